"""The request path, top to bottom. Each step is one call; see ARCHITECTURE.md."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from proxy import accesslog, steps
from proxy.appkeys import BACKGROUND, KEYS, PRICES, RUNS, SETTINGS, STORE, TEL, UPSTREAM
from proxy.ceilings import admit, limits_for
from proxy.config import Policy
from proxy.errors import ProxyError
from proxy.guard import guard
from proxy.model import Call, Caller, Rewrite
from proxy.outputs import retry_request
from proxy.providers.base import ProviderAdapter
from proxy.relay import Flow, Hooks, relay
from proxy.routes import Target, target_for
from proxy.tenants import identify
from proxy.upstream import request_headers
from tracing import spans

__all__ = ["handle_call"]


async def handle_call(request: web.Request, adapter: ProviderAdapter, upstream_name: str | None) -> web.StreamResponse:
    app, settings = request.app, request.app[SETTINGS]
    caller = identify(request.headers, request.query, settings, app[KEYS])
    raw, body, call = await steps.read_call(request, adapter, settings.max_body_bytes)
    target = target_for(settings, adapter, caller, upstream_name)
    policy = settings.policy_for(caller.tenant)
    parent = spans.parse_traceparent(request.headers.get("traceparent"))
    run = await app[RUNS].begin(caller, parent)
    await app[BACKGROUND].settled((caller.tenant, caller.run_id))  # the run's previous call is recorded
    closed = await app[RUNS].close_tools(caller, call, run, parent,
                                         capture=policy.capture_content != "NO_CONTENT")
    fwd = Forward(request, adapter, caller, call, target, policy, parent, run)
    response, hooks = await fwd.send(raw, body, closed)
    if hooks.retry_feedback is None:
        return response
    # repair.on_invalid=retry: ask once more, the problems fed back; it counts as a call.
    retry_body = retry_request(adapter.api, body, hooks.retry_output, hooks.retry_feedback)
    response, _ = await fwd.send(orjson.dumps(retry_body), retry_body, [], retry=True)
    return response


@dataclass(frozen=True, slots=True)
class Forward:
    """Admission, upstream and relay for one model call of a request."""

    request: web.Request
    adapter: ProviderAdapter
    caller: Caller
    call: Call
    target: Target
    policy: Policy
    parent: spans.TraceParent | None
    run: spans.RunTrace

    async def send(self, raw: bytes, body: dict[str, Any], closed: list[Any],
                   retry: bool = False) -> tuple[web.StreamResponse, Hooks]:
        request, adapter, caller, call, policy = self.request, self.adapter, self.caller, self.call, self.policy
        app = request.app
        hooks = Hooks(rewrites=[Rewrite("repair_retry", "schema")] if retry else [])
        cs = spans.start_call(app[TEL], caller, call, provider=self.target.provider, parent=self.parent,
                              server_address=self.target.server_address, server_port=self.target.server_port,
                              run_trace=self.run)
        try:
            await guard(app[STORE], app[TEL], caller, call, policy.guard, closed, body, hooks, cs)
            limits = limits_for(policy, request.headers, *await steps.budgets(app, caller.tenant, policy))
            admitted = await admit(app[STORE], app[PRICES], caller, call, limits, tz=app[SETTINGS].timezone)
        except ProxyError as exc:
            await steps.refused(app, caller, call, cs, exc)
            raise
        except asyncio.CancelledError:
            steps.abandoned(app, call, cs)  # the client left before the call was forwarded
            raise
        hooks.rewrites += adapter.prepare(body, call) + list(admitted.rewrites)
        if admitted.clamp_to is not None:
            adapter.set_max_tokens(body, admitted.clamp_to)
        out = orjson.dumps(body) if hooks.rewrites else raw  # unchanged requests go byte for byte
        steps.response_hooks(adapter, call, policy, hooks, retry=retry)
        flow = Flow()
        started = time.perf_counter()
        try:
            async with app[UPSTREAM].send(steps.upstream_url(self.target, request), out,
                                          request_headers(request.headers, self.target.auth)) as upstream:
                extra = {"x-spanmeter-run-id": caller.run_id}
                return await relay(request, upstream, adapter, extra, hooks, flow, started), hooks
        except ProxyError as exc:
            accesslog.answered(exc.status, flow.status)  # before flow.status takes exc.status
            flow.observer.feed([steps.stream_error(exc)])
            flow.status = flow.status or exc.status
            raise
        finally:
            flow.delivered_ns = time.time_ns()
            # A task of its own: the answer does not wait for the ledger, and a client that
            # disconnects cancels the relay, never the settlement.
            app[BACKGROUND].spawn((caller.tenant, caller.run_id), steps.finish_safely(
                app, caller, call, admitted, cs, flow, hooks, request.headers, policy, body))
