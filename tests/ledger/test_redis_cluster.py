"""Redis Cluster: one tenant, one slot; every script declares its keys; cluster URLs.

The whole store contract runs on a real three-master cluster too (test_store_contract.py,
`cluster`); a master killed under load: tests/reliability/test_cluster_faults.py.
"""

from __future__ import annotations

import asyncio
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import redis
from redis.crc import key_slot

from proxy.errors import ConfigError
from proxy.ledger.backends import open_store
from proxy.ledger.redis import REGISTRY, RedisStore, key, tag
from proxy.ledger.store import Ask, GuardRule, Limits, Rate, ToolTurn, Turn
from tests.fixtures.redis import BINARY, SKIP_REASON, RedisServer
from tests.fixtures.redis_cluster import LocalCluster

LUA = Path(__file__).resolve().parents[2] / "proxy" / "ledger" / "lua"
T0 = datetime(2026, 5, 14, 12, 0, tzinfo=UTC)
# Names that try to break out of the hash tag or into another tenant's keys.
AWKWARD = ["acme", "a}b{c", "", "{", "}", "x:y", "%7B", "{sm}:run"]


@pytest.mark.redis
async def test_every_key_a_tenant_touches_lives_in_its_one_slot(redis_cluster: LocalCluster) -> None:
    store = open_store(redis_cluster.url)
    try:
        for i, tenant in enumerate(AWKWARD):
            turn = Turn(reserve=(1, 50), key="k1k1k1k1", rates=(Rate("tenant", "requests", 100, 1),),
                        context=("response:r1",), trace={"ids": i}, guard=GuardRule(threshold=5, refuse=False))
            a = await store.admit(Ask(tenant, f"run:{i}/x", T0, Limits(), ttl_s=60), turn)
            await store.settle(a, 20, run_totals={"calls": 1}, tools=[{"id": "c1", "name": "f", "sig": "f:1"}],
                               contexts={"response:r2": 10})
            await store.admit(Ask(tenant, f"run:{i}/x", T0, Limits(), ttl_s=60),
                              Turn(reserve=(1, 50), results=(("c1", True),)))  # stays in flight: expires below
            t = await store.admit_tool(Ask(tenant, f"run:{i}/x", T0, Limits()), ToolTurn(name="f", sig="f:1", cost=5))
            await store.release(t)
            await store.budget_set(tenant, 1_000_000, None)
            await store.run_add(tenant, "other", {"calls": 1})
            await store.tools_put(tenant, "other", [{"id": "c2", "name": "g"}])
            assert [c["id"] for c in await store.tools_take(tenant, "other", ["c2"])] == ["c2"]
        assert await store.expire(T0 + timedelta(seconds=61)) >= len(AWKWARD)
        for tenant in AWKWARD:
            assert await store.spend(tenant) == 20 + 50, tenant  # nobody reached another's keys
            assert await store.run_end(tenant, f"run:{AWKWARD.index(tenant)}/x") is not None
    finally:
        await store.aclose()
    checked = 0
    for node in redis_cluster.nodes:  # every key on every node, the contract suite's too
        with redis.Redis(port=node.port, decode_responses=True) as r:
            for name in r.scan_iter("sm:*", count=1000):
                if name in (REGISTRY, "sm:sweeper"):
                    continue
                assert name.startswith("sm:{"), name
                prefix = name[: name.index("}") + 1]
                assert key_slot(name.encode()) == key_slot(prefix.encode()), name
                checked += 1
    with redis.Redis(port=redis_cluster.nodes[0].port, decode_responses=True) as r:
        slots = {int(r.execute_command("CLUSTER KEYSLOT", key(t, kind))) for t in AWKWARD
                 for kind in ("run", "exp", "active", "runs", "budget")}
    assert len(slots) > 1, "tenants spread over the cluster"
    assert checked > 100


def test_the_tag_is_the_tenant_encoded() -> None:
    assert tag("acme") == "sm:{acme}"
    assert tag("a}b{c") == "sm:{a%7Db%7Bc}"
    assert tag("") == "sm:{%}", "an empty tag would hash each key whole"
    assert key("a}b", "run", "r:1/2") == "sm:{a%7Db}:run:r%3A1%2F2"
    assert len({tag(t) for t in AWKWARD}) == len(AWKWARD)


# `redis.call('CMD', <key>, ...)`: the key must be one of KEYS (or a table made of KEYS only).
_CALL = re.compile(r"redis\.call\('(\w+)',\s*([^,)]+)")
_FROM_KEYS = re.compile(r"^(KEYS\[[^\]]+\]|scope_keys\[[^\]]+\])$")


def test_every_script_touches_only_the_keys_it_declares() -> None:
    scripts = sorted(LUA.rglob("*.lua"))
    assert len(scripts) >= 12
    for path in scripts:
        text = path.read_text()
        assert "KEYS:" in text, f"{path.name} documents its KEYS"
        for command, first in _CALL.findall(text):
            assert _FROM_KEYS.match(first.strip()), f"{path.name}: redis.call('{command}', {first}) names no KEYS"
        for table in re.findall(r"local scope_keys = \{([^}]*)\}", text):
            assert all(re.fullmatch(r"KEYS\[\d+\]", k.strip()) for k in table.split(",")), path.name


@pytest.mark.parametrize(("url", "problem"), [
    ("redis+cluster://", "No node"),
    ("redis+cluster://h1:6379/3", "only database 0"),
    ("redis+cluster://h1", "is not HOST:PORT"),
    ("redis+cluster://:s3cret@h1:6379,h2/0", "is not HOST:PORT"),
])
def test_a_bad_cluster_url_is_a_config_error(url: str, problem: str) -> None:
    with pytest.raises(ConfigError, match=problem) as ei:
        open_store(url)
    assert "s3cret" not in ei.value.message


async def test_a_cluster_url_names_every_seed_node() -> None:
    store = open_store("rediss+cluster://user:pw@10.0.0.1:7000,10.0.0.2:7001,[::1]:7002", leases=False)
    assert isinstance(store, RedisStore) and store.cluster
    seeds = sorted((n.host, n.port) for n in store._redis.startup_nodes)
    assert seeds == [("10.0.0.1", 7000), ("10.0.0.2", 7001), ("::1", 7002)]
    await store.aclose()


@pytest.mark.redis
@pytest.mark.skipif(BINARY is None, reason=SKIP_REASON)
@pytest.mark.parametrize("kind", ["redis", "cluster"])
async def test_one_replica_sweeps_in_each_period(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """Every tenant is walked by the sweep: on a shared ledger one replica does it per period."""
    if kind == "redis":
        server = RedisServer(tmp_path)  # its own: a proxy of another test may hold the session one's lease
        server.start()
        request.addfinalizer(server.stop)
        url = server.url
    else:
        url = request.getfixturevalue("redis_cluster").url
    replicas = [open_store(url) for _ in range(4)]
    try:
        for _ in range(2):
            turns = await asyncio.gather(*(r.sweep_turn(0.2) for r in replicas))
            assert sorted(turns) == [False, False, False, True]
            await asyncio.sleep(0.2)  # the lease lapses a little before the period ends
    finally:
        for r in replicas:
            await r.aclose()
