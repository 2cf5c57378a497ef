"""One parser of `traceparent`, per W3C Trace Context: the tracer parents spans with it and
the run id is derived with it, so they never disagree. Table: tests/data/tracing/."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from proxy.config import Settings
from proxy.serve.tenants import KeyIndex, identify
from tracing import spans
from tracing.traceparent import TraceParent, parse_traceparent

CASES = [json.loads(line) for line in
         (Path(__file__).parents[1] / "data" / "tracing" / "traceparent.jsonl").read_text().splitlines()]


def _want(case: dict[str, Any]) -> TraceParent | None:
    w = case["want"]
    return None if w is None else TraceParent(int(w["trace_id"], 16), int(w["span_id"], 16), w["sampled"])


@pytest.mark.parametrize("case", CASES, ids=lambda c: c["name"])
def test_the_header_parses_per_the_w3c_rules(case: dict[str, Any]) -> None:
    assert parse_traceparent(case["header"]) == _want(case)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c["name"])
def test_a_run_is_named_after_a_trace_only_when_the_tracer_joins_it(case: dict[str, Any]) -> None:
    headers = {} if case["header"] is None else {"traceparent": case["header"]}
    open_mode = Settings()
    caller = identify(headers, {}, open_mode, KeyIndex(open_mode))
    joined = spans.parse_traceparent(case["header"])  # what handler.py parents the spans with
    if joined is None:
        assert caller.run_id_source == "generated" and caller.run_id.startswith("run-")
    else:
        assert (caller.run_id, caller.run_id_source) == (case["want"]["trace_id"], "traceparent")
        assert caller.run_id == f"{joined.trace_id:032x}"


def test_x_run_id_still_wins_over_a_valid_traceparent() -> None:
    headers = {"x-run-id": "mine", "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
    open_mode = Settings()
    assert identify(headers, {}, open_mode, KeyIndex(open_mode)).run_id == "mine"
