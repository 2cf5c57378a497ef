"""Pricing: table-driven over tests/data/policy/pricing_cases.yaml, plus the file's own rules."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
import yaml

from proxy.config import Settings
from proxy.model import Call, Usage
from proxy.pricing import (
    PROVIDER_OVERHEAD_TOKENS,
    STANDARD_FACTOR,
    PriceTable,
    affordable_output_tokens,
    cache_savings,
    cost,
    input_bound,
    reservation,
)
from proxy.pricing.table import _FOUND_MAX

CASES = yaml.safe_load((Path(__file__).parents[1] / "data" / "policy" / "pricing_cases.yaml").read_text())
TABLE = PriceTable.load()


def cases(section: str) -> Any:
    return pytest.mark.parametrize("case", CASES[section], ids=lambda c: c["name"])


def price(model: str) -> Any:
    p = TABLE.price(model)
    assert p is not None, model
    return p


@cases("lookup")
def test_lookup(case: dict[str, Any]) -> None:
    found = TABLE.price(case["model"])
    assert (found.model if found else None) == case["want"]


@cases("cost")
def test_cost(case: dict[str, Any]) -> None:
    assert cost(price(case["model"]), Usage(**case["usage"])) == case["want"]


@cases("savings")
def test_cache_savings(case: dict[str, Any]) -> None:
    assert cache_savings(price(case["model"]), Usage(**case["usage"])) == case["want"]


@cases("reservation")
def test_reservation(case: dict[str, Any]) -> None:
    got = reservation(price(case["model"]), case["input_bound"], case["max_output_tokens"])
    assert got == case["want"]


@cases("affordable")
def test_affordable_output_tokens(case: dict[str, Any]) -> None:
    p = price(case["model"])
    n = affordable_output_tokens(p, case["budget"], case["input_bound"])
    assert n == case["want"]
    if n:  # the answer is the largest that fits
        assert reservation(p, case["input_bound"], n) <= case["budget"]
        assert reservation(p, case["input_bound"], n + 1) > case["budget"]


def test_every_shipped_price_has_a_source_and_a_date() -> None:
    raw = yaml.safe_load(Path("proxy/data/prices.yaml").read_text())["models"]
    assert len(TABLE) == len(raw) > 30
    for name in TABLE.models():
        p = price(name)
        assert p.source and (p.as_of[:2] == "20" or p.as_of.startswith("genai-prices ")), name
        assert p.cached_input <= p.input <= p.cache_write, name
    for family in ("gpt-5", "claude-sonnet-4-5", "gemini-2.5-pro", "sim-small", "sim-large"):
        assert family in TABLE


def test_money_is_integer_micro_usd() -> None:
    p = price("gpt-5-nano")
    assert (p.input, p.cached_input, p.output) == (50_000, 5_000, 400_000)
    assert isinstance(cost(p, Usage(input_tokens=3, output_tokens=3)), int)


def test_overrides_change_fields_and_add_models() -> None:
    table = PriceTable.load(
        overrides={
            "gpt-4o": {"output": 12.5},
            "my-model": {"input": 1, "output": 4},
        }
    )
    gpt = table.price("gpt-4o-2024-08-06")
    assert gpt is not None and (gpt.input, gpt.output, gpt.source) == (
        2_500_000,
        12_500_000,
        "config pricing.overrides",
    )
    mine = table.price("my-model")
    assert mine is not None and (mine.cached_input, mine.cache_write) == (1_000_000, 1_000_000)


def test_overrides_set_the_one_hour_write_rate_and_the_tier_multipliers() -> None:
    settings = Settings(prices={  # through the config's own validation
        "claude-haiku-4-5": {"cache_write_1h": 3},
        "my-model": {"input": 1, "output": 4, "service_tiers": {"priority": 3}, "inference_geos": {"eu": 1.2}},
    })
    table = PriceTable.load(overrides=settings.prices)
    haiku, mine = table.price("claude-haiku-4-5"), table.price("my-model")
    assert haiku is not None and mine is not None
    assert cost(haiku, Usage(input_tokens=1000, cache_write_tokens=1000, cache_write_1h_tokens=1000)) == 3000
    assert cost(mine, Usage(input_tokens=1000, service_tier="priority", inference_geo="eu")) == 3600
    assert cost(mine, Usage(input_tokens=1000, service_tier="flex")) == 1000


def test_a_tier_billed_at_1x_is_the_standard_factor_itself() -> None:
    """OpenAI answers name their tier ("default", "auto"): one the table does not list, or lists
    at 1x, is STANDARD_FACTOR itself, which `cost` and the anatomy test by identity to stay
    on integer arithmetic; a listed factor, alone or with a geography, still applies."""
    table = PriceTable.load(overrides=Settings(prices={
        "my-model": {"input": 1, "output": 4, "service_tiers": {"default": 1, "priority": 2.5},
                     "inference_geos": {"us": 1.1, "global": 1.0}},
        "tiers-only": {"input": 1, "output": 1, "service_tiers": {"default": 1, "flex": 0.5}},
    }).prices)
    mine, tiers, mini = table.price("my-model"), table.price("tiers-only"), price("gpt-4o-mini")
    assert mine is not None and tiers is not None
    for p, usage in [(mini, Usage(input_tokens=10, service_tier="default")),
                     (mine, Usage(input_tokens=10, service_tier="default")),
                     (mine, Usage(input_tokens=10, service_tier="scale", inference_geo="global")),
                     (mine, Usage(input_tokens=10, inference_geo="elsewhere"))]:
        assert p.multiplier(usage) is STANDARD_FACTOR, usage
        assert cost(p, usage) == cost(p, Usage(input_tokens=10))
    assert mine.multiplier(Usage(service_tier="priority")) == Fraction(5, 2)
    assert mine.multiplier(Usage(inference_geo="us")) == Fraction(11, 10)
    assert mine.multiplier(Usage(service_tier="priority", inference_geo="us")) == Fraction(11, 4)
    # A reservation covers any geography, and any tier the project enables unless one is asked for.
    assert tiers.reserve_factor("default") is STANDARD_FACTOR is tiers.reserve_factor("flex")
    assert mine.reserve_factor("default") == Fraction(11, 10)
    assert mine.reserve_factor(None) == Fraction(11, 4)
    assert cost(mine, Usage(input_tokens=1000, service_tier="priority", inference_geo="us")) == 2750


def test_every_shipped_one_hour_write_rate_is_twice_input() -> None:
    for name in TABLE.models():
        p = price(name)
        if p.cache_write_1h is not None:
            assert p.cache_write_1h == 2 * p.input, name
            assert p.cache_write_1h_rate(0) == p.cache_write_1h
        if p.long_context is not None and p.long_context.cache_write_1h is not None:
            assert p.long_context.cache_write_1h == 2 * p.long_context.input, name
    # Every Claude with a prompt cache (Claude 2 had none) has the 1-hour write rate.
    assert all(price(m).cache_write_1h for m in TABLE.models()
               if m.startswith("claude-") and price(m).cached_input < price(m).input)


@pytest.mark.parametrize(
    ("entry", "problem"),
    [
        ({"output": 1}, "missing input"),
        ({"input": -1, "output": 1}, "negative"),
        ({"input": 0.0000001, "output": 1}, "finer than"),
        ({"input": "x1", "output": 1}, "expected a number"),
        ({"input": 1, "output": 1, "service_tiers": {"flex": 0}}, "positive multiplier"),
        ({"input": 1, "output": 1, "service_tiers": {"flex": "half"}}, "positive multiplier"),
        ({"input": 1, "output": 1, "inference_geos": ["us"]}, "mapping of name to multiplier"),
    ],
    ids=["no input", "negative", "too fine", "not a number", "zero multiplier", "word multiplier",
         "geos not a mapping"],
)
def test_bad_overrides_are_refused(entry: dict[str, Any], problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        PriceTable.load(overrides={"new-model": entry})


@pytest.mark.parametrize(
    ("call", "want"),
    [
        (Call("chat", "chat", "gpt-4o", body_bytes=1_000, input_chars=900), 1_000),
        (Call("chat", "chat", "gpt-4o", input_chars=250), 1_000),
        (Call("chat", "chat", "gpt-4o"), 0),
    ],
    ids=["body size bounds the text", "chars x 4 when the size is unknown", "empty"],
)
def test_input_bound(call: Call, want: int) -> None:
    assert input_bound(call) == want + PROVIDER_OVERHEAD_TOKENS


@pytest.mark.parametrize("text", ["plain ascii words", "é" * 50, "漢字" * 40, "🙂" * 30])
def test_the_byte_bound_holds_for_a_byte_level_tokenizer(text: str) -> None:
    # Byte-level BPE: no token is shorter than one byte, so tokens <= UTF-8 bytes.
    # The worst case is one token per byte; code points never beat that.
    worst_case_tokens = len(text.encode())
    body = ('{"messages":[{"role":"user","content":"' + text + '"}]}').encode()
    call = Call("chat", "chat", "gpt-4o", body_bytes=len(body), input_chars=len(text))
    assert input_bound(call) >= worst_case_tokens




@cases("lookup")
def test_a_name_looked_up_again_finds_the_same_price(case: dict[str, Any]) -> None:
    table = PriceTable.load()
    first = table.price(case["model"])
    assert table.price(case["model"]) is first
    assert (first.model if first else None) == case["want"]


def test_the_lookup_memo_is_bounded_and_names_past_it_still_resolve() -> None:
    """Model names are the caller's: many distinct ones must not grow the table's memory."""
    table = PriceTable.load()
    for i in range(_FOUND_MAX + 1000):
        assert table.price(f"unknown-model-{i}") is None
    found = table.price("gpt-4o-mini-2024-07-18")
    assert found is not None and found.model == "gpt-4o-mini"
    assert len(table._found) == _FOUND_MAX
