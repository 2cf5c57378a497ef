"""The ledger and run-state store: one protocol, two backends, one contract suite.

Money is integer micro-USD everywhere. Scopes of a reservation:

    run_cost      (tenant, run_id)
    tenant_day    (tenant, calendar day in the configured time zone)  "2026-11-29"
    tenant_month  (tenant, calendar month in that zone)               "2026-11"

A window's date is part of its key, so windows roll over without any reset job.

Reservations and expiry: `admit` reserves; `settle` replaces the reservation by the
actual cost (idempotent); `release` settles at zero. A reservation never settled within
`ttl_s` (the proxy crashed mid-call) expires *at its reserved amount*: the call may
well have been billed, and unknown is not zero. Expiry changes no headroom (reserved
becomes settled); it only stops the amount being shown as in flight. If the real
settle arrives after expiry it still corrects the charge to the actual cost.

Every key is tenant-scoped: the same run id in two tenants shares nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal, Protocol
from urllib.parse import parse_qs
from zoneinfo import ZoneInfo

from proxy.errors import CeilingReached, ConfigError
from proxy.policy import messages

__all__ = [
    "MAX_MICROS",
    "SCOPES",
    "Admission",
    "Decision",
    "Limits",
    "Spend",
    "Store",
    "decide",
    "open_store",
    "refusal",
    "release_if_cancelled",
    "release_later",
    "window_keys",
]

Scope = Literal["run_cost", "tenant_day", "tenant_month"]
SCOPES: tuple[Scope, ...] = ("run_cost", "tenant_day", "tenant_month")
MAX_MICROS = 2**53


@dataclass(frozen=True, slots=True)
class Limits:
    """Ceilings in force for one call; None = no limit. Cost limits in micro-USD.

    `origin` names where each limit came from ("tenant setting runs.max_llm_calls",
    "request header X-Run-Max-Calls"), keyed run_calls/run_cost/tenant_day/tenant_month,
    so that a refusal can say how to raise it.
    """

    run_max_calls: int | None = None
    run_max_cost: int | None = None
    day_budget: int | None = None
    month_budget: int | None = None
    origin: Mapping[str, str] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        # Redis Lua numbers are doubles: integers stay exact only below 2^53 (~$9e9).
        for name in ("run_max_calls", "run_max_cost", "day_budget", "month_budget"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < MAX_MICROS:
                raise ValueError(f"{name}={value} must be between 0 and 2^53 micro-USD")

    def cost_limit(self, scope: str) -> int | None:
        return {
            "run_cost": self.run_max_cost,
            "tenant_day": self.day_budget,
            "tenant_month": self.month_budget,
        }.get(scope)


@dataclass(frozen=True, slots=True)
class Admission:
    """A counted call holding `reserved` micro-USD on every scope until settled."""

    id: str
    tenant: str
    run_id: str
    reserved: int
    calls: int  # the run's call count, this call included
    remaining: dict[str, int | None]  # scope -> micro-USD left after this reservation
    day_key: str
    month_key: str


@dataclass(frozen=True, slots=True)
class Spend:
    settled: int = 0
    reserved: int = 0

    @property
    def total(self) -> int:
        return self.settled + self.reserved


@dataclass(frozen=True, slots=True)
class Decision:
    """What `decide` concluded: reserve `amount`, or refuse on `scope`."""

    amount: int = 0
    refused: str | None = None  # run_calls | run_cost | tenant_day | tenant_month
    remaining: dict[str, int | None] = field(default_factory=dict)


def window_keys(now: datetime, tz: str = "UTC") -> tuple[str, str]:
    """("YYYY-MM-DD", "YYYY-MM") of `now` in `tz`. `now` must be timezone-aware."""
    if now.tzinfo is None:
        raise ValueError("admission time must be timezone-aware (use datetime.now(UTC))")
    local = now.astimezone(ZoneInfo(tz))
    return local.strftime("%Y-%m-%d"), local.strftime("%Y-%m")


def decide(
    calls: int,
    ledger: Mapping[str, Spend],
    limits: Limits,
    *,
    min_reserve: int,
    max_reserve: int,
) -> Decision:
    """The admission rule, shared by both backends (redis.py's admit.lua mirrors it).

    Refuse when the run's call count is at its ceiling, or when some scope has less
    headroom than `min_reserve`; otherwise reserve min(max_reserve, smallest headroom).
    """
    if limits.run_max_calls is not None and calls >= limits.run_max_calls:
        return Decision(refused="run_calls")
    headroom: dict[str, int | None] = {}
    for scope in SCOPES:
        limit = limits.cost_limit(scope)
        headroom[scope] = None if limit is None else limit - ledger[scope].total
    bounded = [(h, s) for s, h in headroom.items() if h is not None]
    tightest = min(bounded) if bounded else None
    if tightest is not None and tightest[0] < min_reserve:
        return Decision(refused=tightest[1])
    amount = max_reserve if tightest is None else min(max_reserve, tightest[0])
    remaining = {s: None if h is None else h - amount for s, h in headroom.items()}
    return Decision(amount=amount, remaining=remaining)


def refusal(
    decision: Decision,
    *,
    tenant: str,
    run_id: str,
    limits: Limits,
    ledger: Mapping[str, Spend],
    windows: tuple[str, str],
    tz: str,
    min_reserve: int,
) -> CeilingReached:
    """The CeilingReached error for a refused decision, with its message."""
    scope = decision.refused or "run_calls"
    origin = limits.origin.get(scope)
    if scope == "run_calls":
        text = messages.call_ceiling(tenant, run_id, limits.run_max_calls or 0, origin)
        return CeilingReached(text, limit=scope)
    spend = ledger[scope]
    window = windows[0] if scope == "tenant_day" else windows[1] if scope == "tenant_month" else None
    text = messages.cost_ceiling(
        scope,
        tenant=tenant,
        run_id=run_id,
        window=window,
        tz=tz,
        limit=limits.cost_limit(scope) or 0,
        spent=spend.settled,
        reserved=spend.reserved,
        needed=min_reserve,
        origin=origin,
    )
    return CeilingReached(text, limit=scope)


async def release_if_cancelled(store: Store, admitting: Callable[[], Awaitable[Admission]]) -> Admission:
    """Run an admission so that a caller cancelled mid-way does not leak it.

    The store operation runs to completion in its own task; if our caller is cancelled
    meanwhile, the admission it would have returned is released (the call was never
    forwarded, so zero is its true cost) instead of expiring at its reserved amount.
    """
    task = asyncio.ensure_future(admitting())
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        task.add_done_callback(lambda t: release_later(store, t))
        raise


_RELEASING: set[asyncio.Task[None]] = set()  # keeps fire-and-forget releases alive


def release_later(store: Store, task: asyncio.Future[Any]) -> None:
    """Release the admission an abandoned admit produced (a refusal needs nothing)."""
    if task.cancelled() or task.exception() is not None or not isinstance(task.result(), Admission):
        return
    releasing = asyncio.ensure_future(store.release(task.result()))
    _RELEASING.add(releasing)
    releasing.add_done_callback(_RELEASING.discard)


class Store(Protocol):
    """Ledger + run state. All methods are atomic per call; all raise StoreUnavailable
    (never a backend's own exception) when the backend cannot be reached."""

    async def admit(
        self,
        tenant: str,
        run_id: str,
        *,
        min_reserve: int,
        max_reserve: int,
        limits: Limits,
        now: datetime,
        tz: str = "UTC",
        ttl_s: int = 900,
    ) -> Admission:
        """Count the call and reserve on every scope, in one atomic step, or raise
        CeilingReached (nothing counted, nothing reserved)."""
        ...

    async def settle(
        self,
        admission: Admission,
        actual: int,
        *,
        run_totals: dict[str, int] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> int:
        """Replace the reservation by `actual` on every scope; returns the overshoot
        (actual - reserved when positive, charged in full).

        In the same atomic step, for the admission's tenant and run: adds `run_totals`
        as `run_add` would and remembers `tools` as `tools_put` would (one commit / one
        round trip per answered call instead of three). A second settle of the same
        admission is a no-op as a whole: no charge, no totals, no tool calls."""
        ...

    async def release(self, admission: Admission) -> None: ...

    async def expire(self, now: datetime) -> int:
        """Turn reservations past their ttl into settled charges; returns how many."""
        ...

    async def spend(
        self,
        tenant: str,
        *,
        run_id: str | None = None,
        day: str | None = None,
        month: str | None = None,
    ) -> int:
        """Settled + reserved micro-USD of one scope (run, day, month; none = all time)."""
        ...

    async def spend_detail(
        self,
        tenant: str,
        *,
        run_id: str | None = None,
        day: str | None = None,
        month: str | None = None,
    ) -> Spend: ...

    async def run_calls(self, tenant: str, run_id: str) -> int: ...

    async def run_begin(self, tenant: str, run_id: str, now: datetime, trace: dict[str, Any]) -> dict[str, Any]:
        """Store `trace` if the run has none yet; return the stored one (shared by replicas)."""
        ...

    async def run_add(self, tenant: str, run_id: str, deltas: dict[str, int]) -> None: ...
    async def run_totals(self, tenant: str, run_id: str) -> dict[str, int]: ...

    async def run_end(self, tenant: str, run_id: str) -> dict[str, Any] | None:
        """Mark the run ended; the run record goes to the first caller only."""
        ...

    async def idle_runs(self, before: datetime) -> list[tuple[str, str]]: ...
    async def list_runs(self, tenant: str | None, limit: int = 50) -> list[dict[str, Any]]: ...
    async def tools_put(self, tenant: str, run_id: str, calls: list[dict[str, Any]]) -> None: ...
    async def tools_take(self, tenant: str, run_id: str, ids: list[str]) -> list[dict[str, Any]]: ...
    async def tools_pending(self, tenant: str, run_id: str) -> list[dict[str, Any]]: ...
    async def streak(self, tenant: str, run_id: str, signature: str) -> int: ...
    async def failures(self, tenant: str, run_id: str, failed: bool) -> int: ...
    async def budget_set(self, tenant: str, day: int | None, month: int | None) -> None: ...
    async def budget_get(self, tenant: str) -> tuple[int | None, int | None]: ...
    async def ping(self) -> None: ...
    async def aclose(self) -> None: ...


class DerivedOps:
    """Store operations both backends derive from their own primitives."""

    async def spend_detail(
        self, tenant: str, *, run_id: str | None = None, day: str | None = None, month: str | None = None
    ) -> Spend:
        raise NotImplementedError

    async def settle(self, admission: Admission, actual: int, *, run_totals: dict[str, int] | None = None,
                     tools: list[dict[str, Any]] | None = None) -> int:
        raise NotImplementedError

    async def spend(
        self, tenant: str, *, run_id: str | None = None, day: str | None = None, month: str | None = None
    ) -> int:
        return (await self.spend_detail(tenant, run_id=run_id, day=day, month=month)).total

    async def release(self, admission: Admission) -> None:
        await self.settle(admission, 0)


def open_store(url: str) -> Store:
    """`sqlite:///relative.db`, `sqlite:////abs/path.db`, `redis://host:port/db`.

    SQLite takes `?synchronous=normal` (default `full`): see proxy/policy/sqlite.py for
    what each survives. `sqlite:///:memory:` works but is not durable: tests only.
    """
    if url.startswith("sqlite:///"):
        from proxy.policy.sqlite import SqliteStore

        path, options = _sqlite_options(url)
        return SqliteStore(path, **options)
    if url.startswith(("redis://", "rediss://", "unix://")):
        from proxy.policy.redis import RedisStore

        return RedisStore(url)
    raise ConfigError(
        f"Unknown store URL {url!r}: use sqlite:///path/to/ledger.db (the default, one "
        f"machine) or redis://host:6379/0 (several replicas sharing one ledger)."
    )


def _sqlite_options(url: str) -> tuple[str, dict[str, str]]:
    """(path, SqliteStore keyword arguments) from a sqlite:/// URL."""
    from proxy.policy.sqlite import SYNCHRONOUS

    path, _, query = url.removeprefix("sqlite:///").partition("?")
    options: dict[str, str] = {}
    for name, values in parse_qs(query, keep_blank_values=True).items():
        value = values[-1].upper()
        if name != "synchronous" or value not in SYNCHRONOUS:
            raise ConfigError(
                f"Unknown SQLite ledger option {name}={values[-1]!r} in {url!r}: the only option is "
                f"synchronous={'|'.join(v.lower() for v in SYNCHRONOUS)} (full, the default, survives "
                f"power loss; normal survives process crashes and saves an fsync per commit)."
            )
        options["synchronous"] = value
    return path, options


def run_record(
    tenant: str,
    run_id: str,
    *,
    calls: int,
    spend: Spend,
    first_seen: float | None,
    last_seen: float | None,
    ended: bool,
    trace: dict[str, Any] | None,
    totals: dict[str, int],
) -> dict[str, Any]:
    """The one shape both backends return for a run."""
    return {
        "tenant": tenant,
        "run_id": run_id,
        "calls": calls,
        "settled": spend.settled,
        "reserved": spend.reserved,
        "spend": spend.total,
        "first_seen": first_seen,
        "last_seen": last_seen,
        "ended": ended,
        "trace": trace,
        "totals": totals,
    }


def scope_of(run_id: str | None, day: str | None, month: str | None) -> tuple[str, str]:
    """(scope, key) for spend(): at most one of run_id/day/month; none = all time."""
    given = [(s, k) for s, k in (("run", run_id), ("day", day), ("month", month)) if k is not None]
    if len(given) > 1:
        raise ValueError("spend() takes at most one of run_id, day, month")
    return given[0] if given else ("total", "")
