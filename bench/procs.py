"""Processes the bench starts: pinned, on ephemeral loopback ports, killed by PID.

Everything read about a process comes from /proc: CPU ticks (utime + stime, all
threads), resident memory now and at its peak (VmRSS, VmHWM), threads and open fds.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["HZ", "Proc", "Procs", "cpu_times", "free_port", "http_post"]

HZ = os.sysconf("SC_CLK_TCK")
HOST = "127.0.0.1"


def _ticks(stat_file: Path) -> int:
    # Fields after the parenthesised comm: state is [0], utime [11], stime [12].
    fields = stat_file.read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


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
    cpu: int | None
    log: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def cpu_ticks(self) -> int:
        return _ticks(Path(f"/proc/{self.pid}/stat"))

    def main_thread_ticks(self) -> int:
        """CPU of the main thread alone: for the proxies, the event loop."""
        return _ticks(Path(f"/proc/{self.pid}/task/{self.pid}/stat"))

    def status(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "Threads"):
                out[key] = int(value.split()[0])
        return out

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))

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

    def start(self, name: str, argv: list[str], *, cpu: int | None, port: int | None,
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
        if proc.alive():
            proc.popen.send_signal(signal.SIGTERM)
            try:
                proc.popen.wait(timeout=8)
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait(timeout=5)
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
