"""A run's back-to-back calls through the SQLite ledger: how long the next call waits
before it can be forwarded.

What the proxy does per call of a run at one connection: the answer goes out, the settle
(run totals and the tool call the answer asked for) runs in the background, the run's
next request arrives (here 0.2 ms later), waits for that settle (proxy/serve/background.py
`settled`), then its own admission. The figure is the time from the next request's
arrival to its admission's return, in ms (p50, p90), per store setting, the code of this
checkout and, with --baseline DIR, the code of another checkout, alternating rounds:

    .venv/bin/python bench/bench_chain.py --n 400 --rounds 3 --baseline ../before

Real SqliteStore on a file in a temp dir (synchronous=FULL, the default), uvloop.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
T0 = datetime(2026, 5, 14, 12, 0, tzinfo=UTC)
ROUND_TRIP_S = 0.0002  # the answer to the agent and its next request back, on loopback


async def chain(path: str, n: int, tools: bool) -> dict[str, float]:
    from proxy.ledger.sqlite import SqliteStore
    from proxy.ledger.store import Limits

    store = SqliteStore(path)
    waits: list[float] = []
    previous: asyncio.Task[Any] | None = None
    try:
        for i in range(n):
            arrived = time.perf_counter()
            if previous is not None:
                await asyncio.wait([previous])  # the run's previous call is recorded
            admission = await store.admit("bench", "run-1", min_reserve=10, max_reserve=1000, limits=Limits(),
                                          now=T0)
            waits.append(time.perf_counter() - arrived)
            calls = [{"id": f"call_{i}", "name": "lookup", "arguments": "{}", "run": "run-1"}] if tools else None
            previous = asyncio.get_running_loop().create_task(store.settle(
                admission, 40, run_totals={"model_calls": 1, "input_tokens": 96, "output_tokens": 24}, tools=calls))
            await asyncio.sleep(ROUND_TRIP_S)
        if previous is not None:
            await previous
    finally:
        await store.aclose()
    waits.sort()
    return {"p50_ms": 1000 * statistics.median(waits), "p90_ms": 1000 * waits[int(len(waits) * 0.9)]}


def _child(args: argparse.Namespace) -> None:
    import uvloop

    sys.path.insert(0, args.code)
    out = {}
    for tools in (False, True):
        with tempfile.TemporaryDirectory() as tmp:
            out["with tool calls" if tools else "without"] = uvloop.run(chain(str(Path(tmp) / "l.db"), args.n, tools))
    print(json.dumps(out))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=400, help="calls per run measured")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--baseline", help="another checkout to measure alternately")
    p.add_argument("--code", help=argparse.SUPPRESS)  # the child: measure the code in this directory
    args = p.parse_args()
    if args.code:
        _child(args)
        return
    codes = {"this checkout": str(HERE.parent)} | ({"baseline": args.baseline} if args.baseline else {})
    results: dict[str, list[dict[str, dict[str, float]]]] = {k: [] for k in codes}
    for _ in range(args.rounds):
        for name, code in codes.items():
            done = subprocess.run([sys.executable, __file__, "--code", code, "--n", str(args.n)], check=True,
                                  capture_output=True, text=True, cwd=code, env={**os.environ, "PYTHONPATH": code})
            results[name].append(json.loads(done.stdout))
    print(f"the run's next call, arrival to admitted, ms (median of {args.rounds} rounds of {args.n} calls)")
    print("| code | kind of call | p50 | p90 |\n|---|---|---|---|")
    for name, rounds in results.items():
        for kind in rounds[0]:
            p50 = statistics.median(r[kind]["p50_ms"] for r in rounds)
            p90 = statistics.median(r[kind]["p90_ms"] for r in rounds)
            print(f"| {name} | {kind} | {p50:.3f} | {p90:.3f} |")


if __name__ == "__main__":
    main()
