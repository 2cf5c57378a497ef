"""Refusal messages: which limit, the numbers, and how to raise it. Pure string building.

Every message says that the call was not forwarded (and, but for the loop guard's, that
nothing was charged) before it says how to get past the limit, because an agent (or the
human reading its log) otherwise cannot tell a refusal from a failed call.
"""

from __future__ import annotations

from proxy.ledger.rates import RateState
from proxy.model import frozen

__all__ = [
    "DEFAULT_ORIGINS",
    "Tally",
    "Who",
    "call_ceiling",
    "cost_ceiling",
    "failure_ceiling",
    "loop_ceiling",
    "rate_limit",
    "time_ceiling",
    "token_ceiling",
    "tool_call_ceiling",
    "unbounded_context",
    "unknown_price",
    "usd",
]

# Where a limit comes from when the caller does not say (Limits.origin).
DEFAULT_ORIGINS = {
    "run_calls": "setting runs.max_llm_calls",
    "run_cost": "setting runs.max_cost_usd",
    "tenant_day": "setting budgets.daily_usd",
    "tenant_month": "setting budgets.monthly_usd",
    "run_tokens": "setting runs.max_tokens",
    "run_seconds": "setting runs.max_seconds",
    "key_day": "key setting budgets.daily_usd",
    "key_month": "key setting budgets.monthly_usd",
}

_NOT_SENT = "The call was not forwarded and nothing was charged."


@frozen
class Who:
    """The run a refusal speaks of, and the caller's key id when it has one."""

    tenant: str
    run_id: str
    key: str | None = None


@frozen
class Tally:
    """A ceiling's numbers at a refusal, in its unit (micro-USD or tokens): the limit, what
    answered calls used, what calls in flight hold, and the least this call needs."""

    limit: int
    used: int
    held: int = 0
    needed: int = 0


def usd(micros: int) -> str:
    """Exact dollars: at least cents, more digits only when they are not zero."""
    # Integer arithmetic, not Decimal (~1.5 µs): the remaining-budget headers of every
    # answer and every access-log line are written with it.
    whole, frac = divmod(abs(micros), 1_000_000)
    sign = "-" if micros < 0 else ""
    return f"${sign}{whole}.{f'{frac:06d}'.rstrip('0').ljust(2, '0')}"


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _header(origin: str) -> str | None:
    """The request header a limit came from, when it came from one."""
    prefix = "request header "
    return origin[len(prefix):] if origin.startswith(prefix) else None


def _fix(where: str, tenant_fix: str) -> str:
    """How to raise a run ceiling that came from `where`: a request header, a key's policy, or the tenant's."""
    header = _header(where)
    if header:
        return (f"Raise {header} on this run's requests (a header can only lower the tenant's ceiling, never "
                "raise it), or start a new run.")
    if where.startswith("key setting "):
        return (f"Raise {where.removeprefix('key setting ')} in the policy of this key (under the tenant's `keys` "
                "in the config; a key's ceiling can only lower the tenant's), use another key, or start a new run.")
    return tenant_fix


def call_ceiling(tenant: str, run_id: str, limit: int, origin: str | None = None) -> str:
    where = origin or DEFAULT_ORIGINS["run_calls"]
    fix = _fix(where, "Raise the ceiling for this tenant or start a new run.")
    return (
        f"Run {run_id} of tenant {tenant} reached its ceiling of {_plural(limit, 'model call')} ({where}). "
        f"{_NOT_SENT} {fix}"
    )


def cost_ceiling(scope: str, who: Who, tally: Tally, *, window: str | None = None, tz: str = "UTC",
                 origin: str | None = None) -> str:
    """`scope` is run_cost, tenant_day, tenant_month, key_day or key_month (of the key
    `who.key`), `window` its day or month in `tz`; `tally.needed` is the minimal reservation."""
    tenant, run_id, key = who.tenant, who.run_id, who.key
    limit, spent, reserved, needed = tally.limit, tally.used, tally.held, tally.needed
    where = origin or DEFAULT_ORIGINS.get(scope, scope)
    left = max(0, limit - spent - reserved)
    numbers = (
        f"{usd(spent)} spent and {usd(reserved)} reserved by calls in flight leave {usd(left)}, "
        f"and this call needs at least {usd(needed)} (its input plus a minimal answer)."
    )
    if scope == "run_cost":
        fix = _fix(where, "Raise the ceiling for this tenant, or start a new run.")
        return (
            f"Run {run_id} of tenant {tenant} reached its cost ceiling of {usd(limit)} ({where}): "
            f"{numbers} {_NOT_SENT} {fix}"
        )
    period = "daily" if scope.endswith("_day") else "monthly"
    rolls = "day" if scope.endswith("_day") else "month"
    if scope.startswith("key_"):
        return (
            f"Key {key} of tenant {tenant} reached its {period} budget of {usd(limit)} for {window} ({tz}) "
            f"({where}): {numbers} {_NOT_SENT} Raise the key's {period} budget (its `policy.budgets` under "
            f"tenants.{tenant}.keys in the config), use another key, or wait until the {rolls} ends in {tz}."
        )
    return (
        f"Tenant {tenant} reached its {period} budget of {usd(limit)} for {window} ({tz}) "
        f"({where}): "
        f"{numbers} {_NOT_SENT} Raise the tenant's {period} budget (admin API or "
        f"`spanmeter budget set`), or wait until the {rolls} ends in {tz}."
    )


def token_ceiling(who: Who, tally: Tally, origin: str | None = None) -> str:
    tenant, run_id = who.tenant, who.run_id
    limit, used, held, needed = tally.limit, tally.used, tally.held, tally.needed
    where = origin or DEFAULT_ORIGINS["run_tokens"]
    flight = f", and {held:,} are held by its calls in flight" if held else ""
    need = (f" This call needs at least {needed:,} (its input bound and the least answer worth sending)."
            if needed and used + held < limit else "")
    return (
        f"Run {run_id} of tenant {tenant} reached its ceiling of {limit:,} tokens ({where}): its answered "
        f"calls used {used:,} input and output tokens{flight}.{need} {_NOT_SENT} "
        f"{_fix(where, 'Raise runs.max_tokens for this tenant or start a new run.')}"
    )


def time_ceiling(tenant: str, run_id: str, limit: float, elapsed: float, origin: str | None = None) -> str:
    where = origin or DEFAULT_ORIGINS["run_seconds"]
    return (
        f"Run {run_id} of tenant {tenant} reached its ceiling of {limit:g} s of wall time ({where}): its "
        f"first call arrived {elapsed:,.0f} s ago. {_NOT_SENT} "
        f"{_fix(where, 'Raise runs.max_seconds for this tenant or start a new run.')}"
    )


def rate_limit(tenant: str, state: RateState) -> str:
    """A rate refusal by the bucket `state` describes: its owner is "tenant" or "key <id>",
    its unit requests or tokens."""
    owner, unit, limit, cost = state.rate.owner, state.rate.unit, state.rate.limit, state.rate.cost
    available, wait_ms = state.remaining, state.wait_ms
    who = f"Tenant {tenant}" if owner == "tenant" else f"{owner.capitalize()} of tenant {tenant}"
    where = f"{'tenant' if owner == 'tenant' else 'key'} setting rate_limits.{unit}_per_minute"
    if wait_ms is None:
        return (
            f"This call alone counts {cost:,} tokens (its input bound plus the output it may generate), above "
            f"the rate limit of {limit:,} tokens per minute of {who[0].lower() + who[1:]} ({where}), so it can "
            f"never be admitted. {_NOT_SENT} Lower the request's max-token value or send less input, or raise "
            f"the limit; retrying will not help."
        )
    counted = f"this call counts {cost:,} tokens and {available:,} are free now" if unit == "tokens" else (
        f"{limit:,} requests were admitted in the last minute")
    return (
        f"{who} is over its rate limit of {limit:,} {unit} per minute ({where}): {counted}. "
        f"{_NOT_SENT} Retry in {wait_ms / 1000:.1f} s (Retry-After; SDKs retry on their own), "
        f"lower the agent's concurrency, or raise the limit."
    )


def unknown_price(model: str | None, tenant: str) -> str:
    name = repr(model) if model else "(no model named)"
    return (
        f"Model {name} has no known price, and tenant {tenant!r} has a cost ceiling, so "
        f"spanmeter cannot bound what this call would cost. {_NOT_SENT} Add the model's prices "
        f"under `prices:` in the config file (input, cached_input, cache_write, output in USD "
        f"per million tokens), or use a priced model."
    )


def unbounded_context(tenant: str, refs: list[str]) -> str:
    named = ", ".join(refs)
    return (
        f"This call names stored context that spanmeter has not seen ({named}), and tenant "
        f"{tenant!r} has a cost ceiling. The provider bills that context as input, but its size is "
        f"not in the request, so spanmeter cannot bound what the call would cost. {_NOT_SENT} "
        f"Responses and conversations created through spanmeter are remembered and bounded; send "
        f"the context inline instead (e.g. `store: false` and the full input), create it through "
        f"spanmeter first, or use a tenant without a cost ceiling."
    )


def tool_call_ceiling(tenant: str, run_id: str, limit: int) -> str:
    return (
        f"Run {run_id} of tenant {tenant} reached its ceiling of {limit} MCP tool calls "
        f"(setting runs.max_tool_calls). The tool call was not forwarded and nothing was charged. "
        f"Raise runs.max_tool_calls for this tenant, or start a new run."
    )


def loop_ceiling(tenant: str, run_id: str, tool: str, streak: int, threshold: int) -> str:
    return (
        f"Run {run_id} of tenant {tenant} called the tool `{tool}` {streak} times in a row "
        f"with identical arguments (threshold {threshold}, setting guard.threshold). The call was not "
        "forwarded: the model is looping. Change the arguments, or set guard.action to `remind` or "
        "`off` for this tenant."
    )


def failure_ceiling(tenant: str, run_id: str, tool: str, failures: int, limit: int) -> str:
    return (
        f"Run {run_id} of tenant {tenant} had {failures} tool failures in a row "
        f"(last: `{tool}`), reaching the ceiling of {limit} (setting guard.max_consecutive_failures). "
        "The call was not forwarded. Fix the tool, or raise or remove the ceiling for this tenant."
    )
