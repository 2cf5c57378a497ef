"""The MCP route: /mcp/{name}, Streamable HTTP relayed to a configured MCP server.

    request -> routes.match (the path as sent) -> the configured server (404 lists them)
      -> tenants.identify (the spanmeter key; the run from X-Run-Id, traceparent or _meta)
      -> POST: one JSON-RPC message (mcp/wire.py). A request gets a span; a
         tools/call is admitted first (Store.admit_tool: counted, its cost reserved,
         the model tool call it executes marked, the loop guard's streak) or refused
         with a JSON-RPC error saying which limit and how to raise it. Any other
         request goes through the same admission only to draw on the tenant's and the
         key's requests-per-minute limits, or to fix the run's trace ids when neither
         this process nor a traceparent gives them
      -> upstream.send with the server's own credential (never the caller's key)
      -> relay: a JSON answer whole, an SSE answer event by event as each completes;
         GET streams and DELETE pass through as they come
      -> the span, then (off the answer's path) the settlement: ONE store operation.

Headers the protocol needs (`Mcp-Session-Id`, `MCP-Protocol-Version`, `Mcp-Method`,
`Last-Event-ID`, `Accept`) pass both ways; credentials, cookies and trace headers do
not go upstream (proxy/serve/upstream.py). Request bodies go byte for byte.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

import orjson
from aiohttp import web

from proxy.config import KeyPolicy, McpServer, Policy, Settings
from proxy.errors import (
    CeilingReached,
    ConfigError,
    LoopRefused,
    ProxyError,
    Refusal,
    UnknownRoute,
    UpstreamConnectError,
    UpstreamRedirect,
)
from proxy.govern import guard
from proxy.govern.ceilings import plan
from proxy.ledger.store import Admission, Ask, Limits, Rate, ToolTurn
from proxy.mcp import wire
from proxy.model import Caller, Rewrite
from proxy.providers.sse import Framer, SseEvent
from proxy.serve.appkeys import BACKGROUND, KEYS, RUNS, SETTINGS, STORE, TEL, UPSTREAM
from proxy.serve.body import read_body
from proxy.serve.routes import match
from proxy.serve.tenants import identify
from proxy.serve.upstream import UpstreamResponse, host_port, request_headers, response_headers
from tracing import mcp as mcp_spans
from tracing.digests import canonical_sha256
from tracing.spans import Lineage, RunTrace, SpanRef, TraceParent, parse_traceparent

__all__ = ["MCP_PREFIX", "handle_mcp"]

log = logging.getLogger("spanmeter.mcp")
MCP_PREFIX = "/mcp"


async def handle_mcp(request: web.Request) -> web.StreamResponse:
    """Serve one HTTP request of the MCP route; every spanmeter error is a JSON-RPC error."""
    arrived_ns = time.time_ns()
    request_id: wire.RequestId | None = None
    try:
        settings = request.app[SETTINGS]
        route = match(request.raw_path.partition("?")[0])
        name = route.mcp or ""
        # Who asks first: the names of the configured servers are no business of a stranger's.
        caller = identify(request.headers, request.query, settings, request.app[KEYS])
        server = _server(settings, name)
        raw = b""
        if request.method == "POST":
            raw = await read_body(request, settings.max_body_bytes)
            msg = wire.parse(raw)
            request_id = msg.id
            if msg.kind == "request":
                return await _Call(request, _with_meta_run(caller, msg), name, server, msg, raw, arrived_ns).run()
        elif request.method not in ("GET", "DELETE"):
            raise UnknownRoute(f"spanmeter serves POST, GET and DELETE on /mcp/{name}, not {request.method[:20]}.")
        return await _pass(request, server, caller, raw)
    except ProxyError as exc:
        return _error(exc, request_id)


def _server(settings: Settings, name: str) -> McpServer:
    server = settings.mcp_servers.get(name)
    if server is None:
        raise UnknownRoute(f"No MCP server named {name[:64]!r} is configured. Check the name in the URL "
                           "(/mcp/NAME) against mcp_servers in spanmeter's config, or ask its operator.")
    return server


def _with_meta_run(caller: Caller, msg: wire.Message) -> Caller:
    """The run named by the trace in `params._meta` when the headers named none."""
    if caller.run_id_source != "generated":
        return caller
    parent = parse_traceparent(msg.meta("traceparent"))
    return replace(caller, run_id=parent.trace_id_hex, run_id_source="traceparent") if parent else caller


def _auth(settings: Settings, server: McpServer, caller: Caller) -> dict[str, str]:
    """The server's own credential; in open mode without one, the caller's own key."""
    if server.key_env:
        key = os.environ.get(server.key_env)
        if key is None:
            raise ConfigError(f"The MCP server's credential is read from the environment variable {server.key_env}, "
                              "which is not set in the proxy's environment. Set it and restart spanmeter.")
        return {"Authorization": f"Bearer {key}"} if key else {}
    if settings.open_mode and caller.upstream_key:
        return {"Authorization": f"Bearer {caller.upstream_key}"}
    return {}


def _error(exc: ProxyError, request_id: wire.RequestId | None) -> web.Response:
    headers = {**exc.headers(), "Content-Type": "application/json"}
    return web.Response(body=wire.error_body(request_id, exc), status=wire.error_status(exc), headers=headers)


async def _pass(request: web.Request, server: McpServer, caller: Caller, raw: bytes) -> web.StreamResponse:
    """A notification, a response to the server, a GET stream or a DELETE: relayed as it
    comes, byte for byte (a GET stream may stay open for the session's life)."""
    app = request.app
    headers = request_headers(request.headers, _auth(app[SETTINGS], server, caller))
    async with app[UPSTREAM].send(server.url, raw, headers, method=request.method) as up:
        resp = web.StreamResponse(status=up.status, headers=response_headers(up.headers))
        await resp.prepare(request)
        try:
            async for chunk in up.chunks():
                await resp.write(chunk)
        except ProxyError:
            log.warning("MCP server %s broke off a %s stream", server.url, request.method)
        await resp.write_eof()
        return resp


@dataclass
class _Seen:
    """What the relay learnt of the answer; owned by the call so a cancelled relay loses nothing."""

    request_id: wire.RequestId
    note: str | None = None  # the loop guard's reminder, added to a tools/call result
    status: int = 0
    session: str | None = None  # the session the server named in its answer (to initialize)
    answer: wire.Answer | None = None
    error: ProxyError | None = None
    cancelled: bool = False
    reminded: int = 0  # the streak the loop guard's reminder was added for
    rewrites: list[Rewrite] = field(default_factory=list)

    def message(self, data: Any) -> bytes | None:
        """Look at one message of the answer; the bytes to send instead, if any."""
        answer = wire.read_answer(data, self.request_id)
        if answer is None or self.answer is not None:
            return None
        self.answer = answer
        if self.note is not None and answer.result is not None:
            return wire.with_note(data, self.note)
        return None

    def event(self, event: SseEvent) -> bytes:
        if not event.data or '"id"' not in event.data:
            return event.raw  # a priming event, or a notification: nothing to read
        try:
            replaced = self.message(event.json())
        except orjson.JSONDecodeError:
            return event.raw
        return event.raw if replaced is None else wire.sse_event(event.raw, replaced)

    def outcome(self, refusal: ProxyError | None) -> mcp_spans.McpOutcome:
        exc = refusal or self.error
        a = self.answer
        return mcp_spans.McpOutcome(
            status=self.status, result=a.result_text() if a else None, is_error=bool(a and a.is_error),
            rpc_code=a.code if a else None, rpc_message=a.message if a else "",
            error_type="client_disconnected" if self.cancelled else exc.error_type if exc else None,
            error_message=exc.message if exc else "", refusal=_reason(refusal) if refusal else None,
            reminded=self.reminded, rewrites=[r.header_value() for r in self.rewrites])


@dataclass
class _Call:
    """One JSON-RPC request of a POST: admission (tools/call), relay, span, settlement."""

    request: web.Request
    caller: Caller
    name: str
    server: McpServer
    msg: wire.Message
    raw: bytes
    arrived_ns: int

    async def run(self) -> web.StreamResponse:
        app, msg = self.request.app, self.msg
        policy = app[SETTINGS].policy_for(self.caller.tenant)
        parent = parse_traceparent(self.request.headers.get("traceparent")) or parse_traceparent(
            msg.meta("traceparent"), msg.meta("tracestate"))
        assert msg.id is not None
        seen = _Seen(msg.id)
        admission: Admission | None = None
        refusal: ProxyError | None = None
        entry: dict[str, Any] = {}
        run_trace = app[RUNS].known(self.caller)
        settings = app[SETTINGS]
        key = settings.key_policy(self.caller.tenant, self.caller.key_id)
        try:
            planned = plan(policy, self.request.headers, key, self.caller.key_id)
            rates = tuple(Rate(owner, "requests", limit, 1) for owner, unit, limit in planned.rates
                          if unit == "requests")
            if msg.tool is not None or rates or (parent is None and run_trace is None):
                try:
                    admission = await self._admit(policy, key, planned.limits, rates, parent)
                except Refusal as exc:
                    refusal, entry = exc, (exc.closed[0] if exc.closed else {})
                    run_trace = app[RUNS].trace(self.caller, exc.trace, parent)
                    self._book_refusal(exc, entry)
                    raise
                entry = admission.closed[0] if admission.closed else {}
                run_trace = app[RUNS].trace(self.caller, admission.trace, parent)
            seen.note = self._reminder(policy, entry, seen)
            return await self._forward(seen)
        except asyncio.CancelledError:
            seen.cancelled = True
            raise
        except ProxyError as exc:
            if refusal is None and seen.error is None:
                seen.error = exc  # e.g. an invalid X-Run-Max-Cost-Usd, or the ledger unreachable
            raise
        finally:
            self._span(seen, refusal, entry, parent, run_trace, policy)
            if admission is not None and admission.id:
                app[BACKGROUND].spawn((self.caller.tenant, self.caller.run_id), self._settle(admission, entry, seen))

    async def _admit(self, policy: Policy, key: KeyPolicy | None, limits: Limits, rates: tuple[Rate, ...],
                     parent: TraceParent | None) -> Admission:
        app, msg, caller = self.request.app, self.msg, self.caller
        await app[BACKGROUND].wait_ordered((caller.tenant, caller.run_id))  # the model call's tool calls are stored
        turn = ToolTurn(trace=app[RUNS].candidate(caller, parent, self.arrived_ns), key=caller.key_id, rates=rates)
        if msg.tool is not None:
            turn = replace(turn, name=msg.tool, sig=f"{msg.tool}:{canonical_sha256(msg.arguments)}",
                           cost=round(self.server.tool_costs.get(msg.tool, 0.0) * 1_000_000),
                           max_calls=_tighter(policy.runs.max_tool_calls, key.runs.max_tool_calls if key else None),
                           guard=guard.rule(policy.guard))
        settings = app[SETTINGS]
        ask = Ask(caller.tenant, caller.run_id, datetime.now(UTC), limits, tz=settings.timezone)
        return await app[STORE].admit_tool(ask, turn)

    def _reminder(self, policy: Policy, entry: dict[str, Any], seen: _Seen) -> str | None:
        """From the threshold on, the loop guard's reminder goes into the tool's result."""
        streak = int(entry.get("streak", 0))
        if self.msg.tool is None or policy.guard.action != "remind" or streak < (
                policy.guard.threshold or guard.DEFAULT_THRESHOLD):
            return None
        seen.rewrites.append(Rewrite("loop_reminder", f"{self.msg.tool}x{streak}"))
        seen.reminded = streak
        return guard.reminder(self.msg.tool, streak)

    async def _forward(self, seen: _Seen) -> web.StreamResponse:
        app, request = self.request.app, self.request
        headers = request_headers(request.headers, _auth(app[SETTINGS], self.server, self.caller))
        try:
            async with app[UPSTREAM].send(self.server.url, self.raw, headers, method="POST") as up:
                seen.status, seen.session = up.status, up.headers.get(wire.SESSION_HEADER)
                return await _relay(request, up, seen, self.caller)
        except ProxyError as exc:
            seen.error = exc
            raise

    def _span(self, seen: _Seen, refusal: ProxyError | None, entry: dict[str, Any], parent: TraceParent | None,
              run_trace: RunTrace | None, policy: Policy) -> None:
        msg, (address, port) = self.msg, host_port(self.server.url)
        req = mcp_spans.McpRequest(
            server=self.name, method=msg.method or "", request_id=str(msg.id), server_address=address,
            server_port=port, session_id=self.request.headers.get(wire.SESSION_HEADER) or seen.session,
            protocol_version=self.request.headers.get(wire.PROTOCOL_HEADER), tool=msg.tool,
            arguments=msg.arguments if msg.tool is not None else None, prompt=msg.prompt,
            resource_uri=msg.resource_uri)
        link = entry.get("link")
        mcp_spans.record_request(self.request.app[TEL], mcp_spans.McpRecord(
            self.caller, req, seen.outcome(refusal), self.arrived_ns, time.time_ns(), Lineage(parent, run_trace),
            call_id=str(entry["id"]) if "id" in entry else None,
            link=SpanRef(int(link[0]), int(link[1])) if link else None,
            capture=policy.capture_content != "NO_CONTENT"))

    def _book_refusal(self, exc: Refusal, entry: dict[str, Any]) -> None:
        """A refused tool call: a ceiling hit, and a failed tool call when a model made it."""
        totals = {"ceilings_hit": 1 if isinstance(exc, CeilingReached) else 0,
                  "tool_failures": 1 if "id" in entry else 0}
        if any(totals.values()):
            store, caller = self.request.app[STORE], self.caller
            self.request.app[BACKGROUND].spawn((caller.tenant, caller.run_id), _safely(
                store.run_add(caller.tenant, caller.run_id, {k: v for k, v in totals.items() if v})))

    async def _settle(self, admission: Admission, entry: dict[str, Any], seen: _Seen) -> None:
        """The tool's cost unless the server is known not to have run it; the run's failed
        tool calls by the server's own verdict. One store operation."""
        answer = seen.answer
        amount = admission.reserved if _maybe_ran(seen) else 0
        failed = answer is None or answer.failed or seen.status >= 400
        try:
            await self.request.app[STORE].settle(admission, amount, run_totals={
                "tool_failures": 1 if failed else 0, "cost_micros": amount})
        except ProxyError:
            log.error("could not settle MCP tool call of run %s; its reservation stands", admission.run_id)
        except Exception:
            log.exception("settling an MCP tool call failed")


async def _relay(request: web.Request, up: UpstreamResponse, seen: _Seen, caller: Caller) -> web.StreamResponse:
    headers = response_headers(up.headers)
    headers["x-spanmeter-run-id"] = caller.run_id
    if seen.note is not None:
        headers["x-spanmeter-rewrites"] = ", ".join(r.header_value() for r in seen.rewrites)
    if not up.is_sse:
        # One JSON-RPC message: the protocol does not stream it, so it is read whole.
        body = await up.read()
        try:
            replaced = seen.message(orjson.loads(body))
        except orjson.JSONDecodeError:
            replaced = None
        return web.Response(body=body if replaced is None else replaced, status=up.status, headers=headers)
    resp = web.StreamResponse(status=up.status, headers=headers)
    await resp.prepare(request)
    framer = Framer()
    try:
        async for chunk in up.chunks():
            out = b"".join(seen.event(e) for e in framer.feed(chunk))
            if out:
                await resp.write(out)
        tail = framer.flush()
        if tail is not None:
            await resp.write(seen.event(tail))
    except ProxyError as exc:
        seen.error = exc
        if seen.answer is None:  # the status line is gone: the error is the request's last event
            await resp.write(wire.error_event(seen.request_id, exc))
    await resp.write_eof()
    return resp


def _maybe_ran(seen: _Seen) -> bool:
    """Whether the server may have run the tool. Only its own word that it did not (a
    JSON-RPC error, an error status, a redirect) or a connection never made proves it; a
    request sent whose answer was never read (the client left, `read_timeout_s` cut it, a
    body that is not JSON, an answer to another id) may well have run a paid tool:
    unknown is not zero, as on the model route."""
    if seen.answer is not None:
        return seen.answer.code is None and seen.status < 400
    return seen.status < 300 and not isinstance(seen.error, UpstreamConnectError | UpstreamRedirect)


def _tighter(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else min(a, b)


def _reason(exc: ProxyError) -> str:
    """The refusal's metric label: which ceiling, or the loop guard."""
    if isinstance(exc, LoopRefused):
        return "loop_guard"
    return exc.limit if isinstance(exc, CeilingReached) else exc.code


async def _safely(work: Awaitable[None]) -> None:
    try:
        await work
    except Exception:
        log.warning("could not record the totals of a refused MCP tool call", exc_info=True)
