"""Writes tests/data/ledger/redis_v1.json: a Redis ledger in the key layout before hash tags.

The keys were written by the RedisStore of commit e45afe4 (`sm:<kind>:<tenant>:...`, global
`sm:exp`, `sm:runs`, `sm:active`), the last layout `spanmeter ledger migrate-keys` moves
from. To write it again, run this with that commit's code first on the path:

    git worktree add /tmp/spanmeter-v1 e45afe4
    PYTHONPATH=/tmp/spanmeter-v1 python tests/data/ledger/redis_v1_session.py

The file holds every key (type, value, ms to live) and what the old store answered about
them (`expect`), which the migrated ledger must answer the same.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from proxy.ledger.backends import open_store
from proxy.ledger.store import Ask, Limits, Rate, Store, ToolTurn, Turn
from tests.fixtures.redis import RedisServer

OUT = Path(__file__).with_name("redis_v1.json")
T0 = datetime(2026, 5, 14, 12, 0, tzinfo=UTC)
TENANTS = ["acme", "beta:x/y{z}", "gamma"]


async def session(store: Store) -> None:
    limits = Limits(day_budget=50_000_000, month_budget=900_000_000)
    # acme: a run of settled calls with totals, tool calls and a stored response; a key's scopes.
    for i in range(3):
        a = await store.admit(Ask("acme", "r-1", T0, limits),
                              Turn(reserve=(10, 5_000), key="k1k1k1k1", rates=(Rate("tenant", "requests", 100, 1),),
                                   trace={"trace_id": 2**127 + i}))
        await store.settle(a, 1_000 + i, run_totals={"calls": 1, "input_tokens": 100 + i, "output_tokens": 7},
                           tools=[{"id": f"c{i}", "name": "search", "arguments": "{}", "sig": "search:x"}],
                           contexts={"response:resp_1": 4_000 + i})
    await store.admit(Ask("acme", "r-1", T0, limits),
                      Turn(reserve=(10, 5_000), results=(("c0", True),)))  # closes c0; stays in flight (reserved 5,000)
    await store.budget_set("acme", 25_000_000, None)
    await store.admit_tool(Ask("acme", "r-2", T0 + timedelta(seconds=30), limits),
                           ToolTurn(name="get_weather", sig="get_weather:oslo", cost=300))  # an MCP call in flight
    # beta: separators and braces in the tenant name; an ended run; another day and month.
    b = await store.admit(Ask("beta:x/y{z}", "run:1/2", T0, Limits()), Turn(reserve=(1, 700)))
    await store.settle(b, 650)
    c = await store.admit(Ask("beta:x/y{z}", "run:1/2", T0 - timedelta(days=20), Limits()), Turn(reserve=(1, 700)))
    await store.settle(c, 20)
    await store.run_end("beta:x/y{z}", "run:1/2")
    await store.budget_set("beta:x/y{z}", 1_000_000, 2_000_000)
    # gamma: a reservation that expired (charged in full) and was never settled.
    await store.admit(Ask("gamma", "g-1", T0, Limits(), ttl_s=60), Turn(reserve=(1, 900)))
    await store.expire(T0 + timedelta(seconds=61))


async def answers(store: Store) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for tenant in TENANTS:
        runs = await store.list_runs(tenant)
        out[tenant] = {
            "total": list(await _detail(store, tenant)),
            "days": {d: list(await _detail(store, tenant, day=d)) for d in ("2026-05-14", "2026-04-24")},
            "months": {m: list(await _detail(store, tenant, month=m)) for m in ("2026-05", "2026-04")},
            "key_day": list(await _detail(store, tenant, day="2026-05-14", key_id="k1k1k1k1")),
            "key_month": list(await _detail(store, tenant, month="2026-05", key_id="k1k1k1k1")),
            "budget": list(await store.budget_get(tenant)),
            "runs": [{k: r[k] for k in ("run_id", "calls", "settled", "reserved", "ended", "trace", "totals")}
                     for r in runs],
            "run_spend": {r["run_id"]: list(await _detail(store, tenant, run_id=r["run_id"])) for r in runs},
            "tools": {r["run_id"]: await store.tools_pending(tenant, r["run_id"]) for r in runs},
        }
    out["idle"] = sorted(await store.idle_runs(T0 + timedelta(days=1)))
    return out


async def _detail(store: Store, tenant: str, **kw: Any) -> tuple[int, int]:
    d = await store.spend_detail(tenant, **kw)
    return d.settled, d.reserved


async def dump(url: str) -> dict[str, dict[str, Any]]:
    r = aioredis.Redis.from_url(url, decode_responses=True)
    keys: dict[str, dict[str, Any]] = {}
    async for name in r.scan_iter("*"):
        kind = await r.type(name)
        value: Any
        if kind == "hash":
            value = await r.hgetall(name)
        elif kind == "zset":
            value = await r.zrange(name, 0, -1, withscores=True)
        elif kind == "string":
            value = await r.get(name)
        else:
            raise AssertionError(f"{name}: {kind}")
        keys[name] = {"type": kind, "value": value, "pttl": await r.pttl(name)}
    await r.aclose()
    return dict(sorted(keys.items()))


async def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp))
        server.start()
        try:
            store = open_store(server.url)
            await session(store)
            expect = await answers(store)
            await store.aclose()
            keys = await dump(server.url)
        finally:
            server.stop()
    OUT.write_text(json.dumps({"about": __doc__.split("\n\n")[0], "expect": expect, "keys": keys}, indent=1) + "\n")
    print(f"{len(keys)} keys -> {OUT}")


if __name__ == "__main__":
    asyncio.run(main())
