"""`spanmeter ledger migrate-keys`: a Redis ledger from the layout before hash tags to today's.

Before, keys were `sm:<kind>:<tenant>:<...>` with three global sorted sets (`sm:exp`,
`sm:runs`, `sm:active`) in every admission, which only one Redis can serve. Now every
key of a tenant is `sm:{<tenant>}:<kind>:<...>` (one Redis Cluster slot per tenant) and
those sets are per tenant (proxy/ledger/redis.py). The parts are percent-encoded the same
way in both, so each old key has exactly one new name.

Each step is one atomic script on the one Redis the old layout lived on, and does nothing
the second time, so the command can be run again after any interruption:

1. every reservation (`sm:res:*`) moves with its place in the expiry set, and the scopes
   it names are renamed inside it: calls in flight are settled or charged at their
   reserved amount as before;
2. every other key moves (RENAME keeps its time to live); a key the new layout already
   has (a new proxy wrote it first) is merged: money and counts added, the newer value
   kept for the rest;
3. the runs in the global active set move to their tenant's;
4. the tenants found join the registry `sm:tenants`;
5. last, `sm:exp` and `sm:runs` (the global index of every tenant's `sm:runs:<tenant>`)
   are deleted: while they exist, new proxies refuse calls (503) rather than count spend
   from zero.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from proxy.errors import ConfigError, StoreUnavailable
from proxy.ledger.redis import OLD_LAYOUT, REGISTRY, _redact, is_cluster_url, key

__all__ = ["MERGE", "MigrationReport", "migrate_keys", "new_name"]

_LUA = Path(__file__).with_name("lua") / "migrate"
# How a kind of key merges when its new name exists already (migrate/key.lua).
MERGE = {"run": "run", "day": "add", "month": "add", "total": "add", "keyday": "add", "keymonth": "add",
         "totals": "add", "runs": "zmax", "tools": "fill", "toolseq": "max", "ctx": "max", "budget": "keep",
         "rate": "keep"}
_EXP, _RUNS, _ACTIVE = OLD_LAYOUT


@dataclass
class MigrationReport:
    moved: Counter[str] = field(default_factory=Counter)  # kind -> keys renamed
    merged: Counter[str] = field(default_factory=Counter)  # kind -> keys merged into an existing new key
    reservations: int = 0
    active_runs: int = 0
    tenants: set[str] = field(default_factory=set)
    left: list[str] = field(default_factory=list)  # old-layout keys this run did not recognise

    @property
    def changed(self) -> int:
        return sum(self.moved.values()) + sum(self.merged.values()) + self.reservations + self.active_runs


def new_name(old: str) -> tuple[str, str, str] | None:
    """(new name, kind, tenant) of a key of the old layout; None for anything else (new keys too)."""
    parts = old.split(":")
    if len(parts) < 3 or parts[0] != "sm":
        return None
    kind, encoded = parts[1], parts[2]
    if kind == "res" and len(parts) == 3:
        encoded = unquote(encoded).rpartition(".")[0]  # the id is "<tenant encoded>.<uuid hex>"
    elif kind not in MERGE:
        return None
    tenant = unquote(encoded)
    # Both layouts encode each part alike (quote, safe=""): only the order and the braces change.
    rest = parts[2:] if kind == "res" else parts[3:]  # a reservation keeps its id, tenant and all
    return ":".join([key(tenant, kind), *rest]), kind, tenant


async def migrate_keys(url: str, *, dry_run: bool = False) -> MigrationReport:
    """Migrate the ledger at `url` (one Redis) in place; see the module's docstring."""
    if is_cluster_url(url):
        raise ConfigError(
            "The key layout before hash tags only ever lived on one Redis (it could not run on a Cluster): run "
            "`spanmeter ledger migrate-keys` against that Redis (redis://...), then move the keys to the Cluster "
            "with `redis-cli --cluster import` (docs/operations.md, 'Migrating Redis keys').")
    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise ConfigError(f"Only a Redis ledger has keys to migrate, not {url!r}.")
    client = aioredis.Redis.from_url(url, decode_responses=True)
    scripts = {p.stem: client.register_script(p.read_text(encoding="utf-8")) for p in _LUA.glob("*.lua")}
    report = MigrationReport()
    try:
        # 1. Reservations first: the scopes they name are still at their old names.
        async for old in client.scan_iter(match="sm:res:*", count=1000):
            found = new_name(str(old))
            if found is None:
                continue
            new, _, tenant = found
            held = await client.hmget(old, ["run", "day", "month", "total", "keyday", "keymonth"])
            names = [(new_name(str(n)) or ("", "", ""))[0] if n else "" for n in held]
            report.tenants.add(tenant)
            if dry_run:
                report.reservations += 1
                continue
            report.reservations += int(await scripts["reservation"](keys=[old, new, _EXP, key(tenant, "exp")],
                                                                   args=names))
        # 2. Every other key of the old layout.
        async for old in client.scan_iter(match="sm:*", count=1000):
            found = new_name(str(old))
            if found is None:
                if not old.startswith("sm:{") and old not in (*OLD_LAYOUT, REGISTRY, "sm:sweeper"):
                    report.left.append(old)
                continue
            new, kind, tenant = found
            if kind == "res":
                continue  # moved above, or settled meanwhile
            report.tenants.add(tenant)
            if dry_run:
                report.moved[kind] += 1
                continue
            done = int(await scripts["key"](keys=[old, new], args=[MERGE[kind]]))
            if done == 1:
                report.moved[kind] += 1
            elif done == 2:
                report.merged[kind] += 1
        # 3. Active runs, from the global set to their tenant's.
        active: list[Any] = await client.zrange(_ACTIVE, 0, -1, withscores=True)
        for member, _ in active:
            tenant, run_id = json.loads(member)
            report.tenants.add(tenant)
            if dry_run:
                report.active_runs += 1
                continue
            report.active_runs += int(await scripts["active"](keys=[_ACTIVE, key(tenant, "active")],
                                                             args=[member, run_id]))
        if dry_run:
            return report
        # 4. The registry the sweeps walk; 5. the global indexes, last.
        if report.tenants:
            await client.sadd(REGISTRY, *sorted(report.tenants))
        await client.delete(_EXP, _RUNS, _ACTIVE)
        return report
    except RedisError as exc:
        raise StoreUnavailable(f"The ledger at {_redact(url)} could not be migrated ({type(exc).__name__}: "
                               f"{exc}). Nothing half-done is lost: run the command again.") from exc
    finally:
        await client.aclose()
