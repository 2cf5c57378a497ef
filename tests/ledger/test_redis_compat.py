"""redis-py's internals the Redis ledger uses (proxy/ledger/redis_compat.py): probed when a
store is made, a moved one logged once and the public path taken (redis-py's pipelines,
its Cluster client's routing); and both paths give the same replies and leave the same
ledger state in a real redis-server.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import redis
from redis.asyncio.cluster import RedisCluster

from proxy.errors import Refusal
from proxy.ledger import redis_compat
from proxy.ledger.redis import RedisStore
from proxy.ledger.redis_pipe import Batched, Pipe
from proxy.ledger.store import Ask, Limits, Turn
from tests.fixtures.redis import BINARY, SKIP_REASON
from tests.fixtures.redis_cluster import CLI, CLUSTER_SKIP_REASON

T0 = datetime(2026, 5, 14, 12, 0, tzinfo=UTC)
pytestmark = [pytest.mark.redis, pytest.mark.skipif(BINARY is None, reason=SKIP_REASON)]
LIMITS = Limits(run_max_calls=3, run_max_cost=50_000, day_budget=10**9, month_budget=10**10)
TRACE = {"trace_id": "4bf92f3577b34da6a3ce929d0e0e4736", "span_id": "00f067aa0ba902b7"}


async def _story(store: RedisStore, tenant: str) -> list[Any]:
    """What an agent's calls do to the ledger: admissions (one refused), settles with totals
    and tool calls, concurrent admissions, reads. Every answer, ids left out."""
    seen: list[Any] = []
    tools = [{"id": "call_1", "name": "search", "arguments": '{"q": "x"}', "delivered_ns": 1, "link": None}]
    a = await store.admit(Ask(tenant, "run-1", T0, LIMITS), Turn(trace=TRACE, reserve=(10, 9_000)))
    seen.append((a.reserved, a.calls, a.remaining, a.day_key, a.month_key, a.closed, a.trace))
    seen.append(await store.settle(a, 1_234, run_totals={"calls": 1, "input_tokens": 812}, tools=tools))
    many = await asyncio.gather(*(store.admit(Ask(tenant, f"run-{i}", T0 + timedelta(seconds=i), LIMITS),
                                              Turn(reserve=(1, 100 + i))) for i in range(2, 40)))
    # Concurrent: the tenant's windows depend on the order they arrive in; the runs' do not.
    seen.append([(m.reserved, m.calls, m.remaining["run_cost"]) for m in many])
    seen.append(await asyncio.gather(*(store.settle(m, 50, run_totals={"calls": 1}) for m in many)))
    for _ in range(3):  # the run's call ceiling (3) refuses the third
        try:
            b = await store.admit(Ask(tenant, "run-1", T0, LIMITS), Turn(reserve=(10, 9_000)))
            seen.append((b.reserved, b.calls))
            seen.append(await store.settle(b, 2_000, run_totals={"calls": 1}))
        except Refusal as exc:
            seen.append(("refused", str(exc).replace(tenant, "<tenant>")))
    seen.append(await store.run_totals(tenant, "run-1"))
    seen.append(await store.run_totals(tenant, "run-7"))
    return seen


def _state(url: str) -> dict[str, Any]:
    """Every key of the database with its value (and whether it expires)."""
    client = redis.Redis.from_url(url, decode_responses=True)
    try:
        state: dict[str, Any] = {}
        for name in sorted(client.scan_iter("*")):
            kind = client.type(name)
            value: Any = {
                "string": lambda n: client.get(n),
                "hash": lambda n: client.hgetall(n),
                "zset": lambda n: client.zrange(n, 0, -1, withscores=True),
                "set": lambda n: sorted(client.smembers(n)),
                "list": lambda n: client.lrange(n, 0, -1),
            }[kind](name)
            state[name] = (kind, value, client.pttl(name) > 0)
        return state
    finally:
        client.close()


async def _run(url: str, monkeypatch: pytest.MonkeyPatch, internals: bool) -> tuple[list[Any], dict[str, Any]]:
    monkeypatch.setenv(redis_compat.ENV, "on" if internals else "off")
    store = RedisStore(url)
    try:
        assert (store._pipe is None or isinstance(store._pipe, Pipe if internals else Batched))
        return await _story(store, "compat"), _state(url) if not store.cluster else {}
    finally:
        await store.aclose()


async def test_standalone_both_paths_give_the_same_replies_and_state(redis_server: Any,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    base = redis_server.url.rsplit("/", 1)[0]
    bypass = await _run(f"{base}/7", monkeypatch, internals=True)
    public = await _run(f"{base}/8", monkeypatch, internals=False)
    assert bypass[0] == public[0]
    assert bypass[1] == public[1]
    assert any(r[0] == "refused" for r in public[0] if isinstance(r, tuple))  # the story reached the ceiling
    assert len(public[1]) > 5


@pytest.mark.skipif(CLI is None, reason=CLUSTER_SKIP_REASON)
async def test_cluster_both_paths_give_the_same_replies(redis_cluster: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    bypass = await _run(redis_cluster.url, monkeypatch, internals=True)
    # The same tenant again: its run totals carry on from the first pass, so compare the answers
    # of a fresh tenant on each path instead.
    monkeypatch.setenv(redis_compat.ENV, "off")
    store = RedisStore(redis_cluster.url)
    try:
        public = await _story(store, "compat-public")
    finally:
        await store.aclose()
    monkeypatch.setenv(redis_compat.ENV, "on")
    store = RedisStore(redis_cluster.url)
    try:
        again = await _story(store, "compat-bypass")
    finally:
        await store.aclose()
    assert again == public
    assert bypass[0] == again  # and the first pass said the same


async def test_public_replies_stay_with_their_calls_when_callers_go_away(redis_server: Any,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(redis_compat.ENV, "off")
    store = RedisStore(redis_server.url)
    try:
        async def admit(i: int) -> int:
            a = await store.admit(Ask("batched", f"r-{i}", T0, Limits()), Turn(reserve=(1, 1000 + i)))
            return a.reserved

        tasks = [asyncio.ensure_future(admit(i)) for i in range(60)]
        await asyncio.sleep(0)
        for t in tasks[::3]:
            t.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert [r for i, r in enumerate(results) if i % 3] == [1000 + i for i in range(60) if i % 3]
    finally:
        await store.aclose()


async def test_a_moved_internal_is_said_once_and_the_public_path_taken(
        redis_server: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv(redis_compat.ENV, raising=False)
    # As a release that renamed the Cluster client's flag would leave redis-py.
    monkeypatch.setattr(RedisCluster, "__slots__", tuple(s for s in RedisCluster.__slots__ if s != "_initialize"))
    with caplog.at_level(logging.WARNING):
        stores = [RedisStore(redis_server.url) for _ in range(3)]
    try:
        assert all(isinstance(s._pipe, Batched) for s in stores)
        said = [r.getMessage() for r in caplog.records if r.name == redis_compat.__name__]
        assert len(said) == 1, said
        assert "RedisCluster._initialize" in said[0]
        assert f"redis-py {importlib.metadata.version('redis')}" in said[0]
        a = await stores[0].admit(Ask("moved", "r", T0, Limits()), Turn(reserve=(1, 10)))
        assert await stores[0].settle(a, 3, run_totals={"calls": 1}) == 0
    finally:
        for s in stores:
            await s.aclose()


def test_the_probe_finds_nothing_moved_in_the_installed_redis_py() -> None:
    assert redis_compat.moved() == []
