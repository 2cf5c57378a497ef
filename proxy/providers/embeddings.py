"""OpenAI Embeddings: `POST /v1/embeddings`, a metered call with input tokens only."""

from __future__ import annotations

from typing import Any

from proxy.model import (
    NO_BYTE_FACTS,
    ByteFacts,
    Call,
    InputPart,
    MetaEvent,
    Outcome,
    Rewrite,
    StreamError,
    StreamEvent,
    Usage,
    UsageEvent,
)
from proxy.providers.answer import ArgumentSlot, EventRewrite, Json, Slot, StreamEdits
from proxy.providers.base import Exchange, HistoryCall
from proxy.providers.base import integer as _int
from proxy.providers.chat import OpenAIFamily
from proxy.providers.parts import Messages
from proxy.providers.sse import SseEvent

__all__ = ["EMBEDDINGS", "EmbeddingsAdapter"]

# Inputs given as token ids have no text; a token is about four characters, and the
# character count is only an input bound for pricing.
_CHARS_PER_TOKEN = 4


def _input_chars(value: Any) -> int:
    if isinstance(value, str):
        return len(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return _CHARS_PER_TOKEN
    if isinstance(value, list):
        return sum(_input_chars(v) for v in value)
    return 0


class EmbeddingsAdapter(OpenAIFamily):
    api = "embeddings"
    conversation: str | None = None
    text_part = "text"

    def parse_request(self, body: dict[str, Any], path: str, facts: ByteFacts = NO_BYTE_FACTS) -> Call:
        model = body.get("model")
        return Call(
            api="embeddings",
            body_bytes=facts.body_bytes,
            cache_write=facts.cache_write,
            operation="embeddings",
            model=model if isinstance(model, str) else None,
            input_chars=_input_chars(body.get("input")),
            generates_output=False,
        )

    def prepare(self, ex: Exchange) -> list[Rewrite]:
        return []

    def set_max_tokens(self, ex: Exchange, value: int) -> None:
        """Embeddings produce no tokens: nothing to clamp."""

    def tool_result_slots(self, body: dict[str, Any], call_id: str) -> list[tuple[dict[str, Any], str]]:
        return []

    def append_note(self, ex: Exchange, text: str) -> bool:
        """Embeddings have no conversation: no note."""
        return False

    def tool_history(self, body: dict[str, Any]) -> list[HistoryCall]:
        return []

    def input_parts(self, body: dict[str, Any]) -> list[InputPart]:
        return [("new", _input_chars(body.get("input")), "", "")]  # all of it is this call's

    def stored_sizes(self, call: Call, outcome: Outcome) -> dict[str, int]:
        return {}  # no context is stored by this API

    def parse_response(self, body: Any) -> list[StreamEvent]:
        if not isinstance(body, dict):
            return []
        if isinstance(body.get("error"), dict):
            err = body["error"]
            return [StreamError(str(err.get("type") or "error"), str(err.get("message") or ""))]
        events: list[StreamEvent] = [MetaEvent(None, body.get("model") if isinstance(
            body.get("model"), str) else None)]
        usage = body.get("usage")
        if isinstance(usage, dict):
            # Output stays None: an embedding has no output tokens to report (semconv
            # sets only input_tokens on embeddings spans).
            events.append(UsageEvent(Usage(
                input_tokens=_int(usage.get("prompt_tokens", usage.get("input_tokens"))))))
        return events

    def parse_event(self, event: SseEvent) -> list[StreamEvent]:
        if not event.data:
            return []
        return self.parse_response(event.json())  # embeddings do not stream

    # An embedding has no answer to repair, ask for again or capture.

    def text_slots(self, body: Json) -> list[Slot]:
        return []

    def argument_slots(self, body: Json) -> list[ArgumentSlot]:
        return []

    def stream_rewriter(self, edits: StreamEdits) -> EventRewrite | None:
        return None

    def retry_body(self, body: Json, answer: str, feedback: str) -> Json:
        return dict(body)

    def input_messages(self, body: Json) -> Messages:
        return "", []


EMBEDDINGS = EmbeddingsAdapter()
