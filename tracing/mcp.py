"""Spans and metrics for requests on the MCP route (semconv v1.41.1 mcp.md).

Every JSON-RPC request a client sends through /mcp/{name} becomes one CLIENT span named
`{mcp.method.name} {target}` (`tools/call get_weather`, `prompts/get greet`, `tools/list`),
timed at the proxy from the request's arrival to the last byte of its answer.

A `tools/call` is a tool execution (`gen_ai.operation.name=execute_tool`), observed rather
than inferred (`spanmeter.tool.timing=observed`), with the same digests as the inferred
`execute_tool` spans (tracing/digests.py). When it executes a tool call a model made
through the proxy, it carries that call's `gen_ai.tool.call.id` and links to the chat span
that made it, and it *replaces* the inferred span: proxy/govern/runs.py emits none for a call an
MCP span tells (semconv-genai: one call, one execute_tool span). Its tool metrics
(`gen_ai.execute_tool.duration`, `spanmeter.tool.calls`) are recorded here, once, with the
measured duration.

Failures: a result with `isError: true` is `error.type=tool_error`; a JSON-RPC error is
`error.type` = `rpc.response.status_code` = its code (`-32602`); spanmeter's refusals and
upstream failures their `spanmeter.*` type. `mcp.session.id` is a hash of the session id:
whoever holds a session id can use the session.

Like tracing/spans.py, nothing here raises into the request path.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence

from opentelemetry.context import Context
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode
from opentelemetry.util.types import AttributeValue

from proxy.model import Caller, RefusalReason, frozen
from tracing import attributes as A
from tracing import digests
from tracing.setup import Telemetry
from tracing.spans import (
    NO_LINEAGE,
    Lineage,
    SpanRef,
    _cap_bytes,
    _name,
    _parent_span,
    _present,
    _redact,
    _status_text,
    _text,
    count_refusal,
    record_guard_action,
)

__all__ = ["McpOutcome", "McpRecord", "McpRequest", "record_request", "session_hash"]

log = logging.getLogger(__name__)
Attrs = dict[str, AttributeValue]
_METHOD_NOT_FOUND = -32601


@frozen
class McpRequest:
    """What the proxy read of one JSON-RPC request on the MCP route."""

    server: str  # the configured name: /mcp/{server}
    method: str
    request_id: str
    server_address: str
    server_port: int
    session_id: str | None = None  # as sent; recorded hashed
    protocol_version: str | None = None
    tool: str | None = None  # tools/call
    arguments: str | None = None  # tools/call, JSON text
    prompt: str | None = None  # prompts/get
    resource_uri: str | None = None  # resources/*


@frozen
class McpOutcome:
    """How the request ended."""

    status: int = 0  # HTTP status of the answer; 0 when none came
    result: str | None = None  # a tools/call result as digests read it (Answer.result_text)
    is_error: bool = False  # the server flagged the tool result `isError`
    rpc_code: int | None = None  # the server answered with this JSON-RPC error
    rpc_message: str = ""
    error_type: str | None = None  # spanmeter's own: a refusal, an upstream failure, cancelled
    error_message: str = ""
    refusal: RefusalReason | None = None  # why spanmeter refused it, in the model calls' words
    reminded: int = 0  # the loop guard added its reminder for this streak of identical calls
    rewrites: Sequence[str] = ()

    @property
    def failure(self) -> str | None:
        """`error.type`, None for a success."""
        if self.error_type:
            return self.error_type
        if self.rpc_code is not None:
            return str(self.rpc_code)
        if self.is_error:
            return A.ERROR_TOOL
        return str(self.status) if self.status >= 400 else None

    @property
    def executed(self) -> bool:
        """The server ran the method (a tool that failed did run; an unknown one did not)."""
        return self.error_type is None and self.status < 400 and self.rpc_code is None


def session_hash(session_id: str) -> str:
    return hashlib.sha256(session_id.encode("utf-8", "surrogatepass")).hexdigest()[:32]


@frozen
class McpRecord:
    """One request on the MCP route once it is over, read by its span and its metrics:
    timed from its arrival (`start_ns`) to the last byte of its answer (`end_ns`).
    `call_id`/`link`: the model tool call it executes and the chat span that made it.
    `capture`: the tenant allows content capture."""

    caller: Caller
    request: McpRequest
    outcome: McpOutcome
    start_ns: int
    end_ns: int
    lineage: Lineage = NO_LINEAGE
    call_id: str | None = None
    link: SpanRef | None = None
    capture: bool = False


def record_request(tel: Telemetry, record: McpRecord) -> None:
    """Emit the request's span and metrics."""
    try:
        caller, req, out, link = record.caller, record.request, record.outcome, record.link
        failure = out.failure
        attrs = _attrs(caller, req, out, failure)
        if req.tool is not None:
            attrs.update(_tool_attrs(tel, caller, req, out, record.call_id, record.capture))
        links = [Link(SpanContext(link.trace_id, link.span_id, is_remote=False))] if link else None
        span = tel.lean.open(
            f"{req.method} {_name(target)}" if (target := req.tool or req.prompt) else _name(req.method),
            _parent_span(record.lineage.parent, record.lineage.run_trace), SpanKind.CLIENT, attrs,
            record.start_ns, links or ())
        if failure:
            why = out.error_message or out.rpc_message or failure
            span.set_status(Status(StatusCode.ERROR, _status_text(why, caller)))
        _record_metrics(tel, record, failure, span.parent_context())
        tel.lean.end(span, record.end_ns)
    except Exception:
        log.exception("record_request failed")


def _attrs(caller: Caller, req: McpRequest, out: McpOutcome, failure: str | None) -> Attrs:
    attrs: dict[str, AttributeValue | None] = {
        A.MCP_METHOD_NAME: _name(req.method),
        A.JSONRPC_REQUEST_ID: _name(req.request_id),
        A.MCP_SESSION_ID: session_hash(req.session_id) if req.session_id else None,
        A.MCP_PROTOCOL_VERSION: _name(req.protocol_version) if req.protocol_version else None,
        A.GEN_AI_PROMPT_NAME: _name(req.prompt) if req.prompt else None,
        A.MCP_RESOURCE_URI: _text(req.resource_uri) if req.resource_uri else None,
        A.NETWORK_TRANSPORT: "tcp",
        A.NETWORK_PROTOCOL_NAME: "http",
        A.SERVER_ADDRESS: req.server_address or None,
        A.SERVER_PORT: req.server_port or None,
        A.SPANMETER_MCP_SERVER: req.server,
        A.SPANMETER_TENANT_ID: caller.tenant,
        A.SPANMETER_RUN_ID: _name(caller.run_id),
        A.SPANMETER_RUN_ID_SOURCE: caller.run_id_source,
        A.ERROR_TYPE: _name(failure) if failure else None,
        A.RPC_RESPONSE_STATUS_CODE: str(out.rpc_code) if out.rpc_code is not None else None,
        A.SPANMETER_REFUSAL_REASON: out.refusal,  # as on a model call's span; the message is the status
        A.SPANMETER_REWRITES: tuple(out.rewrites) if out.rewrites else None,
    }
    if out.reminded:
        attrs.update({A.SPANMETER_GUARD_ACTION: "remind", A.SPANMETER_GUARD_TOOL: _name(req.tool or ""),
                      A.SPANMETER_GUARD_REPEATS: out.reminded})
    return _present(attrs)


def _tool_attrs(tel: Telemetry, caller: Caller, req: McpRequest, out: McpOutcome, call_id: str | None,
                capture: bool) -> Attrs:
    """The execute_tool attributes, digests as on inferred tool spans."""
    arguments = req.arguments or "{}"
    verdict = digests.tool_result_digest(out.result, is_error=out.is_error) if out.result is not None else None
    cap = tel.config.content_cap_bytes if capture and tel.config.capture_content == "SPAN_ONLY" else None
    attrs: dict[str, AttributeValue | None] = {
        A.GEN_AI_OPERATION_NAME: A.OPERATION_EXECUTE_TOOL,
        A.GEN_AI_TOOL_NAME: _name(req.tool or ""),
        A.GEN_AI_TOOL_CALL_ID: _name(call_id) if call_id else None,
        A.SPANMETER_TOOL_TIMING: A.TOOL_TIMING_OBSERVED,
        A.SPANMETER_TOOL_ARGUMENTS_DIGEST: _redact(digests.tool_arguments_digest(arguments), caller),
        A.SPANMETER_TOOL_ARGUMENTS_SHA256: digests.canonical_sha256(arguments),
        A.SPANMETER_TOOL_ARGUMENTS_SIZE: len(arguments.encode()),
        A.SPANMETER_TOOL_OK: out.failure is None,
    }
    if cap is not None:
        attrs[A.GEN_AI_TOOL_CALL_ARGUMENTS] = _cap_bytes(_redact(arguments, caller), cap)
    if out.result is not None and verdict is not None:
        attrs[A.SPANMETER_TOOL_RESULT_DIGEST] = _redact(verdict.digest, caller)
        attrs[A.SPANMETER_TOOL_RESULT_SHA256] = digests.canonical_sha256(out.result)
        attrs[A.SPANMETER_TOOL_RESULT_SIZE] = len(out.result.encode())
        if cap is not None:
            attrs[A.SPANMETER_TOOL_RESULT_PREVIEW] = _redact(verdict.preview, caller)
            if not out.is_error:  # semconv: the result only if execution succeeded
                attrs[A.GEN_AI_TOOL_CALL_RESULT] = _cap_bytes(_redact(out.result, caller), cap)
    return _present(attrs)


def _record_metrics(tel: Telemetry, record: McpRecord, failure: str | None, ctx: Context) -> None:
    caller, req, out = record.caller, record.request, record.outcome
    seconds = max(0, record.end_ns - record.start_ns) / 1e9
    # A label value is minted only by a request the server answered: a refused or hostile
    # request takes values already known, or `_OTHER`.
    m, bounds = tel.instruments, tel.instruments.labels
    admit = out.executed or out.is_error
    labels: Attrs = {
        A.MCP_METHOD_NAME: bounds.mcp_method(req.method, admit=admit or out.rpc_code not in (None, _METHOD_NOT_FOUND)),
        A.SPANMETER_TENANT_ID: caller.tenant,
    }
    if req.server_address:
        labels[A.SERVER_ADDRESS] = req.server_address
        labels[A.SERVER_PORT] = req.server_port
    tool = bounds.tool(req.tool, admit=admit) if req.tool is not None else None
    if tool is not None:
        labels[A.GEN_AI_OPERATION_NAME] = A.OPERATION_EXECUTE_TOOL
        labels[A.GEN_AI_TOOL_NAME] = tool
    error = bounds.error_type(failure, admit=admit)
    timed = {**labels, A.ERROR_TYPE: error} if error else labels
    m.mcp_duration.record(seconds, timed, context=ctx)
    if out.refusal:  # any request refused, a tools/list by a rate limit too, as a model call is counted
        which: Attrs = {A.GEN_AI_OPERATION_NAME: A.OPERATION_EXECUTE_TOOL, A.GEN_AI_TOOL_NAME: tool} if tool else {
            A.MCP_METHOD_NAME: labels[A.MCP_METHOD_NAME]}
        count_refusal(tel, caller, out.refusal, which, ctx)
    if tool is None:
        return
    tool_labels: Attrs = {A.GEN_AI_OPERATION_NAME: A.OPERATION_EXECUTE_TOOL, A.GEN_AI_TOOL_NAME: tool,
                          A.SPANMETER_TENANT_ID: caller.tenant}
    outcome = "refused" if out.refusal else "ok" if failure is None else "failed"
    m.tool_calls.add(1, {**tool_labels, A.SPANMETER_OUTCOME: outcome}, context=ctx)
    if out.refusal:
        if out.refusal == "loop_detected":
            record_guard_action(tel, caller, "refuse", tool_name=req.tool or "", repeats=0)
        return
    m.execute_tool_duration.record(seconds, {**tool_labels, A.ERROR_TYPE: error} if error else tool_labels,
                                   context=ctx)
    if out.reminded:
        record_guard_action(tel, caller, "remind", tool_name=req.tool or "", repeats=out.reminded)
