"""The SSE framer: events out as soon as complete, raw bytes kept, at every chunk split,
with lines ended by CRLF, LF or CR in any mix (the SSE spec allows each)."""

from __future__ import annotations

import itertools
import re

import pytest

from proxy.providers.base import Framer, parse_sse_event

CASES = [
    ("openai data lines", b'data: {"a":1}\n\ndata: [DONE]\n\n', [(None, '{"a":1}'), (None, "[DONE]")]),
    ("anthropic event and data lines", b"event: ping\ndata: {}\n\nevent: message_stop\ndata: {\"x\":2}\n\n",
     [("ping", "{}"), ("message_stop", '{"x":2}')]),
    ("gemini CRLF framing", b'data: {"c":1}\r\n\r\ndata: {"c":2}\r\n\r\n', [(None, '{"c":1}'), (None, '{"c":2}')]),
    ("data without a space and a comment", b": keepalive\ndata:{\"b\":1}\n\n", [(None, '{"b":1}')]),
    ("multi-line data joins with newlines", b"data: one\ndata: two\n\n", [(None, "one\ntwo")]),
    ("utf-8 split across chunks", 'data: "héllo ✓"\n\n'.encode(), [(None, '"héllo ✓"')]),
    ("LF then CRLF ends an event", b"event: a\ndata: 1\n\r\nevent: b\ndata: 2\n\r\n", [("a", "1"), ("b", "2")]),
    ("CRLF then LF ends an event", b"data: 1\r\n\ndata: 2\r\n\n", [(None, "1"), (None, "2")]),
    ("CR CR ends an event", b"data: 1\r\rdata: 2\r\r", [(None, "1"), (None, "2")]),
    ("CR then CRLF ends an event", b"data: 1\r\r\ndata: 2\r\r\n", [(None, "1"), (None, "2")]),
    ("CRLF then CR ends an event", b"data: 1\r\n\rdata: 2\r\n\r", [(None, "1"), (None, "2")]),
    ("LF then CR ends an event", b"data: 1\n\rdata: 2\n\r", [(None, "1"), (None, "2")]),
]

ENDS = (b"\n", b"\r\n", b"\r")


def _spec(stream: bytes) -> tuple[list[tuple[str | None, str]], list[int]]:
    """The events of a whole stream read line by line as the SSE spec does (a line ends at
    CRLF, LF or CR), each with where it is complete: once the first byte of its blank
    line's end has arrived. Events with no line but blank ones carry nothing and are left out."""
    events, ready = [], []
    name: str | None = None
    data: list[bytes] = []
    seen = False
    for m in re.finditer(rb"([^\r\n]*)(\r\n|\r|\n)", stream):
        line = m.group(1)
        if line:
            seen = True
            if line.startswith(b"data:"):
                data.append(line[6:] if line[5:6] == b" " else line[5:])
            elif line.startswith(b"event:"):
                name = line[6:].decode().strip()
            continue
        if seen:
            events.append((name, b"\n".join(data).decode()))
            ready.append(m.start(2) + 1)
        name, data, seen = None, [], False
    return events, ready


def _fields(raws: list[bytes]) -> list[tuple[str | None, str]]:
    out = []
    for e in (parse_sse_event(r) for r in raws):
        if e.raw.strip(b"\r\n"):
            out.append((e.event, e.data))
    return out


@pytest.mark.parametrize("name,stream,expected", CASES, ids=[c[0] for c in CASES])
def test_every_split_point_gives_the_same_events_and_raw_bytes(name, stream, expected):
    assert _spec(stream)[0] == expected  # the table agrees with the spec's reading
    for cut in range(len(stream) + 1):
        f = Framer()
        raws = f.split(stream[:cut]) + f.split(stream[cut:])
        assert _fields(raws) == expected, cut
        tail = f.flush_raw()
        assert tail is None or not tail.strip(b"\r\n")  # at most the LF of a CRLF cut in two
        assert b"".join(raws) + (tail or b"") == stream


def _mixes() -> list[bytes]:
    """Two events (an event line and two data lines) for every choice of each line's end
    and the blank line's end, one after another: every line-end mix but CR then LF (one CRLF, not a blank line)."""
    out = []
    for a, b, c, blank in itertools.product(ENDS, repeat=4):
        if c == b"\r" and blank == b"\n":
            continue  # that is one CRLF, not two line ends: no blank line
        event = b"event: e" + a + b"data: {\"x\":1}" + b + b"data: 2" + c + blank
        out.append(event + event.replace(b"1", b"3"))
    return out


@pytest.mark.parametrize("stream", _mixes(), ids=lambda s: repr(s[8:]).replace("\\", "/"))
def test_every_mix_of_line_ends_at_every_chunk_boundary(stream: bytes) -> None:
    expected, ready = _spec(stream)
    assert expected == [("e", '{"x":1}\n2'), ("e", '{"x":3}\n2')]
    for cut in range(len(stream) + 1):
        f = Framer()
        first = f.split(stream[:cut])
        # An event is out as soon as its blank line's first byte arrives, not later.
        assert len([r for r in first if r.strip(b"\r\n")]) == sum(1 for at in ready if at <= cut), cut
        rest = f.split(stream[cut:])
        assert _fields(first + rest) == expected, cut
        tail = f.flush_raw()
        assert tail is None or not tail.strip(b"\r\n")  # at most the LF of a CRLF cut in two
        assert b"".join(first + rest) + (tail or b"") == stream
    # One byte at a time.
    f = Framer()
    raws = [r for i in range(len(stream)) for r in f.split(stream[i:i + 1])]
    assert _fields(raws) == expected and b"".join(raws) + (f.flush_raw() or b"") == stream


def test_a_cr_that_ends_a_chunk_ends_the_event_and_the_lf_after_it_is_not_a_blank_line():
    f = Framer()
    assert [e.data for e in f.feed(b"data: 1\r\n\r")] == ["1"]  # not held back for a possible LF
    # The LF completes that CRLF: no empty event of its own, and the next event reads right.
    assert f.feed(b"\n") == []
    events = f.feed(b"data: 2\r\n\r\n")
    assert [(e.data, e.raw) for e in events] == [("2", b"\ndata: 2\r\n\r\n")]


def test_an_unterminated_last_event_comes_out_on_flush():
    f = Framer()
    assert [e.data for e in f.feed(b"data: 1\n\ndata: 2")] == ["1"]
    tail = f.flush()
    assert tail is not None and tail.data == "2"


def test_an_event_is_released_as_soon_as_its_blank_line_arrives():
    f = Framer()
    assert f.feed(b"data: 1\n") == []
    assert [e.data for e in f.feed(b"\n")] == ["1"]
    assert f.feed(b"data: 2\n") == []
    assert [e.data for e in f.feed(b"\r\n")] == ["2"]
