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
      -> serve/relay.py through wire.Reader: a JSON answer whole, an SSE answer event
         by event as each completes; GET streams and DELETE pass through as they come
      -> the span, then (off the answer's path) the settlement: ONE store operation.

The skeleton is the model route's (proxy/serve/pipeline.py): the same upstream client,
relay and background order, and a refusal named in the same words
(proxy.model.RefusalReason) on its span and in `spanmeter.limit.rejections`.

Headers the protocol needs (`Mcp-Session-Id`, `MCP-Protocol-Version`, `Mcp-Method`,
`Last-Event-ID`, `Accept`) pass both ways; credentials, cookies and trace headers do
not go upstream (proxy/serve/upstream.py). Request bodies go byte for byte.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from aiohttp import web

from proxy.config import KeyPolicy, McpServer, Policy, Settings
from proxy.errors import (
    ConfigError,
    ProxyError,
    Refusal,
    UnknownRoute,
    UpstreamConnectError,
    UpstreamRedirect,
)
from proxy.govern import guard
from proxy.ledger.store import Admission, Ask, Limits, Rate, ToolTurn
from proxy.mcp import wire
from proxy.model import Caller, Rewrite
from proxy.serve.appkeys import KEYS, PLANS, RUNS, SETTINGS, STORE, TEL, UPSTREAM
from proxy.serve.body import read_body
from proxy.serve.pipeline import add_run_totals, admission_turn, after_answer, refusal_reason, refusal_totals
from proxy.serve.relay import relay
from proxy.serve.routes import match
from proxy.serve.tenants import identify
from proxy.serve.upstream import host_port, request_headers, response_headers
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
class _Books:
    """What the route learnt of one request beside its answer: its admission or refusal,
    the model tool call it executes (`entry`), its run's trace; kept by the call so a
    cancelled relay loses nothing."""

    run_trace: RunTrace | None
    admission: Admission | None = None
    refusal: ProxyError | None = None
    entry: dict[str, Any] = field(default_factory=dict)
    session: str | None = None  # the session the server named in its answer (to initialize)
    reminded: int = 0  # the streak the loop guard's reminder was added for
    cancelled: bool = False


def _outcome(reader: wire.Reader, books: _Books) -> mcp_spans.McpOutcome:
    refusal, a = books.refusal, reader.answer
    exc = refusal or reader.error
    return mcp_spans.McpOutcome(
        status=reader.status, result=a.result_text() if a else None, is_error=bool(a and a.is_error),
        rpc_code=a.code if a else None, rpc_message=a.message if a else "",
        error_type="client_disconnected" if books.cancelled else exc.error_type if exc else None,
        error_message=exc.message if exc else "", refusal=refusal_reason(refusal) if refusal else None,
        reminded=books.reminded, rewrites=[r.header_value() for r in reader.hooks.rewrites])


@dataclass
class _Call:
    """One JSON-RPC request of a POST, on the shared skeleton (proxy/serve/pipeline.py):
    admit (a tools/call; any request under a rate limit), forward, relay through the wire
    format's reader, span, settle off the answer's path."""

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
        books = _Books(app[RUNS].known(self.caller))
        reader = wire.Reader(msg.id)
        try:
            await self._admission(policy, parent, books)
            self._remind(policy, books, reader)
            return await self._forward(reader, books)
        except asyncio.CancelledError:
            books.cancelled = True
            raise
        except ProxyError as exc:
            if books.refusal is None and reader.error is None:
                reader.error = exc  # e.g. the server's credential is not set
            raise
        finally:
            self._span(reader, books, parent, policy)
            if books.admission is not None and books.admission.id:
                after_answer(app, self.caller, self._settle(books.admission, reader))

    async def _admission(self, policy: Policy, parent: TraceParent | None, books: _Books) -> None:
        """Admit the request when it needs it: a tools/call always; any request to draw on a
        requests-per-minute limit, or to fix the run's trace ids when neither this process
        nor a traceparent gives them. Whatever stops it here is a refusal, as on the model
        route: counted under its reason, and raised."""
        app, caller = self.request.app, self.caller
        try:
            key = app[SETTINGS].key_policy(caller.tenant, caller.key_id)
            planned = app[PLANS].plan(caller.tenant, policy, self.request.headers, key, caller.key_id)
            rates = tuple(Rate(owner, "requests", limit, 1) for owner, unit, limit in planned.rates
                          if unit == "requests")
            if self.msg.tool is None and not rates and (parent is not None or books.run_trace is not None):
                return
            await admission_turn(app, caller)  # the model call's tool calls are stored
            books.admission = await self._admit(policy, key, planned.limits, rates, parent)
        except ProxyError as exc:
            books.refusal = exc
            if isinstance(exc, Refusal):  # the ledger closed the call's model tool call and fixed the trace ids
                books.entry = exc.closed[0] if exc.closed else {}
                books.run_trace = app[RUNS].trace(caller, exc.trace, parent)
            # A refused tool call a model made is a failed tool call of its run.
            totals = refusal_totals(exc, 1 if "id" in books.entry else 0)
            if totals:
                after_answer(app, caller, add_run_totals(app[STORE], caller, totals))
            raise
        books.entry = books.admission.closed[0] if books.admission.closed else {}
        books.run_trace = app[RUNS].trace(caller, books.admission.trace, parent)

    async def _admit(self, policy: Policy, key: KeyPolicy | None, limits: Limits, rates: tuple[Rate, ...],
                     parent: TraceParent | None) -> Admission:
        app, msg, caller = self.request.app, self.msg, self.caller
        turn = ToolTurn(trace=app[RUNS].candidate(caller, parent, self.arrived_ns), key=caller.key_id, rates=rates)
        if msg.tool is not None:
            turn = replace(turn, name=msg.tool, sig=f"{msg.tool}:{canonical_sha256(msg.arguments)}",
                           cost=round(self.server.tool_costs.get(msg.tool, 0.0) * 1_000_000),
                           max_calls=_tighter(policy.runs.max_tool_calls, key.runs.max_tool_calls if key else None),
                           guard=guard.rule(policy.guard))
        settings = app[SETTINGS]
        ask = Ask(caller.tenant, caller.run_id, datetime.now(UTC), limits, tz=settings.timezone)
        return await app[STORE].admit_tool(ask, turn)

    def _remind(self, policy: Policy, books: _Books, reader: wire.Reader) -> None:
        """From the threshold on, the loop guard's reminder goes into the tool's result."""
        streak = int(books.entry.get("streak", 0))
        if self.msg.tool is None or policy.guard.action != "remind" or streak < (
                policy.guard.threshold or guard.DEFAULT_THRESHOLD):
            return
        reader.hooks.rewrites.append(Rewrite("loop_reminder", f"{self.msg.tool}x{streak}"))
        reader.note = guard.reminder(self.msg.tool, streak)
        books.reminded = streak

    async def _forward(self, reader: wire.Reader, books: _Books) -> web.StreamResponse:
        app, request = self.request.app, self.request
        headers = request_headers(request.headers, _auth(app[SETTINGS], self.server, self.caller))
        try:
            async with app[UPSTREAM].send(self.server.url, self.raw, headers, method="POST") as up:
                books.session = up.headers.get(wire.SESSION_HEADER)
                return await relay(request, up, reader, {"x-spanmeter-run-id": self.caller.run_id},
                                   time.perf_counter(), errors_inside=True)
        except ProxyError as exc:
            reader.error = exc
            raise

    def _span(self, reader: wire.Reader, books: _Books, parent: TraceParent | None, policy: Policy) -> None:
        msg, (address, port) = self.msg, host_port(self.server.url)
        req = mcp_spans.McpRequest(
            server=self.name, method=msg.method or "", request_id=str(msg.id), server_address=address,
            server_port=port, session_id=self.request.headers.get(wire.SESSION_HEADER) or books.session,
            protocol_version=self.request.headers.get(wire.PROTOCOL_HEADER), tool=msg.tool,
            arguments=msg.arguments if msg.tool is not None else None, prompt=msg.prompt,
            resource_uri=msg.resource_uri)
        entry = books.entry
        link = entry.get("link")
        mcp_spans.record_request(self.request.app[TEL], mcp_spans.McpRecord(
            self.caller, req, _outcome(reader, books), self.arrived_ns, time.time_ns(),
            Lineage(parent, books.run_trace), call_id=str(entry["id"]) if "id" in entry else None,
            link=SpanRef(int(link[0]), int(link[1])) if link else None,
            capture=policy.capture_content != "NO_CONTENT"))

    async def _settle(self, admission: Admission, reader: wire.Reader) -> None:
        """The tool's cost unless the server is known not to have run it; the run's failed
        tool calls by the server's own verdict. One store operation."""
        answer = reader.answer
        amount = admission.reserved if _maybe_ran(reader) else 0
        failed = answer is None or answer.failed or reader.status >= 400
        try:
            await self.request.app[STORE].settle(admission, amount, run_totals={
                "tool_failures": 1 if failed else 0, "cost_micros": amount})
        except ProxyError:
            log.error("could not settle MCP tool call of run %s; its reservation stands", admission.run_id)
        except Exception:
            log.exception("settling an MCP tool call failed")


def _maybe_ran(reader: wire.Reader) -> bool:
    """Whether the server may have run the tool. Only its own word that it did not (a
    JSON-RPC error, an error status, a redirect) or a connection never made proves it; a
    request sent whose answer was never read (the client left, `read_timeout_s` cut it, a
    body that is not JSON, an answer to another id) may well have run a paid tool:
    unknown is not zero, as on the model route."""
    if reader.answer is not None:
        return reader.answer.code is None and reader.status < 400
    return reader.status < 300 and not isinstance(reader.error, UpstreamConnectError | UpstreamRedirect)


def _tighter(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else min(a, b)
