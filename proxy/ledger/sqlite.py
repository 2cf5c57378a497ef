"""The embedded ledger: one SQLite file in WAL mode, written by one dedicated thread.

Operations queue up; the thread runs every waiting one in one `BEGIN IMMEDIATE`
transaction and commits once (group commit), each operation still atomic and isolated
(one that raises leaves no write). Consecutive settles and admissions run as one row
(`_settle_row`, `_admit_row`), each reading what it would read had the ones before it been
committed one by one. Results are handed back after the commit, a batch's at once.
Why, what it costs, and what each `synchronous` setting (FULL, NORMAL, EXTRA) keeps
through a crash: docs/internals.md, "The SQLite ledger".
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import queue
import secrets
import sqlite3
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import replace
from datetime import datetime
from typing import Any, TypeVar

import orjson

from proxy.errors import Refusal, StoreUnavailable
from proxy.ledger.rates import Rate, RateState, epoch_ms, rate_step
from proxy.ledger.store import (
    CONTEXT_KEPT_S,
    MCP_TOOL_CALLS,
    NO_TURN,
    Admission,
    Ask,
    DerivedOps,
    RunRow,
    Spend,
    Standing,
    ToolTurn,
    Turn,
    WholeRun,
    context_micros,
    context_refusal,
    costed,
    decide,
    guard_refusal,
    ledger_keys,
    match_pending,
    rate_refusal,
    refusal,
    refused_with,
    release_soon,
    run_record,
    scope_of,
    streak_of,
    tool_ceiling,
    tool_entry,
    unpriced_refusal,
    window_keys,
    with_budgets,
)

__all__ = ["SYNCHRONOUS", "SYNC_WITHIN_S", "SqliteStore"]

log = logging.getLogger("spanmeter.ledger")

T = TypeVar("T")
Op = Callable[[sqlite3.Connection], Any]
# How long a commit may wait for its fsync: NOW (before its result is handed back), SOON
# (within SYNC_WITHIN_S) or LAZY (when anything next fsyncs; losing it can only over-count).
NOW, SOON, LAZY = 0, 1, 2
_Job = tuple[Op, asyncio.AbstractEventLoop, "asyncio.Future[Any]", int]  # (op, its loop, its future, durability)
# A durable-soon commit is fsynced within this, unless a batch that waits fsyncs it first.
# About one fsync's own time on a busy disk: the settle is durable about when it was before,
# without the run's next admission queueing behind that fsync.
SYNC_WITHIN_S = 0.002

_BATCH = 256
# Prepared statements kept per connection: every distinct SQL text of this module (about
# 60, counting the per-row-count variants of the multi-row ones) stays prepared.
_STATEMENTS = 256
# Waiting for another process's write lock (the workers of `spanmeter serve --workers N`
# share the file). SQLite's own busy handler sleeps 1, 2, 5, 10 ... 100 ms between tries,
# far longer than a batch holds the lock (its commit's fsync, a few ms), so two workers
# took turns in tens of milliseconds (p99 0.46 s in the bench). We poll instead, from 0.1 ms
# doubling to 1 ms, for as long as the busy timeout allowed.
LOCK_PATIENCE_S = 30.0
_FIRST_PAUSE_S = 0.0001
_LAST_PAUSE_S = 0.001
SYNCHRONOUS = ("FULL", "NORMAL", "EXTRA")  # OFF is left out: an OS crash could corrupt the file
_EXPIRED_KEPT_S = 7 * 86400  # how long an expired reservation can still be corrected

_SCHEMA = """
CREATE TABLE IF NOT EXISTS ledger (
    tenant TEXT NOT NULL, scope TEXT NOT NULL, key TEXT NOT NULL,
    settled INTEGER NOT NULL DEFAULT 0, reserved INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (tenant, scope, key)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS reservations (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, run_id TEXT NOT NULL,
    day_key TEXT NOT NULL, month_key TEXT NOT NULL, amount INTEGER NOT NULL,
    expires_at REAL NOT NULL, expired INTEGER NOT NULL DEFAULT 0);
CREATE INDEX IF NOT EXISTS reservations_due ON reservations (expired, expires_at);
CREATE TABLE IF NOT EXISTS runs (
    tenant TEXT NOT NULL, run_id TEXT NOT NULL, calls INTEGER NOT NULL DEFAULT 0,
    trace TEXT, first_seen REAL, last_seen REAL, ended INTEGER NOT NULL DEFAULT 0,
    ended_at REAL, sig TEXT, streak INTEGER NOT NULL DEFAULT 0,
    failures INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (tenant, run_id)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS runs_idle ON runs (ended, last_seen);
CREATE INDEX IF NOT EXISTS runs_recent ON runs (last_seen);
CREATE TABLE IF NOT EXISTS run_totals (
    tenant TEXT NOT NULL, run_id TEXT NOT NULL, name TEXT NOT NULL,
    value INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (tenant, run_id, name)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS tools (
    tenant TEXT NOT NULL, run_id TEXT NOT NULL, id TEXT NOT NULL, seq INTEGER NOT NULL,
    call TEXT NOT NULL,
    PRIMARY KEY (tenant, run_id, id)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS mcp_guard (
    tenant TEXT NOT NULL, run_id TEXT NOT NULL, sig TEXT, streak INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (tenant, run_id)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS budgets (tenant TEXT PRIMARY KEY, day INTEGER, month INTEGER);
CREATE TABLE IF NOT EXISTS contexts (
    tenant TEXT NOT NULL, ref TEXT NOT NULL, tokens INTEGER NOT NULL, seen_at REAL NOT NULL,
    PRIMARY KEY (tenant, ref)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS rates (
    tenant TEXT NOT NULL, bucket TEXT NOT NULL, debt INTEGER NOT NULL, last_ms INTEGER NOT NULL,
    PRIMARY KEY (tenant, bucket)) WITHOUT ROWID;
"""
# Columns added after a ledger file may have been created: (table, column, declaration).
_ADDED_COLUMNS = (("reservations", "key_id", "TEXT"), ("reservations", "tokens", "INTEGER NOT NULL DEFAULT 0"),
                  ("runs", "tokens_held", "INTEGER NOT NULL DEFAULT 0"),
                  ("runs", "tokens_expired", "INTEGER NOT NULL DEFAULT 0"),
                  # A run written whole (a run of one call, held in memory by budget leases): its
                  # totals as one JSON object, read with its run_totals rows (`_totals`).
                  ("runs", "totals", "TEXT"))


class SqliteStore(DerivedOps):
    """`Store` over one SQLite file. `path` may be ":memory:" (tests only: not durable)."""

    def __init__(self, path: str, *, synchronous: str = "FULL", lock_patience_s: float = LOCK_PATIENCE_S) -> None:
        # Checked here too because it is interpolated into a PRAGMA.
        if synchronous.upper() not in SYNCHRONOUS:
            raise ValueError(f"synchronous={synchronous!r}: use one of {', '.join(SYNCHRONOUS)}")
        self.path = path
        self._synchronous = synchronous.upper()
        self._patience = lock_patience_s
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._closed = False
        self._lazy = False  # the connection is at synchronous=NORMAL for a lazy batch (writer thread only)
        self.operations = 0  # store operations submitted since start (one transaction step each)
        self.deferred_syncs = 0  # WAL fsyncs made for durable-soon commits no later batch covered
        self._sync_due: float | None = None  # when the durable-soon commits must be fsynced (writer thread only)
        self._thread = threading.Thread(target=self._serve, name="spanmeter-ledger", daemon=True)
        self._thread.start()

    # --- the writer thread -----------------------------------------------------------

    def _connect(self) -> sqlite3.Connection:
        # Two processes opening a new file at once race on the switch to WAL, which does
        # not wait on busy_timeout: "database is locked" then only means "try again".
        for attempt in range(50):
            conn = sqlite3.connect(self.path, isolation_level=None, timeout=30.0, check_same_thread=False,
                                   cached_statements=_STATEMENTS)
            try:
                conn.execute("PRAGMA busy_timeout=30000")
                conn.execute("PRAGMA journal_mode=WAL")
                conn.execute(f"PRAGMA synchronous={self._synchronous}")
                conn.executescript(_SCHEMA)
                _add_columns(conn)
                # From here on a lock held by another process is waited for by _begin's
                # short polls, not by the busy handler's long sleeps.
                conn.execute("PRAGMA busy_timeout=0")
                return conn
            except sqlite3.OperationalError as exc:
                conn.close()
                if "locked" not in str(exc) or attempt == 49:
                    raise
                time.sleep(0.02 * (attempt + 1))
        raise AssertionError("unreachable")

    def _serve(self) -> None:
        conn: sqlite3.Connection | None = None
        failure: Exception | None = None
        try:
            conn = self._connect()
        except (sqlite3.Error, OSError) as exc:
            failure = exc
        stop = False
        while not stop:
            job = self._next_job()
            if job is None:
                break
            batch = [job]
            while len(batch) < _BATCH:
                try:
                    more = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stop = True
                    break
                batch.append(more)
            if conn is None:
                results: list[tuple[bool, Any]] = [(False, failure)] * len(batch)
            else:
                results = self._commit(conn, batch)
            self._deliver(batch, results)
        if self._sync_due is not None:
            self._sync_wal()
        if conn is not None:
            conn.close()

    def _next_job(self) -> _Job | None:
        """The next job; while durable-soon commits wait for an fsync, it is made when due."""
        while self._sync_due is not None:
            wait = self._sync_due - time.monotonic()
            if wait > 0:
                try:
                    return self._jobs.get(timeout=wait)
                except queue.Empty:
                    pass
            self._sync_wal()
        return self._jobs.get()

    def _sync_wal(self) -> None:
        """fsync the WAL file: every commit written to it so far survives a power cut.
        (fsync works on the file, whichever descriptor: SQLite's own commit does the same.)"""
        self._sync_due = None
        try:
            fd = os.open(self.path + "-wal", os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            self.deferred_syncs += 1
        except OSError as exc:
            log.error("could not fsync the ledger's WAL %s-wal (%s): the last settles are durable only once the "
                      "next admission commits", self.path, exc)

    def _commit(self, conn: sqlite3.Connection, batch: list[_Job]) -> list[tuple[bool, Any]]:
        """Run a batch in one transaction, fsynced unless no op in it needs that now (FULL only)."""
        level = min(job[3] for job in batch) if self._synchronous == "FULL" else NOW
        if level == SOON and self.path == ":memory:":
            level = LAZY  # no file to fsync later
        lazy = level != NOW
        if lazy != self._lazy:
            try:  # outside any transaction: SQLite refuses to change it inside one
                conn.execute(f"PRAGMA synchronous={'NORMAL' if lazy else 'FULL'}")
            except sqlite3.Error as exc:
                return [(False, exc)] * len(batch)
            self._lazy = lazy
        changes = conn.total_changes
        results = _run_batch(conn, [job[0] for job in batch], self._patience)
        # SQLite fsyncs (and needs to) only a commit that wrote: a batch of reads, or of an
        # end already made, neither stands for a pending fsync nor calls for one.
        wrote = conn.total_changes != changes
        if not lazy and wrote and all(ok for ok, _ in results):
            self._sync_due = None  # this commit's fsync made every commit before it durable too
        elif level == SOON and wrote and self._sync_due is None:
            self._sync_due = time.monotonic() + SYNC_WITHIN_S
        return results

    def _deliver(self, batch: list[_Job], results: list[tuple[bool, Any]]) -> None:
        """Hand a batch's results back with one wake-up of each waiting event loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future[Any], bool, Any]]] = {}
        for (_, loop, fut, _), (ok, value) in zip(batch, results, strict=True):
            if not ok and isinstance(value, sqlite3.Error | OSError):
                error = StoreUnavailable(_failure_text(self.path, value, self._patience))
                error.__cause__ = value
                value = error
            by_loop.setdefault(loop, []).append((fut, ok, value))
        for loop, done in by_loop.items():
            with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits any more
                loop.call_soon_threadsafe(self._hand_back, done)

    def _hand_back(self, done: list[tuple[asyncio.Future[Any], bool, Any]]) -> None:
        """On the caller's loop: resolve the futures of one batch."""
        for fut, ok, value in done:
            if not fut.done():
                if ok:
                    fut.set_result(value)
                else:
                    fut.set_exception(value)
            elif ok and isinstance(value, Admission):
                # Its caller was cancelled while it committed: nothing was forwarded, so
                # zero is its true cost (rather than expiring at its reserved amount).
                release_soon(self, value)

    async def _do(self, op: Op, *, lazy: bool = False, soon: bool = False) -> Any:
        return await self._submit(op, lazy, soon)

    def _submit(self, op: Op, lazy: bool = False, soon: bool = False) -> asyncio.Future[Any]:
        """Queue `op` for the writer thread; the future resolves on the caller's loop.

        `lazy`: losing this op's commit to a power cut can only over-count spend (see the
        module docstring), so a batch made only of such ops may skip the fsync. `soon`: the
        op's result need not wait for the fsync, which follows within SYNC_WITHIN_S."""
        if self._closed:
            raise StoreUnavailable(f"The ledger {self.path} is closed.")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        self.operations += 1
        self._jobs.put((op, loop, fut, LAZY if lazy else SOON if soon else NOW))
        return fut

    # --- ledger ----------------------------------------------------------------------

    async def admit(self, ask: Ask, turn: Turn = NO_TURN) -> Admission:
        min_reserve, max_reserve = turn.reserve
        if not 0 <= min_reserve <= max_reserve:
            raise ValueError(f"need 0 <= least ({min_reserve}) <= most ({max_reserve}) in Turn.reserve")
        return await self._admit(_admission(ask, turn))

    async def admit_tool(self, ask: Ask, turn: ToolTurn) -> Admission:
        tenant, run_id, limits, now = ask.tenant, ask.run_id, ask.limits, ask.now
        windows = window_keys(now, ask.tz)
        if turn.cost < 0:
            raise ValueError(f"a tool call cannot cost less than nothing (cost={turn.cost})")

        now_ms = epoch_ms(now)

        def op(conn: sqlite3.Connection) -> Admission | Refusal:
            # A row of its own: not an `_Admit`, so it ends a row of model admissions.
            return _admit_row(conn, [_Admit(admitted)])[0]

        def admitted(rows: _Rows) -> Admission | Refusal:
            conn = rows.conn
            ts = now.timestamp()
            budget, run = rows.read_run(tenant, run_id)
            trace = run.keep_trace(turn.trace)
            rows.save_run(tenant, run_id, run, ts)  # the trace is kept whatever follows
            if turn.name is None:
                rates = _rates(conn, tenant, turn.rates, now_ms)
                if any(state.wait_ms != 0 for _, state in rates):
                    return refused_with(rate_refusal(tenant, tuple(s for _, s in rates)), (), trace)
                _draw(conn, tenant, rates, now_ms)
                return Admission("", tenant, run_id, 0, 0, {}, *windows, trace=trace, limits=limits,
                                 rates=tuple(state for _, state in rates), key=turn.key)
            entry = (_take_for_mcp(conn, tenant, run_id, turn),)
            loop = guard_refusal(tenant, run_id, entry, turn.guard)
            if loop is not None:
                return refused_with(loop, entry, trace)
            eff = with_budgets(limits, *budget)
            count = _counter(conn, tenant, run_id, MCP_TOOL_CALLS, run.whole)
            if turn.max_calls is not None and count >= turn.max_calls:
                return refused_with(tool_ceiling(tenant, run_id, turn.max_calls), entry, trace)
            started = run.first_seen if run.first_seen is not None else ts
            elapsed = ts - started if eff.run_max_seconds is not None else 0.0
            keys = ledger_keys(run_id, windows, turn.key)
            ledger = rows.spends(tenant, keys)
            found = Standing(eff, ledger, (turn.cost, turn.cost), elapsed_s=elapsed)
            # A tool call spends no model tokens and is no model call: those ceilings are the model route's.
            d = decide(replace(found, limits=replace(eff, run_max_calls=None, run_max_tokens=None)))
            if d.refused:
                return refused_with(refusal(d, ask, found, turn.key), entry, trace)
            rates = _rates(conn, tenant, turn.rates, now_ms)
            if any(state.wait_ms != 0 for _, state in rates):
                return refused_with(rate_refusal(tenant, tuple(s for _, s in rates)), entry, trace)
            _draw(conn, tenant, rates, now_ms)
            rows.add(tenant, [(scope, key, 0, d.amount) for scope, key in (*keys.values(), ("total", ""))])
            _run_add(conn, tenant, run_id, [(MCP_TOOL_CALLS, 1), ("tool_calls", 0 if "id" in entry[0] else 1)])
            run.last_seen, run.changed = ts, True
            rows.save_run(tenant, run_id, run, ts)
            rid = secrets.token_hex(16)
            rows.reserve((rid, tenant, run_id, *windows, d.amount, ts + ask.ttl_s, turn.key, 0))
            return Admission(rid, tenant, run_id, d.amount, count + 1, d.remaining, *windows, closed=entry,
                             trace=trace, limits=eff, started_at=started if eff.run_max_seconds is not None else None,
                             rates=tuple(state for _, state in rates), key=turn.key)

        return await self._admit(op)

    async def _admit(self, op: Op) -> Admission:
        """Run an admission op; a refusal comes back as a value (its transaction commits the
        tool calls it closed) and is raised here."""
        # A caller cancelled while the admission commits cancels this future; the
        # admission is then released when it lands (`_hand_back`), never leaked.
        result = await self._submit(op)
        if isinstance(result, Refusal):
            raise result
        assert isinstance(result, Admission)
        return result

    async def settle(
        self,
        admission: Admission,
        actual: int,
        *,
        run_totals: dict[str, int] | None = None,
        tools: list[dict[str, Any]] | None = None,
        contexts: dict[str, int] | None = None,
    ) -> int:
        done = await self.settle_in_order(admission, actual, run_totals=run_totals, tools=tools, contexts=contexts)
        return await done

    def queues_settle(self, admission: Admission) -> bool:
        return True  # onto the one writer thread's queue

    async def settle_in_order(
        self,
        admission: Admission,
        actual: int,
        *,
        run_totals: dict[str, int] | None = None,
        tools: list[dict[str, Any]] | None = None,
        contexts: dict[str, int] | None = None,
    ) -> Awaitable[int]:
        # Ordered once queued: the one writer thread runs jobs in the order they were put,
        # within a batch too, so any operation submitted after this one sees its writes.
        if actual < 0:
            raise ValueError(f"a call cannot cost less than nothing (actual={actual})")
        totals = [(name, int(v)) for name, v in (run_totals or {}).items()]
        seen = [(ref, int(tokens)) for ref, tokens in (contexts or {}).items()]
        encoded = _encode_tools(tools or [])  # on the caller's side: a bad call fails here, not in a batch
        op = _Settle(admission.id, actual, totals, encoded, seen)
        lazy = _lazy_settle(admission, actual, totals, encoded, seen)
        # Lazy but for its open tool calls: those are durable soon, not before the hand-back.
        # The run's next call reads them, and its admission's fsync comes before it is forwarded.
        soon = not lazy and bool(encoded) and _lazy_settle(admission, actual, totals, [], seen)
        return self._submit(op, lazy, soon)

    async def expire(self, now: datetime) -> int:
        ts = now.timestamp()
        result: int = await self._do(lambda conn: _expire(conn, ts))
        return result

    async def spend_detail(
        self,
        tenant: str,
        *,
        run_id: str | None = None,
        day: str | None = None,
        month: str | None = None,
        key_id: str | None = None,
    ) -> Spend:
        scope, key = scope_of(run_id, day, month, key_id)
        result: Spend = await self._do(lambda conn: _spend(conn, tenant, scope, key))
        return result

    async def run_calls(self, tenant: str, run_id: str) -> int:
        sql = "SELECT calls FROM runs WHERE tenant=? AND run_id=?"
        return int(await self._do(lambda conn: _one(conn, sql, tenant, run_id) or 0))

    # --- run state -------------------------------------------------------------------

    async def run_add(self, tenant: str, run_id: str, deltas: dict[str, int], *, soon: bool = False) -> None:
        totals = [(name, int(v)) for name, v in deltas.items()]
        await self._do(lambda conn: _run_add(conn, tenant, run_id, totals), soon=soon)

    async def run_totals(self, tenant: str, run_id: str) -> dict[str, int]:
        result: dict[str, int] = await self._do(lambda conn: _totals(conn, tenant, run_id))
        return result

    async def run_end(self, tenant: str, run_id: str) -> dict[str, Any] | None:
        def op(conn: sqlite3.Connection) -> dict[str, Any] | None:
            cur = conn.execute(
                "UPDATE runs SET ended = 1 WHERE tenant=? AND run_id=? AND ended = 0",
                (tenant, run_id),
            )
            if cur.rowcount == 0:
                return None  # unknown, or another caller ended it first
            return _record(conn, tenant, run_id)

        # Durable soon (module docstring): a run without X-Run-Id ends with its one call, and
        # its end's fsync would hold up the caller's next admission queued behind it.
        result: dict[str, Any] | None = await self._do(op, soon=True)
        return result

    async def idle_runs(self, before: datetime) -> list[tuple[str, str]]:
        ts = before.timestamp()
        rows = await self._do(
            lambda conn: conn.execute(
                "SELECT tenant, run_id FROM runs WHERE ended = 0 AND last_seen < ? ORDER BY last_seen",
                (ts,),
            ).fetchall()
        )
        return [(t, r) for t, r in rows]

    async def run_guard(self, tenant: str, run_id: str, state: tuple[str | None, int, int]) -> None:
        sql = "UPDATE runs SET sig = ?, streak = ?, failures = ? WHERE tenant=? AND run_id=?"
        await self._do(lambda conn: conn.execute(sql, (*state, tenant, run_id)))

    async def runs_record(self, runs: Sequence[WholeRun]) -> None:
        spent: dict[tuple[str, str, str], list[int]] = {}
        summed: dict[tuple[str, str], dict[str, int]] = {}
        for r in runs:
            spent.setdefault((r.tenant, "run", r.run_id), [0, 0])[0] += int(r.settled)
            into = summed.setdefault((r.tenant, r.run_id), {})
            for name, value in r.totals.items():
                into[name] = into.get(name, 0) + int(value)

        def op(conn: sqlite3.Connection) -> None:
            # A run the store does not hold yet gets its totals in its row, one JSON object:
            # as run_totals rows (~10 a run of one call) they were 60% of the ledger thread's
            # CPU at 64 connections of calls without a run id (bench/bench_percall.py
            # --run-calls 0). A run it holds has them added to its rows.
            held, unwritten = _held_runs(conn, list(summed)), dict(summed)  # an op may run again
            rows: list[tuple[Any, ...]] = []
            added: dict[tuple[str, str, str], int] = {}
            for r in runs:
                run = (r.tenant, r.run_id)
                totals = unwritten.pop(run, None)  # a run named twice in a batch: its totals once
                blob = None
                if totals and run not in held:
                    blob = _dumps(totals)
                elif totals:
                    added |= {(*run, name): value for name, value in totals.items()}
                held.add(run)  # its second row in the batch finds the first
                rows.append((r.tenant, r.run_id, r.calls, _dumps(r.trace) if r.trace else None, r.first_seen,
                             r.last_seen, 0 if r.ended_at is None else 1, r.ended_at, blob))
            conn.executemany(_RECORD_RUN, rows)
            _add(conn, spent)
            _add_totals(conn, added)

        # Durable soon: the money these runs spent is already counted on the tenant's scopes
        # (their lease's reservation, then its settle); a power cut loses only their rows.
        await self._do(op, soon=True)

    async def sweep_turn(self, every_s: float) -> bool:
        return True  # one machine: every worker's sweep is cheap and run ends are first-caller-only

    async def list_runs(self, tenant: str | None, limit: int = 50) -> list[dict[str, Any]]:
        def op(conn: sqlite3.Connection) -> list[dict[str, Any]]:
            if tenant is None:
                rows = conn.execute("SELECT tenant, run_id FROM runs ORDER BY last_seen DESC LIMIT ?", (limit,))
            else:
                rows = conn.execute(
                    "SELECT tenant, run_id FROM runs WHERE tenant=? ORDER BY last_seen DESC LIMIT ?",
                    (tenant, limit),
                )
            return [r for t, run in rows.fetchall() if (r := _record(conn, t, run)) is not None]

        result: list[dict[str, Any]] = await self._do(op)
        return result

    # --- tool calls ------------------------------------------------------------------

    async def tools_put(self, tenant: str, run_id: str, calls: list[dict[str, Any]]) -> None:
        encoded = _encode_tools(calls)
        await self._do(lambda conn: _tools_put(conn, tenant, run_id, encoded))

    async def tools_take(self, tenant: str, run_id: str, ids: list[str]) -> list[dict[str, Any]]:
        def op(conn: sqlite3.Connection) -> list[dict[str, Any]]:
            taken = []
            for call_id in dict.fromkeys(ids):
                row = conn.execute(
                    "DELETE FROM tools WHERE tenant=? AND run_id=? AND id=? RETURNING call",
                    (tenant, run_id, call_id),
                ).fetchone()
                if row is not None:
                    taken.append(json.loads(row[0]))
            return taken

        result: list[dict[str, Any]] = await self._do(op)
        return result

    async def tools_pending(self, tenant: str, run_id: str) -> list[dict[str, Any]]:
        rows = await self._do(
            lambda conn: conn.execute(
                "SELECT call FROM tools WHERE tenant=? AND run_id=? ORDER BY seq", (tenant, run_id)
            ).fetchall()
        )
        return [json.loads(r[0]) for r in rows]

    # --- admin -----------------------------------------------------------------------

    async def budget_set(self, tenant: str, day: int | None, month: int | None) -> None:
        await self._do(
            lambda conn: conn.execute(
                "INSERT INTO budgets (tenant, day, month) VALUES (?,?,?) "
                "ON CONFLICT DO UPDATE SET day = excluded.day, month = excluded.month",
                (tenant, day, month),
            )
        )

    async def budget_get(self, tenant: str) -> tuple[int | None, int | None]:
        row = await self._do(
            lambda conn: conn.execute("SELECT day, month FROM budgets WHERE tenant=?", (tenant,)).fetchone()
        )
        return (row[0], row[1]) if row else (None, None)

    async def ping(self) -> None:
        await self._do(lambda conn: conn.execute("SELECT 1").fetchone())

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._jobs.put(None)
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join)


# --- helpers run on the writer thread ---------------------------------------------------


def _run_batch(conn: sqlite3.Connection, ops: list[Op], patience_s: float = LOCK_PATIENCE_S) -> list[tuple[bool, Any]]:
    """Run `ops` in one transaction, each atomic: an op that raises leaves no write behind
    and does not take its batch-mates down.

    Ops almost never raise (arguments are checked before they are queued), so the batch
    first runs without a SAVEPOINT per op (two statements per op saved). If one raises,
    the whole transaction is rolled back, nothing of it committed or handed back, and the
    batch runs again with each op in its own SAVEPOINT. This is sound because an op is a
    function of the database only (no effect outside it, results handed back only after
    the commit), so running it a second time on the same state is as if it ran once."""
    try:
        _begin(conn, patience_s)
        try:
            results: list[tuple[bool, Any]] = [(True, result) for result in _run_ops(conn, ops)]
        except Exception:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            _begin(conn, patience_s)
            results = [_in_savepoint(conn, op) for op in ops]
        conn.execute("COMMIT")
    except sqlite3.Error as exc:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        return [(False, exc)] * len(ops)
    return results


def _admission(ask: Ask, turn: Turn) -> _Admit:
    """A model call's admission, as an op of a row of admissions (`_admit_row`)."""
    tenant, run_id, limits, now = ask.tenant, ask.run_id, ask.limits, ask.now
    windows = window_keys(now, ask.tz)
    min_reserve, max_reserve = turn.reserve
    now_ms = epoch_ms(now)

    def op(rows: _Rows) -> Admission | Refusal:
        conn = rows.conn
        ts = now.timestamp()
        # Reservations past their ttl are charged by the sweeper's `expire` (every 15 s
        # in the proxy), as on Redis: expiry moves reserved to settled and changes no
        # headroom, so an admission need not pass over them itself.
        budget, run = rows.read_run(tenant, run_id)
        # Everything the request settles about the run happens even if the call is
        # then refused: the tool results did arrive.
        closed = _close_tools(conn, tenant, run_id, turn.results, run)
        trace = run.keep_trace(turn.trace)

        def refused(error: Refusal) -> Refusal:
            rows.save_run(tenant, run_id, run, ts)
            return refused_with(error, closed, trace)

        loop = guard_refusal(tenant, run_id, closed, turn.guard)
        if loop is not None:
            return refused(loop)
        eff = with_budgets(limits, *budget)
        if not turn.priced and costed(eff):
            return refused(unpriced_refusal(tenant, turn.model, turn.price_hint))
        known, unknown = _contexts(conn, tenant, turn.context)
        if unknown and costed(eff):
            return refused(context_refusal(tenant, unknown, eff))
        extra = context_micros(known, turn.input_rate)
        lo, hi = min_reserve + extra, max_reserve + extra
        calls, first_seen = run.calls, run.first_seen
        run_tokens = (_run_tokens(conn, tenant, run_id, run.whole) + run.tokens_expired
                      if eff.run_max_tokens is not None else 0)
        started = (first_seen if first_seen is not None else ts) if eff.run_max_seconds is not None else None
        elapsed = ts - started if started is not None else 0.0
        keys = ledger_keys(run_id, windows, turn.key)
        ledger = rows.spends(tenant, keys)
        tokens = (turn.tokens[0] + known, turn.tokens[1] + known)
        found = Standing(eff, ledger, (lo, hi), calls=calls, run_tokens=run_tokens, tokens=tokens,
                         tokens_held=run.tokens_held, elapsed_s=elapsed, count=turn.count)
        d = decide(found)
        if d.refused:
            return refused(refusal(d, ask, found, turn.key))
        rates = _rates(conn, tenant, turn.rates, now_ms)
        if any(state.wait_ms != 0 for _, state in rates):
            return refused(rate_refusal(tenant, tuple(state for _, state in rates)))
        _draw(conn, tenant, rates, now_ms)
        rows.add(tenant, [(scope, key, 0, d.amount) for scope, key in (*keys.values(), ("total", ""))])
        run.count(ts, turn.count)
        run.tokens_held += d.tokens
        rows.save_run(tenant, run_id, run, ts)
        rid = secrets.token_hex(16)
        rows.reserve((rid, tenant, run_id, *windows, d.amount, ts + ask.ttl_s, turn.key, d.tokens))
        return Admission(rid, tenant, run_id, d.amount, calls + turn.count, d.remaining, *windows,
                         closed=closed, trace=trace, context_tokens=known, limits=eff,
                         run_tokens=run_tokens, started_at=started,
                         rates=tuple(state for _, state in rates), key=turn.key, tokens=d.tokens)

    return _Admit(op)


class _Admit:
    """A model call's admission as an op (`__call__`), and as one of a row of admissions."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[_Rows], Admission | Refusal]) -> None:
        self.fn = fn

    def __call__(self, conn: sqlite3.Connection) -> Admission | Refusal:
        return _admit_row(conn, [self])[0]


def _admit_row(conn: sqlite3.Connection, row: list[_Admit]) -> list[Admission | Refusal]:
    """Admit each of `row` in turn, the ledger and run rows they read and write kept between
    them and written once at the end (`_Rows`): what one admission wrote, the next one reads
    from there, as it would read it from the file."""
    rows = _Rows(conn)
    out = [op.fn(rows) for op in row]
    rows.flush()
    return out


class _Rows:
    """The ledger's spends and the runs a row of admissions reads and writes, and the
    reservations it makes. Read from the file once, kept up to date here as the admissions
    write them, and written at the row's end, one statement a table (`flush`; the
    reservations in inserts of power-of-two lengths): at 64
    connections an admission's five statements cost the ledger thread 15-20 us each, and
    the admissions of a batch come in rows that share the tenant's day and month rows and
    their runs'. Every other table an admission touches (tool calls, rates, contexts, run
    totals) is read and written at once, on `conn`."""

    __slots__ = ("added", "budgets", "conn", "reservations", "runs", "saved", "spent")

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn
        self.budgets: dict[str, tuple[int | None, int | None]] = {}
        self.runs: dict[tuple[str, str], tuple[Any, ...] | None] = {}  # a run's columns as `_Run` reads them
        self.spent: dict[tuple[str, str, str], Spend] = {}  # (tenant, scope, key): as it stands now, once read
        self.added: dict[tuple[str, str, str], list[int]] = {}  # (settled, reserved) to add at the end
        self.saved: dict[tuple[str, str], tuple[Any, ...]] = {}  # the runs' rows to write at the end
        self.reservations: list[tuple[Any, ...]] = []

    def read_run(self, tenant: str, run_id: str) -> tuple[tuple[int | None, int | None], _Run]:
        """(the tenant's admin budgets (day, month), the run), in one statement the first time."""
        key = (tenant, run_id)
        if key not in self.runs:  # else read (and its tenant's budgets with it) or saved in this row
            row = self.conn.execute(_READ_RUN, key).fetchone()
            self.budgets[tenant] = (row[0], row[1])
            self.runs[key] = row[2:] if row[2] is not None else None
        return self.budgets[tenant], _Run(self.runs[key])

    def save_run(self, tenant: str, run_id: str, run: _Run, ts: float) -> None:
        """Keep the run's row, if the op changed it; a new run starts at `ts`."""
        if not run.changed:
            return
        first_seen = run.first_seen if run.first_seen is not None else ts
        last_seen = run.last_seen if run.last_seen is not None else ts
        key = (tenant, run_id)
        self.saved[key] = (tenant, run_id, run.calls, first_seen, last_seen, run.trace, run.sig, run.streak,
                           run.failures, run.tokens_held)
        self.runs[key] = (run.calls, first_seen, last_seen, run.trace, run.sig, run.streak, run.failures,
                          run.tokens_held, run.tokens_expired, run.whole)
        run.first_seen, run.last_seen, run.changed = first_seen, last_seen, False

    def spends(self, tenant: str, keys: dict[str, tuple[str, str]]) -> dict[str, Spend]:
        """The spend of each scope of `keys` (scope -> (ledger scope, key)); what is not known
        yet read in one statement, with what this row added to it."""
        missing = {s: k for s, k in keys.items() if (tenant, *k) not in self.spent}
        if missing:
            for s, spend in _spends(self.conn, tenant, missing).items():
                at = (tenant, *missing[s])
                more = self.added.get(at)
                self.spent[at] = spend if more is None else Spend(spend.settled + more[0], spend.reserved + more[1])
        return {s: self.spent[(tenant, *k)] for s, k in keys.items()}

    def add(self, tenant: str, rows: list[tuple[str, str, int, int]]) -> None:
        """Add (settled, reserved) to each (scope, key) of `rows`."""
        for scope, key, settled, reserved in rows:
            at = (tenant, scope, key)
            more = self.added.get(at)
            if more is None:
                self.added[at] = [settled, reserved]
            else:
                more[0] += settled
                more[1] += reserved
            now = self.spent.get(at)
            if now is not None:
                self.spent[at] = Spend(now.settled + settled, now.reserved + reserved)

    def reserve(self, values: tuple[Any, ...]) -> None:
        """(id, tenant, run_id, day, month, amount, expires_at, key_id, tokens) of a reservation."""
        self.reservations.append(values)

    def flush(self) -> None:
        conn = self.conn
        _add(conn, self.added)
        if self.saved:
            rows = list(self.saved.values())  # a copy repeats a row: the same values written again
            conn.execute(_sql(_save_runs_sql, _padded(len(rows))), [v for r in _pad(rows) for v in r])
        made = self.reservations
        while made:  # in lengths that are powers of two: an id is never written twice
            n = 1 << (len(made).bit_length() - 1)
            conn.execute(_sql(_reserve_sql, n), [v for r in made[:n] for v in r])
            made = made[n:]


_RECORD_RUN = (
    "INSERT INTO runs (tenant, run_id, calls, trace, first_seen, last_seen, ended, ended_at, totals) "
    "VALUES (?,?,?,?,?,?,?,?,?) ON CONFLICT DO UPDATE SET calls = calls + excluded.calls, "
    "trace = COALESCE(trace, excluded.trace), first_seen = MIN(COALESCE(first_seen, excluded.first_seen), "
    "excluded.first_seen), last_seen = MAX(COALESCE(last_seen, excluded.last_seen), excluded.last_seen), "
    "ended = MAX(ended, excluded.ended), ended_at = COALESCE(ended_at, excluded.ended_at)")

_READ_RUN = ("SELECT b.day, b.month, r.calls, r.first_seen, r.last_seen, r.trace, r.sig, r.streak, r.failures, "
             "r.tokens_held, r.tokens_expired, r.totals "
             "FROM (SELECT 1) LEFT JOIN budgets b ON b.tenant = ?1 "
             "LEFT JOIN runs r ON r.tenant = ?1 AND r.run_id = ?2")


def _save_runs_sql(n: int) -> str:
    return ("INSERT INTO runs (tenant, run_id, calls, first_seen, last_seen, trace, sig, streak, failures, "
            "tokens_held) VALUES " + ",".join(["(?,?,?,?,?,?,?,?,?,?)"] * n)
            + " ON CONFLICT DO UPDATE SET calls = excluded.calls, first_seen = excluded.first_seen, "
              "last_seen = excluded.last_seen, trace = excluded.trace, sig = excluded.sig, "
              "streak = excluded.streak, failures = excluded.failures, tokens_held = excluded.tokens_held")


def _reserve_sql(n: int) -> str:
    return ("INSERT INTO reservations (id, tenant, run_id, day_key, month_key, amount, expires_at, key_id, tokens) "
            "VALUES " + ",".join(["(?,?,?,?,?,?,?,?,?)"] * n))


def _run_ops(conn: sqlite3.Connection, ops: list[Op]) -> list[Any]:
    """Each op's result, in order. Consecutive settles run as one row (`_settle_row`): a
    settle reads nothing but its own reservation, so nothing between two of them could
    have seen the state in between, and what they add up to is the same in any order.
    Consecutive admissions run as one row too (`_admit_row`), each reading what the ones
    before it wrote."""
    out: list[Any] = []
    i, n = 0, len(ops)
    while i < n:
        kind = type(ops[i])
        if kind is not _Settle and kind is not _Admit:
            out.append(ops[i](conn))
            i += 1
            continue
        j = i + 1
        while j < n and type(ops[j]) is kind:
            j += 1
        row: Any = ops[i:j]  # all of `kind`, by the loop above
        out += _settle_row(conn, row) if kind is _Settle else _admit_row(conn, row)
        i = j
    return out


class _Settle:
    """One settle as an op: the real cost of a reservation, and what the call adds to its run."""

    __slots__ = ("actual", "encoded", "rid", "seen", "totals")

    def __init__(self, rid: str, actual: int, totals: list[tuple[str, int]], encoded: list[tuple[str, str]],
                 seen: list[tuple[str, int]]) -> None:
        self.rid, self.actual, self.totals, self.encoded, self.seen = rid, actual, totals, encoded, seen

    def __call__(self, conn: sqlite3.Connection) -> int:
        return _settle_row(conn, [self])[0]


def _settle_row(conn: sqlite3.Connection, row: list[_Settle]) -> list[int]:
    """Settle each of `row` as if one after the other, in three statements for all of them
    (the reservations taken, the ledger rows and the run totals added to: one statement
    each, where each settle alone made three; at 64 connections a batch holds rows of ~15):
    each settle's overshoot (its cost past its reservation), 0 for a reservation settled
    before (idempotent: the run totals and tool calls of the first settle are not added
    again either)."""
    taken = conn.execute(_sql(_take_sql, _padded(len(row))), _pad([s.rid for s in row])).fetchall()
    held = {r[0]: r[1:] for r in taken}
    adds: dict[tuple[str, str, str], list[int]] = {}
    totals: dict[tuple[str, str, str], int] = {}
    out = []
    for s in row:
        found = held.pop(s.rid, None)  # a second settle of one reservation finds it taken
        if found is None:
            out.append(0)
            continue
        tenant, run_id, day, month, amount, expired, key_id, tokens = found
        if tokens:  # the real count arrives in the run totals; expiry had charged the held tokens
            column = "tokens_expired" if expired else "tokens_held"
            conn.execute(f"UPDATE runs SET {column} = {column} - ? WHERE tenant=? AND run_id=?",
                         (tokens, tenant, run_id))
        # An expired reservation was charged at `amount` already: correct it to the real cost.
        settled, reserved = (s.actual - amount, 0) if expired else (s.actual, -amount)
        for scope, key in _reserved_on(run_id, day, month, key_id):
            acc = adds.setdefault((tenant, scope, key), [0, 0])
            acc[0] += settled
            acc[1] += reserved
        for name, n in s.totals:
            totals[tenant, run_id, name] = totals.get((tenant, run_id, name), 0) + n
        _tools_put(conn, tenant, run_id, s.encoded)
        if s.seen:
            _remember(conn, tenant, s.seen, time.time())
        out.append(max(0, s.actual - int(amount)))
    _add(conn, adds)
    _add_totals(conn, totals)
    return out


def _take_sql(n: int) -> str:
    return ("DELETE FROM reservations WHERE id IN (" + ",".join(["?"] * n) + ") "
            "RETURNING id, tenant, run_id, day_key, month_key, amount, expired, key_id, tokens")


def _padded(n: int) -> int:
    """n rounded up to a power of two: a row's statements come in few lengths, each prepared
    once and kept (`_sql`, and sqlite3's statement cache)."""
    return 1 << (n - 1).bit_length()


def _pad(items: list[Any], zero: tuple[int, ...] = ()) -> list[Any]:
    """`items` made `_padded` long with copies of the last: an id taken twice in an IN list
    is taken once; a row added twice in one upsert adds nothing more when its amounts are
    `zero`d (SQLite applies the ON CONFLICT update to a row the same statement inserted)."""
    extra = _padded(len(items)) - len(items)
    if not extra:
        return items
    last = items[-1]
    filler = (*last[: len(last) - len(zero)], *zero) if zero else last
    return items + [filler] * extra


def _failure_text(path: str, exc: sqlite3.Error | OSError, patience_s: float) -> str:
    if isinstance(exc, sqlite3.OperationalError) and exc.sqlite_errorcode & 0xFF == sqlite3.SQLITE_BUSY:
        return (f"The ledger {path} stayed locked by another connection for {patience_s:g} s ({exc}). "
                "Another process holds a write transaction on it: look for a stuck process using the file "
                "(a sibling spanmeter or a tool such as the sqlite3 shell left inside BEGIN).")
    return f"The ledger {path} failed: {exc}. Check the disk and its permissions."


def _begin(conn: sqlite3.Connection, patience_s: float) -> None:
    """BEGIN IMMEDIATE: take the write lock, waiting up to `patience_s` for another
    process (or store) that holds it."""
    deadline = time.monotonic() + patience_s
    pause = _FIRST_PAUSE_S
    while True:
        try:
            conn.execute("BEGIN IMMEDIATE")
            return
        except sqlite3.OperationalError as exc:
            if exc.sqlite_errorcode & 0xFF != sqlite3.SQLITE_BUSY or time.monotonic() >= deadline:
                raise
        time.sleep(pause)
        pause = min(pause * 2, _LAST_PAUSE_S)


def _in_savepoint(conn: sqlite3.Connection, op: Op) -> tuple[bool, Any]:
    conn.execute("SAVEPOINT op")
    try:
        result = op(conn)
    except Exception as exc:
        conn.execute("ROLLBACK TO op")
        conn.execute("RELEASE op")
        return False, exc
    conn.execute("RELEASE op")
    return True, result


def _add_columns(conn: sqlite3.Connection) -> None:
    """Bring a ledger file made by an older spanmeter up to the current schema."""
    for table, column, decl in _ADDED_COLUMNS:
        have = {r[1] for r in conn.execute(f"PRAGMA table_info({table})")}
        if column not in have:
            try:
                conn.execute(f"ALTER TABLE {table} ADD COLUMN {column} {decl}")
            except sqlite3.OperationalError as exc:  # another process added it first
                if "duplicate column" not in str(exc):
                    raise


def _reserved_on(run_id: str, day: str, month: str, key_id: str | None) -> list[tuple[str, str]]:
    """(ledger scope, key) of every row a reservation holds money on."""
    rows = [("run", run_id), ("day", day), ("month", month), ("total", "")]
    if key_id is not None:
        rows += [("keyday", f"{key_id}/{day}"), ("keymonth", f"{key_id}/{month}")]
    return rows


def _run_tokens(conn: sqlite3.Connection, tenant: str, run_id: str, whole: str | None) -> int:
    """The tokens a run's totals count (`whole`: what its row keeps, as `_Run` read it)."""
    rows = int(_one(conn, "SELECT COALESCE(SUM(value), 0) FROM run_totals WHERE tenant=? AND run_id=? "
                          "AND name IN ('input_tokens', 'output_tokens', 'estimated_tokens')", tenant, run_id))
    kept = json.loads(whole) if whole else {}
    return rows + int(sum(kept.get(name, 0) for name in _TOKEN_TOTALS))


def _counter(conn: sqlite3.Connection, tenant: str, run_id: str, name: str, whole: str | None) -> int:
    """One of a run's totals: its run_totals row and what its row keeps (`whole`, as `_Run` read it)."""
    row = int(_one(conn, "SELECT value FROM run_totals WHERE tenant=? AND run_id=? AND name=?",
                   tenant, run_id, name) or 0)
    return row + int((json.loads(whole) if whole else {}).get(name, 0))


def _whole_totals(conn: sqlite3.Connection, tenant: str, run_id: str) -> dict[str, int]:
    """The totals a run written whole keeps in its row (`runs_record`); {} for any other."""
    blob = _one(conn, "SELECT totals FROM runs WHERE tenant=? AND run_id=?", tenant, run_id)
    return dict(json.loads(blob)) if blob else {}


def _held_runs(conn: sqlite3.Connection, runs: list[tuple[str, str]]) -> set[tuple[str, str]]:
    """Which of `runs` ((tenant, run id)) the store has a row of. By tenant: `tenant = ? AND
    run_id IN (...)` searches the primary key, where `(tenant, run_id) IN (VALUES ...)`
    scans the whole table (SQLite 3.40's plan)."""
    by_tenant: dict[str, list[str]] = {}
    for tenant, run_id in runs:
        by_tenant.setdefault(tenant, []).append(run_id)
    held: set[tuple[str, str]] = set()
    for tenant, ids in by_tenant.items():
        for i in range(0, len(ids), 500):  # well under SQLite's variable limit
            part = ids[i:i + 500]
            marks = ",".join(["?"] * len(part))
            sql = f"SELECT tenant, run_id FROM runs WHERE tenant=? AND run_id IN ({marks})"
            held.update(conn.execute(sql, [tenant, *part]).fetchall())
    return held


def _rates(conn: sqlite3.Connection, tenant: str, rates: tuple[Rate, ...], now_ms: int,
           ) -> list[tuple[int, RateState]]:
    """(debt with this call counted, state) of each rate bucket the call draws on."""
    out = []
    for rate in rates:
        row = conn.execute("SELECT debt, last_ms FROM rates WHERE tenant=? AND bucket=?",
                           (tenant, rate.bucket)).fetchone()
        out.append(rate_step(int(row[0]), int(row[1]), now_ms, rate) if row else rate_step(0, now_ms, now_ms, rate))
    return out


def _draw(conn: sqlite3.Connection, tenant: str, rates: list[tuple[int, RateState]], now_ms: int) -> None:
    """Keep each bucket's debt with this call counted."""
    for debt, state in rates:
        conn.execute("INSERT INTO rates (tenant, bucket, debt, last_ms) VALUES (?,?,?,?) "
                     "ON CONFLICT DO UPDATE SET debt = excluded.debt, last_ms = MAX(last_ms, excluded.last_ms)",
                     (tenant, state.rate.bucket, debt, now_ms))


def _one(conn: sqlite3.Connection, sql: str, *args: Any) -> Any:
    row = conn.execute(sql, args).fetchone()
    return row[0] if row else None


def _spend(conn: sqlite3.Connection, tenant: str, scope: str, key: str) -> Spend:
    row = conn.execute(
        "SELECT settled, reserved FROM ledger WHERE tenant=? AND scope=? AND key=?",
        (tenant, scope, key),
    ).fetchone()
    return Spend(int(row[0]), int(row[1])) if row else Spend()


def _spends(conn: sqlite3.Connection, tenant: str, keys: dict[str, tuple[str, str]]) -> dict[str, Spend]:
    """The spend of each scope of `keys` (scope -> (ledger scope, key)), read in one statement."""
    rows = conn.execute(_sql(_spends_sql, len(keys)), [v for k in keys.values() for v in (tenant, *k)]).fetchall()
    found = {(scope, key): Spend(int(settled), int(reserved)) for scope, key, settled, reserved in rows}
    return {s: found.get(k, Spend()) for s, k in keys.items()}


def _spends_sql(n: int) -> str:
    # A UNION ALL of primary-key lookups: `(scope, key) IN (...)` would scan all the
    # tenant's ledger rows (one per run) instead.
    one = "SELECT scope, key, settled, reserved FROM ledger WHERE tenant=? AND scope=? AND key=?"
    return " UNION ALL ".join([one] * n)


def _add(conn: sqlite3.Connection, added: Mapping[tuple[str, str, str], Sequence[int]]) -> None:
    """Add (settled, reserved) to each (tenant, scope, key) of `added`, in one statement
    of a `_padded` length."""
    if added:
        rows = [(*k, *v) for k, v in added.items()]
        conn.execute(_sql(_add_sql, _padded(len(rows))), [v for r in _pad(rows, zero=(0, 0)) for v in r])


def _add_sql(n: int) -> str:
    return ("INSERT INTO ledger (tenant, scope, key, settled, reserved) VALUES "
            + ",".join(["(?,?,?,?,?)"] * n)
            + " ON CONFLICT DO UPDATE SET settled = settled + excluded.settled, "
              "reserved = reserved + excluded.reserved")


_SQL: dict[tuple[Callable[[int], str], int], str] = {}


def _sql(make: Callable[[int], str], n: int) -> str:
    """The statement `make` writes for n rows, built once (the text is the key of
    sqlite3's prepared-statement cache, so it must not be rebuilt differently)."""
    sql = _SQL.get((make, n))
    if sql is None:
        sql = _SQL[make, n] = make(n)
    return sql


def _expire(conn: sqlite3.Connection, now_ts: float) -> int:
    """Charge reservations past their ttl at their reserved amount (unknown is not zero),
    and forget what no settle can correct any more."""
    rows = conn.execute(
        "SELECT id, tenant, run_id, day_key, month_key, amount, key_id, tokens FROM reservations "
        "WHERE expired = 0 AND expires_at <= ? ORDER BY expires_at",
        (now_ts,),
    ).fetchall()
    for rid, tenant, run_id, day, month, amount, key_id, tokens in rows:
        _add(conn, {(tenant, scope, key): (amount, -amount) for scope, key in _reserved_on(run_id, day, month, key_id)})
        if tokens:  # charged at the tokens it held, as at its money
            conn.execute("UPDATE runs SET tokens_held = tokens_held - ?1, tokens_expired = tokens_expired + ?1 "
                         "WHERE tenant=?2 AND run_id=?3", (tokens, tenant, run_id))
        conn.execute("UPDATE reservations SET expired = 1 WHERE id=?", (rid,))
    conn.execute("DELETE FROM reservations WHERE expired = 1 AND expires_at < ?", (now_ts - _EXPIRED_KEPT_S,))
    conn.execute("DELETE FROM contexts WHERE seen_at < ?", (now_ts - CONTEXT_KEPT_S,))
    return len(rows)


class _Run:
    """A run's row as one operation reads it, changes it, and writes it back once
    (`_Rows.save_run`): the op holds the write lock throughout, so nothing changes it between."""

    __slots__ = ("calls", "changed", "failures", "first_seen", "last_seen", "sig", "streak", "tokens_expired",
                 "tokens_held", "trace", "whole")

    def __init__(self, row: tuple[Any, ...] | None) -> None:
        calls, self.first_seen, self.last_seen, self.trace, self.sig, streak, failures, held, expired, self.whole = (
            row or (0, *[None] * 9))  # whole: the totals of a run written whole (`runs_record`), as JSON
        self.calls, self.streak, self.failures = int(calls or 0), int(streak or 0), int(failures or 0)
        self.tokens_held, self.tokens_expired = int(held or 0), int(expired or 0)
        self.changed = False

    def keep_trace(self, trace: dict[str, Any] | None) -> dict[str, Any] | None:
        """The run's trace ids: the first ones stored win, so every replica uses the same."""
        if trace is None:
            return None
        if self.trace:
            return dict(json.loads(self.trace))
        self.trace, self.changed = _dumps(trace), True
        return trace

    def count(self, ts: float, n: int = 1) -> None:
        self.calls, self.last_seen, self.changed = self.calls + n, ts, True


def _close_tools(conn: sqlite3.Connection, tenant: str, run_id: str,
                 results: tuple[tuple[str, bool], ...], run: _Run) -> tuple[dict[str, Any], ...]:
    """Take the open tool calls these results answer, in order, counting the run's streak
    of identical calls and its consecutive failures after each (the loop guard's state)."""
    if not results:
        return ()
    state: tuple[str | None, int, int] = (run.sig, run.streak, run.failures)
    closed: list[dict[str, Any]] = []
    for call_id, ok in dict(results).items():
        taken = conn.execute("DELETE FROM tools WHERE tenant=? AND run_id=? AND id=? RETURNING call",
                             (tenant, run_id, call_id)).fetchone()
        if taken is None:
            continue  # not a call this proxy delivered, or closed already
        call = json.loads(taken[0])
        state = streak_of(state, str(call.get("sig") or ""), ok, step=not closed)
        closed.append({**call, "ok": ok, "streak": state[1], "failures": state[2]})
    if closed:
        (run.sig, run.streak, run.failures), run.changed = state, True
    return tuple(closed)


def _take_for_mcp(conn: sqlite3.Connection, tenant: str, run_id: str, turn: ToolTurn) -> dict[str, Any]:
    """Mark the open model tool call this MCP call executes, and count the MCP streak."""
    assert turn.name is not None
    rows = conn.execute("SELECT id, call FROM tools WHERE tenant=? AND run_id=? ORDER BY seq",
                        (tenant, run_id)).fetchall()
    matched = match_pending([json.loads(body) for _, body in rows], turn.name, turn.sig)
    if matched is not None:
        conn.execute("UPDATE tools SET call=? WHERE tenant=? AND run_id=? AND id=?",
                     (_dumps({**matched, "mcp": True}), tenant, run_id, str(matched["id"])))
    row = conn.execute("SELECT sig, streak FROM mcp_guard WHERE tenant=? AND run_id=?", (tenant, run_id)).fetchone()
    streak = int(row[1]) + 1 if row is not None and row[0] == turn.sig else 1
    conn.execute("INSERT INTO mcp_guard (tenant, run_id, sig, streak) VALUES (?,?,?,?) "
                 "ON CONFLICT DO UPDATE SET sig = excluded.sig, streak = excluded.streak",
                 (tenant, run_id, turn.sig, streak))
    return tool_entry(matched, turn, streak)


def _contexts(conn: sqlite3.Connection, tenant: str, refs: tuple[str, ...]) -> tuple[int, list[str]]:
    """(tokens of the stored context seen before, the refs never seen)."""
    known, unknown = 0, []
    for ref in refs:
        tokens = _one(conn, "SELECT tokens FROM contexts WHERE tenant=? AND ref=?", tenant, ref)
        if tokens is None:
            unknown.append(ref)
        else:
            known += int(tokens)
    return known, unknown


def _remember(conn: sqlite3.Connection, tenant: str, seen: list[tuple[str, int]], ts: float) -> None:
    # The largest size seen: a conversation only grows, a prompt template is fixed.
    conn.executemany(
        "INSERT INTO contexts (tenant, ref, tokens, seen_at) VALUES (?,?,?,?) "
        "ON CONFLICT DO UPDATE SET tokens = MAX(tokens, excluded.tokens), seen_at = excluded.seen_at",
        [(tenant, ref, tokens, ts) for ref, tokens in seen])


def _run_add(conn: sqlite3.Connection, tenant: str, run_id: str, totals: list[tuple[str, int]]) -> None:
    summed: dict[tuple[str, str, str], int] = {}
    for name, n in totals:
        summed[tenant, run_id, name] = summed.get((tenant, run_id, name), 0) + n
    _add_totals(conn, summed)


def _add_totals(conn: sqlite3.Connection, totals: Mapping[tuple[str, str, str], int]) -> None:
    """Add each value to its (tenant, run id, counter) of `totals`, in one statement of a
    `_padded` length."""
    if totals:
        rows = [(*k, n) for k, n in totals.items()]
        conn.execute(_sql(_run_add_sql, _padded(len(rows))), [v for r in _pad(rows, zero=(0,)) for v in r])


def _run_add_sql(n: int) -> str:
    return ("INSERT INTO run_totals (tenant, run_id, name, value) VALUES " + ",".join(["(?,?,?,?)"] * n)
            + " ON CONFLICT DO UPDATE SET value = value + excluded.value")


# What `runs.max_tokens` counts (_run_tokens): estimated_tokens are those of an answer whose usage was never read.
_TOKEN_TOTALS = frozenset({"input_tokens", "output_tokens", "estimated_tokens"})


def _lazy_settle(admission: Admission, actual: int, totals: list[tuple[str, int]],
                 tools: list[tuple[str, str]], seen: list[tuple[str, int]]) -> bool:
    """Whether losing this settle to a power cut can only over-count, so that its commit
    need not wait for the fsync (module docstring). Lost, it leaves the reservation
    standing, to be charged at its full amount when it expires; that is at least the cost
    only when the cost did not exceed it. `admission.reserved` is the amount the row holds:
    admit wrote both from one value and nothing changes a reservation's amount after."""
    if actual > admission.reserved:
        return False  # an overshoot: the reservation would charge less than the call cost
    if tools or seen:
        return False  # open tool calls (the loop guard counts them) and context sizes bound later calls
    # The run's token totals bound its next calls under runs.max_tokens: lost, they would under-count.
    capped = admission.limits is None or admission.limits.run_max_tokens is not None
    return not (capped and any(name in _TOKEN_TOTALS for name, _ in totals))


def _dumps(value: Any) -> str:
    # orjson: the tool calls are encoded on the event loop, once per call that made any.
    # (Decoding stays json's: orjson would read an integer past 64 bits, such as a trace
    # id in a span link, as a float.)
    try:
        return orjson.dumps(value).decode()
    except TypeError:  # what orjson refuses (ints past 64 bits, non-string keys) json still writes
        return json.dumps(value)


def _encode_tools(calls: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(str(call["id"]), _dumps(call)) for call in calls]


def _tools_put(conn: sqlite3.Connection, tenant: str, run_id: str, encoded: list[tuple[str, str]]) -> None:
    # A call already known keeps its place in the order (seq) and takes the new body.
    for call_id, body in encoded:
        conn.execute(
            "INSERT INTO tools (tenant, run_id, id, seq, call) VALUES (?,?,?,"
            "(SELECT COALESCE(MAX(seq), 0) + 1 FROM tools WHERE tenant=? AND run_id=?),?) "
            "ON CONFLICT DO UPDATE SET call = excluded.call",
            (tenant, run_id, call_id, tenant, run_id, body),
        )


def _totals(conn: sqlite3.Connection, tenant: str, run_id: str, whole: str | None = None) -> dict[str, int]:
    """A run's totals: its run_totals rows, with what its row keeps (`whole`, when the
    caller read the row already), by name."""
    out = dict(json.loads(whole)) if whole else _whole_totals(conn, tenant, run_id)
    for name, value in conn.execute("SELECT name, value FROM run_totals WHERE tenant=? AND run_id=?",
                                    (tenant, run_id)).fetchall():
        out[name] = out.get(name, 0) + int(value)
    return dict(sorted(out.items()))  # by name, as the rows alone read


def _record(conn: sqlite3.Connection, tenant: str, run_id: str) -> dict[str, Any] | None:
    row = conn.execute(
        "SELECT calls, trace, first_seen, last_seen, ended, totals FROM runs WHERE tenant=? AND run_id=?",
        (tenant, run_id),
    ).fetchone()
    if row is None:
        return None
    calls, trace, first_seen, last_seen, ended, whole = row
    stored = RunRow(int(calls), first_seen, last_seen, bool(ended), json.loads(trace) if trace else None)
    return run_record(tenant, run_id, stored, _spend(conn, tenant, "run", run_id),
                      _totals(conn, tenant, run_id, whole or "{}"))
