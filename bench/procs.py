"""Processes the bench starts: pinned, on ephemeral loopback ports, killed by PID.

Everything read about a process comes from /proc: CPU ticks (utime + stime, all
threads), resident memory now and at its peak (VmRSS, VmHWM), threads and open fds; for a
process with children (a supervisor and its workers), of the process and its children
together.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["HZ", "Proc", "Procs", "children", "cpu_times", "free_port", "http_post"]

HZ = os.sysconf("SC_CLK_TCK")
HOST = "127.0.0.1"


def _ticks(stat_file: Path, *, reaped_children: bool = False) -> int:
    # Fields after the parenthesised comm: state is [0], ppid [1], utime [11], stime [12],
    # cutime [13], cstime [14] (children waited for: a worker the supervisor reaped).
    try:
        fields = stat_file.read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0  # the process is gone
    ticks = int(fields[11]) + int(fields[12])
    return ticks + int(fields[13]) + int(fields[14]) if reaped_children else ticks


def children(pid: int) -> list[int]:
    """The live descendants of `pid` (a supervisor's workers, each process's span-export
    child), from /proc."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(entry.name)] = int(fields[1])
    found: list[int] = []
    frontier = [pid]
    while frontier:
        kids = [c for c, parent in parents.items() if parent in frontier]
        found += kids
        frontier = kids
    return found


def _serves(pid: int) -> bool:
    """Whether `pid` runs an event loop that serves calls (a worker or a single process),
    not a helper process such as the span-export child."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"multiprocessing" not in cmdline and b"export_process" not in cmdline


def cpu_times() -> dict[int, tuple[int, int]]:
    """Per CPU: (busy, total) ticks since boot, from /proc/stat (iowait counts as idle)."""
    out: dict[int, tuple[int, int]] = {}
    for line in Path("/proc/stat").read_text().splitlines():
        name, *vals = line.split()
        if name.startswith("cpu") and name != "cpu":
            ticks = [int(v) for v in vals[:8]]
            idle = ticks[3] + ticks[4]
            out[int(name[3:])] = (sum(ticks) - idle, sum(ticks))
    return out


def free_port() -> int:
    # The kernel picks an ephemeral port; the child binds it right after. A race with
    # another binder is possible in theory and shows up as a start failure, not silence.
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    port: int | None
    cpu: int | str | None  # a CPU, or a list for taskset ("0,1")
    log: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def pids(self) -> list[int]:
        """The process and its children: `spanmeter serve --workers N` is a supervisor and N
        workers, and every figure below is of all of them."""
        return [self.pid, *children(self.pid)]

    def cpu_ticks(self) -> int:
        own = _ticks(Path(f"/proc/{self.pid}/stat"), reaped_children=True)
        return own + sum(_ticks(Path(f"/proc/{c}/stat")) for c in children(self.pid))

    def main_thread_ticks(self) -> int:
        """CPU of the main thread alone: for the proxies, the event loop (of each worker,
        summed, for a supervisor with workers)."""
        pids = [p for p in (self.pid, *children(self.pid)) if _serves(p)]
        return sum(_ticks(Path(f"/proc/{p}/task/{p}/stat")) for p in pids)

    def status(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for pid in self.pids():
            try:
                text = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
            for line in text.splitlines():
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM", "Threads"):
                    out[key] = out.get(key, 0) + int(value.split()[0])
        return out

    def reset_peak_rss(self) -> None:
        """Start VmHWM again from the current RSS (clear_refs 5), for the process and its
        children, so the next reading is the peak of what ran since."""
        for pid in self.pids():
            with contextlib.suppress(OSError):
                Path(f"/proc/{pid}/clear_refs").write_text("5")

    def peaks_by_process(self, field: str = "VmHWM") -> dict[str, int]:
        """VmHWM (or `field`: VmRSS) in kB of each process (the serving one first, then its
        children by PID)."""
        out: dict[str, int] = {}
        for pid in self.pids():
            try:
                text = Path(f"/proc/{pid}/status").read_text()
                kind = "export child" if not _serves(pid) else "serving"
            except OSError:
                continue
            for line in text.splitlines():
                if line.startswith(field + ":"):
                    out[f"{kind} {pid}"] = int(line.split()[1])
        return out

    def fds(self) -> int:
        return sum(len(os.listdir(f"/proc/{pid}/fd")) for pid in self.pids())

    def wait_idle(self, quiet_s: float = 0.3, limit_s: float = 4.0) -> None:
        """Wait until the process stops burning CPU (background export done), bounded."""
        deadline = time.monotonic() + limit_s
        last = self.cpu_ticks()
        while time.monotonic() < deadline:
            time.sleep(quiet_s)
            now = self.cpu_ticks()
            if now - last <= 1:
                return
            last = now

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


@dataclass
class Procs:
    """Starts processes and, on close, ends every one of them by its own PID."""

    tmp: Path
    started: list[Proc] = field(default_factory=list)

    def start(self, name: str, argv: list[str], *, cpu: int | str | None, port: int | None,
              env: dict[str, str] | None = None, cwd: str | None = None, unset: list[str] | None = None) -> Proc:
        cmd = (["taskset", "-c", str(cpu)] if cpu is not None else []) + argv
        log = self.tmp / f"{name}.log"
        # taskset execs the command, so the PID we hold is the program's own.
        full_env = {k: v for k, v in os.environ.items() if k not in (unset or [])} | (env or {})
        popen = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=cwd,
                                 env=full_env, start_new_session=True)
        proc = Proc(name, popen, port, cpu, log)
        self.started.append(proc)
        if port is not None:
            _wait_port(proc, port)
        return proc

    def stop(self, proc: Proc) -> None:
        kids = children(proc.pid) if proc.alive() else []
        if proc.alive():
            proc.popen.send_signal(signal.SIGTERM)  # a supervisor stops its workers itself
            try:
                proc.popen.wait(timeout=8)
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait(timeout=5)
        for pid in kids:  # children that outlive their parent, by their own PIDs
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if proc in self.started:
            self.started.remove(proc)

    def close(self) -> None:
        for proc in reversed(list(self.started)):
            self.stop(proc)


def _wait_port(proc: Proc, port: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}:\n{proc.tail()}")
        try:
            with socket.create_connection((HOST, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{proc.name} did not listen on {port} within {timeout_s} s:\n{proc.tail()}")


def http_post(port: int, path: str, body: bytes, key: str, timeout_s: float = 10.0) -> tuple[int, bytes]:
    req = urllib.request.Request(f"http://{HOST}:{port}{path}", data=body, method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
