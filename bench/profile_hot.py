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

__all__ = ["fold", "fold_threads", "profile_one_connection", "profile_target", "render_profile", "render_threads"]

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


# Leaf frames where a thread waits rather than works (py-spy --idle samples them too).
WAITS = [  # a leaf frame that is a call into C which blocks
    ("waiting for I/O (event loop poll)", ("run_app (", "run_forever", "run_until_complete", "select (selectors.py)")),
    ("waiting for work (ledger queue)", ("SqliteStore._serve (", "SqliteStore._next_job (", "get (queue.py)")),
    ("waiting for work (a queue, a pipe or a condition)", ("Condition.wait", "_read_exactly", "_Offloaded._write",
                                                           "Event.wait", "recv_bytes", "_recv (")),
]


def fold_threads(collapsed: str, top: int = 12) -> dict[str, Any]:
    """Wall-clock stacks (`--idle`, no `--gil`) -> per thread: its share of samples, and
    within it the leaf frames (self) and our frames (inclusive), in percent of that thread."""
    per: dict[str, Counter[str]] = {}
    incl: dict[str, Counter[str]] = {}
    totals: Counter[str] = Counter()
    for line in collapsed.splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        frames = stack.split(";")
        name = "MainThread"
        if frames and frames[0].startswith(("thread ", "process ")):
            name = frames[0].partition("): ")[2] or frames[0]
            frames = frames[1:]
        if not frames:
            continue
        count = int(n)
        labels = [_label(f)[0] for f in frames]
        totals[name] += count
        per.setdefault(name, Counter())[labels[-1]] += count
        mine = incl.setdefault(name, Counter())
        for lbl in {x for x in labels if x.split("(")[-1].startswith(("proxy/", "tracing/"))}:
            mine[lbl] += count
    out: dict[str, Any] = {}
    for name, total in totals.most_common():
        waits: Counter[str] = Counter()
        for leaf, c in per[name].items():
            for what, markers in WAITS:
                if any(m in leaf for m in markers):
                    waits[what] += c
                    break
        out[name] = {"samples": total, "busy_pct": round(100 * (total - sum(waits.values())) / total, 1),
                     "waits": {k: round(100 * v / total, 1) for k, v in waits.items()},
                     "self": [(k, round(100 * v / total, 1)) for k, v in per[name].most_common(top)],
                     "ours": [(k, round(100 * v / total, 1)) for k, v in incl[name].most_common(top)]}
    return out


def profile_one_connection(proc: Any, drive: Callable[[Any, int], dict[str, Any]], scenarios: dict[str, Any],
                           seconds: int, tmp: Path) -> dict[str, Any]:
    """Where one call's wall time goes at one connection: py-spy on every thread of the
    serving process and, apart, on its span-export child, idle samples included (so the
    ledger thread's fsync and the loop's waits show)."""
    spy = _py_spy()
    if spy is None:
        print("py-spy not installed (.venv/bin/pip install -e '.[bench]'): no profile", flush=True)
        return {}
    from procs import children

    def export_child() -> int | None:
        for pid in children(proc.pid):
            try:
                if b"export_process" in Path(f"/proc/{pid}/cmdline").read_bytes() or \
                        b"multiprocessing" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    return pid
            except OSError:
                continue
        return None

    out: dict[str, Any] = {}
    for name, sc in scenarios.items():
        spies = []
        for who, pid in (("serving", proc.pid), ("export child", export_child())):
            if pid is None:
                continue
            raw = tmp / f"profile1-{name}-{pid}.txt"
            cmd = ["taskset", "-c", "1", spy, "record", "--pid", str(pid), "--duration", str(seconds + 1),
                   "--rate", "500", "--format", "raw", "--threads", "--idle", "--full-filenames", "--nonblocking",
                   "--output", str(raw)]
            spies.append((who, raw, subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)))
        loaded: dict[str, Any] = {}
        t = threading.Thread(target=lambda sc=sc, loaded=loaded: loaded.update(drive(sc, seconds)))
        t.start()
        t.join()
        result: dict[str, Any] = {"calls_per_s": loaded.get("requests", 0) / seconds,
                                  "p50_ms": loaded.get("latency_us", {}).get("p50", 0) / 1000}
        for who, raw, sp in spies:
            try:
                sp.communicate(timeout=seconds + 30)
            except subprocess.TimeoutExpired:
                sp.kill()
                sp.communicate()
            if raw.exists():
                text = raw.read_text()
                result[who] = fold_threads(text)
                (Path(__file__).parent / "results").mkdir(exist_ok=True)
                (Path(__file__).parent / "results" / f"profile-c1-{name}-{who.replace(' ', '-')}.collapsed"
                 ).write_text(text)
        out[name] = result
    return out


def render_threads(profile: dict[str, Any]) -> str:
    lines = []
    for name, p in profile.items():
        lines.append(f"\nWall time at 1 connection, {name}: {p['calls_per_s']:.0f} calls/s, p50 {p['p50_ms']:.2f} ms "
                     "(py-spy --idle, per thread, % of that thread's samples)")
        for who in ("serving", "export child"):
            for thread, t in p.get(who, {}).items():
                waits = ", ".join(f"{k} {v}%" for k, v in t["waits"].items())
                lines.append(f"  [{who}] {thread}: busy {t['busy_pct']}%" + (f"; {waits}" if waits else ""))
                lines += [f"      {v:5.1f}%  {k}" for k, v in t["self"][:8]]
                if t["ours"]:
                    lines.append("      ours, inclusive: " + "; ".join(f"{k} {v}%" for k, v in t["ours"][:8]))
    return "\n".join(lines)


def render_profile(profile: dict[str, Any], target: str = "sm-full") -> str:
    lines = []
    for name, p in profile.items():
        lines.append(f"\nProfile of {target} under {name} load at 64 connections ({p['samples']} samples, "
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
