"""`spanmeter serve --workers N`: every core of one machine, one port, one ledger.

`--workers N` (`SPANMETER_WORKERS`, `auto` = one per CPU) runs N worker processes behind
one port; `1`, the default, is one process with no supervisor. A supervisor that serves
no traffic reserves the port, forks each worker after the settings are checked (a worker
builds everything with a thread, socket or file after the fork), restarts one that dies
with a back-off, and forwards SIGTERM/SIGINT; each worker listens on its own SO_REUSEPORT
socket. It writes `{data_dir}/workers/{port}/status.json` on every change.
Each decision and why: docs/scale.md, "How the workers are built".
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import json
import logging
import os
import select
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, NoReturn

from proxy.errors import ConfigError
from proxy.serve.siblings import Worker, reset_state, retire

if TYPE_CHECKING:
    from aiohttp import web

    from proxy.config import Settings

__all__ = ["SHUTDOWN_GRACE_S", "Supervisor", "listen_reuseport", "state_dir_of", "use_uvloop"]

log = logging.getLogger("spanmeter.workers")

SHUTDOWN_GRACE_S: Final = 100.0  # aiohttp drains for up to 60 s; then settlements and telemetry flush
QUICK_EXIT_S: Final = 10.0  # a worker that exits sooner than this after its start counts towards back-off
MAX_BACKOFF_S: Final = 30.0
_PR_SET_PDEATHSIG: Final = 1
_HANDLED: Final = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGCHLD})

Address = tuple[int, Any]  # (family, sockaddr)


def state_dir_of(data_dir: str, port: int) -> Path:
    return Path(data_dir) / "workers" / str(port)


def listen_reuseport(family: int, addr: Any, backlog: int = 1024) -> socket.socket:
    """A worker's own listening socket on the shared port."""
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(addr)
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


@dataclass
class _Slot:
    index: int
    metrics_sock: socket.socket
    pid: int | None = None
    generation: int = 0
    started: float = 0.0
    ready: bool = False
    ever_ready: bool = False
    restarts: int = 0
    quick_exits: int = 0
    due: float | None = None  # monotonic time a replacement is to start


def _exit_text(status: int) -> str:
    code = os.waitstatus_to_exitcode(status)
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "unknown"
        return f"was killed by signal {-code} ({name})"
    return f"exited with code {code}"


class Supervisor:
    """Starts and keeps `settings.workers` workers on the reserved port; `run()` returns
    the exit code of `spanmeter serve`."""

    def __init__(self, settings: Settings, reserved: list[socket.socket]) -> None:
        self.settings = settings
        self.reserved = reserved
        self.port = int(reserved[0].getsockname()[1])
        self.addresses: list[Address] = [(s.family, s.getsockname()) for s in reserved]
        self.state_dir = state_dir_of(settings.data_dir, self.port)
        self.slots: list[_Slot] = []
        self.generations = 0
        self.stopping = False
        self.stop_deadline = 0.0
        self.failed = False
        self._wake_r = self._wake_w = self._ready_r = self._ready_w = -1
        self._ready_buf = b""
        try:  # before the `listening` line: a data_dir spanmeter cannot write is a start-up error
            self.state_dir.mkdir(parents=True, exist_ok=True)
            reset_state(self.state_dir)
        except OSError as exc:
            raise ConfigError(f"Cannot write the workers' state directory {self.state_dir}: {exc.strerror or exc}. "
                              "spanmeter needs a writable data_dir (SPANMETER_DATA_DIR).") from None

    # --- the supervisor's loop -----------------------------------------------------------

    def run(self) -> int:
        self._wake_r, self._wake_w = os.pipe()
        self._ready_r, self._ready_w = os.pipe()
        for fd in (self._wake_r, self._wake_w, self._ready_r):
            os.set_blocking(fd, False)
        previous = signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        handlers = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        # (the supervisor's own SIGTERM/SIGINT only set a flag; the loop below acts on it)
        handlers[signal.SIGCHLD] = signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the loop
        try:
            for i in range(1, self.settings.workers + 1):
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sock.bind(("127.0.0.1", 0))
                sock.listen(64)
                self.slots.append(_Slot(i, sock))
            log.info("supervisor (pid %d) starting %d workers on port %d", os.getpid(), len(self.slots), self.port)
            for slot in self.slots:
                self._spawn(slot)
            self._loop()
        finally:
            for sig, old in handlers.items():
                signal.signal(sig, old)
            signal.set_wakeup_fd(previous)
            self._kill_all(signal.SIGKILL)  # only if the loop itself failed: normally none is left
            for fd in (self._wake_r, self._wake_w, self._ready_r, self._ready_w):
                with contextlib.suppress(OSError):
                    os.close(fd)
            for slot in self.slots:
                slot.metrics_sock.close()
        if self.failed:
            return 1
        log.info("supervisor (pid %d): every worker stopped; exiting", os.getpid())
        return 0

    def _on_signal(self, signum: int, frame: Any) -> None:
        if not self.stopping:
            self.stopping = True
            self.stop_deadline = time.monotonic() + SHUTDOWN_GRACE_S

    def _loop(self) -> None:
        forwarded = False
        while True:
            self._reap()
            if self.stopping and not forwarded:
                forwarded = True
                alive = [s for s in self.slots if s.pid is not None]
                log.info("stopping: SIGTERM to %d worker(s); each finishes its calls in flight, settles them and "
                         "flushes telemetry", len(alive))
                self._kill_all(signal.SIGTERM)
            if self.stopping:
                if all(s.pid is None for s in self.slots):
                    return
                if time.monotonic() > self.stop_deadline:
                    log.error("workers still running %.0f s after SIGTERM: killing them", SHUTDOWN_GRACE_S)
                    self.failed = True
                    self._kill_all(signal.SIGKILL)
                    self.stop_deadline = float("inf")
            else:
                now = time.monotonic()
                for slot in self.slots:
                    if slot.pid is None and slot.due is not None and slot.due <= now:
                        self._spawn(slot)
            self._wait()

    def _wait(self) -> None:
        dues = [s.due for s in self.slots if s.pid is None and s.due is not None and not self.stopping]
        timeout = max(0.0, min(dues) - time.monotonic()) if dues else 1.0
        try:
            readable, _, _ = select.select([self._wake_r, self._ready_r], [], [], min(timeout, 1.0))
        except InterruptedError:
            return
        if self._wake_r in readable:
            with contextlib.suppress(BlockingIOError):
                while os.read(self._wake_r, 512):
                    pass
        if self._ready_r in readable:
            self._read_ready()

    def _read_ready(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while chunk := os.read(self._ready_r, 4096):
                self._ready_buf += chunk
        *lines, self._ready_buf = self._ready_buf.split(b"\n")
        for line in lines:
            try:
                generation = int(line)
            except ValueError:
                continue
            for slot in self.slots:
                if slot.generation == generation and slot.pid is not None:
                    slot.ready = slot.ever_ready = True
                    log.info("worker %d (pid %d) serving", slot.index, slot.pid)
        self._write_status()

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            slot = next((s for s in self.slots if s.pid == pid), None)
            if slot is not None:
                self._exited(slot, status)

    def _exited(self, slot: _Slot, status: int) -> None:
        pid, lived = slot.pid, time.monotonic() - slot.started
        slot.pid, slot.ready = None, False
        try:
            retire(self.state_dir, slot.index, slot.generation)
        except OSError as exc:  # metrics bookkeeping never stops the serving
            log.warning("could not keep the metrics of worker %d (pid %d): %s", slot.index, pid, exc)
        code = os.waitstatus_to_exitcode(status)
        if self.stopping:
            if code != 0 and code != -signal.SIGTERM:
                log.error("worker %d (pid %d) %s while stopping", slot.index, pid, _exit_text(status))
                self.failed = True
            else:
                log.info("worker %d (pid %d) stopped", slot.index, pid)
            self._write_status()
            return
        if not slot.ever_ready:
            log.error("worker %d (pid %d) %s before it was serving; stopping (its log above says why)",
                      slot.index, pid, _exit_text(status))
            self.failed = True
            self._on_signal(signal.SIGTERM, None)
            self._write_status()
            return
        slot.quick_exits = slot.quick_exits + 1 if lived < QUICK_EXIT_S else 0
        delay = 0.0 if slot.quick_exits <= 1 else min(MAX_BACKOFF_S, 0.5 * 2 ** (slot.quick_exits - 2))
        slot.due = time.monotonic() + delay
        slot.restarts += 1
        log.error("worker %d (pid %d) %s after %.1f s; starting a replacement %s", slot.index, pid,
                  _exit_text(status), lived, "now" if delay == 0 else f"in {delay:g} s")
        self._write_status()

    def _kill_all(self, sig: int) -> None:
        for slot in self.slots:
            if slot.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(slot.pid, sig)

    def _write_status(self) -> None:
        status = {
            "pid": os.getpid(), "port": self.port, "stopping": self.stopping,
            "workers": [{"index": s.index, "pid": s.pid, "generation": s.generation, "ready": s.ready,
                         "restarts": s.restarts, "metrics_port": s.metrics_sock.getsockname()[1]}
                        for s in self.slots],
        }
        path = self.state_dir / "status.json"
        tmp = path.with_name(".status.json.tmp")
        try:
            tmp.write_text(json.dumps(status, indent=1) + "\n")
            tmp.replace(path)
        except OSError as exc:
            log.warning("could not write %s: %s", path, exc)

    # --- starting a worker ---------------------------------------------------------------

    def _spawn(self, slot: _Slot) -> None:
        self.generations += 1
        slot.generation, slot.due, slot.ready = self.generations, None, False
        worker = Worker(index=slot.index, count=len(self.slots), generation=slot.generation,
                        metrics_ports=tuple(s.metrics_sock.getsockname()[1] for s in self.slots),
                        state_dir=self.state_dir, metrics_sock=slot.metrics_sock)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        supervisor = os.getpid()
        # Signals wait until the child has its own handlers (the parent's would swallow a
        # SIGTERM meant for the child) and the parent knows the child's PID.
        signal.pthread_sigmask(signal.SIG_BLOCK, _HANDLED)
        try:
            pid = os.fork()
        except OSError as exc:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, _HANDLED)
            slot.due = time.monotonic() + MAX_BACKOFF_S / 10
            log.error("could not start worker %d: %s; trying again in %g s", slot.index, exc, MAX_BACKOFF_S / 10)
            return
        if pid == 0:
            self._child(worker, supervisor)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _HANDLED)
        slot.pid, slot.started = pid, time.monotonic()
        log.info("worker %d started (pid %d)", slot.index, pid)
        self._write_status()

    def _child(self, worker: Worker, supervisor: int) -> NoReturn:
        code = 1
        try:
            signal.set_wakeup_fd(-1)
            for sig in _HANDLED:
                signal.signal(sig, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, _HANDLED)  # a SIGTERM already sent ends it here
            _die_with(supervisor)
            for fd in (self._wake_r, self._wake_w, self._ready_r):
                os.close(fd)
            for sock in self.reserved:
                sock.close()
            for slot in self.slots:
                if slot.index != worker.index:
                    slot.metrics_sock.close()
            ready_w = self._ready_w

            def ready() -> None:
                os.write(ready_w, f"{worker.generation}\n".encode())

            code = run_worker(self.settings, worker, self.addresses, ready)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            os._exit(code)


def _die_with(parent: int) -> None:
    """SIGTERM when the supervisor dies, however it dies (Linux); and now if it is gone."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:
        raise SystemExit(0)


# --- inside a worker --------------------------------------------------------------------------


def use_uvloop() -> None:
    """uvloop's event loop for the asyncio.run that follows, when it is installed."""
    try:
        import uvloop
    except ImportError:
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def run_worker(settings: Settings, worker: Worker, addresses: list[Address], ready: Callable[[], None]) -> int:
    """A worker's life: its own logging, sockets, app and event loop; returns its exit code."""
    from proxy.app import create_app
    from proxy.serve.accesslog import configure_logging

    stop_logs = configure_logging(settings.log_level, settings.log_format, worker=worker.index)
    try:
        try:
            socks = [listen_reuseport(family, addr) for family, addr in addresses]
        except OSError as exc:
            log.error("worker %d cannot listen on port %s: %s", worker.index, addresses[0][1][1],
                      errno.errorcode.get(exc.errno or 0, exc))
            return 2
        use_uvloop()
        asyncio.run(_serve(create_app(settings, worker=worker), socks, ready))
    finally:
        stop_logs()
    return 0


async def _serve(app: web.Application, socks: list[socket.socket], ready: Callable[[], None]) -> None:
    """aiohttp's run_app, with signals that only ever start one graceful stop."""
    from aiohttp import web

    runner = web.AppRunner(app, handle_signals=False, access_log=None, handler_cancellation=True)
    await runner.setup()
    try:
        for sock in socks:
            await web.SockSite(runner, sock, backlog=1024).start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        ready()
        await stop.wait()
        log.info("stopping: no new connections; finishing the calls in flight")
    finally:
        await runner.cleanup()
