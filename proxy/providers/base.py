"""The adapter seam: one adapter per wire format, pure functions over parsed bodies.

An adapter never does I/O, never reads a clock and never touches globals, so it is
tested from recorded fixtures alone (tests/data/<dialect>/).

The handler parses the request body once (orjson) and hands the dict to
`parse_request`; responses come back as `StreamEvent`s, from a whole body
(`parse_response`) or one SSE event at a time (`parse_event`), and one shared
`Observer` folds either into an `Outcome`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import orjson

from proxy.errors import MalformedBody, ProxyError
from proxy.model import Call, Outcome, Rewrite, StreamEvent

__all__ = [
    "MAX_OUTPUT_MULTIPLIER",
    "MAX_TOKENS_LIMIT",
    "Exchange",
    "Framer",
    "ProviderAdapter",
    "SseEvent",
    "array",
    "count_field",
    "integer",
    "number",
    "open_exchange",
    "string",
    "text_of",
]

# The largest max-token value any API accepts is far below this; larger values are refused
# at the edge rather than overflowing a 64-bit ledger column later.
MAX_TOKENS_LIMIT = 2**31 - 1
# OpenAI accepts n <= 128; Gemini candidateCount <= 8. A multiplier is bounded by the
# larger, so a new provider limit still reserves exactly what the request asks for.
MAX_OUTPUT_MULTIPLIER = 128


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
    """What the rest of spanmeter needs from a wire format; nothing else knows one.

    Example (chat)::

        ex = CHAT.open(raw, "/v1/chat/completions")   # the request's facts in ex.call
        events = CHAT.parse_response(orjson.loads(upstream_body))
    """

    api: str  # one of proxy.model.Api
    upstream_setting: str  # which settings field holds this dialect's base URL
    text_part: str  # the type of a text part in a tool result's content list
    # Bytes that mark an explicit prompt-cache breakpoint (Anthropic `cache_control`),
    # whose writes bill above plain input; None when the API bills no write premium.
    cache_marker: bytes | None

    def parse_request(self, body: dict[str, Any], path: str) -> Call:
        """The call's facts; refuses (MalformedBody) a field that changes cost and is not
        a value the API accepts."""
        ...

    def prepare(self, ex: Exchange) -> list[Rewrite]:
        """Patch the upstream request (e.g. inject include_usage); say what changed."""
        ...

    def set_max_tokens(self, ex: Exchange, value: int) -> None:
        """Write a max-output-tokens value in the field this model family takes (the clamp)."""
        ...

    def tool_result_slots(self, body: dict[str, Any], call_id: str) -> list[tuple[dict[str, Any], str]]:
        """(holder, key) of each tool result for `call_id` in the request, in order."""
        ...

    def append_note(self, ex: Exchange, text: str) -> bool:
        """Place a note for the model after the request's last message, in the dialect's own
        shape, leaving every earlier byte as it was (the provider's prompt cache keeps
        matching); False when the request has no conversation to add it to."""
        ...

    def stored_sizes(self, call: Call, outcome: Outcome) -> dict[str, int]:
        """Stored context this answer revealed the size of, in tokens (see Call.stored_context)."""
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


def open_exchange(adapter: ProviderAdapter, raw: bytes, path: str) -> Exchange:
    """The exchange of one call: the body parsed once, the facts read, bad values refused."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise MalformedBody(
            f"The request body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno} "
            f"(byte {exc.pos}). Send a JSON object as the {adapter.api} API expects.") from None
    if not isinstance(body, dict):
        raise MalformedBody(f"The request body must be a JSON object, not {type(body).__name__}.")
    try:
        call = adapter.parse_request(body, path)
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        raise MalformedBody(f"The request body has a field of the wrong type ({exc}).") from None
    return Exchange(adapter, replace(call, body_bytes=len(raw), cache_write=_cache_write(adapter, raw)), raw, body)


def _cache_write(adapter: ProviderAdapter, raw: bytes) -> str:
    """The dearest cache write the request may cause: a byte scan (the body is JSON text,
    so a breakpoint's key appears verbatim; a false positive only reserves more)."""
    if adapter.cache_marker is None or adapter.cache_marker not in raw:
        return ""
    return "1h" if b'"1h"' in raw else "5m"


class Exchange:
    """One model call's request as it will go upstream: its facts and its patches.

    Opened from the bytes exactly as received. A request nobody patches goes upstream byte
    for byte; a new top-level field (a max-token clamp, stream_options) is spliced into the
    bytes, so a 45 KB conversation is not re-serialised to add one field; only an edit
    inside the conversation (a loop-guard reminder) re-serialises the body.
    """

    __slots__ = ("_added", "_edited", "adapter", "body", "call", "raw")

    def __init__(self, adapter: ProviderAdapter, call: Call, raw: bytes, body: dict[str, Any]) -> None:
        self.adapter = adapter
        self.call = call
        self.raw = raw
        self.body = body
        self._added: dict[str, Any] = {}
        self._edited = False

    def set_top(self, key: str, value: Any) -> None:
        """Set a top-level field of the request."""
        if key in self.body and key not in self._added:
            self._edited = True
        else:
            self._added[key] = value
        self.body[key] = value

    def edited(self) -> None:
        """Say that `body` was changed in place below the top level."""
        self._edited = True

    def prefix_tool_result(self, call_id: str, text: str) -> bool:
        """Prefix `text` to the last tool result for `call_id`, in the dialect's own shape."""
        slots = self.adapter.tool_result_slots(self.body, call_id)
        if not slots:
            return False
        holder, key = slots[-1]
        value = holder.get(key)
        if isinstance(value, str):
            holder[key] = text + value
        elif isinstance(value, list):
            value.insert(0, {"type": self.adapter.text_part, "text": text})
        elif isinstance(value, dict):  # Gemini functionResponse.response
            holder[key] = {"spanmeter_reminder": text.strip(), **value}
        else:
            holder[key] = text
        self._edited = True
        return True

    def raw_value(self, path: Path) -> bytes | None:
        """The exact bytes of the value at `path` (keys and indexes, -1 = last) in the request
        as it will go upstream; None when the path is not there."""
        text = self.raw.decode()
        span = _locate(text, path)
        return None if span is None else text[span[0]:span[1]].encode()

    def append_item(self, path: Path, item: Any) -> bool:
        """Append `item` to the array at `path`: in `body`, and spliced into the bytes before
        the array's closing bracket, so every byte before it is forwarded unchanged."""
        array = _follow(self.body, path)
        text = self.raw.decode()
        span = _locate(text, path)
        if not isinstance(array, list) or span is None or text[span[0]] != "[":
            return False
        close = span[1] - 1
        sep = "," if text[span[0] + 1:close].strip() else ""
        self.raw = (text[:close] + sep + orjson.dumps(item).decode() + text[close:]).encode()
        array.append(item)
        return True

    def replace_value(self, path: Path, value: Any, encoded: bytes) -> bool:
        """Put `value` at `path` in `body` and its JSON text `encoded` in place of the old
        value's bytes (so `encoded` may keep parts of them, byte for byte)."""
        text = self.raw.decode()
        span = _locate(text, path)
        holder = _follow(self.body, path[:-1])
        if span is None or not path or not isinstance(holder, dict | list):
            return False
        self.raw = (text[:span[0]] + encoded.decode() + text[span[1]:]).encode()
        holder[path[-1]] = value  # type: ignore[index]
        return True

    def request_bytes(self) -> bytes:
        if self._edited:
            return orjson.dumps(self.body)
        if not self._added:
            return self.raw
        end = self.raw.rindex(b"}")  # the body parsed as a JSON object: its last byte is `}`
        fields = b",".join(orjson.dumps(k) + b":" + orjson.dumps(v) for k, v in self._added.items())
        sep = b"," if len(self.body) > len(self._added) else b""
        return self.raw[:end] + sep + fields + self.raw[end:]


Path = Sequence[str | int]
_DECODER = json.JSONDecoder()
_WS = re.compile(r"[ \t\n\r]*")


def _skip(text: str, i: int) -> int:
    """The position of the first non-whitespace character from `i`."""
    m = _WS.match(text, i)
    return m.end() if m else i


def _follow(body: Any, path: Path) -> Any:
    """The value at `path` in parsed JSON, or None."""
    for step in path:
        if isinstance(step, str) and isinstance(body, dict):
            body = body.get(step)
        elif isinstance(step, int) and isinstance(body, list) and -len(body) <= step < len(body):
            body = body[step]
        else:
            return None
    return body


def _members(text: str, start: int) -> list[tuple[str | int, int, int]]:
    """(key or index, start, end) of each member of the object or array opening at `start`.

    Positions in the JSON text of a body that already parsed: the stdlib's C scanner
    (`raw_decode`) measures each value, so nothing is re-serialised."""
    opener = text[start]
    close = "}" if opener == "{" else "]"
    i = _skip(text, start + 1)
    out: list[tuple[str | int, int, int]] = []
    if text[i] == close:
        return out
    while True:
        name: str | int = len(out)
        if opener == "{":
            name, i = _DECODER.raw_decode(text, i)
            i = _skip(text, _skip(text, i) + 1)  # past the colon
        _, end = _DECODER.raw_decode(text, i)
        out.append((name, i, end))
        i = _skip(text, end)
        if text[i] != ",":
            return out
        i = _skip(text, i + 1)


def _locate(text: str, path: Path) -> tuple[int, int] | None:
    """[start, end) of the value at `path` in JSON `text`; of repeated keys the last one,
    which is the one a parser keeps. None when it is not there, or the text is nested
    deeper than the stdlib's scanner goes (orjson takes 1024 levels, Python's ~1000)."""
    try:
        return _walk(text, path)
    except (ValueError, IndexError, RecursionError):
        return None


def _walk(text: str, path: Path) -> tuple[int, int] | None:
    start = _skip(text, 0)
    end = len(text.rstrip())
    for step in path:
        if text[start] not in "{[" or (isinstance(step, str)) != (text[start] == "{"):
            return None
        members = _members(text, start)
        if isinstance(step, str):
            found = [(s, e) for name, s, e in members if name == step]
        else:
            found = [(s, e) for _, s, e in members[step:][:1]] if -len(members) <= step < len(members) else []
        if not found:
            return None
        start, end = found[-1]
    return start, end


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


def count_field(name: str, value: Any, *, upper: int, what: str) -> int | None:
    """A positive whole-number request field (a max-token value, a choice count), or None
    when absent; anything else is refused, since it changes what the call may cost."""
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer() and value >= 1:
        value = int(value)  # 512.0 is a whole number, as the APIs read it
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= upper:
        shown = orjson.dumps(value).decode()[:40]  # parsed by orjson, so it serialises
        raise MalformedBody(
            f"`{name}` must be a whole number from 1 to {upper:,} ({what}), got {shown}. "
            f"Send a positive integer, or leave `{name}` out.", param=name)
    return value


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
