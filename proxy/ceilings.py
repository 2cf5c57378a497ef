"""Admission: turn policy, prices and the request into one atomic reservation.

The worst case is reserved before anything is sent upstream, on every scope the call
touches (run, tenant day, tenant month), so concurrent calls can never overshoot. A
request without a max-token field is clamped to what the remaining budget affords.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from fractions import Fraction

from proxy.config import MAX_RUN_CALLS, MAX_USD, Policy
from proxy.errors import RequestError
from proxy.model import Call, Caller, Rewrite, Usage
from proxy.policy.pricing import (
    Price,
    PriceTable,
    affordable_output_tokens,
    cost,
    dearest_input_rate,
    input_bound,
    reservation,
)
from proxy.policy.store import NO_TURN, Admission, Limits, Store, Turn, costed

__all__ = ["Admitted", "admit", "limits_for", "settle_amount"]

MIN_ANSWER_TOKENS = 16  # below this an answer is not worth sending: refuse instead
DEFAULT_MAX_OUTPUT = 32_768  # when neither the request nor the price table bounds output
MAX_RESERVE = 2**50  # micro-USD (~$1e9): below 2^53, where Redis's Lua numbers stop being exact


@dataclass(frozen=True, slots=True)
class Admitted:
    admission: Admission
    price: Price | None
    rewrites: tuple[Rewrite, ...]
    clamp_to: int | None  # max output tokens to write into the request, if clamped
    limits: Limits


def _micros(usd: float | None) -> int | None:
    return None if usd is None else round(usd * 1_000_000)


def limits_for(policy: Policy, headers: Mapping[str, str], day: float | None, month: float | None) -> Limits:
    """Policy limits, tightened (never loosened) by X-Run-Max-Calls / X-Run-Max-Cost-Usd."""
    calls = policy.runs.max_llm_calls
    run_cost = _micros(policy.runs.max_cost_usd)
    origin = {"run_calls": "tenant setting runs.max_llm_calls", "run_cost": "tenant setting runs.max_cost_usd",
              "tenant_day": "tenant setting budgets.daily_usd", "tenant_month": "tenant setting budgets.monthly_usd"}
    if (h := headers.get("x-run-max-calls")) is not None:
        asked = _header_int(h, "X-Run-Max-Calls")
        if calls is None or asked < calls:
            calls, origin["run_calls"] = asked, "request header X-Run-Max-Calls"
    if (h := headers.get("x-run-max-cost-usd")) is not None:
        asked = _header_usd(h, "X-Run-Max-Cost-Usd")
        if run_cost is None or asked < run_cost:
            run_cost, origin["run_cost"] = asked, "request header X-Run-Max-Cost-Usd"
    return Limits(calls, run_cost, _micros(day), _micros(month), origin)


def _header_int(value: str, name: str) -> int:
    try:
        n = int(value.strip())
    except ValueError:
        n = 0
    if not 1 <= n <= MAX_RUN_CALLS:
        raise RequestError(f"{name} must be a whole number from 1 to {MAX_RUN_CALLS}, got {value[:24]!r}.",
                           param=name)
    return n


def _header_usd(value: str, name: str) -> int:
    try:
        usd = float(value.strip())
    except ValueError:
        usd = -1.0
    if not 0 < usd <= MAX_USD:  # also refuses nan and inf
        raise RequestError(f"{name} must be an amount of US dollars above 0 and at most {MAX_USD}, "
                           f"got {value[:24]!r}.", param=name)
    return round(usd * 1_000_000)


async def admit(
    store: Store, prices: PriceTable, caller: Caller, call: Call, limits: Limits, *, tz: str,
    turn: Turn = NO_TURN, now: datetime | None = None, patch_bytes: int = 0,
) -> Admitted:
    """One store operation: the turn's tool results and the call's reservation together.

    The reservation covers every answer the request asks for (`output_multiplier`), each
    bounded by the request's max-token value or, without one, the model's output cap; a
    model's cap also bounds a larger request value, since no answer can exceed it.
    """
    price = prices.price(call.model) if call.model else None
    # What goes upstream is the request plus spanmeter's patches (a clamp, a reminder):
    # they are input too, so the bound covers the bytes they may add.
    bound = input_bound(call) + patch_bytes
    n = call.output_multiplier
    factor = price.reserve_factor(call.service_tier) if price else Fraction(1)
    if price is None:
        lo = hi = 0
    else:
        cap = price.max_output_tokens or DEFAULT_MAX_OUTPUT
        asked = call.max_output_tokens
        if asked is not None or call.api == "embeddings":
            lo = hi = reservation(price, bound, min(asked or 0, cap), n, factor, call.cache_write)
        else:
            lo = reservation(price, bound, MIN_ANSWER_TOKENS, n, factor, call.cache_write)
            hi = reservation(price, bound, cap, n, factor, call.cache_write)
    turn = replace(turn, priced=price is not None, model=call.model, context=call.stored_context,
                   input_rate=dearest_input_rate(price, factor) if price else 0)
    adm = await store.admit(caller.tenant, caller.run_id, min_reserve=min(lo, MAX_RESERVE),
                            max_reserve=min(hi, MAX_RESERVE), limits=limits, now=now or datetime.now(UTC),
                            tz=tz, turn=turn)
    in_force = adm.limits or limits
    clamp = None
    rewrites: tuple[Rewrite, ...] = ()
    if price is not None and costed(in_force) and call.max_output_tokens is None and call.api != "embeddings":
        cap = price.max_output_tokens or DEFAULT_MAX_OUTPUT
        affordable = affordable_output_tokens(price, adm.reserved, bound + adm.context_tokens, n, factor,
                                              call.cache_write)
        clamp = min(cap, max(MIN_ANSWER_TOKENS, affordable))
        rewrites = (Rewrite("max_tokens_clamp", str(clamp)),)
    return Admitted(adm, price, rewrites, clamp, in_force)


def settle_amount(
    admitted: Admitted, usage: Usage, *, failed_before_output: bool, embeddings: bool = False
) -> tuple[int, str]:
    """What to charge and how we know: reported usage, the reservation, or nothing."""
    if admitted.price is None:
        return 0, "unpriced"  # no cost ceiling applies (else admission refused it)
    # Output counts are final only at the end (Anthropic's message_delta is cumulative).
    final = usage.output_tokens is not None or (embeddings and usage.input_tokens is not None)
    if final:
        return cost(admitted.price, usage), "reported"
    if failed_before_output:
        return 0, "none"  # the provider refused or never answered: nothing was generated
    # The stream was cut or usage never came: unknown is not zero.
    return admitted.admission.reserved, "estimate"
