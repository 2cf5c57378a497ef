"""Model prices and the cost of a call, in integer micro-USD. Pure: no I/O after load.

Rates are integer micro-USD per million tokens; a cost is computed exactly in integers
and rounded up once (at most 1 micro-USD high, never low). `input_bound` bounds a
request's input tokens by its body bytes plus `PROVIDER_OVERHEAD_TOKENS`; output is bounded
by the max-token value times the output multiplier; stored context is reserved at
`dearest_input_rate` from the size the ledger remembers. Why bytes bound tokens, where the
bound is loose and where it is no bound at all: docs/budgets.md, "How a cost is computed
and bounded".
"""

from __future__ import annotations

import re
from dataclasses import replace
from datetime import date
from decimal import Decimal
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import yaml

from proxy.model import Call, Usage
from proxy.pricing.row import STANDARD_FACTOR, LongContext, Price

if TYPE_CHECKING:
    from proxy.pricing.source import PriceSource

__all__ = [
    "PROVIDER_OVERHEAD_TOKENS",
    "STANDARD_FACTOR",
    "LongContext",
    "Price",
    "PriceTable",
    "affordable_output_tokens",
    "cache_savings",
    "cache_write_premium",
    "cost",
    "dearest_input_rate",
    "input_bound",
    "reservation",
]

DEFAULT_PATH = Path(__file__).resolve().parent.parent / "data" / "prices.yaml"
PROVIDER_OVERHEAD_TOKENS = 2048
_SCALE = 1_000_000  # rates are micro-USD per million tokens
_UNLIMITED = 2**31 - 1

# A dated or versioned variant of a known model: -2024-08-06, -20250929, @20250929,
# -0613 (OpenAI's month-day snapshots), -001, -latest, -preview-05-20, -exp. Anything else ("gpt-5-pro", "gpt-4o-audio")
# is a different model with a different price and must not inherit the base price.
_VARIANT = re.compile(r"^(?:[-@](?:\d{4}-\d{2}-\d{2}|\d{8}|\d{2}-\d{2,4}|\d{3,4}|latest|preview|exp|v\d+(?::\d+)?))+$")
_FOUND_MAX: Final = 4096  # dated names remembered by a PriceTable (`_base`)


class PriceTable:
    """Prices from genai-prices, our shipped rows and config overrides; lookup by exact name,
    dated variant or alias, and optionally by provider.

    Precedence, last wins: genai-prices' row for the model (at the provider the call went
    to, else at the model's first-party provider), then our shipped prices.yaml row for that
    name (field by field: what a yaml entry leaves out comes from genai-prices), then config
    `pricing.overrides` (field by field again). docs/budgets.md has the full story.

    An alias (`claude-sonnet-4-0`, `gpt-4o`, `gemini-flash-latest`) is a name the provider
    resolves to another model, and may resolve to a newer one tomorrow. Looking one up
    gives the dearest of its own price and those of every model it may resolve to: the
    reservation for a call must cover whichever runs. What the call is charged is the
    price of the model the answer names, when the table knows it (proxy.serve.bookkeeping).
    """

    def __init__(self, prices: dict[str, Price], aliases: dict[str, tuple[str, ...]] | None = None,
                 unpriced: dict[str, str] | None = None, source: PriceSource | None = None) -> None:
        self._prices = prices
        self.source = source
        # Longest names first, so "gpt-4o-mini-2024-07-18" finds gpt-4o-mini, not gpt-4o.
        self._by_length = sorted(prices, key=len, reverse=True)
        # A dated name's variant search walks every known name (10 us, twice a call), and a
        # genai-prices miss scans its matchers: each (provider, name) is looked up once.
        # Names are the caller's, so the memo is bounded.
        self._found: dict[str, Price | None] = {}
        self._by_provider: dict[tuple[str, str], Price | None] = {}
        self._aliases = {name: _dearest(name, self._base(name), {t: self._base(t) for t in targets})
                         for name, targets in (aliases or {}).items()}
        self._unpriced = dict(unpriced or {})

    @classmethod
    def load(cls, path: str | Path | None = None, overrides: dict[str, Any] | None = None,
             source: PriceSource | None = None) -> PriceTable:
        """Our shipped rows over `source` (default: the installed genai-prices' data, compiled
        for today), with `overrides` (config pricing.overrides) over both."""
        if source is None:
            from proxy.pricing.bundled import bundled

            source = bundled()
        raw = yaml.safe_load(Path(path or DEFAULT_PATH).read_text(encoding="utf-8")) or {}
        models = raw.get("models") or {}
        # A row that only adds to genai-prices' (max output, tiers) prices nothing without it.
        prices = {name: _merged(base, name, entry) for name, entry in models.items()
                  if (base := source.first_party(name)) is not None or "input" in entry}
        for name, entry in (overrides or {}).items():
            prices[name] = _override(prices.get(name) or source.first_party(name), name, entry)
        return cls(prices, _aliases(raw.get("aliases")), {str(k): str(v) for k, v in
                                                          (raw.get("unpriced") or {}).items()}, source)

    def unpriced(self) -> dict[str, str]:
        """Model names deliberately left without a price, each with the reason."""
        return dict(self._unpriced)

    def __contains__(self, model: str) -> bool:
        return self.price(model) is not None

    def __len__(self) -> int:
        return len(self._prices)

    def models(self) -> list[str]:
        """The names of our shipped and configured rows (genai-prices' are not listed)."""
        return sorted(self._prices)

    def price(self, model: str | None, provider: str | None = None) -> Price | None:
        """The model's price; `provider` is the call's gen_ai.provider.name (None: unknown,
        priced at the model's first-party provider)."""
        if not model:
            return None
        name = model.removeprefix("models/")
        alias = self._aliases.get(name)
        if alias is not None:
            return alias
        if provider is None:
            return self._base(name)
        key = (provider, name)
        if key in self._by_provider:
            return self._by_provider[key]
        found = self._at(provider, name)
        if len(self._by_provider) < _FOUND_MAX:
            self._by_provider[key] = found
        return found

    def _at(self, provider: str, name: str) -> Price | None:
        from proxy.pricing.source import FREE_PROVIDERS, PROVIDERS

        if provider in FREE_PROVIDERS:
            return _free(name, provider)
        genai_id = PROVIDERS.get(provider)
        if genai_id is None or self.source is None or genai_id not in self.source.provider_ids():
            return self._base(name)
        return self._shipped(name) or self.source.find(genai_id, name)

    def _base(self, name: str) -> Price | None:
        found = self._prices.get(name)
        if found is not None:
            return found
        if name in self._found:
            return self._found[name]
        found = self._shipped(name)
        if found is None and self.source is not None:
            found = self.source.first_party(name)
        if len(self._found) < _FOUND_MAX:
            self._found[name] = found
        return found

    def _shipped(self, name: str) -> Price | None:
        """Our own row (prices.yaml or config) for the name or the model it is a dated variant of."""
        found = self._prices.get(name)
        if found is not None:
            return found
        return next((self._prices[known] for known in self._by_length
                     if name.startswith(known) and _VARIANT.match(name[len(known):])), None)


def _free(name: str, provider: str) -> Price:
    return Price(model=name, input=0, cached_input=0, cache_write=0, output=0,
                 source=f"{provider}: runs on your own hardware, priced at $0 deliberately", as_of="always")


def _aliases(raw: Any) -> dict[str, tuple[str, ...]]:
    """{alias: [model, ...]} from prices.yaml; a single target may be written bare."""
    if not raw:
        return {}
    if not isinstance(raw, dict):
        raise ValueError(f"prices aliases: expected a mapping of alias to its models, got {raw!r}")
    return {str(name): tuple(str(t) for t in (targets if isinstance(targets, list) else [targets]))
            for name, targets in raw.items()}


def _dearest(alias: str, own: Price | None, targets: dict[str, Price | None]) -> Price:
    """The dearest of the alias's own price and its targets' (output, then input, then cache
    rates). Every target must have a price, or the reservation could fall short of the model
    that runs."""
    missing = [t for t, p in targets.items() if p is None]
    if missing or not targets:
        raise ValueError(f"prices alias {alias}: {', '.join(missing) or 'no model'} has no price; "
                         "add it under `models:` (or pricing.overrides) or drop the alias")
    known = [p for p in (*targets.values(), own) if p is not None]  # a tie names the target
    return max(known, key=lambda p: (p.output, p.input, p.cache_write_1h_rate(0), p.cache_write, p.cached_input))


def cost(price: Price, usage: Usage) -> int:
    """Micro-USD for the usage a provider reported (gen_ai terms, see `Usage`).

    input_tokens includes cache reads and writes, so those are taken out of it and
    priced at their own rates (1-hour cache writes at theirs); output_tokens already
    includes reasoning tokens. The whole is then scaled by the service tier and inference
    geography the usage names (`Price.multiplier`).
    Fields the provider never reported count as zero here: when usage is unknown or the
    stream was cut, proxy.govern.ceilings.settle_amount charges the reservation instead (unknown is not zero).
    """
    if usage.billed_micros is not None:
        return usage.billed_micros  # what the host billed (OpenRouter) is the cost
    total_in = usage.input_tokens or 0
    cached = usage.cache_read_tokens or 0
    written = usage.cache_write_tokens or 0
    written_1h = min(usage.cache_write_1h_tokens or 0, written)
    uncached = max(0, total_in - cached - written)
    size = max(total_in, cached + written)
    r_in, r_cached, r_write, r_out = price.rates(size)
    micro = (uncached * r_in + cached * r_cached + (written - written_1h) * r_write
             + written_1h * price.cache_write_1h_rate(size) + (usage.output_tokens or 0) * r_out)
    factor = price.multiplier(usage)
    return _ceil_div(micro * factor.numerator, _SCALE * factor.denominator)


def cache_savings(price: Price, usage: Usage) -> int:
    """Micro-USD the usage's cache reads saved: what `cost` would be had they been billed
    as uncached input, minus what it is (tier and long-context rates included). Cache
    writes are not netted out: Anthropic's write premium is in the cost itself."""
    if not usage.cache_read_tokens:
        return 0
    return max(0, cost(price, replace(usage, cache_read_tokens=0)) - cost(price, usage))


def cache_write_premium(price: Price, usage: Usage) -> int:
    """Micro-USD the usage's cache writes cost above plain input (Anthropic's 1.25x and 2x):
    `cost` minus what it would be with the writes billed as uncached input. What caching
    saved, net, is `cache_savings` minus this."""
    if not usage.cache_write_tokens:
        return 0
    return max(0, cost(price, usage) - cost(price, replace(usage, cache_write_tokens=0, cache_write_1h_tokens=0)))


def _worst_input(price: Price, input_tokens: int, cache_write: str) -> int:
    """The dearest rate an input token of this request can bill at. Cache writes bill above
    input (Anthropic 1.25x for 5 minutes, 2x for an hour) only where the request marks a
    breakpoint (Call.cache_write)."""
    r_in, r_cached, r_write, _ = price.rates(input_tokens)
    rates = [r_in, r_cached]
    if cache_write:
        rates.append(r_write)
    if cache_write == "1h":
        rates.append(price.cache_write_1h_rate(input_tokens))
    return max(rates)


def reservation(price: Price, input_bound_tokens: int, max_output_tokens: int, multiplier: int = 1,
                factor: Fraction = Fraction(1), cache_write: str = "5m") -> int:
    """Worst-case micro-USD: every input token at the dearest input rate, full output for
    each of `multiplier` answers, all at the dearest tier `factor` (Price.reserve_factor)."""
    r_out = price.rates(input_bound_tokens)[3]
    micro = (input_bound_tokens * _worst_input(price, input_bound_tokens, cache_write)
             + max_output_tokens * multiplier * r_out)
    return _ceil_div(micro * factor.numerator, _SCALE * factor.denominator)


def dearest_input_rate(price: Price, factor: Fraction = Fraction(1)) -> int:
    """The highest rate a stored-context token of this model can be billed at, in any size
    tier, times the tier `factor` (rounded up). Stored context is read, never written."""
    rates = [price.input, price.cached_input]
    if price.long_context is not None:
        rates += [price.long_context.input, price.long_context.cached_input]
    return _ceil_div(max(rates) * factor.numerator, factor.denominator)


def affordable_output_tokens(price: Price, budget_micros: int, input_bound: int, multiplier: int = 1,
                             factor: Fraction = Fraction(1), cache_write: str = "5m") -> int:
    """The largest max_output_tokens whose `reservation` fits in `budget_micros` (>= 0)."""
    r_out = price.rates(input_bound)[3]
    # budget >= (input x worst + out x n x r_out) x factor / SCALE, solved for out.
    room = budget_micros * _SCALE * factor.denominator // factor.numerator - input_bound * _worst_input(
        price, input_bound, cache_write)
    if room < 0:
        return 0
    if r_out == 0:
        return _UNLIMITED
    return min(room // (r_out * multiplier), _UNLIMITED)


def input_bound(call: Call) -> int:
    """Tokens that bound the call's billable input; see the module docstring for the rule."""
    if call.body_bytes > 0:
        return call.body_bytes + PROVIDER_OVERHEAD_TOKENS
    return 4 * call.input_chars + PROVIDER_OVERHEAD_TOKENS


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _factors(raw: Any, where: str) -> tuple[tuple[str, Fraction], ...]:
    """{name: multiplier} -> exact fractions, e.g. {flex: 0.5, priority: 2}."""
    if not raw:
        return ()
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected a mapping of name to multiplier, got {raw!r}")
    out = []
    for name, value in raw.items():
        if isinstance(value, bool) or not isinstance(value, int | float | str | Decimal):
            raise ValueError(f"{where}.{name}: expected a positive multiplier, got {value!r}")
        try:
            factor = Fraction(Decimal(str(value)))
        except (ArithmeticError, ValueError):
            raise ValueError(f"{where}.{name}: expected a positive multiplier, got {value!r}") from None
        if factor <= 0:
            raise ValueError(f"{where}.{name}: expected a positive multiplier, got {value!r}")
        out.append((str(name), STANDARD_FACTOR if factor == 1 else factor))
    return tuple(out)


def _optional_rate(entry: dict[str, Any], key: str, where: str) -> int | None:
    return _rate(entry[key], where) if entry.get(key) is not None else None


def _rate(value: Any, where: str) -> int:
    """USD per million tokens -> integer micro-USD per million tokens, exactly."""
    if isinstance(value, bool) or not isinstance(value, int | float | str | Decimal):
        raise ValueError(f"{where}: expected a number of USD per million tokens, got {value!r}")
    try:
        micros = Decimal(str(value)) * _SCALE
    except ArithmeticError:  # decimal.InvalidOperation for text that is no number
        raise ValueError(f"{where}: expected a number of USD per million tokens, got {value!r}") from None
    if micros < 0 or micros != micros.to_integral_value():
        raise ValueError(f"{where}: {value!r} is negative or finer than 1e-6 USD per million tokens")
    return int(micros)


def _price(name: str, entry: dict[str, Any]) -> Price:
    where = f"price of {name}"
    missing = [k for k in ("input", "output", "source", "as_of") if k not in entry]
    if missing:
        raise ValueError(f"{where}: missing {', '.join(missing)}")
    r_in = _rate(entry["input"], where)
    lc = entry.get("long_context")
    return Price(
        model=name,
        input=r_in,
        cached_input=_rate(entry.get("cached_input", entry["input"]), where),
        cache_write=_rate(entry.get("cache_write", entry["input"]), where),
        output=_rate(entry["output"], where),
        source=str(entry["source"]),
        as_of=_as_of(entry["as_of"]),
        max_output_tokens=int(entry["max_output_tokens"]) if entry.get("max_output_tokens") else None,
        long_context=_long_context(lc, where) if lc else None,
        cache_write_1h=_optional_rate(entry, "cache_write_1h", where),
        service_tiers=_factors(entry.get("service_tiers"), f"{where}: service_tiers"),
        inference_geos=_factors(entry.get("inference_geos"), f"{where}: inference_geos"),
    )


def _as_of(value: Any) -> str:
    return value.isoformat() if isinstance(value, date) else str(value)


def _long_context(lc: dict[str, Any], where: str) -> LongContext:
    return LongContext(
        threshold_tokens=int(lc["threshold_tokens"]),
        input=_rate(lc["input"], where),
        cached_input=_rate(lc.get("cached_input", lc["input"]), where),
        cache_write=_rate(lc.get("cache_write", lc["input"]), where),
        output=_rate(lc["output"], where),
        cache_write_1h=_optional_rate(lc, "cache_write_1h", where),
    )


_RATES: Final = ("input", "cached_input", "cache_write", "cache_write_1h", "output")


def _merged(base: Price | None, name: str, entry: dict[str, Any]) -> Price:
    """A prices.yaml row over genai-prices' row for the same name, field by field. A row that
    sets no rate (only max_output_tokens, tiers, geos) keeps genai-prices' source."""
    if base is None:
        return _price(name, entry)
    if not any(k in entry for k in (*_RATES, "long_context")):
        entry = {"source": base.source, "as_of": base.as_of, **entry}
    return _override(base, name, entry, where=f"price of {name}")


def _override(base: Price | None, name: str, entry: dict[str, Any], where: str = "") -> Price:
    """Config wins field by field; a model new to the table needs input and output."""
    if base is None:
        return _price(name, {"source": "config pricing.overrides", "as_of": "config", **entry})
    where = where or f"pricing.overrides.{name}"
    changes: dict[str, Any] = {
        "model": name,
        "source": str(entry.get("source", "config pricing.overrides")),
        "as_of": _as_of(entry.get("as_of", "config")),
    }
    for key in _RATES:
        if key in entry:
            changes[key] = _rate(entry[key], where)
    if "long_context" in entry:
        changes["long_context"] = _long_context(entry["long_context"], where) if entry["long_context"] else None
    for key in ("service_tiers", "inference_geos"):
        if key in entry:
            changes[key] = _factors(entry[key], f"{where}.{key}")
    if "max_output_tokens" in entry:
        changes["max_output_tokens"] = int(entry["max_output_tokens"]) or None
    return replace(base, **changes)
