"""Which tool results a request carries as new, per dialect: a result answers the model's
last turn that called tools, whatever turns an agent framework adds after it (issue 25)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.providers.cases import ADAPTERS, DATA

CASES: list[dict[str, Any]] = json.loads((DATA / "tool_results" / "cases.json").read_text())


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['dialect']}: {c['name']}")
def test_the_new_results_are_those_answering_the_last_calling_turn(case: dict[str, Any]) -> None:
    call = ADAPTERS[case["dialect"]].parse_request(case["body"], case["path"])
    assert [r.call_id for r in call.tool_results] == case["results"]
