"""Pricing: model prices and the cost of a call, in integer micro-USD. Pure after load.

- `PriceTable` (table.py): a model's `Price` (row.py) by name and provider, from genai-prices'
  data compiled at load (source.py), our shipped `proxy/data/prices.yaml` rows over it and
  config overrides over both.
- `quote(call, price, bound) -> Quote` (quote.py): what admission asks, worked out once per call.
- `cost`, `cache_savings`, `cache_write_premium`: what reported usage costs (settlement).
- `input_bound(call)`: the tokens that bound a call's billable input.
"""

from __future__ import annotations

from proxy.pricing.quote import DEFAULT_MAX_OUTPUT, MAX_RESERVE, MIN_ANSWER_TOKENS, Quote, quote
from proxy.pricing.row import STANDARD_FACTOR, LongContext, Price
from proxy.pricing.table import (
    PROVIDER_OVERHEAD_TOKENS,
    PriceTable,
    affordable_output_tokens,
    cache_savings,
    cache_write_premium,
    cost,
    dearest_input_rate,
    input_bound,
    reservation,
)

__all__ = [
    "DEFAULT_MAX_OUTPUT",
    "MAX_RESERVE",
    "MIN_ANSWER_TOKENS",
    "PROVIDER_OVERHEAD_TOKENS",
    "STANDARD_FACTOR",
    "LongContext",
    "Price",
    "PriceTable",
    "Quote",
    "affordable_output_tokens",
    "cache_savings",
    "cache_write_premium",
    "cost",
    "dearest_input_rate",
    "input_bound",
    "quote",
    "reservation",
]
