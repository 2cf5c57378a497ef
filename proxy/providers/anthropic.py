"""Anthropic Messages: `POST /v1/messages` (also `?beta=true`), streaming and not.

Usage: `message_start` carries the input side, `message_delta` the cumulative output
(newer API versions repeat the input side there too). Anthropic's `input_tokens`
excludes cached tokens, so gen_ai input = input + cache_read + cache_creation
(semconv anthropic.md v1.41.1). Tool calls are `tool_use` content blocks whose input
streams as `input_json_delta` fragments; results are `tool_result` blocks with `is_error`.
"""

from __future__ import annotations

from typing import Any, Final

import orjson

from proxy.errors import (
    BodyTimeout,
    BodyTooLarge,
    LoopRefused,
    ProxyError,
    RateLimited,
    Refusal,
    RequestError,
    Unauthorized,
    UnknownRoute,
    UpstreamTimeout,
)
from proxy.model import (
    NO_BYTE_FACTS,
    ByteFacts,
    Call,
    Finish,
    InputPart,
    MetaEvent,
    Outcome,
    OutputSpec,
    Rewrite,
    StreamError,
    StreamEvent,
    TextDelta,
    ToolCallDelta,
    ToolResult,
    ToolSpec,
    Usage,
    UsageEvent,
)
from proxy.providers.answer import (
    ArgumentSlot,
    EventRewrite,
    Json,
    Slot,
    StreamEdits,
    answer_and_feedback,
    append_turns,
    dicts,
)
from proxy.providers.anthropic_cache import anthropic_breakpoints
from proxy.providers.anthropic_stream import AnthropicStreamRepair
from proxy.providers.base import (
    MAX_TOKENS_LIMIT,
    Exchange,
    History,
    HistoryCall,
    TextShape,
    count_field,
    joined_results,
    number,
    text_of,
    vocabulary,
)
from proxy.providers.base import integer as _int
from proxy.providers.base import string as _str
from proxy.providers.cache import CacheScope
from proxy.providers.parts import Messages, call_part, response_part, text_part
from proxy.providers.sizes import json_size, size_of
from proxy.providers.sse import SseEvent
from proxy.providers.translator import Opens

__all__ = ["ANTHROPIC", "AnthropicAdapter", "anthropic_error_body", "anthropic_usage"]


def anthropic_usage(u: Any) -> Usage:
    if not isinstance(u, dict):
        return Usage()
    raw_input = _int(u.get("input_tokens"))
    read = _int(u.get("cache_read_input_tokens"))
    created = _int(u.get("cache_creation_input_tokens"))
    # cache_creation splits the writes by lifetime; 1-hour writes bill at 2x input, not 1.25x.
    by_ttl = u.get("cache_creation")
    written_1h = _int(by_ttl.get("ephemeral_1h_input_tokens")) if isinstance(by_ttl, dict) else None
    return Usage(
        input_tokens=None if raw_input is None else raw_input + (read or 0) + (created or 0),
        output_tokens=_int(u.get("output_tokens")),
        cache_read_tokens=read,
        cache_write_tokens=created,
        cache_write_1h_tokens=written_1h,
        service_tier=_str(u.get("service_tier")),
        inference_geo=_str(u.get("inference_geo")),
    )


def _tools(raw: Any) -> tuple[ToolSpec, ...]:
    out = []
    for t in raw if isinstance(raw, list) else ():
        if isinstance(t, dict) and isinstance(t.get("name"), str):
            # Server tools (web_search, code_execution, ...) have a type and no input_schema.
            schema = t.get("input_schema")
            out.append(ToolSpec(t["name"], _str(t.get("description")),
                                schema if isinstance(schema, dict) else None))
    return tuple(out)


def _format_spec(fmt: Any) -> OutputSpec | None:
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        schema = fmt.get("schema")
        # Anthropic structured outputs are constrained decoding: always strict.
        return OutputSpec("json_schema", schema if isinstance(schema, dict) else None, strict=True)
    return None


def _output(body: dict[str, Any], tools: tuple[ToolSpec, ...]) -> OutputSpec | None:
    config = body.get("output_config")
    spec = _format_spec(config.get("format") if isinstance(config, dict) else None)
    # `output_format` is the older beta form (anthropic-beta: structured-outputs-2025-11-13).
    spec = spec or _format_spec(body.get("output_format"))
    if spec:
        return spec
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "tool":
        tool = next((t for t in tools if t.name == choice.get("name")), None)
        if tool is not None:
            return OutputSpec("tool", tool.parameters, tool.name)
    return None


def _blocks(content: Any) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return [b for b in content if isinstance(b, dict)] if isinstance(content, list) else []


def _tool_results(messages: list[Any]) -> tuple[ToolResult, ...]:
    # Every result, joined by id (joined_results): an agent framework that loads tools on
    # demand writes its own tool_use turn and result after the model's, so the model's
    # call may be answered before the last turn that used tools. Those after that turn
    # are the new ones. Names come from the tool_use blocks: tool_result carries only the id.
    results: list[ToolResult] = []
    names: dict[str, str] = {}
    new_from = 0
    for m in messages:
        if not isinstance(m, dict):
            continue
        if m.get("role") == "assistant":
            used = {str(b.get("id")): str(b.get("name")) for b in _blocks(m.get("content"))
                    if b.get("type") == "tool_use"}
            if used:
                names |= used
                new_from = len(results)
            continue
        for b in _blocks(m.get("content")):
            if b.get("type") == "tool_result" and isinstance(b.get("tool_use_id"), str):
                content = b.get("content")
                text = content if isinstance(content, str) else text_of(content)
                results.append(ToolResult(b["tool_use_id"], text, names.get(b["tool_use_id"]),
                                          b.get("is_error") is True))
    return joined_results(results, new_from)


def _input_parts(body: dict[str, Any]) -> list[InputPart]:
    """In Anthropic's prompt order (tools, system, messages; its cache prefix follows it):
    each tool definition, the system prompt, then each message's blocks, tool_result
    blocks as results, the rest as earlier conversation up to the model's last turn and as
    this turn's new content after it."""
    parts = [("tools", json_size(t), _str(t.get("name")) or _str(t.get("type")) or "", "")
             for t in body.get("tools") or () if isinstance(t, dict)]
    if body.get("system"):
        parts.append(("system", size_of(body["system"]), "", ""))
    messages = body.get("messages")
    messages = messages if isinstance(messages, list) else []
    last = max((i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "assistant"),
               default=-1)
    names: dict[str, str] = {}
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            continue
        kind = "history" if i <= last else "new"
        size = 0
        for b in _blocks(m.get("content")):
            if b.get("type") == "tool_result":
                cid = _str(b.get("tool_use_id")) or ""
                parts.append(("tool_result", size_of(b.get("content")), names.get(cid, ""), cid))
            elif b.get("type") == "tool_use":
                name = _str(b.get("name")) or ""
                names[_str(b.get("id")) or ""] = name
                size += len(name) + json_size(b.get("input"))
            else:
                size += size_of([b])
        if size or not m.get("content"):
            parts.append((kind, size, "", ""))
    return parts


def _history(messages: list[Any]) -> list[HistoryCall]:
    h = History()
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(m, dict) and m.get("role") == "assistant":
            h.turn()
        for j, b in enumerate(content if isinstance(content, list) else ()):
            if not isinstance(b, dict):
                continue
            if m.get("role") == "assistant" and b.get("type") == "tool_use" and isinstance(b.get("id"), str):
                # As the response's tool call reads (_content_events): the input as JSON text.
                h.call(b["id"], str(b.get("name") or ""), orjson.dumps(b.get("input") or {}).decode())
            elif b.get("type") == "tool_result" and isinstance(b.get("tool_use_id"), str):
                h.result(b["tool_use_id"], ("messages", i, "content", j, "content"))
    return h.calls()


def _content_events(content: Any) -> list[StreamEvent]:
    events: list[StreamEvent] = []
    for i, block in enumerate(_blocks(content)):
        if block.get("type") == "text":
            events.append(TextDelta(str(block.get("text") or "")))
        elif block.get("type") == "tool_use":
            args = orjson.dumps(block.get("input") or {}).decode()
            events.append(ToolCallDelta(i, _str(block.get("id")), _str(block.get("name")), args,
                                        complete=True))
    return events


def _error(err: Any) -> StreamError:
    err = err if isinstance(err, dict) else {}
    return StreamError(str(err.get("type") or "error"), str(err.get("message") or ""))


def _block_start(index: int, block: Any) -> list[StreamEvent]:
    if not isinstance(block, dict):
        return []
    if block.get("type") == "tool_use":
        # The input streams as input_json_delta; a non-empty input here is complete.
        given = block.get("input")
        args = orjson.dumps(given).decode() if given else ""
        return [ToolCallDelta(index, _str(block.get("id")), _str(block.get("name")), args)]
    if block.get("type") == "text" and block.get("text"):
        return [TextDelta(str(block["text"]))]
    return []


def _block_delta(index: int, delta: Any) -> list[StreamEvent]:
    if not isinstance(delta, dict):
        return []
    if delta.get("type") == "text_delta" and isinstance(delta.get("text"), str):
        return [TextDelta(delta["text"])]
    if delta.get("type") == "input_json_delta" and isinstance(delta.get("partial_json"), str):
        return [ToolCallDelta(index, arguments=delta["partial_json"])]
    return []


def _part(block: Json) -> Json | None:
    kind = block.get("type")
    if kind == "text":
        return text_part(block.get("text", ""))
    if kind == "tool_use":
        return call_part(block.get("id"), block.get("name"), block.get("input"))
    if kind == "tool_result":
        return response_part(block.get("tool_use_id"), text_of(block.get("content")))
    return None


def _input_messages(body: Json) -> Messages:
    out = []
    for m in body.get("messages") or ():
        if isinstance(m, dict):
            parts = [p for b in _blocks(m.get("content")) if (p := _part(b)) is not None]
            out.append({"role": m.get("role"), "parts": parts})
    return text_of(body.get("system")), out


# spanmeter's errors in Anthropic's `error.type` words (the SDK raises by status; the type is shown).
_ANTHROPIC_TYPES: Final[dict[type[ProxyError], str]] = {
    ProxyError: "api_error",
    RequestError: "invalid_request_error",
    Unauthorized: "authentication_error",
    BodyTimeout: "timeout_error",
    UnknownRoute: "not_found_error",
    BodyTooLarge: "request_too_large",
    Refusal: "billing_error",
    LoopRefused: "invalid_request_error",
    RateLimited: "rate_limit_error",
    UpstreamTimeout: "timeout_error",
}


def anthropic_error_type(error: ProxyError) -> str:
    return vocabulary(error, _ANTHROPIC_TYPES)


def anthropic_error_body(error: ProxyError, request_id: str) -> bytes:
    return orjson.dumps({"type": "error",
                         "error": {"type": anthropic_error_type(error), "message": error.message},
                         "request_id": request_id})


def _plain_delta(event: SseEvent) -> bool:
    """A text_delta of a content_block_delta event: what AnthropicStreamRepair passes."""
    data = event.json()
    delta = data.get("delta")
    return (data.get("type") == "content_block_delta" and event.event in (None, "content_block_delta")
            and isinstance(delta, dict) and delta.get("type") == "text_delta")


class AnthropicAdapter(Opens):
    api = "messages"
    conversation: str | None = "messages"
    family = "anthropic"
    provider = "anthropic"
    upstream_setting = "anthropic_base_url"
    names_deployment = False
    text_part = "text"
    cache_marker: str | None = "cache_control"
    text_shape: TextShape | None = TextShape(b'"text":', _plain_delta)

    def parse_request(self, body: dict[str, Any], path: str, facts: ByteFacts = NO_BYTE_FACTS) -> Call:
        tools = _tools(body.get("tools"))
        messages = body.get("messages")
        stop = body.get("stop_sequences")
        return Call(
            api="messages",
            body_bytes=facts.body_bytes,
            cache_write=facts.cache_write,
            operation="chat",
            model=self.model_of(body, path),
            stream=body.get("stream") is True,
            max_output_tokens=count_field("max_tokens", body.get("max_tokens"), upper=MAX_TOKENS_LIMIT,
                                          what="the most tokens the answer may have, thinking included"),
            max_tokens_field="max_tokens",
            tools=tools,
            tool_results=_tool_results(messages) if isinstance(messages, list) else (),
            output=_output(body, tools),
            temperature=number(body.get("temperature")),
            top_p=number(body.get("top_p")),
            top_k=number(body.get("top_k")),
            stop_sequences=tuple(s for s in stop if isinstance(s, str))
            if isinstance(stop, list) else (),
        )

    def model_of(self, body: dict[str, Any], path: str) -> str | None:
        """The model the upstream runs: the body's `model` here; a route that names the
        model in its path (Anthropic on Vertex AI, proxy/providers/vertex.py) reads it there."""
        return _str(body.get("model"))

    def prepare(self, ex: Exchange) -> list[Rewrite]:
        return []  # usage always streams in message_start / message_delta

    def set_max_tokens(self, ex: Exchange, value: int) -> None:
        ex.splicer.set_top("max_tokens", value)

    def tool_result_slots(self, body: dict[str, Any], call_id: str) -> list[tuple[dict[str, Any], str]]:
        return [(block, "content") for m in body.get("messages") or () if isinstance(m, dict)
                for block in _blocks(m.get("content"))
                if block.get("type") == "tool_result" and block.get("tool_use_id") == call_id]

    def append_note(self, ex: Exchange, text: str) -> bool:
        """Roles must alternate: a text block at the end of the last turn when it is the
        user's (after its tool results, as the API requires), else a new user turn."""
        messages = ex.body.get("messages")
        if not isinstance(messages, list):
            return False
        block = {"type": "text", "text": text}
        last = messages[-1] if messages else None
        if not (isinstance(last, dict) and last.get("role") == "user"):
            return ex.splicer.append_item(("messages",), {"role": "user", "content": [block]})
        content = last.get("content")
        if isinstance(content, list):
            return ex.splicer.append_item(("messages", -1, "content"), block)
        if isinstance(content, str):  # its text block keeps the string's bytes as they came
            note = orjson.dumps(block).decode()
            return ex.splicer.replace_value(("messages", -1, "content"), [{"type": "text", "text": content}, block],
                                    lambda old: '[{"type":"text","text":' + old + "}," + note + "]")
        return False

    def tool_history(self, body: dict[str, Any]) -> list[HistoryCall]:
        messages = body.get("messages")
        return _history(messages if isinstance(messages, list) else [])

    def input_parts(self, body: dict[str, Any]) -> list[InputPart]:
        return _input_parts(body)

    def stored_sizes(self, call: Call, outcome: Outcome) -> dict[str, int]:
        return {}  # no context is stored by this API

    def parse_response(self, body: Any) -> list[StreamEvent]:
        if not isinstance(body, dict):
            return []
        if body.get("type") == "error":
            return [_error(body.get("error"))]
        events: list[StreamEvent] = [MetaEvent(_str(body.get("id")), _str(body.get("model")))]
        events += _content_events(body.get("content"))
        if isinstance(body.get("stop_reason"), str):
            events.append(Finish(body["stop_reason"]))
        if isinstance(body.get("usage"), dict):
            events.append(UsageEvent(anthropic_usage(body["usage"])))
        return events

    def parse_event(self, event: SseEvent) -> list[StreamEvent]:
        if not event.data:
            return []
        data = event.json()
        if not isinstance(data, dict):
            return []
        kind = data.get("type") or event.event
        index = _int(data.get("index")) or 0
        if kind == "message_start" and isinstance(data.get("message"), dict):
            msg = data["message"]
            return [MetaEvent(_str(msg.get("id")), _str(msg.get("model"))),
                    UsageEvent(anthropic_usage(msg.get("usage")))]
        if kind == "content_block_start":
            return _block_start(index, data.get("content_block"))
        if kind == "content_block_delta":
            return _block_delta(index, data.get("delta"))
        if kind == "message_delta":
            events: list[StreamEvent] = []
            delta = data.get("delta")
            if isinstance(delta, dict) and isinstance(delta.get("stop_reason"), str):
                events.append(Finish(delta["stop_reason"]))
            if isinstance(data.get("usage"), dict):
                events.append(UsageEvent(anthropic_usage(data["usage"])))
            return events
        if kind == "error":
            return [_error(data.get("error"))]
        return []  # ping, content_block_stop, message_stop, and what we do not know

    def text_slots(self, body: Json) -> list[Slot]:
        return [Slot(b, "text") for b in dicts(body.get("content"))
                if b.get("type") == "text" and isinstance(b.get("text"), str)]

    def argument_slots(self, body: Json) -> list[ArgumentSlot]:
        return [ArgumentSlot(b, "input", str(b.get("id")), b.get("name"))
                for b in dicts(body.get("content")) if b.get("type") == "tool_use"]

    def stream_rewriter(self, edits: StreamEdits) -> EventRewrite | None:
        return AnthropicStreamRepair(edits)

    def retry_body(self, body: Json, answer: str, feedback: str) -> Json:
        return append_turns(body, "messages", *answer_and_feedback(answer, feedback))

    def input_messages(self, body: Json) -> Messages:
        return _input_messages(body)

    def render_error(self, error: ProxyError, request_id: str) -> bytes:
        return anthropic_error_body(error, request_id)

    def render_stream_error(self, error: ProxyError) -> bytes:
        # The SDK skips events without an event name: the `event:` line is required.
        payload = {"type": "error",
                   "error": {"type": anthropic_error_type(error), "message": error.message}}
        return b"event: error\ndata: " + orjson.dumps(payload) + b"\n\n"

    def cache_points(self, ex: Exchange, scope: CacheScope) -> list[Rewrite]:
        return anthropic_breakpoints(ex, scope.caller, scope.memory, scope.now)

    def auth_headers(self, key: str) -> dict[str, str]:
        return {"x-api-key": key}


ANTHROPIC = AnthropicAdapter()
