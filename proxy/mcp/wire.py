"""MCP over Streamable HTTP, the wire format of /mcp/{name}. Pure: no I/O, no clock.

Everything spanmeter knows about MCP's wire is here; the route (proxy/mcp/route.py)
only moves bytes and keeps books. What it reads:

- a POST carries one JSON-RPC message (MCP removed batches in protocol 2025-06-18):
  a request (`id` + `method`), a notification (`method`, no `id`) or a response to a
  request of the server (`id` + `result`/`error`);
- a request's target: the tool of `tools/call` (and its `arguments`), the prompt of
  `prompts/get`, the resource of `resources/*`; trace context in `params._meta`
  (`traceparent`, `tracestate`, as the SDKs inject it);
- the answer: one JSON message (`application/json`), or an SSE stream
  (`text/event-stream`) of `event: message` events, each one JSON-RPC message: the
  server's notifications and requests first, the response to the request last.
  `Mcp-Session-Id` and `MCP-Protocol-Version` ride in headers, as do the 2026 era's
  `Mcp-Method` / `Mcp-Name`, which must match the body (spanmeter never changes a
  request body).

A tools/call result is `{"content": [blocks], "isError": bool, "structuredContent"?}`;
`isError: true` is a tool failure the model should see, a JSON-RPC `error` a failure of
the call itself (unknown tool, invalid arguments).

`Reader` is the route's answer reader for the shared relay (proxy/serve/relay.py
`Relayed`), as a model API's `Answer` is for a model call.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import field
from typing import Any, Final, Literal

import orjson

from proxy.errors import CeilingReached, LoopRefused, MalformedBody, ProxyError, RateLimited, Refusal, RequestError
from proxy.model import Rewrite, frozen
from proxy.providers.hooks import Hooks
from proxy.providers.sse import Framer, SseEvent

__all__ = [
    "CEILING_REACHED",
    "LOOP_REFUSED",
    "PROTOCOL_HEADER",
    "RATE_LIMITED",
    "SESSION_HEADER",
    "Answer",
    "Message",
    "Reader",
    "error_body",
    "error_code",
    "error_event",
    "error_status",
    "parse",
    "read_answer",
    "sse_event",
    "with_note",
]

SESSION_HEADER: Final = "mcp-session-id"
PROTOCOL_HEADER: Final = "mcp-protocol-version"

# JSON-RPC 2.0 codes. spanmeter's own refusals take codes from the implementation-defined
# server range (-32000..-32099) that neither the spec nor the MCP SDKs use.
PARSE_ERROR: Final = -32700
INVALID_REQUEST: Final = -32600
INTERNAL_ERROR: Final = -32603
CEILING_REACHED: Final = -32050  # a run or tenant ceiling (tool calls, cost)
LOOP_REFUSED: Final = -32051  # the loop guard: the same tool call again and again
RATE_LIMITED: Final = -32052  # a requests-per-minute limit of the tenant or the key

Kind = Literal["request", "notification", "response"]
RequestId = str | int


@frozen
class Message:
    """One JSON-RPC message a client sent."""

    kind: Kind
    id: RequestId | None = None
    method: str | None = None
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def tool(self) -> str | None:
        """The tool a `tools/call` calls."""
        return _str(self.params.get("name")) if self.method == "tools/call" else None

    @property
    def prompt(self) -> str | None:
        return _str(self.params.get("name")) if self.method == "prompts/get" else None

    @property
    def resource_uri(self) -> str | None:
        return _str(self.params.get("uri")) if (self.method or "").startswith("resources/") else None

    @property
    def target(self) -> str | None:
        """What the span name adds to the method (semconv: `{mcp.method.name} {target}`)."""
        return self.tool or self.prompt

    @property
    def arguments(self) -> str:
        """A tools/call's arguments as JSON text (`{}` when absent), for digests and hashes."""
        args = self.params.get("arguments")
        return json.dumps(args if args is not None else {}, ensure_ascii=False)

    def meta(self, key: str) -> str | None:
        """A string of `params._meta`, e.g. the `traceparent` an SDK injected."""
        meta = self.params.get("_meta")
        return _str(meta.get(key)) if isinstance(meta, dict) else None


def parse(raw: bytes) -> Message:
    """The one JSON-RPC message of a POST body. Refuses what the server might read
    differently (not JSON, not a JSON-RPC message) and batches: a message spanmeter
    cannot read is one it cannot meter."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise MalformedBody(f"The body is not JSON ({exc}). Send one JSON-RPC 2.0 message per POST.") from None
    if isinstance(data, list):
        raise RequestError(
            "spanmeter relays one JSON-RPC message per POST; batches (removed from MCP in protocol "
            "2025-06-18) are not relayed. Send each message in its own POST.")
    if not isinstance(data, dict) or data.get("jsonrpc") != "2.0":
        raise MalformedBody('The body is not a JSON-RPC 2.0 message (an object with "jsonrpc": "2.0").')
    method, rid, params = data.get("method"), data.get("id"), data.get("params")
    if rid is not None and (isinstance(rid, bool) or not isinstance(rid, str | int)):
        raise MalformedBody("A JSON-RPC id is a string or an integer.")
    if params is not None and not isinstance(params, dict):
        raise MalformedBody("MCP params are an object.")
    if method == "tools/call" and rid is None:
        raise RequestError(
            'A "tools/call" without an "id" is a notification: the server would run the tool and answer '
            "nothing, so spanmeter could neither meter it nor return its result. spanmeter does not relay it; "
            'send the tools/call as a request, with an "id".', param="id")
    if isinstance(method, str):
        return Message("request" if rid is not None else "notification", rid, method, params or {})
    if method is None and rid is not None and ("result" in data or "error" in data):
        return Message("response", rid)
    raise MalformedBody("The body is neither a JSON-RPC request, notification nor response.")


@frozen
class Answer:
    """The server's response to one request."""

    result: dict[str, Any] | None = None
    code: int | None = None  # JSON-RPC error code, when the server answered with an error
    message: str = ""

    @property
    def is_error(self) -> bool:
        """A tool result the server flagged as a failure (`isError: true`)."""
        return self.result is not None and self.result.get("isError") is True

    @property
    def failed(self) -> bool:
        return self.code is not None or self.is_error

    def result_text(self) -> str | None:
        """A tools/call result as the digests read it (content blocks and the error flag)."""
        if self.result is None:
            return None
        return json.dumps({"content": self.result.get("content", []), "isError": self.is_error}, ensure_ascii=False)


def read_answer(data: Any, request_id: RequestId) -> Answer | None:
    """`data` (one parsed message) as the answer to `request_id`, or None when it is
    something else (a notification, a server request, another request's response)."""
    if not isinstance(data, dict) or "method" in data or not _same_id(data.get("id"), request_id):
        return None
    result, error = data.get("result"), data.get("error")
    if isinstance(error, dict):
        code = error.get("code")
        return Answer(code=code if isinstance(code, int) and not isinstance(code, bool) else INTERNAL_ERROR,
                      message=_str(error.get("message")) or "")
    return Answer(result=result if isinstance(result, dict) else {})


class Reader:
    """The answer to one request as the relay reads it: the one message that answers
    `request_id`, found in a JSON body or among the SSE events, with `note` (the loop
    guard's reminder) added to a tools/call result. What it learnt stays here, so a relay
    cancelled half-way loses nothing. JSON-RPC answers failures in the body whatever the
    HTTP status: it is relayed with `errors_inside`."""

    __slots__ = ("answer", "chunk_gaps_s", "complete", "error", "first_chunk_s", "hooks", "note", "request_id",
                 "status")

    def __init__(self, request_id: RequestId, note: str | None = None, rewrites: tuple[Rewrite, ...] = ()) -> None:
        self.request_id = request_id
        self.note = note
        self.hooks = Hooks(rewrites=list(rewrites))  # the relay announces them in x-spanmeter-rewrites
        self.status = 0
        self.complete = False
        self.first_chunk_s: float | None = None
        self.chunk_gaps_s: list[float] = []
        self.answer: Answer | None = None
        self.error: ProxyError | None = None  # the answer broke off, or never came

    def read_headers(self, headers: Mapping[str, str]) -> None:
        """MCP's answers say nothing in their headers that the reader needs."""

    def body(self, raw: bytes) -> bytes:
        """One JSON-RPC message, read whole (the protocol does not stream it): what to send."""
        try:
            replaced = self._message(orjson.loads(raw))
        except orjson.JSONDecodeError:
            return raw
        return raw if replaced is None else replaced

    def stream(self) -> _EventStream:
        return _EventStream(self)

    def cut(self, exc: ProxyError) -> bytes:
        """The stream broke off: once its status line went, the error is the request's last
        event, unless the answer came already."""
        self.error = exc
        return b"" if self.answer is not None else error_event(self.request_id, exc)

    def event(self, event: SseEvent) -> bytes:
        """One SSE event: as it came, or re-framed when the note went into it."""
        if not event.data or '"id"' not in event.data:
            return event.raw  # a priming event, or a notification: nothing to read
        try:
            replaced = self._message(event.json())
        except orjson.JSONDecodeError:
            return event.raw
        return event.raw if replaced is None else sse_event(event.raw, replaced)

    def _message(self, data: Any) -> bytes | None:
        """Look at one message of the answer; the bytes to send instead, if any."""
        answer = read_answer(data, self.request_id)
        if answer is None or self.answer is not None:
            return None
        self.answer = answer
        if self.note is not None and answer.result is not None:
            return with_note(data, self.note)
        return None


class _EventStream:
    """An SSE answer, event by event as each completes (relay.Feed)."""

    __slots__ = ("_framer", "_reader")

    def __init__(self, reader: Reader) -> None:
        self._reader, self._framer = reader, Framer()

    def feed(self, chunk: bytes) -> bytes:
        return b"".join(self._reader.event(e) for e in self._framer.feed(chunk))

    def flush(self) -> bytes:
        tail = self._framer.flush()
        return b"" if tail is None else self._reader.event(tail)

    def release(self) -> bytes:
        return b""  # nothing is held back: a partial event at a cut is dropped


def with_note(data: dict[str, Any], note: str) -> bytes:
    """A tools/call response with `note` as its first text block, for the model to read."""
    result = dict(data.get("result") or {})
    content = result.get("content")
    result["content"] = [{"type": "text", "text": note}, *(content if isinstance(content, list) else [])]
    return orjson.dumps({**data, "result": result})


def sse_event(raw: bytes, data: bytes) -> bytes:
    """The SSE event `raw` with `data` as its one data line; its other fields (`event`,
    `id`, `retry`) and line ending kept as they were."""
    ending = b"\r\n" if b"\r\n" in raw else b"\n"
    kept = [line for line in raw.splitlines() if line and not line.startswith(b"data:")]
    return ending.join([*kept, b"data: " + data]) + ending + ending


def error_code(exc: ProxyError) -> int:
    if isinstance(exc, CeilingReached):
        return CEILING_REACHED
    if isinstance(exc, LoopRefused):
        return LOOP_REFUSED
    if isinstance(exc, RateLimited):
        return RATE_LIMITED
    if isinstance(exc, MalformedBody):
        return PARSE_ERROR
    return INVALID_REQUEST if isinstance(exc, RequestError) else INTERNAL_ERROR


def error_status(exc: ProxyError) -> int:
    """HTTP status of a spanmeter error on this route. A refusal answers a well-formed
    request, so it is a JSON-RPC error with 200, as MCP servers answer theirs: every MCP
    client surfaces it to the agent (a non-2xx status reads as a broken transport to
    older SDKs, which drop the message). Transport-level problems keep their status."""
    return 200 if isinstance(exc, Refusal) else exc.status


def error_body(request_id: RequestId | None, exc: ProxyError) -> bytes:
    data: dict[str, Any] = {"type": exc.error_type}
    if isinstance(exc, CeilingReached | RateLimited):
        data["limit"] = exc.limit
    return orjson.dumps({"jsonrpc": "2.0", "id": request_id,
                         "error": {"code": error_code(exc), "message": exc.message, "data": data}})


def error_event(request_id: RequestId, exc: ProxyError) -> bytes:
    """The error as the last event of an SSE answer whose status line is already sent."""
    return b"event: message\ndata: " + error_body(request_id, exc) + b"\n\n"


def _same_id(got: Any, want: RequestId) -> bool:
    # "1" and 1 are different ids; so are 1 and true.
    return type(got) is type(want) and got == want


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None
