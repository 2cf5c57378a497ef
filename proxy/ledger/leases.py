"""Budget leases (issue 51, item 1; on by default, SPANMETER_LEDGER_LEASES=false turns them
off): a `Store` over any backend that admits calls on the event loop, against headroom it
leased durably ahead of need, instead of one store operation per call. Two kinds: a
tenant's runs of one call (`Turn.solo`, their runs kept in memory: solo.py) from a lease of
its day, month and key scopes; a hot run's calls from a lease of the run, their tool results
closed in memory where the lease made the calls they answer.

A lease is one exact admission of the wrapped store, so what it holds is counted on every
scope before any call is served from it; a crash only over-counts, never crosses a
ceiling. Only the safe case leases; anything else takes the wrapped store's exact path.
Sizing, returns and why it is safe: docs/internals.md, "Budget leases"; docs/budgets.md.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from functools import partial
from typing import Any

from proxy.errors import CeilingReached, LoopRefused, Refusal
from proxy.ledger.solo import Solo, SoloRuns
from proxy.ledger.store import (
    NO_TURN,
    Admission,
    Ask,
    HeldEnd,
    Limits,
    Spend,
    Store,
    ToolTurn,
    Turn,
    WholeRun,
    done_future,
    guard_refusal,
    refused_with,
    streak_of,
    window_keys,
)

log = logging.getLogger("spanmeter.ledger")

__all__ = ["HOT_AFTER", "LEASE_CALLS", "LEASE_RUN", "LEASE_S", "MARGIN", "PACE", "SOLO_CALLS", "SOLO_CALLS_MAX",
           "LeasedStore"]

LEASE_S = 2.0  # a lease is returned this long after it was taken, at the latest
LEASE_CALLS = 32  # calls one lease may serve
MARGIN = 8  # lease only with this many leases' worth of headroom on every limited scope
HOT_AFTER = 1  # exact admissions of a run before it leases (its first: docs/budgets.md)
TRIES = 4  # times a call of a leased run looks for a lease before the exact path
HEAT_KEPT = 4096  # runs whose latest admission is remembered (the least recent forgotten first)
SOLO_CALLS = 32  # a tenant lease's first size, for runs of one call; doubled each time one is used up
SOLO_CALLS_MAX = 1024
SOLO_CALLS_MIN = 8
RENEW_AT = 4  # a tenant lease's next is taken when 1/RENEW_AT of its calls or time is left
# A run (or a tenant's runs of one call) leases only while its calls come at least this many to
# a lease's life: an agent whose model answers in seconds sends its next call after its run's
# lease expired, and a lease per call is three ledger writes (take, settle, give back the
# unused) where the exact path is two, its calls counted and reserved 32 at a time meanwhile.
PACE = 4
# The run a process's tenant leases are admitted on (with a token of the process after it):
# ended at once, so it is never swept as idle, and left out of every listing.
LEASE_RUN = "~spanmeter-lease-"
LISTED_LEASE_RUNS = 16  # lease runs a listing may meet among the latest runs (one per process and tenant)

_Key = tuple[str, str, str | None, str, str]  # tenant, run, key id, day, month


@dataclass
class _Lease:
    """One lease: an exact admission of the wrapped store, served from in memory."""

    lkey: _Key
    admission: Admission
    ask: Ask
    taken: float  # time.monotonic()
    count: int  # calls it counted on the run up front
    served: int = 0  # calls admitted from it
    used: int = 0  # money: settled actuals + reservations in flight
    settled: int = 0  # the settled actuals among `used`
    inflight: dict[str, int] = field(default_factory=dict)  # leased admission id -> reserved
    totals: dict[str, int] = field(default_factory=dict)  # run totals to write with the return
    tools: dict[str, dict[str, Any]] = field(default_factory=dict)  # open tool calls by id, likewise
    # The run's loop-guard state (sig, streak, failures) as of the lease's admission and the
    # closes served since, when known (the admission closed a tool call): with it, a call whose
    # results answer tool calls this lease's calls made is closed in memory.
    guard: tuple[str | None, int, int] | None = None
    guard_moved: bool = False  # closes in memory moved it: written back with the lease
    contexts: dict[str, int] = field(default_factory=dict)  # stored-context sizes, likewise
    counted: bool = True  # its calls were counted on its run up front (a run's lease; not a tenant's)
    closing: bool = False  # no more calls; returned once nothing is in flight
    giving_back: bool = False  # its return has begun: no call is served from it any more
    settled_back: bool = False  # its settle is in the wrapped store
    uncounted: bool = False  # and its unused calls are given back

    @property
    def calls_left(self) -> int:
        return 0 if self.closing else self.count - self.served

    @property
    def run(self) -> tuple[str, str]:
        return self.ask.tenant, self.ask.run_id

    @property
    def base(self) -> int:
        """The run's calls before the lease."""
        return self.admission.calls - self.count


@dataclass
class _Heat:
    """What this process last saw of a run's exact admissions: whether to lease next, and
    what the next lease is sized from (only that: thousands are kept)."""

    __slots__ = ("calls", "key", "last_call", "limits", "remaining", "streak")

    def __init__(self) -> None:
        self.streak = 0
        self.calls = 0
        self.last_call = 0.0  # time.monotonic() of the run's latest call admitted here, exact or leased
        self.remaining: dict[str, int | None] = {}
        self.key: str | None = None
        self.limits: Limits | None = None


class LeasedStore:
    """A `Store` that leases hot runs' budgets from `inner` (module doc). Everything not on
    a call's path is the wrapped store's, after the run's leased work is written back."""

    def __init__(self, inner: Store, *, lease_s: float = LEASE_S, lease_calls: int = LEASE_CALLS) -> None:
        self.inner = inner
        self.lease_s, self.lease_calls = lease_s, lease_calls
        self._leases: dict[_Key, _Lease] = {}  # open: calls are served from these
        self._by_id: dict[str, _Lease] = {}  # leased calls in flight
        self._runs: dict[tuple[str, str], list[_Lease]] = {}  # every lease not yet returned, by run
        self._returns: dict[tuple[str, str], set[asyncio.Task[None]]] = {}  # returns under way, by run
        self._heat: dict[tuple[str, str], _Heat] = {}
        self._taking: dict[_Key, asyncio.Future[_Lease | None]] = {}  # leases being taken, for whoever waits
        self._closing: set[asyncio.Task[None]] = set()  # keeps the timers' closes alive
        self._ids = itertools.count()
        # Runs of one call (Turn.solo), served from tenant leases and kept in memory (solo.py).
        self.solos = SoloRuns(inner)
        self._lease_run = LEASE_RUN + secrets.token_hex(6)
        self._lease_runs_ended: set[str] = set()  # tenants whose lease run this process has ended
        self._tenant_heat: dict[tuple[str, str | None], tuple[Limits, Admission]] = {}  # (tenant, key) -> last seen
        self._tenant_last: dict[tuple[str, str | None], float] = {}  # (tenant, key) -> its latest run of one call
        self._solo_taking: dict[_Key, asyncio.Future[_Lease | None]] = {}
        self._solo_size: dict[tuple[str, str | None], int] = {}
        self._solo_of: dict[str, tuple[str, str]] = {}  # a leased call of a run of one -> its run
        self._renewing: set[asyncio.Task[_Lease | None]] = set()
        self._gave_back = 0  # give-backs begun (spend_detail reads the store between them)
        self._contexts: dict[str, dict[str, int]] = {}  # stored-context sizes settled into leases, not yet written

    # --- the call's path -------------------------------------------------------------

    async def admit(self, ask: Ask, turn: Turn = NO_TURN) -> Admission:
        run = (ask.tenant, ask.run_id)
        if turn.context and ask.tenant in self._contexts:
            await self._write_contexts(ask.tenant)
        if run in self.solos:  # a run of one call with a second (a retry): the store takes it over
            await self.solos.materialize(*run)
        elif turn.solo:
            served = await self._admit_solo(ask, turn)
            if served is not None:
                return served
            try:
                admission = await self.inner.admit(ask, turn)
            except CeilingReached as refused:
                lkey = self._solo_key(ask, turn)
                spare = None if lkey is None or refused.limit == "run_cost" else self._spare(
                    self._runs.get((ask.tenant, self._lease_run), ()), lkey, _tenant_limits(ask.limits), ask, turn)
                if spare is None:
                    raise
                return self._serve_solo(spare, ask, turn)
            self._tenant_heat[ask.tenant, turn.key] = (_tenant_limits(ask.limits), admission)
            self._tenant_last[ask.tenant, turn.key] = time.monotonic()
            return admission
        lkey = _lease_key(ask, turn)
        if run not in self._runs and run not in self._returns and not self._hot(run):
            return await self._exact(ask, turn)  # a run not leased nor hot: nothing else to do
        if lkey is None:
            await self._flush_run(ask.tenant, ask.run_id)
            return await self._exact(ask, turn)
        for _ in range(TRIES):
            taking = self._taking.get(lkey)
            if taking is not None:  # another call of the run is taking its lease: served from it
                await asyncio.wait([taking])
            lease = self._leases.get(lkey)
            if lease is not None and self._fits(lease, ask, turn):
                if not turn.results:
                    return self._serve(lease, turn)
                closed = self._close_in_memory(lease, ask, turn)
                if closed is not None:
                    return self._serve(lease, turn, closed)
            if lease is not None:
                await self._close(lkey)
            if lkey in self._taking:
                continue  # taken by another call meanwhile: from it, not past it
            size = self._lease_size(ask, turn, lkey)
            if not size:
                break
            try:
                lease = await self._take_for(lkey, ask, turn, size)
            except LoopRefused:
                raise  # on the call's own closes: what its exact admission would have said
            except Refusal as refused:  # the lease's admission closed the results, then found no room
                turn = replace(turn, results=(), guard=None)  # closed already: the exact path must not again
                await self._flush_run(ask.tenant, ask.run_id)
                try:
                    admission = await self._exact(ask, turn)
                except Refusal as again:
                    raise refused_with(again, refused.closed, again.trace or refused.trace) from None
                return replace(admission, closed=refused.closed)
            if lease is not None and self._fits(lease, ask, turn):
                return self._serve(lease, turn, lease.admission.closed)
            break
        await self._flush_run(ask.tenant, ask.run_id)
        try:
            return await self._exact(ask, turn)
        except CeilingReached:
            spare = None if turn.results else self._spare(self._runs.get(run, ()), lkey, ask.limits, ask, turn)
            if spare is None:
                raise
            return self._serve(spare, turn)

    async def _exact(self, ask: Ask, turn: Turn) -> Admission:
        admission = await self.inner.admit(ask, turn)
        self._seen(ask, admission)
        return admission

    def _seen(self, ask: Ask, admission: Admission) -> None:
        """Remember the run's latest admission (exact or a lease): what the next lease is sized from."""
        heat = self._heat.pop((ask.tenant, ask.run_id), None) or _Heat()
        heat.streak, heat.calls, heat.remaining = heat.streak + 1, admission.calls, admission.remaining
        heat.key, heat.limits, heat.last_call = admission.key, ask.limits, time.monotonic()
        self._heat[ask.tenant, ask.run_id] = heat  # most recent last
        if len(self._heat) > HEAT_KEPT:
            del self._heat[next(iter(self._heat))]

    def _fits(self, lease: _Lease, ask: Ask, turn: Turn) -> bool:
        a = lease.admission
        return (not lease.closing and lease.calls_left > 0 and a.reserved - lease.used >= turn.reserve[1]
                and ask.limits == lease.ask.limits and ask.ttl_s == lease.ask.ttl_s
                and time.monotonic() - lease.taken < self.lease_s
                and (turn.trace is None or a.trace is not None))

    def _hot(self, run: tuple[str, str]) -> bool:
        heat = self._heat.get(run)
        return heat is not None and heat.streak >= HOT_AFTER

    def _lease_size(self, ask: Ask, turn: Turn, lkey: _Key) -> int:
        """How many calls to lease for this run now (0: take the exact path)."""
        heat = self._heat.get((ask.tenant, ask.run_id))
        if heat is None or heat.streak < HOT_AFTER or heat.limits != ask.limits or heat.key != turn.key:
            return 0
        if time.monotonic() - heat.last_call > self.lease_s / PACE:
            return 0  # its calls come too far apart for a lease to serve several
        return _size(heat.calls, heat.remaining, ask.limits, turn.reserve[1], self.lease_calls)

    async def _take_for(self, lkey: _Key, ask: Ask, turn: Turn, calls: int) -> _Lease | None:
        """`_take`, run to its end even when the call that asked goes away meanwhile: the lease
        is then kept for the run's next calls (and given back as any), and the call that left
        is counted from it and released at once, as the store counts and releases an exact
        admission whose caller left (store.release_if_cancelled). Released by the store
        instead, the lease would leave all its calls counted on the run."""
        # Marked as being taken now, not when the task first runs: the run's next calls wait
        # for it rather than take one of their own.
        taking: asyncio.Future[_Lease | None] = asyncio.get_running_loop().create_future()
        self._taking[lkey] = taking
        task = asyncio.ensure_future(self._take(lkey, ask, turn, calls, taking))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(partial(self._left, ask, turn))
            raise

    def _left(self, ask: Ask, turn: Turn, task: asyncio.Task[_Lease | None]) -> None:
        if task.cancelled() or task.exception() is not None:
            return  # refused, or the store failed: nothing was leased
        lease = task.result()
        if lease is not None and self._fits(lease, ask, turn):
            release = asyncio.ensure_future(self.release(self._serve(lease, turn, lease.admission.closed)))
            self._closing.add(release)
            release.add_done_callback(self._closing.discard)

    async def _take(self, lkey: _Key, ask: Ask, turn: Turn, calls: int,
                    taking: asyncio.Future[_Lease | None]) -> _Lease | None:
        lease: _Lease | None = None
        try:
            await self._flush_run(ask.tenant, ask.run_id)
            most = turn.reserve[1]
            # The call's tool results are closed by the lease's admission, as its own would.
            # All or nothing: a lease cut to what is left would hold the rest unused (a stale
            # headroom, another process spending the same scope).
            lease_turn = Turn(reserve=(most * calls, most * calls), trace=turn.trace, key=turn.key, count=calls,
                              results=turn.results, guard=turn.guard)
            try:
                admission = await self.inner.admit(ask, lease_turn)
            except LoopRefused:
                raise  # the call's own admission would have said the same, on the same closes
            except Refusal as refused:
                if refused.closed:
                    raise  # the closes are done: the caller takes the exact path without them
                return None  # a refused lease is no refusal of the call: the exact path decides
            except Exception:
                return None
            self._seen(ask, admission)
            lease = _Lease(lkey, admission, ask, time.monotonic(), calls)
            if admission.closed:
                last = admission.closed[-1]
                lease.guard = (str(last.get("sig") or ""), int(last["streak"]), int(last["failures"]))
            self._leases[lkey] = lease
            self._runs.setdefault(lease.run, []).append(lease)
            loop = asyncio.get_running_loop()
            loop.call_later(self.lease_s, self._expire_soon, lkey, lease)
            return lease
        finally:
            del self._taking[lkey]
            taking.set_result(lease)

    def _spare(self, leases: Sequence[_Lease], lkey: _Key, limits: Limits, ask: Ask, turn: Turn) -> _Lease | None:
        """A lease of `lkey` that still holds a call's worst case, closing or not, for a call the
        store refused: near a limit, the unused part of a lease whose calls are in flight is
        headroom only this process can give (module doc). Only a lease younger than LEASE_S,
        so an admin budget cut holds here as soon as without the fallback."""
        now = time.monotonic()
        for lease in leases:
            if (lease.lkey == lkey and not lease.giving_back and lease.served < lease.count
                    and lease.admission.reserved - lease.used >= turn.reserve[1] and lease.ask.limits == limits
                    and lease.ask.ttl_s == ask.ttl_s and now - lease.taken < self.lease_s):
                return lease
        return None

    def _close_in_memory(self, lease: _Lease, ask: Ask, turn: Turn) -> tuple[dict[str, Any], ...] | None:
        """Close the tool calls a call's results answer from the lease's own open calls, as the
        store's admission would (sqlite.py `_close_tools`, admit.lua): None when one is not the
        lease's or the run's guard state is unknown (the exact path closes them). A loop-guard
        refusal is raised with the closes kept, as the store keeps them."""
        if lease.guard is None or any(call_id not in lease.tools for call_id, _ in turn.results):
            return None
        state: tuple[str | None, int, int] = lease.guard
        closed: list[dict[str, Any]] = []
        for call_id, ok in dict(turn.results).items():
            call = lease.tools.pop(call_id)
            state = streak_of(state, str(call.get("sig") or ""), ok, step=not closed)
            closed.append({**call, "ok": ok, "streak": state[1], "failures": state[2]})
        lease.guard, lease.guard_moved = state, True
        done = tuple(closed)
        loop = guard_refusal(ask.tenant, ask.run_id, done, turn.guard)
        if loop is not None:
            raise refused_with(loop, done, lease.admission.trace)
        return done

    def _serve(self, lease: _Lease, turn: Turn, closed: tuple[dict[str, Any], ...] = ()) -> Admission:
        a, amount = lease.admission, turn.reserve[1]
        heat = self._heat.get(lease.run)
        if heat is not None:
            heat.last_call = time.monotonic()
        lease.served += 1
        lease.used += amount
        rid = f"lease-{next(self._ids)}"
        lease.inflight[rid] = amount
        self._by_id[rid] = lease
        if lease.served >= lease.count and self._leases.get(lease.lkey) is lease:
            # Used up: returned at its last call's settle, not held until it expires (a
            # reading from another process counts its unused money until then).
            del self._leases[lease.lkey]
            lease.closing = True
        free = a.reserved - lease.used
        remaining = {s: None if v is None else v + free for s, v in a.remaining.items()}
        return Admission(rid, a.tenant, a.run_id, amount, lease.base + lease.served, remaining, a.day_key,
                         a.month_key, closed=closed, trace=a.trace, limits=a.limits, key=turn.key)

    async def settle(self, admission: Admission, actual: int, *, run_totals: dict[str, int] | None = None,
                     tools: list[dict[str, Any]] | None = None, contexts: dict[str, int] | None = None) -> int:
        lease = self._by_id.pop(admission.id, None)
        if lease is None:
            if admission.id.startswith("lease-"):
                return 0  # a second settle of a leased call
            return await self.inner.settle(admission, actual, run_totals=run_totals, tools=tools,
                                           contexts=contexts)
        reserved = lease.inflight.pop(admission.id)
        within = min(actual, reserved)
        lease.used += within - reserved
        lease.settled += within
        solo_run = self._solo_of.pop(admission.id, None)
        if solo_run is not None:  # the run's own record is kept apart from the tenant's lease
            solo = self.solos.live.get(solo_run)
            if solo is not None:
                solo.settled += actual
                solo.inflight -= reserved
                solo.add(run_totals, tools)
            else:  # the store took the run over meanwhile (solo.py `materialize`)
                await asyncio.ensure_future(self.solos.add_late(*solo_run, 0, actual, run_totals, tools))
        else:
            for name, value in (run_totals or {}).items():
                lease.totals[name] = lease.totals.get(name, 0) + value
            for call in tools or ():
                lease.tools[str(call.get("id"))] = call
        for ref, size in (contexts or {}).items():
            lease.contexts[ref] = max(size, lease.contexts.get(ref, 0))
            pending = self._contexts.setdefault(lease.ask.tenant, {})
            pending[ref] = max(size, pending.get(ref, 0))
        if actual > reserved:
            await asyncio.ensure_future(self._overshoot(lease, actual - reserved))
        if lease.closing and not lease.inflight:
            await self._return(lease)
        return max(0, actual - reserved)

    async def _overshoot(self, lease: _Lease, excess: int) -> None:
        """A leased call cost more than its reservation: the lease does not hold the excess,
        so it is charged now, in full, on every scope of the lease (an admission of nothing
        settled at the excess), and the lease is closed. Refused (a scope already overspent),
        the excess goes with the lease's settle, which then comes as soon as nothing is in flight."""
        await self._close(lease.lkey)
        a = lease.admission
        try:
            charge = await self.inner.admit(Ask(a.tenant, a.run_id, lease.ask.now, tz=lease.ask.tz,
                                                ttl_s=lease.ask.ttl_s), Turn(key=a.key, count=0))
        except Exception:  # charged with the lease instead
            lease.settled += excess
            return
        await self.inner.settle(charge, excess)

    def queues_settle(self, admission: Admission) -> bool:
        # A leased call settles in memory; what it may wait for (a lease's return, an
        # overshoot's charge) runs in a task of its own.
        return admission.id in self._by_id or self.inner.queues_settle(admission)

    async def settle_in_order(self, admission: Admission, actual: int, *, run_totals: dict[str, int] | None = None,
                              tools: list[dict[str, Any]] | None = None,
                              contexts: dict[str, int] | None = None) -> Awaitable[int]:
        if admission.id not in self._by_id:
            return await self.inner.settle_in_order(admission, actual, run_totals=run_totals, tools=tools,
                                                    contexts=contexts)
        return done_future(await self.settle(admission, actual, run_totals=run_totals, tools=tools,
                                             contexts=contexts))

    async def release(self, admission: Admission) -> None:
        await self.settle(admission, 0)

    async def admit_tool(self, ask: Ask, turn: ToolTurn) -> Admission:
        await self.solos.materialize(ask.tenant, ask.run_id)
        await self._flush_run(ask.tenant, ask.run_id)
        self._heat.pop((ask.tenant, ask.run_id), None)
        return await self.inner.admit_tool(ask, turn)

    async def expire(self, now: datetime) -> int:
        return await self.inner.expire(now)

    # --- runs of one call: tenant leases ------------------------------------------

    async def _admit_solo(self, ask: Ask, turn: Turn) -> Admission | None:
        """A run of one call served from its tenant's lease, or None for the exact path."""
        lkey = self._solo_key(ask, turn)
        if lkey is None:
            return None
        lease = self._leases.get(lkey)
        if lease is None or not self._fits_solo(lease, ask, turn):
            lease = await self._solo_lease(lkey, ask, turn)
            if lease is None or not self._fits_solo(lease, ask, turn):
                return None
        admission = self._serve_solo(lease, ask, turn)
        left = lease.calls_left * RENEW_AT < lease.count or (
            (time.monotonic() - lease.taken) * RENEW_AT > self.lease_s * (RENEW_AT - 1))
        if left and lkey not in self._solo_taking:  # the next lease is taken before this one runs out
            task = asyncio.ensure_future(self._solo_lease(lkey, ask, turn))
            self._renewing.add(task)
            task.add_done_callback(self._renewing.discard)
        return admission

    def _solo_key(self, ask: Ask, turn: Turn) -> _Key | None:
        """The tenant lease a run of one call may be served from; None when the store must
        judge it (what a fresh run's ceilings cannot decide alone, or a rate, a stored context)."""
        limits = ask.limits
        if (turn.context or turn.rates or not turn.priced or turn.count != 1
                or limits.run_max_tokens is not None or limits.run_max_seconds is not None
                or (limits.run_max_calls is not None and limits.run_max_calls < 1)
                or (limits.run_max_cost is not None and limits.run_max_cost < turn.reserve[0])):
            return None
        day, month = window_keys(ask.now, ask.tz)
        return ask.tenant, self._lease_run, turn.key, day, month

    def _fits_solo(self, lease: _Lease, ask: Ask, turn: Turn) -> bool:
        return (not lease.closing and lease.calls_left > 0
                and lease.admission.reserved - lease.used >= turn.reserve[1]
                and _tenant_limits(ask.limits) == lease.ask.limits and ask.ttl_s == lease.ask.ttl_s
                and time.monotonic() - lease.taken < self.lease_s)

    async def _solo_lease(self, lkey: _Key, ask: Ask, turn: Turn) -> _Lease | None:
        """The tenant's next lease: taken once, whoever else waits for it meanwhile."""
        pending = self._solo_taking.get(lkey)
        if pending is not None:
            return await asyncio.shield(pending)
        calls = self._solo_calls(ask, turn)
        if not calls:
            return None
        taking: asyncio.Future[_Lease | None] = asyncio.get_running_loop().create_future()
        self._solo_taking[lkey] = taking
        lease = None
        try:
            lease = await self._take_solo(lkey, ask, turn, calls)
        finally:
            del self._solo_taking[lkey]
            taking.set_result(lease)
        return lease

    def _solo_calls(self, ask: Ask, turn: Turn) -> int:
        """Calls to lease for the tenant's runs of one call: from how the last lease was used,
        and at most 1/MARGIN of the headroom its last admission left on every limited scope."""
        heat = self._tenant_heat.get((ask.tenant, turn.key))
        if heat is None or heat[0] != _tenant_limits(ask.limits):
            return 0  # the first: exact, and its headroom sizes the lease
        if time.monotonic() - self._tenant_last.get((ask.tenant, turn.key), 0.0) > self.lease_s / PACE:
            return 0  # its calls come too far apart for a lease to serve several
        calls, most = self._solo_size.get((ask.tenant, turn.key), SOLO_CALLS), turn.reserve[1]
        if most > 0:
            for scope, left in heat[1].remaining.items():
                if scope != "run_cost" and left is not None:
                    calls = min(calls, left // (MARGIN * most))
        return calls if calls >= 2 else 0

    async def _take_solo(self, lkey: _Key, ask: Ask, turn: Turn, calls: int) -> _Lease | None:
        most = turn.reserve[1]
        lask = Ask(ask.tenant, self._lease_run, ask.now, _tenant_limits(ask.limits), tz=ask.tz, ttl_s=ask.ttl_s)
        try:
            admission = await self.inner.admit(lask, Turn(reserve=(most, most * calls), key=turn.key, count=0))
        except Exception:  # a refused lease is no refusal of the call: the exact path decides
            return None
        self._tenant_heat[ask.tenant, turn.key] = (lask.limits, admission)
        if ask.tenant not in self._lease_runs_ended:  # never an open run: no sweep, no run span
            self._lease_runs_ended.add(ask.tenant)
            try:
                await self.inner.run_end(ask.tenant, self._lease_run)
            except Exception:
                self._lease_runs_ended.discard(ask.tenant)
        if most > 0:
            calls = min(calls, admission.reserved // most)
        lease = _Lease(lkey, admission, lask, time.monotonic(), calls, counted=False)
        if lkey in self._leases:
            self._close_behind(lkey)
        self._leases[lkey] = lease
        self._runs.setdefault(lease.run, []).append(lease)
        asyncio.get_running_loop().call_later(self.lease_s, self._expire_soon, lkey, lease)
        return lease

    def _serve_solo(self, lease: _Lease, ask: Ask, turn: Turn) -> Admission:
        """Admit a run of one call from the tenant's lease: the run's own ceilings judged here
        (a fresh run: its first call, nothing spent), the tenant's by the lease."""
        a, limits = lease.admission, ask.limits
        self._tenant_last[ask.tenant, turn.key] = time.monotonic()
        amount = turn.reserve[1] if limits.run_max_cost is None else min(turn.reserve[1], limits.run_max_cost)
        lease.served += 1
        lease.used += amount
        rid = f"lease-{next(self._ids)}"
        lease.inflight[rid] = amount
        self._by_id[rid] = lease
        self._solo_of[rid] = (ask.tenant, ask.run_id)
        free = a.reserved - lease.used
        remaining: dict[str, int | None] = {"run_cost": None if limits.run_max_cost is None
                                            else limits.run_max_cost - amount}
        remaining |= {s: None if v is None else v + free for s, v in a.remaining.items() if s != "run_cost"}
        ts = ask.now.timestamp()
        self.solos.begin(Solo(ask.tenant, ask.run_id, ts, turn.trace, last_seen=ts, inflight=amount))
        return Admission(rid, a.tenant, ask.run_id, amount, 1, remaining, a.day_key, a.month_key, trace=turn.trace,
                         limits=_in_force(limits, a.limits), key=turn.key)

    def _close_behind(self, lkey: _Key) -> None:
        """`_close` now, its return left to a task: nobody waits for it."""
        lease = self._leases.pop(lkey, None)
        if lease is None:
            return
        lease.closing = True
        if not lease.inflight:
            task = asyncio.ensure_future(self._return(lease))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def _write_contexts(self, tenant: str) -> None:
        """Stored-context sizes settled into leases, written now: a call naming one is about
        to be admitted (an admission of nothing on the lease run, settled with them)."""
        pending = self._contexts.pop(tenant, None)
        if not pending:
            return
        try:
            carrier = await self.inner.admit(Ask(tenant, self._lease_run, datetime.now(UTC)), Turn(count=0))
            await self.inner.settle(carrier, 0, contexts=pending)
        except Exception:  # the leases carrying them write them at their return
            for ref, size in pending.items():
                self._contexts.setdefault(tenant, {})[ref] = max(size, self._contexts.get(tenant, {}).get(ref, 0))
            raise

    def _contexts_written(self, tenant: str, written: dict[str, int]) -> None:
        pending = self._contexts.get(tenant)
        if not pending or not written:
            return
        for ref, size in written.items():
            if pending.get(ref, size + 1) <= size:
                del pending[ref]
        if not pending:
            del self._contexts[tenant]

    # --- returning leases ------------------------------------------------------------

    def _expire_soon(self, lkey: _Key, lease: _Lease) -> None:
        if self._leases.get(lkey) is lease:
            task = asyncio.ensure_future(self._close(lkey))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def _close(self, lkey: _Key) -> None:
        """No more calls from this lease; return it now, or at its last call's settle."""
        lease = self._leases.pop(lkey, None)
        if lease is None:
            return
        lease.closing = True
        if not lease.inflight:
            await self._return(lease)

    async def _return(self, lease: _Lease) -> None:
        """Give the lease back in a task of its own, which an exact operation on the run
        waits for (`_flush_run`) and a cancelled caller does not stop."""
        task = asyncio.ensure_future(self._give_back(lease))
        self._returns.setdefault(lease.run, set()).add(task)
        task.add_done_callback(lambda t: self._returned(lease, t))
        await task

    def _returned(self, lease: _Lease, task: asyncio.Task[None]) -> None:
        returns = self._returns.get(lease.run, set())
        returns.discard(task)
        if not returns:
            self._returns.pop(lease.run, None)

    async def _give_back(self, lease: _Lease) -> None:
        """One settle of the lease (the money its calls spent, with their totals, tool calls
        and context sizes), then the calls it counted and did not serve are uncounted. Until
        each is done the ledger holds more than was spent, never less."""
        self._gave_back += 1
        lease.giving_back = True
        try:
            totals, tools, contexts = lease.totals, list(lease.tools.values()), lease.contexts
            lease.totals, lease.tools, lease.contexts = {}, {}, {}
            if lease.guard_moved and lease.guard is not None:
                lease.guard_moved = False
                await self.inner.run_guard(lease.ask.tenant, lease.ask.run_id, lease.guard)
            await self.inner.settle(lease.admission, lease.settled, run_totals=totals or None,
                                    tools=tools or None, contexts=contexts or None)
            lease.settled_back = True
            self._contexts_written(lease.ask.tenant, contexts)
            unused = lease.count - lease.served
            if unused > 0 and lease.counted:
                await self._uncount(lease.ask, unused)
            lease.uncounted = True
            if not lease.counted:  # a tenant lease: the next is sized from how this one was used
                sized = (lease.ask.tenant, lease.admission.key)
                if unused <= 0:
                    self._solo_size[sized] = min(SOLO_CALLS_MAX, lease.count * 2)
                elif lease.served < lease.count // 4:
                    self._solo_size[sized] = max(SOLO_CALLS_MIN, lease.count // 2)
        finally:
            leases = self._runs.get(lease.run, [])
            if lease in leases:
                leases.remove(lease)
            if not leases:
                self._runs.pop(lease.run, None)

    async def _uncount(self, ask: Ask, calls: int) -> None:
        """Give back the calls a lease counted and did not serve: an admission counting
        -`calls` that reserves nothing, released at once. Refused (an admin budget already
        overspent), they stay counted: an over-count, never an under-count."""
        try:
            admission = await self.inner.admit(Ask(ask.tenant, ask.run_id, ask.now, tz=ask.tz, ttl_s=ask.ttl_s),
                                               Turn(count=-calls))
        except Exception:  # an over-count is the safe way to fail
            return
        await self.inner.release(admission)

    async def _flush_run(self, tenant: str, run_id: str) -> None:
        """Before an exact operation on a run: close its leases, write what their settled
        calls left (run totals, open tool calls) and wait for their returns, so that the
        operation sees everything the leased calls did."""
        run = (tenant, run_id)
        if run not in self._runs and run not in self._returns:
            return  # the common case: nothing leased
        for lease in list(self._runs.get(run, ())):
            await self._close(lease.lkey)
        for lease in list(self._runs.get(run, ())):
            if lease.inflight:  # returned by its last call's settle; what is settled goes now
                await self._write_behind(lease)
        pending = self._returns.get(run)
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)

    async def _write_behind(self, lease: _Lease) -> None:
        tools, totals = list(lease.tools.values()), lease.totals
        lease.tools, lease.totals = {}, {}
        if lease.guard_moved and lease.guard is not None:
            lease.guard_moved = False
            await self.inner.run_guard(lease.ask.tenant, lease.ask.run_id, lease.guard)
        if tools:
            await self.inner.tools_put(lease.ask.tenant, lease.ask.run_id, tools)
        if totals:
            await self.inner.run_add(lease.ask.tenant, lease.ask.run_id, totals)

    async def _flush_all(self) -> None:
        for run in list(self._runs):
            await self._flush_run(*run)
        for run in list(self._returns):
            await self._flush_run(*run)

    # --- views: the wrapped store's, with this process's leases at their true use ----

    async def spend_detail(self, tenant: str, *, run_id: str | None = None, day: str | None = None,
                           month: str | None = None, key_id: str | None = None) -> Spend:
        if run_id is not None:
            solo = self.solos.live.get((tenant, run_id))
            if solo is not None:
                return Spend(solo.settled, solo.inflight)
            await self.solos.settled(tenant, run_id)
        # A lease being given back is in the store or not depending on the moment the store is
        # read: read it when none is, again if one began meanwhile.
        for _ in range(8):
            returning = [task for tasks in self._returns.values() for task in tasks]
            if returning:
                await asyncio.gather(*returning, return_exceptions=True)
            began = self._gave_back
            found = await self.inner.spend_detail(tenant, run_id=run_id, day=day, month=month, key_id=key_id)
            if began == self._gave_back and not any(self._returns.values()):
                break
        settled, reserved = found.settled, found.reserved
        for lease in self._live():
            if not lease.settled_back and _covers(lease.admission, tenant, run_id, day, month, key_id):
                settled += lease.settled
                reserved += sum(lease.inflight.values()) - lease.admission.reserved
        return Spend(settled, reserved)

    async def spend(self, tenant: str, *, run_id: str | None = None, day: str | None = None,
                    month: str | None = None, key_id: str | None = None) -> int:
        return (await self.spend_detail(tenant, run_id=run_id, day=day, month=month, key_id=key_id)).total

    def _live(self) -> list[_Lease]:
        """Leases not yet returned (open, closing with calls in flight, being returned)."""
        return [lease for leases in self._runs.values() for lease in leases]

    async def run_calls(self, tenant: str, run_id: str) -> int:
        solo = self.solos.live.get((tenant, run_id))
        if solo is not None:
            return solo.calls
        await self.solos.settled(tenant, run_id)
        calls = await self.inner.run_calls(tenant, run_id)
        return calls - sum(lease.count - lease.served for lease in self._runs.get((tenant, run_id), ())
                           if not lease.uncounted)

    async def run_add(self, tenant: str, run_id: str, deltas: dict[str, int], *, soon: bool = False) -> None:
        solo = self.solos.live.get((tenant, run_id))
        if solo is not None:
            solo.add(deltas, None)
            return
        await self.solos.settled(tenant, run_id)
        await self.inner.run_add(tenant, run_id, deltas, soon=soon)

    async def run_totals(self, tenant: str, run_id: str) -> dict[str, int]:
        solo = self.solos.live.get((tenant, run_id))
        if solo is not None:
            return dict(solo.totals)
        await self.solos.settled(tenant, run_id)
        await self._flush_run(tenant, run_id)
        return await self.inner.run_totals(tenant, run_id)

    def end_held(self, tenant: str, run_id: str) -> HeldEnd | None:
        return self.solos.end_held(tenant, run_id)

    async def run_end(self, tenant: str, run_id: str) -> dict[str, Any] | None:
        if (tenant, run_id) in self.solos.live:
            return self.solos.end(tenant, run_id)
        await self.solos.settled(tenant, run_id)
        await self._flush_run(tenant, run_id)
        self._heat.pop((tenant, run_id), None)
        return await self.inner.run_end(tenant, run_id)

    async def idle_runs(self, before: datetime) -> list[tuple[str, str]]:
        return [(t, r) for t, r in await self.inner.idle_runs(before) if not r.startswith(LEASE_RUN)]

    async def sweep_turn(self, every_s: float) -> bool:
        return await self.inner.sweep_turn(every_s)

    async def runs_record(self, runs: Sequence[WholeRun]) -> None:
        await self.inner.runs_record(runs)

    async def run_guard(self, tenant: str, run_id: str, state: tuple[str | None, int, int]) -> None:
        await self._flush_run(tenant, run_id)
        await self.inner.run_guard(tenant, run_id, state)

    async def list_runs(self, tenant: str | None, limit: int = 50) -> list[dict[str, Any]]:
        await self._flush_all()
        await self.solos.flush(stale_only=True)  # every ended run of one call, written
        # Every process's lease runs are left out (a few a tenant: one per process).
        found = await self.inner.list_runs(tenant, limit + LISTED_LEASE_RUNS)
        return [r for r in found if not r["run_id"].startswith(LEASE_RUN)][:limit]

    async def tools_put(self, tenant: str, run_id: str, calls: list[dict[str, Any]]) -> None:
        solo = self.solos.live.get((tenant, run_id))
        if solo is not None:
            solo.add(None, calls)
            return
        await self.solos.settled(tenant, run_id)
        await self._flush_run(tenant, run_id)
        await self.inner.tools_put(tenant, run_id, calls)

    async def tools_take(self, tenant: str, run_id: str, ids: list[str]) -> list[dict[str, Any]]:
        solo = self.solos.live.get((tenant, run_id))
        if solo is not None:
            wanted = set(ids)
            taken = [t for t in solo.tools if t.get("id") in wanted]
            solo.tools = [t for t in solo.tools if t.get("id") not in wanted]
            return taken
        await self.solos.settled(tenant, run_id)
        await self._flush_run(tenant, run_id)
        return await self.inner.tools_take(tenant, run_id, ids)

    async def tools_pending(self, tenant: str, run_id: str) -> list[dict[str, Any]]:
        solo = self.solos.live.get((tenant, run_id))
        if solo is not None:
            return list(solo.tools)
        await self.solos.settled(tenant, run_id)
        await self._flush_run(tenant, run_id)
        return await self.inner.tools_pending(tenant, run_id)

    async def budget_set(self, tenant: str, day: int | None, month: int | None) -> None:
        await self.inner.budget_set(tenant, day, month)
        for lkey in [k for k in self._leases if k[0] == tenant]:
            await self._close(lkey)  # this process's leases follow the new budget at once

    async def budget_get(self, tenant: str) -> tuple[int | None, int | None]:
        return await self.inner.budget_get(tenant)

    async def ping(self) -> None:
        await self.inner.ping()

    async def aclose(self) -> None:
        """Give every lease back and write every run held here; with the store down, what
        is left stays counted as spent (an over-count, never an under-count), logged."""
        if self._renewing:
            await asyncio.gather(*self._renewing, return_exceptions=True)
        try:
            await self._flush_all()
        except Exception:
            log.warning("could not give budget leases back at shutdown; their unused part stays counted as spent "
                        "until the reservations expire", exc_info=True)
        await self.solos.aclose()
        await self.inner.aclose()


def _lease_key(ask: Ask, turn: Turn) -> _Key | None:
    """The lease a call may be served from, or None when it must take the exact path."""
    limits = ask.limits
    if (turn.context or turn.rates or not turn.priced or turn.count != 1
            or limits.run_max_tokens is not None or limits.run_max_seconds is not None):
        return None
    day, month = window_keys(ask.now, ask.tz)
    return ask.tenant, ask.run_id, turn.key, day, month


def _size(run_calls: int, remaining: dict[str, int | None], limits: Limits, most: int, calls: int) -> int:
    """Calls to lease: at most `calls`, and at most 1/`MARGIN` of the headroom the run's last
    admission left on the call ceiling and on every limited scope (a lease holds `most` per
    call); under 2, none (near a limit every call takes the exact path)."""
    if limits.run_max_calls is not None:
        calls = min(calls, (limits.run_max_calls - run_calls) // MARGIN)
    if most > 0:
        for left in remaining.values():
            if left is not None:
                calls = min(calls, left // (MARGIN * most))
    return calls if calls >= 2 else 0


def _covers(a: Admission, tenant: str, run_id: str | None, day: str | None, month: str | None,
            key_id: str | None) -> bool:
    """Whether a lease's admission reserved on the scope `spend` was asked for."""
    if a.tenant != tenant or (key_id is not None and a.key != key_id):
        return False
    if run_id is not None:
        return a.run_id == run_id
    if day is not None:
        return a.day_key == day
    if month is not None:
        return a.month_key == month
    return True


def _tenant_limits(limits: Limits) -> Limits:
    """The limits a tenant lease is admitted under: the run's are judged per call."""
    return replace(limits, run_max_calls=None, run_max_cost=None, run_max_tokens=None, run_max_seconds=None)


def _in_force(limits: Limits, leased: Limits | None) -> Limits:
    """A call's limits with the admin API's budgets its lease's admission found in force."""
    if leased is None or (leased.day_budget, leased.month_budget) == (limits.day_budget, limits.month_budget):
        return limits
    origin = dict(limits.origin)
    for scope in ("tenant_day", "tenant_month"):
        if scope in leased.origin:
            origin[scope] = leased.origin[scope]
    return replace(limits, day_budget=leased.day_budget, month_budget=leased.month_budget, origin=origin)
