"""Text deltas taken by their bytes (proxy/providers/shortcut.py) give what the full parse
gives: the same bytes to the client, the same outcome, the same hook records.

The full path is the same relay with the shortcut off (`Hooks.reads_text`, as when the
answer's text is repaired). Streams: every recorded stream of every dialect, those
streams with their text deltas multiplied (texts from hypothesis: escapes, unicode, raw
control characters, arbitrary bytes), cut at every byte and at random places.
"""

from __future__ import annotations

import base64
import itertools
import json
import re
from dataclasses import dataclass
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.config import DEFAULT_POLICY
from proxy.govern.outputs import response_hooks
from proxy.model import Outcome
from proxy.providers.hooks import Hooks
from proxy.providers.observer import Observer
from proxy.providers.sse import Framer, SseEvent, parse_sse_event
from proxy.providers.translator import Answer, open_call
from tests.fakes.replay import MISSING, decoded, recorded_pairs
from tests.providers.cases import ADAPTERS, DATA, ApiObject, Case, stream_cases

DIALECTS = ("chat", "anthropic", "responses", "gemini")


@dataclass
class Relayed:
    sent: bytes
    outcome: Outcome
    records: Any
    taken: int


Request = str | tuple[bytes, str]  # a fixture's name (made streaming), or a recorded (body, path)


def _answer(dialect: str, request: Request) -> Answer:
    """The answer of a fixture's request made streaming, or of a recorded (body, path) as sent."""
    if isinstance(request, tuple):
        raw, path = request
    else:
        req = orjson.loads((DATA / dialect / f"{request}.request.json").read_bytes())
        body, path = req["body"], req["path"]
        if dialect == "gemini":
            path = path.replace(":generateContent", ":streamGenerateContent")
        else:
            body = {**body, "stream": True}
        raw = orjson.dumps(body)
    tr = open_call(ADAPTERS[dialect], raw, path)
    assert tr.call.stream
    hooks = Hooks()
    hooks.rewrites += tr.request.prepare()
    answer = tr.answer(hooks)
    response_hooks(answer, DEFAULT_POLICY)
    return answer


def _hooks(dialect: str, request: Request) -> Hooks:
    return _answer(dialect, request).hooks


def _relay(adapter: ApiObject, dialect: str, request: Request, chunks: list[bytes], *, full: bool) -> Relayed:
    answer = _answer(dialect, request)
    hooks = answer.hooks
    assert not hooks.reads_text  # no structured output asked: the shortcut may run
    hooks.reads_text = full
    relay = answer.stream()
    sent = b"".join([*(relay.feed(c) for c in chunks), relay.flush()])
    records = ([r.header_value() for r in hooks.rewrites], hooks.repairs, hooks.delivered_text,
               hooks.delivered_arguments)
    answer.status, answer.complete = 200, True  # as the relay leaves a whole stream
    return Relayed(sent, answer.outcome(), records, relay.taken)


def _reference(adapter: ApiObject, dialect: str, request: Request, stream: bytes) -> tuple[bytes, Outcome]:
    """The stream relayed as the spec frames it, every event parsed, the first hook that
    claims an event deciding its bytes: what the relay must do however the stream is cut."""
    answer = _answer(dialect, request)
    hooks, observer, sent = answer.hooks, Observer(), []
    for raw in _reference_events(stream):
        event = _reference_parse(raw)
        try:
            parsed = answer.events.parse_event(event)  # this answer's reader: Gemini numbers calls per stream
        except (ValueError, TypeError, KeyError, AttributeError, IndexError):
            observer.note("unparsed_event")
            parsed = []
        observer.feed(parsed)
        sent.append(next((b for hook in hooks.on_event if (b := hook(event, parsed)) is not None), raw))
    return b"".join(sent), observer.finish(200)


def _same(dialect: str, chunks: list[bytes], request: Request = "stream") -> Relayed:
    adapter = ADAPTERS[dialect]
    full = _relay(adapter, dialect, request, chunks, full=True)
    fast = _relay(adapter, dialect, request, chunks, full=False)
    assert full.taken == 0
    sent, outcome = _reference(adapter, dialect, request, b"".join(chunks))
    assert full.outcome == outcome
    if any(a.endswith(b"\r") and b.startswith(b"\n") for a, b in itertools.pairwise(c for c in chunks if c)):
        # A CRLF cut in two ends its event at the CR; when a hook replaces that event, the
        # LF still goes out after it: a blank line more between events, the same events.
        assert _fields(full.sent) == _fields(sent)
    else:
        assert full.sent == sent
    assert fast.sent == full.sent
    assert fast.outcome == full.outcome
    assert fast.records == full.records
    return fast


def _events(raw: bytes) -> list[bytes]:
    sep = b"\r\n\r\n" if b"\r\n\r\n" in raw else b"\n\n"
    return [e + sep for e in raw.split(sep) if e.strip()]


def _first_delta(dialect: str) -> tuple[list[bytes], int, int, int]:
    """The dialect's recorded text stream's events, which of them is its first text delta,
    and where that delta's text starts and ends."""
    events = _events((DATA / dialect / "text_stream.sse").read_bytes())
    at = next(i for i, e in enumerate(events) if b'"Paris is' in e)
    start = events[at].index(b'"Paris is') + 1
    return events, at, start, events[at].index(b'"', start)


def _grown(dialect: str, insides: list[bytes]) -> bytes:
    """The dialect's recorded text stream with its first text delta repeated, once per
    `insides` (the bytes between the text's quotes)."""
    events, at, start, end = _first_delta(dialect)
    event = events[at]
    return b"".join([*events[:at], *(event[:start] + x + event[end:] for x in insides), *events[at:]])


@pytest.mark.parametrize("request_kind", ["stream", "tools"])
@pytest.mark.parametrize("case", [c for c in stream_cases() if c.dialect in DIALECTS], ids=str)
def test_every_recorded_stream_relays_the_same_through_the_shortcut(case: Case, request_kind: str) -> None:
    _same(case.dialect, [case.input], request_kind)
    _same(case.dialect, _events(case.input), request_kind)


@pytest.mark.parametrize("dialect", DIALECTS)
def test_a_long_answer_is_mostly_taken_by_its_bytes_and_cut_anywhere_relays_the_same(dialect: str) -> None:
    words = [b"Paris ", b"is ", b"\\\"sunny\\\" ", b"caf\\u00e9 ", "naïve ".encode(), b"\\ud83d\\ude00", b"\\n"]
    stream = _grown(dialect, [words[i % len(words)] for i in range(40)])
    whole = _same(dialect, [stream])
    assert whole.taken >= 35  # all but the first of a shape, when nothing reads the text
    assert whole.outcome.text.startswith('Paris is "sunny" café naïve 😀\nParis ')
    for cut in range(1, len(stream)):
        _same(dialect, [stream[:cut], stream[cut:]])
    _same(dialect, [stream[i:i + 1] for i in range(len(stream))])


_ENDS = (b"\n", b"\r\n", b"\r")
_WORDS = [b"Paris ", b"is ", b"sunny "] * 3
# (line end, blank line's end) pairs: every mix but CR then LF, which is one CRLF.
_MIXES = [(a, b) for a in _ENDS for b in _ENDS if not (a == b"\r" and b == b"\n")]


def _reframed(dialect: str, mixes: list[tuple[bytes, bytes]]) -> bytes:
    """The dialect's recorded text stream, its text deltas repeated (the shortcut takes
    them), with each event's lines ended by the next mix's line end and the event by its
    blank line's end (`\n\r\n`: LF, then CRLF)."""
    out = []
    for i, event in enumerate(_events(_grown(dialect, _WORDS))):
        line, blank = mixes[i % len(mixes)]
        lines = re.split(rb"\r\n|\r|\n", event.strip(b"\r\n"))
        out.append(line.join(lines) + line + blank)
    return b"".join(out)


@pytest.mark.parametrize("dialect", DIALECTS)
@pytest.mark.parametrize("mix", _MIXES, ids=lambda m: repr(m[0] + m[1]).replace("\\", "/"))
def test_any_line_ends_relay_the_same_through_the_shortcut(dialect: str, mix: tuple[bytes, bytes]) -> None:
    stream = _reframed(dialect, [mix])
    plain = _same(dialect, _events(_grown(dialect, _WORDS)))
    whole = _same(dialect, [stream])
    assert whole.outcome == plain.outcome  # the line ends change nothing read from the stream
    assert whole.outcome.text.startswith("Paris is sunny Paris")
    assert whole.taken >= len(_WORDS) - 1  # and the shortcut still takes the text deltas
    _same(dialect, [stream[i:i + 1] for i in range(len(stream))])


@pytest.mark.parametrize("dialect", DIALECTS)
def test_mixed_line_ends_cut_at_every_byte_relay_the_same(dialect: str) -> None:
    stream = _reframed(dialect, _MIXES)
    for cut in range(len(stream) + 1):
        _same(dialect, [stream[:cut], stream[cut:]])


_JSON_TEXT = st.text(alphabet=st.characters(codec="utf-8"), max_size=12)


@st.composite
def _inside(draw: st.DrawFn) -> bytes:
    """What may stand between a text's quotes: JSON-encoded text (escaped or raw UTF-8),
    or any bytes at all (invalid escapes, quotes, control characters, broken UTF-8)."""
    kind = draw(st.sampled_from(["ascii", "utf8", "bytes"]))
    if kind == "bytes":
        return draw(st.binary(max_size=8))
    text = draw(_JSON_TEXT)
    return json.dumps(text, ensure_ascii=kind == "ascii").encode()[1:-1]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dialect=st.sampled_from(DIALECTS), insides=st.lists(_inside(), min_size=1, max_size=12),
       cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=6))
def test_any_text_deltas_cut_anywhere_relay_the_same(dialect: str, insides: list[bytes], cuts: list[int]) -> None:
    stream = _grown(dialect, insides)
    at = sorted({c % (len(stream) + 1) for c in cuts} | {0, len(stream)})
    _same(dialect, [stream[a:b] for a, b in itertools.pairwise(at)])


def _padded(stream: bytes) -> bytes:
    """A chat stream as OpenAI sends it today (../shared/cassettes): each chunk but the
    usage chunk ends with an `obfuscation` pad whose length changes from chunk to chunk."""
    out = []
    for i, event in enumerate(_events(stream)):
        if event.startswith(b"data: {") and b'"choices":[{' in event:
            event = event.replace(b"}\n\n", b',"obfuscation":"%s"}\n\n' % b"x7Qz_-9aB"[:1 + i % 9], 1)
        out.append(event)
    return b"".join(out)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(insides=st.lists(_inside(), min_size=1, max_size=12),
       cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=6))
def test_chat_deltas_with_their_obfuscation_pads_cut_anywhere_relay_the_same(insides: list[bytes],
                                                                           cuts: list[int]) -> None:
    stream = _padded(_grown("chat", insides))
    assert stream.count(b'"obfuscation":') >= len(insides)
    at = sorted({c % (len(stream) + 1) for c in cuts} | {0, len(stream)})
    _same("chat", [stream[a:b] for a, b in itertools.pairwise(at)])


# What in a delta's head names another answer's text, changed keeping its length (a row of
# deltas is read with the first one's head as a backreference).
_OTHER_HEAD = {"chat": (b"chatcmpl-B9", b"chatcmpl-C7"), "anthropic": (b'"index":0,"delta"', b'"index":7,"delta"')}


def _row(dialect: str, row: list[tuple[bool, bytes]]) -> bytes:
    """The dialect's recorded text stream with a row of text deltas after its first one,
    each of its shape or of another head (`_OTHER_HEAD`), with `inside` as its text."""
    events, at, start, end = _first_delta(dialect)
    event = events[at]
    old, new = _OTHER_HEAD[dialect]
    made = [(event if same else event.replace(old, new))[:start] + inside + event[end:] for same, inside in row]
    return b"".join([*events[:at + 1], *made, *events[at + 1:]])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dialect=st.sampled_from(sorted(_OTHER_HEAD)),
       row=st.lists(st.tuples(st.booleans() | st.just(True), _inside() | st.sampled_from([b"", b"a\\nb", b"\\ud800"])),
                    min_size=1, max_size=12))
def test_a_row_of_deltas_read_at_once_takes_what_each_alone_would(dialect: str, row: list[tuple[bool, bytes]]) -> None:
    """`take_more` reads the deltas in a row after a taken one at once (two regexes over
    the row, `_read_run`), and must take exactly the events, and give exactly the texts,
    that the one-event reader takes from each delivered alone: a delta of another head of
    the same length, an empty text or an escape that does not decode ends the row."""
    stream = _row(dialect, row)
    whole = _same(dialect, [stream])
    alone = _same(dialect, _events(stream))
    assert whole.taken == alone.taken


def test_a_row_of_plain_deltas_is_taken_whole() -> None:
    words = [b"Paris ", b"is ", b"\\\"sunny\\\" ", b"caf\\u00e9 ", "na\u00efve ".encode()]
    for dialect in _OTHER_HEAD:
        stream = _row(dialect, [(True, words[i % len(words)]) for i in range(30)])
        assert _same(dialect, [stream]).taken == 31  # the row and the recorded delta after it


def test_padded_chat_deltas_are_taken_by_their_bytes() -> None:
    words = [b"Paris ", b"is ", b"\\\"sunny\\\" ", b"caf\\u00e9 ", "na\u00efve ".encode()]
    stream = _padded(_grown("chat", [words[i % len(words)] for i in range(40)]))
    whole = _same("chat", [stream])
    assert whole.taken >= 39  # the pad is a hole: its length changing does not make a new shape
    assert whole.outcome.text.startswith('Paris is "sunny" caf\u00e9 na\u00efve Paris ')
    _same("chat", _events(stream))


_RECORDED_DIALECT = {"chat": "chat", "responses": "responses", "messages": "anthropic", "gemini": "gemini"}


def _recorded_streams() -> list[Any]:
    """Every streamed answer of ../shared/cassettes that a full 200 came back for, with the
    request that asked for it as it was sent."""
    out = []
    for pair in recorded_pairs():
        if not pair["stream"] or pair["response"]["status"] != 200:
            continue
        dialect = _RECORDED_DIALECT[pair["dialect"]]
        request = (base64.b64decode(pair["request"]["body_b64"]), pair["request"]["path"])
        out.append(pytest.param(dialect, request, decoded(pair), id=f"{dialect}-{pair['id']}"))
    return out or [pytest.param(None, None, None, marks=pytest.mark.skip(reason=MISSING))]


@pytest.mark.parametrize(("dialect", "request_", "stream"), _recorded_streams())
def test_every_real_recorded_stream_relays_the_same_through_the_shortcut(
        dialect: str, request_: tuple[bytes, str], stream: bytes) -> None:
    """What the real APIs streamed (chat with its obfuscation pads, Responses with its
    sequence numbers, Gemini with usage in every chunk) gives, taken by its bytes, what the
    full parse gives, whole, event by event and cut every 97 bytes; and a real chat answer
    of several text deltas is mostly taken by its bytes."""
    if _hooks(dialect, request_).reads_text:
        pytest.skip("its answer's text is repaired: the shortcut is off")
    whole = _same(dialect, [stream], request_)
    _same(dialect, _events(stream), request_)
    _same(dialect, [stream[i:i + 97] for i in range(0, len(stream), 97)], request_)
    deltas = stream.count(b'"delta":{"content":"')
    if dialect == "chat" and deltas >= 5:
        assert whole.taken >= deltas - 2, "all but the first of a shape (and one more in case the id moves)"


def test_a_delta_of_an_earlier_shape_after_another_brings_its_own_metadata_back() -> None:
    # Two shapes in one stream (the response id changed in between): the last delta's id is
    # the outcome's, whichever shape it fits, as the full parse reads it.
    events = _events((DATA / "chat" / "text_stream.sse").read_bytes())
    first = next(e for e in events if b'"Paris is ' in e)
    other = first.replace(b"chatcmpl-B9", b"chatcmpl-C7")
    stream = b"".join([first, first, other, other, first, other, first])
    relayed = _same("chat", [stream])
    assert relayed.taken == 5  # all but the first of each shape
    assert relayed.outcome.response_id == "chatcmpl-B9"


def _reference_events(stream: bytes) -> list[bytes]:
    """SSE framing as the spec reads a whole stream: line by line (a line ends at CRLF, LF
    or CR), an event ending with the blank line after it; and the unterminated rest."""
    out, start, content = [], 0, False
    for m in re.finditer(rb"([^\r\n]*)(?:\r\n|\r|\n)", stream):
        if m.group(1):
            content = True
        elif content:
            out.append(stream[start:m.end()])
            start, content = m.end(), False
    return out + ([stream[start:]] if stream[start:] else [])


def _fields(stream: bytes) -> list[tuple[str | None, str]]:
    return [(e.event, e.data) for e in map(_reference_parse, _contentful(_reference_events(stream)))]


def _contentful(raws: list[bytes]) -> list[bytes]:
    """The events that carry a line (blank lines between events are no event of their own)."""
    return [r for r in raws if r.strip(b"\r\n")]


_SSE_BYTES = st.sampled_from([b"\r", b"\n", b"\r\n", b"data: x", b"data:y", b"event: e ", b"a", b" "])


@settings(max_examples=300, deadline=None)
@given(stream=st.lists(_SSE_BYTES, max_size=40).map(b"".join),
       cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=5))
def test_the_framer_ends_events_where_the_spec_does_however_the_stream_is_cut(stream: bytes, cuts: list[int]) -> None:
    framer = Framer()
    at = sorted({c % (len(stream) + 1) for c in cuts} | {0, len(stream)})
    got = [e for a, b in itertools.pairwise(at) for e in framer.split(stream[a:b])]
    tail = framer.flush_raw()
    got += [tail] if tail is not None else []
    assert b"".join(got) == stream
    want = _reference_events(stream)
    fields = [(e.event, e.data) for e in map(_reference_parse, _contentful(want))]
    assert [(e.event, e.data) for e in map(parse_sse_event, _contentful(got))] == fields
    if not any(stream[c - 1:c + 1] == b"\r\n" for c in at):  # no CRLF cut in two: the same bytes each
        assert [e.strip(b"\r\n") for e in _contentful(got)] == [e.strip(b"\r\n") for e in _contentful(want)]


def _reference_parse(raw: bytes) -> SseEvent:
    """An event's fields as the SSE spec reads them: lines end at CR, LF or CRLF."""
    name, data = None, []
    for line in re.split(rb"\r\n|\r|\n", raw):
        if line.startswith(b"data:"):
            data.append(line[6:] if line[5:6] == b" " else line[5:])
        elif line.startswith(b"event:"):
            name = line[6:].decode("utf-8", "replace").strip()
    return SseEvent(raw, name, b"\n".join(data).decode("utf-8", "replace"))


# ------------------------------------------------------------------ a repair that changes nothing

@pytest.mark.parametrize("case", [c for c in stream_cases() if c.dialect in DIALECTS], ids=str)
def test_a_stream_needing_no_repair_goes_out_as_it_came_however_it_is_cut(case: Case) -> None:
    # Its tools declared, so the arguments are repaired as they stream: the repairers hold
    # back the start of an object and a maybe-trailing comma, and the events with them.
    stream = case.input
    for chunks in ([stream], _events(stream), [stream[i:i + 7] for i in range(0, len(stream), 7)]):
        for full in (False, True):
            relayed = _relay(ADAPTERS[case.dialect], case.dialect, "tools", chunks, full=full)
            rewrites, repairs, _, delivered = relayed.records
            assert relayed.sent == (_without_usage_chunk(stream) if "usage_chunk=dropped" in rewrites else stream)
            assert not [r for r in rewrites if r.startswith("repair")] and repairs == [] and delivered == {}


def _without_usage_chunk(stream: bytes) -> bytes:
    """A chat stream as a client that did not ask for usage gets it: no usage-only chunk."""
    return b"".join(e for e in _events(stream) if not (b'"choices":[]' in e and b'"usage":{' in e))


def _chat_events(name: str) -> list[bytes]:
    return _events((DATA / "chat" / name).read_bytes())


def test_a_text_delta_never_overtakes_events_held_for_the_arguments() -> None:
    # A text delta the shortcut knows the shape of arrives while the first fragment of a
    # call's arguments (`{"ci`) is held: it waits its turn, and all go out as they came.
    text, tools = _chat_events("text_stream.sse"), _chat_events("tool_calls_stream.sse")
    again = text[1].replace(b"Paris is ", b"and warm")
    stream = b"".join([*text[:2], text[1], tools[0], tools[1], again, *tools[2:]])
    for chunks in ([stream], _events(stream)):
        relayed = _relay(ADAPTERS["chat"], "chat", "tools", chunks, full=False)
        assert relayed.sent == stream
        assert relayed.taken >= 1  # the shortcut ran before the call; not while events were held


def test_events_held_when_the_stream_ends_go_out_as_they_came() -> None:
    # Cut inside the arguments, before any finish: nothing repaired them, nothing is lost.
    tools = _chat_events("tool_calls_stream.sse")
    stream = b"".join(tools[:2])
    for chunks in ([stream], [stream[:-1], stream[-1:]], [stream[:-3]]):
        relayed = _relay(ADAPTERS["chat"], "chat", "tools", chunks, full=False)
        assert relayed.sent == b"".join(chunks)
