"""Message content in the semconv shapes, for opt-in capture (SPAN_ONLY). Pure.

`gen_ai.input.messages` / `gen_ai.output.messages` are lists of
`{"role", "parts": [{"type": "text", "content"} | {"type": "tool_call", "id", "name", "arguments"}
| {"type": "tool_call_response", "id", "response"}]}`; system text goes to
`gen_ai.system_instructions` when the API carries it separately.

Repair changes what the agent receives, never what the model said: `output_messages` is
the model's answer as it came (semconv: "messages returned by the model"), and, when a
repair changed it, `output_messages_repaired` is the answer as the agent received it,
in the same shape (`spanmeter.output.messages.repaired`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import orjson

from proxy.model import Outcome
from proxy.providers.base import text_of

__all__ = ["capture"]

Json = dict[str, Any]


def capture(api: str, body: Json, outcome: Outcome, *, delivered_text: str | None = None,
            delivered_arguments: Mapping[str, str] | None = None) -> Json:
    """`delivered_*`: the answer's text and tool-call arguments (by call id) as the agent
    received them, where a repair changed them."""
    system, messages = _INPUT.get(api, _none)(body)
    out: Json = {"input_messages": messages, "output_messages": [_output(outcome)]}
    if system:
        out["system_instructions"] = [{"type": "text", "content": system}]
    delivered = _delivered(outcome, delivered_text, delivered_arguments or {})
    if delivered is not None:
        out["output_messages_repaired"] = [_output(delivered)]
    return out


def _delivered(o: Outcome, text: str | None, arguments: Mapping[str, str]) -> Outcome | None:
    """The outcome as the agent received it, or None when no repair changed it."""
    changed_text = text is not None and text != o.text
    calls = tuple(replace(tc, arguments=arguments[tc.id]) if arguments.get(tc.id, tc.arguments) != tc.arguments
                  else tc for tc in o.tool_calls)
    if not changed_text and calls == o.tool_calls:
        return None
    return replace(o, text=text if changed_text and text is not None else o.text, tool_calls=calls)


def _text(text: str) -> Json:
    return {"type": "text", "content": text}


def _call(call_id: Any, name: Any, arguments: Any) -> Json:
    return {"type": "tool_call", "id": call_id, "name": name, "arguments": arguments}


def _args(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return orjson.loads(value)
        except orjson.JSONDecodeError:
            return value
    return value


def _output(o: Outcome) -> Json:
    parts: list[Json] = [_text(o.text)] if o.text else []
    parts += [_call(tc.id, tc.name, _args(tc.arguments)) for tc in o.tool_calls]
    reason = o.finish_reasons[0] if o.finish_reasons else ("error" if o.error_type else "stop")
    return {"role": "assistant", "parts": parts, "finish_reason": reason}


def _none(body: Json) -> tuple[str, list[Json]]:
    return "", []


def _chat(body: Json) -> tuple[str, list[Json]]:
    out = []
    for m in body.get("messages") or ():
        if not isinstance(m, dict):
            continue
        parts = [_text(text_of(m.get("content")))] if m.get("content") else []
        for tc in m.get("tool_calls") or ():
            fn = tc.get("function") or {}
            parts.append(_call(tc.get("id"), fn.get("name"), _args(fn.get("arguments"))))
        if m.get("role") == "tool":
            parts = [{"type": "tool_call_response", "id": m.get("tool_call_id"), "response": text_of(m.get("content"))}]
        out.append({"role": m.get("role"), "parts": parts})
    return "", out


def _responses(body: Json) -> tuple[str, list[Json]]:
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    out = []
    for it in items if isinstance(items, list) else ():
        if not isinstance(it, dict):
            continue
        if it.get("type") == "function_call":
            call = _call(it.get("call_id"), it.get("name"), _args(it.get("arguments")))
            out.append({"role": "assistant", "parts": [call]})
        elif it.get("type") == "function_call_output":
            out.append({"role": "tool", "parts": [{"type": "tool_call_response", "id": it.get("call_id"),
                                                   "response": it.get("output")}]})
        else:
            out.append({"role": it.get("role", "user"), "parts": [_text(text_of(it.get("content")))]})
    instructions = body.get("instructions")
    return instructions if isinstance(instructions, str) else "", out


def _messages(body: Json) -> tuple[str, list[Json]]:
    out = []
    for m in body.get("messages") or ():
        if not isinstance(m, dict):
            continue
        content = m.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content or []
        parts: list[Json] = []
        for b in blocks:
            if not isinstance(b, dict):
                continue
            if b.get("type") == "text":
                parts.append(_text(b.get("text", "")))
            elif b.get("type") == "tool_use":
                parts.append(_call(b.get("id"), b.get("name"), b.get("input")))
            elif b.get("type") == "tool_result":
                parts.append({"type": "tool_call_response", "id": b.get("tool_use_id"),
                              "response": text_of(b.get("content"))})
        out.append({"role": m.get("role"), "parts": parts})
    return text_of(body.get("system")), out


def _gemini(body: Json) -> tuple[str, list[Json]]:
    out = []
    for c in body.get("contents") or ():
        if not isinstance(c, dict):
            continue
        parts: list[Json] = []
        for p in c.get("parts") or ():
            if not isinstance(p, dict):
                continue
            if isinstance(p.get("text"), str):
                parts.append(_text(p["text"]))
            elif isinstance(p.get("functionCall"), dict):
                fc = p["functionCall"]
                parts.append(_call(fc.get("id"), fc.get("name"), fc.get("args")))
            elif isinstance(p.get("functionResponse"), dict):
                fr = p["functionResponse"]
                parts.append({"type": "tool_call_response", "id": fr.get("id") or fr.get("name"),
                              "response": fr.get("response")})
        out.append({"role": "assistant" if c.get("role") == "model" else c.get("role", "user"), "parts": parts})
    si = body.get("systemInstruction") or body.get("system_instruction")
    return text_of(si.get("parts")) if isinstance(si, dict) else "", out


_INPUT = {"chat": _chat, "responses": _responses, "messages": _messages, "gemini": _gemini}
