"""`make bench`: spanmeter side by side with a direct call and a bare aiohttp pass-through.

Loopback only, every server on an ephemeral port, every process it starts ended by
PID. The proxy under test runs on CPU 0 (sm-workers2, spanmeter --workers 2, on CPUs 0
and 1); wrk, the upstream, Redis and the OTLP sink share CPU 1. Each repetition runs
each scenario on every target in turn (`schedule`), and the reported figure is the median
over repetitions; each ratio to bare is also given paired by repetition (`paired_ratios`).

    python bench/run.py              # full run, < 8 minutes on 2 cores
    python bench/run.py --quick      # direct, bare, sm-full, sm-local, 1 repetition, ~2-3 minutes
    python bench/run.py --quick --scenarios json_c1,chain_c1   # only those scenarios
    python bench/run.py --soak 100000   # reliability soak instead (see soak.py)
    python bench/run.py --no-profile    # skip the py-spy profile
    python bench/run.py --profile-c1    # sm-full at 1 connection: wall time per thread and export child

It ends with issue 51's targets (speed round three), met or not, per spanmeter target, beside the bare
pass-through's figure of the same run.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from payloads import (  # noqa: E402
    CHAIN_FIRST_JSON,
    CHAIN_FIRST_SSE,
    CHAIN_NEXT_JSON,
    CHAIN_NEXT_SSE,
    REQUEST_AGENT,
    REQUEST_JSON,
    REQUEST_SSE,
)
from procs import HZ, Proc, Procs, cpu_times, free_port, http_post  # noqa: E402
from upstream import nginx_available, nginx_conf  # noqa: E402

__all__ = ["main"]

PY = sys.executable
PROXY_CPU, LOAD_CPU = 0, 1
UPSTREAM_KEY = "sk-bench-upstream"
SLOW_IDEAL_RPS = 256 / 0.05  # 256 connections, each waiting 50 ms per call
S = TypeVar("S")
T = TypeVar("T")

# Settings the bench's own shell might carry; each spanmeter gets exactly the ones set below.
INHERITED_CONFIG = [k for k in os.environ if k.startswith(("SPANMETER_", "OTEL_"))]
SM_ENV: dict[str, str] = {}  # --sm-env: set for every spanmeter target, after the bench's own


@dataclass(frozen=True)
class Scenario:
    name: str
    body: bytes
    query: str
    conns: int
    what: str
    next_body: bytes | None = None  # a chained run: every call after a run's first carries the last tool call
    runs: bool = True  # calls grouped into runs of 20 by X-Run-Id; False: none sent, every call its own run


SCENARIOS = [
    Scenario("json_c1", REQUEST_JSON, "", 1, "non-stream, 1 connection"),
    Scenario("oneshot_c1", REQUEST_JSON, "", 1, "non-stream, 1 connection, no X-Run-Id (as most agents send): "
             "every call its own run, ended with it", runs=False),
    Scenario("sse_c1", REQUEST_SSE, "?s=sse", 1, "50-event stream (one upstream write), 1 connection"),
    Scenario("sse50_c1", REQUEST_SSE, "?s=sse50", 1, "50-event stream, one upstream write per event, 1 connection"),
    Scenario("chain_c1", CHAIN_FIRST_JSON, "?s=tool", 1, "back-to-back calls of one run, each carrying the previous "
             "answer's tool call and result (JSON), 1 connection", CHAIN_NEXT_JSON),
    Scenario("chainsse_c1", CHAIN_FIRST_SSE, "?s=toolsse", 1, "back-to-back calls of one run, each carrying the "
             "previous answer's tool call and result (50-event stream), 1 connection", CHAIN_NEXT_SSE),
    Scenario("oneshotsse_c1", REQUEST_SSE, "?s=sse", 1, "50-event stream (one upstream write), 1 connection, no "
             "X-Run-Id: every call its own run", runs=False),
    Scenario("json_c64", REQUEST_JSON, "", 64, "non-stream, 64 connections"),
    Scenario("sse_c64", REQUEST_SSE, "?s=sse", 64, "50-event stream (one upstream write), 64 connections"),
    Scenario("oneshot_c64", REQUEST_JSON, "", 64, "non-stream, 64 connections, no X-Run-Id: every call its own run",
             runs=False),
    Scenario("oneshotsse_c64", REQUEST_SSE, "?s=sse", 64, "50-event stream (one upstream write), 64 connections, no "
             "X-Run-Id: every call its own run", runs=False),
    Scenario("slow_c256", REQUEST_JSON, "?s=slow", 256, "50 ms upstream, 256 connections"),
    Scenario("agent_c1", REQUEST_AGENT, "", 1, "agent turn (45 KB, 20 tools, 15 rounds, 2 tool results), 1 connection"),
    Scenario("agent_c64", REQUEST_AGENT, "", 64, "agent turn (45 KB, 20 tools, 2 tool results), 64 connections"),
]
BY_NAME = {s.name: s for s in SCENARIOS}


@dataclass
class Target:
    name: str
    port: int
    key: str
    what: str
    proc: Proc | None = None  # None for `direct`: no proxy process to measure
    runs: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    ttfb: list[dict[str, float]] = field(default_factory=list)
    peak_rss_kb: int = 0
    peak_rss_kb_by_scenario: dict[str, int] = field(default_factory=dict)  # the highest of any repetition
    start_rss_kb_by_process: dict[str, int] = field(default_factory=dict)  # after the smoke calls, before any load


@dataclass
class Plan:
    reps: int
    duration_s: int
    warmup_s: int
    targets: list[str]
    ttfb_n: int
    profile_s: int


FULL = Plan(reps=3, duration_s=3, warmup_s=2, ttfb_n=300, profile_s=6,
            targets=["direct", "bare", "sm-full", "sm-redis", "sm-cluster", "sm-local", "sm-off", "sm-workers2"])
QUICK = Plan(reps=1, duration_s=2, warmup_s=1, ttfb_n=150, profile_s=4,
             targets=["direct", "bare", "sm-full", "sm-local"])

DESCRIPTIONS = {
    "direct": "wrk -> upstream (no proxy)",
    "bare": "bare aiohttp+uvloop pass-through (bench/passthrough.py)",
    "sm-full": "spanmeter, all on: tenant key, run ceilings + budgets, SQLite ledger, OTLP export to sink, repair on",
    "sm-redis": "spanmeter, all on, Redis ledger",
    "sm-cluster": "spanmeter, all on, Redis Cluster ledger (three local masters; the tenant's keys on one)",
    "sm-local": "spanmeter, all on but tracing local only (JSONL file, no OTLP)",
    "sm-off": "spanmeter, all on but tracing export off (no OTLP, no local file)",
    "sm-workers2": "sm-full with --workers 2: a supervisor and 2 workers on CPUs 0-1, sharing CPU 1 with wrk and "
                   "the upstream",
    "sm-before": "sm-full run from another checkout (--baseline DIR): the code before a change, side by side",
    # The library bypasses against their public paths (proxy/ledger/redis_compat.py, tracing/otel_compat.py):
    "sm-inproc": "sm-full with spans encoded and sent in-process (SPANMETER_EXPORT_PROCESS=off), not by a child",
    "sm-public": "sm-full through the libraries' public APIs only (SDK start_span, no lean spans)",
    # Span records (issue 51, item 2) against the path before them, from one checkout:
    "sm-spans": "sm-full with spans as ReadableSpans on both sides of the export pipe and gzip at level 9, as before "
                "span records (SPANMETER_SPAN_RECORDS=off, SPANMETER_OTLP_GZIP_LEVEL=sdk)",
    "sm-records-gz9": "sm-full (span records) with gzip at the exporter's level 9 (SPANMETER_OTLP_GZIP_LEVEL=sdk)",
    "sm-redis-public": "sm-redis through redis-py's public pipelines (SPANMETER_REDIS_INTERNALS=off)",
    # A setting's cost, side by side from one checkout (a --baseline checkout reads 6-14% slower
    # than this one with the same code: docs/benchmarks.md, "Cost anatomy, fourth pass ... and
    # measuring a setting").
    "sm-anatomy-on": "sm-full with the cost anatomy on (SPANMETER_ANATOMY=true)",
    "sm-anatomy-off": "sm-full with the cost anatomy off (SPANMETER_ANATOMY=false)",
    # What a deployment can trade for speed, side by side with the defaults (docs/operations.md).
    # Budget leases (issue 51, item 1; on by default) against every call's exact ledger write.
    "sm-noleases": "sm-full with budget leases off (SPANMETER_LEDGER_LEASES=false): one exact ledger write a call",
    "sm-fast": "sm-full with the settings that trade for speed: the SQLite ledger at synchronous=normal (no fsync "
               "before a call is forwarded), the cost anatomy off, OTLP without gzip",
}
# Settings that make a bypass target what its description says.
BYPASS_ENV = {
    "sm-inproc": {"SPANMETER_EXPORT_PROCESS": "off"},
    "sm-public": {"SPANMETER_OTEL_INTERNALS": "off"},
    "sm-spans": {"SPANMETER_SPAN_RECORDS": "off", "SPANMETER_OTLP_GZIP_LEVEL": "sdk"},
    "sm-records-gz9": {"SPANMETER_OTLP_GZIP_LEVEL": "sdk"},
    "sm-redis-public": {"SPANMETER_REDIS_INTERNALS": "off"},
    "sm-anatomy-on": {"SPANMETER_ANATOMY": "true"},
    "sm-anatomy-off": {"SPANMETER_ANATOMY": "false"},
    "sm-fast": {"SPANMETER_ANATOMY": "false", "OTEL_EXPORTER_OTLP_COMPRESSION": "none"},
    "sm-noleases": {"SPANMETER_LEDGER_LEASES": "false"},
}
# The proxy's CPUs per target: one process on CPU 0, except the workers, which get both
# cores (the kernel places them); on a 2-core machine that is the load generator's core too.
PROXY_CPUS = {"sm-workers2": f"{PROXY_CPU},{LOAD_CPU}"}
WORKERS = {"sm-workers2": 2}


# ---------------------------------------------------------------- processes


def start_upstream(procs: Procs) -> tuple[Proc, str]:
    port = free_port()
    if nginx_available():
        conf = procs.tmp / "nginx.conf"
        conf.write_text(nginx_conf(procs.tmp, port))
        return procs.start("upstream-nginx", ["/usr/sbin/nginx", "-p", str(procs.tmp), "-c", str(conf),
                                              "-e", "stderr"], cpu=LOAD_CPU, port=port), "nginx"
    print("nginx + echo module not found (apt-get install nginx libnginx-mod-http-echo): "
          "using the aiohttp static upstream, which is slower and may cap the direct figures.")
    return procs.start("upstream-aiohttp", [PY, str(HERE / "upstream.py"), "--port", str(port)],
                       cpu=LOAD_CPU, port=port), "aiohttp"


def tenant_config(tmp: Path, upstream_keys: str = "{openai: OPENAI_API_KEY}") -> tuple[Path, str]:
    """A config with one tenant and its key. `upstream_keys`: the variables of the APIs the
    bench calls (spanmeter checks that every one named is set)."""
    sys.path.insert(0, str(ROOT))
    from proxy.config import hash_key
    from proxy.serve.tenants import new_key

    key = new_key()
    path = tmp / "spanmeter.yaml"
    # Ceilings high enough never to refuse, low enough that every call is counted and
    # reserved against the run, the day and the month.
    path.write_text(
        f"upstream_keys: {upstream_keys}\n"
        "tenants:\n"
        "  bench:\n"
        f"    keys: ['{hash_key(key)}']\n"
        "    policy:\n"
        "      runs: {max_llm_calls: 1000000, max_cost_usd: 100000}\n"
        "      budgets: {daily_usd: 10000000, monthly_usd: 100000000}\n"
        "      repair: {mode: repair}\n")
    return path, key


def spanmeter_env(name: str, tmp: Path, upstream_port: int, config: Path, sink_port: int,
                  redis_port: int | None, cluster_url: str | None = None) -> dict[str, str]:
    data = tmp / name
    data.mkdir(exist_ok=True)
    env = {
        "SPANMETER_CONFIG": str(config),
        "SPANMETER_HOST": "127.0.0.1",
        "SPANMETER_DATA_DIR": str(data),
        "SPANMETER_OPENAI_BASE_URL": f"http://127.0.0.1:{upstream_port}",
        # The default pool (100) would cap in-flight calls below the 256-connection test;
        # the bare pass-through gets the same 1024.
        "SPANMETER_MAX_CONNECTIONS": "1024",
        "SPANMETER_LOCAL_TRACES": "true" if name == "sm-local" else "false",
        "OPENAI_API_KEY": UPSTREAM_KEY,
        "PYTHONUNBUFFERED": "1",
    }
    if name in ("sm-full", "sm-redis", "sm-cluster", "sm-workers2", "sm-before", *BYPASS_ENV):
        env["SPANMETER_OTLP_ENDPOINT"] = f"http://127.0.0.1:{sink_port}"
    env.update(BYPASS_ENV.get(name, {}))
    env.update(SM_ENV)
    if name in ("sm-redis", "sm-redis-public"):
        env["SPANMETER_LEDGER_URL"] = f"redis://127.0.0.1:{redis_port}/0"
    if name == "sm-cluster" and cluster_url is not None:
        env["SPANMETER_LEDGER_URL"] = cluster_url
    if name == "sm-fast":
        env["SPANMETER_LEDGER_URL"] = f"sqlite:///{data / 'ledger.db'}?synchronous=normal"
    return env


def start_cluster(procs: Procs, masters: int = 3) -> str:
    """A Redis Cluster of `masters` local masters (no replicas) on the load core; its URL."""
    ports = [free_port() for _ in range(masters)]
    for i, port in enumerate(ports):
        workdir = procs.tmp / f"cluster-{i}"
        workdir.mkdir(exist_ok=True)
        procs.start(f"redis-cluster-{i}", ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                           "--appendonly", "no", "--dir", str(workdir), "--cluster-enabled", "yes",
                                           "--cluster-port", str(free_port()), "--cluster-config-file",
                                           str(workdir / "nodes.conf")], cpu=LOAD_CPU, port=port)
    subprocess.run(["redis-cli", "--cluster", "create", *(f"127.0.0.1:{p}" for p in ports), "--cluster-replicas",
                    "0", "--cluster-yes"], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=30)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        infos = [subprocess.run(["redis-cli", "-p", str(p), "cluster", "info"], capture_output=True, text=True,
                                timeout=5).stdout for p in ports]
        if all("cluster_state:ok" in info and "cluster_slots_ok:16384" in info for info in infos):
            return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in ports)
        time.sleep(0.1)
    raise RuntimeError("the bench's Redis Cluster did not reach cluster_state:ok in 20 s")


def start_targets(procs: Procs, plan: Plan, upstream: Proc, baseline: Path | None = None) -> list[Target]:
    assert upstream.port is not None
    targets = [Target("direct", upstream.port, UPSTREAM_KEY, DESCRIPTIONS["direct"])]
    if "bare" in plan.targets:
        port = free_port()
        proc = procs.start("bare", [PY, str(HERE / "passthrough.py"), "--port", str(port), "--upstream",
                                    f"http://127.0.0.1:{upstream.port}"], cpu=PROXY_CPU, port=port)
        targets.append(Target("bare", port, UPSTREAM_KEY, DESCRIPTIONS["bare"], proc))
    names = [n for n in plan.targets if n.startswith("sm-")]
    if not names:
        return targets
    config, key = tenant_config(procs.tmp)
    sink = free_port()
    procs.start("otlp-sink", [PY, str(HERE / "otlp_sink.py"), "--port", str(sink)], cpu=LOAD_CPU, port=sink)
    redis_port = None
    if "sm-redis" in names or "sm-redis-public" in names:
        if shutil.which("redis-server"):
            redis_port = free_port()
            procs.start("redis", ["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                                  "--appendonly", "no", "--dir", str(procs.tmp)], cpu=LOAD_CPU, port=redis_port)
        else:
            print("redis-server not found: skipping sm-redis and sm-redis-public")
            names = [n for n in names if n not in ("sm-redis", "sm-redis-public")]
    cluster_url = None
    if "sm-cluster" in names:
        if shutil.which("redis-server") and shutil.which("redis-cli"):
            cluster_url = start_cluster(procs)
        else:
            print("redis-server or redis-cli not found: skipping sm-cluster")
            names.remove("sm-cluster")
    for name in names:
        port = free_port()
        env = spanmeter_env(name, procs.tmp, upstream.port, config, sink, redis_port, cluster_url)
        env["SPANMETER_PORT"] = str(port)
        env["SPANMETER_WORKERS"] = str(WORKERS.get(name, 1))
        home = ROOT
        if name == "sm-before":
            if baseline is None:
                raise SystemExit("target sm-before needs --baseline DIR (a checkout of the code to compare with)")
            home = baseline
            env["PYTHONPATH"] = str(baseline)  # its own proxy/ and tracing/, not this checkout's
        proc = procs.start(name, [PY, "-m", "proxy", "serve"], cpu=PROXY_CPUS.get(name, PROXY_CPU), port=port,
                           env=env, cwd=str(home), unset=INHERITED_CONFIG)
        targets.append(Target(name, port, key, DESCRIPTIONS[name], proc))
    return targets


def smoke(targets: list[Target]) -> None:
    """One call of each kind through each target, so a broken setup fails loudly up front."""
    for t in targets:
        for sc in (BY_NAME["json_c1"], BY_NAME["sse_c1"], BY_NAME["sse50_c1"], BY_NAME["chain_c1"],
                   BY_NAME["chainsse_c1"]):
            status, body = http_post(t.port, "/v1/chat/completions" + sc.query, sc.body, t.key)
            if status != 200 or ("sse" in sc.query and b"[DONE]" not in body) or \
                    (sc.next_body is not None and b'"call_' not in body):
                raise RuntimeError(f"{t.name} answered {status} to {sc.name}: {body[:400]!r}\n"
                                   f"{t.proc.tail() if t.proc else ''}")


# ---------------------------------------------------------------- load


def wrk(t: Target, sc: Scenario, duration_s: int, tmp: Path, seed: str) -> dict[str, Any]:
    body = tmp / f"body-{sc.name}.json"
    if not body.exists():
        body.write_bytes(sc.body)
    result = tmp / f"wrk-{seed}.json"
    env = {**os.environ, "BENCH_BODY": str(body), "BENCH_PATH": "/v1/chat/completions" + sc.query,
           "BENCH_KEY": t.key, "BENCH_RESULT": str(result), "BENCH_SEED": seed}
    if sc.next_body is not None:
        following = tmp / f"body-{sc.name}-next.json"
        if not following.exists():
            following.write_bytes(sc.next_body)
        env["BENCH_NEXT"] = str(following)
    if not sc.runs:
        env["BENCH_NO_RUN"] = "1"
    cmd = ["taskset", "-c", str(LOAD_CPU), "wrk", "-t1", f"-c{sc.conns}", f"-d{duration_s}s", "--timeout", "10s",
           "-s", str(HERE / "wrk.lua"), f"http://127.0.0.1:{t.port}"]
    subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=duration_s + 60)
    out: dict[str, Any] = json.loads(result.read_text())
    result.unlink()
    return out


def measure(t: Target, sc: Scenario, duration_s: int, tmp: Path, seed: str,
            upstream: Proc | None = None) -> dict[str, Any]:
    before = t.proc.cpu_ticks() if t.proc else 0
    loop_before = t.proc.main_thread_ticks() if t.proc else 0
    up_before = upstream.cpu_ticks() if upstream else 0
    if t.proc:
        t.proc.reset_peak_rss()  # this scenario's own peak, not the highest since start
    machine_before = cpu_times()
    r = wrk(t, sc, duration_s, tmp, seed)
    machine_after = cpu_times()
    proxy_ticks = 0
    if t.proc:
        proxy_ticks = t.proc.cpu_ticks() - before
        # Count the export that finishes after the load stops, and keep it out of the next run.
        t.proc.wait_idle()
        cpu_ms = (t.proc.cpu_ticks() - before) * 1000 / HZ
        r["cpu_ms_per_req"] = cpu_ms / max(r["requests"], 1)
        r["loop_cpu_ms_per_req"] = (t.proc.main_thread_ticks() - loop_before) * 1000 / HZ / max(r["requests"], 1)
        r["peak_rss_kb"] = t.proc.status().get("VmHWM", 0)
        r["peak_rss_kb_by_process"] = t.proc.peaks_by_process()
    if upstream:
        r["upstream_cpu_ms_per_req"] = (upstream.cpu_ticks() - up_before) * 1000 / HZ / max(r["requests"], 1)
    # A proxy on both cores (sm-workers2) cannot be told apart from other work on CPU 0.
    one_cpu = t.proc is None or isinstance(t.proc.cpu, int)
    r.update(_contention(machine_before, machine_after, proxy_ticks if one_cpu else None))
    r["rps"] = r["requests"] / (r["duration_us"] / 1e6)
    r["error_count"] = sum(r["errors"].values())
    return r


def _contention(before: dict[int, tuple[int, int]], after: dict[int, tuple[int, int]],
                proxy_ticks: int | None) -> dict[str, float]:
    """How busy each CPU was; on the proxy's CPU, how much of it was not the proxy.

    The bench assumes it has the machine to itself. Other work on CPU 0 steals time from
    the proxy under test, which shows as `foreign_cpu0_pct` and makes latencies and
    rates of that run unreliable (CPU per request much less so).
    """
    out: dict[str, float] = {}
    for cpu in (PROXY_CPU, LOAD_CPU):
        if cpu in before and cpu in after:
            busy = after[cpu][0] - before[cpu][0]
            total = max(after[cpu][1] - before[cpu][1], 1)
            out[f"cpu{cpu}_busy_pct"] = round(100 * busy / total, 1)
            if cpu == PROXY_CPU and proxy_ticks is not None:
                out["foreign_cpu0_pct"] = round(max(0, 100 * (busy - proxy_ticks) / total), 1)
    return out


def ttfb(t: Target, n: int, tmp: Path) -> dict[str, float]:
    sc = BY_NAME["sse50_c1"]
    body = tmp / "body-ttfb.json"
    body.write_bytes(sc.body)
    cmd = ["taskset", "-c", str(LOAD_CPU), PY, str(HERE / "ttfb.py"), "--port", str(t.port),
           "--path", "/v1/chat/completions" + sc.query, "--body", str(body), "--key", t.key, "--n", str(n)]
    done = subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    out: dict[str, float] = json.loads(done.stdout)
    return out


def run_load(targets: list[Target], plan: Plan, tmp: Path, upstream: Proc) -> None:
    for t in targets:  # the start-up baseline: imports, the app, one call of each kind
        if t.proc:
            t.start_rss_kb_by_process = t.proc.peaks_by_process("VmRSS")
    for t in targets:  # warm-up: pools filled, code paths imported, SQLite pages cached
        for sc in (BY_NAME['json_c64'], BY_NAME['sse_c64']):
            measure(t, sc, plan.warmup_s, tmp, f"w{t.name}{sc.name}", upstream)
    order = schedule(plan.reps, targets, SCENARIOS)
    for step, (rep, sc, t) in enumerate(order, 1):
        seconds = max(1, plan.duration_s - 1) if sc.conns == 1 else plan.duration_s
        r = measure(t, sc, seconds, tmp, f"r{rep}{t.name}{sc.name}", upstream)
        t.runs.setdefault(sc.name, []).append(r)
        print(f"  [{step}/{len(order)}] rep {rep + 1} {t.name:9} {sc.name:10} {r['rps']:8.0f} req/s "
              f"p50 {r['latency_us']['p50'] / 1000:6.2f} ms  errors {r['error_count']}  "
              f"cpu0 foreign {r.get('foreign_cpu0_pct', 0):4.0f}%  cpu1 busy {r.get('cpu1_busy_pct', 0):4.0f}%",
              flush=True)
        if sc is SCENARIOS[-1] and t is targets[-1]:  # the repetition's last: its first-event timings
            for each in targets:
                each.ttfb.append(ttfb(each, plan.ttfb_n, tmp))
    for t in targets:
        for sc_name, runs in t.runs.items():
            t.peak_rss_kb_by_scenario[sc_name] = max(r.get("peak_rss_kb", 0) for r in runs)
        t.peak_rss_kb = max(t.peak_rss_kb_by_scenario.values(), default=0)


def schedule(reps: int, targets: Sequence[T], scenarios: Sequence[S]) -> list[tuple[int, S, T]]:
    """The order of the measurements: within a repetition, each scenario on every target in
    turn. A target's figure and bare's, which a ratio compares, are then taken seconds apart
    rather than a whole round of scenarios apart: on a shared VM the core's speed drifts
    over tens of seconds (bare's CPU per JSON request read 0.127, 0.266 and 0.207 ms in the
    three repetitions of one run, docs/benchmarks.md, twelfth pass)."""
    return [(rep, sc, t) for rep in range(reps) for sc in scenarios for t in targets]


# ---------------------------------------------------------------- summary


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def _by_kind(by_process: dict[str, int]) -> dict[str, int]:
    """{"serving 123": kB, "export child 456": kB} -> {"serving": kB, "child": kB} (summed per kind)."""
    out: dict[str, int] = {}
    for name, kb in by_process.items():
        kind = "serving" if name.startswith("serving") else "child"
        out[kind] = out.get(kind, 0) + kb
    return out


def summarise(targets: list[Target]) -> dict[str, dict[str, float]]:
    """Median over repetitions of every figure, per target."""
    out: dict[str, dict[str, float]] = {}
    for t in targets:
        m: dict[str, float] = {}
        for sc_name, runs in t.runs.items():
            m[f"{sc_name}.rps"] = _median([r["rps"] for r in runs])
            m[f"{sc_name}.p50_ms"] = _median([r["latency_us"]["p50"] for r in runs]) / 1000
            m[f"{sc_name}.p99_ms"] = _median([r["latency_us"]["p99"] for r in runs]) / 1000
            m[f"{sc_name}.errors"] = _median([r["error_count"] for r in runs])
            if t.proc:
                m[f"{sc_name}.cpu_ms"] = _median([r["cpu_ms_per_req"] for r in runs])
                m[f"{sc_name}.loop_cpu_ms"] = _median([r["loop_cpu_ms_per_req"] for r in runs])
                # Cores the proxy kept busy, and what one core of it serves.
                m[f"{sc_name}.cores"] = m[f"{sc_name}.rps"] * m[f"{sc_name}.cpu_ms"] / 1000
                m[f"{sc_name}.rps_per_core"] = 1000 / m[f"{sc_name}.cpu_ms"] if m[f"{sc_name}.cpu_ms"] else 0.0
            m[f"{sc_name}.upstream_cpu_ms"] = _median([r.get("upstream_cpu_ms_per_req", 0) for r in runs])
            if any("foreign_cpu0_pct" in r for r in runs):  # not for a proxy on both cores
                m[f"{sc_name}.foreign_cpu0_pct"] = _median([r.get("foreign_cpu0_pct", 0) for r in runs])
            m[f"{sc_name}.cpu1_busy_pct"] = _median([r.get("cpu1_busy_pct", 0) for r in runs])
            m[f"{sc_name}.cpu0_busy_pct"] = _median([r.get("cpu0_busy_pct", 0) for r in runs])
            if t.peak_rss_kb_by_scenario.get(sc_name):
                m[f"{sc_name}.peak_rss_mb"] = t.peak_rss_kb_by_scenario[sc_name] / 1024
        if t.ttfb:
            m["ttfb.p50_ms"] = _median([x["first_p50_us"] for x in t.ttfb]) / 1000
            m["ttfb.p99_ms"] = _median([x["first_p99_us"] for x in t.ttfb]) / 1000
        if t.peak_rss_kb:
            m["peak_rss_mb"] = t.peak_rss_kb / 1024
            # Where the highest peak was: the serving process and the export child apart, and
            # what each held at start-up (RSS is not given back: later peaks start from there).
            worst = max((r for runs in t.runs.values() for r in runs), key=lambda r: r.get("peak_rss_kb", 0))
            for kind, kb in _by_kind(worst.get("peak_rss_kb_by_process", {})).items():
                m[f"peak_rss_{kind}_mb"] = kb / 1024
            for kind, kb in _by_kind(t.start_rss_kb_by_process).items():
                m[f"start_rss_{kind}_mb"] = kb / 1024
        out[t.name] = m
    direct = out["direct"]
    for m in out.values():  # what the proxy adds over calling the upstream directly
        for k in ("json_c1.p50_ms", "json_c1.p99_ms", "oneshot_c1.p50_ms", "sse_c1.p50_ms", "sse_c1.p99_ms",
                  "sse50_c1.p50_ms", "sse50_c1.p99_ms", "ttfb.p50_ms", "ttfb.p99_ms", "agent_c1.p50_ms",
                  "chain_c1.p50_ms", "chain_c1.p99_ms", "chainsse_c1.p50_ms", "chainsse_c1.p99_ms"):
            if k in m and k in direct:
                m["added." + k] = m[k] - direct[k]
        if "slow_c256.rps" in m:
            m["slow_c256.pct_ideal"] = 100 * m["slow_c256.rps"] / SLOW_IDEAL_RPS
    return out


def ratios(summary: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    bare = summary.get("bare", {})
    out: dict[str, dict[str, float]] = {}
    for name, m in summary.items():
        out[name] = {k: v / bare[k] for k, v in m.items() if bare.get(k) and k in bare}
    return out


PAIRED = (("cpu_ms", "cpu_ms_per_req"), ("rps", "rps"))


def paired_ratios(targets: list[Target], base: str = "bare") -> dict[str, dict[str, float]]:
    """Per target, the median over repetitions of its figure over `base`'s in the same
    repetition (CPU per request, requests a second), scenario by scenario: the two were
    measured seconds apart (`schedule`), so a drift of the machine's speed between
    repetitions cancels out of each pair, where a ratio of medians keeps it."""
    ref = next((t for t in targets if t.name == base), None)
    out: dict[str, dict[str, float]] = {}
    if ref is None:
        return out
    for t in targets:
        if t.proc is None or t is ref:
            continue
        m: dict[str, float] = {}
        for sc_name, runs in t.runs.items():
            for key, field_ in PAIRED:
                pairs = [r[field_] / b[field_] for r, b in zip(runs, ref.runs.get(sc_name, []), strict=False)
                         if r.get(field_) and b.get(field_)]
                if pairs:
                    m[f"{sc_name}.{key}"] = _median(pairs)
        out[t.name] = m
    return out


def _fmt(v: float | None, r: float | None, digits: int = 2) -> str:
    if v is None:
        return "-"
    text = f"{v:,.{digits}f}"
    return f"{text} ({r:.2f}x)" if r is not None else text


TABLES = [
    ("Added latency at 1 connection vs direct, ms (ratio to bare pass-through)",
     [("JSON p50", "added.json_c1.p50_ms", 3), ("JSON p99", "added.json_c1.p99_ms", 3),
      ("one-call runs JSON p50", "added.oneshot_c1.p50_ms", 3),
      ("SSE p50", "added.sse_c1.p50_ms", 3), ("SSE p99", "added.sse_c1.p99_ms", 3),
      ("SSE/50 writes p50", "added.sse50_c1.p50_ms", 3), ("SSE/50 writes p99", "added.sse50_c1.p99_ms", 3),
      ("run chain JSON p50", "added.chain_c1.p50_ms", 3), ("run chain SSE p50", "added.chainsse_c1.p50_ms", 3),
      ("first event p50", "added.ttfb.p50_ms", 3), ("first event p99", "added.ttfb.p99_ms", 3)]),
    ("64 connections: requests/s and latency, ms (ratio to bare)",
     [("JSON req/s", "json_c64.rps", 0), ("JSON p50", "json_c64.p50_ms", 2), ("JSON p99", "json_c64.p99_ms", 2),
      ("SSE req/s", "sse_c64.rps", 0), ("SSE p50", "sse_c64.p50_ms", 2), ("SSE p99", "sse_c64.p99_ms", 2)]),
    ("Proxy CPU per request, ms; 50 ms upstream at 256 connections; peak RSS (ratio to bare)",
     [("CPU JSON c64", "json_c64.cpu_ms", 3), ("CPU SSE c64", "sse_c64.cpu_ms", 3),
      ("  of which event loop", "json_c64.loop_cpu_ms", 3), ("  SSE event loop", "sse_c64.loop_cpu_ms", 3),
      ("CPU JSON c1", "json_c1.cpu_ms", 3), ("CPU SSE/50 writes c1", "sse50_c1.cpu_ms", 3),
      ("256c req/s", "slow_c256.rps", 0),
      ("% of ideal", "slow_c256.pct_ideal", 1), ("256c errors", "slow_c256.errors", 0),
      ("peak RSS MB", "peak_rss_mb", 1)]),
    ("Agent turn (45 KB: 20 tools, 15 rounds, 2 tool results): CPU per request, ms; latency, ms (ratio to bare)",
     [("CPU agent c64", "agent_c64.cpu_ms", 3), ("agent req/s c64", "agent_c64.rps", 0),
      ("agent p50 c64", "agent_c64.p50_ms", 2), ("CPU agent c1", "agent_c1.cpu_ms", 3),
      ("added p50 agent c1", "added.agent_c1.p50_ms", 3)]),
    ("Peak RSS of the proxy (its processes together, export child included) per scenario, MB",
     [(name, f"{name}.peak_rss_mb", 0) for name in ("json_c1", "sse_c1", "chain_c1", "chainsse_c1", "json_c64",
                                                    "sse_c64", "slow_c256", "agent_c64")]),
    ("Is the bench itself sound? Other work on the proxy's CPU 0 (%, median) and load on CPU 1 (%, median)",
     [("foreign CPU0 JSON c64", "json_c64.foreign_cpu0_pct", 0),
      ("foreign CPU0 SSE c64", "sse_c64.foreign_cpu0_pct", 0),
      ("foreign CPU0 JSON c1", "json_c1.foreign_cpu0_pct", 0), ("CPU1 busy JSON c64", "json_c64.cpu1_busy_pct", 0),
      ("CPU1 busy SSE c64", "sse_c64.cpu1_busy_pct", 0),
      ("upstream CPU ms/req JSON c64", "json_c64.upstream_cpu_ms", 3)]),
]


WORKER_COLUMNS = [("JSON req/s c64", "json_c64.rps", 0), ("SSE req/s c64", "sse_c64.rps", 0),
                  ("256c req/s", "slow_c256.rps", 0), ("agent req/s c64", "agent_c64.rps", 0),
                  ("JSON p50 c64 ms", "json_c64.p50_ms", 2), ("CPU JSON c64 ms", "json_c64.cpu_ms", 3),
                  ("proxy cores busy, JSON c64", "json_c64.cores", 2),
                  ("JSON calls/s per proxy core", "json_c64.rps_per_core", 0),
                  ("SSE calls/s per proxy core", "sse_c64.rps_per_core", 0),
                  ("CPU0 busy JSON c64 %", "json_c64.cpu0_busy_pct", 0),
                  ("CPU1 busy JSON c64 %", "json_c64.cpu1_busy_pct", 0)]


def workers_vs_one(summary: dict[str, dict[str, float]]) -> dict[str, float]:
    """sm-workers2 over sm-full (the same spanmeter in one process), measured in the same run."""
    one, two = summary.get("sm-full"), summary.get("sm-workers2")
    if not one or not two:
        return {}
    return {key: two[key] / one[key] for _, key, _ in WORKER_COLUMNS if one.get(key) and key in two}


def render_workers(summary: dict[str, dict[str, float]]) -> str:
    ratio = workers_vs_one(summary)
    if not ratio:
        return ""
    lines = ["\n\n2 workers vs 1 (sm-workers2 / sm-full, same run; the workers share CPU 1 with wrk and the "
             "upstream)\n", "| target | " + " | ".join(c[0] for c in WORKER_COLUMNS) + " |",
             "|---|" + "---|" * len(WORKER_COLUMNS)]
    for name in ("sm-full", "sm-workers2"):
        lines.append(f"| {name} | " + " | ".join(_fmt(summary[name].get(k), None, d) for _, k, d in WORKER_COLUMNS)
                     + " |")
    lines.append("| 2 workers / 1 | " + " | ".join(f"{ratio[k]:.2f}x" if k in ratio else "-"
                                                  for _, k, _ in WORKER_COLUMNS) + " |")
    return "\n".join(lines)


BEFORE_COLUMNS = [("CPU JSON c64 ms", "json_c64.cpu_ms", 3), ("CPU SSE c64 ms", "sse_c64.cpu_ms", 3),
                  ("event loop JSON c64 ms", "json_c64.loop_cpu_ms", 3),
                  ("event loop SSE c64 ms", "sse_c64.loop_cpu_ms", 3), ("CPU agent c64 ms", "agent_c64.cpu_ms", 3),
                  ("added p50 JSON c1 ms", "added.json_c1.p50_ms", 3),
                  ("added p50 SSE c1 ms", "added.sse_c1.p50_ms", 3), ("JSON req/s c64", "json_c64.rps", 0),
                  ("256c req/s", "slow_c256.rps", 0), ("peak RSS MB", "peak_rss_mb", 1)]


def render_before(summary: dict[str, dict[str, float]]) -> str:
    """sm-full over sm-before (--baseline): the change, measured side by side in one run."""
    before, after = summary.get("sm-before"), summary.get("sm-full")
    if not before or not after:
        return ""
    lines = ["\n\nThis checkout (sm-full) vs the baseline (sm-before), same run\n",
             "| target | " + " | ".join(c[0] for c in BEFORE_COLUMNS) + " |", "|---|" + "---|" * len(BEFORE_COLUMNS)]
    for name in ("sm-before", "sm-full"):
        lines.append(f"| {name} | " + " | ".join(_fmt(summary[name].get(k), None, d) for _, k, d in BEFORE_COLUMNS)
                     + " |")
    lines.append("| after / before | " + " | ".join(f"{after[k] / before[k]:.2f}x" if before.get(k) and k in after
                                                   else "-" for _, k, _ in BEFORE_COLUMNS) + " |")
    return "\n".join(lines)


def render_tables(summary: dict[str, dict[str, float]], rat: dict[str, dict[str, float]]) -> str:
    lines: list[str] = []
    for title, cols in TABLES:
        lines += [f"\n{title}\n", "| target | " + " | ".join(c[0] for c in cols) + " |",
                  "|---|" + "---|" * len(cols)]
        with_ratio = "ratio" in title
        for name, m in summary.items():
            cells = [_fmt(m.get(key), rat[name].get(key) if with_ratio and name not in ("bare", "direct") else None, d)
                     for _, key, d in cols]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + render_workers(summary) + render_before(summary)


# Issue 51's targets (speed round three), each for calls within a run and for calls that carry
# no run id (every call its own run). kind: "added" is ms over direct (at most), "ratio" CPU
# over bare's in the same run (at most), "ratio_min" a rate over bare's (at least),
# "max_scenarios" the highest per-scenario value (at most; only for targets with OTLP export on).
TARGETS_CHECKED = [
    ("added p50, 1 connection, JSON <= 0.6 ms", "added.json_c1.p50_ms", "added", 0.6),
    ("added p50, 1 connection, JSON, no run id <= 0.6 ms", "added.oneshot_c1.p50_ms", "added", 0.6),
    ("added p50, 1 connection, 50-event stream <= 0.75 ms", "added.sse_c1.p50_ms", "added", 0.75),
    ("added p50, 1 connection, 50-event stream, no run id <= 0.75 ms", "added.oneshotsse_c1.p50_ms", "added", 0.75),
    ("added p50, back-to-back calls of a run with tool results, JSON <= 0.6 ms", "added.chain_c1.p50_ms", "added",
     0.6),
    ("added p50, back-to-back calls of a run with tool results, stream <= 0.75 ms", "added.chainsse_c1.p50_ms",
     "added", 0.75),
    ("CPU per request JSON, 64 connections <= 2.8x bare", "json_c64.cpu_ms", "ratio", 2.8),
    ("CPU per request JSON, 64 connections, no run id <= 2.8x bare", "oneshot_c64.cpu_ms", "ratio", 2.8),
    ("CPU per request 50-event stream, 64 connections <= 3.4x bare", "sse_c64.cpu_ms", "ratio", 3.4),
    ("CPU per request 50-event stream, 64 connections, no run id <= 3.4x bare", "oneshotsse_c64.cpu_ms", "ratio",
     3.4),
    ("throughput, 256 connections, 50 ms upstream >= 60% of bare", "slow_c256.rps", "ratio_min", 0.6),
    ("peak RSS <= 150 MB in every scenario (OTLP export on)", "peak_rss_mb", "max_scenarios", 150.0),
]
OTLP_ON = ("sm-full", "sm-redis", "sm-cluster", "sm-workers2", "sm-before", "sm-fast", "sm-noleases")


# Issue 28's target: the anatomy's work per call in a run at most 20 us, set beside a bare
# pass-through's 0.170 ms of CPU per JSON request at 64 connections (issue 29's table, one
# machine): 11.8% of it. The same share of bare's figure in this run is the target on this machine.
ANATOMY_TARGET_US = 20.0
ANATOMY_TARGET_SHARE = ANATOMY_TARGET_US / 170.0


def anatomy_line(anatomy: dict[str, float], bare_cpu_ms: float | None) -> str:
    """The cost anatomy's figure beside its target, absolute and as a share of bare's CPU per
    JSON request in the same run (machines differ ~3x in Python's speed; the share does not)."""
    whole = anatomy["whole"]
    line = (f"Cost anatomy per call at the agent turn (bench/bench_anatomy.py): {whole:.1f} us in a run, "
            f"{anatomy['whole_cold']:.1f} us for a run's first call; target {ANATOMY_TARGET_US:.0f} us: "
            f"{'met' if whole <= ANATOMY_TARGET_US else 'not met'}")
    if bare_cpu_ms:
        share = whole / (bare_cpu_ms * 1000)
        line += (f"; {share:.1%} of bare's CPU per JSON request in this run ({bare_cpu_ms * 1000:.0f} us), target "
                 f"{ANATOMY_TARGET_SHARE:.1%} (20 us beside the issue's bare 170 us): "
                 f"{'met' if share <= ANATOMY_TARGET_SHARE else 'not met'}")
    return line


def verdicts(summary: dict[str, dict[str, float]], rat: dict[str, dict[str, float]],
             paired: dict[str, dict[str, float]] | None = None) -> dict[str, list[str]]:
    """Per spanmeter target: each target met or not, with bare's figure from the same run
    beside it, and for a ratio the median of the ratios paired by repetition
    (`paired_ratios`) too. The verdict is the ratio of medians."""
    bare = summary.get("bare", {})
    paired = paired or {}
    out: dict[str, list[str]] = {}
    for name in summary:
        if not name.startswith("sm-"):
            continue
        rows = []
        for label, key, kind, limit in TARGETS_CHECKED:
            m = summary[name]
            if kind == "max_scenarios":
                if name not in OTLP_ON or key not in m:
                    continue
                v, unit = m[key], " MB"
                worst = max((k for k in m if k.endswith(".peak_rss_mb")), key=lambda k: m[k], default="")
                split = (f": serving {m.get('peak_rss_serving_mb', 0):.0f} + export child "
                         f"{m.get('peak_rss_child_mb', 0):.0f} MB, at start-up "
                         f"{m.get('start_rss_serving_mb', 0):.0f} + {m.get('start_rss_child_mb', 0):.0f}"
                         ) if "peak_rss_serving_mb" in m else ""
                side = f" (highest in {worst.split('.')[0]}{split}; bare {bare.get(key, 0):.0f} MB)"
            elif kind == "added":
                if key not in m:
                    continue
                v, unit, side = m[key], " ms", f" (bare +{bare[key]:.3f} ms)" if key in bare else ""
            else:
                if key not in rat.get(name, {}):
                    continue
                v, unit = rat[name][key], "x bare"
                pair = paired.get(name, {}).get(key)
                also = f"; paired by repetition {pair:.3f}x" if pair is not None else ""
                side = f" ({m[key]:,.3f} vs bare {bare[key]:,.3f}{also})" if "cpu" in key else \
                    f" ({m[key]:,.0f} vs bare {bare[key]:,.0f} req/s{also})"
            ok = v >= limit if kind == "ratio_min" else v <= limit
            rows.append(f"{'met    ' if ok else 'NOT MET'} {label}: {v:.3f}{unit}{side}")
        out[name] = rows
    return out


def machine() -> dict[str, Any]:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())

    def version(cmd: list[str]) -> str:
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
            return (done.stdout or done.stderr).strip().splitlines()[0]
        except (OSError, IndexError, subprocess.TimeoutExpired):
            return "n/a"

    import aiohttp

    return {"cpu": cpu, "cores": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version(),
            "aiohttp": aiohttp.__version__, "wrk": version(["wrk", "-v"]), "nginx": version(["nginx", "-v"]),
            "mem_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)}


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer targets, one repetition (~2-3 minutes)")
    p.add_argument("--reps", type=int, help="repetitions per scenario (default 3, quick 1)")
    p.add_argument("--duration", type=int, help="seconds per measurement (default 3, quick 2)")
    p.add_argument("--targets", help="comma-separated subset of: " + ", ".join(FULL.targets))
    p.add_argument("--scenarios", help="comma-separated subset of: " + ", ".join(BY_NAME))
    p.add_argument("--no-profile", action="store_true", help="skip the py-spy profile of sm-full")
    p.add_argument("--profile-only", action="store_true",
                   help="only start sm-full (or the one target of --targets, e.g. bare) and profile it")
    p.add_argument("--profile-c1", action="store_true",
                   help="only start sm-full and profile it at 1 connection: every thread and the export child, "
                        "wall time (JSON, stream, back-to-back calls of a run)")
    p.add_argument("--soak", type=int, metavar="N", help="run the reliability soak of N requests instead")
    p.add_argument("--out", default=str(HERE / "results" / "latest.json"))
    p.add_argument("--sm-env", action="append", default=[], metavar="KEY=VALUE",
                   help="a setting for every spanmeter target (repeatable), e.g. SPANMETER_GC_TUNING=false")
    p.add_argument("--baseline", type=Path, metavar="DIR",
                   help="another checkout (e.g. a git worktree of the previous commit) run as target sm-before "
                        "beside sm-full, so a change is measured side by side in one run")
    args = p.parse_args(argv)
    if os.cpu_count() is None or os.cpu_count() < 2:  # type: ignore[operator]
        print("warning: fewer than 2 CPUs; pinning proxy and load apart is impossible", file=sys.stderr)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so `finally` ends the children
    plan = QUICK if args.quick else FULL
    plan = Plan(args.reps or plan.reps, args.duration or plan.duration_s, plan.warmup_s,
                args.targets.split(",") if args.targets else plan.targets, plan.ttfb_n, plan.profile_s)
    SM_ENV.update(kv.split("=", 1) for kv in args.sm_env)  # type: ignore[arg-type]
    if args.scenarios:
        wanted = args.scenarios.split(",")
        unknown = [n for n in wanted if n not in BY_NAME]
        if unknown:
            p.error(f"unknown scenario(s) {', '.join(unknown)}: choose from {', '.join(BY_NAME)}")
        SCENARIOS[:] = [s for s in SCENARIOS if s.name in wanted]
    if "direct" not in plan.targets:
        plan.targets.insert(0, "direct")
    if args.baseline is not None and "sm-before" not in plan.targets:
        plan.targets.append("sm-before")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="spanmeter-bench-") as tmp:
        procs = Procs(Path(tmp))
        try:
            if args.soak:
                from soak import run_soak

                report = run_soak(procs, args.soak)
                _write(Path(args.out).with_name("soak.json"), report)
                return 0 if report["ok"] else 1
            if args.profile_only:
                return _profile_only(procs, plan, args.targets or "sm-full")
            if args.profile_c1:
                return _profile_c1(procs, plan)
            return _bench(procs, plan, args, started)
        finally:
            procs.close()


def _bench(procs: Procs, plan: Plan, args: argparse.Namespace, started: float) -> int:
    upstream, kind = start_upstream(procs)
    targets = start_targets(procs, plan, upstream, args.baseline)
    smoke(targets)
    print(f"upstream: {kind}; targets: {', '.join(t.name for t in targets)}; {plan.reps} rep(s) x "
          f"{len(SCENARIOS)} scenarios x {plan.duration_s} s", flush=True)
    run_load(targets, plan, procs.tmp, upstream)
    summary = summarise(targets)
    rat = ratios(summary)
    profile: dict[str, Any] = {}
    full = next((t for t in targets if t.name == "sm-full"), None)
    if not args.no_profile and full is not None and full.proc is not None:
        from profile_hot import profile_target

        profile = profile_target(full.proc, lambda sc, d: wrk(full, sc, d, procs.tmp, f"p{sc.name}"),
                                 {"json": BY_NAME["json_c64"], "sse": BY_NAME["sse_c64"]}, plan.profile_s, procs.tmp)
    tables = render_tables(summary, rat)
    paired = paired_ratios(targets)
    before = paired_ratios(targets, base="sm-before").get("sm-full", {})
    if before:
        tables += "\n\nsm-full / sm-before, paired by repetition: " + ", ".join(
            f"{k} {v:.3f}x" for k, v in sorted(before.items()))
    verdict = verdicts(summary, rat, paired)
    noisy = sorted({f"{t.name}/{sc}" for t in targets for sc, runs in t.runs.items()
                    if any(r.get("foreign_cpu0_pct", 0) > 10 for r in runs)})
    if noisy:
        tables += ("\n\nWARNING: other processes used more than 10% of CPU 0 during " + str(len(noisy)) +
                   " measurement(s) (" + ", ".join(noisy[:12]) + ("..." if len(noisy) > 12 else "") +
                   "): latencies and rates of those are pessimistic; CPU per request is the robust figure.")
    from bench_anatomy import measure as anatomy_measure

    anatomy = anatomy_measure(2000)  # the cost anatomy's CPU per call (issue 28): seconds, in-process
    tables += "\n\n" + anatomy_line(anatomy, summary.get("bare", {}).get("json_c64.cpu_ms"))
    print(tables)
    for name, rows in verdict.items():
        print(f"\n{name}:\n  " + "\n  ".join(rows))
    if profile:
        from profile_hot import render_profile

        print(render_profile(profile))
    report = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": machine(), "upstream": kind,
        "plan": plan.__dict__, "targets": {t.name: t.what for t in targets},
        "scenarios": {s.name: s.what for s in SCENARIOS},
        "summary": summary, "ratio_to_bare": rat, "paired_ratio_to_bare": paired,
        "paired_ratio_to_before": before, "workers_vs_one": workers_vs_one(summary),
        "contaminated": noisy, "verdicts": verdict, "tables_md": tables, "anatomy_us": anatomy,
        "runs": {t.name: t.runs | {"ttfb": t.ttfb} for t in targets}, "profile": profile,
        "elapsed_s": round(time.monotonic() - started, 1),
    }
    _write(Path(args.out), report)
    print(f"\nwrote {args.out} in {report['elapsed_s']} s")
    return 0


def _profile_only(procs: Procs, plan: Plan, name: str) -> int:
    """py-spy on one target under JSON and stream load at 64 connections: sm-full, or
    another (bare: what aiohttp alone spends, read the same way)."""
    from profile_hot import profile_target, render_profile

    if name not in DESCRIPTIONS or name in ("direct", "sm-before"):
        raise SystemExit(f"--profile-only profiles one proxy target, not {name!r}")
    upstream, _ = start_upstream(procs)
    targets = start_targets(procs, Plan(1, 1, 1, ["direct", name], 0, plan.profile_s), upstream)
    full = targets[-1]
    assert full.proc is not None
    smoke(targets)
    # --scenarios picks what is profiled (e.g. oneshot_c64); else JSON and a stream at 64 connections.
    chosen = {s.name: s for s in SCENARIOS} if len(SCENARIOS) < len(BY_NAME) else \
        {"json": BY_NAME["json_c64"], "sse": BY_NAME["sse_c64"]}
    for sc in chosen.values():
        measure(full, sc, plan.warmup_s, procs.tmp, f"w{sc.name}")
    profile = profile_target(full.proc, lambda sc, d: wrk(full, sc, d, procs.tmp, f"p{sc.name}"),
                             chosen, plan.profile_s, procs.tmp)
    print(render_profile(profile, name))
    _write(HERE / "results" / ("profile.json" if name == "sm-full" else f"profile-{name}.json"), profile)
    return 0


def _profile_c1(procs: Procs, plan: Plan) -> int:
    from profile_hot import profile_one_connection, render_threads

    upstream, _ = start_upstream(procs)
    targets = start_targets(procs, Plan(1, 1, 1, ["direct", "sm-full"], 0, plan.profile_s), upstream)
    full = targets[-1]
    assert full.proc is not None
    smoke(targets)
    chosen = {n: BY_NAME[n] for n in ("json_c1", "sse_c1", "chain_c1")}
    for sc in chosen.values():
        measure(full, sc, plan.warmup_s, procs.tmp, f"w{sc.name}")
    profile = profile_one_connection(full.proc, lambda sc, d: wrk(full, sc, d, procs.tmp, f"p{sc.name}"), chosen,
                                     plan.profile_s, procs.tmp)
    print(render_threads(profile))
    _write(HERE / "results" / "profile-c1.json", profile)
    return 0


def _write(path: Path, report: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, default=str) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
