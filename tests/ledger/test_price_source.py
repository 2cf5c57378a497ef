"""genai-prices' data compiled into our rows: the rules of the compiler on a data file the
test writes (the shape `spanmeter prices --refresh` stores), the provider-aware lookup on the
installed data, and every rate prices.yaml ships that differs from genai-prices', each with
the side we keep and why (tests/data/ledger/price_disagreements.json)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import date
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import yaml

from proxy.pricing.bundled import bundled
from proxy.pricing.compiler import from_snapshot
from proxy.pricing.row import LongContext, Price
from proxy.pricing.source import PriceSource
from proxy.pricing.table import PriceTable, _price

ROOT = Path(__file__).resolve().parents[2]
DISAGREEMENTS = ROOT / "tests" / "data" / "ledger" / "price_disagreements.json"
TODAY = date(2026, 6, 1)

SNAPSHOT = {
    "fetched_at": "2026-05-30T09:00:00+00:00",
    "url": "https://example.invalid/data.json",
    "providers": [{
        "id": "groq", "name": "Groq", "api_pattern": "https://api\\.groq\\.com", "model_match": {"equals": "dated"},
        "extractors": [{"root": "usage", "mappings": []}],
        "models": [
            {"id": "dated", "match": {"equals": "dated"}, "prices": [
                {"prices": {"input_mtok": 1, "output_mtok": 2}},
                {"constraint": {"start_date": "2026-01-01"}, "prices": {"input_mtok": 3, "output_mtok": 4}},
                {"constraint": {"start_date": "2027-01-01"}, "prices": {"input_mtok": 9, "output_mtok": 9}}]},
            {"id": "offpeak", "match": {"equals": "offpeak"}, "prices": [
                {"prices": {"input_mtok": 0.135, "cache_read_mtok": 0.035, "output_mtok": 0.55}},
                {"constraint": {"start_time": "00:30:00Z", "end_time": "16:30:00Z"},
                 "prices": {"input_mtok": 0.27, "cache_read_mtok": 0.07, "output_mtok": 1.1}}]},
            {"id": "long", "match": {"or": [{"equals": "long"}, {"starts_with": "long-"}]}, "prices": {
                "input_mtok": {"base": 3, "tiers": [{"start": 200000, "price": 6}]},
                "cache_read_mtok": {"base": 0.3, "tiers": [{"start": 200000, "price": 0.6}]},
                "cache_write_mtok": 3.75, "cache_write_1h_mtok": 6,
                "output_mtok": {"base": 15, "tiers": [{"start": 200000, "price": 22.5}]}}},
            {"id": "tiered", "match": {"contains": "tiered"},
             "prices": {"input_mtok": 2, "cache_read_mtok": 0.5, "output_mtok": 8},
             "price_variants": [
                 {"when": {"service_tier": "flex"}, "prices": {"input_mtok": 1, "cache_read_mtok": 0.25,
                                                               "output_mtok": 4}},
                 {"when": {"service_tier": "priority"}, "prices": {"input_mtok": 3.5, "output_mtok": 16}},
                 {"when": {"processing": "batch"}, "prices": {"input_mtok": 1, "output_mtok": 4}}]},
            {"id": "hours", "match": {"equals": "hours"}, "prices": {"audio_hours": 0.1}},
            {"id": "fine", "match": {"regex": "^fine-\\d+$"}, "prices": {"input_mtok": 0.0000001, "output_mtok": 1}},
        ]}],
}


def _source() -> PriceSource:
    return from_snapshot(json.dumps(SNAPSHOT), TODAY)


def _rates(p: Price | LongContext | None) -> tuple[int | None, ...] | None:
    if p is None:
        return None
    return (p.input, p.cached_input, p.cache_write, p.cache_write_1h, p.output)


def test_the_latest_started_price_is_in_force() -> None:
    dated = _source().find("groq", "dated")
    assert dated is not None and (dated.input, dated.output) == (3_000_000, 4_000_000)
    assert dated.source == "genai-prices data fetched 2026-05-30 (groq)"


def test_a_time_of_day_price_reserves_and_charges_at_the_dearest() -> None:
    assert _rates(_source().find("groq", "offpeak")) == (270_000, 70_000, 270_000, None, 1_100_000)


def test_a_tiered_price_is_a_long_context_tier_over_its_start() -> None:
    long = _source().find("groq", "LONG-2025")  # a starts_with clause, matched lowercased
    assert long is not None and _rates(long) == (3_000_000, 300_000, 3_750_000, 6_000_000, 15_000_000)
    assert long.long_context is not None and long.long_context.threshold_tokens == 200_000
    # Rates that have no tier stay the same over it.
    assert _rates(long.long_context) == (6_000_000, 600_000, 3_750_000, 6_000_000, 22_500_000)


def test_only_service_tiers_that_are_exact_multiples_become_factors() -> None:
    tiered = _source().find("groq", "my-tiered-model")  # a contains clause
    assert tiered is not None and dict(tiered.service_tiers) == {"flex": Decimal("0.5")}
    assert tiered.cache_write == tiered.input  # no write premium listed: writes bill as input


def test_models_without_token_prices_are_left_out_and_rates_round_up() -> None:
    source = _source()
    assert source.find("groq", "hours") is None
    fine = source.find("groq", "fine-7")
    assert fine is not None and fine.input == 1  # 0.1 micro-USD per million: charged 1, never 0
    assert source.find("groq", "fine-x") is None


def test_a_table_looks_a_model_up_at_the_calls_provider(tmp_path: Path) -> None:
    shipped = tmp_path / "prices.yaml"
    shipped.write_text("models:\n  sim-small: {input: 1, output: 2, source: spanmeter simulator (fictional), "
                       "as_of: 2026-11-29}\n  dated: {max_output_tokens: 64}\n  gone: {max_output_tokens: 64}\n")
    table = PriceTable.load(shipped, source=_source())
    dated = table.price("dated", provider="groq")
    assert dated is table.price("dated", provider="groq") and dated is not None and dated.max_output_tokens == 64
    # A shipped row that only adds to a model the source lacks prices nothing.
    assert table.price("gone") is None
    # Unknown provider and no first-party provider whose model names look like it: no price.
    assert table.price("offpeak") is None and table.price("offpeak", provider="acme") is None
    # Our shipped rows still come first, whatever the source.
    sim = table.price("sim-small", provider="groq")
    assert sim is not None and sim.source == "spanmeter simulator (fictional)"


def test_a_bad_prices_file_says_what_it_expected() -> None:
    with pytest.raises(ValueError, match="spanmeter prices --refresh"):
        from_snapshot("[]", TODAY)


# ------------------------------------------------------------------ the installed data

TABLE = PriceTable.load()


@pytest.mark.parametrize(("model", "provider", "want_source"), [
    ("llama-3.3-70b-versatile", "groq", "(groq)"),
    ("gpt-4o", "azure.ai.openai", "genai-prices"),  # Azure falls back to OpenAI's rows
    ("claude-sonnet-4-5@20250929", "gcp.vertex_ai", "(anthropic)"),  # Vertex falls back to Anthropic
    ("deepseek-chat", "deepseek", "(deepseek)"),
    ("grok-4", "x_ai", "(x-ai)"),
    ("claude-haiku-4-5", "some-new-gateway", "(anthropic)"),  # unknown provider: first party
    ("mistral-large-latest", None, "(mistral)"),
])
def test_installed_data_prices_models_at_their_provider(model: str, provider: str | None,
                                                        want_source: str) -> None:
    price = TABLE.price(model, provider)
    assert price is not None and want_source in price.source and price.output > 0


def test_a_local_model_is_free_deliberately() -> None:
    price = TABLE.price("qwen3:8b", provider="ollama")
    assert price is not None and _rates(price) == (0, 0, 0, None, 0) and "$0 deliberately" in price.source


def test_config_overrides_win_over_genai_prices() -> None:
    table = PriceTable.load(overrides={"gpt-5": {"input": 9}})
    for provider in (None, "openai", "azure.ai.openai"):
        price = table.price("gpt-5", provider)
        assert price is not None and price.input == 9_000_000 and price.output == 10_000_000


# ------------------------------------------------------------------ where we and genai-prices differ

def _fmt(p: Price | LongContext | None) -> str | None:
    if p is None:
        return None
    rates = "/".join("-" if r is None else _usd(r) for r in _rates(p) or ())
    return f"{p.threshold_tokens}: {rates}" if isinstance(p, LongContext) else rates


def _usd(micros: int) -> str:
    text = f"{Decimal(micros) / 1_000_000:f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def _disagreements(source: PriceSource) -> list[dict[str, Any]]:
    """Every rate a full prices.yaml row ships that differs from genai-prices' row for the
    same name (its first-party provider's), and every full row genai-prices lacks."""
    raw = yaml.safe_load((ROOT / "proxy" / "data" / "prices.yaml").read_text())["models"]
    found = []
    for name, entry in raw.items():
        if "input" not in entry:
            continue  # a supplement: genai-prices' rates with our max output and tiers
        ours, theirs = _price(name, entry), source.first_party(name)
        if theirs is None:
            found.append({"model": name, "field": "*", "ours": _fmt(ours), "genai_prices": None})
            continue
        for field in ("input", "cached_input", "cache_write", "cache_write_1h", "output"):
            mine, other = getattr(ours, field), getattr(theirs, field)
            if field == "cache_write_1h" and mine is None:
                continue  # we ship none: genai-prices' rate is merged in
            if mine != other:
                found.append({"model": name, "field": field, "ours": mine, "genai_prices": other})
        if _fmt(ours.long_context) != _fmt(theirs.long_context):
            found.append({"model": name, "field": "long_context", "ours": _fmt(ours.long_context),
                          "genai_prices": _fmt(theirs.long_context)})
    return found


def test_every_disagreement_with_genai_prices_is_listed_with_the_side_we_keep() -> None:
    listed = json.loads(DISAGREEMENTS.read_text())
    assert all(e["keep"] in ("ours", "genai-prices") and len(e["why"]) > 20 for e in listed)
    key = ("model", "field", "ours", "genai_prices")
    now = sorted(json.dumps([d[k] for k in key]) for d in _disagreements(bundled()))
    assert now == sorted(json.dumps([e[k] for k in key]) for e in listed), (
        "prices.yaml and genai-prices differ in other ways than price_disagreements.json lists: "
        "decide each new one (keep ours with a source, or drop our row), and drop entries that vanished")


def test_a_row_we_keep_is_the_one_the_table_uses() -> None:
    for entry in json.loads(DISAGREEMENTS.read_text()):
        if entry["keep"] == "ours" and entry["field"] == "long_context":
            price = TABLE.price(entry["model"])
            assert price is not None and _fmt(price.long_context) == entry["ours"]


# ------------------------------------------------------------------ compiled apart and cached

def test_compiled_rows_read_back_from_json_price_every_name_the_same() -> None:
    from proxy.pricing.compiler import compile_installed

    compiled = compile_installed(TODAY)
    again = PriceSource.from_json(json.loads(json.dumps(compiled.to_json())))
    assert again.to_json() == compiled.to_json()
    names = [(p["id"], n) for p in compiled.to_json()["providers"] for n in p["exact"]]
    names += [("groq", "llama-3.3-70b-versatile"), ("mistral", "mistral-large-latest"),
              ("aws-bedrock", "us.anthropic.claude-3-7-sonnet-20250219-v1:0"), ("openai", "gpt-4o-2024-08-06")]
    assert len(names) > 1000
    assert all(compiled.find(pid, n) == again.find(pid, n) for pid, n in names)
    assert again.find("mistral", "mistral-large-latest") is not None  # a matcher, not an exact name


_SERVE = ("import sys; from proxy.pricing import PriceTable; t = PriceTable.load(); "
          "print(t.price('gpt-4o').input, 'genai_prices' in sys.modules)")


def test_a_serving_process_loads_compiled_rows_without_importing_genai_prices(tmp_path: Path) -> None:
    env = {**os.environ, "SPANMETER_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    first = subprocess.run([sys.executable, "-c", _SERVE], env=env, capture_output=True, text=True, check=True)
    assert first.stdout.split() == ["2500000", "False"], first.stderr
    (cached,) = tmp_path.glob("prices-*.json")
    stamp = cached.stat().st_mtime_ns
    second = subprocess.run([sys.executable, "-c", _SERVE], env=env, capture_output=True, text=True, check=True)
    assert second.stdout == first.stdout and cached.stat().st_mtime_ns == stamp  # read, not compiled again
    cached.write_text("{not json")
    third = subprocess.run([sys.executable, "-c", _SERVE], env=env, capture_output=True, text=True, check=True)
    assert third.stdout == first.stdout and "unreadable" in third.stderr
    assert json.loads(cached.read_text())["label"].startswith("genai-prices ")  # compiled and kept again
