"""A settle that leaves tool calls open commits without waiting for its fsync, and is made
durable within SYNC_WITHIN_S, or sooner by the next batch that is fsynced (an admission).

The run's next call waits for that settle's commit (it closes those tool calls), so before
this it queued behind two fsyncs in a row: the settle's and its own admission's."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from proxy.ledger.sqlite import SYNC_WITHIN_S, SqliteStore
from proxy.ledger.store import Admission, Ask, Limits, Turn
from tests.ledger.test_sqlite_ledger import one_batch

T0 = datetime(2026, 5, 14, 12, 0, tzinfo=UTC)
TOOL = {"id": "call_1", "name": "lookup", "arguments": "{}"}


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SqliteStore]:
    s = SqliteStore(str(tmp_path / "ledger.db"))
    yield s
    await s.aclose()


async def admit(store: SqliteStore, run_id: str, **kw: Any) -> Admission:
    return await store.admit(Ask("acme", run_id, T0, **kw), Turn(reserve=(10, 100)))


def _level(conn: sqlite3.Connection) -> int:
    return int(conn.execute("PRAGMA synchronous").fetchone()[0])


async def _until(predicate: Any, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "not within the time allowed"
        await asyncio.sleep(0.001)


@pytest.mark.parametrize(
    ("cost", "limits", "level"),
    [
        pytest.param(40, Limits(), 1, id="within its reservation: commits without waiting, fsynced soon"),
        pytest.param(101, Limits(), 2, id="an overshoot: waits for its fsync as before"),
        pytest.param(40, Limits(run_max_tokens=10_000), 2, id="token totals under runs.max_tokens: waits"),
    ],
)
async def test_a_settle_with_open_tool_calls_waits_for_its_fsync_only_when_losing_it_under_counts(
        store: SqliteStore, cost: int, limits: Limits, level: int) -> None:
    admission = await admit(store, "r-1", limits=limits)
    async with one_batch(store):
        settled = asyncio.ensure_future(store.settle(admission, cost, run_totals={"input_tokens": 5},
                                                     tools=[TOOL]))
        await asyncio.sleep(0)
        probe = store._submit(_level, lazy=True)  # reads the batch's level; claims nothing itself
    assert await probe == level
    await settled
    # The run's next call sees the tool call as soon as the settle is handed back.
    assert [c["id"] for c in await store.tools_pending("acme", "r-1")] == ["call_1"]


async def test_the_wal_is_fsynced_soon_after_such_a_settle_when_nothing_else_comes(store: SqliteStore) -> None:
    admission = await admit(store, "r-1")
    before = store.deferred_syncs
    started = time.monotonic()
    await store.settle(admission, 40, run_totals={"model_calls": 1}, tools=[TOOL])
    await _until(lambda: store.deferred_syncs > before)
    # Due SYNC_WITHIN_S after the commit; the bound here only allows for a loaded machine.
    assert time.monotonic() - started < 2.0 + SYNC_WITHIN_S
    assert store.deferred_syncs == before + 1  # one fsync for it, not one per wake-up


async def test_an_admission_in_the_same_batch_makes_it_durable_with_no_extra_fsync(store: SqliteStore) -> None:
    admission = await admit(store, "r-1")
    before = store.deferred_syncs
    async with one_batch(store):
        settled = asyncio.ensure_future(store.settle(admission, 40, run_totals={"model_calls": 1}, tools=[TOOL]))
        nxt = asyncio.ensure_future(admit(store, "r-1"))
        await asyncio.sleep(0)
        probe = store._submit(_level, lazy=True)
    assert await probe == 2  # the admission's batch waits for its fsync, which covers the settle
    await asyncio.gather(settled, nxt)
    await asyncio.sleep(SYNC_WITHIN_S * 20)
    assert store.deferred_syncs == before


async def test_lazy_settles_alone_still_need_no_fsync_at_all(store: SqliteStore) -> None:
    admission = await admit(store, "r-1")
    before = store.deferred_syncs
    await store.settle(admission, 40, run_totals={"model_calls": 1})
    await asyncio.sleep(SYNC_WITHIN_S * 20)
    assert store.deferred_syncs == before


async def test_analytics_added_soon_do_not_wait_for_an_fsync(store: SqliteStore) -> None:
    """The cost anatomy's sums (run_add soon=True) commit without an fsync of their own: a
    power cut may lose them, and they are not money."""
    async with one_batch(store):
        added = asyncio.ensure_future(store.run_add("acme", "r-1", {"anatomy|part|new|tokens": 5}, soon=True))
        await asyncio.sleep(0)
        probe = store._submit(_level, lazy=True)
    assert await probe == 1
    await added
    assert (await store.run_totals("acme", "r-1"))["anatomy|part|new|tokens"] == 5
    async with one_batch(store):
        added = asyncio.ensure_future(store.run_add("acme", "r-1", {"tool_failures": 1}))
        await asyncio.sleep(0)
        probe = store._submit(_level, lazy=True)
    assert await probe == 2, "other totals wait for their fsync, as before"
    await added


async def test_a_runs_end_does_not_hold_the_next_admission_behind_its_fsync(store: SqliteStore) -> None:
    """A run without X-Run-Id ends with its one call; the caller's next call is admitted in
    the batch after that end, which must not wait for an fsync of its own first."""
    admission = await admit(store, "r-1")
    await store.settle(admission, 40, run_totals={"model_calls": 1})
    before = store.deferred_syncs
    async with one_batch(store):
        ended = asyncio.ensure_future(store.run_end("acme", "r-1"))
        await asyncio.sleep(0)
        probe = store._submit(_level, lazy=True)
    assert await probe == 1
    record = await ended
    assert record is not None and record["totals"]["model_calls"] == 1
    await _until(lambda: store.deferred_syncs > before)  # fsynced soon after, with nothing else coming
    synced = store.deferred_syncs
    assert await store.run_end("acme", "r-1") is None  # ended once: the end is committed
    await asyncio.sleep(SYNC_WITHIN_S * 20)
    assert store.deferred_syncs == synced  # an end already made wrote nothing: nothing to fsync


async def test_a_batch_that_writes_nothing_does_not_stand_for_the_pending_fsync(
        store: SqliteStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """SQLite fsyncs the WAL only when a commit wrote to it: a read in the window before a
    durable-soon commit's fsync is due must not count as that fsync."""
    import proxy.ledger.sqlite as ledger

    monkeypatch.setattr(ledger, "SYNC_WITHIN_S", 0.5)
    admission = await admit(store, "r-1")
    before = store.deferred_syncs
    await store.settle(admission, 40, run_totals={"model_calls": 1}, tools=[TOOL])  # durable soon
    assert (await store.run_totals("acme", "r-1"))["model_calls"] == 1  # a read, in its own batch
    assert store._sync_due is not None
    await _until(lambda: store.deferred_syncs > before)
