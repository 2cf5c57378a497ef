"""CPU per proxied JSON call, measured in the proxy's own process (issue 16: the per-call Python).

The real app (proxy.app.create_app) runs in this process on uvloop with the settings the
full bench's sm-full uses (a tenant key, run ceilings, daily and monthly budgets, the
SQLite ledger in a temp dir, repair on; no OTLP endpoint, so no span export). The
upstream (bench/upstream.py, aiohttp) and the client driving the calls run in two child
processes, so nothing but the proxy is counted here: no baseline to subtract.

Reported per call, over the measured calls (after a warm-up):
  process  time.process_time() of this process: the event loop plus the ledger and log threads
  loop     time.thread_time() of the event-loop thread alone
  threads  each thread's exact CPU (/proc/.../schedstat), and how often it was put on a CPU
  latency  p50, p99 and p99.9 of the calls as the driving client timed them

    python bench/bench_percall.py [--calls N] [--run-calls 20] [--profile out.prof] [--top 40] [--pin]

`--profile` runs cProfile (timed by the thread's CPU clock) on the event-loop thread over
the measured calls and lists our functions (proxy/, tracing/) by self and by inclusive time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

CONCURRENCY = 64
PAYLOADS = {  # what each call sends (bench/payloads.py) and the upstream's answer, as make bench's scenarios
    "json": (lambda p: p.REQUEST_JSON, ""),  # a short chat, a JSON answer
    "sse": (lambda p: p.REQUEST_SSE, "?s=sse"),  # the same, its answer a 50-event stream
    "agent": (lambda p: p.REQUEST_AGENT, ""),  # an agent's 17th turn: 20 tools, 15 rounds of results (~45 KB)
    "slow": (lambda p: p.REQUEST_JSON, "?s=slow"),  # the short chat answered after 50 ms (slow_c256's)
}
UPSTREAM_KEY = "sk-bench-upstream"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --- the client (a child process) ------------------------------------------------------


async def _drive(port: int, key: str, warmup: int, calls: int, run_calls: int, concurrency: int,
                 payload: str, runs_by_connection: bool = False) -> None:
    import aiohttp
    import payloads

    make, query = PAYLOADS[payload]
    body = make(payloads)

    url = f"http://127.0.0.1:{port}/v1/chat/completions{query}"
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    sent = 0
    latencies: list[float] = []  # seconds, each call as this client saw it
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def worker(n: int, me: int, name: str) -> None:
            nonlocal sent
            for i in range(n):
                # Runs of `run_calls` consecutive calls over all connections, as wrk.lua groups
                # them; 0: no X-Run-Id, every call its own run (ended with it). By connection:
                # each connection's calls one run after another, as an agent's loop sends them.
                at = f"{me}-{i // run_calls}" if runs_by_connection and run_calls else sent // max(run_calls, 1)
                run = {"X-Run-Id": f"r-{os.getpid()}-{name}-{at}"} if run_calls else {}
                sent += 1
                started = time.perf_counter()
                async with session.post(url, data=body, headers=headers | run) as resp:
                    await resp.read()
                    if resp.status != 200:
                        raise SystemExit(f"proxy answered {resp.status}: {await resp.text()}")
                latencies.append(time.perf_counter() - started)

        async def phase(total: int, name: str) -> None:  # each phase's runs its own
            share, extra = divmod(total, concurrency)
            await asyncio.gather(*(worker(share + (i < extra), i, name) for i in range(concurrency)))

        await phase(warmup, "warm")
        print("warm", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        latencies.clear()
        await phase(calls, "measured")
        latencies.sort()
        quantiles = (latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1e6 for q in (0.5, 0.99, 0.999))
        print("done", *(f"{x:.0f}" for x in quantiles), flush=True)


# --- the proxy (this process) ----------------------------------------------------------


def _configure(tmp: Path, upstream_port: int) -> str:
    from run import tenant_config

    config, key = tenant_config(tmp)
    data = tmp / "data"
    data.mkdir()
    os.environ.update({
        "SPANMETER_CONFIG": str(config),
        "SPANMETER_DATA_DIR": str(data),
        "SPANMETER_OPENAI_BASE_URL": f"http://127.0.0.1:{upstream_port}",
        "SPANMETER_MAX_CONNECTIONS": "1024",
        "SPANMETER_LOCAL_TRACES": "false",
        "OPENAI_API_KEY": UPSTREAM_KEY,
    })
    return key


async def _wait_port(port: int) -> None:
    for _ in range(200):
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            await asyncio.sleep(0.05)
            continue
        writer.close()
        return
    raise SystemExit(f"upstream on port {port} never came up")


async def _serve_and_measure(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    upstream_port = _free_port()
    key = _configure(tmp, upstream_port)
    upstream = await asyncio.create_subprocess_exec(
        sys.executable, str(HERE / "upstream.py"), "--port", str(upstream_port))
    runner = None
    client = None
    try:
        await _wait_port(upstream_port)
        runner, port = await _serve_app()
        client = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--client", str(port), "--key", key, "--warmup", str(args.warmup),
            "--calls", str(args.calls), "--run-calls", str(args.run_calls), "--concurrency", str(args.concurrency),
            "--payload", args.payload, *(["--runs-by-connection"] if args.runs_by_connection else []),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE)
        assert client.stdout is not None and client.stdin is not None
        assert (await client.stdout.readline()).strip() == b"warm"
        if args.pin:
            _pin(upstream.pid, client.pid)
        profiler = None
        if args.profile:
            import cProfile
            # CPU time of this thread, not wall time: on a shared machine wall time would
            # charge a function for the moments the thread was descheduled or waiting for
            # the GIL (os.urandom, for one, releases it).
            profiler = cProfile.Profile(time.thread_time)
        threads0 = _threads()
        p0, t0, w0 = time.process_time(), time.thread_time(), time.perf_counter()
        if profiler:
            profiler.enable()
        client.stdin.write(b"go\n")
        await client.stdin.drain()
        line = await client.stdout.readline()
        if profiler:
            profiler.disable()
        p1, t1, w1 = time.process_time(), time.thread_time(), time.perf_counter()
        threads1 = _threads()
        assert line.startswith(b"done "), line
        p50, p99, p999 = (float(x) for x in line.split()[1:])
        await client.wait()
        if profiler:
            profiler.dump_stats(args.profile)
        n = args.calls
        by_name: dict[str, tuple[float, float, float, float]] = {}
        for tid, (name, *now) in threads1.items():
            _, *then = threads0.get(tid, (name, 0, 0, 0, 0))
            by_name[name] = tuple(a + b - c for a, b, c in zip(by_name.get(name, (0, 0, 0, 0)), now, then,
                                                               strict=True))  # type: ignore[assignment]
        tick = os.sysconf("SC_CLK_TCK")
        return {"process_us": (p1 - p0) / n * 1e6, "loop_us": (t1 - t0) / n * 1e6,
                "wall_us": (w1 - w0) / n * 1e6, "latency_us": (p50, p99, p999),
                "threads_us": {k: (r / n / 1e3, u / tick / n * 1e6, s / tick / n * 1e6, runs / n)
                               for k, (u, s, r, runs) in sorted(by_name.items(), key=lambda kv: -kv[1][2]) if r}}
    finally:
        await _stop(client, runner, upstream)


async def _serve_app() -> tuple[Any, int]:
    """The real app (proxy.app.create_app, with the settings of the environment) served on an
    ephemeral port of 127.0.0.1, in this process: its runner and its port."""
    from aiohttp import web

    from proxy.app import create_app
    from proxy.config import load_settings

    runner = web.AppRunner(create_app(load_settings()), handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, int(runner.addresses[0][1])


async def _stop(client: asyncio.subprocess.Process | None, runner: Any,
                upstream: asyncio.subprocess.Process) -> None:
    """End what a measurement started, by PID: the client, the app, the upstream."""
    if client is not None and client.returncode is None:
        client.kill()
        await client.wait()
    if runner is not None:
        await runner.cleanup()
    upstream.terminate()
    await upstream.wait()


def _pin(*others: int) -> None:
    """Every thread of this process on CPU 0, `others` (the upstream, the client) on CPU 1:
    as bench/run.py places the proxy and the load."""
    for pid in others:
        os.sched_setaffinity(pid, {1})
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(task.name), {0})


def _threads() -> dict[int, tuple[str, int, int, int, int]]:
    """CPU of each thread of this process, by thread id, with its Python name (the OS name is
    the process's): ticks of user and system time, the scheduler's exact runtime in ns, and
    how many times the scheduler put the thread on a CPU (each a wake-up or a preemption).

    The ticks split user from system but are sampled at the clock tick (100 Hz), so a thread
    that runs briefly or in step with the tick can be charged more or less than it ran; the
    runtime (/proc/.../schedstat) is exact, unsplit. (At one connection the two agreed within
    1% for the ledger thread, 2026-12-03.)"""
    import threading

    names = {t.native_id: t.name for t in threading.enumerate()}
    out = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            name = names.get(int(task.name), "(other)")
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            runtime_ns, _, slices = (task / "schedstat").read_text().split()
        except OSError:
            continue  # ended meanwhile
        out[int(task.name)] = (name, int(fields[11]), int(fields[12]), int(runtime_ns), int(slices))
    return out


def _rank(path: str, top: int) -> None:
    import pstats

    stats: Any = pstats.Stats(path).stats  # {(file, line, fn): (cc, nc, tt, ct, callers)}
    total = sum(v[2] for v in stats.values())
    ours = {k: v for k, v in stats.items() if "/proxy/" in k[0] or "/tracing/" in k[0]}
    ours = {k: v for k, v in ours.items() if "site-packages" not in k[0]}

    def name(k: tuple[str, int, str]) -> str:
        file = k[0].split("/proxy/", 1)[-1] if "/proxy/" in k[0] else "tracing/" + k[0].split("/tracing/", 1)[-1]
        return f"{file}:{k[1]} {k[2]}"

    print(f"\nloop-thread profile: {total:.3f} s total; ours self = "
          f"{sum(v[2] for v in ours.values()) / total:.1%}")
    for label, idx in (("self", 2), ("inclusive", 3)):
        print(f"\n  top {top} of ours by {label} time (% of the profiled thread, calls)")
        for k, v in sorted(ours.items(), key=lambda kv: -kv[1][idx])[:top]:
            print(f"  {v[idx] / total:6.1%}  {v[1]:>8}  {name(k)}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=20000)
    p.add_argument("--warmup", type=int, default=3000)
    p.add_argument("--profile", help="cProfile the event-loop thread into this file")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--concurrency", type=int, default=CONCURRENCY, help="connections of the driving client")
    p.add_argument("--run-calls", type=int, default=20,
                   help="calls per run (X-Run-Id), as make bench sends them; 0: no X-Run-Id, one run per call")
    p.add_argument("--payload", choices=sorted(PAYLOADS), default="json", help="what each call sends")
    p.add_argument("--runs-by-connection", action="store_true",
                   help="each connection sends its own runs, one call after another (an agent's loop), rather "
                        "than runs of consecutive calls over all connections (make bench's wrk.lua)")
    p.add_argument("--pin", action="store_true",
                   help="this process's threads on CPU 0, the client and the upstream on CPU 1 (as bench/run.py)")
    p.add_argument("--client", type=int, help=argparse.SUPPRESS)  # child mode: the proxy's port
    p.add_argument("--key", help=argparse.SUPPRESS)
    args = p.parse_args()
    import uvloop

    if args.client:
        uvloop.run(_drive(args.client, args.key, args.warmup, args.calls, args.run_calls, args.concurrency,
                          args.payload, args.runs_by_connection))
        return
    with tempfile.TemporaryDirectory(prefix="bench-percall-") as tmp:
        result = uvloop.run(_serve_and_measure(args, Path(tmp)))
    by = " by connection" if args.runs_by_connection and args.run_calls else ""
    print(f"{args.calls} {args.payload} calls at concurrency {args.concurrency}, runs of {args.run_calls or 1}{by}: "
          f"CPU per call process {result['process_us']:.1f} us, "
          f"loop thread {result['loop_us']:.1f} us (wall {result['wall_us']:.1f} us per call)")
    print("  latency as the client saw it, us: p50 {:.0f}, p99 {:.0f}, p99.9 {:.0f}".format(*result["latency_us"]))
    print("  per thread and call, by name: CPU us exact (user + system from /proc ticks), times put on a CPU: "
          + ", ".join(f"{k} {r:.0f} ({u:.0f} + {s:.0f}), {runs:.1f}x"
                      for k, (r, u, s, runs) in result["threads_us"].items()))
    if args.profile:
        _rank(args.profile, args.top)


if __name__ == "__main__":
    main()
