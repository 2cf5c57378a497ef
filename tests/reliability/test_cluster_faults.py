"""A Redis Cluster master killed under load, with no replica to take over.

The calls of a tenant whose slot that master served fail closed (503, saying which tenant,
slot and what to check); the other tenants' calls go on, on every replica, and their spend is
exact; readiness holds. When the master comes back, the tenant is served again without a
restart. (With replicas, Redis promotes one after cluster-node-timeout: docs/scale.md.)
With budget leases on, a tenant's calls a lease already holds are served for at most the
lease's life (LEASE_S) after its master died; then they fail closed alike.
"""

from __future__ import annotations

import asyncio
import time

import orjson
import pytest

from proxy.config import hash_key
from proxy.ledger.leases import LEASE_S
from proxy.ledger.redis import tag
from proxy.serve.appkeys import STORE
from tests.fixtures.redis import BINARY
from tests.fixtures.redis_cluster import CLI, CLUSTER_SKIP_REASON, LocalCluster
from tests.reliability.dialects import DIALECTS, Reply, post

pytestmark = [pytest.mark.redis, pytest.mark.skipif(BINARY is None or CLI is None, reason=CLUSTER_SKIP_REASON)]


def _tenants(cluster: LocalCluster) -> tuple[str, list[str]]:
    """A tenant on the first master (the one killed), and one on each other master."""
    by_node: dict[int, str] = {}
    for i in range(200):
        name = f"tenant-{i}"
        by_node.setdefault(cluster.node_of(tag(name)).port, name)
    doomed = by_node.pop(cluster.nodes[0].port)
    return doomed, sorted(by_node.values())


async def _get(url: str) -> int:
    import aiohttp

    async with aiohttp.ClientSession() as s, s.get(url) as r:
        return r.status


@pytest.mark.parametrize("leases", [False, True], ids=["exact", "leases"])
async def test_a_dead_master_fails_its_tenants_closed_and_no_one_else(make_proxy, monkeypatch_env, tmp_path, leases):
    monkeypatch_env("SPANMETER_LEDGER_LEASES", str(leases).lower())
    cluster = LocalCluster(tmp_path / "cluster", node_timeout_ms=500, full_coverage=False)
    cluster.start()
    try:
        doomed, alive = _tenants(cluster)
        monkeypatch_env("OPENAI_API_KEY", "sk-upstream")
        tenants = {t: {"keys": [hash_key(f"key-{t}")]} for t in [doomed, *alive]}
        proxies = [await make_proxy(ledger_url=cluster.url, tenants=tenants) for _ in range(2)]  # two replicas
        d = DIALECTS[0]
        log: list[tuple[str, float, Reply]] = []
        stop = asyncio.Event()

        async def agent(tenant: str, n: int) -> None:
            proxy = proxies[n % 2]
            while not stop.is_set():
                started = time.monotonic()
                r = await post(proxy.url, d.path(False), d.body("hi", False), key=f"key-{tenant}",
                               headers={"X-Run-Id": f"run-{n}"})
                log.append((tenant, started, r))

        agents = [asyncio.create_task(agent(t, n)) for t in [doomed, *alive] for n in range(3)]
        deadline = time.monotonic() + 15  # a busy machine may take a while to serve every tenant once
        while {t for t, _, r in log if r.status == 200} != {doomed, *alive}:
            assert time.monotonic() < deadline, "all served before"
            await asyncio.sleep(0.05)
        cluster.nodes[0].stop()  # SIGKILL, no persistence, no replica
        killed = time.monotonic()
        await asyncio.sleep(1.0)  # past cluster-node-timeout: the others mark it failed meanwhile
        assert await _get(proxies[0].url + "/readyz") == 200, "ready: the other shards answer"
        late = await make_proxy(ledger_url=cluster.url, tenants=tenants)  # a replica started while it is down
        for tenant in alive:
            r = await post(late.url, d.path(False), d.body("hi", False), key=f"key-{tenant}",
                           headers={"X-Run-Id": "late"})
            assert r.status == 200, (tenant, r.body)
        grace = LEASE_S + 0.05 if leases else 0.05  # a lease taken before the kill serves until it expires
        while not any(t == doomed and started > killed + grace for t, started, _ in log):
            assert time.monotonic() < killed + grace + 15, "the doomed tenant's agents went on"
            await asyncio.sleep(0.05)
        stop.set()
        await asyncio.gather(*agents)

        after = [(t, r) for t, started, r in log if started > killed + 0.05]
        doomed_after = [r for t, started, r in log if t == doomed and started > killed + grace]
        assert doomed_after and {r.status for r in doomed_after} == {503}
        message = d.error_message(orjson.loads(doomed_after[-1].body))
        assert f"unreachable for tenant {doomed}, whose keys live in Redis Cluster slot" in message, message
        assert "No call is forwarded" in message
        for tenant in alive:
            served = [r.status for t, r in after if t == tenant]
            assert served and set(served) == {200}, (tenant, served)

        for proxy in proxies:
            await proxy.settled()
        store = proxies[0].app[STORE]
        await late.settled()
        for tenant in alive:  # every answered call counted, on a ledger the replicas share
            answered = sum(1 for t, _, r in log if t == tenant and r.status == 200)
            counted_by = time.monotonic() + LEASE_S + 3  # the other replica's leases go back within LEASE_S
            while True:
                counted = sum([await store.run_calls(tenant, f"run-{n}") for n in range(3)])
                reserved = (await store.spend_detail(tenant)).reserved
                if (counted, reserved) == (answered, 0) or time.monotonic() > counted_by:
                    break
                await asyncio.sleep(0.1)
            assert counted == answered, tenant
            assert reserved == 0, "every call settled"

        cluster.nodes[0].start()  # back on its port with its slots (and none of its data)
        cluster.wait_ok()
        r = await post(proxies[1].url, d.path(False), d.body("hi", False), key=f"key-{doomed}")
        assert r.status == 200, r.body
    finally:
        cluster.stop()


async def test_a_replica_takes_over_a_dead_master_and_its_tenants_come_back(make_proxy, monkeypatch_env, tmp_path):
    """Three masters, a replica each: the replica of the killed master is promoted after
    cluster-node-timeout, and the proxy follows the new layout without a restart. (Exact
    calls: with budget leases, the first test shows what a lease serves meanwhile.)"""
    monkeypatch_env("SPANMETER_LEDGER_LEASES", "false")
    cluster = LocalCluster(tmp_path / "cluster", replicas=1, node_timeout_ms=500, full_coverage=False)
    cluster.start()
    try:
        doomed, alive = _tenants(cluster)
        monkeypatch_env("OPENAI_API_KEY", "sk-upstream")
        tenants = {t: {"keys": [hash_key(f"key-{t}")]} for t in [doomed, *alive]}
        proxy = await make_proxy(ledger_url=cluster.url, tenants=tenants)
        d = DIALECTS[0]

        async def call(tenant: str) -> Reply:
            return await post(proxy.url, d.path(False), d.body("hi", False), key=f"key-{tenant}",
                              headers={"X-Run-Id": "failover"})

        assert {(await call(t)).status for t in [doomed, *alive]} == {200}
        master = cluster.node_of(tag(doomed))
        master.stop()
        statuses: list[int] = []
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            replies = await asyncio.gather(*(call(t) for t in [doomed, *alive]))
            assert [r.status for r in replies[1:]] == [200] * len(alive), "the other shards never stopped"
            statuses.append(replies[0].status)
            if replies[0].status == 200:
                break
            await asyncio.sleep(0.05)
        assert statuses[-1] == 200, f"no promotion within 15 s: {statuses[-5:]}"
        assert set(statuses[:-1]) <= {503}, "until the replica took over, the tenant failed closed"
        # The proxy followed the promotion; the node the fixture asks may hear of it a
        # gossip round later.
        view_deadline = time.monotonic() + 10
        while cluster.node_of(tag(doomed)) is master and time.monotonic() < view_deadline:
            await asyncio.sleep(0.1)
        assert cluster.node_of(tag(doomed)) is not master
        await proxy.settled()
        # What the promoted replica had of the tenant's ledger (asynchronous replication) is there.
        assert await proxy.app[STORE].run_calls(doomed, "failover") >= 1
    finally:
        cluster.stop()
