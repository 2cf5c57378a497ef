"""One price quote per call: everything admission asks of pricing, answered once.

`quote(call, price, bound)` reads the call's facts (its output bound and multiplier, service
tier, cache-write marker) and its price once, and answers: the reservation's bounds, the
dearest rate a stored-context token bills at, the tokens the call may use (least and most),
and, given what the ledger reserved, the output that reservation affords.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Final

from proxy.model import Call, frozen
from proxy.pricing.row import STANDARD_FACTOR, Price
from proxy.pricing.table import affordable_output_tokens, dearest_input_rate, reservation

__all__ = ["DEFAULT_MAX_OUTPUT", "MAX_RESERVE", "MIN_ANSWER_TOKENS", "Quote", "quote"]

MIN_ANSWER_TOKENS: Final = 16  # below this an answer is not worth sending: refuse instead
DEFAULT_MAX_OUTPUT: Final = 32_768  # when neither the request nor the price table bounds output
MAX_RESERVE: Final = 2**50  # micro-USD (~$1e9): below 2^53, where Redis's Lua numbers stop being exact


@frozen
class Quote:
    """A call's price, worked out once. `reserve`: (least, most) micro-USD, the input and the
    least answer worth sending, and the worst case. `tokens`: (least, most) tokens, the input
    bound plus the least answer, and plus the output bound. `input_rate`: micro-USD per
    million stored-context tokens. `output_cap`: the model's output cap; `output_bound`: the
    most one answer may have (the request's value, cut to the cap)."""

    price: Price | None
    bound: int  # input tokens, spanmeter's patches included
    multiplier: int
    factor: Fraction
    cache_write: str
    output_cap: int
    output_bound: int
    reserve: tuple[int, int]
    tokens: tuple[int, int]
    input_rate: int

    def affordable_output(self, reserved: int, context_tokens: int) -> int:
        """The most output tokens per answer that `reserved` micro-USD pay for, with the
        stored context the ledger remembered (`context_tokens`) as input too."""
        if self.price is None:
            return self.output_cap
        return affordable_output_tokens(self.price, reserved, self.bound + context_tokens, self.multiplier,
                                        self.factor, self.cache_write)


def quote(call: Call, price: Price | None, bound: int) -> Quote:
    """The call's quote at `price` (None: unpriced, reserves nothing), `bound` input tokens.

    The reservation covers every answer the request asks for (`output_multiplier`), each
    bounded by the request's max-token value or, without one, the model's output cap; a
    model's cap also bounds a larger request value, since no answer can exceed it."""
    n, asked, writes = call.output_multiplier, call.max_output_tokens, call.cache_write
    cap = (price.max_output_tokens if price else None) or DEFAULT_MAX_OUTPUT
    out = cap if asked is None else min(asked, cap)
    tokens = (bound + min(MIN_ANSWER_TOKENS, out) * n, bound + out * n) if call.generates_output else (bound, bound)
    if price is None:
        return Quote(None, bound, n, STANDARD_FACTOR, writes, cap, out, (0, 0), tokens, 0)
    factor = price.reserve_factor(call.service_tier)
    if asked is not None or not call.generates_output:
        lo = hi = min(reservation(price, bound, min(asked or 0, cap), n, factor, writes), MAX_RESERVE)
    else:
        lo = min(reservation(price, bound, MIN_ANSWER_TOKENS, n, factor, writes), MAX_RESERVE)
        hi = min(reservation(price, bound, cap, n, factor, writes), MAX_RESERVE)
    return Quote(price, bound, n, factor, writes, cap, out, (lo, hi), tokens, dearest_input_rate(price, factor))
