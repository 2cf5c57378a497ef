"""Table tests for tracing/digests.py over tests/data/digests/*.jsonl."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

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
