"""A model's rates: the `Price` row every price source compiles to. Pure, no I/O.

Rates are integer micro-USD per million tokens (proxy.pricing says why).
"""

from __future__ import annotations

import functools
from fractions import Fraction

from proxy.model import Usage, frozen

__all__ = ["STANDARD_FACTOR", "LongContext", "Price"]


@frozen
class LongContext:
    """Rates billed for the whole request once its input exceeds `threshold_tokens`."""

    threshold_tokens: int
    input: int
    cached_input: int
    cache_write: int
    output: int
    cache_write_1h: int | None = None  # None: the provider has one write rate, cache_write


@frozen
class Price:
    """One model's rates in micro-USD per million tokens (= USD per token x 10^12 / 10^6)."""

    model: str
    input: int
    cached_input: int
    cache_write: int
    output: int
    source: str
    as_of: str
    max_output_tokens: int | None = None
    long_context: LongContext | None = None
    # Anthropic's 1-hour cache writes (2x input; cache_write is the 5-minute rate, 1.25x).
    # None: the provider has one write rate, cache_write.
    cache_write_1h: int | None = None
    # Multipliers on every rate, by what the usage says the call was billed as:
    # OpenAI service_tier (flex 0.5, priority 1.7-2.5 by model), Anthropic inference_geo
    # (us 1.1 on Opus/Sonnet 4.6 and later). A tier or geo not listed bills at 1x.
    service_tiers: tuple[tuple[str, Fraction], ...] = ()
    inference_geos: tuple[tuple[str, Fraction], ...] = ()

    def rates(self, input_tokens: int) -> tuple[int, int, int, int]:
        """(input, cached_input, cache_write, output) for a request of this input size."""
        lc = self.long_context
        if lc is not None and input_tokens > lc.threshold_tokens:
            return lc.input, lc.cached_input, lc.cache_write, lc.output
        return self.input, self.cached_input, self.cache_write, self.output

    def cache_write_1h_rate(self, input_tokens: int) -> int:
        """The 1-hour cache-write rate for a request of this input size."""
        lc = self.long_context
        if lc is not None and input_tokens > lc.threshold_tokens:
            return lc.cache_write if lc.cache_write_1h is None else lc.cache_write_1h
        return self.cache_write if self.cache_write_1h is None else self.cache_write_1h

    def reserve_factor(self, service_tier: str | None) -> Fraction:
        """The largest factor a call asking for `service_tier` may be billed at: a request
        without one (or `auto`) may run at any tier its project enables, and any geography."""
        if not self.service_tiers and not self.inference_geos:
            return STANDARD_FACTOR  # most models: no Fraction arithmetic on the hot path
        return _reserve_factor(self.service_tiers, self.inference_geos, service_tier)

    def multiplier(self, usage: Usage) -> Fraction:
        """The factor on every rate for the tier and geography the usage was billed as."""
        if usage.service_tier is None and usage.inference_geo is None:
            return STANDARD_FACTOR
        # OpenAI answers name their tier ("default", "auto"), which the table
        # rarely lists: a factor of 1 stays STANDARD_FACTOR, so its callers keep the
        # integer path (Fraction arithmetic costs ~1.5 us, two or three times a call).
        tier = _lookup(self.service_tiers, usage.service_tier)
        geo = _lookup(self.inference_geos, usage.inference_geo)
        return tier if geo is STANDARD_FACTOR else geo if tier is STANDARD_FACTOR else tier * geo


# The factor of a call billed at standard rates; `multiplier` returns this very object, so
# a caller may skip Fraction arithmetic with `is STANDARD_FACTOR`.
STANDARD_FACTOR = Fraction(1)


@functools.lru_cache(maxsize=1024)
def _reserve_factor(tiers: tuple[tuple[str, Fraction], ...], geos: tuple[tuple[str, Fraction], ...],
                    service_tier: str | None) -> Fraction:
    chosen = [f for _, f in tiers] if service_tier in (None, "auto") else [_lookup(tiers, service_tier)]
    geo = max([f for _, f in geos], default=STANDARD_FACTOR)
    factor = max([*chosen, STANDARD_FACTOR]) * max(geo, STANDARD_FACTOR)
    return STANDARD_FACTOR if factor == 1 else factor


def _lookup(factors: tuple[tuple[str, Fraction], ...], key: str | None) -> Fraction:
    for name, factor in factors:
        if name == key:
            return factor
    return STANDARD_FACTOR
