"""The stream of one call's answer, event by event: what the relay feeds between the
upstream's chunks and the client's writes. Pure; per call (`Answer.stream()` opens it).

Bytes go to the client before the observer sees them only in the sense that observation
never delays or fails the write: a parse failure becomes an observer note, never an
exception into the stream. Everything read in one upstream chunk goes out in one write.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol, TypeVar

from proxy.model import StreamEvent
from proxy.providers.hooks import Hooks
from proxy.providers.observer import Observer
from proxy.providers.roles import AnswerReader, Events
from proxy.providers.shortcut import TextShortcut
from proxy.providers.sse import Framer, parse_sse_event

__all__ = ["ChunkRelay", "StreamRelay", "safely_parsed"]

T = TypeVar("T")
log = logging.getLogger("spanmeter.relay")


class ChunkRelay(Protocol):
    """What the relay asks of a stream's reader, whatever its framing."""

    def feed(self, chunk: bytes) -> bytes:
        """The bytes to send the client for what `chunk` completes."""
        ...

    def flush(self) -> bytes:
        """The bytes still held at the stream's end."""
        ...

    def release(self) -> bytes:
        """What is held, as it is held: the stream was cut."""
        ...


class StreamRelay:
    """What relaying one stream does between the upstream's chunks and the client's writes:
    frame the events, feed the observer, let the hooks rewrite.

    While no hook reads the answer's text (`Hooks.reads_text`), a text delta whose shape
    this stream has shown before is taken by its bytes (proxy/providers/shortcut.py): no
    parse, no event objects, its bytes forwarded as they came. Every other event is parsed
    and offered to the hooks.
    """

    __slots__ = ("_events", "_framer", "_hooks", "_observer", "_shortcut", "taken")

    def __init__(self, reader: AnswerReader, events: Events, observer: Observer, hooks: Hooks) -> None:
        self._events = events  # this answer's reader of events (Answer's `events`)
        self._observer = observer
        self._hooks = hooks
        self._framer = Framer()
        shape = reader.text_shape
        self._shortcut = None if shape is None or hooks.reads_text else TextShortcut(reader, shape, observer)
        self.taken = 0  # events taken by their bytes, unparsed

    def feed(self, chunk: bytes) -> bytes:
        """The bytes to send the client for what `chunk` completes."""
        shortcut = self._shortcut
        if self._framer.single(chunk):
            if shortcut is not None and not self._holding() and shortcut.take(chunk, 0, len(chunk)):
                self.taken += 1
                return chunk
            out = self._event(chunk)
            return chunk if out is None else out
        ends = self._framer.begin(chunk)
        buf = ends.buf
        parts: list[bytes] = []
        sent, start = 0, ends.first  # buf[sent:start] goes out as it came
        while (end := ends.after(start)) != -1:
            if shortcut is not None and not self._holding() and shortcut.take(buf, start, end):
                # The text deltas right after it of its shape, in one loop: nothing but the
                # observer sees them, so no hook starts or stops holding in between.
                n, end = shortcut.take_more(buf, end, ends)
                self.taken += 1 + n
            else:
                out = self._event(buf[start:end])
                if out is not None:
                    parts += (buf[sent:start], out)
                    sent = end
            start = end
        self._framer.keep(ends, start)
        if not parts:
            return buf[:start]
        parts.append(buf[sent:start])
        return b"".join(parts)

    def flush(self) -> bytes:
        """The bytes for an unterminated last event and what the hooks still hold, at the
        stream's end."""
        raw = self._framer.flush_raw()
        if raw is None:
            last = b""
        elif not raw.strip():
            last = raw  # line ends after the last event: no event, forwarded as they came
        else:
            out = self._event(raw)
            last = raw if out is None else out
        return last + self.release()

    def release(self) -> bytes:
        """What the hooks hold, as they hold it: the stream ends."""
        return b"".join(h.release() for h in self._hooks.holds)

    def _holding(self) -> bool:
        holds = self._hooks.holds
        return bool(holds) and any(h.held for h in holds)

    def _event(self, raw: bytes) -> bytes | None:
        """An event parsed in full, fed and offered to the hooks: its replacement, or None."""
        observer = self._observer
        event = parse_sse_event(raw)
        parsed = safely_parsed(self._events.parse_event, event, observer)
        observer.feed(parsed)
        if self._shortcut is not None:
            self._shortcut.learn(event, parsed)
        # The first hook that claims an event decides its bytes; the hooks of one call never
        # claim the same events (the usage-only chunk has no text to repair).
        for hook in self._hooks.on_event:
            try:
                out = hook(event, parsed)
            except Exception:  # never cut a client's stream over a rewrite
                log.exception("stream rewrite failed; forwarding the event unchanged")
                observer.note("rewrite_failed")
                continue
            if out is not None:
                return out
        return None


def safely_parsed(fn: Callable[[T], list[StreamEvent]], arg: T, observer: Observer) -> list[StreamEvent]:
    """`fn(arg)`, or no events and a note when the upstream's bytes are not what the API
    module reads (never an exception into the answer)."""
    try:
        return fn(arg)
    except (ValueError, TypeError, KeyError, AttributeError, IndexError):
        observer.note("unparsed_event")
        return []
