"""A run's back-to-back calls through the SQLite ledger: how long the next call waits
before it can be forwarded.

What the proxy does per call of a run at one connection: the answer goes out, the settle
(run totals and the tool call the answer asked for) runs in a background task
(proxy/serve/background.py), the run's next request arrives (here 0.2 ms later), carrying
that tool call's result, waits for the run's bookkeeping (`wait_ordered`; `settled` in code
before issue 29's change, which waited for the whole task), then its own admission. The
figure is the time from the next request's arrival to its admission's return, in ms (p50,
p90), for the code of this checkout and, with --baseline DIR, the code of another checkout,
alternating rounds:

    .venv/bin/python bench/bench_chain.py --n 400 --rounds 3 --baseline ../before

Real SqliteStore on a file in a temp dir (synchronous=FULL, the default), the real
Background, uvloop. The background task is the ledger part of serve/bookkeeping.finish:
the settle, ordered then awaited where the code has `settle_in_order`.
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
KEY = ("bench", "run-1")
TOTALS = {"model_calls": 1, "input_tokens": 96, "output_tokens": 24}


async def book(store: Any, background: Any, admission: Any, calls: list[dict[str, Any]] | None) -> None:
    """The ledger part of one call's bookkeeping, as serve/bookkeeping.finish does it."""
    if hasattr(store, "settle_in_order"):
        done = await store.settle_in_order(admission, 40, run_totals=TOTALS, tools=calls)
        background.mark_ordered(KEY)
        await done
    else:  # the code before: the next call waited for the whole task
        await store.settle(admission, 40, run_totals=TOTALS, tools=calls)


async def chain(path: str, n: int, tools: bool, capped: bool) -> dict[str, float]:
    from proxy.ledger.sqlite import SqliteStore
    from proxy.ledger.store import Ask, Limits, Turn
    from proxy.serve.background import Background

    store, background = SqliteStore(path), Background()
    wait = getattr(background, "wait_ordered", None) or background.settled
    waits: list[float] = []
    try:
        for i in range(n):
            arrived = time.perf_counter()
            await wait(KEY)  # the run's previous call is recorded (or ordered ahead)
            results = ((f"call_{i - 1}", True),) if tools and i else ()
            # Under runs.max_tokens the settle's token totals bound the next call: it waits for its fsync.
            limits = Limits(run_max_tokens=2**40) if capped else Limits()
            admission = await store.admit(Ask("bench", "run-1", T0, limits),
                                          Turn(reserve=(10, 1000), results=results, tokens=(100, 200)))
            waits.append(time.perf_counter() - arrived)
            calls = [{"id": f"call_{i}", "name": "lookup", "arguments": "{}"}] if tools else None
            background.spawn(KEY, book(store, background, admission, calls))
            await asyncio.sleep(ROUND_TRIP_S)
        await background.drain()
        assert await store.tools_pending("bench", "run-1") == (
            [{"id": f"call_{n - 1}", "name": "lookup", "arguments": "{}"}] if tools else [])
    finally:
        await store.aclose()
    waits.sort()
    return {"p50_ms": 1000 * statistics.median(waits), "p90_ms": 1000 * waits[int(len(waits) * 0.9)]}


KINDS = {"without tool calls": (False, False), "with tool calls": (True, False),
         "with tool calls, under runs.max_tokens": (True, True)}


def _child(args: argparse.Namespace) -> None:
    import uvloop

    sys.path.insert(0, args.code)
    out = {}
    for kind, (tools, capped) in KINDS.items():
        with tempfile.TemporaryDirectory() as tmp:
            out[kind] = uvloop.run(chain(str(Path(tmp) / "l.db"), args.n, tools, capped))
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
