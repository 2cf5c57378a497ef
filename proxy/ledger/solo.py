"""Runs of one call kept in memory by budget leases (proxy/ledger/leases.py), and written to
the store whole, behind, in batches (`Views.runs_record`).

A call that carries no run id gets a run made for it alone: nobody else names that run, so
its row, totals and open tool calls need not be in the store while the call is served; the
money it spends is counted on the tenant's scopes by the lease that served it. What a crash
loses here is the run's row (its listing), never money: see docs/budgets.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from proxy.ledger.store import HeldEnd, RunRow, Spend, Store, WholeRun, run_record

__all__ = ["STALE_S", "WRITE_S", "Solo", "SoloRuns"]

log = logging.getLogger("spanmeter.ledger")

WRITE_S = 0.25  # ended runs are written this long after the first of a batch ended, at the latest
STALE_S = 60.0  # a run not ended this long after its call is written open (the idle sweeper ends it)
KEPT = 100_000  # runs waiting to be written past this (a store down long) are dropped, oldest first


@dataclass
class Solo:
    """What the store would hold for a run of one call."""

    tenant: str
    run_id: str
    first_seen: float  # epoch seconds
    trace: dict[str, Any] | None
    calls: int = 1
    last_seen: float = 0.0
    settled: int = 0  # micro-USD its settled calls cost
    inflight: int = 0  # reserved by its calls in flight
    totals: dict[str, int] = field(default_factory=dict)
    tools: list[dict[str, Any]] = field(default_factory=list)  # its open tool calls, in order
    ended_at: float | None = None
    born: float = field(default_factory=time.monotonic)

    def whole(self) -> WholeRun:
        return WholeRun(self.tenant, self.run_id, self.calls, self.first_seen, max(self.last_seen, self.first_seen),
                        self.trace, self.settled, dict(self.totals), self.ended_at)

    def record(self) -> dict[str, Any]:
        """The run as `Views.run_end` and `list_runs` give it."""
        row = RunRow(self.calls, self.first_seen, max(self.last_seen, self.first_seen), self.ended_at is not None,
                     self.trace)
        return run_record(self.tenant, self.run_id, row, Spend(self.settled, self.inflight), dict(self.totals))

    def add(self, totals: dict[str, int] | None, tools: list[dict[str, Any]] | None) -> None:
        for name, value in (totals or {}).items():
            self.totals[name] = self.totals.get(name, 0) + value
        if tools:
            known = {t.get("id") for t in self.tools}
            self.tools += [t for t in tools if t.get("id") not in known]


class SoloRuns:
    """The runs of one call this process holds, and their writing behind."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.live: dict[tuple[str, str], Solo] = {}  # held here: the store has nothing of them yet
        self._ended: list[Solo] = []  # ended, to be written
        self._writing: dict[tuple[str, str], asyncio.Future[None]] = {}  # being written now
        self._timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False

    def __contains__(self, run: tuple[str, str]) -> bool:
        return run in self.live or run in self._writing

    def begin(self, solo: Solo) -> None:
        self.live[solo.tenant, solo.run_id] = solo
        self._schedule(STALE_S)

    def end(self, tenant: str, run_id: str) -> dict[str, Any] | None:
        """End a run held here; its record, or None when it had ended already."""
        solo = self.live.get((tenant, run_id))
        if solo is None or solo.ended_at is not None:
            return None
        solo.ended_at = time.time()
        self._ended.append(solo)
        self._schedule(WRITE_S)
        return solo.record()

    def end_held(self, tenant: str, run_id: str) -> HeldEnd | None:
        """End a run held here with its open tool calls taken (`Views.end_held`); None when
        it is not held here or had ended already."""
        record = self.end(tenant, run_id)
        if record is None:
            return None
        solo = self.live[tenant, run_id]
        tools, solo.tools = solo.tools, []
        return HeldEnd(record, tools, partial(solo.add, tools=None))

    async def settled(self, tenant: str, run_id: str) -> None:
        """Wait until a run being written is in the store."""
        writing = self._writing.get((tenant, run_id))
        if writing is not None:
            await asyncio.shield(writing)

    async def materialize(self, tenant: str, run_id: str) -> None:
        """Put a run held here into the store now (open, or ended), so that an exact operation
        on it (a retry's admission, an MCP call naming it) sees everything it did."""
        await self.settled(tenant, run_id)
        solo = self.live.get((tenant, run_id))
        if solo is None:
            return
        if solo.ended_at is not None and solo in self._ended:
            self._ended.remove(solo)
        await self._write([solo])

    async def add_late(self, tenant: str, run_id: str, calls: int, settled: int, totals: dict[str, int] | None,
                       tools: list[dict[str, Any]] | None) -> None:
        """What a call of a run no longer held here settled: added to the run in the store."""
        now = time.time()
        await self.store.runs_record([WholeRun(tenant, run_id, calls, now, now, None, settled, dict(totals or {}))])
        if tools:
            await self.store.tools_put(tenant, run_id, tools)

    def _schedule(self, delay: float) -> None:
        if self._closed:
            return
        if self._timer is not None and self._timer.when() - asyncio.get_running_loop().time() <= delay:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_later(delay, self._tick)

    def _tick(self) -> None:
        self._timer = None
        task = asyncio.ensure_future(self.flush(stale_only=True))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def flush(self, *, stale_only: bool = False) -> None:
        """Write every ended run, and every run held longer than STALE_S (all, unless
        `stale_only`), in one store operation."""
        now = time.monotonic()
        batch, self._ended = self._ended, []
        batch += [s for s in self.live.values()
                  if s.ended_at is None and (not stale_only or now - s.born >= STALE_S)]
        if batch:
            await self._write(batch)
        if self.live:
            self._schedule(WRITE_S if self._ended else STALE_S)

    async def _write(self, batch: Sequence[Solo]) -> None:
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        runs = [(s.tenant, s.run_id) for s in batch]
        for run in runs:
            self._writing[run] = done
            self.live.pop(run, None)
        tools = [(s.tenant, s.run_id, s.tools) for s in batch if s.tools]
        try:
            for tenant, run_id, open_calls in tools:  # first: whoever finds the run finds its calls
                await self.store.tools_put(tenant, run_id, open_calls)
            await self.store.runs_record([s.whole() for s in batch])
        except Exception:
            # Kept to be written again (their money is counted already: only their rows wait).
            log.warning("could not write %d runs of one call to the ledger; will retry", len(batch), exc_info=True)
            for s in batch:
                self.live.setdefault((s.tenant, s.run_id), s)
                if s.ended_at is not None:
                    self._ended.append(s)
            self._drop_oldest()
            self._schedule(WRITE_S * 8)
        finally:
            for run in runs:
                if self._writing.get(run) is done:
                    del self._writing[run]
            done.set_result(None)

    def _drop_oldest(self) -> None:
        while len(self.live) > KEPT:
            run, solo = next(iter(self.live.items()))
            del self.live[run]
            if solo in self._ended:
                self._ended.remove(solo)
            log.error("dropped run %s of tenant %s unwritten: the ledger has been unreachable too long", run[1], run[0])

    async def aclose(self) -> None:
        """Write every run held here, once (a store down at shutdown loses their rows, logged)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        self._closed = True
        await self.flush()
        if self.live:
            log.error("%d runs of one call were not written to the ledger at shutdown (their money is counted)",
                      len(self.live))
