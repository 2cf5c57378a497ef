"""repair_output, repair_arguments, validation problems and the feedback message."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from proxy.model import OutputSpec, Repair
from proxy.repair import problems, repair_arguments, repair_output, violation_feedback
from proxy.repair.validate import describe, normalize_schema, schema_key
from tests.repair.cases import load


def expected_repair(case: dict[str, Any], target: str) -> Repair | None:
    r = case["repair"]
    if r is None:
        return None
    return Repair(target, tuple(r["actions"]), r["valid"], tuple(r["problems"]))


def normalised(repair: Repair | None) -> Repair | None:
    if repair is None:
        return None
    return Repair(repair.target, tuple(sorted(repair.actions)), repair.valid, repair.problems)


@pytest.mark.parametrize("case", load("output.jsonl"))
def test_repair_output(case: dict[str, Any]) -> None:
    spec = OutputSpec(kind=case["spec"]["kind"], schema=case["spec"]["schema"])
    text, repair = repair_output(case["input"], spec, close_truncated=case["close_truncated"])
    assert text == case["text"]
    assert normalised(repair) == normalised(expected_repair(case, "output"))


@pytest.mark.parametrize("case", load("arguments.jsonl"))
def test_repair_arguments(case: dict[str, Any]) -> None:
    text, repair = repair_arguments(case["args"], case["schema"], "call_1")
    assert text == case["text"]
    assert normalised(repair) == normalised(expected_repair(case, "tool:call_1"))


@pytest.mark.parametrize("case", load("validate.jsonl"))
def test_problems(case: dict[str, Any]) -> None:
    assert sorted(problems(case["value"], case["schema"])) == sorted(case["problems"])


def test_normalize_schema_leaves_json_schema_alone() -> None:
    schema = {"type": "object", "properties": {"type": {"type": "string"}}, "required": ["type"]}
    assert normalize_schema(schema) == schema
    assert normalize_schema(normalize_schema(schema)) == schema


def test_schema_key_ignores_key_order() -> None:
    assert schema_key({"a": 1, "b": 2}) == schema_key({"b": 2, "a": 1})


def test_a_broken_schema_cannot_judge_the_output() -> None:
    spec = OutputSpec("json_schema", schema={"type": 12})
    text, repair = repair_output("{a: 1}", spec)
    assert text == '{"a":1}'
    assert repair is not None and repair.valid is None and repair.problems == ()


@pytest.mark.parametrize("case", load("describe.jsonl"))
def test_an_error_of_a_shape_we_do_not_know_still_counts(case: dict[str, Any]) -> None:
    # Library errors as other jsonschema-rs releases shape them: never an empty list, which
    # would read as "conforms" and let the answer through unchecked.
    assert describe(SimpleNamespace(**case["error"])) == case["problems"]


def test_a_validator_that_cannot_judge_the_value_counts_it_invalid() -> None:
    # jsonschema-rs raises on a mapping with a non-string key instead of judging it.
    found = problems({1: "x"}, {"type": "object", "additionalProperties": False})
    assert len(found) == 1 and found[0].startswith("the value could not be checked against the schema (")


def test_real_errors_keep_their_field_names() -> None:
    schema = {"type": "object", "properties": {"a": {}}, "required": ["b"], "additionalProperties": False}
    assert sorted(problems({"c": 1}, schema)) == ["missing required field 'b' at $", "unknown field 'c' at $"]


def test_violation_feedback_lists_each_problem() -> None:
    message = violation_feedback(["unknown field 'x' at $", "missing required field 'y' at $"])
    assert "- unknown field 'x' at $\n- missing required field 'y' at $" in message
    assert "only the corrected JSON" in message
