"""OpenAI Responses: `POST /v1/responses`, streaming (typed events) and not.

Tool calls are `function_call` output items; their results come back as
`function_call_output` input items. Usage arrives once, in `response.completed`
(or `response.incomplete` / `response.failed`), with the whole response.

Finish reasons: the Responses API has no per-choice finish reason, so the raw
`status` is reported ("completed", "failed", ...), or the `incomplete_details.reason`
when the response is incomplete ("max_output_tokens", "content_filter").
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
)
from proxy.providers.base import array as _list
from proxy.providers.base import integer as _int
from proxy.providers.base import string as _str
from proxy.providers.chat import OpenAIFamily, openai_usage
from proxy.providers.parts import Messages, arguments, call_part, response_part, text_part
from proxy.providers.responses_stream import ResponsesStreamRepair
from proxy.providers.sizes import json_size, size_of
from proxy.providers.sse import SseEvent

__all__ = ["RESPONSES", "ResponsesAdapter"]

# Items the model produced: a new run of them after a tool result starts a new turn.
_MODEL_ITEMS = frozenset({"function_call", "reasoning", "custom_tool_call"})


def _tools(raw: Any) -> tuple[ToolSpec, ...]:
    out = []
    for t in raw if isinstance(raw, list) else ():
        if isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("name"), str):
            params = t.get("parameters")
            out.append(ToolSpec(t["name"], _str(t.get("description")),
                                params if isinstance(params, dict) else None))
    return tuple(out)


def _output(body: dict[str, Any], tools: tuple[ToolSpec, ...]) -> OutputSpec | None:
    text = body.get("text")
    fmt = text.get("format") if isinstance(text, dict) else None
    if isinstance(fmt, dict):
        # Flat, unlike chat's response_format.json_schema nesting.
        if fmt.get("type") == "json_schema":
            schema = fmt.get("schema")
            return OutputSpec("json_schema", schema if isinstance(schema, dict) else None,
                              _str(fmt.get("name")), fmt.get("strict") is True)
        if fmt.get("type") == "json_object":
            return OutputSpec("json_object")
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":
        spec = next((t for t in tools if t.name == choice.get("name")), None)
        if spec is not None:
            return OutputSpec("tool", spec.parameters, spec.name)
    return None


def _stored_context(body: dict[str, Any]) -> tuple[str, ...]:
    """Context OpenAI keeps server-side and bills as input, named but not carried here."""
    refs = []
    if isinstance(prev := body.get("previous_response_id"), str) and prev:
        refs.append(f"response:{prev}")
    conv = body.get("conversation")
    conv = conv.get("id") if isinstance(conv, dict) else conv
    if isinstance(conv, str) and conv:
        refs.append(f"conversation:{conv}")
    prompt = body.get("prompt")
    if isinstance(prompt, dict) and isinstance(prompt.get("id"), str):
        version = prompt.get("version")
        refs.append(f"prompt:{prompt['id']}" + (f"@{version}" if isinstance(version, str) else ""))
    return tuple(refs)


def _is_model_item(item: dict[str, Any]) -> bool:
    kind = item.get("type")  # any JSON value: a list or object is not hashable, so no set lookup
    return (isinstance(kind, str) and kind in _MODEL_ITEMS) or item.get("role") == "assistant"


def _input_parts(body: dict[str, Any]) -> list[InputPart]:
    """Tool definitions, then `instructions`, then the input items in order: system and
    developer messages as instructions, function_call_output items as results, model items
    and the messages before the model's last turn as earlier conversation, the rest new."""
    parts = [("tools", json_size(t), _tool_name(t), "") for t in _list(body.get("tools"))]
    if isinstance(body.get("instructions"), str):
        parts.append(("system", len(body["instructions"]), "", ""))
    given = body.get("input")
    items = [{"role": "user", "content": given}] if isinstance(given, str) else _list(given)
    last = max((i for i, it in enumerate(items) if isinstance(it, dict) and _is_model_item(it)), default=-1)
    names: dict[str, str] = {}
    for i, it in enumerate(items):
        if not isinstance(it, dict):
            continue
        kind = it.get("type")
        if it.get("role") in ("system", "developer"):
            parts.append(("system", size_of(it.get("content")), "", ""))
        elif kind == "function_call_output":
            cid = _str(it.get("call_id")) or ""
            parts.append(("tool_result", size_of(it.get("output")), names.get(cid, ""), cid))
        elif kind == "function_call":
            name = _str(it.get("name")) or ""
            names[_str(it.get("call_id")) or ""] = name
            parts.append(("history", len(name) + size_of(it.get("arguments")), "", ""))
        elif _is_model_item(it):
            parts.append(("history", size_of(it.get("content") or it.get("summary")), "", ""))
        else:
            parts.append(("history" if i < last else "new", size_of(it.get("content")), "", ""))
    return parts


def _tool_name(tool: Any) -> str:
    """A function's name; a built-in tool (web_search, file_search) by its type."""
    if not isinstance(tool, dict):
        return ""
    return _str(tool.get("name")) or _str(tool.get("type")) or ""


def _tool_results(items: list[Any]) -> tuple[ToolResult, ...]:
    # Every function_call_output, joined by id (joined_results): an agent framework may
    # add items of its own after the model's turn (a message, its own function call and
    # output when it loads tools on demand). The new ones follow the model's last turn that
    # called functions: a turn is a run of model items (echoed function_call, reasoning,
    # assistant message), and a model item that follows anything else starts the next one.
    results: list[ToolResult] = []
    names: dict[str, str] = {}
    previous_was_model = False
    calls_in_turn = False
    new_from = 0
    for item in items:
        if not isinstance(item, dict):
            continue
        if _is_model_item(item):
            if not previous_was_model:
                calls_in_turn = False
            previous_was_model = True
            if item.get("type") == "function_call" and isinstance(item.get("call_id"), str):
                if not calls_in_turn:
                    new_from, calls_in_turn = len(results), True
                names[item["call_id"]] = str(item.get("name") or "")
            continue
        previous_was_model = False
        if item.get("type") == "function_call_output" and isinstance(item.get("call_id"), str):
            out = item.get("output")
            text = out if isinstance(out, str) else text_of(out)
            results.append(ToolResult(item["call_id"], text, names.get(item["call_id"]) or None))
    return joined_results(results, new_from)


def _history(items: list[Any]) -> list[HistoryCall]:
    # A model turn is a run of model items, as in _tool_results.
    h = History()
    previous_was_model = False
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            continue
        model = _is_model_item(item)
        if model and not previous_was_model:
            h.turn()
        previous_was_model = model
        if not isinstance(item.get("call_id"), str):
            continue
        if item.get("type") == "function_call":
            args = item.get("arguments")
            h.call(item["call_id"], str(item.get("name") or ""),
                   args if isinstance(args, str) else orjson.dumps(args).decode())
        elif item.get("type") == "function_call_output":
            h.result(item["call_id"], ("input", i, "output"))
    return h.calls()


def _finish_reason(response: dict[str, Any]) -> str | None:
    details = response.get("incomplete_details")
    if isinstance(details, dict) and isinstance(details.get("reason"), str):
        return str(details["reason"])
    return _str(response.get("status"))


def _summary(response: dict[str, Any]) -> list[StreamEvent]:
    """Meta, usage, finish and error of a whole response object (not its output)."""
    events: list[StreamEvent] = [MetaEvent(_str(response.get("id")), _str(response.get("model")))]
    if isinstance(response.get("usage"), dict):
        events.append(UsageEvent(openai_usage(response["usage"], response.get("service_tier"))))
    reason = _finish_reason(response)
    if reason:
        events.append(Finish(reason))
    err = response.get("error")
    if isinstance(err, dict):
        events.append(StreamError(str(err.get("code") or "error"), str(err.get("message") or "")))
    return events


def _output_events(output: Any) -> list[StreamEvent]:
    events: list[StreamEvent] = []
    for i, item in enumerate(output if isinstance(output, list) else ()):
        if not isinstance(item, dict):
            continue
        if item.get("type") == "message":
            for part in _list(item.get("content")):
                if isinstance(part, dict) and part.get("type") == "output_text":
                    events.append(TextDelta(str(part.get("text") or "")))
        elif item.get("type") == "function_call":
            events.append(ToolCallDelta(i, _str(item.get("call_id")), _str(item.get("name")),
                                        str(item.get("arguments") or ""), True))
    return events


def _stream_item(index: int, item: Any) -> list[StreamEvent]:
    if isinstance(item, dict) and item.get("type") == "function_call":
        return [ToolCallDelta(index, _str(item.get("call_id")), _str(item.get("name")),
                              str(item.get("arguments") or ""))]
    return []


def _input_message(item: Json) -> Json:
    kind = item.get("type")
    if kind == "function_call":
        return {"role": "assistant",
                "parts": [call_part(item.get("call_id"), item.get("name"), arguments(item.get("arguments")))]}
    if kind == "function_call_output":
        return {"role": "tool", "parts": [response_part(item.get("call_id"), item.get("output"))]}
    return {"role": item.get("role", "user"), "parts": [text_part(text_of(item.get("content")))]}


def _input_messages(body: Json) -> Messages:
    given, instructions = body.get("input"), body.get("instructions")
    items = dicts(_input_items(given) if isinstance(given, str) else given)
    return instructions if isinstance(instructions, str) else "", [_input_message(item) for item in items]


def _input_items(given: Any) -> list[Any]:
    """`input` as a list of items: a string is one user message."""
    return [{"role": "user", "content": given}] if isinstance(given, str) else list(given or [])


def _plain_delta(event: SseEvent) -> bool:
    return bool(event.json().get("type") == "response.output_text.delta")


class ResponsesAdapter(OpenAIFamily):
    # A text delta names its output item, which nothing reads from it: a hole, so that the
    # shape is the same in every stream.
    text_shape: TextShape | None = TextShape(b'"delta":', _plain_delta,
                                             ignored=(b'"sequence_number":', b'"item_id":', b'"obfuscation":'))
    api = "responses"
    conversation: str | None = "input"
    cache_key = True
    text_part = "input_text"

    def parse_request(self, body: dict[str, Any], path: str, facts: ByteFacts = NO_BYTE_FACTS) -> Call:
        tools = _tools(body.get("tools"))
        items = body.get("input")
        return Call(
            api="responses",
            body_bytes=facts.body_bytes,
            cache_write=facts.cache_write,
            operation="chat",
            openai_api_type="responses",
            model=_str(body.get("model")),
            stream=body.get("stream") is True,
            max_output_tokens=count_field("max_output_tokens", body.get("max_output_tokens"),
                                          upper=MAX_TOKENS_LIMIT, what="the most tokens the answer may have"),
            service_tier=_str(body.get("service_tier")),
            max_tokens_field="max_output_tokens",
            stored_context=_stored_context(body),
            tools=tools,
            tool_results=_tool_results(items) if isinstance(items, list) else (),
            output=_output(body, tools),
            temperature=number(body.get("temperature")),
            top_p=number(body.get("top_p")),
        )

    def prepare(self, ex: Exchange) -> list[Rewrite]:
        return []  # usage always arrives in response.completed

    def set_max_tokens(self, ex: Exchange, value: int) -> None:
        ex.splicer.set_top("max_output_tokens", value)

    def tool_result_slots(self, body: dict[str, Any], call_id: str) -> list[tuple[dict[str, Any], str]]:
        return [(it, "output") for it in _list(body.get("input"))
                if isinstance(it, dict) and it.get("type") == "function_call_output" and it.get("call_id") == call_id]

    def append_note(self, ex: Exchange, text: str) -> bool:
        """A new final user input item. A string `input` is one user message: it becomes
        the list of that message (its text byte for byte) and the note."""
        item = {"role": "user", "content": text}
        given = ex.body.get("input")
        if isinstance(given, list):
            return ex.splicer.append_item(("input",), item)
        if isinstance(given, str):  # its message keeps the string's bytes as they came
            note = orjson.dumps(item).decode()
            return ex.splicer.replace_value(("input",), [{"role": "user", "content": given}, item],
                                    lambda old: '[{"role":"user","content":' + old + "}," + note + "]")
        if "input" not in ex.body:  # a stored prompt alone
            ex.splicer.set_top("input", [item])
            return True
        return False

    def tool_history(self, body: dict[str, Any]) -> list[HistoryCall]:
        return _history(_list(body.get("input")))

    def input_parts(self, body: dict[str, Any]) -> list[InputPart]:
        return _input_parts(body)

    def stored_sizes(self, call: Call, outcome: Outcome) -> dict[str, int]:
        """A stored response, and the conversation it extends, hold this call's input and
        output; a stored prompt is at most this call's input."""
        u = outcome.usage
        if u.input_tokens is None:
            return {}
        held = u.input_tokens + (u.output_tokens or 0)
        sizes = {ref: u.input_tokens for ref in call.stored_context if ref.startswith("prompt:")}
        sizes |= {ref: held for ref in call.stored_context if ref.startswith("conversation:")}
        if outcome.response_id:
            sizes[f"response:{outcome.response_id}"] = held
        return sizes

    def parse_response(self, body: Any) -> list[StreamEvent]:
        if not isinstance(body, dict):
            return []
        if isinstance(body.get("error"), dict) and "output" not in body:
            err = body["error"]
            return [StreamError(str(err.get("type") or err.get("code") or "error"),
                                str(err.get("message") or ""))]
        summary = _summary(body)
        return [summary[0], *_output_events(body.get("output")), *summary[1:]]

    def parse_event(self, event: SseEvent) -> list[StreamEvent]:
        if not event.data:
            return []
        data = event.json()
        if not isinstance(data, dict):
            return []
        # The SDK dispatches on data.type; the `event:` line is optional.
        kind = data.get("type")
        response = data.get("response")
        if kind in ("response.created", "response.in_progress") and isinstance(response, dict):
            return [MetaEvent(_str(response.get("id")), _str(response.get("model")))]
        if kind in ("response.completed", "response.incomplete", "response.failed") and isinstance(
            response, dict
        ):
            return _summary(response)
        if kind == "response.output_text.delta" and isinstance(data.get("delta"), str):
            return [TextDelta(data["delta"])]
        index = _int(data.get("output_index")) or 0
        if kind == "response.output_item.added":
            return _stream_item(index, data.get("item"))
        if kind == "response.function_call_arguments.delta" and isinstance(data.get("delta"), str):
            return [ToolCallDelta(index, arguments=data["delta"])]
        done = kind == "response.function_call_arguments.done"
        if done and isinstance(data.get("arguments"), str):
            # The whole arguments again: replaces the fragments, so a lost delta heals.
            return [ToolCallDelta(index, arguments=data["arguments"], complete=True)]
        if kind == "error":
            return [StreamError(str(data.get("code") or "error"), str(data.get("message") or ""))]
        return []

    def text_slots(self, body: Json) -> list[Slot]:
        return [Slot(p, "text") for item in dicts(body.get("output")) if item.get("type") == "message"
                for p in dicts(item.get("content"))
                if p.get("type") == "output_text" and isinstance(p.get("text"), str)]

    def argument_slots(self, body: Json) -> list[ArgumentSlot]:
        return [ArgumentSlot(it, "arguments", str(it.get("call_id")), it.get("name"))
                for it in dicts(body.get("output")) if it.get("type") == "function_call"]

    def stream_rewriter(self, edits: StreamEdits) -> EventRewrite | None:
        return ResponsesStreamRepair(edits)

    def retry_body(self, body: Json, answer: str, feedback: str) -> Json:
        items = {**body, "input": _input_items(body.get("input"))}
        return append_turns(items, "input", *answer_and_feedback(answer, feedback))

    def input_messages(self, body: Json) -> Messages:
        return _input_messages(body)

    def render_stream_error(self, error: ProxyError) -> bytes:
        # No sequence_number: we cannot know the stream's next one, and a wrong one could
        # make a consumer drop the event as a duplicate.
        payload = {"type": "error", "code": error.code, "message": error.message,
                   "param": error.param}
        return b"event: error\ndata: " + orjson.dumps(payload) + b"\n\n"


RESPONSES = ResponsesAdapter()
