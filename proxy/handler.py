"""The request path, top to bottom. Each step is one call; see ARCHITECTURE.md."""

from __future__ import annotations

import asyncio
import time

import orjson
from aiohttp import web

from proxy import steps
from proxy.appkeys import KEYS, PRICES, RUNS, SETTINGS, STORE, TEL, UPSTREAM
from proxy.ceilings import admit, limits_for
from proxy.errors import ProxyError
from proxy.guard import guard
from proxy.providers.base import ProviderAdapter
from proxy.relay import Flow, Hooks, relay
from proxy.routes import target_for
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
    closed = await app[RUNS].close_tools(caller, call, run, parent,
                                         capture=policy.capture_content != "NO_CONTENT")
    hooks = Hooks()
    cs = spans.start_call(app[TEL], caller, call, provider=target.provider, server_address=target.server_address,
                          server_port=target.server_port, parent=parent, run_trace=run)
    try:
        await guard(app[STORE], app[TEL], caller, call, policy.guard, closed, body, hooks, cs)
        limits = limits_for(policy, request.headers, *await steps.budgets(app, caller.tenant, policy))
        admitted = await admit(app[STORE], app[PRICES], caller, call, limits, tz=settings.timezone)
    except ProxyError as exc:
        await steps.refused(app, caller, call, cs, exc)
        raise
    hooks.rewrites += adapter.prepare(body, call) + list(admitted.rewrites)
    if admitted.clamp_to is not None:
        adapter.set_max_tokens(body, admitted.clamp_to)
    steps.response_hooks(adapter, call, policy, hooks)
    out = orjson.dumps(body) if hooks.rewrites else raw
    flow = Flow()
    started = time.perf_counter()
    try:
        async with app[UPSTREAM].send(steps.upstream_url(target, request), out,
                                      request_headers(request.headers, target.auth)) as upstream:
            return await relay(request, upstream, adapter, {"x-spanmeter-run-id": caller.run_id}, hooks, flow, started)
    except ProxyError as exc:
        flow.observer.feed([steps.stream_error(exc)])
        flow.status = flow.status or exc.status
        raise
    finally:
        flow.delivered_ns = time.time_ns()
        # Shielded: a client that disconnects cancels the relay, never the settlement.
        await asyncio.shield(steps.finish_safely(app, caller, call, admitted, cs, flow, hooks, request.headers,
                                                 policy, body))
