"""Server-sent events: the one framing of every API's stream (the relay, its text-delta
shortcut and the MCP route), and one event parsed. Pure."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

__all__ = ["EventEnds", "Framer", "SseEvent", "parse_sse_event"]

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


class Framer:
    """Splits a byte stream into SSE events as soon as each is complete: the one framing of
    every API's stream (the relay, its text-delta shortcut and the MCP route read
    events through it).

    An event ends at a blank line, and per the SSE spec a line ends at CRLF, LF or CR, in
    any mix (`\n\r\n` is LF then CRLF: a blank line). Keeps only the unfinished tail
    between calls, so the work is linear in the stream. The raw bytes of each event
    (terminator included) are kept so that the relay forwards them unchanged: Anthropic
    needs its `event:` lines, google-genai needs `data: ` exactly as the upstream wrote it.

    A CR that ends a blank line at the very end of a chunk ends the event at once (it is
    not held back in case an LF follows); an LF that then opens the next chunk is the rest
    of that CRLF, not a line of its own: `split` hands it out with the next event's bytes,
    the relay forwards it on its own (`EventEnds.first`).
    """

    __slots__ = ("_cr", "_tail")

    def __init__(self) -> None:
        self._tail = b""
        self._cr = False  # the bytes before `_tail` ended in a CR that ended an event

    def feed(self, chunk: bytes) -> list[SseEvent]:
        return [parse_sse_event(raw) for raw in self.split(chunk)]

    def split(self, chunk: bytes) -> list[bytes]:
        """The raw bytes of each event `chunk` completes: one slice each, nothing parsed."""
        ends = self.begin(chunk)
        events: list[bytes] = []
        start = 0
        while (end := ends.after(start)) != -1:
            events.append(ends.buf[start:end])
            start = end
        self.keep(ends, start)
        return events

    def single(self, chunk: bytes) -> bool:
        """Whether `chunk` is one whole event and nothing is held back: what a model's stream
        mostly is, one event per write (LF framing; anything else is found by `begin`)."""
        return (not self._tail and not self._cr and chunk.endswith(b"\n\n")
                and chunk.find(b"\n\n") == len(chunk) - 2 and b"\r" not in chunk)

    def begin(self, chunk: bytes) -> EventEnds:
        """The bytes held back so far and `chunk`, to find the events in; `keep` says where
        the unfinished rest starts (the relay reads events in place, unsliced)."""
        buf = self._tail + chunk if self._tail else chunk
        ends = EventEnds(buf, 1 if self._cr and buf.startswith(b"\n") else 0)
        self._tail = b""
        return ends

    def keep(self, ends: EventEnds, start: int) -> None:
        buf = ends.buf
        self._tail = buf[start:] if start else buf
        if start:
            self._cr = buf[start - 1] == 0x0D
        elif buf:
            self._cr = self._cr and buf[0] == 0x0A  # the held tail still opens with that LF

    def flush(self) -> SseEvent | None:
        """The last event when the stream ended without a blank line."""
        raw = self.flush_raw()
        return None if raw is None or not raw.strip() else parse_sse_event(raw)

    def flush_raw(self) -> bytes | None:
        """The bytes held back at the stream's end (an unterminated event, or line ends
        after the last one: the relay forwards every byte); None when there are none."""
        tail, self._tail = self._tail, b""
        self._cr = False
        return tail or None


class EventEnds:
    """Where the SSE events in one buffer end: after the earliest blank line from an
    event's start.

    Two line ends in a row, whichever of CRLF, LF, CR each is, always show as one of
    three byte pairs: LF LF, LF CR or CR CR (CR LF is one line end, never two). So the
    earliest of those pairs is where the blank line starts; it ends two bytes on, or three
    when its CR is the start of a CRLF. Each pair is looked for again only once passed, so
    a buffer is read once, however many events it holds. `skip` leading bytes belong to
    the event before (the LF of a CRLF whose CR ended it in an earlier chunk).
    """

    __slots__ = ("_cr", "_lf", "_lfcr", "_skip", "buf", "first")

    def __init__(self, buf: bytes, skip: int = 0) -> None:
        self.buf = buf
        # Where the first event starts: the relay forwards a skipped LF as it came, outside
        # any event, so an event's bytes are the same however the stream was cut.
        self.first = self._skip = skip
        self._lf = buf.find(b"\n\n", skip)
        # The common framing (OpenAI, Anthropic) has no CR: only LF LF is looked for.
        self._lfcr = self._cr = -1 if b"\r" not in buf else -2  # -2: not looked for yet

    def after(self, start: int) -> int:
        """The end of the event that starts at `start`, blank line included; -1: unfinished."""
        buf, lf = self.buf, self._lf
        if start < self._skip:
            start = self._skip
        if lf != -1 and lf < start:
            lf = self._lf = buf.find(b"\n\n", start)
        lfcr, cr = self._lfcr, self._cr
        if lfcr == -1 and cr == -1:
            return -1 if lf == -1 else lf + 2
        if lfcr != -1 and lfcr < start:
            lfcr = self._lfcr = buf.find(b"\n\r", start)
        if cr != -1 and cr < start:
            cr = self._cr = buf.find(b"\r\r", start)
        at = lf
        if lfcr != -1 and (at == -1 or lfcr < at):
            at = lfcr
        if cr != -1 and (at == -1 or cr < at):
            at = cr
        if at == -1:
            return -1
        end = at + 2
        # The blank line's own end is a CRLF: its LF is part of it.
        return end + 1 if buf[end - 1] == 0x0D and buf[end:end + 1] == b"\n" else end


def parse_sse_event(raw: bytes) -> SseEvent:
    """One SSE event from its raw bytes (blank line included): its name and its data lines joined."""
    # The framings of nearly every event, read by position: one data line (OpenAI, Gemini's
    # CRLF), or an event line and a data line (Anthropic, Responses).
    if b"\r" not in raw:
        if raw.endswith(b"\n\n"):
            newlines = raw.count(b"\n")
            if newlines == 2 and raw.startswith(b"data: "):
                return SseEvent(raw, None, raw[6:-2].decode("utf-8", "replace"))
            if newlines == 3 and raw.startswith(b"event: "):
                nl = raw.find(b"\n")
                if raw.startswith(b"data: ", nl + 1):
                    return SseEvent(raw, raw[7:nl].decode("utf-8", "replace").strip(),
                                    raw[nl + 7:-2].decode("utf-8", "replace"))
    elif raw.startswith(b"data: ") and raw.endswith(b"\r\n\r\n") and raw.count(b"\n") == 2 and raw.count(b"\r") == 2:
        return SseEvent(raw, None, raw[6:-4].decode("utf-8", "replace"))
    # Lines end at CR, LF or CRLF and nowhere else (a U+2028 in a JSON string is no line end).
    lines = raw.split(b"\n") if b"\r" not in raw else raw.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
    name: str | None = None
    data: list[bytes] = []
    for line in lines:
        if line.startswith(b"data:"):
            data.append(line[6:] if line[5:6] == b" " else line[5:])
        elif line.startswith(b"event:"):
            name = line[6:].decode("utf-8", "replace").strip()
    return SseEvent(raw, name, b"\n".join(data).decode("utf-8", "replace"))
