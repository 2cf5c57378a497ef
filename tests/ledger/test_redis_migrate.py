"""`spanmeter ledger migrate-keys` on a real redis-server holding a ledger the old RedisStore wrote,
then on to a Redis Cluster with `redis-cli --cluster import`.

tests/data/ledger/redis_v1.json is every key of that ledger (written by the store of commit
e45afe4, before hash tags; redis_v1_session.py is how) and what that store answered about it.
After the migration today's store must answer the same, with nothing left in the old layout.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import subprocess
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import redis

from proxy.errors import StoreUnavailable
from proxy.ledger.backends import open_store
from proxy.ledger.redis import REGISTRY
from proxy.ledger.redis_migrate import new_name
from proxy.ledger.store import Ask, Limits, Spend, Store, Turn
from proxy.ops.cli import main
from tests.fixtures.redis import BINARY, SKIP_REASON, RedisServer
from tests.fixtures.redis_cluster import CLI, CLUSTER_SKIP_REASON, LocalCluster

pytestmark = [pytest.mark.redis, pytest.mark.skipif(BINARY is None, reason=SKIP_REASON)]

DATA = Path(__file__).resolve().parents[1] / "data" / "ledger"
V1 = json.loads((DATA / "redis_v1.json").read_text())
_spec = importlib.util.spec_from_file_location("redis_v1_session", DATA / "redis_v1_session.py")
assert _spec is not None and _spec.loader is not None
session = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(session)


def load(url: str, keys: dict[str, dict[str, Any]]) -> None:
    with redis.Redis.from_url(url) as r:
        for name, k in keys.items():
            if k["type"] == "hash":
                r.hset(name, mapping=k["value"])
            elif k["type"] == "zset":
                r.zadd(name, {m: s for m, s in k["value"]})
            else:
                r.set(name, k["value"])
            if k["pttl"] > 0:
                r.pexpire(name, k["pttl"])


def names(url: str) -> list[str]:
    with redis.Redis.from_url(url, decode_responses=True) as r:
        return sorted(r.scan_iter("*"))


@pytest.fixture
def server(tmp_path: Path) -> Any:
    s = RedisServer(tmp_path)
    s.start()
    load(s.url, V1["keys"])
    yield s
    s.stop()


@pytest.fixture
async def store(server: RedisServer) -> AsyncIterator[Store]:
    s = open_store(server.url)
    yield s
    await s.aclose()


async def cli(*argv: str) -> int:
    """The command as a shell runs it (it runs its own event loop: in a thread here)."""
    return await asyncio.to_thread(main, list(argv))


async def migrate(url: str, capsys: pytest.CaptureFixture[str], *extra: str) -> str:
    assert await cli("ledger", "migrate-keys", "--ledger", url, *extra) == 0
    return capsys.readouterr().out


async def test_the_migrated_ledger_answers_as_the_old_one_did(server: RedisServer, store: Store,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    # Before: a new proxy refuses calls rather than count every budget from zero.
    with pytest.raises(StoreUnavailable, match="spanmeter ledger migrate-keys"):
        await store.admit(Ask("acme", "r-9", session.T0, Limits()), Turn(reserve=(1, 1)))
    before = names(server.url)
    out = await migrate(server.url, capsys, "--dry-run")
    assert "Dry run" in out and "would move 3 reservation(s)" in out and "3 active run(s)" in out, out
    assert names(server.url) == before, "a dry run changes nothing"

    out = await migrate(server.url, capsys)
    assert "moved 3 reservation(s) of calls in flight, 3 active run(s)" in out and "of 3 tenant(s)" in out, out
    after = names(server.url)
    renamed = {found[0] for n in before if (found := new_name(n)) is not None}
    indexes = {REGISTRY, "sm:{acme}:exp", "sm:{acme}:active", "sm:{gamma}:active"}  # from sm:exp, sm:active
    assert set(after) == renamed | indexes, "each key under its new name; sm:exp, sm:runs, sm:active gone"
    assert json.loads(json.dumps(await session.answers(store))) == V1["expect"]  # as the file holds it

    # Again: nothing to do, nothing changed.
    assert "Nothing to migrate" in await migrate(server.url, capsys)
    assert names(server.url) == after

    # The same store serves calls now (no restart), for every tenant, with its budgets.
    a = await store.admit(Ask("acme", "r-1", session.T0, Limits()), Turn(reserve=(1, 10)))
    assert a.calls == 5 and a.remaining["tenant_day"] == 25_000_000 - 3_003 - 5_300 - 10
    await store.settle(a, 10)
    # The calls that were in flight are charged at their reservation when they expire.
    assert await store.expire(session.T0 + timedelta(seconds=931)) == 2
    assert await store.spend_detail("acme", day="2026-05-14") == Spend(3_003 + 5_300 + 10, 0)
    assert await store.spend_detail("acme", run_id="r-2") == Spend(300, 0)
    with redis.Redis.from_url(server.url, decode_responses=True) as r:
        assert r.smembers(REGISTRY) == {"acme", "beta:x/y{z}", "gamma"}, "the sweeps walk every tenant"


async def test_keys_a_new_proxy_wrote_first_are_merged(server: RedisServer, store: Store,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    await store.run_add("acme", "r-1", {"calls": 1, "output_tokens": 2})  # totals: added
    await store.budget_set("acme", None, 7_000_000)  # the admin's latest budget: kept
    out = await migrate(server.url, capsys)
    assert "2 merged into keys a new proxy had written" in out, out
    assert await store.run_totals("acme", "r-1") == {"calls": 4, "input_tokens": 303, "output_tokens": 23}
    assert await store.budget_get("acme") == (None, 7_000_000)


async def test_a_cluster_or_sqlite_ledger_has_nothing_to_migrate(capsys: pytest.CaptureFixture[str],
                                                                tmp_path: Path) -> None:
    assert await cli("ledger", "migrate-keys", "--ledger", "redis+cluster://127.0.0.1:1") == 2
    assert "redis-cli --cluster import" in capsys.readouterr().err
    assert await cli("ledger", "migrate-keys", "--ledger", f"sqlite:///{tmp_path}/l.db") == 2
    assert "Only a Redis ledger" in capsys.readouterr().err


async def test_an_unreachable_redis_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    down = RedisServer(Path("/nonexistent"))  # never started: its port is free
    assert await cli("ledger", "migrate-keys", "--ledger", down.url) == 1
    assert "could not be migrated" in capsys.readouterr().err


@pytest.mark.skipif(CLI is None, reason=CLUSTER_SKIP_REASON)
async def test_migrated_keys_copied_into_a_cluster_answer_the_same(server: RedisServer, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """docs/operations.md's way to a Cluster: migrate on the one Redis, `redis-cli --cluster import`."""
    await migrate(server.url, capsys)
    cluster = LocalCluster(tmp_path / "cluster")  # its own: the import brings the registry along
    cluster.start()
    try:
        assert CLI is not None
        done = subprocess.run([CLI, "--cluster", "import", f"127.0.0.1:{cluster.nodes[0].port}",
                               "--cluster-from", f"127.0.0.1:{server.port}", "--cluster-copy"],
                              capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stdout + done.stderr
        store = open_store(cluster.url)
        try:
            assert json.loads(json.dumps(await session.answers(store))) == V1["expect"]
            assert await store.expire(session.T0 + timedelta(seconds=931)) == 2, "the registry came along"
        finally:
            await store.aclose()
    finally:
        cluster.stop()
