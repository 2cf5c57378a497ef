"""Refusal messages: which limit, the numbers, and how to raise it. Pure string building.

Every message ends by saying that nothing was forwarded or charged, because an agent
(or the human reading its log) otherwise cannot tell a refusal from a failed call.
"""

from __future__ import annotations

from decimal import Decimal

__all__ = [
    "DEFAULT_ORIGINS",
    "call_ceiling",
    "cost_ceiling",
    "failure_ceiling",
    "loop_ceiling",
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
}

_NOT_SENT = "The call was not forwarded and nothing was charged."


def usd(micros: int) -> str:
    """Exact dollars: at least cents, more digits only when they are not zero."""
    text = f"{Decimal(micros) / 1_000_000:.6f}".rstrip("0")
    whole, _, frac = text.partition(".")
    return f"${whole}.{frac.ljust(2, '0')}"


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _header(origin: str) -> str | None:
    """The request header a limit came from, when it came from one."""
    prefix = "request header "
    return origin[len(prefix):] if origin.startswith(prefix) else None


def call_ceiling(tenant: str, run_id: str, limit: int, origin: str | None = None) -> str:
    where = origin or DEFAULT_ORIGINS["run_calls"]
    header = _header(where)
    fix = (
        f"Raise {header} on this run's requests (a header can only lower the tenant's ceiling, never raise "
        "it), or start a new run."
        if header else "Raise the ceiling for this tenant or start a new run."
    )
    return (
        f"Run {run_id} of tenant {tenant} reached its ceiling of {_plural(limit, 'model call')} ({where}). "
        f"{_NOT_SENT} {fix}"
    )


def cost_ceiling(
    scope: str,
    *,
    tenant: str,
    run_id: str,
    window: str | None,
    tz: str,
    limit: int,
    spent: int,
    reserved: int,
    needed: int,
    origin: str | None = None,
) -> str:
    """`scope` is run_cost, tenant_day or tenant_month; `needed` is the minimal reservation."""
    where = origin or DEFAULT_ORIGINS.get(scope, scope)
    left = max(0, limit - spent - reserved)
    numbers = (
        f"{usd(spent)} spent and {usd(reserved)} reserved by calls in flight leave {usd(left)}, "
        f"and this call needs at least {usd(needed)} (its input plus a minimal answer)."
    )
    if scope == "run_cost":
        header = _header(where)
        fix = (
            f"Raise {header} on this run's requests (a header can only lower the tenant's ceiling, never raise "
        "it), or start a new run."
            if header else "Raise the ceiling for this tenant, or start a new run."
        )
        return (
            f"Run {run_id} of tenant {tenant} reached its cost ceiling of {usd(limit)} ({where}): "
            f"{numbers} {_NOT_SENT} {fix}"
        )
    period = "daily" if scope == "tenant_day" else "monthly"
    rolls = "day" if scope == "tenant_day" else "month"
    return (
        f"Tenant {tenant} reached its {period} budget of {usd(limit)} for {window} ({tz}) "
        f"({where}): "
        f"{numbers} {_NOT_SENT} Raise the tenant's {period} budget (admin API or "
        f"`spanmeter budget set`), or wait until the {rolls} ends in {tz}."
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
