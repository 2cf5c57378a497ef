"""AWS event streams (`application/vnd.amazon.eventstream`): the framing of Bedrock's streamed
answers, beside SSE's (proxy/providers/sse.py). Pure; per call.

A frame is binary: a prelude (total length, headers length, CRC32 of the two), typed
headers (`:message-type` event | exception, `:event-type` or `:exception-type`,
`:content-type`), the payload, and a CRC32 of the whole. Frames are decoded with botocore's
parser (`botocore.eventstream`, the `bedrock` extra), which checks both CRCs; each decoded
frame reaches the API module's reader as an `SseEvent` whose `event` is the frame's event
(or exception) type and whose `data` is its payload, so an API module reads both framings
through the one `Events.parse_event`.

The client gets the upstream's frames byte for byte. The relay forwards whole frames only,
as the SSE relay forwards whole events: a stream cut inside a frame then ends with a whole
exception frame of spanmeter's, which the client's parser can read, rather than with half a
frame and garbage after it. Frames are never rewritten (that would mean re-encoding them
and their CRCs): the stream rewriters of the repair driver are SSE's alone.
"""

from __future__ import annotations

import logging
import struct
import zlib
from collections.abc import Callable

import orjson

from proxy.model import StreamEvent
from proxy.providers.base import Events
from proxy.providers.hooks import Hooks
from proxy.providers.observer import Observer
from proxy.providers.sse import SseEvent

__all__ = ["EVENTSTREAM", "EventStreamRelay", "exception_frame", "frame"]

log = logging.getLogger("spanmeter.relay")

EVENTSTREAM = "application/vnd.amazon.eventstream"
_PRELUDE = 12  # total length, headers length, prelude CRC: 4 bytes each
_STRING = 7  # header value type: a UTF-8 string with a 2-byte length


class EventStreamRelay:
    """The stream of one answer in AWS event-stream frames: the same surface as the SSE
    relay (`feed`, `flush`, `release`) so the relay does not know which framing it reads.

    `notes`: where the reader leaves what the observer should note (a usage disagreement),
    drained after each frame; `at_end`, called once the stream has ended whole."""

    __slots__ = ("_at_end", "_broken", "_buffer", "_events", "_hooks", "_notes", "_observer", "_pending", "taken")

    def __init__(self, events: Events, observer: Observer, hooks: Hooks,
                 notes: Callable[[], list[str]] | None = None, at_end: Callable[[], None] | None = None) -> None:
        from botocore.eventstream import EventStreamBuffer  # the `bedrock` extra: imported when a stream comes

        self._events = events
        self._observer = observer
        self._hooks = hooks
        self._notes = notes
        self._at_end = at_end
        self._buffer = EventStreamBuffer()
        self._pending = b""  # bytes of frames not complete yet: held until they are
        self._broken = False  # a frame failed its CRC or its lengths: forwarded as it comes from then on
        self.taken = 0  # events taken unparsed: none in this framing (the SSE relay's count)

    def feed(self, chunk: bytes) -> bytes:
        """The bytes to send the client for the frames `chunk` completes."""
        if self._broken:
            return chunk
        from botocore.eventstream import ParserError

        self._buffer.add_data(chunk)
        pending = self._pending + chunk if self._pending else chunk
        done = 0
        try:
            for message in self._buffer:
                done += message.prelude.total_length
                self._frame(message.headers, message.payload)
        except ParserError:
            # Not frames botocore (or the client's SDK) can read: nothing more is parsed, every
            # byte goes on as it came, and the call is settled at its reservation if no usage came.
            self._broken = True
            self._observer.note("unparsed_event")
            self._pending = b""
            return pending
        self._pending = pending[done:]
        return pending[:done]

    def flush(self) -> bytes:
        """At the stream's end: an unfinished frame goes on as it came (the client's parser
        decides), and is noted."""
        rest, self._pending = self._pending, b""
        if rest:
            self._observer.note("unfinished_frame")
        if self._at_end is not None:
            self._at_end()
        return rest

    def release(self) -> bytes:
        """What is held for the client when the stream is cut: an unfinished frame is dropped,
        so the error frame after it starts on a frame boundary."""
        self._pending = b""
        return b""

    def _frame(self, headers: dict[str, object], payload: bytes) -> None:
        kind = headers.get(":message-type")
        name = headers.get(":exception-type") if kind == "exception" else headers.get(":event-type")
        event = SseEvent(b"", name if isinstance(name, str) else None, payload.decode("utf-8", "replace"))
        if kind == "exception":
            event = SseEvent(b"", f"exception:{event.event}", event.data)
        observer = self._observer
        try:
            parsed: list[StreamEvent] = self._events.parse_event(event)
        except (ValueError, TypeError, KeyError, AttributeError, IndexError, orjson.JSONDecodeError):
            observer.note("unparsed_event")
            parsed = []
        observer.feed(parsed)
        if self._notes is not None:
            for note in self._notes():
                observer.note(note)


def _header(name: str, value: str) -> bytes:
    key, text = name.encode(), value.encode()
    return struct.pack(">B", len(key)) + key + struct.pack(">BH", _STRING, len(text)) + text


def frame(headers: dict[str, str], payload: bytes) -> bytes:
    """One event-stream frame with string headers, as AWS encodes them (its CRCs included).
    botocore has a decoder and no public encoder; spanmeter writes only its own error frames."""
    head = b"".join(_header(k, v) for k, v in headers.items())
    total = _PRELUDE + len(head) + len(payload) + 4
    prelude = struct.pack(">II", total, len(head))
    prelude += struct.pack(">I", zlib.crc32(prelude))
    body = prelude + head + payload
    return body + struct.pack(">I", zlib.crc32(body))


def exception_frame(exception_type: str, message: str) -> bytes:
    """An `exception` frame, as Bedrock ends a stream that fails (botocore raises it as an
    EventStreamError with `exception_type` as its code)."""
    return frame({":exception-type": exception_type, ":content-type": "application/json",
                  ":message-type": "exception"}, orjson.dumps({"message": message}))
