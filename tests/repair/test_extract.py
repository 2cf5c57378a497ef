"""extract_json / extract_items / extract_jsonl / extract_enum over the case tables."""

from __future__ import annotations

import math
from typing import Any

import pytest

from proxy.repair import (
    ExtractError,
    StreamExtractor,
    extract_enum,
    extract_items,
    extract_json,
    extract_json_report,
    extract_jsonl,
)
from tests.repair.cases import load

JSON_CASES = load("extract_json.jsonl")


@pytest.mark.parametrize("case", JSON_CASES)
def test_extract_json(case: dict[str, Any]) -> None:
    text, partial = case["input"], case["allow_partial"]
    if "error" in case:
        with pytest.raises(ExtractError) as err:
            extract_json(text, partial)
        assert case["error"] in err.value.reason
        assert 0 <= err.value.position <= len(text)
        return
    report = extract_json_report(text, partial)
    assert report.value == case["expected"]
    assert extract_json(text, partial) == case["expected"]
    assert sorted(report.actions) == sorted(case["actions"])
    assert report.truncated == case.get("truncated", False)


@pytest.mark.parametrize("case", JSON_CASES)
def test_stream_extractor_agrees_at_every_split(case: dict[str, Any]) -> None:
    """Fed in two pieces at every split point, the json-mode stream finds the same value."""
    if "error" in case or "```python" in case["input"] or case["input"].startswith("27"):
        # a stream takes the first value: preferring a later fence, or an object over a
        # leading number followed by prose, needs the end of the text
        return
    text, partial = case["input"], case["allow_partial"]
    for cut in range(len(text) + 1):
        ex = StreamExtractor("json", allow_partial=partial)
        found = ex.feed(text[:cut]) + ex.feed(text[cut:]) + ex.finish()
        assert found == [case["expected"]], cut


@pytest.mark.parametrize("case", load("extract_items.jsonl"))
def test_extract_items(case: dict[str, Any]) -> None:
    items, cursor = extract_items(case["input"], 0)
    assert items == case["items"]
    more, again = extract_items(case["input"], cursor)
    assert more == [] and again == cursor


@pytest.mark.parametrize("case", load("extract_items.jsonl"))
def test_extract_items_called_per_chunk_finds_each_item_once(case: dict[str, Any]) -> None:
    text, found, cursor = case["input"], [], 0
    for end in range(1, len(text) + 1):
        items, cursor = extract_items(text[:end], cursor)
        found.extend(items)
    assert found == case["items"]


@pytest.mark.parametrize("case", load("extract_items.jsonl"))
def test_stream_extractor_items_at_every_split(case: dict[str, Any]) -> None:
    text = case["input"]
    if "{bad bad}" in text:
        return  # one malformed element ends the streamed array (it is not re-synchronised)
    complete = text.rstrip().endswith("]")
    for cut in range(len(text) + 1):
        ex = StreamExtractor("items")
        found = ex.feed(text[:cut]) + ex.feed(text[cut:])
        found += ex.finish()
        expected = case["items"]
        if not complete and found != expected:  # a cut trailing number completes at the end
            assert found[: len(expected)] == expected
        else:
            assert found == expected, cut


@pytest.mark.parametrize("case", load("extract_jsonl.jsonl"))
def test_extract_jsonl(case: dict[str, Any]) -> None:
    assert extract_jsonl(case["input"]) == case["expected"]
    text = case["input"]
    for cut in range(len(text) + 1):
        ex = StreamExtractor("jsonl")
        assert ex.feed(text[:cut]) + ex.feed(text[cut:]) + ex.finish() == case["expected"]


@pytest.mark.parametrize("case", load("extract_enum.jsonl"))
def test_extract_enum(case: dict[str, Any]) -> None:
    if "error" in case:
        with pytest.raises(ExtractError):
            extract_enum(case["input"], case["choices"])
    else:
        assert extract_enum(case["input"], case["choices"]) == case["expected"]


def test_special_numbers_are_floats() -> None:
    value = extract_json("{a: +Infinity, b: -Infinity, c: NaN}")
    assert value["a"] == math.inf and value["b"] == -math.inf and math.isnan(value["c"])


def test_stream_extractor_rejects_unknown_mode() -> None:
    with pytest.raises(ValueError, match="mode"):
        StreamExtractor("yaml")


def test_an_element_nested_too_deep_is_refused_not_dropped() -> None:
    deep = "[" * 1100 + "1" + "]" * 1100
    with pytest.raises(ExtractError, match="nested deeper than 1000 levels"):
        extract_items(f"[1, {deep}, 2]")
    with pytest.raises(ExtractError, match="nested deeper than 1000 levels"):
        extract_items(f"Here: [{deep}, 2]")
