"""What the API modules share for the answer side of a call. Pure.

An API module knows where its answer's text and each tool call's arguments are, in a
whole body and in its stream's own framing; the repair (proxy/govern/outputs.py) knows what
they should become. The module hands them over through `Slot`s (whole bodies) and a
`StreamEdits` (streams), and writes back what it is given.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import orjson

from proxy.model import StreamEvent
from proxy.providers.sse import SseEvent

__all__ = ["ArgumentSlot", "CallKey", "EventRewrite", "Json", "Slot", "StreamEdits", "answer_and_feedback",
           "append_turns", "dicts", "first", "reframed"]

Json = dict[str, Any]

EventRewrite = Callable[[SseEvent, list[StreamEvent]], bytes | None]
"""Replacement bytes for one stream event (b"" drops it), or None to forward it as it came."""

CallKey = int | str
"""How a stream names a tool call until it ends: its index (chat, Anthropic) or item id (Responses)."""


class Slot(NamedTuple):
    """Where a piece of an answer's text is: `holder[key]`."""

    holder: Json
    key: str


class ArgumentSlot(NamedTuple):
    """Where a tool call's arguments are, `holder[key]`: JSON text, or an object the
    API sends already parsed (Anthropic `input`, Gemini `args`). `parsed`: the API's
    clients read the member as a JSON document (Converse's `toolUse.input`), so arguments
    that came as text and were repaired go back as the object they spell."""

    holder: Json
    key: str
    call_id: str
    name: str | None
    parsed: bool = False


class StreamEdits(Protocol):
    """What a stream rewriter hands over as the answer streams, and gets back to send.

    Each method returns the text to put where the fragment was ("" holds it back); the
    `end_*` methods return what was held back, to send before the text or call closes.
    """

    @property
    def repairs_text(self) -> bool:
        """Whether the answer's text is being repaired (the request asked for structured output)."""
        ...

    def text(self, fragment: str) -> str: ...

    def end_text(self) -> str: ...

    def open_call(self, key: CallKey, call_id: str, name: str | None) -> None:
        """A tool call starts (a second open of the same key changes nothing)."""
        ...

    def is_open(self, key: CallKey) -> bool: ...

    def open_calls(self) -> list[CallKey]: ...

    def arguments(self, key: CallKey, fragment: str) -> str:
        """A fragment of the arguments of the open call `key`."""
        ...

    def end_arguments(self, key: CallKey) -> str:
        """The call `key` ends ("" for a call never opened)."""
        ...


def dicts(value: Any) -> list[Json]:
    """The objects of a JSON array; anything else is no objects."""
    return [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []


def first(value: Any, key: str) -> Any:
    """`key` of the first object of a JSON array (the first choice, the first candidate)."""
    items = dicts(value)
    return items[0].get(key) if items else None


def reframed(event: SseEvent, data: Json) -> bytes:
    """`event` with `data` as its JSON, framed as OpenAI and Anthropic frame theirs: the
    `event:` line when it had one, one `data:` line."""
    head = f"event: {event.event}\n".encode() if event.event else b""
    return head + b"data: " + orjson.dumps(data) + b"\n\n"


def append_turns(body: Json, key: str, *turns: Json) -> Json:
    """A copy of `body` whose conversation at `key` goes on with `turns` (the retry of a
    request: the answer that did not match, then the problems as the user's turn)."""
    return {**body, key: [*(body.get(key) or []), *turns]}


def answer_and_feedback(answer: str, feedback: str) -> tuple[Json, Json]:
    """A retry's two turns as role + content messages (OpenAI's and Anthropic's shape)."""
    return {"role": "assistant", "content": answer}, {"role": "user", "content": feedback}
