"""GCRA in integers (proxy/ledger/rates.py), from the table in tests/data/policy/rate_cases.yaml."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import yaml

from proxy.ledger.rates import Rate, RateState, duration, epoch_ms, rate_headers, rate_step

CASES = yaml.safe_load((Path(__file__).parent.parent / "data" / "policy" / "rate_cases.yaml").read_text())


@pytest.mark.parametrize("case", CASES["steps"], ids=[c["name"] for c in CASES["steps"]])
def test_a_gcra_step(case):
    debt, last, now, limit, cost = case["step"]
    held, state = rate_step(debt, last, now, Rate("tenant", "tokens", limit, cost))
    assert [held, state.remaining, state.reset_ms, state.wait_ms] == case["expect"]


@pytest.mark.parametrize(("ms", "text"), CASES["durations"])
def test_waits_are_written_as_openai_writes_them(ms, text):
    assert duration(ms) == text


def test_the_headers_speak_for_the_tightest_bucket_of_each_unit():
    tenant = RateState(Rate("tenant", "requests", 100, 1), remaining=40, reset_ms=36_000, wait_ms=0)
    key = RateState(Rate("key abcd1234", "requests", 10, 1), remaining=3, reset_ms=42_000, wait_ms=0)
    tokens = RateState(Rate("tenant", "tokens", 10_000, 500), remaining=9_000, reset_ms=6_000, wait_ms=0)
    assert rate_headers((tenant, key, tokens)) == {
        "x-ratelimit-limit-requests": "10", "x-ratelimit-remaining-requests": "3",
        "x-ratelimit-reset-requests": "42s", "x-ratelimit-limit-tokens": "10000",
        "x-ratelimit-remaining-tokens": "9000", "x-ratelimit-reset-tokens": "6s"}
    assert rate_headers(()) == {}


def test_the_clock_is_read_in_exact_milliseconds():
    t = datetime(2026, 5, 14, 12, 0, tzinfo=UTC)
    assert epoch_ms(t + timedelta(milliseconds=600)) - epoch_ms(t) == 600
    assert epoch_ms(t + timedelta(microseconds=999)) == epoch_ms(t)
