"""Tolerant extraction of a JSON value from model text. Pure; no I/O.

`extract_json(text)` returns, in this order of preference:

1. the whole text, if it is JSON or JSON5 (scalars included);
2. the first fenced block whose content parses (``json``/``json5``/unlabelled blocks
   before other labels);
3. the value at the first `{`/`[` where one parses, skipping bracket groups in prose
   that do not (`{name}`). Quotes and apostrophes in prose do not matter: scanning
   starts at a candidate bracket, never at the start of the text.

JSON5 accepted: single quotes, trailing commas, comments, unquoted keys, hex, `+`,
`.5`, `Infinity`/`NaN` (and Python's `True`/`False`/`None`). A value cut off at the end is
returned only with `allow_partial=True`: completed members kept, a cut string kept as
received, a cut key, token or escape dropped (a high surrogate escape whose low half was
cut, too). Anything else raises `ExtractError`, including a value nested deeper than
`MAX_DEPTH` (1,000) levels: it is refused whole, never returned cut at that depth, and
no value inside it is returned in its place.

Clean input costs one `orjson.loads`; fenced input a `str.find` more. Every other path
scans each candidate once with `Scanner` (regex runs over clean stretches); candidates
inside a failed span's still-open brackets are skipped (they fail the same way), and
the total work is capped, so adversarial text ends in linear time. `json5` is used only
as a last resort on small texts.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import json5
import orjson

from proxy.model import frozen
from proxy.repair.scan import DONE, MAX_DEPTH, Scanner
from proxy.repair.stream import TENTATIVE_LIMIT, ValueStream

__all__ = [
    "ACTIONS",
    "ExtractError",
    "Extraction",
    "StreamExtractor",
    "extract_enum",
    "extract_items",
    "extract_json",
    "extract_json_report",
    "extract_jsonl",
    "ordered",
]

ACTIONS = (
    "fence",
    "prose",
    "trailing_comma",
    "single_quotes",
    "comment",
    "unquoted_key",
    "hex",
    "special_number",
    "leading_dot",
    "python_literal",
    "string_escape",
    "whitespace",
    "json5",
    "truncation",
    "unrepairable",
)
"""Every action a repair may report, in the order reports list them."""

_RANK = {a: i for i, a in enumerate(ACTIONS)}
_FAST_START = frozenset('{["-0123456789tfn')
_JSON_LABELS = ("json", "json5", "jsonc", "jsonl", "")
_FENCE_INFO = re.compile(r"```[ \t]*([\w+.-]*)[ \t]*(?:\r?\n)?")
# A bracket is a candidate only if what follows could continue a value.
_CANDIDATE = re.compile(r"\{(?=\s*[\"'}\w$/])|\[(?=\s*[\"'\[\]{\w+./-])")
_MAX_CANDIDATES = 10_000
_JSON5_LIMIT = 16_384
_ENUM_STRIP = re.compile(r"^(?:\s|\*\*|[`\"'])+|(?:\s|\*\*|[`\"']|\.(?=[\s*`\"']*$))+$")


class ExtractError(ValueError):
    """No value could be extracted: `position` in the text and the `reason`."""

    def __init__(self, position: int, reason: str) -> None:
        super().__init__(f"{reason} (at character {position})")
        self.position = position
        self.reason = reason


@frozen
class Extraction:
    """An extracted value and what had to be repaired to get it."""

    value: Any
    actions: tuple[str, ...] = ()
    truncated: bool = False


def ordered(actions: Iterable[str]) -> tuple[str, ...]:
    """Actions deduplicated, in `ACTIONS` order (unknown ones last)."""
    return tuple(sorted(set(actions), key=lambda a: (_RANK.get(a, len(_RANK)), a)))


# ---------------------------------------------------------------------- extract_json


def extract_json(text: str, allow_partial: bool = False) -> Any:
    """The JSON value in `text` (see the module docstring); raises `ExtractError`."""
    return extract_json_report(text, allow_partial).value


def extract_json_report(text: str, allow_partial: bool = False) -> Extraction:
    """Like `extract_json`, and also says what was repaired and whether it was cut."""
    lead = len(text) - len(text.lstrip())
    if lead == len(text):
        raise ExtractError(0, "no JSON value: the text is empty")
    if text[lead] in _FAST_START:
        try:
            return Extraction(orjson.loads(text))
        except orjson.JSONDecodeError:
            pass
    search = _Search(text, allow_partial)
    found = search.whole(lead) or search.fences() or search.candidates(lead)
    if found is not None:
        return found
    return search.give_up()


@dataclass(slots=True)
class _Span:
    """One scan from a start position."""

    scanner: Scanner
    start: int

    @property
    def complete(self) -> bool:
        return self.scanner.state == DONE

    @property
    def end(self) -> int:
        return self.scanner.done_at


class _Search:
    """The state of one `extract_json` call: budget, best error, first truncated span."""

    def __init__(self, text: str, allow_partial: bool) -> None:
        self.text = text
        self.allow_partial = allow_partial
        self.budget = 4 * len(text) + 65_536  # characters all scans together may read
        self.error: tuple[int, str] | None = None
        self.truncated: tuple[Scanner, tuple[str, ...]] | None = None
        self.first: _Span | None = None  # the whole-text scan, reused as a candidate

    def scan(self, text: str, start: int, *, scalars: bool) -> _Span:
        sc = Scanner(scalars=scalars)
        sc.scan_from(text, start)
        self.budget -= sc.consumed - start
        if sc.error and (self.error is None or sc.error[0] > self.error[0]):
            self.error = sc.error
        return _Span(sc, start)

    def whole(self, lead: int) -> Extraction | None:
        span = self.scan(self.text, lead, scalars=True)
        if self.text[lead] in "{[":
            self.first = span
        if span.complete and not self.text[span.end :].strip():
            return self.value(span.scanner, ())
        if span.scanner.truncated and self.truncated is None:
            self.truncated = (span.scanner, ())
        return None

    def fences(self) -> Extraction | None:
        blocks = _fences(self.text)
        blocks.sort(key=lambda b: b[0] not in _JSON_LABELS)
        for _label, start, end, closed in blocks:
            content = self.text[start:end]
            extra = ("fence", "prose") if _outside(self.text, start, end) else ("fence",)
            found = self.content(content, extra, closed)
            if found is not None:
                return found
        return None

    def content(self, content: str, extra: tuple[str, ...], closed: bool) -> Extraction | None:
        lead = len(content) - len(content.lstrip())
        if lead == len(content):
            return None
        try:
            return Extraction(orjson.loads(content), extra)
        except orjson.JSONDecodeError:
            pass
        span = self.scan(content, lead, scalars=True)
        if span.complete and not content[span.end :].strip():
            return self.value(span.scanner, extra)
        if not closed and span.scanner.truncated and self.truncated is None:
            self.truncated = (span.scanner, extra)
        return None

    def candidates(self, lead: int) -> Extraction | None:
        text, skip = self.text, set[int]()
        for count, m in enumerate(_CANDIDATE.finditer(text, lead)):
            i = m.start()
            if i in skip:
                continue
            if count >= _MAX_CANDIDATES or self.budget < 0:
                self.error = (i, "gave up: too many places where a JSON value might start")
                return None
            if count == 0:
                found = self.fast_candidate(i)
                if found is not None:
                    return found
            span = self.first if (self.first and self.first.start == i) else None
            span = span or self.scan(text, i, scalars=False)
            _refuse_too_deep(span.scanner)  # every later candidate is inside it
            if span.complete:
                return self.value(span.scanner, self.around(i, span.end))
            sc = span.scanner
            if sc.truncated:
                if self.truncated is None:
                    self.truncated = (sc, self.around(i, len(text)))
                if sc.quote != "'":  # an apostrophe in prose may have opened that "string"
                    return None
                skip.update(range(i, sc.string_start + 1))
            skip.update(sc.open_at)
        return None

    def fast_candidate(self, i: int) -> Extraction | None:
        """Prose around clean JSON: the span to the last matching bracket, at C speed."""
        close = self.text.rfind("}" if self.text[i] == "{" else "]")
        if close <= i:
            return None
        try:
            value = orjson.loads(self.text[i : close + 1])
        except orjson.JSONDecodeError:
            return None
        return Extraction(value, self.around(i, close + 1))

    def around(self, start: int, end: int) -> tuple[str, ...]:
        outside = self.text[:start] + self.text[end:]
        if not outside.strip():
            return ()
        prose = _FENCE_INFO.sub("", outside).strip()
        fence = ("fence",) if "```" in outside else ()
        return (*fence, "prose") if prose else fence

    def value(self, sc: Scanner, extra: tuple[str, ...]) -> Extraction | None:
        pieces = sc.out
        if sc.state != DONE:
            pieces = pieces + sc.closing()
        try:
            value = _loads("".join(pieces), "special_number" in sc.actions)
        except (ValueError, RecursionError) as exc:
            self.error = (sc.consumed, f"not JSON after repair: {exc}")
            return None
        truncated = sc.state != DONE
        actions = (*extra, *sc.actions, *(("truncation",) if truncated else ()))
        return Extraction(value, ordered(actions), truncated)

    def give_up(self) -> Extraction:
        if self.truncated is not None:
            sc, extra = self.truncated
            if self.allow_partial:
                found = self.value(sc, extra)
                if found is not None:
                    return found
            else:
                raise ExtractError(len(self.text), "the JSON value is cut off (truncated) and allow_partial is off")
        found = _json5_last_resort(self.text)
        if found is not None:
            return found
        pos, reason = self.error or (0, "no JSON value found")
        raise ExtractError(pos, reason)


def _refuse_too_deep(sc: Scanner) -> None:
    """A value nested deeper than MAX_DEPTH is refused whole: a value cut at that depth,
    or one found inside it, would be a different value returned as if it were the answer."""
    if sc.too_deep and sc.error is not None:
        raise ExtractError(sc.error[0], f"the JSON value is nested deeper than {MAX_DEPTH} levels")


def _loads(text: str, special: bool) -> Any:
    # orjson refuses NaN/Infinity; the stdlib reads them (and raises RecursionError, not
    # crashing, if nesting is deep)
    return json.loads(text) if special else orjson.loads(text)


def _fences(text: str) -> list[tuple[str, int, int, bool]]:
    """(label, content start, content end, closed) of each ``` block, in order."""
    blocks: list[tuple[str, int, int, bool]] = []
    i = text.find("```")
    while i != -1:
        m = _FENCE_INFO.match(text, i)
        assert m is not None
        label, start = m.group(1).lower(), m.end()
        close = text.find("```", start)
        if close == -1:
            blocks.append((label, start, len(text), False))
            break
        blocks.append((label, start, close, True))
        i = text.find("```", close + 3)
    return blocks


def _outside(text: str, start: int, end: int) -> bool:
    """Is there prose outside the fence whose content is text[start:end]?"""
    before = _FENCE_INFO.sub("", text[:start])
    after = text[end:].replace("```", "", 1)
    return bool(before.strip() or after.strip())


def _json5_last_resort(text: str) -> Extraction | None:
    stripped = text.strip()
    if len(stripped) > _JSON5_LIMIT:
        return None
    try:
        return Extraction(json5.loads(stripped), ("json5",))
    except Exception:  # json5 raises ValueError, RecursionError and others on junk
        return None


# ---------------------------------------------------------------------- items, jsonl, enum

_SEP = re.compile(r"[\s,]*")
_TOKEN_END = re.compile(r"[\w$.+\-]*")
_SKIP = re.compile(r"\"(?:[^\"\\]|\\.)*\"|'(?:[^'\\]|\\.)*'|[\[{}\],]")


def extract_items(text: str, cursor: int = 0) -> tuple[list[Any], int]:
    """Elements of the first top-level array completed since `cursor` (Genkit's
    `extractItems`): returns them and the cursor for the next call with more text.
    A bad element is skipped (not retried); the cursor stops before an unfinished one;
    an element nested deeper than MAX_DEPTH raises `ExtractError` (never dropped)."""
    if cursor == 0:
        start = _array_start(text)
        if start == -1:
            return [], 0
        cursor = start + 1
    items: list[Any] = []
    n = len(text)
    while True:
        i = _SEP.match(text, cursor).end()  # type: ignore[union-attr]
        if i >= n or text[i] == "]":
            return items, (i if i < n else cursor)
        sc = Scanner()
        sc.scan_from(text, i)
        _refuse_too_deep(sc)
        if sc.state == DONE and not (sc.done_at == n and text[n - 1] not in "}]\"'"):
            items.append(_loads("".join(sc.out), "special_number" in sc.actions))
            cursor = sc.done_at
        elif sc.error:
            end = _skip_element(text, i)
            if end is None:
                return items, cursor
            cursor = end
        else:
            return items, cursor


def _array_start(text: str) -> int:
    """The `[` that opens the array, or -1 while no `[` is known to. A `[` with only
    whitespace or a fence opener before it is the array. After prose, as in a stream, a
    bracket group (`Here are [some] items:`) is skipped when its first element fails to
    parse, and a `[` whose first element is still arriving is not committed to (up to
    TENTATIVE_LIMIT characters of it)."""
    start = text.find("[")
    while start != -1:
        if not _FENCE_INFO.sub("", text[:start]).strip():
            return start  # nothing but a fence before it: the array the text is
        i = _SEP.match(text, start + 1).end()  # type: ignore[union-attr]
        if i >= len(text):
            return -1  # the first element has not begun
        if text[i] == "]":
            return start
        sc = Scanner()
        sc.scan_from(text, i)
        _refuse_too_deep(sc)
        if sc.error is None:
            if (sc.state == DONE and sc.done_at < len(text)) or sc.consumed - i > TENTATIVE_LIMIT:
                return start
            return -1  # the first element is still arriving: decide when it is whole
        if _TOKEN_END.match(text, sc.error[0]).end() >= len(text):  # type: ignore[union-attr]
            return -1  # the bad token may still grow into a good one (`tru` -> `true`)
        start = text.find("[", start + 1)
    return -1


def _skip_element(text: str, i: int) -> int | None:
    """End of a malformed element (its ',' or the array's ']'), or None if not there yet."""
    depth = 0
    for m in _SKIP.finditer(text, i):
        t = m.group()
        if t in "[{":
            depth += 1
        elif t in "]}":
            if depth == 0:  # the array's end stays for the caller; a stray '}' is skipped
                return m.start() if t == "]" and m.start() > i else m.end()
            depth -= 1
        elif t == "," and depth == 0:
            return m.end()
    return None


def extract_jsonl(text: str, allow_partial: bool = False) -> list[Any]:
    """One value per line; bad lines are skipped, not fatal. Lines that do not start with
    `{` or `[` (prose, fences) are ignored."""
    values: list[Any] = []
    for line in text.splitlines():
        s = line.strip()
        if not s or s[0] not in "{[":
            continue
        try:
            values.append(extract_json(s, allow_partial))
        except ExtractError:
            continue
    return values


def extract_enum(text: str, choices: Sequence[str]) -> str:
    """The choice `text` names: quotes, backticks, `**`, whitespace and a trailing period
    are stripped at the ends and case is ignored. Raises `ExtractError` otherwise."""
    value = _ENUM_STRIP.sub("", text)
    folded = value.casefold()
    for choice in choices:
        if choice.casefold() == folded:
            return choice
    raise ExtractError(0, f"{value!r} is not one of {list(choices)!r}")


# ---------------------------------------------------------------------- streams


class StreamExtractor:
    """Incremental extraction from a stream, fed only the new text (linear time).

    mode "items": `feed` returns the elements of the top-level array completed by
    this piece. mode "json": `feed` returns `[value]` once the value is complete.
    mode "jsonl": `feed` returns the values of lines completed by this piece (bad
    lines skipped). `finish()` returns what the end of the stream completes; a cut
    value only with `allow_partial`.
    """

    def __init__(self, mode: str = "json", *, allow_partial: bool = False) -> None:
        if mode not in ("json", "items", "jsonl"):
            raise ValueError(f"mode must be json, items or jsonl, not {mode!r}")
        self.mode = mode
        self.allow_partial = allow_partial
        self._stream = ValueStream(
            starts="[" if mode == "items" else "{[",
            nonfinite="keep",
            collect_items=mode == "items",
        )
        self._pieces: list[str] = []
        self._line: list[str] = []
        self._emitted = False

    @property
    def actions(self) -> tuple[str, ...]:
        return ordered(self._stream.actions)

    def feed(self, delta: str) -> list[Any]:
        if self.mode == "jsonl":
            return self._lines(delta)
        self._stream.feed(delta)
        return self._collect()

    def finish(self) -> list[Any]:
        if self.mode == "jsonl":
            rest, self._line = "".join(self._line), []
            return extract_jsonl(rest, self.allow_partial)
        self._stream.finish(close=self.allow_partial)
        return self._collect(final=True)

    def _collect(self, final: bool = False) -> list[Any]:
        stream = self._stream
        pieces = stream.drain()
        sc = stream.scanner
        if self.mode == "items":
            return self._items(sc)
        self._pieces.extend(pieces)
        if self._emitted or not (stream.done or (final and self.allow_partial)):
            return []
        if stream.error or sc is None:
            return []
        self._emitted = True
        try:
            return [_loads("".join(self._pieces), "special_number" in stream.actions)]
        except (ValueError, RecursionError):
            return []

    def _items(self, sc: Scanner | None) -> list[Any]:
        if sc is None or not sc.items:
            return []
        found: list[Any] = []
        for text, many in sc.items:
            try:
                value = _loads(text, "special_number" in sc.actions)
            except (ValueError, RecursionError):
                continue
            if many:
                found.extend(value)
            else:
                found.append(value)
        sc.items.clear()
        return found

    def _lines(self, delta: str) -> list[Any]:
        if "\n" not in delta:
            self._line.append(delta)
            return []
        head, _, tail = delta.rpartition("\n")
        complete = "".join(self._line) + head
        self._line = [tail]
        return extract_jsonl(complete)
