"""Serving-process CPU per span with span export in-process vs in the export child process,
and, with the child, spans that end as ReadableSpans vs as flat records (issue 51).

    .venv/bin/python bench/bench_export.py [--calls N] [--repeats R]
    .venv/bin/python bench/bench_export.py --kinds otlp --modes spans,records,records:9   # issue 51

Builds N realistic call spans through the real tracing API (`spans.start_call` +
`spans.end_call`, JSON and streamed calls alternating, as bench/bench_spans.py does),
then `force_flush`es, and measures `time.process_time()` of this process only: the
calling thread plus the export thread (in-process) or the hand-off thread (child). The
collector is bench/otlp_sink.py in its own process, so its CPU is not counted; neither
is the export child's. Modes alternate within each repeat; the best of R is shown.

    otlp   OTEL traces to the sink, gzip (the default), export_process off vs on
    local  the local JSON-lines files only, export_process off vs on

`--modes` (default off,on): `off` exports in process; `on` is the child as configured by
default; `spans` the child fed ReadableSpans and gzip at the exporter's level 9, the path
before issue 51 (span_records=False, gzip_level=None); `records` the child fed flat
records at the default gzip level; `records:N` the same at gzip level N; `records:N:B`
with batches of B spans (max_export_batch, both sides of the pipe) too. With `--kinds
otlp`, `wire` is the bytes the sink received per span.

`calling thread` is what the calls themselves cost (span + metric points) and is the
same either way; the rest is the export (off) or the hand-off (on). `child` is the export
process's own CPU (the scheduler's run time of each of its threads, from
/proc/PID/task/*/schedstat), off the serving process's GIL but not free: `total` is both.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_spans import one_call
from tracing.setup import ExportProcess, Telemetry, TelemetryConfig, setup_telemetry


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_sink() -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    sink = Path(__file__).resolve().parent / "otlp_sink.py"
    proc = subprocess.Popen([sys.executable, str(sink), "--port", str(port)], stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            urllib.request.urlopen(url + "/stats", timeout=1).read()
            return proc, url
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("the OTLP sink did not start")


def make(kind: str, mode: str, endpoint: str, local_dir: str) -> Telemetry:
    base, _, rest = mode.partition(":")
    level, _, batch = rest.partition(":")
    process: ExportProcess = "off" if base == "off" else "on"
    extra: dict[str, Any] = {"max_export_batch": int(batch)} if batch else {}
    if base == "spans":
        extra.update(span_records=False, gzip_level=None)
    elif base == "records":
        extra.update(span_records=True, **({"gzip_level": int(level)} if level else {}))
    cfg = TelemetryConfig(
        otlp_endpoint=endpoint if kind == "otlp" else None,
        local_dir=local_dir if kind == "local" else None,
        export_process=process, metric_export_interval_ms=3_600_000, **extra,
    )  # fmt: skip
    return setup_telemetry(cfg, environ={})


def child_ns() -> int:
    """CPU time (ns, the scheduler's run time of every thread) of our live export children."""
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and b"tracing.export_process" in cmdline:
            for task in (entry / "task").iterdir():
                with contextlib.suppress(OSError):
                    total += int((task / "schedstat").read_text().split()[0])
    return total


def child_peak_mb() -> float:
    """The highest peak RSS (VmHWM) of our live export children, MB."""
    peak = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (entry / "cmdline").read_bytes()
            status = (entry / "status").read_text()
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and b"tracing.export_process" in cmdline:
            for line in status.splitlines():
                if line.startswith("VmHWM:"):
                    peak = max(peak, int(line.split()[1]))
    return peak / 1024


def sink_bytes(endpoint: str) -> int:
    with urllib.request.urlopen(endpoint + "/stats", timeout=5) as r:
        return int(json.loads(r.read()).get("traces_wire_bytes", 0))


def measure(tel: Telemetry, calls: int, endpoint: str) -> tuple[float, float, float, float, float]:
    """(process CPU µs per span, calling thread CPU µs per span, child CPU µs per span,
    bytes the sink received per span, the child's peak RSS in MB since it started)."""
    for i in range(200):  # warm caches, and start the child before measuring
        one_call(tel, i, i % 2 == 1)
    tel.force_flush()
    gc.collect()
    c0, b0 = child_ns(), sink_bytes(endpoint)
    p0, t0 = time.process_time_ns(), time.thread_time_ns()
    for i in range(calls):
        one_call(tel, i, i % 2 == 1)
    t1 = time.thread_time_ns()
    assert tel.force_flush(60_000), "flush failed"
    p1 = time.process_time_ns()
    child_us = (child_ns() - c0) / calls / 1e3
    wire = (sink_bytes(endpoint) - b0) / calls
    return (p1 - p0) / calls / 1e3, (t1 - t0) / calls / 1e3, child_us, wire, child_peak_mb()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=5000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kinds", default="otlp,local", help="which exports: otlp, local or both")
    ap.add_argument("--modes", default="off,on", help="off, on, spans, records, records:N (see above)")
    args = ap.parse_args()
    sink, endpoint = start_sink()
    try:
        for kind in args.kinds.split(","):
            runs: dict[str, list[tuple[float, float, float, float, float]]] = {}
            modes = args.modes.split(",")
            for _ in range(args.repeats):
                for mode in modes:
                    with tempfile.TemporaryDirectory() as d:
                        tel = make(kind, mode, endpoint, d)
                        try:
                            runs.setdefault(mode, []).append(measure(tel, args.calls, endpoint))
                        finally:
                            tel.shutdown()
            print(f"{kind}: CPU per span (best of {args.repeats} by process CPU, {args.calls} calls; in turns)")
            for mode, got in runs.items():
                proc_us, thread_us, child_us, wire, _ = min(got)
                spread = "/".join(f"{g[0]:.1f}" for g in got)
                print(f"  {mode:10s} process {proc_us:6.1f} µs/span  "
                      f"(calling thread {thread_us:6.1f}, export/hand-off {proc_us - thread_us:5.1f})  "
                      f"child {child_us:5.1f} (all: {'/'.join(f'{g[2]:.1f}' for g in got)})  "
                      f"total {proc_us + child_us:6.1f}  wire {wire:5.0f} B/span  child peak RSS "
                      f"{max(g[4] for g in got):.1f} MB  [process, all: {spread}]")
        with urllib.request.urlopen(endpoint + "/stats", timeout=5) as r:
            print("sink received:", r.read().decode())
    finally:
        sink.kill()
        sink.wait()


if __name__ == "__main__":
    main()
