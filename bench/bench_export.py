"""Serving-process CPU per span with span export in-process vs in the export child process.

    .venv/bin/python bench/bench_export.py [--calls N] [--repeats R]

Builds N realistic call spans through the real tracing API (`spans.start_call` +
`spans.end_call`, JSON and streamed calls alternating, as bench/bench_spans.py does),
then `force_flush`es, and measures `time.process_time()` of this process only: the
calling thread plus the export thread (in-process) or the hand-off thread (child). The
collector is bench/otlp_sink.py in its own process, so its CPU is not counted; neither
is the export child's. Modes alternate within each repeat; the best of R is shown.

    otlp   OTEL traces to the sink, gzip (the default), export_process off vs on
    local  the local JSON-lines files only, export_process off vs on

`calling thread` is what the calls themselves cost (span + metric points) and is the
same either way; the rest is the export (off) or the hand-off (on). `child` is the export
process's own CPU (utime + stime from /proc, 10 ms ticks: coarse), off the serving
process's GIL but not free: `total` is both.
"""

from __future__ import annotations

import argparse
import gc
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

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


def make(kind: str, mode: ExportProcess, endpoint: str, local_dir: str) -> Telemetry:
    cfg = TelemetryConfig(
        otlp_endpoint=endpoint if kind == "otlp" else None,
        local_dir=local_dir if kind == "local" else None,
        export_process=mode, metric_export_interval_ms=3_600_000,
    )  # fmt: skip
    return setup_telemetry(cfg, environ={})


def child_ticks() -> int:
    """CPU ticks (utime + stime) of our live export children."""
    ticks = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and b"tracing.export_process" in cmdline:
            ticks += int(fields[11]) + int(fields[12])
    return ticks


def measure(tel: Telemetry, calls: int) -> tuple[float, float, float]:
    """(process CPU µs per span, calling thread CPU µs per span, child CPU µs per span)."""
    for i in range(200):  # warm caches, and start the child before measuring
        one_call(tel, i, i % 2 == 1)
    tel.force_flush()
    gc.collect()
    c0 = child_ticks()
    p0, t0 = time.process_time_ns(), time.thread_time_ns()
    for i in range(calls):
        one_call(tel, i, i % 2 == 1)
    t1 = time.thread_time_ns()
    assert tel.force_flush(60_000), "flush failed"
    p1 = time.process_time_ns()
    child_us = (child_ticks() - c0) / os.sysconf("SC_CLK_TCK") * 1e6 / calls
    return (p1 - p0) / calls / 1e3, (t1 - t0) / calls / 1e3, child_us


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=5000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kinds", default="otlp,local", help="which exports: otlp, local or both")
    args = ap.parse_args()
    sink, endpoint = start_sink()
    try:
        for kind in args.kinds.split(","):
            best: dict[str, tuple[float, float, float]] = {}
            for _ in range(args.repeats):
                for mode in ("off", "on"):
                    with tempfile.TemporaryDirectory() as d:
                        tel = make(kind, mode, endpoint, d)
                        try:
                            got = measure(tel, args.calls)
                        finally:
                            tel.shutdown()
                    if mode not in best or got[0] < best[mode][0]:
                        best[mode] = got
            print(f"{kind}: serving-process CPU per span (best of {args.repeats}, {args.calls} calls)")
            for mode, (proc_us, thread_us, child_us) in best.items():
                print(f"  export_process={mode:3s}  process {proc_us:6.1f} µs/span  "
                      f"(calling thread {thread_us:6.1f}, export/hand-off {proc_us - thread_us:5.1f})  "
                      f"child {child_us:5.1f}  total {proc_us + child_us:6.1f}")
        with urllib.request.urlopen(endpoint + "/stats", timeout=5) as r:
            print("sink received:", r.read().decode())
    finally:
        sink.kill()
        sink.wait()


if __name__ == "__main__":
    main()
