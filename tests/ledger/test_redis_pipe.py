"""The ledger's scripts on pipelined connections (proxy/ledger/redis_pipe.py): replies stay
matched to their calls when callers go away, a server that stops answering fails the
calls closed and a fresh connection serves the next ones, and a Cluster slot moved to
another master is followed (MOVED) with nothing lost.
"""

from __future__ import annotations

import asyncio
import os
import signal
from datetime import UTC, datetime
from pathlib import Path

import pytest
import redis
from redis.crc import key_slot

from proxy.errors import StoreUnavailable
from proxy.ledger.backends import open_store
from proxy.ledger.redis import RedisStore, key, tag
from proxy.ledger.store import Ask, Limits, Spend, Turn
from tests.fixtures.redis import BINARY, SKIP_REASON, RedisServer
from tests.fixtures.redis_cluster import CLI, CLUSTER_SKIP_REASON, LocalCluster

T0 = datetime(2026, 5, 14, 12, 0, tzinfo=UTC)
pytestmark = [pytest.mark.redis, pytest.mark.skipif(BINARY is None, reason=SKIP_REASON)]


@pytest.mark.parametrize("kind", ["redis", pytest.param("cluster", marks=pytest.mark.skipif(CLI is None,
                                                                                           reason=CLUSTER_SKIP_REASON))])
async def test_replies_stay_with_their_calls_when_callers_go_away(kind: str, request: pytest.FixtureRequest) -> None:
    url = request.getfixturevalue("redis_server" if kind == "redis" else "redis_cluster").url
    store = open_store(url)
    tenant = f"pipe-{kind}"
    try:
        async def admit(i: int) -> int:
            a = await store.admit(Ask(tenant, f"r-{i}", T0, Limits()), Turn(reserve=(1, 1000 + i)))
            return a.reserved

        tasks = [asyncio.ensure_future(admit(i)) for i in range(120)]
        await asyncio.sleep(0)  # every admission is written; none has its reply yet
        for t in tasks[::3]:
            t.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for i, r in enumerate(results):
            if i % 3:
                assert r == 1000 + i, i  # each caller got its own reply, not a neighbour's
            else:
                assert isinstance(r, asyncio.CancelledError | int), r
        # The connection is still in step: the next calls read their own replies.
        for i in range(5):
            a = await store.admit(Ask(tenant, f"after-{i}", T0, Limits()), Turn(reserve=(1, 77 + i)))
            assert a.reserved == 77 + i
            assert await store.settle(a, 5, run_totals={"calls": 1}) == 0
            assert await store.run_totals(tenant, f"after-{i}") == {"calls": 1}
    finally:
        await store.aclose()


async def test_a_server_that_stops_answering_fails_closed_and_a_new_connection_serves_after(tmp_path: Path) -> None:
    server = RedisServer(tmp_path)
    server.start()
    store = RedisStore(server.url, timeout_s=0.3)
    assert server.proc is not None
    try:
        first = await store.admit(Ask("acme", "r-1", T0, Limits()), Turn(reserve=(1, 100)))
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            calls = [store.admit(Ask("acme", f"stuck-{i}", T0, Limits()), Turn(reserve=(1, 100)))
                     for i in range(3)]
            outcomes = await asyncio.gather(*calls, return_exceptions=True)
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        assert all(isinstance(o, StoreUnavailable) for o in outcomes), outcomes
        assert "TimeoutError" in str(outcomes[0])
        assert await store.settle(first, 40, run_totals={"calls": 1}) == 0
        assert await store.spend_detail("acme", run_id="r-1") == Spend(40, 0)
    finally:
        await store.aclose()
        server.stop()


@pytest.mark.skipif(CLI is None, reason=CLUSTER_SKIP_REASON)
async def test_a_tenants_slot_moved_to_another_master_is_followed(tmp_path: Path) -> None:
    cluster = LocalCluster(tmp_path / "cluster")
    cluster.start()
    tenant = "moving"
    store = open_store(cluster.url)
    try:
        a = await store.admit(Ask(tenant, "r-1", T0, Limits()), Turn(reserve=(1, 100)))
        assert await store.settle(a, 30) == 0
        source = cluster.node_of(key(tenant, "total"))
        target = next(n for n in cluster.nodes if n is not source)
        _move_slot(key_slot(tag(tenant).encode()), source.port, target.port, [n.port for n in cluster.nodes])
        assert cluster.node_of(key(tenant, "total")) is target
        for i in range(3):  # the first is told MOVED; all are served from the new master
            b = await store.admit(Ask(tenant, f"r-{i + 2}", T0, Limits()), Turn(reserve=(1, 100)))
            assert await store.settle(b, 10) == 0
        assert await store.spend(tenant) == 30 + 3 * 10  # the money moved with the slot; none counted twice
        with redis.Redis(port=target.port) as r:
            assert r.hget(key(tenant, "total"), "settled") == b"60"
    finally:
        await store.aclose()
        cluster.stop()


def _move_slot(slot: int, source: int, target: int, every: list[int]) -> None:
    """What `redis-cli --cluster reshard` does for one slot: its keys migrated, then every
    master told the slot's new owner."""
    with redis.Redis(port=source) as src, redis.Redis(port=target) as dst:
        src_id, dst_id = src.execute_command("CLUSTER MYID"), dst.execute_command("CLUSTER MYID")
        dst.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", src_id)
        src.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", dst_id)
        while names := src.execute_command("CLUSTER GETKEYSINSLOT", slot, 100):
            src.execute_command("MIGRATE", "127.0.0.1", target, "", 0, 5000, "KEYS", *names)
        for port in every:
            with redis.Redis(port=port) as r:
                r.execute_command("CLUSTER SETSLOT", slot, "NODE", dst_id)
