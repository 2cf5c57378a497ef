"""Table tests for tracing/digests.py over tests/data/digests/*.jsonl."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tracing import digests

DATA = Path(__file__).parent.parent / "data" / "digests"


def cases(name: str) -> list[Any]:
    lines = (DATA / f"{name}.jsonl").read_text(encoding="utf-8").splitlines()
    rows = [json.loads(line) for line in lines if line.strip()]
    return [pytest.param(row, id=row["name"]) for row in rows]


@pytest.mark.parametrize("case", cases("arguments"))
def test_arguments_digest(case: dict[str, Any]) -> None:
    assert digests.arguments_digest(case["input"]) == case["expected"]


@pytest.mark.parametrize("case", cases("tool_arguments"))
def test_tool_arguments_digest(case: dict[str, Any]) -> None:
    assert digests.tool_arguments_digest(case["input"]) == case["expected"]


@pytest.mark.parametrize("case", cases("tool_result"))
def test_tool_result_digest(case: dict[str, Any]) -> None:
    got = digests.tool_result_digest(case["input"], is_error=case.get("is_error", False))
    assert {"ok": got.ok, "digest": got.digest} == case["expected"]
    assert got.preview == case["input"][: digests.PREVIEW_LIMIT]


@pytest.mark.parametrize("case", cases("value"))
def test_value_digest(case: dict[str, Any]) -> None:
    assert digests.value_digest(case["input"]) == case["expected"]


@pytest.mark.parametrize("case", cases("sha256"))
def test_canonical_sha256(case: dict[str, Any]) -> None:
    got = digests.canonical_sha256(case["input"])
    if "expected" in case:
        assert got == case["expected"]
    if "same_as" in case:
        assert got == digests.canonical_sha256(case["same_as"])
    if "different_from" in case:
        assert got != digests.canonical_sha256(case["different_from"])


def _hash_as_json_writes_it(text: str) -> str:
    """canonical_sha256 as written before orjson wrote the canonical form: json.dumps of
    what the parsers read (orjson first, json for NaN, Infinity and lone surrogates)."""
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError:
        try:
            value = json.loads(text)
        except ValueError:
            return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
    form = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(form.encode("utf-8", "surrogatepass")).hexdigest()


# Floats json writes with an exponent (1e-05, 1e+16) and orjson would not write alike (its
# older versions, `make test-lowest`, write 1e16),
# every escape json writes in a string, what only json reads, and nesting orjson reads but
# does not write.
_EDGES = ["1e-05", "1.5e-07", "1e+16", "[1.5e-07, 6.2e-05, 0.0001, 1e+16, 1e16, 5e-324, 1.7976931348623157e+308, -0.0]",
          '{"b": 1e22, "a": 123456789012345678901234567890}', '"\\u2028\\u007f\\b\\f\\n\\r\\t\\u0001\\"\\\\/"',
          '{"é": 1, "e": 2, "\\ud83d\\ude00": 3, "\\uffff": 4}', "[NaN, Infinity]", '"\\ud800"', "1e400",
          '{"a": "1e5 0.00001"}', "0.00001", "[" * 300 + "]" * 300]
_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12)


@pytest.mark.parametrize("text", _EDGES)
def test_the_canonical_hash_is_the_one_json_writes_at_its_edges(text: str) -> None:
    assert digests.canonical_sha256(text) == _hash_as_json_writes_it(text)


@settings(max_examples=400, deadline=None)
@given(_JSON_VALUES, st.booleans())
def test_the_canonical_hash_is_the_one_json_writes(value: Any, indent: bool) -> None:
    text = json.dumps(value, indent=2 if indent else None, ensure_ascii=indent)
    assert digests.canonical_sha256(text) == _hash_as_json_writes_it(text)


def test_preview_is_cut_at_400_runes() -> None:
    text = "é" * 1000
    assert digests.tool_result_digest(text).preview == "é" * 400


@pytest.mark.parametrize(
    ("value", "cap"),
    [
        pytest.param([{"role": "user", "parts": [{"type": "text", "content": "x" * 5000}]}], 512,
                     id="one long text part is halved until it fits"),
        pytest.param([{"role": "user", "content": "é" * 3000}] * 20, 300,
                     id="many long multi-byte messages fit by bytes"),
        pytest.param([{"a": "short"}] * 400, 200, id="many short items drop from the end"),
    ],
)  # fmt: skip
def test_capped_json_stays_valid_json_under_the_cap(value: Any, cap: int) -> None:
    before = json.dumps(value)
    out = digests.capped_json(value, cap)
    assert len(out.encode()) <= cap
    assert isinstance(json.loads(out), list)
    assert json.dumps(value) == before  # the caller's data is not modified


def test_capped_json_keeps_small_values_whole() -> None:
    value = {"role": "user", "parts": [{"type": "text", "content": "hi"}]}
    assert json.loads(digests.capped_json(value, 1024)) == value


@pytest.mark.parametrize(("value", "cap"), [
    pytest.param([{"type": "function", "name": "lookup_\ud800"}], 1024, id="a lone surrogate in a name"),
    pytest.param([{"n": 2**70}], 1024, id="an integer past 64 bits"),
    pytest.param([{"n": 2**70, "text": "y" * 4000}], 256, id="an integer past 64 bits, cut to fit"),
    pytest.param({1: "a key that is not a string"}, 1024, id="a key that is not a string"),
])  # fmt: skip
def test_capped_json_writes_what_orjson_refuses(value: Any, cap: int) -> None:
    out = digests.capped_json(value, cap)
    assert len(out.encode("utf-8", "surrogatepass")) <= cap
    parsed = json.loads(out)
    assert json.dumps(parsed, sort_keys=True)[:40] == json.dumps(json.loads(json.dumps(value)), sort_keys=True)[:40]


def _parsed_by_both(text: str) -> Any:
    """What the digests read a text as without their first-character check: orjson, then
    the standard library (NaN, Infinity, integers past 64 bits), else nothing."""
    for loads in (orjson.loads, json.loads):
        try:
            return loads(text)
        except ValueError:
            continue
    return digests._MISSING


@pytest.mark.parametrize("text", [
    "", " ", "prose, as most answers are", "\n\n{\"a\": 1}", " [1, 2]", '"quoted"', "-1", "-Infinity",
    "NaN", "Infinity", "true", "false", "null", "nope", "tru", "7 days", "{not json", "\ufeff{}", "\u00a0{}",
    "\u2028[]", "\x0b[]", "12345678901234567890123", "# heading\n{}", "```json\n{}\n```",
])  # fmt: skip
def test_prose_is_turned_away_without_parsing_and_nothing_else(text: str) -> None:
    assert _same(digests._parse(text), _parsed_by_both(text))


@settings(max_examples=400, deadline=None)
@given(st.one_of(st.text(), st.from_regex(r"[ \t\n\r\f\v\u00a0]*[-{\[\"0-9tfnNIx ].*", fullmatch=True),
                 st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
                              lambda inner: st.lists(inner) | st.dictionaries(st.text(), inner))
                 .map(lambda v: json.dumps(v))))
def test_the_first_character_check_reads_every_text_as_both_parsers_do(text: str) -> None:
    assert _same(digests._parse(text), _parsed_by_both(text))


def _same(a: Any, b: Any) -> bool:
    # NaN is not equal to itself: compare what the digests would be made of.
    return a is b or repr(a) == repr(b)


def test_a_kept_verdict_is_the_one_judging_gives_and_the_error_flag_is_part_of_it() -> None:
    text = '{"ok": true, "rows": [{"name": "a"}, {"name": "b"}]}'
    first = digests.tool_result_digest(text)
    assert digests.tool_result_digest(text) is first  # kept: judged once
    assert first == digests._judge(text, False)
    flagged = digests.tool_result_digest(text, is_error=True)
    assert not flagged.ok and flagged == digests._judge(text, True)


def test_kept_verdicts_are_bounded_by_the_size_of_their_texts() -> None:
    small = '{"rows": [1, 2]}'
    digests.tool_result_digest(small)
    big = "x" * (digests._VERDICT_CHARS + 1)
    assert digests.tool_result_digest(big).digest == "1 line"
    assert (big, False) not in digests._VERDICTS  # too large to keep alive
    assert (small, False) in digests._VERDICTS  # and it pushed nothing out
    piece = digests._VERDICT_CHARS // 8
    for i in range(20):
        digests.tool_result_digest(str(i) * piece)
        assert digests._kept_chars <= digests._VERDICT_CHARS
        assert sum(len(t) for t, _ in digests._VERDICTS) == digests._kept_chars
    assert len(digests._VERDICTS) <= 8
