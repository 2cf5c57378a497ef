"""Admission: policy, the call's one price quote and the request into one atomic reservation.

`plan` layers the tenant's policy, its key's (the tighter ceiling wins; a key's budgets and
rate limits are held besides the tenant's) and the request's `X-Run-*` headers (which only
tighten). `admit` quotes the call once (proxy/pricing/quote.py), builds its `Turn` whole,
reserves the worst case on every scope in one store operation, and says how to clamp the
request's output to what was reserved (cost) or held (runs.max_tokens). `settle_amount`
says what a finished call is charged.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime

from proxy.config import MAX_RUN_CALLS, MAX_RUN_SECONDS, MAX_RUN_TOKENS, MAX_USD, KeyPolicy, Policy, RunPolicy
from proxy.errors import NOT_ECHOED, RequestError
from proxy.ledger.store import Admission, Ask, GuardRule, Limits, Rate, Store, Turn, costed
from proxy.model import Call, Caller, Rewrite, Usage, frozen
from proxy.pricing import MIN_ANSWER_TOKENS, Price, PriceTable, Quote, cost, input_bound, quote

__all__ = ["NOTE_BYTES", "Admitted", "Candidate", "Plan", "Plans", "admit", "limits_for", "plan", "settle_amount"]

# The most a wrap-up note adds to a request (proxy/govern/wrapup.py): counted in the input bound
# of every call that may carry one, since the note is placed after the admission.
NOTE_BYTES = 512


@frozen
class Plan:
    """What a call is admitted under: its ceilings, the rate limits it draws on
    (owner, unit, per minute), and the share of a ceiling from which it carries a note."""

    limits: Limits
    rates: tuple[tuple[str, str, int], ...] = ()
    wrap_up_at: float | None = None


@frozen
class Candidate:
    """One model call up for admission, built once by the handler: who calls, what the call is,
    the plan it is admitted under, what the turn closes (its tool results, the loop guard,
    the run's trace ids to keep), and how many bytes spanmeter's own patches (clamp,
    reminder, cache breakpoints) may add to it upstream. `admit` makes its `Turn` whole."""

    caller: Caller
    call: Call
    plan: Plan
    results: tuple[tuple[str, bool], ...] = ()
    guard: GuardRule | None = None
    trace: dict[str, str] | None = None
    patch_bytes: int = 0
    # The model to price the call at when its own names none the table knows (an Azure
    # deployment's model), and what a refusal for want of a price should add.
    priced_as: str | None = None
    price_hint: str = ""
    provider: str | None = None  # gen_ai.provider.name of the upstream: whose price list applies
    solo: bool = False  # its run was made for it (no X-Run-Id, no traceparent), and it is not a retry


@frozen
class Admitted:
    admission: Admission
    price: Price | None
    rewrites: tuple[Rewrite, ...]
    clamp_to: int | None  # max output tokens to write into the request, if clamped
    limits: Limits
    wrap_up_at: float | None = None
    now: datetime | None = None  # the admission's clock
    quote: Quote | None = None  # the call's price, worked out once (None: made outside admission)


def _micros(usd: float | None) -> int | None:
    return None if usd is None else round(usd * 1_000_000)


# run ceiling -> (its field of RunPolicy, the request header that may lower it)
_RUN_FIELDS = {
    "run_calls": ("max_llm_calls", "X-Run-Max-Calls"),
    "run_cost": ("max_cost_usd", "X-Run-Max-Cost-Usd"),
    "run_tokens": ("max_tokens", "X-Run-Max-Tokens"),
    "run_seconds": ("max_seconds", "X-Run-Max-Seconds"),
}


def limits_for(policy: Policy, headers: Mapping[str, str], day: float | None, month: float | None,
               key: KeyPolicy | None = None) -> Limits:
    """Policy limits, with the key's run ceilings where tighter, tightened (never loosened)
    by the X-Run-Max-* headers. The key's own budgets ride along as key_day/key_month."""
    runs: dict[str, float | int | None] = {}
    origin = {"tenant_day": "tenant setting budgets.daily_usd", "tenant_month": "tenant setting budgets.monthly_usd",
              "key_day": "key setting budgets.daily_usd", "key_month": "key setting budgets.monthly_usd"}
    for name, (field, header) in _RUN_FIELDS.items():
        value = _run_value(name, getattr(policy.runs, field))
        origin[name] = f"tenant setting runs.{field}"
        if key is not None and (mine := _run_value(name, getattr(key.runs, field))) is not None and (
                value is None or mine < value):
            value, origin[name] = mine, f"key setting runs.{field}"
        if (h := headers.get(header.lower())) is not None:
            asked = _header_value(name, h, header)
            if value is None or asked < value:
                value, origin[name] = asked, f"request header {header}"
        runs[name] = value
    key_budgets = key.budgets if key is not None else None
    return Limits(
        run_max_calls=_int(runs["run_calls"]), run_max_cost=_int(runs["run_cost"]),
        day_budget=_micros(day), month_budget=_micros(month),
        run_max_tokens=_int(runs["run_tokens"]), run_max_seconds=runs["run_seconds"],
        key_day_budget=_micros(key_budgets.daily_usd) if key_budgets else None,
        key_month_budget=_micros(key_budgets.monthly_usd) if key_budgets else None,
        origin=origin)


def _int(value: float | int | None) -> int | None:
    return None if value is None else int(value)


def _run_value(name: str, value: float | int | None) -> float | int | None:
    """A run ceiling of the policy in the ledger's unit (micro-USD for cost)."""
    return _micros(value) if name == "run_cost" and value is not None else value


def _header_value(name: str, value: str, header: str) -> float | int:
    if name == "run_cost":
        return _header_usd(value, header)
    if name == "run_seconds":
        return _header_float(value, header, MAX_RUN_SECONDS, "a number of seconds above 0")
    return _header_int(value, header, MAX_RUN_TOKENS if name == "run_tokens" else MAX_RUN_CALLS)


# The request headers that change a plan (they may only tighten it).
_WRAP_UP_HEADER = "X-Run-Wrap-Up-At"
_PLAN_HEADERS = tuple(header.lower() for header in (*(h for _, h in _RUN_FIELDS.values()), _WRAP_UP_HEADER))
_PLAN_CACHE_MAX = 1024


def plan(policy: Policy, headers: Mapping[str, str], key: KeyPolicy | None = None,
         key_id: str | None = None) -> Plan:
    """Everything a call is admitted under, from the tenant's policy, its key's (`key`, of
    the caller's key `key_id`) and the request's headers."""
    return _plan(policy, headers, key, key_id)


class Plans:
    """The plans of one process's settings. A request that sends none of the plan headers is
    admitted under a plan that depends on its tenant's policy and its key's alone, both fixed
    for the settings the process serves: each is built once (~4 µs) per tenant and key."""

    __slots__ = ("_built",)

    def __init__(self) -> None:
        self._built: dict[tuple[str, str | None], Plan] = {}

    def plan(self, tenant: str, policy: Policy, headers: Mapping[str, str], key: KeyPolicy | None = None,
             key_id: str | None = None) -> Plan:
        if any(h in headers for h in _PLAN_HEADERS):
            return _plan(policy, headers, key, key_id)
        found = self._built.get((tenant, key_id))
        if found is None:
            found = _plan(policy, headers, key, key_id)
            if len(self._built) < _PLAN_CACHE_MAX:  # tenants and keys are configured: bounded anyway
                self._built[(tenant, key_id)] = found
        return found


def _plan(policy: Policy, headers: Mapping[str, str], key: KeyPolicy | None, key_id: str | None) -> Plan:
    limits = limits_for(policy, headers, policy.budgets.daily_usd, policy.budgets.monthly_usd, key)
    rates: list[tuple[str, str, int]] = []
    owners = [("tenant", policy.rate_limits)]
    if key is not None and key_id is not None:
        owners.append((f"key {key_id}", key.rate_limits))
    for owner, rl in owners:
        for unit, limit in (("requests", rl.requests_per_minute), ("tokens", rl.tokens_per_minute)):
            if limit is not None:
                rates.append((owner, unit, limit))
    return Plan(limits, tuple(rates), _wrap_up_at(policy.runs, key.runs if key else None, headers))


def _wrap_up_at(runs: RunPolicy, key: RunPolicy | None, headers: Mapping[str, str]) -> float | None:
    """The tenant's share, or its key's or the request's when earlier. Only a tenant (or a
    key) that set one gets notes: a request cannot turn them on where the operator did not."""
    shares = [s for s in (runs.wrap_up_at, key.wrap_up_at if key else None) if s is not None]
    if not shares:
        return None
    if (h := headers.get(_WRAP_UP_HEADER.lower())) is not None:
        shares.append(_header_float(h, _WRAP_UP_HEADER, 1.0, "a fraction above 0 and at most 1"))
    return min(shares)


def _header_int(value: str, name: str, upper: int = MAX_RUN_CALLS) -> int:
    try:
        n = int(value.strip())
    except ValueError:
        n = 0
    if not 1 <= n <= upper:
        raise RequestError(f"{name} must be a whole number from 1 to {upper}; {NOT_ECHOED}", param=name)
    return n


def _header_float(value: str, name: str, upper: float, what: str) -> float:
    try:
        x = float(value.strip())
    except ValueError:
        x = -1.0
    if not 0 < x <= upper:  # also refuses nan and inf
        raise RequestError(f"{name} must be {what} (at most {upper:g}); {NOT_ECHOED}", param=name)
    return x


def _header_usd(value: str, name: str) -> int:
    try:
        usd = float(value.strip())
    except ValueError:
        usd = -1.0
    if not 0 < usd <= MAX_USD:  # also refuses nan and inf
        raise RequestError(f"{name} must be an amount of US dollars above 0 and at most {MAX_USD}; {NOT_ECHOED}",
                           param=name)
    return round(usd * 1_000_000)


async def admit(store: Store, prices: PriceTable, candidate: Candidate, *, tz: str,
                now: datetime | None = None) -> Admitted:
    """One store operation: the turn's tool results and the call's reservation together,
    at the call's one price quote (proxy/pricing/quote.py). The same bounds, in tokens, are
    what the call draws from a tokens-per-minute limit and holds under runs.max_tokens."""
    caller, call, plan = candidate.caller, candidate.call, candidate.plan
    limits = plan.limits
    named = candidate.priced_as or call.model
    price = prices.price(named, candidate.provider) if named else None
    # What goes upstream is the request plus spanmeter's patches (a clamp, a reminder, a
    # wrap-up note): they are input too, so the bound covers the bytes they may add.
    bound = input_bound(call) + candidate.patch_bytes + (NOTE_BYTES if plan.wrap_up_at is not None else 0)
    q = quote(call, price, bound)
    most = q.tokens[1]
    rates = tuple(Rate(owner, "requests" if unit == "requests" else "tokens", limit,
                       1 if unit == "requests" else most)
                  for owner, unit, limit in plan.rates)
    turn = Turn(reserve=q.reserve, results=candidate.results, guard=candidate.guard, trace=candidate.trace,
                context=call.stored_context, input_rate=q.input_rate, priced=price is not None, model=call.model,
                price_hint=candidate.price_hint if price is None else "", key=caller.key_id, rates=rates,
                tokens=q.tokens, solo=candidate.solo)
    now = now or datetime.now(UTC)
    adm = await store.admit(Ask(caller.tenant, caller.run_id, now, limits, tz=tz), turn)
    in_force = adm.limits or limits
    clamp = capped = None
    rewrites: tuple[Rewrite, ...] = ()
    if price is not None and costed(in_force) and call.generates_output:
        if call.max_output_tokens is None:
            clamp = min(q.output_cap, max(MIN_ANSWER_TOKENS, q.affordable_output(adm.reserved, adm.context_tokens)))
        elif call.max_output_tokens > q.output_cap:
            # Reserved at the model's cap: forwarding more would let a compatible server, or
            # a provider whose cap grew past the price table, generate (and bill) past it.
            clamp = capped = q.output_cap
    if in_force.run_max_tokens is not None and call.generates_output:
        # The output the tokens held allow, written into the request when it asked for more
        # (or named no bound): the model can never use more than the ledger holds for it.
        held = (adm.tokens - bound - adm.context_tokens) // call.output_multiplier
        if held < (q.output_bound if clamp is None else min(q.output_bound, clamp)):
            clamp = held  # at least the least answer, or what was asked when less: the store held that
    if clamp is not None:
        rewrites = ((Rewrite("max_tokens_capped", f"{call.max_output_tokens}->{clamp}"),) if clamp == capped
                    else (Rewrite("max_tokens_clamp", str(clamp)),))
    return Admitted(adm, price, rewrites, clamp, in_force, plan.wrap_up_at, now, q)


def settle_amount(
    admitted: Admitted, usage: Usage, *, failed_before_output: bool, input_only: bool = False
) -> tuple[int, str]:
    """What to charge and how we know: reported usage, the reservation, or nothing."""
    # Output counts are final only at the end (Anthropic's message_delta is cumulative).
    final = usage.output_tokens is not None or (input_only and usage.input_tokens is not None)
    if final and usage.billed_micros is not None:
        return usage.billed_micros, "reported"  # the host said what it billed (OpenRouter)
    if admitted.price is None:
        return 0, "unpriced"  # no cost ceiling applies (else admission refused it)
    if final:
        return cost(admitted.price, usage), "reported"
    if failed_before_output:
        return 0, "none"  # the provider refused or never answered: nothing was generated
    # The stream was cut or usage never came: unknown is not zero.
    return admitted.admission.reserved, "estimate"
