"""One refusal vocabulary (proxy.model.RefusalReason): every refusal the ledger or the
admission makes is named in it, the metric label admits it and nothing else, and the
operations guide lists exactly it (tests/e2e/test_refusal_labels.py: both routes agree)."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from pathlib import Path
from typing import get_args

import pytest

from proxy.errors import (
    BodyTooLarge,
    CeilingReached,
    LoopRefused,
    ProxyError,
    RateLimited,
    Refusal,
    RequestError,
    StoreUnavailable,
)
from proxy.ledger.rates import Rate, RateState
from proxy.ledger.store import (
    SCOPES,
    Ask,
    Decision,
    Limits,
    Spend,
    Standing,
    context_refusal,
    rate_refusal,
    refusal,
    tool_ceiling,
    unpriced_refusal,
)
from proxy.model import REFUSAL_KINDS, REFUSAL_REASONS, RefusalReason
from proxy.serve.pipeline import refusal_reason
from tracing.labels import LabelBounds

ROOT = Path(__file__).resolve().parents[2]
LIMITS = Limits(run_max_calls=1, run_max_cost=1, day_budget=1, month_budget=1, run_max_tokens=1,
                run_max_seconds=1, key_day_budget=1, key_month_budget=1)


def _ledger_refusals() -> list[Refusal]:
    """Every refusal the ledger's admissions build (store.py; sqlite.py, redis.py and the Lua
    scripts go through these builders)."""
    ask = Ask("acme", "r1", datetime.now(UTC), LIMITS)
    found = Standing(LIMITS, {scope: Spend(1, 0) for scope in SCOPES}, (1, 1))
    scopes = ("run_calls", "run_tokens", "run_seconds", *SCOPES)
    states = tuple(RateState(Rate("tenant", unit, 1, 2), 0, 1000, wait) for unit in ("requests", "tokens")
                   for wait in (None, 500))
    return [
        *(refusal(Decision(refused=scope), ask, found, key="k1") for scope in scopes),
        *(rate_refusal("acme", (state,)) for state in states),
        tool_ceiling("acme", "r1", 3),
        context_refusal("acme", ["response:1"], LIMITS),
        unpriced_refusal("acme", "no-such-model"),
    ]


@pytest.mark.parametrize("exc", _ledger_refusals(), ids=lambda e: getattr(e, "limit", e.code))
def test_every_limit_the_ledger_names_is_a_reason_of_the_vocabulary(exc: Refusal) -> None:
    assert isinstance(exc, CeilingReached | RateLimited)
    assert exc.limit in REFUSAL_REASONS
    assert refusal_reason(exc) == exc.limit


@pytest.mark.parametrize(("exc", "reason"), [
    (LoopRefused("the same call 3 times"), "loop_detected"),
    (StoreUnavailable("the ledger is down"), "ledger_unavailable"),
    (RequestError("X-Run-Max-Cost-Usd must be an amount"), "invalid_request"),
    (CeilingReached("a limit no one named", limit="run_widgets"), "refused"),
    (ProxyError("anything else"), "refused"),
])
def test_every_refusal_is_named_in_the_vocabulary(exc: ProxyError, reason: str) -> None:
    assert refusal_reason(exc) == reason


def test_the_mcp_routes_old_words_are_not_reasons() -> None:
    # MCP used to say these where model calls said loop_detected and rate_requests/rate_tokens.
    assert not {"loop_guard", "rate_limit_exceeded", "budget_exceeded"} & REFUSAL_REASONS


def test_the_reason_label_admits_the_vocabulary_and_nothing_else() -> None:
    bounds = LabelBounds()
    assert {bounds.refusal(r) for r in REFUSAL_REASONS} == REFUSAL_REASONS
    for word in ("loop_guard", "rate_limit_exceeded", "run_widgets", BodyTooLarge.code, "x" * 300):
        assert bounds.refusal(word) == "_OTHER"


def test_the_literal_type_and_the_table_name_the_same_reasons() -> None:
    assert tuple(REFUSAL_KINDS) == get_args(RefusalReason)


def test_the_operations_guide_lists_exactly_the_vocabulary() -> None:
    text = (ROOT / "docs/operations.md").read_text()
    row = next(line for line in text.splitlines() if line.startswith("| `spanmeter.limit.rejections`"))
    listed = row.partition("by `spanmeter_reason`:")[2].partition(". ")[0]
    assert set(re.findall(r"`([a-z_]+)`", listed)) == REFUSAL_REASONS
