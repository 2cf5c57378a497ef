"""Where the event loop's CPU per call goes, by layer of spanmeter (issue 51's findings).

Runs bench/bench_percall.py (the real app in one process, pinned as make bench pins it)
and samples its event-loop thread with py-spy while the measured calls run. Each sample
is put in the layer of the innermost spanmeter frame on its stack (what a library does for
one of our modules counts to that module: SQLite for the ledger, the OTel SDK for
tracing, aiohttp's client for the upstream call), or in `event loop and aiohttp server`
when the stack has no spanmeter frame at all. Shares times the loop's CPU per call give
microseconds per call per layer.

    python bench/bench_layers.py [--payload json] [--run-calls 20] [--calls 20000] [--seconds 8]
    python bench/bench_layers.py --collapsed bench/results/profile-json_c64.collapsed --loop-us 625

The layers answer: if a layer cost nothing, what would the rest cost? The pass-through
layer is what any proxy does (bench/passthrough.py does the same with aiohttp).

Read the shares at 64 connections, where the loop never sleeps. py-spy cannot tell uvloop's
C code running from its wait in epoll_wait (both are the `Runner.run` frame), so where the
loop waits (one connection) the first layer also holds idle time and the shares overstate it.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

# (layer, path prefixes of its modules), the first match wins.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("pass-through: body, upstream call, relay", ("proxy/serve/upstream.py", "proxy/serve/relay.py",
                                                   "proxy/serve/body.py", "proxy/serve/content.py")),
    ("ledger, ceilings, prices, runs", ("proxy/ledger/", "proxy/govern/ceilings.py", "proxy/govern/runs.py",
                                        "proxy/pricing/", "proxy/serve/pipeline.py")),
    ("tracing: spans and metrics", ("tracing/",)),
    ("cost anatomy", ("proxy/anatomy/",)),
    ("access log", ("proxy/serve/accesslog.py",)),
    ("request and answer: parse, translate, observe, repair", ("proxy/providers/", "proxy/repair/",
                                                               "proxy/govern/outputs.py", "proxy/model.py")),
    ("guard, wrap-up, caching", ("proxy/govern/",)),
    ("routing, tenant, call flow, bookkeeping", ("proxy/",)),
)
NONE = "event loop and aiohttp server (no spanmeter frame)"
_ROOT = str(ROOT) + "/"
_OUTER = ("proxy/__main__.py", "proxy/ops/cli.py")  # below every frame of the serving process
_FRAME = re.compile(r"\((?P<file>[^:()]+)(?::\d+)?\)$")


def layer_of(stack: list[str]) -> str:
    """The layer of the innermost spanmeter frame of a py-spy stack (outermost first)."""
    for frame in reversed(stack):
        m = _FRAME.search(frame)
        if m is None:
            continue
        path = m.group("file")
        if path.startswith(_ROOT):  # make bench's profiles name files by their whole path
            path = path[len(_ROOT):]
        if path.startswith(("proxy/", "tracing/")) and not path.startswith(_OUTER):
            for name, prefixes in LAYERS:
                if path.startswith(prefixes):
                    return name
    return NONE


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--payload", default="json")
    p.add_argument("--run-calls", type=int, default=20)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--calls", type=int, default=20_000)
    p.add_argument("--seconds", type=int, default=8, help="how long py-spy samples, after a 7 s start")
    p.add_argument("--collapsed", type=Path,
                   help="instead, put the event-loop samples of this py-spy profile in layers (e.g. make bench's "
                        "bench/results/profile-json_c64.collapsed); --loop-us: its loop CPU per call")
    p.add_argument("--loop-us", type=float, default=float("nan"))
    args = p.parse_args()
    if args.collapsed is not None:
        _report(_samples(args.collapsed.read_text()), args.loop_us, f"{args.collapsed}:")
        return
    with tempfile.TemporaryDirectory(prefix="bench-layers-") as tmp:
        raw = Path(tmp) / "raw.txt"
        bench = subprocess.Popen(
            [sys.executable, str(HERE / "bench_percall.py"), "--pin", "--calls", str(args.calls), "--concurrency",
             str(args.concurrency), "--run-calls", str(args.run_calls), "--payload", args.payload],
            stdout=subprocess.PIPE, text=True, cwd=ROOT)
        time.sleep(7)  # start-up and warm-up
        spy = Path(sys.executable).with_name("py-spy")
        subprocess.run([str(spy), "record", "-p", str(bench.pid), "-d", str(args.seconds), "-r", "200", "-t",
                        "-f", "raw", "-o", str(raw), "--nonblocking"], capture_output=True, check=True)
        out, _ = bench.communicate(timeout=600)
        samples = _samples(raw.read_text())
    m = re.search(r"loop thread ([\d.]+) us", out)
    _report(samples, float(m.group(1)) if m else float("nan"), out.splitlines()[0])


def _samples(text: str) -> Counter[str]:
    """The event-loop thread's samples of a py-spy raw (collapsed) profile, by layer."""
    samples: Counter[str] = Counter()
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if "MainThread" in frames[0]:
            samples[layer_of(frames[1:])] += int(count)
    return samples


def _report(samples: Counter[str], loop_us: float, title: str) -> None:
    total = sum(samples.values()) or 1
    print(title)
    print(f"event-loop thread, {total} samples, by layer (share, us per call of its {loop_us:.0f} us):")
    for name, n in samples.most_common():
        print(f"  {100 * n / total:5.1f}%  {loop_us * n / total:6.0f} us  {name}")

if __name__ == "__main__":
    main()
