"""Faults of the proxy process itself: kill -9 under load, then a restart on the same
ledger; a disk that fills up under the ledger."""

from __future__ import annotations

import asyncio
import sqlite3
from datetime import UTC, datetime, timedelta
from pathlib import Path

import aiohttp
import orjson

from proxy.ledger.leases import LEASE_CALLS
from proxy.ledger.sqlite import SqliteStore
from proxy.model import Usage
from proxy.pricing import PriceTable, cost
from tests.reliability.dialects import DIALECTS, post
from tests.reliability.served import serve

CHAT = DIALECTS[0]
PRICE = PriceTable.load().price("sim-small")


def _cost_of(body: bytes) -> int:
    u = orjson.loads(body)["usage"]
    assert PRICE is not None
    return cost(PRICE, Usage(u["prompt_tokens"], u["completion_tokens"], 0))


async def _open_stream(s: aiohttp.ClientSession, url: str, run: str) -> aiohttp.ClientResponse:
    r = await s.post(url + CHAT.path(True), json=CHAT.body("SCENARIO:slow:0.2", True),
                     headers={"Authorization": "Bearer k", "X-Run-Id": run})
    await r.content.readany()  # admitted, reserved, forwarded, streaming
    return r


async def test_kill_9_under_load_then_restart_loses_no_spend_and_no_reservation(sim, tmp_path: Path):
    data = tmp_path / "data"
    first = await serve(data, sim.url)
    try:
        done = await asyncio.gather(*(post(first.url, CHAT.path(False), CHAT.body(f"hi {i}", False),
                                           headers={"X-Run-Id": f"done-{i % 4}"}) for i in range(40)))
        assert [r.status for r in done] == [200] * 40
        delivered = sum(_cost_of(r.body) for r in done)
        async with aiohttp.ClientSession() as s:
            streams = [await _open_stream(s, first.url, f"inflight-{i}") for i in range(8)]
            await first.kill()  # mid-stream, with settles of the last answers possibly queued
            for r in streams:
                r.close()
    finally:
        await first.kill()

    store = SqliteStore(str(data / "ledger.db"))
    try:
        after = await store.spend_detail("default")
        assert after.total >= delivered, "every delivered answer is charged or still reserved"
        assert after.reserved > 0, "the reservations of the cut calls survived the kill"
        assert [await store.run_calls("default", f"inflight-{i}") for i in range(8)] == [1] * 8
        # Exact, or over by the unused part of a budget lease one of the runs held at the kill.
        assert 40 <= sum([await store.run_calls("default", f"done-{i}") for i in range(4)]) <= 40 + 4 * LEASE_CALLS
    finally:
        await store.aclose()

    second = await serve(data, sim.url)
    try:
        r = await post(second.url, CHAT.path(False), CHAT.body("hi", False), headers={"X-Run-Id": "inflight-0"})
        assert r.status == 200
        await asyncio.sleep(0)  # the answer may be out before its settle; read after restart below
    finally:
        await second.kill()
    store = SqliteStore(str(data / "ledger.db"))
    try:
        assert await store.run_calls("default", "inflight-0") == 2, "run state continues after the restart"
        before = await store.spend_detail("default")
        await store.expire(datetime.now(UTC) + timedelta(hours=1))  # what the sweeper does after the ttl
        expired = await store.spend_detail("default")
        assert expired.reserved == 0
        assert expired.total == before.total, "an expired reservation is charged in full: unknown is not zero"
    finally:
        await store.aclose()
    with sqlite3.connect(data / "ledger.db") as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)


async def test_a_full_disk_is_a_clear_503_and_the_ledger_stays_intact(sim, tmp_path: Path):
    data = tmp_path / "data"
    # Every file the process writes is capped at 256 KiB: the ledger's WAL hits it first.
    proc = await serve(data, sim.url, max_file_bytes=256 * 1024, env={"SPANMETER_LOCAL_TRACES": "false",
                                                                       "OTEL_TRACES_EXPORTER": "none"})
    ok, failure = 0, None
    try:
        for i in range(2000):
            r = await post(proc.url, CHAT.path(False), CHAT.body("hi", False), headers={"X-Run-Id": f"disk-{i}"})
            if r.status != 200:
                failure = r
                break
            ok += 1
    finally:
        await proc.kill()
    assert failure is not None, "the disk never filled: the limit did not apply"
    assert ok > 0
    assert failure.status == 503
    message = CHAT.error_message(orjson.loads(failure.body))
    # EFBIG reads as SQLITE_IOERR ("disk I/O error"); a real ENOSPC reads "database or disk is full".
    assert "ledger.db failed: disk I/O error" in message and "Check the disk" in message
    with sqlite3.connect(data / "ledger.db") as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        calls = conn.execute("SELECT COALESCE(SUM(calls), 0) FROM runs").fetchone()[0]
    assert calls >= ok - 1, "every answered call was counted (the last one's bookkeeping may have hit the wall)"
