"""AWS Bedrock Converse: `POST /model/{modelId}/converse` and `/converse-stream`, the fifth
wire format. One body shape for every model Bedrock serves.

- The model is in the path (percent-encoded as the client sent it; an inference profile,
  an ARN: proxy/providers/bedrock.py reads it), never in the body; answers carry no model
  name, so the call is charged as the model the path names.
- `inferenceConfig.maxTokens` is the output bound (reserved, and clamped there).
- Content blocks are objects keyed by their kind: `{"text"}`, `{"toolUse": {toolUseId,
  name, input}}`, `{"toolResult": {toolUseId, content: [{"text"} | {"json"}], status}}`,
  `{"cachePoint": {"type": "default"}}` (a prompt-cache breakpoint: the client's own are
  kept, and spanmeter adds them as proxy/providers/converse_cache.py says), `{"image"}`, ...
  Text blocks have no `type` member: Bedrock refuses members it does not know.
- Usage: `inputTokens` excludes cache reads and writes, so gen_ai input = inputTokens +
  cacheReadInputTokens + cacheWriteInputTokens.
- Streams are AWS event-stream frames (proxy/providers/eventstream.py): `messageStart`,
  `contentBlockStart` (a toolUse's id and name), `contentBlockDelta` (text, or a fragment
  of a toolUse's input as JSON text), `contentBlockStop`, `messageStop` (`stopReason`),
  `metadata` (usage); an `exception` frame ends a failed one.

Pure: no I/O.
"""

from __future__ import annotations

from typing import Any

import orjson

from proxy.errors import ProxyError
from proxy.model import (
    NO_BYTE_FACTS,
    ByteFacts,
    Call,
    Finish,
    InputPart,
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
from proxy.providers.answer import ArgumentSlot, EventRewrite, Json, Slot, StreamEdits, dicts
from proxy.providers.base import (
    MAX_TOKENS_LIMIT,
    Exchange,
    History,
    count_field,
    joined_results,
    number,
)
from proxy.providers.base import integer as _int
from proxy.providers.base import string as _str
from proxy.providers.bedrock_wire import bedrock_auth, bedrock_error_body, bedrock_stream_error, model_of_path
from proxy.providers.cache import CacheScope
from proxy.providers.converse_cache import converse_breakpoints
from proxy.providers.parts import Messages, call_part, response_part, text_part
from proxy.providers.roles import HistoryCall, TextShape
from proxy.providers.sizes import json_size, size_of
from proxy.providers.sse import SseEvent

__all__ = ["CONVERSE", "ConverseFormat", "converse_events", "converse_stream_event", "converse_usage", "result_text"]


def converse_usage(u: Any) -> Usage:
    """Converse's usage (also Nova's on InvokeModel, whose cache members end in `Count`)."""
    if not isinstance(u, dict):
        return Usage()
    raw_input = _int(u.get("inputTokens"))
    read = _int(u.get("cacheReadInputTokens", u.get("cacheReadInputTokenCount")))
    written = _int(u.get("cacheWriteInputTokens", u.get("cacheWriteInputTokenCount")))
    return Usage(
        input_tokens=None if raw_input is None else raw_input + (read or 0) + (written or 0),
        output_tokens=_int(u.get("outputTokens")),
        cache_read_tokens=read,
        cache_write_tokens=written,
    )


def _blocks(content: Any) -> list[Json]:
    return dicts(content)


def result_text(result: Json) -> str:
    """A toolResult's content as text: its text blocks, its JSON blocks serialised."""
    out = []
    for part in _blocks(result.get("content")):
        if isinstance(part.get("text"), str):
            out.append(part["text"])
        elif "json" in part:
            out.append(orjson.dumps(part["json"]).decode())
    return "".join(out)


def _tools(config: Any) -> tuple[ToolSpec, ...]:
    out = []
    for t in _blocks(config.get("tools") if isinstance(config, dict) else None):
        spec = t.get("toolSpec")
        if isinstance(spec, dict) and isinstance(spec.get("name"), str):
            schema = spec.get("inputSchema")
            schema = schema.get("json") if isinstance(schema, dict) else None
            out.append(ToolSpec(spec["name"], _str(spec.get("description")),
                                schema if isinstance(schema, dict) else None))
    return tuple(out)


def _text_format(output_config: Any) -> OutputSpec | None:
    """`outputConfig.textFormat: {type: json_schema, structure: {jsonSchema: {schema, name}}}`:
    the answer's text is JSON of that schema (Bedrock constrains it; `schema` is JSON text,
    an object is read too)."""
    fmt = output_config.get("textFormat") if isinstance(output_config, dict) else None
    structure = fmt.get("structure") if isinstance(fmt, dict) else None
    declared = structure.get("jsonSchema") if isinstance(structure, dict) else None
    if not isinstance(declared, dict):
        return None
    schema = declared.get("schema")
    if isinstance(schema, str):
        try:
            schema = orjson.loads(schema)
        except orjson.JSONDecodeError:
            schema = None
    return OutputSpec("json_schema", schema if isinstance(schema, dict) else None, _str(declared.get("name")),
                      strict=True)


def _output(config: Any, tools: tuple[ToolSpec, ...], output_config: Any = None) -> OutputSpec | None:
    """The declared structured output: `outputConfig.textFormat`'s schema for the text, else a
    tool the request forces (`toolChoice: {tool: {name}}`), whose input is the output."""
    declared = _text_format(output_config)
    if declared is not None:
        return declared
    choice = config.get("toolChoice") if isinstance(config, dict) else None
    forced = choice.get("tool") if isinstance(choice, dict) else None
    if isinstance(forced, dict):
        tool = next((t for t in tools if t.name == forced.get("name")), None)
        if tool is not None:
            return OutputSpec("tool", tool.parameters, tool.name)
    return None


def _tool_results(messages: list[Any]) -> tuple[ToolResult, ...]:
    results: list[ToolResult] = []
    names: dict[str, str] = {}
    new_from = 0
    for m in _blocks(messages):
        blocks = _blocks(m.get("content"))
        if m.get("role") == "assistant":
            used = {str(b["toolUse"].get("toolUseId")): str(b["toolUse"].get("name")) for b in blocks
                    if isinstance(b.get("toolUse"), dict)}
            if used:
                names |= used
                new_from = len(results)
            continue
        for b in blocks:
            r = b.get("toolResult")
            if isinstance(r, dict) and isinstance(r.get("toolUseId"), str):
                results.append(ToolResult(r["toolUseId"], result_text(r), names.get(r["toolUseId"]),
                                          r.get("status") == "error"))
    return joined_results(results, new_from)


def _first_text(result: Json) -> int | None:
    """The index of a toolResult's first text block: where a reminder goes (a string, so no
    block of a shape Bedrock would refuse is added)."""
    return next((k for k, part in enumerate(_blocks(result.get("content"))) if isinstance(part.get("text"), str)),
                None)


def _history(messages: list[Any]) -> list[HistoryCall]:
    h = History()
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            continue
        if m.get("role") == "assistant":
            h.turn()
        content = m.get("content")
        for j, b in enumerate(content if isinstance(content, list) else ()):
            if not isinstance(b, dict):
                continue
            use, result = b.get("toolUse"), b.get("toolResult")
            if m.get("role") == "assistant" and isinstance(use, dict) and isinstance(use.get("toolUseId"), str):
                h.call(use["toolUseId"], str(use.get("name") or ""), orjson.dumps(use.get("input") or {}).decode())
            elif isinstance(result, dict) and isinstance(result.get("toolUseId"), str):
                k = _first_text(result)
                if k is not None:
                    h.result(result["toolUseId"], ("messages", i, "content", j, "toolResult", "content", k, "text"))
    return h.calls()


def converse_events(message: Any) -> list[StreamEvent]:
    """The text and tool calls of an answer's `output.message`."""
    events: list[StreamEvent] = []
    content = message.get("content") if isinstance(message, dict) else None
    for i, block in enumerate(_blocks(content)):
        if isinstance(block.get("text"), str):
            events.append(TextDelta(block["text"]))
        elif isinstance(block.get("toolUse"), dict):
            use = block["toolUse"]
            events.append(ToolCallDelta(i, _str(use.get("toolUseId")), _str(use.get("name")),
                                        orjson.dumps(use.get("input") or {}).decode(), complete=True))
    return events


def converse_stream_event(kind: str | None, data: Any) -> list[StreamEvent]:
    """One Converse stream event (also Nova's InvokeModel chunk, keyed by its kind)."""
    if not isinstance(data, dict):
        return []
    index = _int(data.get("contentBlockIndex")) or 0
    if kind == "contentBlockDelta":
        delta = data.get("delta")
        if not isinstance(delta, dict):
            return []
        if isinstance(delta.get("text"), str):
            return [TextDelta(delta["text"])]
        use = delta.get("toolUse")
        if isinstance(use, dict) and isinstance(use.get("input"), str):
            return [ToolCallDelta(index, arguments=use["input"])]
        return []
    if kind == "contentBlockStart":
        start = data.get("start")
        use = start.get("toolUse") if isinstance(start, dict) else None
        if isinstance(use, dict):
            return [ToolCallDelta(index, _str(use.get("toolUseId")), _str(use.get("name")))]
        return []
    if kind == "messageStop" and isinstance(data.get("stopReason"), str):
        return [Finish(data["stopReason"])]
    if kind == "metadata" and isinstance(data.get("usage"), dict):
        return [UsageEvent(converse_usage(data["usage"]))]
    return []


def _input_parts(body: Json) -> list[InputPart]:
    """In Bedrock's prompt order (tools, system, messages), as Anthropic's module splits its own."""
    config = body.get("toolConfig")
    parts = [("tools", json_size(t), _str((t.get("toolSpec") or {}).get("name")) or "", "")
             for t in _blocks(config.get("tools") if isinstance(config, dict) else None)]
    if body.get("system"):
        parts.append(("system", size_of(body["system"]), "", ""))
    messages = _blocks(body.get("messages"))
    last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=-1)
    names: dict[str, str] = {}
    for i, m in enumerate(messages):
        size = 0
        for b in _blocks(m.get("content")):
            use, result = b.get("toolUse"), b.get("toolResult")
            if isinstance(result, dict):
                cid = _str(result.get("toolUseId")) or ""
                parts.append(("tool_result", len(result_text(result)), names.get(cid, ""), cid))
            elif isinstance(use, dict):
                name = _str(use.get("name")) or ""
                names[_str(use.get("toolUseId")) or ""] = name
                size += len(name) + json_size(use.get("input"))
            else:
                size += json_size(b)
        if size or not m.get("content"):
            parts.append(("history" if i <= last else "new", size, "", ""))
    return parts


def _part(block: Json) -> Json | None:
    if isinstance(block.get("text"), str):
        return text_part(block["text"])
    use, result = block.get("toolUse"), block.get("toolResult")
    if isinstance(use, dict):
        return call_part(use.get("toolUseId"), use.get("name"), use.get("input"))
    if isinstance(result, dict):
        return response_part(result.get("toolUseId"), result_text(result))
    return None


def _system_text(system: Any) -> str:
    return "".join(b["text"] for b in _blocks(system) if isinstance(b.get("text"), str))


class ConverseFormat:
    """The Converse wire format: stateless, as every API module's (the roles of proxy/providers/roles.py).
    The route's model and the Bedrock upstream come from proxy/providers/bedrock.py, which
    opens its calls."""

    api = "converse"
    conversation: str | None = "messages"
    family = "bedrock"
    provider = "aws.bedrock"
    upstream_setting = "bedrock_base_url"
    names_deployment = False
    # Not a `type: text` part: Bedrock refuses members it does not know. Reminders go into a
    # result's first text block instead (tool_result_slots, _history).
    text_part = "text"
    # Explicit breakpoints bill a cache write above plain input (cacheWriteInputTokens).
    cache_marker: str | None = "cachePoint"
    text_shape: TextShape | None = None  # event-stream frames are decoded whole (eventstream.py)
    max_tokens_path: tuple[str, str] = ("inferenceConfig", "maxTokens")  # where a clamp writes

    def model_of(self, path: str) -> str | None:
        """The model the path names (an ARN by what it names: proxy/providers/bedrock_wire.py)."""
        return model_of_path(path)

    def parse_request(self, body: dict[str, Any], path: str, facts: ByteFacts = NO_BYTE_FACTS) -> Call:
        config = body.get("toolConfig")
        tools = _tools(config)
        inference = body.get("inferenceConfig")
        inference = inference if isinstance(inference, dict) else {}
        messages = body.get("messages")
        stop = inference.get("stopSequences")
        return Call(
            api="converse",
            body_bytes=facts.body_bytes,
            cache_write=facts.cache_write,
            operation="chat",
            model=self.model_of(path),
            stream=path.endswith("/converse-stream"),
            max_output_tokens=count_field("inferenceConfig.maxTokens", inference.get("maxTokens"),
                                          upper=MAX_TOKENS_LIMIT, what="the most tokens the answer may have"),
            max_tokens_field="inferenceConfig.maxTokens",
            tools=tools,
            tool_results=_tool_results(messages) if isinstance(messages, list) else (),
            output=_output(config, tools, body.get("outputConfig")),
            temperature=number(inference.get("temperature")),
            top_p=number(inference.get("topP")),
            stop_sequences=tuple(s for s in stop if isinstance(s, str)) if isinstance(stop, list) else (),
        )

    def prepare(self, ex: Exchange) -> list[Rewrite]:
        return []  # usage is always in the answer (and a stream's metadata event)

    def set_max_tokens(self, ex: Exchange, value: int) -> None:
        set_nested(ex, self.max_tokens_path, value)

    def tool_result_slots(self, body: dict[str, Any], call_id: str) -> list[tuple[dict[str, Any], str]]:
        slots = []
        for m in _blocks(body.get("messages")):
            for b in _blocks(m.get("content")):
                r = b.get("toolResult")
                if isinstance(r, dict) and r.get("toolUseId") == call_id:
                    k = _first_text(r)
                    if k is not None:
                        slots.append((r["content"][k], "text"))
        return slots

    def append_note(self, ex: Exchange, text: str) -> bool:
        """A text block at the end of the last turn when it is the user's (after its tool
        results), else a new user turn: roles alternate."""
        messages = ex.body.get("messages")
        if not isinstance(messages, list):
            return False
        block = {"text": text}
        last = messages[-1] if messages else None
        if isinstance(last, dict) and last.get("role") == "user" and isinstance(last.get("content"), list):
            return ex.splicer.append_item(("messages", -1, "content"), block)
        return ex.splicer.append_item(("messages",), {"role": "user", "content": [block]})

    def tool_history(self, body: dict[str, Any]) -> list[HistoryCall]:
        messages = body.get("messages")
        return _history(messages if isinstance(messages, list) else [])

    def input_parts(self, body: dict[str, Any]) -> list[InputPart]:
        return _input_parts(body)

    def stored_sizes(self, call: Call, outcome: Outcome) -> dict[str, int]:
        return {}

    def parse_response(self, body: Any) -> list[StreamEvent]:
        if not isinstance(body, dict):
            return []
        output = body.get("output")
        events = converse_events(output.get("message") if isinstance(output, dict) else None)
        if isinstance(body.get("stopReason"), str):
            events.append(Finish(body["stopReason"]))
        if isinstance(body.get("usage"), dict):
            events.append(UsageEvent(converse_usage(body["usage"])))
        return events

    def parse_event(self, event: SseEvent) -> list[StreamEvent]:
        kind = event.event or ""
        if kind.startswith("exception:"):
            data = event.json() if event.data else {}
            message = data.get("message") if isinstance(data, dict) else None
            return [StreamError(kind.removeprefix("exception:"), str(message or ""))]
        return converse_stream_event(kind, event.json())

    def text_slots(self, body: Json) -> list[Slot]:
        output = body.get("output")
        message = output.get("message") if isinstance(output, dict) else None
        return [Slot(b, "text") for b in _blocks(message.get("content") if isinstance(message, dict) else None)
                if isinstance(b.get("text"), str)]

    def argument_slots(self, body: Json) -> list[ArgumentSlot]:
        output = body.get("output")
        message = output.get("message") if isinstance(output, dict) else None
        return [ArgumentSlot(b["toolUse"], "input", str(b["toolUse"].get("toolUseId")), b["toolUse"].get("name"),
                             parsed=True)
                for b in _blocks(message.get("content") if isinstance(message, dict) else None)
                if isinstance(b.get("toolUse"), dict)]

    def stream_rewriter(self, edits: StreamEdits) -> EventRewrite | None:
        return None  # event-stream frames are relayed as they come (see proxy/providers/eventstream.py)

    def retry_body(self, body: Json, answer: str, feedback: str) -> Json:
        turns = [{"role": "assistant", "content": [{"text": answer}]},
                 {"role": "user", "content": [{"text": feedback}]}]
        return {**body, "messages": [*(body.get("messages") or []), *turns]}

    def input_messages(self, body: Json) -> Messages:
        out = []
        for m in _blocks(body.get("messages")):
            parts = [p for b in _blocks(m.get("content")) if (p := _part(b)) is not None]
            out.append({"role": m.get("role"), "parts": parts})
        return _system_text(body.get("system")), out

    def render_error(self, error: ProxyError, request_id: str) -> bytes:
        return bedrock_error_body(error)

    def render_stream_error(self, error: ProxyError) -> bytes:
        return bedrock_stream_error(error)

    def auth_headers(self, key: str) -> dict[str, str]:
        return bedrock_auth(key)

    def cache_points(self, ex: Exchange, scope: CacheScope) -> list[Rewrite]:
        return converse_breakpoints(ex, scope.caller, scope.memory, scope.now)


def set_nested(ex: Exchange, path: tuple[str, str], value: int) -> None:
    """Write `value` at a two-level member (`inferenceConfig.maxTokens`): the parent object is
    replaced, small as it is; every other byte of the request goes as it came."""
    parent, key = path
    holder = ex.body.get(parent)
    ex.splicer.set_top(parent, {**(holder if isinstance(holder, dict) else {}), key: value})


CONVERSE = ConverseFormat()
