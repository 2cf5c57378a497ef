"""Admissions per second for both ledgers, and what one admission adds to a request.

    .venv/bin/python bench/bench_ledger.py [--n 5000] [--concurrency 1,16,128]

Each operation is one admit (reserve on run, day and month; count the call) followed
by its settle, as the proxy does per model call. SQLite runs with synchronous=FULL (the
default: every result is on disk before it is returned). Redis is a local
redis-server started on a free port. Numbers are for this machine only.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from proxy.policy.store import Limits, Store, open_store
from tests.fixtures.redis import BINARY, RedisServer

LIMITS = Limits(run_max_calls=10**9, run_max_cost=10**15, day_budget=10**15, month_budget=10**15)


async def one(store: Store, i: int, latencies: list[float]) -> None:
    start = time.perf_counter()
    admission = await store.admit(
        "bench",
        f"run-{i % 100}",
        min_reserve=1,
        max_reserve=5_000,
        limits=LIMITS,
        now=datetime.now(UTC),
    )
    latencies.append(time.perf_counter() - start)
    await store.settle(admission, 1_234)


async def measure(url: str, n: int, concurrency: int) -> tuple[float, float, float]:
    store = open_store(url)
    await store.ping()
    latencies: list[float] = []
    gate = asyncio.Semaphore(concurrency)

    async def limited(i: int) -> None:
        async with gate:
            await one(store, i, latencies)

    for i in range(200):  # warm up: connections, scripts, page cache
        await one(store, i, [])
    start = time.perf_counter()
    await asyncio.gather(*(limited(i) for i in range(n)))
    elapsed = time.perf_counter() - start
    await store.aclose()
    latencies.sort()
    p50 = statistics.median(latencies) * 1e3
    p99 = latencies[int(len(latencies) * 0.99) - 1] * 1e3
    return n / elapsed, p50, p99


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=5000)
    parser.add_argument("--concurrency", default="1,16,128")
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]

    with tempfile.TemporaryDirectory() as tmp:
        targets = {"sqlite": f"sqlite:///{tmp}/ledger.db"}
        server = None
        if BINARY:
            server = RedisServer(Path(tmp))
            server.start()
            targets["redis"] = server.url
        try:
            print(f"{'store':8} {'conc':>5} {'admit+settle/s':>15} {'admit p50 ms':>13} {'p99 ms':>8}")
            for name, url in targets.items():
                for c in levels:
                    rate, p50, p99 = await measure(url, args.n, c)
                    print(f"{name:8} {c:>5} {rate:>15,.0f} {p50:>13.3f} {p99:>8.3f}")
        finally:
            if server is not None:
                server.stop()


if __name__ == "__main__":
    asyncio.run(main())
