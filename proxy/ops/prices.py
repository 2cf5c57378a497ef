"""`spanmeter prices`: what a model costs and where each number came from, and the opt-in
refresh of genai-prices' data into a file the proxy reads at start-up only."""

from __future__ import annotations

import json
import urllib.request
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import yaml

from proxy.pricing.compiler import from_snapshot
from proxy.pricing.table import DEFAULT_PATH, PriceTable

__all__ = ["describe", "refresh"]

# genai-prices' own update URL (genai_prices.update_prices.DEFAULT_UPDATE_URL): its published
# data, the same providers list its package ships, as JSON.
UPDATE_URL = "https://raw.githubusercontent.com/pydantic/genai-prices/refs/heads/main/prices/new_data/v2/data.json"
_FIELDS = ("input", "cached_input", "cache_write", "cache_write_1h", "output")


def describe(table: PriceTable, model: str, provider: str | None, overrides: dict[str, Any]) -> list[str] | None:
    """Lines saying what `model` costs per million tokens and where each number came from."""
    price = table.price(model, provider)
    if price is None:
        return None
    shipped = (yaml.safe_load(DEFAULT_PATH.read_text(encoding="utf-8")) or {}).get("models") or {}
    mine, override = shipped.get(price.model) or {}, overrides.get(price.model) or {}
    below = table.source.first_party(price.model) if table.source is not None else None
    genai = below.source if below is not None else price.source  # genai-prices' own row, unmerged

    def origin(field: str) -> str:
        if field in override:
            return "config prices (override)"
        if field in mine:
            return f"prices.yaml ({mine['source']}, {mine.get('as_of')})" if "source" in mine else "prices.yaml"
        return genai

    lines = [f"{model}{f' at {provider}' if provider else ''}: priced as {price.model}, USD per million tokens"]
    for field in _FIELDS:
        value = getattr(price, field)
        shown = _usd(value) if value is not None else f"{_usd(price.cache_write)} (as cache_write)"
        lines.append(f"  {field:<16}{shown:<14} {origin(field)}")
    lc = price.long_context
    if lc is not None:
        rates = ", ".join(f"{f} {_usd(getattr(lc, f))}" for f in _FIELDS if getattr(lc, f) is not None)
        lines.append(f"  {'long_context':<16}{'over ' + str(lc.threshold_tokens):<14} {origin('long_context')}")
        lines.append(f"  {'':<16}the whole request: {rates}")
    for field in ("service_tiers", "inference_geos"):
        factors = getattr(price, field)
        if factors:
            shown = ", ".join(f"{name} x{_factor(f)}" for name, f in factors)
            lines.append(f"  {field:<16}{shown}  ({origin(field)})")
    if price.max_output_tokens:
        lines.append(f"  {'max_output':<16}{price.max_output_tokens:<14} {origin('max_output_tokens')}")
    return lines


def refresh(data_dir: str | Path, url: str = UPDATE_URL, timeout_s: float = 30.0) -> Path:
    """Fetch genai-prices' published data into {data_dir}/prices.json with its date. The proxy
    reads it only at start-up, and only when the setting prices_file names it."""
    with urllib.request.urlopen(url, timeout=timeout_s) as answer:
        providers = json.loads(answer.read())
    doc = json.dumps({"fetched_at": datetime.now(UTC).isoformat(timespec="seconds"), "url": url,
                      "providers": providers})
    from_snapshot(doc)  # refuse to store what the proxy could not read at start-up
    path = Path(data_dir) / "prices.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(doc, encoding="utf-8")
    tmp.replace(path)
    return path


def _usd(micros: int) -> str:
    text = f"{Decimal(micros) / 1_000_000:f}"
    return "$" + (text.rstrip("0").rstrip(".") if "." in text else text)


def _factor(f: Any) -> str:
    return str(Decimal(f.numerator) / Decimal(f.denominator))
