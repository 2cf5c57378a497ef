"""The SQLite ledger's writer: how a batch commits and hands its results back.

Each test first holds the writer thread inside an operation of its own, queues the
operations under test behind it, then lets it go: they are then all waiting, and the
writer takes them as one batch (one transaction, one commit).
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from proxy.errors import StoreUnavailable
from proxy.ledger.sqlite import SqliteStore, _lazy_settle
from proxy.ledger.store import Admission, Ask, Limits, Turn, WholeRun

T0 = datetime(2026, 5, 14, 12, 0, tzinfo=UTC)


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SqliteStore]:
    s = SqliteStore(str(tmp_path / "ledger.db"))
    yield s
    await s.aclose()


@asynccontextmanager
async def one_batch(store: SqliteStore) -> AsyncIterator[None]:
    """What is queued inside the block is committed as one batch once it exits."""
    holding, go = threading.Event(), threading.Event()

    def hold(conn: sqlite3.Connection) -> None:
        holding.set()
        go.wait(30)

    held = store._submit(hold)
    assert await asyncio.get_running_loop().run_in_executor(None, holding.wait, 30)
    try:
        yield
        await asyncio.sleep(0)  # let tasks created in the block queue their operations
    finally:
        go.set()
        await held


async def admit(store: SqliteStore, run_id: str, **kw: Any) -> Admission:
    kw.setdefault("limits", Limits())
    return await store.admit(Ask("acme", run_id, T0, **kw), Turn(reserve=(10, 100)))


# --- atomicity -------------------------------------------------------------------------------


async def test_an_op_that_fails_midway_leaves_no_trace_and_spares_its_batch_mates(store: SqliteStore) -> None:
    def half_then_fail(conn: sqlite3.Connection) -> None:
        conn.execute("INSERT INTO budgets (tenant, day, month) VALUES ('acme', 1, 2)")
        raise RuntimeError("failed after its first write")

    async with one_batch(store):
        first = asyncio.ensure_future(admit(store, "r-1"))
        await asyncio.sleep(0)
        failing = store._submit(half_then_fail)
        last = asyncio.ensure_future(admit(store, "r-2"))

    with pytest.raises(RuntimeError, match="first write"):
        await failing
    assert (await first).calls == 1 and (await last).calls == 1
    assert await store.budget_get("acme") == (None, None), "the failed op's write was rolled back"
    assert (await store.spend_detail("acme")).reserved == 200
    assert [await store.run_calls("acme", r) for r in ("r-1", "r-2")] == [1, 1]


# --- handing results back --------------------------------------------------------------------


class Wakeups:
    """Counts the writer thread's wake-ups of one event loop (a spy: every call goes through)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.count = 0
        self._loop, self._real = loop, loop.call_soon_threadsafe

        def counted(callback: Any, *args: Any, **kw: Any) -> Any:
            if threading.current_thread().name == "spanmeter-ledger":
                self.count += 1
            return self._real(callback, *args, **kw)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign]

    def close(self) -> None:
        del self._loop.call_soon_threadsafe


@pytest.fixture
def other_loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


async def test_a_batch_wakes_each_waiting_loop_once_with_all_its_results(
        store: SqliteStore, other_loop: asyncio.AbstractEventLoop) -> None:
    here = Wakeups(asyncio.get_running_loop())
    there = Wakeups(other_loop)
    try:
        async with one_batch(store):
            mine = [asyncio.ensure_future(admit(store, f"r-{i}")) for i in range(5)]
            await asyncio.sleep(0)
            theirs = [asyncio.run_coroutine_threadsafe(admit(store, f"s-{i}"), other_loop) for i in range(3)]
            while store.operations < 1 + 5 + 3:  # the other loop queues its admissions
                await asyncio.sleep(0.001)
            here.count = there.count = 0
        assert sorted(a.run_id for a in await asyncio.gather(*mine)) == [f"r-{i}" for i in range(5)]
        got = await asyncio.gather(*(asyncio.wrap_future(t) for t in theirs))
        assert sorted(a.run_id for a in got) == [f"s-{i}" for i in range(3)]
        # Here: the batch of the operation that held the writer, then ours.
        assert (here.count, there.count) == (2, 1)
    finally:
        here.close()
        there.close()


async def test_an_admission_whose_caller_left_during_the_batch_is_released(store: SqliteStore) -> None:
    async with one_batch(store):
        gone = asyncio.ensure_future(admit(store, "r-gone"))
        await asyncio.sleep(0)
        gone.cancel()
        kept = asyncio.ensure_future(admit(store, "r-kept"))
    with pytest.raises(asyncio.CancelledError):
        await gone
    await kept
    for _ in range(300):  # the release is queued once the admission is handed back
        if (await store.spend_detail("acme", run_id="r-gone")).reserved == 0:
            break
        await asyncio.sleep(0.01)
    assert await store.run_calls("acme", "r-gone") == 1
    assert (await store.spend_detail("acme", run_id="r-gone")).reserved == 0
    assert (await store.spend_detail("acme", run_id="r-kept")).reserved == 100


# --- which commits wait for the fsync ----------------------------------------------------------


CAPPED = Limits(run_max_tokens=10_000)
TOKENS = [("input_tokens", 5), ("output_tokens", 7)]


@pytest.mark.parametrize(
    ("actual", "limits", "totals", "tools", "contexts", "lazy"),
    [
        pytest.param(100, Limits(), TOKENS, [], [], True, id="the whole reservation"),
        pytest.param(40, Limits(), [("model_calls", 1)], [], [], True, id="less than reserved"),
        pytest.param(101, Limits(), [], [], [], False, id="an overshoot"),
        pytest.param(40, Limits(), [], [("c1", "{}")], [], False, id="open tool calls"),
        pytest.param(40, Limits(), [], [], [("response:r1", 900)], False, id="a stored context's size"),
        pytest.param(40, CAPPED, TOKENS, [], [], False, id="tokens under runs.max_tokens"),
        pytest.param(40, CAPPED, [("model_calls", 1)], [], [], True, id="no tokens under runs.max_tokens"),
        pytest.param(40, None, TOKENS, [], [], False, id="tokens under unknown limits"),
    ],
)
def test_a_settle_may_skip_the_fsync_only_if_losing_it_over_counts(
        actual: int, limits: Limits | None, totals: list[tuple[str, int]], tools: list[tuple[str, str]],
        contexts: list[tuple[str, int]], lazy: bool) -> None:
    admission = Admission("id", "acme", "r-1", 100, 1, {}, "2026-05-14", "2026-05", limits=limits)
    assert _lazy_settle(admission, actual, totals, tools, contexts) is lazy


def _level(conn: sqlite3.Connection) -> int:
    return int(conn.execute("PRAGMA synchronous").fetchone()[0])


@pytest.mark.parametrize(
    ("synchronous", "settles", "with_admission", "level"),
    [
        pytest.param("full", [10, 100], False, 1, id="full: settles within their reservations skip it"),
        pytest.param("full", [10, 101], False, 2, id="full: an overshoot in the batch waits"),
        pytest.param("full", [10], True, 2, id="full: an admission in the batch waits"),
        pytest.param("extra", [10], False, 3, id="extra: every commit waits"),
        pytest.param("normal", [10, 101], True, 1, id="normal: no commit waits"),
    ],
)
async def test_the_batch_decides_whether_its_commit_waits_for_the_fsync(
        tmp_path: Path, synchronous: str, settles: list[int], with_admission: bool, level: int) -> None:
    store = SqliteStore(str(tmp_path / "ledger.db"), synchronous=synchronous)
    try:
        admissions = [await admit(store, f"r-{i}") for i in range(len(settles))]
        async with one_batch(store):
            done = [asyncio.ensure_future(store.settle(a, cost)) for a, cost in zip(admissions, settles, strict=True)]
            if with_admission:
                done.append(asyncio.ensure_future(admit(store, "r-new")))
            await asyncio.sleep(0)
            # Reads the connection's level inside the batch; claims nothing about itself.
            probe = store._submit(_level, lazy=True)
        assert await probe == level
        await asyncio.gather(*done)
        assert (await store.spend_detail("acme")).settled == sum(settles)
        # The next batch of an admission alone waits again (FULL: 2), whatever came before.
        await admit(store, "r-after")
        assert await store._do(_level, lazy=False) == {"full": 2, "extra": 3, "normal": 1}[synchronous]
    finally:
        await store.aclose()


# --- another process's write lock ------------------------------------------------------------


async def test_an_admission_waits_for_a_lock_held_elsewhere_and_goes_through_once_it_is_free(tmp_path: Path) -> None:
    """Another connection (a sibling worker) holds the write lock: the admission waits,
    neither failing nor lost, and commits as soon as the lock is released."""
    path = str(tmp_path / "ledger.db")
    store = SqliteStore(path)
    try:
        await admit(store, "warm")  # the file and its schema exist
        other = sqlite3.connect(path, isolation_level=None)
        other.execute("BEGIN IMMEDIATE")
        pending = asyncio.ensure_future(admit(store, "r-1"))
        await asyncio.sleep(0.3)
        assert not pending.done(), "the lock is held: nothing can have committed"
        other.execute("COMMIT")
        other.close()
        admission = await asyncio.wait_for(pending, 30)
        assert admission.reserved == 100
        assert await store.run_calls("acme", "r-1") == 1
    finally:
        await store.aclose()


async def test_a_lock_held_past_the_patience_is_a_store_error_and_the_next_batch_recovers(tmp_path: Path) -> None:
    path = str(tmp_path / "ledger.db")
    store = SqliteStore(path, lock_patience_s=0.2)
    try:
        await admit(store, "warm")
        other = sqlite3.connect(path, isolation_level=None)
        other.execute("BEGIN IMMEDIATE")
        with pytest.raises(StoreUnavailable, match=r"stayed locked by another connection for 0\.2 s"):
            await admit(store, "r-1")
        other.execute("COMMIT")
        other.close()
        assert (await admit(store, "r-2")).reserved == 100
        assert await store.run_calls("acme", "r-1") == 0
    finally:
        await store.aclose()


# --- a ledger file from an older spanmeter ---------------------------------------------------


async def test_a_ledger_made_before_runs_kept_their_totals_in_their_row_opens_and_reads_the_same(
        tmp_path: Path) -> None:
    """A file without `runs.totals` (spanmeter before 2026-12-06) gets the column when opened:
    its runs read their totals from their rows as before, and a run written whole after the
    upgrade reads its own from its row."""
    path = str(tmp_path / "ledger.db")
    store = SqliteStore(path)
    a = await store.admit(Ask("acme", "old", T0), Turn(reserve=(10, 100)))
    await store.settle(a, 40, run_totals={"model_calls": 1, "cost_micros": 40})
    await store.aclose()
    conn = sqlite3.connect(path)
    conn.execute("ALTER TABLE runs DROP COLUMN totals")  # the file as an older spanmeter left it
    conn.commit()
    conn.close()
    store = SqliteStore(path)
    try:
        assert await store.run_totals("acme", "old") == {"cost_micros": 40, "model_calls": 1}
        t = T0.timestamp()
        await store.runs_record([WholeRun("acme", "new", 1, t, t, None, 30, {"model_calls": 1, "cost_micros": 30},
                                          ended_at=t)])
        runs = {r["run_id"]: r["totals"] for r in await store.list_runs("acme")}
        assert runs == {"old": {"cost_micros": 40, "model_calls": 1}, "new": {"cost_micros": 30, "model_calls": 1}}
    finally:
        await store.aclose()
