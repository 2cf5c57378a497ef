"""Which tool results a request carries, per dialect: every result is joined by call id
wherever it stands (an agent framework may write its own call and result after the
model's, issue 54), and the new ones answer the model's last turn that called tools,
whatever turns an agent framework adds after it (issue 25)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.providers.cases import ADAPTERS, DATA

CASES: list[dict[str, Any]] = json.loads((DATA / "tool_results" / "cases.json").read_text())


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['dialect']}: {c['name']}")
def test_the_new_results_are_those_answering_the_last_calling_turn(case: dict[str, Any]) -> None:
    call = ADAPTERS[case["dialect"]].parse_request(case["body"], case["path"])
    assert [r.call_id for r in call.tool_results if r.new] == case["results"]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['dialect']}: {c['name']}")
def test_every_result_is_joined_by_id_once(case: dict[str, Any]) -> None:
    call = ADAPTERS[case["dialect"]].parse_request(case["body"], case["path"])
    assert [r.call_id for r in call.tool_results] == case["joined"]
