"""Texts an operator or an agent reads: refusal messages that name the knob, money that
never reads as zero, and the generated docs that must match the code."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from proxy.config import DEFAULT_POLICY, Settings
from proxy.ledger.messages import Tally, Who, call_ceiling, cost_ceiling, usd
from proxy.ops import docgen
from proxy.serve.siblings import WORKER_ATTRIBUTE, WORKER_SERIES
from proxy.simulator.script import SCENARIO_HELP, SCENARIOS
from tracing import attributes as A
from tracing.summaries import money

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("limit", "words"), [(1, "1 model call "), (2, "2 model calls "), (8, "8 model calls ")])
def test_call_counts_agree_in_number(limit, words):
    assert f"ceiling of {words}(" in call_ceiling("acme", "r-1", limit)


def test_a_ceiling_from_a_request_header_says_to_change_the_header():
    text = call_ceiling("acme", "r-1", 1, "request header X-Run-Max-Calls")
    assert text == (
        "Run r-1 of tenant acme reached its ceiling of 1 model call (request header X-Run-Max-Calls). The call was "
        "not forwarded and nothing was charged. Raise X-Run-Max-Calls on this run's requests (a header can only "
        "lower the tenant's ceiling, never raise it), or start a new run.")
    tenant = call_ceiling("acme", "r-1", 8, "tenant setting runs.max_llm_calls")
    assert tenant.endswith("Raise the ceiling for this tenant or start a new run.")
    cost = cost_ceiling("run_cost", Who("acme", "r-1"), Tally(limit=10_000, used=9_000, held=0, needed=2_000),
                        window=None, tz="UTC", origin="request header X-Run-Max-Cost-Usd")
    assert "Raise X-Run-Max-Cost-Usd on this run's requests" in cost and "for this tenant" not in cost
    assert cost_ceiling("run_cost", Who("acme", "r-1"), Tally(limit=10_000, used=9_000, held=0, needed=2_000),
                        window=None, tz="UTC").endswith("Raise the ceiling for this tenant, or start a new run.")


@pytest.mark.parametrize(("micros", "text"), [
    (0, "$0.00"), (1, "$0.000001"), (10_000, "$0.01"), (1_500_000, "$1.50"), (123_456_789, "$123.456789"),
    (-500_000, "$-0.50"), (-1, "$-0.000001"), (2**53, "$9007199254.740992"),
])
def test_dollars_are_exact_with_at_least_cents(micros, text):
    """The ledger's messages, the remaining-budget headers and the access log all write money so."""
    assert usd(micros) == text


@pytest.mark.parametrize(("usd", "text"), [
    (0, "$0.00"), (3.3e-05, "$0.000033"), (0.000045, "$0.000045"), (0.0123, "$0.0123"), (0.5, "$0.50"),
    (3.3, "$3.30"), (1234.5, "$1,234.50"), (4e-07, "<$0.000001"), (-0.25, "-$0.25"),
])
def test_money_keeps_every_micro_dollar(usd, text):
    assert money(usd) == text


# --- generated docs -------------------------------------------------------------------------


def test_every_setting_has_a_meaning_and_no_meaning_is_stale():
    paths = [path for path, *_ in docgen.fields()]
    assert len(paths) == len(set(paths))
    assert set(paths) == set(docgen.FIELD_DOCS), "add the new setting's meaning to proxy/ops/docgen.py FIELD_DOCS"
    assert {p for p in paths if "." not in p} == set(Settings.model_fields)
    assert docgen._policy_default("policy.guard.threshold") == DEFAULT_POLICY.guard.threshold


def test_every_metric_and_scenario_is_described():
    assert set(docgen.METRIC_DOCS) == {m.name for m in A.METRICS}
    assert set(SCENARIO_HELP) == set(SCENARIOS), "say what the new scenario does in SCENARIO_HELP"


@pytest.mark.parametrize(("rel", "names"), list(docgen.GENERATED.items()))
def test_the_committed_docs_equal_their_rendering(rel, names):
    text = (ROOT / rel).read_text(encoding="utf-8")
    for name in names:
        assert docgen.generated_parts(text, name) == docgen.render(name), (
            f"{rel} is out of date: run `python -m proxy.ops.docgen`")


def test_metric_and_label_names_in_the_operations_guide_exist():
    text = (ROOT / "docs/operations.md").read_text(encoding="utf-8")
    labels = {A.prometheus_label(v) for k, v in vars(A).items() if k.isupper() and isinstance(v, str) and "." in v}
    known = A.all_prometheus_series() | labels | {"gen_ai_latest_experimental"}  # an OTEL_SEMCONV value
    known |= {*WORKER_SERIES, A.prometheus_label(WORKER_ATTRIBUTE)}  # spanmeter serve --workers N
    named = set(re.findall(r"\b((?:spanmeter|gen_ai)_[a-z_]+[a-z])\b", text))
    assert named and named <= known, sorted(named - known)


def test_the_readme_links_the_guides_and_the_simulator_list():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for target in ("docs/operations.md", "docs/simulator.md", "docs/operations.md#configuration-reference"):
        assert f"]({target})" in readme, target
        assert (ROOT / target.partition("#")[0]).exists()
    assert "spanmeter simulate --scenarios" in readme
    assert "## Configuration reference" in (ROOT / "docs/operations.md").read_text(encoding="utf-8")
