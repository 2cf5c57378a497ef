"""Gemini streams rewritten chunk by chunk, for repair.

Each chunk is a whole `GenerateContentResponse`: candidate 0's text parts carry the
answer's next fragments, and the chunk with a `finishReason` is the last. Function calls
arrive whole (`args` is an object), so there is nothing to repair in flight: they are
left as they come. google-genai needs `data: ` exactly, and the upstream's own line ending.
"""

from __future__ import annotations

import orjson

from proxy.model import StreamEvent
from proxy.providers.answer import Json, StreamEdits, dicts
from proxy.providers.sse import SseEvent

__all__ = ["GeminiStreamRepair"]


class GeminiStreamRepair:
    """Hands candidate 0's answer text (not its thoughts) to `edits`, chunk by chunk."""

    __slots__ = ("_edits",)

    def __init__(self, edits: StreamEdits) -> None:
        self._edits = edits

    def __call__(self, event: SseEvent, parsed: list[StreamEvent]) -> bytes | None:
        if not self._edits.repairs_text or not event.data.startswith("{"):
            return None
        chunk = event.json()
        candidates = dicts(chunk.get("candidates"))
        if not candidates:
            return None
        if not self._candidate(candidates[0]):
            return None
        end = b"\r\n\r\n" if event.raw.endswith(b"\r\n\r\n") else b"\n\n"
        return b"data: " + orjson.dumps(chunk) + end

    def _candidate(self, candidate: Json) -> bool:
        content = candidate.setdefault("content", {"role": "model", "parts": []})
        parts = content.setdefault("parts", [])
        changed = False
        for p in dicts(parts):
            if isinstance(p.get("text"), str) and not p.get("thought"):
                out = self._edits.text(p["text"])
                changed |= out != p["text"]
                p["text"] = out
        if candidate.get("finishReason"):
            tail = self._edits.end_text()
            if tail:
                parts.append({"text": tail})
                changed = True
        return changed
