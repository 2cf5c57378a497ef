"""The request path, top to bottom. Each step is one call; see docs/request-path.md.

A call's facts are decided once and handed on, not left on a shared object: the capture
decision and the route in `Forward`, the turn's facts in the admission's `Candidate`, the
repair driver's retry in its returned `Verdict`, everything the bookkeeping reads in one
`CallState`."""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from proxy.config import KeyPolicy, Policy
from proxy.errors import ProxyError, Refusal
from proxy.govern import caching, guard, wrapup
from proxy.govern.ceilings import Candidate, admit
from proxy.govern.outputs import Retry, response_hooks
from proxy.govern.runs import results_ok
from proxy.model import Call, Caller, Rewrite, frozen
from proxy.providers.hooks import Hooks
from proxy.providers.translator import Api, Translator
from proxy.serve import accesslog, bookkeeping
from proxy.serve.appkeys import (
    AWS_SIGNER,
    CLOUD_TOKEN,
    DEPLOYMENTS,
    KEYS,
    PLANS,
    PREFIXES,
    PRICES,
    RUNS,
    SETTINGS,
    STORE,
    TEL,
    UPSTREAM,
)
from proxy.serve.body import open_call
from proxy.serve.cloud_token import authorized
from proxy.serve.deployments import unmapped_hint
from proxy.serve.pipeline import admission_turn
from proxy.serve.relay import relay
from proxy.serve.routes import Target, target_for
from proxy.serve.state import CallState, captures
from proxy.serve.tenants import identify, presented_key
from proxy.serve.upstream import forward_url, request_headers
from tracing import spans

__all__ = ["handle_call"]

# The most bytes a max-token clamp adds after admission (`,"max_completion_tokens":2147483647`).
CLAMP_BYTES = 64


async def handle_call(request: web.Request, api: Api, upstream_name: str | None) -> web.StreamResponse:
    app, settings = request.app, request.app[SETTINGS]
    arrived = time.time_ns()
    caller = identify(request.headers, request.query, settings, app[KEYS])
    accesslog.identified(caller.tenant, caller.run_id)
    tr = await open_call(request, api, settings.max_body_bytes)
    target = target_for(settings, api, caller, upstream_name, _route_path(request))
    target = await authorized(target, app[CLOUD_TOKEN])  # its token, if the machine's own credentials give it
    if target.aws is not None:  # signed by spanmeter (Bedrock): its credentials, loaded before admission
        await app[AWS_SIGNER].ready(target.aws)
    policy = settings.policy_for(caller.tenant)
    parent = spans.parse_traceparent(request.headers.get("traceparent"))
    await admission_turn(app, caller)  # the run's previous settle is ordered
    fwd = Forward(request, caller, target, policy, parent, arrived, settings.key_policy(caller.tenant, caller.key_id),
                  deployment=tr.call.model if api.names_deployment else None,
                  capture=captures(app[TEL].config.capture_content, policy))
    results = results_ok(app[RUNS].unsent(caller, tr.call.tool_results))
    response, again = await fwd.send(tr, Closes(results, app[RUNS].candidate(caller, parent, arrived)))
    if again is None:
        return response
    # repair.on_invalid=retry: ask once more, the problems fed back; it counts as a call.
    response, _ = await fwd.send(tr.retry(again.output, again.feedback), NO_CLOSES, retry=True)
    return response


@frozen
class Closes:
    """What a request's first call closes in the ledger: its tool results (call id, ok) and
    the run's trace ids to keep if the run has none. A retry closes nothing."""

    results: tuple[tuple[str, bool], ...] = ()
    trace: dict[str, str] | None = None


NO_CLOSES = Closes()


@frozen
class Forward:
    """Admission, upstream and relay for one model call of a request."""

    request: web.Request
    caller: Caller
    target: Target
    policy: Policy
    parent: spans.TraceParent | None
    arrived_ns: int
    key: KeyPolicy | None = None  # the caller's key's own limits
    deployment: str | None = None  # the Azure deployment the call names, priced as the model it runs
    capture: bool = False  # its content is captured (state.captures), decided once for the request

    async def send(self, tr: Translator, closes: Closes, retry: bool = False,
                   ) -> tuple[web.StreamResponse, Retry | None]:
        request, caller, policy, ex = self.request, self.caller, self.policy, tr.request
        app = request.app
        hooks = Hooks(rewrites=[Rewrite("repair_retry", "schema")] if retry else [])
        # Patches that need no ledger go first: what they add is input the reservation covers.
        reminded = guard.remind(ex, policy.guard)
        hooks.rewrites += ex.prepare()
        # Cache breakpoints change the call's cache-write premium: the call is read after them.
        hooks.rewrites += caching.add(ex, policy.prompt_cache, caller, self.target.server_address, app[PREFIXES],
                                      time.monotonic())
        call = ex.call
        grown = len(ex.request_bytes()) - call.body_bytes if reminded or hooks.rewrites else 0
        priced_as, hint = self._pricing(app)
        try:
            candidate = Candidate(caller, call, app[PLANS].plan(caller.tenant, policy, request.headers, self.key,
                                                                caller.key_id),
                                  closes.results, None if retry else guard.rule(policy.guard), closes.trace,
                                  patch_bytes=CLAMP_BYTES + grown, priced_as=priced_as, price_hint=hint,
                                  provider=self.target.provider,
                                  solo=caller.run_id_source == "generated" and not retry)
            admitted = await admit(app[STORE], app[PRICES], candidate, tz=app[SETTINGS].timezone)
            app[RUNS].admitted(caller, closes.results)
        except ProxyError as exc:
            closed, stored = (exc.closed, exc.trace) if isinstance(exc, Refusal) else ((), None)
            cs = self._start(call, closed, stored)
            bookkeeping.refused(app, call, cs, exc)
            raise
        except asyncio.CancelledError:
            bookkeeping.abandoned(app, call, self._start(call, (), None))  # the client left before it was forwarded
            raise
        cs = self._start(call, admitted.admission.closed, admitted.admission.trace)
        notes, left = wrapup.apply(ex, admitted, app[TEL], caller, cs)  # what is left, and the note if due
        hooks.rewrites += guard.record(reminded, app[TEL], caller, cs) + notes + list(admitted.rewrites)
        if admitted.clamp_to is not None:
            ex.clamp(admitted.clamp_to)
        answer = tr.answer(hooks)
        verdict = response_hooks(answer, policy, retry=retry)
        started = time.perf_counter()
        try:
            url, body = _upstream_url(self.target, request), ex.request_bytes()
            headers = request_headers(request.headers, self.target.auth)
            if self.target.aws is not None:  # the exact URL and bytes sent, after every patch
                headers = app[AWS_SIGNER].sign(self.target.aws, url, body, headers)
            async with app[UPSTREAM].send(url, body, headers) as upstream:
                extra = {"x-spanmeter-run-id": caller.run_id, **left}
                return await relay(request, upstream, answer, extra, started), verdict.retry()
        except ProxyError as exc:
            accesslog.answered(exc.status, answer.status)  # before the answer's status takes exc.status
            answer.failed(exc)
            raise
        finally:
            answer.delivered_ns = time.time_ns()
            hooks.let_go()
            # Off the answer's path: the answer does not wait for the ledger, and a client that
            # disconnects cancels the relay, never the settlement (a callback, not a task).
            bookkeeping.answered(CallState(request, tr, admitted, answer, cs, self.capture, self.deployment))

    def _pricing(self, app: web.Application) -> tuple[str | None, str]:
        """(model to price at, refusal hint) for a call naming an Azure deployment: the
        model the deployment runs, or what to set when that is not known yet."""
        if self.deployment is None:
            return None, ""
        model = app[DEPLOYMENTS].model(self.deployment)
        return (model, "") if model else (None, unmapped_hint(self.deployment))

    def _start(self, call: Call, closed: tuple[dict[str, object], ...], stored: dict[str, object] | None,
               ) -> spans.CallSpan:
        """The run's trace, the spans of the tool calls this request closed, and the call's span."""
        app, caller = self.request.app, self.caller
        lineage = spans.Lineage(self.parent, app[RUNS].trace(caller, stored, self.parent))
        app[RUNS].close_tools(caller, call, closed, lineage, self.arrived_ns, capture=self.capture)
        peer = spans.Peer(self.target.provider, self.target.server_address, self.target.server_port)
        return spans.start_call(app[TEL], caller, call, peer, lineage, start_ns=self.arrived_ns)


def _route_path(request: web.Request) -> str:
    """The path as it goes upstream (routes.match's, prefix removed, as sent)."""
    path = request.match_info.get("tail")
    return "/" + path if path is not None else request.path


def _upstream_url(target: Target, request: web.Request) -> str:
    path = _route_path(request)
    # The query as sent (still percent-encoded): decoding it would turn %26 into a separator
    # and %23 into a fragment on the way out.
    query = request.rel_url.raw_query_string
    # The caller's key matters only to strip it from a query (parsing one costs on every call).
    return forward_url(target.base_url, path, query, presented_key(request.headers, request.query) if query else None)
