"""Anthropic Messages streams rewritten event by event, for repair.

The answer comes in content blocks: `content_block_start` says a block's type (text or
tool_use, with the call's id and name), `content_block_delta` carries a `text_delta` or
an `input_json_delta` fragment, and `content_block_stop` closes it. What repair held
back goes out as one more delta, just before its block closes.
"""

from __future__ import annotations

from typing import Any

import orjson

from proxy.model import StreamEvent
from proxy.providers.answer import Json, StreamEdits, reframed
from proxy.providers.sse import SseEvent

__all__ = ["AnthropicStreamRepair"]

_BLOCK_EVENTS = ("content_block_start", "content_block_delta", "content_block_stop")


class AnthropicStreamRepair:
    """Hands text blocks and tool_use inputs to `edits`, block by block."""

    __slots__ = ("_blocks", "_edits")

    def __init__(self, edits: StreamEdits) -> None:
        self._edits = edits
        self._blocks: dict[Any, str] = {}  # index -> "text" | "tool_use" | ...

    def __call__(self, event: SseEvent, parsed: list[StreamEvent]) -> bytes | None:
        if event.event not in _BLOCK_EVENTS:
            return None
        data = event.json()
        index = data.get("index", 0)
        if event.event == "content_block_start":
            self._start(index, data.get("content_block") or {})
            return None
        if event.event == "content_block_delta":
            return self._delta(event, data, index, data.get("delta") or {})
        return self._stop(event, index)

    def _start(self, index: Any, block: Json) -> None:
        self._blocks[index] = block.get("type", "")
        if block.get("type") == "tool_use":
            self._edits.open_call(index, str(block.get("id")), block.get("name"))

    def _delta(self, event: SseEvent, data: Json, index: Any, delta: Json) -> bytes | None:
        if delta.get("type") == "text_delta" and self._edits.repairs_text and self._blocks.get(index) == "text":
            out = self._edits.text(delta.get("text", ""))
            if out == delta.get("text"):
                return None
            delta["text"] = out
            return reframed(event, data)
        if delta.get("type") == "input_json_delta" and self._edits.is_open(index):
            frag = delta.get("partial_json", "")
            out = self._edits.arguments(index, frag)
            if out == frag:
                return None
            delta["partial_json"] = out
            return reframed(event, data)
        return None

    def _stop(self, event: SseEvent, index: Any) -> bytes | None:
        kind = self._blocks.get(index)
        tail = self._edits.end_arguments(index) if kind == "tool_use" else \
            self._edits.end_text() if kind == "text" else ""
        if not tail:
            return None
        dtype, field = ("input_json_delta", "partial_json") if kind == "tool_use" else ("text_delta", "text")
        extra = {"type": "content_block_delta", "index": index, "delta": {"type": dtype, field: tail}}
        return b"event: content_block_delta\ndata: " + orjson.dumps(extra) + b"\n\n" + event.raw
