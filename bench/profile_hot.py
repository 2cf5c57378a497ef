"""Profile a running proxy under load with py-spy and list where its CPU goes.

py-spy samples the process from outside (no instrumentation in the proxy) while wrk
drives one scenario, only the thread holding the GIL (`--gil`): that is Python CPU
time, not threads waiting on fsync, a queue or a socket (the ledger's COMMIT, which
waits on fsync with the GIL released, would otherwise look like a fifth of the time).
The collapsed stacks are folded here into self time per function, inclusive time per
function, and time per area (our proxy/, tracing/, aiohttp,
OpenTelemetry, the ledger's drivers, everything else).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["fold", "profile_target", "render_profile"]

FRAME = re.compile(r"^(?P<fn>.*?) \((?P<file>[^:()]*)(?::(?P<line>\d+))?\)$")
AREAS = [  # first match wins; matched against the file path of a frame
    ("spanmeter proxy/", "/proxy/"),
    ("spanmeter tracing/", "/tracing/"),
    ("opentelemetry", "/opentelemetry/"),
    ("aiohttp", "/aiohttp/"),
    ("multidict/yarl", "/multidict/"),
    ("multidict/yarl", "/yarl/"),
    ("redis client", "/redis/"),
    ("sqlite3", "sqlite3"),
    ("protobuf", "/google/protobuf/"),
    ("pydantic", "/pydantic"),
    ("orjson", "orjson"),
    ("asyncio/uvloop", "/asyncio/"),
    ("asyncio/uvloop", "uvloop"),
    ("threading", "threading.py"),
]


def _py_spy() -> str | None:
    here = Path(sys.executable).parent / "py-spy"
    return str(here) if here.exists() else shutil.which("py-spy")


def _label(frame: str) -> tuple[str, str]:
    m = FRAME.match(frame)
    if not m:
        return frame, ""
    path = m["file"]
    short = "/".join(path.split("/")[-2:]) if "site-packages" in path or "/lib/python" in path else path
    for marker in ("/proxy/", "/tracing/"):
        if marker in path and "site-packages" not in path:
            short = marker.strip("/") + "/" + path.split(marker, 1)[1]
    return f"{m['fn']} ({short})", path


def _area(path: str) -> str:
    if "site-packages" not in path:
        if "/proxy/" in path:
            return "spanmeter proxy/"
        if "/tracing/" in path:
            return "spanmeter tracing/"
    for area, marker in AREAS[2:]:
        if marker in path:
            return area
    return "other (stdlib, interpreter)"


def fold(collapsed: str, top: int = 15) -> dict[str, Any]:
    """Collapsed stacks (`a;b;c N` lines) -> self/inclusive/area/thread shares in percent."""
    self_t: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    area: Counter[str] = Counter()
    thread: Counter[str] = Counter()
    main_area: Counter[str] = Counter()
    main_self: Counter[str] = Counter()
    total = main_total = 0
    for line in collapsed.splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        count = int(n)
        frames = stack.split(";")
        name = "MainThread"
        if frames and frames[0].startswith(("thread ", "process ")):
            # `thread (TID): NAME` with --threads
            name = frames[0].partition("): ")[2] or frames[0]
            thread[name] += count
            frames = frames[1:]
        if not frames:
            continue
        total += count
        labels = [_label(f) for f in frames]
        self_t[labels[-1][0]] += count
        area[_area(labels[-1][1])] += count
        if name == "MainThread":
            main_total += count
            main_area[_area(labels[-1][1])] += count
            main_self[labels[-1][0]] += count
        for name in {lbl for lbl, _ in labels}:
            incl[name] += count

    def pct(c: Counter[str], n: int, of: int = 0) -> list[tuple[str, float]]:
        of = of or total
        return [(k, round(100 * v / of, 1)) for k, v in c.most_common(n)] if of else []

    return {"samples": total, "self": pct(self_t, top), "inclusive": pct(incl, top * 2),
            "areas": pct(area, 20), "threads": pct(thread, 10),
            "main_areas": pct(main_area, 20, main_total), "main_self": pct(main_self, top, main_total)}


def profile_target(proc: Any, drive: Callable[[Any, int], dict[str, Any]], scenarios: dict[str, Any],
                   seconds: int, tmp: Path) -> dict[str, Any]:
    spy = _py_spy()
    if spy is None:
        print("py-spy not installed (.venv/bin/pip install -e '.[bench]'): no profile", flush=True)
        return {}
    out: dict[str, Any] = {}
    for name, sc in scenarios.items():
        raw = tmp / f"profile-{name}.txt"
        cmd = ["taskset", "-c", "1", spy, "record", "--pid", str(proc.pid), "--duration", str(seconds + 1),
               "--rate", "250", "--format", "raw", "--threads", "--full-filenames", "--gil",
               "--nonblocking", "--output", str(raw)]
        spy_proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        loaded: dict[str, Any] = {}
        t = threading.Thread(target=lambda sc=sc, loaded=loaded: loaded.update(drive(sc, seconds)))
        t.start()
        t.join()
        try:
            _, err = spy_proc.communicate(timeout=seconds + 30)
        except subprocess.TimeoutExpired:
            spy_proc.kill()
            _, err = spy_proc.communicate()
        if not raw.exists():
            print(f"py-spy failed: {err.decode(errors='replace')[-400:]}", flush=True)
            return {}
        out[name] = fold(raw.read_text()) | {"rps_while_sampled": loaded.get("requests", 0) / seconds}
        (Path(__file__).parent / "results").mkdir(exist_ok=True)
        (Path(__file__).parent / "results" / f"profile-{name}.collapsed").write_text(raw.read_text())
    return out


def render_profile(profile: dict[str, Any]) -> str:
    lines = []
    for name, p in profile.items():
        lines.append(f"\nProfile of sm-full under {name} load at 64 connections ({p['samples']} samples, "
                     f"py-spy, all threads)")
        lines.append("  by area (self time): " + ", ".join(f"{k} {v}%" for k, v in p["areas"]))
        lines.append("  by thread: " + ", ".join(f"{k} {v}%" for k, v in p["threads"]))
        lines.append("  event-loop thread only, by area: " + ", ".join(f"{k} {v}%" for k, v in p["main_areas"]))
        lines.append("  top self time:")
        lines += [f"    {v:5.1f}%  {k}" for k, v in p["self"]]
        lines.append("  top inclusive (spanmeter frames):")
        ours = [(k, v) for k, v in p["inclusive"] if k.split("(")[-1].startswith(("proxy/", "tracing/"))]
        lines += [f"    {v:5.1f}%  {k}" for k, v in ours]
    return "\n".join(lines)
