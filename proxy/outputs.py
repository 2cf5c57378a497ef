"""Repair on the response path: structured output and tool-call arguments, per dialect.

Applies only when the request asked for structured output (`Call.output`) or declared
tools; plain text is never touched. Whole bodies are repaired in place; streams are
rewritten event by event through `StreamRepairer`, which holds back only what it must.
Every repair is recorded (`Hooks.repairs`, and `x-spanmeter-rewrites` for bodies).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import orjson

from proxy.config import RepairPolicy
from proxy.errors import SchemaViolation
from proxy.model import Call, OutputSpec, Repair, Rewrite, StreamEvent
from proxy.providers.base import SseEvent
from proxy.relay import Hooks
from proxy.repair import StreamRepairer, repair_arguments, repair_output, violation_feedback

__all__ = ["install", "retry_request"]

Json = dict[str, Any]


def install(api: str, call: Call, policy: RepairPolicy, hooks: Hooks) -> None:
    """Add the body and stream hooks this call needs, if any."""
    if policy.mode == "off" or (call.output is None and not call.tools):
        return
    hooks.on_body.append(_BodyRepair(api, call, policy, hooks))
    if call.stream and policy.mode == "repair":
        stream = _STREAMS.get(api)
        if stream is not None:
            hooks.on_event.append(stream(call, policy, hooks))
            # Headers leave before the stream: say up front that it may be rewritten.
            hooks.rewrites.append(Rewrite("repair", "stream"))


def retry_request(api: str, body: Json, answer: str, feedback: str) -> Json:
    """The request once more: the answer that did not match, then the problems as a user turn."""
    out = dict(body)
    if api == "gemini":
        out["contents"] = [*(body.get("contents") or []), {"role": "model", "parts": [{"text": answer}]},
                           {"role": "user", "parts": [{"text": feedback}]}]
    elif api == "responses":
        items = body.get("input")
        items = [{"role": "user", "content": items}] if isinstance(items, str) else list(items or [])
        out["input"] = [*items, {"role": "assistant", "content": answer}, {"role": "user", "content": feedback}]
    else:  # chat and Anthropic messages share the shape
        out["messages"] = [*(body.get("messages") or []), {"role": "assistant", "content": answer},
                           {"role": "user", "content": feedback}]
    return out


def _schema_of(call: Call, tool: str | None) -> dict[str, Any] | None:
    return next((t.parameters for t in call.tools if t.name == tool), None)


def _record(hooks: Hooks, policy: RepairPolicy, rep: Repair | None, changed: bool) -> None:
    if rep is None:
        return
    hooks.repairs.append(rep)
    if changed:
        hooks.rewrites.append(Rewrite("repair", f"{rep.target}:{'+'.join(rep.actions) or 'normalised'}"))
    if rep.valid is not False or "truncation" in rep.actions:
        return
    if policy.on_invalid == "retry" and rep.target == "output":
        hooks.retry_feedback = violation_feedback(list(rep.problems))
        return
    if policy.on_invalid == "error":
        where = "the structured output" if rep.target == "output" else f"the arguments of tool call {rep.target[5:]}"
        raise SchemaViolation(
            f"The model's answer does not match the schema the request declared, even after repair. "
            f"Problems in {where}: " + "; ".join(rep.problems) + ". Ask again with clearer instructions, or set "
            "repair.on_invalid to `pass` for this tenant to receive such answers unchanged.")


# --- whole bodies ---------------------------------------------------------------------


class _BodyRepair:
    def __init__(self, api: str, call: Call, policy: RepairPolicy, hooks: Hooks) -> None:
        self.api, self.call, self.policy, self.hooks = api, call, policy, hooks

    def __call__(self, parsed: object) -> bytes | None:
        if not isinstance(parsed, dict):
            return None
        changed = False
        if self.call.output is not None:
            changed |= self._output(parsed, self.call.output)
        for holder, key, call_id, name in _arg_slots(self.api, parsed):
            changed |= self._arguments(holder, key, call_id, name)
        return orjson.dumps(parsed) if changed else None

    def _output(self, parsed: Json, spec: OutputSpec) -> bool:
        slots = _text_slots(self.api, parsed)
        if not slots:
            return False
        text = "".join(h[k] for h, k in slots)
        self.hooks.retry_output = text
        new, rep = repair_output(text, spec, close_truncated=bool(self.policy.close_truncated))
        apply = new is not None and self.policy.mode == "repair"
        _record(self.hooks, self.policy, rep, apply)
        if apply:
            for i, (holder, key) in enumerate(slots):
                holder[key] = new if i == 0 else ""
            self.hooks.delivered_text = new
        return apply

    def _arguments(self, holder: Json, key: str, call_id: str, name: str | None) -> bool:
        value = holder.get(key)
        schema = _schema_of(self.call, name)
        if isinstance(value, dict):  # Anthropic input / Gemini args: already JSON, validate only
            from proxy.repair import problems

            found = problems(value, schema) if schema else []
            if found:
                _record(self.hooks, self.policy, Repair(f"tool:{call_id}", (), False, tuple(found)), False)
            return False
        if not isinstance(value, str):
            return False
        new, rep = repair_arguments(value, schema, call_id, close_truncated=bool(self.policy.close_truncated))
        apply = new is not None and self.policy.mode == "repair"
        _record(self.hooks, self.policy, rep, apply)
        if apply and new is not None:
            holder[key] = new
            self.hooks.delivered_arguments[call_id] = new
        return apply


def _text_slots(api: str, body: Json) -> list[tuple[Json, str]]:
    """Where the answer's text lives, in order (the first choice/candidate only)."""
    slots: list[tuple[Json, str]] = []
    if api == "chat":
        msg = _first(body.get("choices"), "message")
        if isinstance(msg, dict) and isinstance(msg.get("content"), str):
            slots.append((msg, "content"))
    elif api == "responses":
        for item in _list(body.get("output")):
            if item.get("type") == "message":
                slots += [(p, "text") for p in _list(item.get("content"))
                          if p.get("type") == "output_text" and isinstance(p.get("text"), str)]
    elif api == "messages":
        slots += [(b, "text") for b in _list(body.get("content"))
                  if b.get("type") == "text" and isinstance(b.get("text"), str)]
    elif api == "gemini":
        content = _first(body.get("candidates"), "content")
        parts = content.get("parts") if isinstance(content, dict) else None
        slots += [(p, "text") for p in _list(parts) if isinstance(p.get("text"), str) and not p.get("thought")]
    return slots


def _arg_slots(api: str, body: Json) -> list[tuple[Json, str, str, str | None]]:
    """(holder, key, call id, tool name) of each tool call's arguments."""
    out: list[tuple[Json, str, str, str | None]] = []
    if api == "chat":
        msg = _first(body.get("choices"), "message")
        for tc in _list(msg.get("tool_calls") if isinstance(msg, dict) else None):
            fn = tc.get("function")
            if isinstance(fn, dict):
                out.append((fn, "arguments", str(tc.get("id")), fn.get("name")))
    elif api == "responses":
        out += [(it, "arguments", str(it.get("call_id")), it.get("name"))
                for it in _list(body.get("output")) if it.get("type") == "function_call"]
    elif api == "messages":
        out += [(b, "input", str(b.get("id")), b.get("name"))
                for b in _list(body.get("content")) if b.get("type") == "tool_use"]
    elif api == "gemini":
        content = _first(body.get("candidates"), "content")
        for p in _list(content.get("parts") if isinstance(content, dict) else None):
            fc = p.get("functionCall")
            if isinstance(fc, dict):
                out.append((fc, "args", str(fc.get("id") or fc.get("name")), fc.get("name")))
    return out


def _list(value: Any) -> list[Json]:
    return [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []


def _first(value: Any, key: str) -> Any:
    items = _list(value)
    return items[0].get(key) if items else None


# --- streams --------------------------------------------------------------------------


class _StreamRepair:
    """Shared state: one repairer for the answer text, one per tool call's arguments."""

    def __init__(self, call: Call, policy: RepairPolicy, hooks: Hooks) -> None:
        self.call, self.policy, self.hooks = call, policy, hooks
        close = bool(policy.close_truncated)
        self.text = StreamRepairer(call.output, close_truncated=close) if call.output else None
        self.args: dict[Any, tuple[StreamRepairer, str]] = {}  # key -> (repairer, call id)

    def __call__(self, event: SseEvent, parsed: list[StreamEvent]) -> bytes | None:
        raise NotImplementedError

    def arg_repairer(self, key: Any, call_id: str, name: str | None) -> StreamRepairer:
        found = self.args.get(key)
        if found is None:
            spec = OutputSpec("tool", _schema_of(self.call, name), name)
            found = self.args[key] = (StreamRepairer(spec, close_truncated=bool(self.policy.close_truncated)), call_id)
        return found[0]

    def finish_text(self) -> str:
        if self.text is None:
            return ""
        tail = self.text.finish()
        _record(self.hooks, _no_raise(self.policy), self.text.repair, False)
        if self.text.repair is not None and self.text.repair.actions:
            self.hooks.delivered_text = self.text.emitted
        return tail

    def finish_args(self, key: Any) -> str:
        found = self.args.get(key)
        if found is None:
            return ""
        repairer, call_id = found
        tail = repairer.finish()
        rep = repairer.repair
        if rep is not None:
            _record(self.hooks, _no_raise(self.policy), replace(rep, target=f"tool:{call_id}"), False)
            if rep.actions:
                self.hooks.delivered_arguments[call_id] = repairer.emitted
        return tail


def _no_raise(policy: RepairPolicy) -> RepairPolicy:
    # The status line has gone out: a violation found mid-stream is recorded, not raised.
    return policy.model_copy(update={"on_invalid": "pass"})


def _sse(event: SseEvent, data: Json) -> bytes:
    head = f"event: {event.event}\n".encode() if event.event else b""
    return head + b"data: " + orjson.dumps(data) + b"\n\n"


class _ChatStream(_StreamRepair):
    def __init__(self, call: Call, policy: RepairPolicy, hooks: Hooks) -> None:
        super().__init__(call, policy, hooks)
        self.ids: dict[Any, str] = {}  # tool call index -> its id

    def __call__(self, event: SseEvent, parsed: list[StreamEvent]) -> bytes | None:
        if not event.data.startswith("{"):
            return None
        chunk = event.json()
        choices = chunk.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            return None
        choice = choices[0]
        delta = choice.setdefault("delta", {})
        changed = False
        if self.text is not None and isinstance(delta.get("content"), str):
            out = self.text.feed(delta["content"])
            changed |= out != delta["content"]
            delta["content"] = out
        for tc in _list(delta.get("tool_calls")):
            fn = tc.get("function") or {}
            frag = fn.get("arguments")
            if tc.get("id"):  # the first delta of a call names it, often with no arguments yet
                self.ids[tc.get("index", 0)] = str(tc["id"])
            if isinstance(frag, str) and frag:
                r = self.arg_repairer(tc.get("index", 0), self._id(tc), fn.get("name"))
                out = r.feed(frag)
                changed |= out != frag
                fn["arguments"] = out
        if choice.get("finish_reason"):
            changed |= self._flush(delta)
        return _sse(event, chunk) if changed else None

    def _id(self, tc: Json) -> str:
        index = tc.get("index", 0)
        return self.ids.get(index) or f"index-{index}"

    def _flush(self, delta: Json) -> bool:
        changed = False
        tail = self.finish_text()
        if tail:
            delta["content"] = (delta.get("content") or "") + tail
            changed = True
        for index in list(self.args):
            tail = self.finish_args(index)
            if tail:
                delta.setdefault("tool_calls", []).append({"index": index, "function": {"arguments": tail}})
                changed = True
        return changed


class _AnthropicStream(_StreamRepair):
    def __init__(self, call: Call, policy: RepairPolicy, hooks: Hooks) -> None:
        super().__init__(call, policy, hooks)
        self.blocks: dict[int, str] = {}  # index -> "text" | "tool_use"

    def __call__(self, event: SseEvent, parsed: list[StreamEvent]) -> bytes | None:
        if event.event not in ("content_block_start", "content_block_delta", "content_block_stop"):
            return None
        data = event.json()
        index = data.get("index", 0)
        if event.event == "content_block_start":
            block = data.get("content_block") or {}
            self.blocks[index] = block.get("type", "")
            if block.get("type") == "tool_use":
                self.arg_repairer(index, str(block.get("id")), block.get("name"))
            return None
        if event.event == "content_block_delta":
            delta = data.get("delta") or {}
            if delta.get("type") == "text_delta" and self.text is not None and self.blocks.get(index) == "text":
                out = self.text.feed(delta.get("text", ""))
                if out == delta.get("text"):
                    return None
                delta["text"] = out
                return _sse(event, data)
            if delta.get("type") == "input_json_delta" and index in self.args:
                frag = delta.get("partial_json", "")
                out = self.args[index][0].feed(frag)
                if out == frag:
                    return None
                delta["partial_json"] = out
                return _sse(event, data)
            return None
        kind = self.blocks.get(index)
        tail = self.finish_args(index) if kind == "tool_use" else self.finish_text() if kind == "text" else ""
        if not tail:
            return None
        # The held-back tail goes out as one more delta, just before the block closes.
        dtype, field = ("input_json_delta", "partial_json") if kind == "tool_use" else ("text_delta", "text")
        extra = {"type": "content_block_delta", "index": index, "delta": {"type": dtype, field: tail}}
        return b"event: content_block_delta\ndata: " + orjson.dumps(extra) + b"\n\n" + event.raw


class _GeminiStream(_StreamRepair):
    def __call__(self, event: SseEvent, parsed: list[StreamEvent]) -> bytes | None:
        if self.text is None or not event.data.startswith("{"):
            return None  # Gemini sends whole functionCall args: nothing to repair in flight
        chunk = event.json()
        cand = _list(chunk.get("candidates"))
        if not cand:
            return None
        content = cand[0].setdefault("content", {"role": "model", "parts": []})
        parts = content.setdefault("parts", [])
        changed = False
        for p in _list(parts):
            if isinstance(p.get("text"), str) and not p.get("thought"):
                out = self.text.feed(p["text"])
                changed |= out != p["text"]
                p["text"] = out
        if cand[0].get("finishReason"):
            tail = self.finish_text()
            if tail:
                parts.append({"text": tail})
                changed = True
        if not changed:
            return None
        # google-genai needs `data: ` exactly; keep the upstream's own line ending.
        end = b"\r\n\r\n" if event.raw.endswith(b"\r\n\r\n") else b"\n\n"
        return b"data: " + orjson.dumps(chunk) + end


class _ResponsesStream(_StreamRepair):
    def __init__(self, call: Call, policy: RepairPolicy, hooks: Hooks) -> None:
        super().__init__(call, policy, hooks)
        self.full_text = ""  # the repaired answer, to patch the summary events that repeat it
        self.full_args: dict[str, str] = {}  # item id -> repaired arguments
        self.items: dict[str, tuple[str, str | None]] = {}  # item id -> (call id, name)

    def __call__(self, event: SseEvent, parsed: list[StreamEvent]) -> bytes | None:
        if not event.data.startswith("{"):
            return None
        data = event.json()
        kind = data.get("type")
        handler = getattr(self, "_" + str(kind).replace(".", "_"), None)
        if handler is None:
            return None
        out: bytes | None = handler(event, data)
        return out

    def _response_output_item_added(self, event: SseEvent, data: Json) -> bytes | None:
        item = data.get("item") or {}
        if item.get("type") == "function_call":
            self.items[str(item.get("id"))] = (str(item.get("call_id")), item.get("name"))
        return None

    def _response_output_text_delta(self, event: SseEvent, data: Json) -> bytes | None:
        if self.text is None:
            return None
        out = self.text.feed(data.get("delta", ""))
        self.full_text += out
        if out == data.get("delta"):
            return None
        data["delta"] = out
        return _sse(event, data)

    def _response_output_text_done(self, event: SseEvent, data: Json) -> bytes | None:
        if self.text is None:
            return None
        tail = self.finish_text()
        self.full_text += tail
        data["text"] = self.full_text
        extra = b""
        if tail:
            delta = {"type": "response.output_text.delta", "item_id": data.get("item_id"),
                     "output_index": data.get("output_index"), "content_index": data.get("content_index"),
                     "delta": tail, "sequence_number": data.get("sequence_number")}
            extra = b"event: response.output_text.delta\ndata: " + orjson.dumps(delta) + b"\n\n"
        return extra + _sse(event, data)

    def _response_function_call_arguments_delta(self, event: SseEvent, data: Json) -> bytes | None:
        item = str(data.get("item_id"))
        call_id, name = self.items.get(item, (item, None))
        out = self.arg_repairer(item, call_id, name).feed(data.get("delta", ""))
        self.full_args[item] = self.full_args.get(item, "") + out
        if out == data.get("delta"):
            return None
        data["delta"] = out
        return _sse(event, data)

    def _response_function_call_arguments_done(self, event: SseEvent, data: Json) -> bytes | None:
        item = str(data.get("item_id"))
        if item not in self.args:
            return None
        tail = self.finish_args(item)
        self.full_args[item] = self.full_args.get(item, "") + tail
        data["arguments"] = self.full_args[item]
        return _sse(event, data)

    def _response_content_part_done(self, event: SseEvent, data: Json) -> bytes | None:
        part = data.get("part") or {}
        if self.text is None or part.get("type") != "output_text":
            return None
        part["text"] = self.full_text
        return _sse(event, data)

    def _response_output_item_done(self, event: SseEvent, data: Json) -> bytes | None:
        return _sse(event, data) if self._patch_item(data.get("item") or {}) else None

    def _response_completed(self, event: SseEvent, data: Json) -> bytes | None:
        response = data.get("response") or {}
        changed = False
        for item in _list(response.get("output")):
            changed |= self._patch_item(item)
        return _sse(event, data) if changed else None

    def _patch_item(self, item: Json) -> bool:
        if item.get("type") == "function_call" and str(item.get("id")) in self.full_args:
            item["arguments"] = self.full_args[str(item.get("id"))]
            return True
        if item.get("type") == "message" and self.text is not None:
            parts = [p for p in _list(item.get("content")) if p.get("type") == "output_text"]
            for i, p in enumerate(parts):
                p["text"] = self.full_text if i == 0 else ""
            return bool(parts)
        return False


_STREAMS: dict[str, type[_StreamRepair]] = {
    "chat": _ChatStream,
    "messages": _AnthropicStream,
    "gemini": _GeminiStream,
    "responses": _ResponsesStream,
}
