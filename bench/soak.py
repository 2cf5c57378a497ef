"""Reliability soak: N calls through spanmeter (all features on) against the simulator.

A mix of what agents send - plain text, a 50-event stream, a streamed tool call, JSON
output with a schema-less response_format - at 64 concurrent connections, runs of 10
calls each. Sampled every N/40 calls: the proxy's resident memory, open fds and
threads (asyncio tasks are not visible from outside the process; open fds count its
sockets). Memory is "flat" when it grows less than 10% (and under 16 MiB) between the
end of warm-up (20% of the calls) and the end.

    python bench/run.py --soak 100000
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from procs import HZ, Proc, Procs, free_port

__all__ = ["run_soak"]

HERE = Path(__file__).resolve().parent
CONCURRENCY = 64
RUN_LENGTH = 10
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def _body(i: int) -> dict[str, Any]:
    kind = i % 4
    base: dict[str, Any] = {"model": "gpt-4o-mini", "max_tokens": 256}
    if kind == 0:
        return base | {"messages": [{"role": "user", "content": "Say hello."}]}
    if kind == 1:
        return base | {"stream": True, "messages": [{"role": "user", "content": "SCENARIO:long:50"}]}
    if kind == 2:
        return base | {"stream": True, "tools": TOOLS,
                       "messages": [{"role": "user", "content": "SCENARIO:tool weather in Paris?"}]}
    return base | {"response_format": {"type": "json_object"},
                   "messages": [{"role": "user", "content": "SCENARIO:json_fenced give me JSON"}]}


async def _drive(port: int, key: str, n: int, on_progress: Any) -> tuple[Counter[str], float]:
    errors: Counter[str] = Counter()
    counter = iter(range(n))
    done = 0
    url = f"http://127.0.0.1:{port}/v1/chat/completions"

    async def worker(w: int, session: aiohttp.ClientSession) -> None:
        nonlocal done
        for i in counter:
            body = _body(i)
            headers = {"Authorization": f"Bearer {key}", "X-Run-Id": f"soak-{w}-{i // (CONCURRENCY * RUN_LENGTH)}"}
            try:
                async with session.post(url, data=orjson.dumps(body), headers=headers) as resp:
                    data = await resp.read()
                    if resp.status != 200:
                        errors[f"http {resp.status}"] += 1
                    elif body.get("stream") and b"[DONE]" not in data:
                        errors["stream without [DONE]"] += 1
            except (TimeoutError, aiohttp.ClientError) as exc:
                errors[type(exc).__name__] += 1
            done += 1
            on_progress(done)

    t0 = time.perf_counter()
    connector = aiohttp.TCPConnector(limit=CONCURRENCY)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as session:
        await asyncio.gather(*(worker(w, session) for w in range(CONCURRENCY)))
    return errors, time.perf_counter() - t0


def _sample(proxy: Proc, sim: Proc, done: int, t0: float) -> dict[str, Any]:
    st, sim_st = proxy.status(), sim.status()
    return {"calls": done, "t_s": round(time.monotonic() - t0, 1), "rss_mb": round(st["VmRSS"] / 1024, 1),
            "fds": proxy.fds(), "threads": st["Threads"], "simulator_rss_mb": round(sim_st["VmRSS"] / 1024, 1)}


def run_soak(procs: Procs, n: int) -> dict[str, Any]:
    from run import LOAD_CPU, PROXY_CPU, PY, ROOT, spanmeter_env, tenant_config

    sim_port = free_port()
    sim = procs.start("simulator", [PY, "-m", "proxy", "simulate", "--port", str(sim_port)], cpu=LOAD_CPU,
                      port=sim_port, cwd=str(ROOT))
    sink = free_port()
    procs.start("otlp-sink", [PY, str(HERE / "otlp_sink.py"), "--port", str(sink)], cpu=LOAD_CPU, port=sink)
    config, key = tenant_config(procs.tmp)
    port = free_port()
    env = spanmeter_env("sm-full", procs.tmp, sim_port, config, sink, None) | {"SPANMETER_PORT": str(port)}
    proxy = procs.start("sm-full", [PY, "-m", "proxy", "serve"], cpu=PROXY_CPU, port=port, env=env, cwd=str(ROOT))
    samples: list[dict[str, Any]] = []
    every = max(n // 40, 200)
    t0 = time.monotonic()

    def progress(done: int) -> None:
        if done % every == 0 or done == n:
            samples.append(_sample(proxy, sim, done, t0))
            s = samples[-1]
            print(f"  {done:>8} calls  {s['t_s']:6.1f} s  rss {s['rss_mb']:6.1f} MB  fds {s['fds']:4}  "
                  f"threads {s['threads']:3}  simulator rss {s['simulator_rss_mb']:6.1f} MB", flush=True)

    print(f"soak: {n} calls at {CONCURRENCY} connections through sm-full -> simulator", flush=True)
    errors, elapsed = asyncio.run(_drive(port, key, n, progress))
    time.sleep(2)
    idle = _sample(proxy, sim, n, t0)
    report = _verdict(samples, errors, elapsed, n) | {"idle_after": idle, "samples": samples,
                                                      "cpu_s": proxy.cpu_ticks() / HZ}
    print(f"soak: {n} calls in {elapsed:.0f} s, errors {dict(errors) or 0}; rss after warm-up "
          f"{report['rss_warm_mb']} MB -> end {report['rss_end_mb']} MB ({report['rss_growth_pct']:+.1f}%): "
          f"{'flat' if report['rss_flat'] else 'GROWING'}; fds idle {idle['fds']}", flush=True)
    return report


def _verdict(samples: list[dict[str, Any]], errors: Counter[str], elapsed: float, n: int) -> dict[str, Any]:
    warm = next((s for s in samples if s["calls"] >= n * 0.2), samples[0])
    end = samples[-1]
    growth = end["rss_mb"] - warm["rss_mb"]
    pct = 100 * growth / warm["rss_mb"]
    flat = pct < 10 and growth < 16
    return {"ok": flat and not errors, "calls": n, "elapsed_s": round(elapsed, 1), "rps": round(n / elapsed),
            "errors": dict(errors), "rss_warm_mb": warm["rss_mb"], "rss_end_mb": end["rss_mb"],
            "rss_growth_pct": round(pct, 1), "rss_flat": flat}


if __name__ == "__main__":
    sys.exit("run it as: python bench/run.py --soak N")
