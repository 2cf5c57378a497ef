"""genai-prices' data compiled into our `Price` rows (proxy/pricing/source.py). Pure.

Read once, when the table loads; genai-prices' `calc_price` is never called on the call
path. Each choice of the mapping (the prices in force, the dearest of time-of-day prices,
the rates carried, long-context tiers, service-tier factors, name matchers) is ours,
read off its types, and errs dearer, never cheaper: docs/budgets.md, "How genai-prices'
data becomes our prices".
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Iterable
from datetime import date
from decimal import Decimal
from fractions import Fraction
from typing import Any, Final

import pydantic
from genai_prices.types import (
    ClauseAnd,
    ClauseContains,
    ClauseEndsWith,
    ClauseEquals,
    ClauseOr,
    ClauseRegex,
    ClauseStartsWith,
    ConditionalPrice,
    MatchLogic,
    ModelInfo,
    ModelPrice,
    PriceVariant,
    Provider,
    StartDateConstraint,
    Tier,
    TieredPrices,
    TimeOfDateConstraint,
)

from proxy.pricing.row import LongContext, Price
from proxy.pricing.source import Matcher, PriceSource, ProviderPrices

__all__ = ["compile_installed", "compile_source", "from_snapshot"]

_SCALE: Final = 1_000_000


def compile_source(providers: Iterable[Provider], today: date, label: str) -> PriceSource:
    return PriceSource([_provider(p, today, label) for p in providers], label)


def _provider(provider: Provider, today: date, label: str) -> ProviderPrices:
    exact: dict[str, Price] = {}
    patterns: list[tuple[Matcher, Price]] = []
    source = f"{label} ({provider.id})"
    for model in provider.models:
        price = _model(model, today, source, label)
        if price is None:
            continue
        names, rest = _split(model.match)
        for name in names:
            exact.setdefault(name, price)  # the data's first model wins, as in genai-prices
        patterns += [(_matcher(clause), price) for clause in rest]
    match = _matcher(provider.model_match) if provider.model_match is not None else None
    return ProviderPrices(provider.id, exact, tuple(patterns), tuple(provider.fallback_model_providers or ()),
                          match)


def _split(clause: MatchLogic) -> tuple[list[str], list[MatchLogic]]:
    """Exact names out of a top-level `equals` or `or` of them; the rest stays a matcher."""
    parts = clause.or_ if isinstance(clause, ClauseOr) else [clause]
    names = [c.equals.lower() for c in parts if isinstance(c, ClauseEquals)]
    return names, [c for c in parts if not isinstance(c, ClauseEquals)]


def _matcher(clause: MatchLogic) -> Matcher:
    if isinstance(clause, ClauseEquals):
        return Matcher("eq", clause.equals.lower())
    if isinstance(clause, ClauseStartsWith):
        return Matcher("starts", clause.starts_with.lower())
    if isinstance(clause, ClauseEndsWith):
        return Matcher("ends", clause.ends_with.lower())
    if isinstance(clause, ClauseContains):
        return Matcher("contains", clause.contains.lower())
    if isinstance(clause, ClauseRegex):
        re.compile(clause.regex)  # a pattern Python cannot compile is refused when the data loads
        return Matcher("regex", clause.regex)
    if isinstance(clause, ClauseOr):
        return Matcher("or", tuple(_matcher(c) for c in clause.or_))
    if isinstance(clause, ClauseAnd):
        return Matcher("and", tuple(_matcher(c) for c in clause.and_))
    raise ValueError(f"genai-prices: a match clause this version of spanmeter cannot read: {clause!r}")


def _model(model: ModelInfo, today: date, source: str, label: str) -> Price | None:
    prices = _in_force(model.prices, today)
    if getattr(prices, "input_mtok", None) is None or getattr(prices, "output_mtok", None) is None:
        return None
    r_in, lc_in = _rate(prices, "input_mtok")
    r_out, lc_out = _rate(prices, "output_mtok")
    r_read, lc_read = _rate(prices, "cache_read_mtok", r_in, lc_in)
    r_write, lc_write = _rate(prices, "cache_write_mtok", r_in, lc_in)
    if getattr(prices, "cache_write_mtok", None) is None and getattr(prices, "cache_write_5m_mtok", None) is not None:
        r_write, lc_write = _rate(prices, "cache_write_5m_mtok", r_in, lc_in)
    r_1h: int | None = None
    lc_1h: int | None = None
    if getattr(prices, "cache_write_1h_mtok", None) is not None:
        r_1h, lc_1h = _rate(prices, "cache_write_1h_mtok")
    start = _tier_start(prices)
    long_context = None if start is None else LongContext(
        threshold_tokens=start, input=lc_in, cached_input=lc_read, cache_write=lc_write, output=lc_out,
        cache_write_1h=lc_1h if r_1h is not None else None)
    return Price(model=model.id, input=r_in, cached_input=r_read, cache_write=r_write, output=r_out,
                 source=source, as_of=label, long_context=long_context, cache_write_1h=r_1h,
                 service_tiers=_service_tiers(model.price_variants or (), prices, today))


def _in_force(prices: ModelPrice | list[ConditionalPrice], today: date) -> ModelPrice:
    """The standard prices today: the latest started price, merged with any time-of-day one."""
    if isinstance(prices, ModelPrice):
        return prices
    dated = [c for c in prices if not isinstance(c.constraint, TimeOfDateConstraint)]
    started = [c for c in dated if not isinstance(c.constraint, StartDateConstraint)
               or c.constraint.start_date <= today]
    chosen = (started or dated or prices)[-1].prices
    timed = [c.prices for c in prices if isinstance(c.constraint, TimeOfDateConstraint)]
    return _dearest(chosen, timed) if timed else chosen


def _dearest(base: ModelPrice, others: list[ModelPrice]) -> ModelPrice:
    merged = dict(vars(base))
    for other in others:
        for key, value in vars(other).items():
            mine = merged.get(key)
            if value is not None and (mine is None or _top(value) > _top(mine)):
                merged[key] = value
    return ModelPrice(**merged)


def _top(value: Decimal | TieredPrices) -> Decimal:
    return value.tiers[-1].price if isinstance(value, TieredPrices) and value.tiers else (
        value.base if isinstance(value, TieredPrices) else value)


def _rate(prices: ModelPrice, key: str, default: int = 0, default_lc: int = 0) -> tuple[int, int]:
    """(base, long-context) micro-USD per million tokens for one rate; absent: the defaults."""
    value = getattr(prices, key, None)
    if value is None:
        return default, default_lc
    if isinstance(value, TieredPrices):
        return _micros(value.base), _micros(_top(value))
    return _micros(value), _micros(value)


def _tier_start(prices: ModelPrice) -> int | None:
    starts = [t.start for v in vars(prices).values() if isinstance(v, TieredPrices) for t in v.tiers]
    return min(starts) if starts else None


def _micros(usd_per_mtok: Decimal) -> int:
    """USD per million tokens -> integer micro-USD per million, rounded up (never low)."""
    return math.ceil(usd_per_mtok * _SCALE)


_TIER_KEYS: Final = ("input_mtok", "cache_read_mtok", "cache_write_mtok", "cache_write_1h_mtok", "output_mtok")


def _service_tiers(variants: Iterable[PriceVariant], standard: ModelPrice,
                   today: date) -> tuple[tuple[str, Fraction], ...]:
    out: dict[str, Fraction] = {}
    for variant in variants:
        tier = variant.when.get("service_tier")
        if tier is None or len(variant.when) != 1 or tier in out:
            continue
        if isinstance(variant.constraint, StartDateConstraint) and variant.constraint.start_date > today:
            continue
        factor = _exact_multiple(variant.prices, standard)
        if factor is not None and factor != 1:
            out[tier] = factor
    return tuple(out.items())


def _exact_multiple(variant: ModelPrice, standard: ModelPrice) -> Fraction | None:
    """The one factor every rate the variant sets is of the standard rate, or None."""
    ratios = set()
    for key in _TIER_KEYS:
        mine, base = getattr(variant, key, None), getattr(standard, key, None)
        if mine is None:
            continue
        if isinstance(mine, TieredPrices) or isinstance(base, TieredPrices) or not base:
            return None
        ratios.add(Fraction(mine) / Fraction(base))
    return ratios.pop() if len(ratios) == 1 else None


def compile_installed(today: date) -> PriceSource:
    """The installed genai-prices' data, compiled for `today`. Importing its data costs ~0.2 s
    and ~6 MB that the process keeps: proxy/pricing/bundled.py runs this in a process of its
    own and caches what it compiled."""
    from genai_prices import __version__
    from genai_prices.data import providers  # ~2,300 models, imported here only

    return compile_source(providers, today, f"genai-prices {__version__}")


def from_snapshot(text: str | bytes, today: date | None = None) -> PriceSource:
    """A refreshed data file (`spanmeter prices --refresh`), compiled for `today`.

    The file is {"fetched_at": ISO time, "url": where from, "providers": genai-prices'
    published JSON (a list of providers)}; its rows are labelled with the fetch date.
    """
    doc = json.loads(text)
    if not isinstance(doc, dict) or not isinstance(doc.get("providers"), list):
        raise ValueError("prices file: expected {\"fetched_at\": ..., \"providers\": [...]}, as written by "
                         "`spanmeter prices --refresh`")
    label = f"genai-prices data fetched {str(doc.get('fetched_at', 'at an unknown time'))[:10]}"
    providers = _providers_adapter().validate_python([_provider_raw(p) for p in doc["providers"]])
    return compile_source(providers, today or date.today(), label)


# Providers are dataclasses with pydantic validation; a ModelPrice is a plain class holding
# whatever price keys the data names, so its raw mappings are built here before validation.
# Built on first use: a refreshed file is read at most once per start, and building the schema
# at import would cost every start-up.
@functools.cache
def _providers_adapter() -> pydantic.TypeAdapter[list[Provider]]:
    return pydantic.TypeAdapter(list[Provider], config=pydantic.ConfigDict(arbitrary_types_allowed=True))


def _provider_raw(raw: dict[str, Any]) -> dict[str, Any]:
    # Extractors read response bodies, which spanmeter's adapters do themselves.
    return {**{k: v for k, v in raw.items() if k not in ("extractors", "models")},
            "models": [_model_raw(m) for m in raw.get("models") or []]}


def _model_raw(raw: dict[str, Any]) -> dict[str, Any]:
    prices = raw.get("prices") or {}
    out = {**raw, "prices": ([{**c, "prices": _model_price(c.get("prices") or {})} for c in prices]
                             if isinstance(prices, list) else _model_price(prices))}
    if raw.get("price_variants"):
        out["price_variants"] = [{**v, "prices": _model_price(v.get("prices") or {})} for v in raw["price_variants"]]
    return out


def _model_price(raw: dict[str, Any]) -> ModelPrice:
    return ModelPrice(**{key: _price_value(value) for key, value in raw.items() if value is not None})


def _price_value(raw: Any) -> Decimal | TieredPrices:
    if isinstance(raw, dict):
        return TieredPrices(base=Decimal(str(raw["base"])),
                            tiers=[Tier(start=int(t["start"]), price=Decimal(str(t["price"]))) for t in raw["tiers"]])
    return Decimal(str(raw))
