"""Properties: valid JSON passes unchanged, junk never crashes, big and deep inputs end."""

from __future__ import annotations

import contextlib
import json
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from proxy.model import OutputSpec
from proxy.repair import (
    ACTIONS,
    ExtractError,
    StreamExtractor,
    StreamRepairer,
    extract_items,
    extract_json,
    extract_json_report,
    extract_jsonl,
)

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**53), 2**53)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda kids: st.lists(kids, max_size=5) | st.dictionaries(st.text(), kids, max_size=5),
    max_leaves=20,
)
JUNK = st.text(alphabet=st.sampled_from(list("{}[]\"'`:,/*\\ \nabtruefalsnul0123456789.-+x")))
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(JSON)
def test_valid_json_passes_extract_json_unchanged(value: Any) -> None:
    for text in (json.dumps(value), json.dumps(value, indent=2)):
        report = extract_json_report(text)
        assert report.value == value and report.actions == ()


@SETTINGS
@given(JSON, st.integers(1, 17))
def test_valid_json_streams_through_the_repairer_byte_for_byte(value: Any, size: int) -> None:
    text = json.dumps(value, indent=1)
    r = StreamRepairer(OutputSpec("json_schema", schema={}))
    out = "".join(r.feed(text[i : i + size]) for i in range(0, len(text), size)) + r.finish()
    assert out == text
    assert r.repair is None


@SETTINGS
@given(JUNK)
def test_arbitrary_text_never_raises_anything_but_extract_error(text: str) -> None:
    for partial in (False, True):
        with contextlib.suppress(ExtractError):
            report = extract_json_report(text, partial)
            assert report.truncated <= partial, "a cut value only with allow_partial"
            assert set(report.actions) <= set(ACTIONS)
    with contextlib.suppress(ExtractError):
        items, cursor = extract_items(text, 0)
        assert isinstance(items, list) and 0 <= cursor <= len(text)
    assert isinstance(extract_jsonl(text), list)


@SETTINGS
@given(JUNK, st.integers(1, 9))
@example("{}`0", 1)  # a backtick after the value, cut off from the prose that follows it
def test_arbitrary_streams_are_split_invariant(text: str, size: int) -> None:
    def run(chunks: list[str]) -> tuple[str, Any]:
        r = StreamRepairer(OutputSpec("json_object"))
        return "".join([*(r.feed(c) for c in chunks), r.finish()]), r.repair

    whole = run([text])
    assert run([text[i : i + size] for i in range(0, len(text), size)]) == whole
    ex = StreamExtractor("items")
    for i in range(0, len(text), size):
        ex.feed(text[i : i + size])
    ex.finish()


@pytest.mark.parametrize("opener", ["[", '{"a":', "{'a':"])
def test_ten_thousand_deep_nesting_ends_cleanly(opener: str) -> None:
    closer = {"[": "]", '{"a":': "}", "{'a':": "}"}[opener]
    text = opener * 10_000 + "1" + closer * 10_000
    with pytest.raises(ExtractError, match="nested deeper than 1000 levels"):
        extract_json(text)  # refused whole: never a value cut at depth 1000, nor one inside it
    with pytest.raises(ExtractError, match="nested deeper than 1000 levels"):
        extract_json("Here it is: " + text, allow_partial=True)
    r = StreamRepairer(OutputSpec("json_schema", schema={}))
    out = "".join(r.feed(text[i : i + 64]) for i in range(0, len(text), 64)) + r.finish()
    assert r.repair is not None and r.repair.valid is False
    assert len(out) <= len(text)


def test_deep_truncated_nesting_ends_cleanly() -> None:
    with pytest.raises(ExtractError):
        extract_json("[" * 10_000)
    with pytest.raises(ExtractError, match="nested deeper than 1000 levels"):
        extract_json("[" * 10_000, allow_partial=True)
    value, depth = extract_json("[" * 999, allow_partial=True), 0  # 999 levels fit: all of them kept
    while value != []:
        value, depth = value[0], depth + 1
    assert depth == 998


def test_ten_megabytes_of_clean_json_in_prose() -> None:
    records = [{"id": i, "text": "x" * 80} for i in range(100_000)]
    body = orjson.dumps(records).decode()
    assert len(body) > 10_000_000
    assert extract_json("Here you go:\n```json\n" + body + "\n```") == records
    assert extract_json("Here you go: " + body + " Thanks!") == records


def test_ten_megabytes_of_prose_without_json_is_refused() -> None:
    with pytest.raises(ExtractError):
        extract_json("All work and no play. " * 500_000)


def test_adversarial_brace_prose_is_refused_in_linear_time() -> None:
    with pytest.raises(ExtractError):
        extract_json("{a} [b] {'c [d {e: " * 20_000)
    with pytest.raises(ExtractError):
        extract_json("{" * 1_000_000)
    with pytest.raises(ExtractError):
        extract_json('["' * 100_000)


def test_a_megabyte_of_json5_is_repaired() -> None:
    body = "[" + ",\n".join(f"{{id: {i}, name: 'n{i}', tags: ['a', 'b',],}}" for i in range(20_000))
    value = extract_json(body + "]")
    assert len(value) == 20_000 and value[7] == {"id": 7, "name": "n7", "tags": ["a", "b"]}
