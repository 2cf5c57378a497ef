"""The SSE framer: events out as soon as complete, raw bytes kept, at every chunk split."""

from __future__ import annotations

import pytest

from proxy.providers.base import Framer

CASES = [
    ("openai data lines", b'data: {"a":1}\n\ndata: [DONE]\n\n', [(None, '{"a":1}'), (None, "[DONE]")]),
    ("anthropic event and data lines", b"event: ping\ndata: {}\n\nevent: message_stop\ndata: {\"x\":2}\n\n",
     [("ping", "{}"), ("message_stop", '{"x":2}')]),
    ("gemini CRLF framing", b'data: {"c":1}\r\n\r\ndata: {"c":2}\r\n\r\n', [(None, '{"c":1}'), (None, '{"c":2}')]),
    ("data without a space and a comment", b": keepalive\ndata:{\"b\":1}\n\n", [(None, '{"b":1}')]),
    ("multi-line data joins with newlines", b"data: one\ndata: two\n\n", [(None, "one\ntwo")]),
    ("utf-8 split across chunks", 'data: "héllo ✓"\n\n'.encode(), [(None, '"héllo ✓"')]),
]


@pytest.mark.parametrize("name,stream,expected", CASES, ids=[c[0] for c in CASES])
def test_every_split_point_gives_the_same_events_and_raw_bytes(name, stream, expected):
    for cut in range(len(stream) + 1):
        f = Framer()
        events = f.feed(stream[:cut]) + f.feed(stream[cut:])
        assert [(e.event, e.data) for e in events] == expected, cut
        assert b"".join(e.raw for e in events) == stream
        assert f.flush() is None


def test_an_unterminated_last_event_comes_out_on_flush():
    f = Framer()
    assert [e.data for e in f.feed(b"data: 1\n\ndata: 2")] == ["1"]
    tail = f.flush()
    assert tail is not None and tail.data == "2"


def test_an_event_is_released_as_soon_as_its_blank_line_arrives():
    f = Framer()
    assert f.feed(b"data: 1\n") == []
    assert [e.data for e in f.feed(b"\n")] == ["1"]
