"""OpenAI Responses streams rewritten event by event, for repair.

Typed events carry the answer's text (`response.output_text.delta`) and each function
call's arguments (`response.function_call_arguments.delta`, the call named by its item
id in `response.output_item.added`). The stream repeats what it sent in summary events
(`*.done`, `response.content_part.done`, `response.output_item.done`,
`response.completed`): each is patched to say what the agent received. What repair held
back goes out in the `*.done` event that ends the text or the arguments.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

from proxy.model import StreamEvent
from proxy.providers.answer import Json, StreamEdits, dicts, reframed
from proxy.providers.sse import SseEvent

__all__ = ["ResponsesStreamRepair"]


class ResponsesStreamRepair:
    """Hands the output text and each call's arguments to `edits`, event by event."""

    __slots__ = ("_edits", "_full_args", "_full_text", "_handlers", "_items")

    def __init__(self, edits: StreamEdits) -> None:
        self._edits = edits
        self._full_text = ""  # the repaired answer, to patch the summary events that repeat it
        self._full_args: dict[str, str] = {}  # item id -> repaired arguments
        self._items: dict[str, tuple[str, Any]] = {}  # item id -> (call id, name)
        self._handlers: dict[str, Callable[[SseEvent, Json], bytes | None]] = {
            "response.output_item.added": self._item_added,
            "response.output_text.delta": self._text_delta,
            "response.output_text.done": self._text_done,
            "response.function_call_arguments.delta": self._arguments_delta,
            "response.function_call_arguments.done": self._arguments_done,
            "response.content_part.done": self._part_done,
            "response.output_item.done": self._item_done,
            "response.completed": self._completed,
        }

    def __call__(self, event: SseEvent, parsed: list[StreamEvent]) -> bytes | None:
        if not event.data.startswith("{"):
            return None
        data = event.json()
        handler = self._handlers.get(str(data.get("type")))
        return None if handler is None else handler(event, data)

    def _item_added(self, event: SseEvent, data: Json) -> bytes | None:
        item = data.get("item") or {}
        if item.get("type") == "function_call":
            self._items[str(item.get("id"))] = (str(item.get("call_id")), item.get("name"))
        return None

    def _text_delta(self, event: SseEvent, data: Json) -> bytes | None:
        if not self._edits.repairs_text:
            return None
        out = self._edits.text(data.get("delta", ""))
        self._full_text += out
        if out == data.get("delta"):
            return None
        data["delta"] = out
        return reframed(event, data)

    def _text_done(self, event: SseEvent, data: Json) -> bytes | None:
        if not self._edits.repairs_text:
            return None
        tail = self._edits.end_text()
        self._full_text += tail
        data["text"] = self._full_text
        extra = b""
        if tail:
            delta = {"type": "response.output_text.delta", "item_id": data.get("item_id"),
                     "output_index": data.get("output_index"), "content_index": data.get("content_index"),
                     "delta": tail, "sequence_number": data.get("sequence_number")}
            extra = b"event: response.output_text.delta\ndata: " + orjson.dumps(delta) + b"\n\n"
        return extra + reframed(event, data)

    def _arguments_delta(self, event: SseEvent, data: Json) -> bytes | None:
        item = str(data.get("item_id"))
        call_id, name = self._items.get(item, (item, None))
        self._edits.open_call(item, call_id, name)
        out = self._edits.arguments(item, data.get("delta", ""))
        self._full_args[item] = self._full_args.get(item, "") + out
        if out == data.get("delta"):
            return None
        data["delta"] = out
        return reframed(event, data)

    def _arguments_done(self, event: SseEvent, data: Json) -> bytes | None:
        item = str(data.get("item_id"))
        if not self._edits.is_open(item):
            return None
        tail = self._edits.end_arguments(item)
        self._full_args[item] = self._full_args.get(item, "") + tail
        data["arguments"] = self._full_args[item]
        return reframed(event, data)

    def _part_done(self, event: SseEvent, data: Json) -> bytes | None:
        part = data.get("part") or {}
        if not self._edits.repairs_text or part.get("type") != "output_text":
            return None
        part["text"] = self._full_text
        return reframed(event, data)

    def _item_done(self, event: SseEvent, data: Json) -> bytes | None:
        return reframed(event, data) if self._patch_item(data.get("item") or {}) else None

    def _completed(self, event: SseEvent, data: Json) -> bytes | None:
        response = data.get("response") or {}
        changed = False
        for item in dicts(response.get("output")):
            changed |= self._patch_item(item)
        return reframed(event, data) if changed else None

    def _patch_item(self, item: Json) -> bool:
        if item.get("type") == "function_call" and str(item.get("id")) in self._full_args:
            item["arguments"] = self._full_args[str(item.get("id"))]
            return True
        if item.get("type") == "message" and self._edits.repairs_text:
            parts = [p for p in dicts(item.get("content")) if p.get("type") == "output_text"]
            for i, p in enumerate(parts):
                p["text"] = self._full_text if i == 0 else ""
            return bool(parts)
        return False
