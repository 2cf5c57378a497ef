"""Budgets an agent can see coming: the wrap-up note, and what is left on every answer.

A run that reaches a ceiling is refused (402) and ends without an answer. With
`runs.wrap_up_at` set (a share, e.g. 0.5), every call admitted once the run has used that
share of one of its ceilings (calls, cost, tokens or wall time), and the last call the
call ceiling allows, carries a short note for the model saying what is left, so it can
finish with what it has. The note goes after the request's last message, in the dialect's
own shape (`Exchange.note`): never into the system prompt or an earlier turn, so
the provider's prompt cache keeps matching the prefix the agent sent before. It always
starts with `MARK`, which the simulator (proxy/simulator/script.py) also looks for.

"Used" counts what the admission saw before this call: its earlier calls, the run's
spend (settled, and reserved by calls in flight), its settled tokens, the time since its
first call. A run whose tenant (or key) set no `wrap_up_at` is never changed.

Separately, every answer carries the admission's view of what is left (`remaining`) in
`x-spanmeter-*-remaining-*` headers and on the call's span: calls and the run's cost
after this call's worst case, tokens and seconds as of its admission, the day and month
budgets (a key's or its tenant's, whichever is tighter).
"""

from __future__ import annotations

from proxy.govern.ceilings import Admitted
from proxy.ledger.messages import usd
from proxy.ledger.store import Admission, Limits
from proxy.model import Caller, Rewrite, frozen
from proxy.providers.base import Exchange
from tracing import spans
from tracing.setup import Telemetry

__all__ = ["MARK", "Notice", "Remaining", "apply", "notice", "remaining"]

MARK = "[spanmeter] Budget notice"
_FINISH = "Finish the task with what you have."
_LAST = ("this is the last model call this run is allowed. Answer now with what you have: "
         "no tool result can be sent back after this.")


@frozen
class Remaining:
    """What is left of each ceiling that is set (None: not set), as the admission saw it."""

    run_calls: int | None = None  # after this call
    run_cost_micros: int | None = None  # after this call's worst case (its reservation)
    run_tokens: int | None = None  # of the run's settled tokens, before this call
    run_seconds: float | None = None  # of the run's wall time, at admission
    day_micros: int | None = None  # the tighter of the tenant's and the key's day
    month_micros: int | None = None

    def headers(self) -> dict[str, str]:
        """`x-spanmeter-run-calls-remaining` and the like, for each ceiling that is set."""
        # Built entry by entry (on every answer), in this order, only for what is set.
        out: dict[str, str] = {}
        if self.run_calls is not None:
            out["x-spanmeter-run-calls-remaining"] = str(self.run_calls)
        if self.run_cost_micros is not None:
            out["x-spanmeter-run-cost-remaining-usd"] = _dollars(self.run_cost_micros)
        if self.run_tokens is not None:
            out["x-spanmeter-run-tokens-remaining"] = str(self.run_tokens)
        if self.run_seconds is not None:
            out["x-spanmeter-run-seconds-remaining"] = f"{self.run_seconds:.3f}"
        if self.day_micros is not None:
            out["x-spanmeter-budget-day-remaining-usd"] = _dollars(self.day_micros)
        if self.month_micros is not None:
            out["x-spanmeter-budget-month-remaining-usd"] = _dollars(self.month_micros)
        return out


@frozen
class Notice:
    text: str
    reason: str  # last_call, or the first ceiling whose share was reached: calls | cost | tokens | time


def remaining(limits: Limits, adm: Admission, now_s: float) -> Remaining:
    left = adm.remaining
    cost = left.get("run_cost")
    return Remaining(
        run_calls=None if limits.run_max_calls is None else max(0, limits.run_max_calls - adm.calls),
        run_cost_micros=None if cost is None else max(0, cost),
        run_tokens=None if limits.run_max_tokens is None else max(0, limits.run_max_tokens - adm.run_tokens),
        run_seconds=None if limits.run_max_seconds is None else max(0.0, limits.run_max_seconds - _elapsed(adm, now_s)),
        day_micros=_tightest(left.get("tenant_day"), left.get("key_day")),
        month_micros=_tightest(left.get("tenant_month"), left.get("key_month")),
    )


def _tightest(tenant: int | None, key: int | None) -> int | None:
    """The smaller headroom of a tenant's and its key's window (never below zero)."""
    if tenant is None:
        return None if key is None else max(0, key)
    return max(0, tenant if key is None else min(tenant, key))


def notice(limits: Limits, adm: Admission, share: float | None, now_s: float) -> Notice | None:
    """The note this call carries, or None (no `wrap_up_at`, or no share reached yet)."""
    if share is None:
        return None
    used: dict[str, tuple[float, float]] = {}  # ceiling -> (used, limit)
    if limits.run_max_calls is not None:
        used["calls"] = (adm.calls - 1, limits.run_max_calls)
    cost_left = None
    if limits.run_max_cost is not None and (after := adm.remaining.get("run_cost")) is not None:
        cost_left = after + adm.reserved  # what the run had before this call
        used["cost"] = (limits.run_max_cost - cost_left, limits.run_max_cost)
    if limits.run_max_tokens is not None:
        used["tokens"] = (adm.run_tokens, limits.run_max_tokens)
    elapsed = _elapsed(adm, now_s)
    if limits.run_max_seconds is not None:
        used["time"] = (elapsed, limits.run_max_seconds)
    if limits.run_max_calls is not None and adm.calls >= limits.run_max_calls:
        return Notice(f"{MARK}: {_LAST}", "last_call")
    reached = [name for name, (u, limit) in used.items() if u >= share * limit]
    if not reached:
        return None
    calls = None if limits.run_max_calls is None else limits.run_max_calls - adm.calls
    tokens = None if limits.run_max_tokens is None else max(0, limits.run_max_tokens - adm.run_tokens)
    seconds = None if limits.run_max_seconds is None else max(0.0, limits.run_max_seconds - elapsed)
    return Notice(f"{MARK}: {_what_is_left(calls, cost_left, tokens, seconds)}. {_FINISH}", reached[0])


def _what_is_left(calls: int | None, cost: int | None, tokens: int | None, seconds: float | None) -> str:
    others = [text for text in (_money(cost), _count(tokens, "token"), _duration(seconds)) if text]
    if calls is None:
        return f"this run has {_listed(others)} left"
    text = f"this run has {_count(calls, 'model call')} left after this one"
    return f"{text}, and {_listed(others)} left in all" if others else text


def apply(ex: Exchange, admitted: Admitted, tel: Telemetry, caller: Caller, cs: spans.CallSpan,
          ) -> tuple[list[Rewrite], dict[str, str]]:
    """Place the note this call carries (if any) and say what is left: the rewrites made,
    and the headers for the answer. Both also go on the call's span."""
    adm, limits = admitted.admission, admitted.limits
    if adm.calls < 1:  # admitted unmetered (fail-open, ledger away): nothing is known of what is left
        return [], {}
    now_s = admitted.now.timestamp() if admitted.now is not None else 0.0
    left = remaining(limits, adm, now_s)
    spans.record_remaining(cs, left)
    note = notice(limits, adm, admitted.wrap_up_at, now_s)
    if note is None or not ex.note(note.text):
        return [], left.headers()
    spans.record_wrap_up(tel, caller, note.reason, cs=cs)
    return [Rewrite("wrap_up", note.reason)], left.headers()


def _elapsed(adm: Admission, now_s: float) -> float:
    return max(0.0, now_s - adm.started_at) if adm.started_at is not None else 0.0


def _dollars(micros: int) -> str:
    return usd(micros).removeprefix("$")


def _count(n: int | None, noun: str) -> str:
    if n is None:
        return ""
    return f"{n:,} {noun}" + ("" if n == 1 else "s")


def _money(micros: int | None) -> str:
    if micros is None:
        return ""
    return f"${max(0, micros) / 1e6:.2f}" if micros >= 10_000 or micros <= 0 else "less than $0.01"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return ""
    return f"{int(seconds)} s" if seconds < 120 else f"{int(seconds // 60)} min"


def _listed(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]
