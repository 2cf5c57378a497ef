"""What the access log costs the serving process per call at one connection.

One line per call, as `spanmeter serve` writes it (configure_logging: text, the writer
thread), emitted from an asyncio loop with a pause between lines the length of a fast
call (--gap-us), to /dev/null. Per line: the process's CPU (every thread), and the
context switches of the process (voluntary + involuntary, from /proc: a count, so it
holds on a loaded machine where CPU times do not). This checkout's code and, with
--baseline DIR, another's, alternating, on one pinned core:

    .venv/bin/python bench/bench_accesslog.py --lines 3000 --rounds 3 --baseline ../before
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _switches() -> int:
    total = 0
    for task in Path("/proc/self/task").iterdir():
        for line in (task / "status").read_text().splitlines():
            if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                total += int(line.split()[1])
    return total


async def _emit(lines: int, gap_s: float) -> None:
    log = __import__("logging").getLogger("spanmeter.access")
    for i in range(lines):
        log.info("tenant=bench run=r-%d api=chat model=gpt-4o-mini status=200 upstream=200 duration=0.001s", i)
        await asyncio.sleep(gap_s)


def _child(args: argparse.Namespace) -> None:
    sys.path.insert(0, args.code)
    from proxy.serve.accesslog import configure_logging

    with open(os.devnull, "w") as sink:
        stop = configure_logging("INFO", "text", stream=sink)
        asyncio.run(_emit(200, args.gap_us / 1e6))  # warm
        cpu, switches, wall = time.process_time(), _switches(), time.perf_counter()
        asyncio.run(_emit(args.lines, args.gap_us / 1e6))
        cpu, switches, wall = time.process_time() - cpu, _switches() - switches, time.perf_counter() - wall
        stop()
    print(json.dumps({"cpu_us": 1e6 * cpu / args.lines, "switches": switches / args.lines,
                      "wall_us": 1e6 * wall / args.lines}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lines", type=int, default=3000)
    p.add_argument("--gap-us", type=float, default=500.0, help="pause between lines (a call's length)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cpu", default="0", help="the one core every round runs on (taskset)")
    p.add_argument("--baseline", help="another checkout to measure alternately")
    p.add_argument("--code", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.code:
        _child(args)
        return
    codes = {"this checkout": str(HERE.parent)} | ({"baseline": args.baseline} if args.baseline else {})
    got: dict[str, list[dict[str, float]]] = {k: [] for k in codes}
    for _ in range(args.rounds):
        for name, code in codes.items():
            done = subprocess.run(["taskset", "-c", args.cpu, sys.executable, __file__, "--code", code, "--lines",
                                   str(args.lines), "--gap-us", str(args.gap_us)], check=True, capture_output=True,
                                  text=True, cwd=code, env={**os.environ, "PYTHONPATH": code})
            got[name].append(json.loads(done.stdout))
    print(f"access log per line, {args.lines} lines {args.gap_us:g} us apart, median of {args.rounds} rounds")
    print("| code | CPU us (all threads) | context switches | wall us |\n|---|---|---|---|")
    for name, rounds in got.items():
        cells = [statistics.median(r[k] for r in rounds) for k in ("cpu_us", "switches", "wall_us")]
        print(f"| {name} | {cells[0]:.1f} | {cells[1]:.2f} | {cells[2]:.0f} |")


if __name__ == "__main__":
    main()
