"""The adapter seam: one adapter per wire format, pure functions over parsed bodies.

An adapter never does I/O, never reads a clock and never touches globals, so it is
tested from recorded fixtures alone (tests/data/<dialect>/).

The handler parses the request body once (orjson) and hands the dict to
`parse_request`; responses come back as `StreamEvent`s, from a whole body
(`parse_response`) or one SSE event at a time (`parse_event`), and one shared
`Observer` folds either into an `Outcome`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

from proxy.errors import ProxyError
from proxy.model import Call, Rewrite, StreamEvent

__all__ = ["Framer", "ProviderAdapter", "SseEvent", "array", "integer", "number", "string", "text_of"]


_UNPARSED: Any = object()


@dataclass(slots=True)
class SseEvent:
    """One complete SSE event: the exact bytes to forward and its parsed fields."""

    raw: bytes
    event: str | None
    data: str
    _json: Any = field(default=_UNPARSED, compare=False, repr=False)

    def json(self) -> Any:
        """`data` parsed as JSON, once: the adapter and a response rewrite share it."""
        if self._json is _UNPARSED:
            self._json = orjson.loads(self.data)
        return self._json


_BOUNDARY = re.compile(rb"\r\n\r\n|\n\n|\r\r")


class Framer:
    """Splits a byte stream into SSE events as soon as each is complete.

    Keeps only the unfinished tail between calls, so the work is linear in the
    stream. The raw bytes of each event (terminator included) are kept so that the
    relay forwards them unchanged: Anthropic needs its `event:` lines, google-genai
    needs `data: ` exactly as the upstream wrote it.
    """

    __slots__ = ("_tail",)

    def __init__(self) -> None:
        self._tail = b""

    def feed(self, chunk: bytes) -> list[SseEvent]:
        buf = self._tail + chunk if self._tail else chunk
        events: list[SseEvent] = []
        start = 0
        if b"\r" not in buf:
            # The common framing (OpenAI, Anthropic): plain `\n\n`, found without the regex.
            while (end := buf.find(b"\n\n", start)) != -1:
                events.append(_parse(buf[start : end + 2]))
                start = end + 2
        else:
            while (m := _BOUNDARY.search(buf, start)) is not None:
                events.append(_parse(buf[start : m.end()]))
                start = m.end()
        self._tail = buf[start:]
        return events

    def flush(self) -> SseEvent | None:
        """The last event when the stream ended without a blank line."""
        tail, self._tail = self._tail, b""
        return _parse(tail) if tail.strip() else None


def _parse(raw: bytes) -> SseEvent:
    if raw.startswith(b"data: ") and raw.count(b"\n") == 2 and b"\r" not in raw:
        return SseEvent(raw, None, raw[6:-2].decode("utf-8", "replace"))  # one data line: most events
    name: str | None = None
    data: list[str] = []
    for line in raw.decode("utf-8", "replace").splitlines():
        if line.startswith("data:"):
            data.append(line[6:] if line[5:6] == " " else line[5:])
        elif line.startswith("event:"):
            name = line[6:].strip()
    return SseEvent(raw, name, "\n".join(data))


class ProviderAdapter(Protocol):
    """What the handler needs from a wire format.

    Example (chat)::

        call = CHAT.parse_request({"model": "gpt-4o", "messages": [...]}, "/v1/chat/completions")
        events = CHAT.parse_response(orjson.loads(upstream_body))
    """

    api: str  # one of proxy.model.Api
    upstream_setting: str  # which settings field holds this dialect's base URL

    def parse_request(self, body: dict[str, Any], path: str) -> Call: ...

    def prepare(self, body: dict[str, Any], call: Call) -> list[Rewrite]:
        """Rewrite the upstream request in place (e.g. inject include_usage); say what changed."""
        ...

    def set_max_tokens(self, body: dict[str, Any], value: int) -> None:
        """Write a max-output-tokens value in this dialect's field (admission's clamp)."""
        ...

    def parse_response(self, body: Any) -> list[StreamEvent]: ...

    def parse_event(self, event: SseEvent) -> list[StreamEvent]: ...

    def render_error(self, error: ProxyError, request_id: str) -> bytes:
        """The dialect's JSON error body for `error`, which the SDK raises with its message."""
        ...

    def render_stream_error(self, error: ProxyError) -> bytes:
        """A terminal SSE event carrying `error`, for failures after the stream began."""
        ...

    def auth_headers(self, key: str) -> dict[str, str]:
        """Headers carrying an upstream key in this dialect's own scheme."""
        ...


def integer(value: Any) -> int | None:
    """A JSON integer, or None (booleans are not integers here)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def string(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def array(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def number(value: Any) -> float | None:
    """A JSON number as float; anything else (bool, str, None) as None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def text_of(content: Any) -> str:
    """Text of a message content: a string, or the text parts of a list of parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if isinstance(part, dict):
                t = part.get("text")
                if isinstance(t, str):
                    out.append(t)
            elif isinstance(part, str):
                out.append(part)
        return "".join(out)
    return ""
