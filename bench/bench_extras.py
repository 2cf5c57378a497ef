"""The per-call extras of issue 51 item 3, each on its own, in process (no network):

  access    an access line (tracing the text and the JSON format): CPU on the calling thread
            (the event loop's share) and in the whole process (the log's writer thread too),
            per line, lines made in bursts of 32 as calls end (the writer drains between)
  tooldefs  `gen_ai.tool.definitions` of the bench's agent turn (20 tools), names only
  books     the scheduling of a call's bookkeeping without its work: a task per call that
            marks its run ordered and awaits its settle, against a hold, a callback on the
            next turn that releases it and a callback on the settle's future (uvloop; runs of
            20 calls over 64 at a time). Needs this checkout (serve/background.py `hold`).
  runend    a run of one call's end in telemetry: its root span (OTLP on: the span records'
            path) and its count, for a run whose call declared 3 tools and called none
            (`spans.end_run`; before it, `end_run` and `record_run_end`)
  paced     a run whose calls come 0.7 s apart, as an agent whose model answers in seconds
            sends them: how many of its 6 calls leased, the most another process read as
            reserved while a call was in flight, and the calls counted ahead (leases.py PACE)

Run it against each checkout to compare (the code measured is the one on PYTHONPATH):

    PYTHONPATH=$PWD taskset -c 0 .venv/bin/python bench/bench_extras.py
    PYTHONPATH=../before taskset -c 0 .venv/bin/python bench/bench_extras.py --only access,tooldefs
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))


def access(fmt: str, n: int = 20_000, burst: int = 32) -> tuple[float, float]:
    from proxy.model import Call, Caller, CallRecord, Outcome, Rewrite, Usage
    from proxy.serve.accesslog import access, configure_logging

    rec = CallRecord(Caller("acme", "r-1", "header"), Call(api="chat", operation="chat", model="gpt-4o-mini"),
                     Outcome(status=200, usage=Usage(input_tokens=1830, output_tokens=96)), 0, 412_000_000,
                     cost_micros=332, rewrites=[Rewrite("max_tokens_clamp", "4096")])
    rows = []
    with open(os.devnull, "w") as out:
        for _ in range(5):
            stop = configure_logging("INFO", fmt, stream=out, capacity=10**6)
            t0, p0 = time.thread_time(), time.process_time()
            for i in range(n):
                access(rec)
                if i % burst == burst - 1:
                    time.sleep(0.002)
            t1 = time.thread_time()
            stop()  # the writer writes (and formats) every line, then stops
            rows.append(((t1 - t0) / n * 1e6, (time.process_time() - p0) / n * 1e6))
    return sorted(r[0] for r in rows)[2], sorted(r[1] for r in rows)[2]  # medians of 5


def tooldefs(n: int = 20_000) -> float:
    import orjson
    import payloads

    from proxy.model import Call, ToolSpec
    from tracing import spans

    body: Any = orjson.loads(payloads.REQUEST_AGENT)
    specs = [(t["function"]["name"], t["function"].get("description"), t["function"].get("parameters"))
             for t in body["tools"]]
    best = float("inf")
    for _ in range(5):
        calls = [Call(api="chat", operation="chat", model="m", tools=tuple(ToolSpec(*s) for s in specs))
                 for _ in range(200)]
        t = time.thread_time()
        for i in range(n):
            spans._tool_definitions(calls[i % 200], 16_384, full=False)
        best = min(best, (time.thread_time() - t) / n * 1e6)
    return best


def runend(n: int = 20_000) -> float:
    from proxy.model import Caller
    from tracing import spans
    from tracing.setup import TelemetryConfig, setup_telemetry

    # An endpoint nobody answers: the spans are built and handed to the export child as served.
    tel = setup_telemetry(TelemetryConfig(otlp_endpoint="http://127.0.0.1:9", export_timeout=0.1), environ={})
    caller = Caller("acme", "gen-1", "generated")
    totals = {"model_calls": 1, "input_tokens": 1830, "output_tokens": 96, "cost_micros": 332,
              "anatomy|part|system|tokens": 120, "anatomy|part|system|micros": 30,
              "anatomy|part|tools|tokens": 300, "anatomy|part|tools|micros": 75,
              "anatomy|part|new|tokens": 1410, "anatomy|part|new|micros": 227,
              **{f"anatomy|def|{name}|bytes": 200 + i for i, name in enumerate(("search", "fetch", "write"))}}
    # Before 2026-12-06 the count was a function of its own (and read the anatomy again).
    count = getattr(spans, "record_run_end", None)
    best = float("inf")
    try:
        for _ in range(5):
            runs = [spans.new_run_trace() for _ in range(n)]
            t = time.thread_time()
            for run in runs:
                spans.end_run(tel, caller, run, totals, "ended")
                if count is not None:
                    count(tel, caller, totals)
            best = min(best, (time.thread_time() - t) / n * 1e6)
            time.sleep(0.5)  # the hand-off drains
    finally:
        tel.shutdown()
    return best


async def paced(calls: int = 6, gap_s: float = 0.7) -> tuple[int, int, int]:
    import tempfile
    from datetime import UTC, datetime

    from proxy.ledger.backends import open_store
    from proxy.ledger.store import Ask, Limits, Turn

    with tempfile.TemporaryDirectory(prefix="bench-paced-") as tmp:
        url = f"sqlite:///{tmp}/ledger.db"
        leased, plain = open_store(url, leases=True), open_store(url, leases=False)
        leases = held = ahead = 0
        try:
            for i in range(calls):
                a = await leased.admit(Ask("t", "agent", datetime.now(UTC), Limits(day_budget=10**9)),
                                       Turn(reserve=(1, 1000)))
                leases += a.id.startswith("lease-")
                held = max(held, (await plain.spend_detail("t")).reserved)
                ahead = max(ahead, await plain.run_calls("t", "agent") - (i + 1))
                await asyncio.sleep(gap_s)  # the model answering
                await leased.settle(a, 400)
        finally:
            await leased.aclose()
            await plain.aclose()
    return leases, held, ahead


async def _books(mode: str, n: int = 64_000, at_once: int = 64) -> float:
    from proxy.serve.background import Background

    loop = asyncio.get_running_loop()

    async def task(bg: Background, key: tuple[str, str], fut: asyncio.Future[int]) -> None:
        bg.mark_ordered(key)
        await fut

    def settled(_: object, fut: asyncio.Future[int]) -> None:
        pass

    def now(bg: Background, key: tuple[str, str], fut: asyncio.Future[int]) -> None:
        bg.release(key)
        bg.watch(fut)
        fut.add_done_callback(partial(settled, None))

    best = float("inf")
    for _ in range(5):
        bg = Background()
        futs = [loop.create_future() for _ in range(n)]
        t = time.thread_time()
        for i in range(0, n, at_once):
            for j in range(at_once):
                key, f = ("t", str((i + j) // 20)), futs[i + j]
                if mode == "task":
                    bg.spawn(key, task(bg, key, f))
                else:
                    bg.hold(key)
                    loop.call_soon(now, bg, key, f)
            await asyncio.sleep(0)  # the callbacks, or the tasks' first steps
            for f in futs[i:i + at_once]:
                f.set_result(0)  # the writer's commit
            await asyncio.sleep(0)
        await bg.drain()
        best = min(best, (time.thread_time() - t) / n * 1e6)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="access,tooldefs,books,runend,paced")
    args = ap.parse_args()
    only = set(args.only.split(","))
    if "access" in only:
        for fmt in ("text", "json"):
            loop_us, process_us = access(fmt)
            print(f"access line ({fmt}): calling thread {loop_us:.2f} us, process {process_us:.2f} us (medians of 5)")
    if "tooldefs" in only:
        print(f"gen_ai.tool.definitions, 20 tools: {tooldefs():.2f} us a call (best of 5)")
    if "runend" in only:
        print(f"a run of one call's end (root span, count), OTLP on: {runend():.2f} us a run (best of 5)")
    if "paced" in only:
        leases, held, ahead = asyncio.run(paced())
        print(f"a run of 6 calls 0.7 s apart: {leases} leased; another process read up to {held} reserved (one "
              f"call's worst case: 1000); {ahead} calls counted ahead")
    if "books" in only:
        import uvloop

        for mode in ("task", "callback"):
            print(f"bookkeeping scheduling, {mode}: {uvloop.run(_books(mode)):.2f} us a call (best of 5)")


if __name__ == "__main__":
    main()
