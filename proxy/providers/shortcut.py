"""Stream events that carry only a piece of the answer's text, told by their bytes.

Most events of a streamed answer are text deltas that differ from one another only in
their text (and in members nothing reads: a sequence number, an obfuscation pad, or
Gemini's running usage). While no hook of the call reads the answer's text, such an
event needs no JSON parse and no event objects. The first event of a shape is parsed in
full, as every other event is, and a template is learnt from it: the bytes before and
after its text, with holes where the members that change are. A later event that fits a
template byte for byte outside its holes gives its text from one slice, and the observer
the same events the full parse would have given it. Anything else, or anything that does
not fit exactly (a tool call, a finish reason, an escape the template cannot vouch for),
is parsed in full.

Why a fitting event parses as its template did: the template's text hole is proven, when
it is learnt, to be exactly the inside of the string token that parse_event reads as the
text (an event with a marker in its place parses to the marker); a hole accepts only what
a JSON string's inside (or an integer, or one whole JSON value) may be, so an event that
fits has the template's JSON structure, and every other byte is the template's.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from typing import Any, Final

import orjson

from proxy.model import MetaEvent, StreamEvent, TextDelta, UsageEvent
from proxy.providers.observer import Observer
from proxy.providers.roles import AnswerReader, TextShape
from proxy.providers.sse import EventEnds, SseEvent, parse_sse_event

__all__ = ["TextShortcut"]

# The inside of a JSON string (RFC 8259: no quote, backslash or control character
# unescaped), and a JSON integer.
_STRING: Final = re.compile(rb'[^"\\\x00-\x1f]*(?:\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4})[^"\\\x00-\x1f]*)*')
_INT: Final = re.compile(rb"-?(?:0|[1-9][0-9]*)")

_TEXT, _IGNORED_STRING, _IGNORED_INT, _USAGE = range(4)
_TEMPLATES: Final = 4  # kept per stream: one per text block / output item in flight is plenty
_LEARNS: Final = 8  # per stream: an API whose deltas never repeat a shape stops paying for learning
_MARKER: Final = b"spanmeter-probe"


_Rows = tuple[re.Pattern[bytes], re.Pattern[bytes]]  # a row of events of a template, and one event


@dataclass(slots=True)
class _Template:
    head: bytes  # the bytes before the first hole
    steps: tuple[tuple[int, bytes], ...]  # (hole kind, the bytes after it up to the next hole)
    side: tuple[StreamEvent, ...]  # what a fitting event gives besides its text and usage
    body: re.Pattern[bytes]  # what follows the head, holes and all, as one regex: one C call an event
    rows: _Rows | None  # `_read_run`'s two regexes; None where it cannot vouch for a row (`_rows`)


# Proven templates that name no response (no metadata beside the text: Anthropic,
# Responses) are the same in every stream of their API: proven once per process. Kept by
# their bytes, as the regexes of what follows a head are by their steps (the head names
# the response; the rest of a template is the same in every stream of a shape: OpenAI's
# chat deltas with their obfuscation pad). Both are bounded by the few shapes an API has
# (a hostile upstream inventing shapes only makes them start over).
_Steps = tuple[tuple[int, bytes], ...]
_SHARED: dict[tuple[TextShape, bytes, _Steps], _Template] = {}
_BODIES: dict[_Steps, re.Pattern[bytes]] = {}
_RUNS: dict[tuple[_Steps, int], _Rows] = {}
_SHARED_MAX: Final = 256
_HOLE_PATTERNS: Final = {_TEXT: b"(" + _STRING.pattern + b")", _IGNORED_STRING: _STRING.pattern,
                         _IGNORED_INT: _INT.pattern, _USAGE: rb"(.+)"}


class TextShortcut:
    """The text deltas of one stream, taken by their bytes (see the module docstring).

    `take` feeds the observer and says True for an event that fits a learnt template;
    for every other event the caller parses in full and then calls `learn`.
    """

    __slots__ = ("_last", "_learns", "_observer", "_reader", "_shape", "_templates")

    def __init__(self, reader: AnswerReader, shape: TextShape, observer: Observer) -> None:
        self._reader = reader
        self._shape = shape
        self._observer = observer
        self._templates: list[_Template] = []
        self._learns = 0
        self._last: _Template | None = None  # the template of the last event the observer was fed

    def take(self, buf: bytes, start: int, end: int) -> bool:
        """Feed the observer the event `buf[start:end]` and say True, if it fits a template."""
        for t in self._templates:
            if not buf.startswith(t.head, start, end):
                continue
            fit = _read(t, buf, start, end)
            if fit is None:
                continue
            text, usage = fit
            observer = self._observer
            # Metadata and usage fed again change nothing when the last event fed was of
            # this same template: only its text was fed since.
            if t.side and t is not self._last:
                observer.feed(t.side)
            if usage is not None and self._shape.usage_of is not None:
                observer.feed((UsageEvent(self._shape.usage_of(usage)),))
            observer.add_text(text)
            self._last = t
            return True
        return False

    def take_more(self, buf: bytes, start: int, ends: EventEnds) -> tuple[int, int]:
        """After `take` said True: the events from `start` on that fit the same template,
        fed as `take` would feed them one by one, read at once (`_read_run`), or in one loop
        where that cannot vouch for them: (how many, where the next event starts). Only
        while `take` would pick that template first (it tries the newest first) and it has
        no usage hole; the first event that does not fit is left to `take` and the full
        parse."""
        t = self._last
        if t is None or t is not self._templates[0] or t.steps[-1][0] == _USAGE \
                or not buf.startswith(t.head, start):
            return 0, start
        texts, end = _read_run(t, buf, start)
        if texts is None:  # not the common framing, or an event the run cannot vouch for
            texts = []
            while (end := ends.after(start)) != -1 and buf.startswith(t.head, start, end):
                fit = _read(t, buf, start, end)  # the one reader, as `take` reads
                if fit is None:
                    break
                texts.append(fit[0])
                start = end
            end = start
        if texts:
            self._observer.add_texts(texts)
        return len(texts), end

    def learn(self, event: SseEvent, parsed: list[StreamEvent]) -> None:
        """After `event` was parsed in full and fed: learn a template from it if it is a
        plain text delta."""
        self._last = None
        if self._learns >= _LEARNS or not _text_only(parsed):
            return
        try:
            if not self._shape.plain(event):
                return
        except (ValueError, TypeError, KeyError, AttributeError, IndexError):
            return
        self._learns += 1
        template = self._template(event.raw, parsed)
        if template is not None:
            self._templates.insert(0, template)
            del self._templates[_TEMPLATES:]
            self._last = template

    def _template(self, raw: bytes, parsed: list[StreamEvent]) -> _Template | None:
        shape = self._shape
        text = _holes(raw, shape.key, string_only=True)
        if len(text) != 1:
            return None
        holes = [(text[0][0], text[0][1], _TEXT)]
        for key in shape.ignored:
            holes += [(s, e, _IGNORED_STRING if raw[s - 1:s] == b'"' else _IGNORED_INT)
                      for s, e in _holes(raw, key, string_only=False)]
        usage_hole = shape.usage is not None and shape.usage in raw
        if shape.usage is not None and usage_hole:
            usage = _object_at(raw, shape.usage)
            if usage is None:
                return None
            holes.append((*usage, _USAGE))
        holes.sort()
        if any(a[1] > b[0] for a, b in itertools.pairwise(holes)):
            return None
        if any(kind == _USAGE for _, _, kind in holes[:-1]):
            return None  # a usage hole must be the last: its end is found from the tail
        steps = tuple((kind, raw[end:holes[i + 1][0]] if i + 1 < len(holes) else raw[end:])
                      for i, (_, end, kind) in enumerate(holes))
        side = tuple(e for e in parsed if isinstance(e, MetaEvent) or (isinstance(e, UsageEvent) and not usage_hole))
        shared = (self._shape, raw[:holes[0][0]], steps)  # a shape is its API's: one reader parses it
        known = _SHARED.get(shared) if not side else None
        if known is not None and self._reads(known, raw, parsed):
            return known
        head = raw[:holes[0][0]]
        template = _Template(head, steps, side, _body(steps), _rows(head, steps))
        if not self._proven(template, raw, holes, parsed):
            return None
        if not side:
            if len(_SHARED) >= _SHARED_MAX:
                _SHARED.clear()
            _SHARED[shared] = template
        return template

    def _proven(self, t: _Template, raw: bytes, holes: list[tuple[int, int, int]],
                parsed: list[StreamEvent]) -> bool:
        """The template reads what the full parse read, from the event it was learnt from
        and from a probe with every hole changed (a marker as the text, empty usage), which
        the API's reader parses in full: the text hole is the text's token, the usage hole the
        usage the reader reads."""
        probe, at = [], 0
        for start, end, kind in holes:
            probe += [raw[at:start], {_TEXT: _MARKER, _IGNORED_STRING: b"", _IGNORED_INT: b"0", _USAGE: b"{}"}[kind]]
            at = end
        probe.append(raw[at:])
        probe_raw = b"".join(probe)
        try:
            want = self._reader.parse_event(parse_sse_event(probe_raw))
        except (ValueError, TypeError, KeyError, AttributeError, IndexError):
            return False
        return self._reads(t, raw, parsed) and self._reads(t, probe_raw, want) \
            and [e.text for e in want if isinstance(e, TextDelta)] == [_MARKER.decode()]

    def _reads(self, t: _Template, raw: bytes, parsed: list[StreamEvent]) -> bool:
        """Whether `t` fits `raw` and gives the events `parsed` (metadata and usage in their order)."""
        fit = _read(t, raw, 0, len(raw))
        if fit is None:
            return False
        text, usage = fit
        got: list[StreamEvent] = list(t.side)
        if usage is not None and self._shape.usage_of is not None:
            got.append(UsageEvent(self._shape.usage_of(usage)))
        return [e.text for e in parsed if isinstance(e, TextDelta)] == [text] \
            and [e for e in parsed if not isinstance(e, TextDelta)] == got


def _body(steps: _Steps) -> re.Pattern[bytes]:
    """The regex of what follows a template's head: its holes and the bytes between them
    (the text is group 1, the usage group 2). A string hole ends at its first unescaped
    quote and an integer at its first non-digit, and the bytes after each are the
    template's, so an event fits one way or not at all."""
    body = _BODIES.get(steps)
    if body is None:
        if len(_BODIES) >= _SHARED_MAX:
            _BODIES.clear()
        body = _BODIES[steps] = re.compile(b"".join(_HOLE_PATTERNS[kind] + re.escape(after) for kind, after in steps),
                                           re.DOTALL)
    return body


def _read(t: _Template, buf: bytes, start: int, end: int) -> tuple[str, Any] | None:
    """(the text, the usage hole's value or None) when `buf[start:end]` fits `t`, its head
    checked by the caller. The reader of one event: `take` reads with it, `_proven` proves
    it reads what the full parse reads, and `_read_run` takes a row of events only where
    it would take each one."""
    usage: Any = None
    m = t.body.fullmatch(buf, start + len(t.head), end)
    if m is None or m.end(1) == m.start(1):
        return None
    text = _decode(m.group(1))
    if text is None:
        return None
    if t.steps[-1][0] == _USAGE:
        try:
            usage = orjson.loads(m.group(2))
        except orjson.JSONDecodeError:
            return None
        if not isinstance(usage, dict):
            return None
    return text, usage


def _read_run(t: _Template, buf: bytes, start: int) -> tuple[list[str] | None, int]:
    """(the texts, where the next event starts) of the events from `start` on that fit `t`,
    its head at `start` checked by the caller, read by two regexes instead of one `_read`
    an event; (None, start) where the run cannot vouch for what `_read` would read.

    The run regex matches the longest row of events that each are `t`'s head followed by
    what `t.body` matches (the head's bytes at every event the same as at the first: a
    backreference); `findall` then gives each one's text. Each event of the row ends where
    `EventEnds` would end it, at its first blank line, for a template in the common framing
    (no CR, its last bytes LF LF): it was learnt from an event cut there, so its own bytes
    hold LF LF only at their end, and a hole holds no line end (a string's inside has no
    control character, an integer only digits) and is never an empty gap between two line
    ends (a string's sits between its quotes, an integer has a digit), so no LF LF forms
    across one. A row with an empty text, or with a text whose escape `_decode` refuses,
    is left to the one-event reader."""
    if t.rows is None:
        return None, start
    run, each = t.rows
    m = run.match(buf, start)
    if m is None:
        return None, start
    end = m.end()
    raws = each.findall(buf, start, end)
    if b"" in raws:
        return None, start
    if buf.find(b"\\", start, end) == -1:
        return [raw.decode("utf-8", "replace") for raw in raws], end
    texts = []
    for raw in raws:
        text = _decode(raw)
        if text is None:
            return None, start
        texts.append(text)
    return texts, end


def _rows(head: bytes, steps: _Steps) -> _Rows | None:
    """`_read_run`'s regexes for a template, decided once when it is learnt: (a row of events
    that fit it, one event with its text as group 1), for any head of its length (a head
    names the response, the rest of a template is its shape's). None for a template with a
    usage hole (`take_more` never reads those) or outside the common framing: a CR anywhere,
    or last bytes other than LF LF."""
    if steps[-1][0] == _USAGE or not steps[-1][1].endswith(b"\n\n") or b"\r" in head \
            or any(b"\r" in after for _, after in steps):
        return None
    key = (steps, len(head))
    patterns = _RUNS.get(key)
    if patterns is None:
        if len(_RUNS) >= _SHARED_MAX:
            _RUNS.clear()
        quiet = b"".join((_STRING.pattern if kind == _TEXT else _HOLE_PATTERNS[kind]) + re.escape(after)
                         for kind, after in steps)
        any_head = b".{%d}" % len(head)
        patterns = _RUNS[key] = (re.compile(b"(" + any_head + b")" + quiet + b"(?:\\1" + quiet + b")*", re.DOTALL),
                                 re.compile(any_head + _body(steps).pattern, re.DOTALL))
    return patterns


def _text_only(parsed: list[StreamEvent]) -> bool:
    """One non-empty text delta, with nothing but response metadata and usage beside it."""
    texts = 0
    for e in parsed:
        if isinstance(e, TextDelta):
            if not e.text:
                return False
            texts += 1
        elif not isinstance(e, MetaEvent | UsageEvent):
            return False
    return texts == 1


def _holes(raw: bytes, key: bytes, *, string_only: bool) -> list[tuple[int, int]]:
    """(start, end) of the value of each `key` member: a string's inside, or an integer."""
    out = []
    at = raw.find(key)
    while at != -1:
        pos = at + len(key)
        while raw[pos:pos + 1] == b" ":
            pos += 1
        if raw[pos:pos + 1] == b'"':
            m = _STRING.match(raw, pos + 1)
            if m is None or raw[m.end():m.end() + 1] != b'"':
                return []
            out.append((pos + 1, m.end()))
        elif not string_only and (m := _INT.match(raw, pos)) is not None:
            out.append((pos, m.end()))
        else:
            return []
        at = raw.find(key, at + 1)
    return out


def _object_at(raw: bytes, key: bytes) -> tuple[int, int] | None:
    """(start, end) of the JSON object that is the value of the only `key` member."""
    at = raw.find(key)
    if at == -1 or raw.find(key, at + 1) != -1:
        return None
    pos = at + len(key)
    while raw[pos:pos + 1] == b" ":
        pos += 1
    if raw[pos:pos + 1] != b"{":
        return None
    start, depth = pos, 0
    while pos < len(raw):
        c = raw[pos]
        if c == 0x22:  # a string: skip its inside, whatever brackets it holds
            m = _STRING.match(raw, pos + 1)
            if m is None or raw[m.end():m.end() + 1] != b'"':
                return None
            pos = m.end() + 1
            continue
        if c in b"{[":
            depth += 1
        elif c in b"}]":
            depth -= 1
            if depth == 0:
                return start, pos + 1
        pos += 1
    return None


def _decode(inside: bytes) -> str | None:
    """A JSON string's inside as the full parse reads it (invalid UTF-8 replaced first)."""
    if b"\\" not in inside:
        return inside.decode("utf-8", "replace")
    try:
        value = orjson.loads('"' + inside.decode("utf-8", "replace") + '"')
    except orjson.JSONDecodeError:
        return None
    return value if isinstance(value, str) else None
