"""Ledger operations per model call, per second, for both ledgers.

    .venv/bin/python bench/bench_ledger.py [--n 5000] [--concurrency 1,16,128]
        [--modes separate,combined] [--stores sqlite,sqlite-normal,redis,cluster] [--cost]
        [--max-tokens]

One "pair" is what the proxy does per model call: an admit (reserve on run, day and
month; count the call), then the bookkeeping after the answer, either

    separate  settle, tools_put (every second call carries a tool call), run_add:
              three operations, three commits / round trips (the proxy before 2026-05)
    combined  settle(..., run_totals=..., tools=...): one operation

`sqlite` runs with synchronous=FULL (the default: every result is on disk before it is
returned), `sqlite-normal` with synchronous=NORMAL (durable across process crashes, not
power loss). Redis is a local redis-server started on a free port; `cluster` a local
Redis Cluster of three masters (redis-server --cluster-enabled yes, redis-cli --cluster
create), one tenant's keys on one of them. Numbers are for this machine only.

--cost measures, instead, what one admit and one settle cost the Redis servers: commands
(INFO commandstats: the EVALSHA and the commands its script runs), the script's time (usec
per EVALSHA), the servers' whole CPU (INFO cpu, user + sys: network I/O included), and
bytes on the wire each way (INFO stats total_net_input_bytes / total_net_output_bytes),
summed over every node, for --n admissions then --n settles at concurrency 16. These are the figures docs/scale.md sizes
Redis shards from.

--max-tokens runs every admission under a run token ceiling (runs.max_tokens), each call
holding its worst case in tokens until its settle replaces it (issue 26); on code from
before token holds (a --baseline checkout) the ceiling is only read.

--cpu measures, instead, what the serving process spends per pair (combined mode, the
proxy's: an admit carrying the run's trace ids, then one settle with totals and every
second call a tool call) at each --concurrency, on uvloop as the proxy runs: process CPU
(time.process_time: every thread), the event-loop thread's (time.thread_time on it) and
the ledger's own thread's (its CPU clock), in microseconds per pair, plus the wall rate.
--repeat runs each level several times (interleaved with the other stores).

--leases runs each --cpu level twice, without and with budget leases (proxy/ledger/leases.py;
rows `store+leases`), side by side. --runs N spreads the calls over N runs (default 100; 0:
every call its own run, as calls without an X-Run-Id are).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import redis

from proxy.ledger.backends import open_store
from proxy.ledger.store import Admission, Ask, Limits, Store, Turn
from tests.fixtures.redis import BINARY, RedisServer
from tests.fixtures.redis_cluster import CLI, LocalCluster

LIMITS = Limits(run_max_calls=10**9, run_max_cost=10**15, day_budget=10**15, month_budget=10**15)
TOTALS = {"calls": 1, "input_tokens": 812, "output_tokens": 97, "cost_micros": 1_234}


def _tools(i: int) -> list[dict[str, Any]]:
    if i % 2:
        return []
    return [{"id": f"call-{i}", "name": "search", "arguments": '{"q": "x"}', "delivered_ns": i, "link": None}]


TOKEN_LIMITS = Limits(run_max_calls=10**9, run_max_cost=10**15, day_budget=10**15, month_budget=10**15,
                      run_max_tokens=10**14)
# (least, most) tokens of a small chat call; older code has no token holds (see --max-tokens)
TOKEN_TURN = Turn(reserve=(1, 5_000), tokens=(900, 5_000))
TURN = Turn(reserve=(1, 5_000))
_token_ceiling = False


async def one(store: Store, i: int, mode: str, latencies: list[float]) -> None:
    start = time.perf_counter()
    tenant, run_id = "bench", f"run-{i % 100}"
    limits, turn = (TOKEN_LIMITS, TOKEN_TURN) if _token_ceiling else (LIMITS, TURN)
    admission = await store.admit(Ask(tenant, run_id, datetime.now(UTC), limits), turn)
    latencies.append(time.perf_counter() - start)
    tools = _tools(i)
    if mode == "combined":
        await store.settle(admission, 1_234, run_totals=TOTALS, tools=tools)
        return
    await store.settle(admission, 1_234)
    if tools:
        await store.tools_put(tenant, run_id, tools)
    await store.run_add(tenant, run_id, TOTALS)


async def measure(url: str, mode: str, n: int, concurrency: int) -> tuple[float, float, float]:
    store = open_store(url)
    await store.ping()
    latencies: list[float] = []
    gate = asyncio.Semaphore(concurrency)

    async def limited(i: int) -> None:
        async with gate:
            await one(store, i, mode, latencies)

    for i in range(200):  # warm up: connections, scripts, page cache
        await one(store, i, mode, [])
    start = time.perf_counter()
    await asyncio.gather(*(limited(i) for i in range(n)))
    elapsed = time.perf_counter() - start
    await store.aclose()
    latencies.sort()
    p50 = statistics.median(latencies) * 1e3
    p99 = latencies[int(len(latencies) * 0.99) - 1] * 1e3
    return n / elapsed, p50, p99


TRACE = {"trace_id": "4bf92f3577b34da6a3ce929d0e0e4736", "span_id": "00f067aa0ba902b7"}


def _thread_clock(name: str) -> int | None:
    """The CPU clock of this process's thread called `name` (None when there is none)."""
    for thread in threading.enumerate():
        if thread.name == name and thread.ident is not None:
            return time.pthread_getcpuclockid(thread.ident)
    return None


async def cpu(url: str, n: int, concurrency: int, leases: bool | None = None, runs: int = 100) -> dict[str, float]:
    """CPU per pair: the whole process, the event-loop thread, the ledger's thread (us)."""
    store = open_store(url, leases=leases)
    await store.ping()
    gate = asyncio.Semaphore(concurrency)
    turn = Turn(reserve=(1, 5_000), trace=TRACE)

    async def pair(i: int) -> None:
        async with gate:
            run_id = f"run-{i % runs}" if runs else f"run-{i}-{concurrency}"
            admission = await store.admit(Ask("bench", run_id, datetime.now(UTC), LIMITS), turn)
            await store.settle(admission, 1_234, run_totals=TOTALS, tools=_tools(i) or None)

    await asyncio.gather(*(pair(i) for i in range(300)))  # warm up: page cache, statement cache
    clock = _thread_clock("spanmeter-ledger")
    ledger0 = time.clock_gettime(clock) if clock is not None else 0.0
    proc0, loop0, wall0 = time.process_time(), time.thread_time(), time.perf_counter()
    await asyncio.gather(*(pair(i) for i in range(n)))
    proc, loop, wall = time.process_time() - proc0, time.thread_time() - loop0, time.perf_counter() - wall0
    ledger = time.clock_gettime(clock) - ledger0 if clock is not None else float("nan")
    await store.aclose()
    return {"process": proc / n * 1e6, "loop": loop / n * 1e6, "ledger": ledger / n * 1e6, "rate": n / wall}


def _counters(ports: list[int]) -> dict[str, float]:
    """EVALSHA calls and usec, and network bytes in and out, summed over the nodes."""
    total: dict[str, float] = {"calls": 0, "usec": 0, "in": 0, "out": 0, "commands": 0, "cpu": 0}
    for port in ports:
        with redis.Redis(port=port) as r:
            stats = r.info("commandstats")
            net = r.info("stats")
            cpu = r.info("cpu")
        total["cpu"] += (cpu["used_cpu_user"] + cpu["used_cpu_sys"]) * 1e6  # usec, network I/O included
        for name, c in stats.items():
            if name in ("cmdstat_info", "cmdstat_config|resetstat", "cmdstat_config"):
                continue
            total["commands"] += c["calls"]
            if name in ("cmdstat_evalsha", "cmdstat_eval"):
                total["calls"] += c["calls"]
                total["usec"] += c["usec"]
        total["in"] += net["total_net_input_bytes"]
        total["out"] += net["total_net_output_bytes"]
    return total


def _reset(ports: list[int]) -> None:
    for port in ports:
        with redis.Redis(port=port) as r:
            r.config_resetstat()


async def cost(url: str, ports: list[int], n: int) -> list[tuple[str, dict[str, float]]]:
    """Per admit and per settle (combined, with totals and every second call a tool call)."""
    store = open_store(url)
    for i in range(200):
        await one(store, i, "combined", [])
    gate = asyncio.Semaphore(16)
    admissions: list[Admission] = []

    async def admit(i: int) -> None:
        async with gate:
            admissions.append(await store.admit(Ask("bench", f"run-{i % 100}", datetime.now(UTC), LIMITS), TURN))

    async def settle(i: int, a: Admission) -> None:
        async with gate:
            await store.settle(a, 1_234, run_totals=TOTALS, tools=_tools(i))

    rows = []
    for op, work in (("admit", lambda: [admit(i) for i in range(n)]),
                     ("settle", lambda: [settle(i, a) for i, a in enumerate(admissions)])):
        _reset(ports)
        before = _counters(ports)
        await asyncio.gather(*work())
        after = _counters(ports)
        rows.append((op, {k: (after[k] - before[k]) / n for k in after}))
    await store.aclose()
    return rows


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=5000)
    parser.add_argument("--concurrency", default="1,16,128")
    parser.add_argument("--modes", default="separate,combined")
    parser.add_argument("--stores", default="sqlite,sqlite-normal,redis,cluster")
    parser.add_argument("--cost", action="store_true", help="Redis cost per admit and settle instead")
    parser.add_argument("--max-tokens", action="store_true", help="admissions under a run token ceiling")
    parser.add_argument("--cpu", action="store_true", help="the serving process's CPU per pair instead")
    parser.add_argument("--repeat", type=int, default=1, help="--cpu: runs of each level")
    parser.add_argument("--leases", action="store_true", help="--cpu: each store without and with budget leases")
    parser.add_argument("--runs", type=int, default=100, help="--cpu: runs the calls spread over (0: one each)")
    parser.add_argument("--zero-counters", action="store_true",
                        help="settles also carry the seven run counters a call adds zero to, as the proxy wrote "
                             "them before it wrote only what a call adds")
    return parser.parse_args()


async def main(args: argparse.Namespace) -> None:
    global _token_ceiling
    _token_ceiling = args.max_tokens
    if args.zero_counters:
        TOTALS.update(dict.fromkeys(("tool_failures", "tool_calls", "failures", "repairs", "cache_read_tokens",
                                     "cost_saved_micros", "cache_write_premium_micros"), 0))
    levels = [int(c) for c in args.concurrency.split(",")]
    modes = args.modes.split(",")
    wanted = args.stores.split(",")

    with tempfile.TemporaryDirectory() as tmp:
        targets = {
            "sqlite": f"sqlite:///{tmp}/ledger.db",
            "sqlite-normal": f"sqlite:///{tmp}/ledger-normal.db?synchronous=normal",
        }
        server = cluster = None
        ports: dict[str, list[int]] = {}
        if BINARY and "redis" in wanted:
            server = RedisServer(Path(tmp))
            server.start()
            targets["redis"] = server.url
            ports["redis"] = [server.port]
        if BINARY and CLI and "cluster" in wanted:
            cluster = LocalCluster(Path(tmp) / "cluster")
            cluster.start()
            targets["cluster"] = cluster.url
            ports["cluster"] = [node.port for node in cluster.nodes]
        try:
            if args.cpu:
                variants: tuple[bool | None, ...] = (False, True) if args.leases else (None,)
                print(f"{'store':14} {'conc':>5} {'pairs/s':>9} {'process us':>11} {'loop us':>8} {'ledger us':>10}")
                for c in levels:
                    for _ in range(args.repeat):
                        for (name, url), leased in itertools.product(targets.items(), variants):
                            if name not in wanted:
                                continue
                            r = await cpu(url, args.n, c, leased, args.runs)
                            label = f"{name}+leases" if leased else name
                            print(f"{label:14} {c:>5} {r['rate']:>9,.0f} {r['process']:>11.1f} {r['loop']:>8.1f} "
                                  f"{r['ledger']:>10.1f}", flush=True)
                return
            if args.cost:
                print(f"{'store':8} {'op':7} {'commands':>9} {'EVALSHA usec':>13} {'server CPU usec':>16} "
                      f"{'bytes in':>9} {'bytes out':>10}")
                for name, nodes in ports.items():
                    for op, c in await cost(targets[name], nodes, args.n):
                        print(f"{name:8} {op:7} {c['commands']:>9.2f} {c['usec'] / max(c['calls'], 1):>13.1f} "
                              f"{c['cpu']:>16.1f} {c['in']:>9.0f} {c['out']:>10.0f}", flush=True)
                return
            print(f"{'store':14} {'mode':9} {'conc':>5} {'pairs/s':>9} {'admit p50 ms':>13} {'p99 ms':>8}")
            for name, url in targets.items():
                if name not in wanted:
                    continue
                for mode in modes:
                    for c in levels:
                        rate, p50, p99 = await measure(url, mode, args.n, c)
                        print(f"{name:14} {mode:9} {c:>5} {rate:>9,.0f} {p50:>13.3f} {p99:>8.3f}", flush=True)
        finally:
            if server is not None:
                server.stop()
            if cluster is not None:
                cluster.stop()


if __name__ == "__main__":
    options = parse()
    if options.cpu:
        import uvloop  # the proxy's loop (proxy/ops/cli.py)

        uvloop.run(main(options))
    else:
        asyncio.run(main(options))
