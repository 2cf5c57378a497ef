"""Chat Completions streams rewritten chunk by chunk: repair, and the usage chunk dropped.

A chunk carries choice 0's text in `delta.content` and its tool calls' argument
fragments in `delta.tool_calls[].function.arguments`, each call named by `index` (its
id comes once, in its first fragment). What repair held back goes out in the chunk that
carries the finish reason.
"""

from __future__ import annotations

from typing import Any

from proxy.model import Finish, Rewrite, StreamEvent, TextDelta, ToolCallDelta, UsageEvent
from proxy.providers.answer import Json, StreamEdits, dicts, reframed
from proxy.providers.sse import SseEvent

__all__ = ["USAGE_DROPPED", "ChatStreamRepair", "drop_usage_chunk", "is_usage_only"]

USAGE_DROPPED = Rewrite("usage_chunk", "dropped")


def is_usage_only(events: list[StreamEvent]) -> bool:
    """Whether a chunk's events are those of the `choices: []` chunk carrying usage,
    which a client that did not ask for usage must not see."""
    usage = any(isinstance(e, UsageEvent) for e in events)
    return usage and not any(isinstance(e, TextDelta | ToolCallDelta | Finish) for e in events)


def drop_usage_chunk(event: SseEvent, parsed: list[StreamEvent]) -> bytes | None:
    # The client did not ask for usage: user code often indexes chunk.choices[0].
    return b"" if is_usage_only(parsed) else None


class ChatStreamRepair:
    """Hands choice 0's text and argument fragments to `edits`, chunk by chunk."""

    __slots__ = ("_edits", "_ids")

    def __init__(self, edits: StreamEdits) -> None:
        self._edits = edits
        self._ids: dict[Any, str] = {}  # tool call index -> its id

    def __call__(self, event: SseEvent, parsed: list[StreamEvent]) -> bytes | None:
        if not event.data.startswith("{"):
            return None
        chunk = event.json()
        choices = chunk.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            return None
        choice = choices[0]
        delta = choice.setdefault("delta", {})
        changed = self._text(delta) | self._arguments(delta)
        if choice.get("finish_reason"):
            changed |= self._flush(delta)
        return reframed(event, chunk) if changed else None

    def _text(self, delta: Json) -> bool:
        content = delta.get("content")
        if not self._edits.repairs_text or not isinstance(content, str):
            return False
        delta["content"] = self._edits.text(content)
        return bool(delta["content"] != content)

    def _arguments(self, delta: Json) -> bool:
        changed = False
        for tc in dicts(delta.get("tool_calls")):
            fn = tc.get("function") or {}
            frag = fn.get("arguments")
            index = tc.get("index", 0)
            if tc.get("id"):  # the first delta of a call names it, often with no arguments yet
                self._ids[index] = str(tc["id"])
            if isinstance(frag, str) and frag:
                self._edits.open_call(index, self._ids.get(index) or f"index-{index}", fn.get("name"))
                fn["arguments"] = self._edits.arguments(index, frag)
                changed |= fn["arguments"] != frag
        return changed

    def _flush(self, delta: Json) -> bool:
        changed = False
        tail = self._edits.end_text()
        if tail:
            delta["content"] = (delta.get("content") or "") + tail
            changed = True
        for index in self._edits.open_calls():
            tail = self._edits.end_arguments(index)
            if tail:
                delta.setdefault("tool_calls", []).append({"index": index, "function": {"arguments": tail}})
                changed = True
        return changed
