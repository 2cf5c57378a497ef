"""Span encoding and export in a child process, out of the serving process's GIL.

`ExportProcessProcessor` queues each finished span (a record, or a `ReadableSpan` turned
into one), and its thread writes pickled batches to a child interpreter (fork+exec) that
runs the exporters: protobuf, gzip, HTTP and JSON happen there, `NICER_BY` nicer. Every
span is exported or counted in `spanmeter.telemetry.dropped_spans` (`queue_full`,
`export_failed`, `export_process_down`); a dead child is restarted, at most
`MAX_RESPAWNS` within `RESPAWN_WINDOW_S`.
How, and how each span is accounted for: docs/telemetry.md, "The export child".
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
import struct
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Final

from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from proxy.model import frozen
from tracing import attributes as A
from tracing.batching import DropCounter, QueueLimits, record_bytes, span_bytes
from tracing.records import Record, decode_span, encode_span

__all__ = ["ChildExporter", "ExportProcessProcessor", "decode_span", "encode_span", "main"]

log = logging.getLogger(__name__)
_CHILD_LOG = logging.getLogger("spanmeter.export")

MAX_RESPAWNS: Final = 5
RESPAWN_WINDOW_S: Final = 300.0
_DOWN_LOG_EVERY_S: Final = 60.0
# The child runs this much nicer than its parent. Where the two share a core (a one-CPU
# container, or the bench's pinning), the serving process then runs first when a request
# comes in during a batch's encoding (a 128-span batch is ~3 ms of the child's CPU), and the
# child takes the idle time between requests. At one connection the p99 fell in 29 of 32
# paired runs (by 0.5-1 ms, medians), the p50 and the CPU per request moved within the noise,
# and on a core kept saturated for 60 s (slow_c256) the child still kept up: no span dropped
# (docs/benchmarks.md, thirteenth pass). On a machine with a core to spare, it changes nothing.
NICER_BY: Final = 10
_HEADER: Final = struct.Struct("!I")

# parent -> child
_CONFIG: Final = 1
_SPANS: Final = 2
_FLUSH: Final = 3
# child -> parent
_EXPORTED: Final = 10  # (exporter, n)
_DROPPED: Final = 11  # ((exporter, reason, n), ...)
_FLUSHED: Final = 12  # (token, ok)
_LOG: Final = 13  # (pid, level, logger, message): the child's log records, logged by the parent
_LOG_REPEAT_S: Final = 60.0  # the same record again within this is counted, not forwarded


@frozen
class ChildExporter:
    """One exporter the child runs: `otlp` (endpoint, timeout, compression, gzip_level,
    records: whether it encodes span records itself, when it can) or `local` (directory,
    max_bytes), with its batch processor's schedule delay."""

    name: str  # otlp | local
    options: tuple[tuple[str, Any], ...]
    schedule_delay_ms: int


# --- wire ----------------------------------------------------------------------------


def _write(out: IO[bytes], kind: int, payload: Any) -> None:
    # pickle (protocol 5) measured cheapest here for these tuples: ~0.7 µs a span against
    # marshal's ~1.0 (and 270 bytes against 420); orjson cannot hold 128-bit ids.
    body = pickle.dumps((kind, payload), protocol=5)
    out.write(_HEADER.pack(len(body)) + body)
    out.flush()


def _read(inp: IO[bytes]) -> tuple[int, Any] | None:
    head = _read_exactly(inp, _HEADER.size)
    if head is None:
        return None
    body = _read_exactly(inp, _HEADER.unpack(head)[0])
    if body is None:
        return None
    kind, payload = pickle.loads(body)  # from our own parent or child, over a private pipe
    return int(kind), payload


def _read_exactly(inp: IO[bytes], n: int) -> bytes | None:
    chunks = []
    while n:
        chunk = inp.read(n)
        if not chunk:
            return None  # EOF (a frame cut by a crash counts as EOF too)
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


# --- parent ----------------------------------------------------------------------------


class _Flush:
    __slots__ = ("done", "ok")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.ok = False


class _Child:
    """One running child: its process, and the reader thread of its reports."""

    def __init__(self, owner: ExportProcessProcessor, config: Any) -> None:
        # The child finds this package where the parent did, installed or not: its directory
        # goes last on the path (first, it could shadow the standard library when it is
        # site-packages itself); the inherited environment and working directory come first.
        root = str(Path(__file__).resolve().parent.parent)
        start = f"import sys; sys.path.append({root!r}); from {__name__} import main; main()"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", start], stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True,
        )  # fmt: skip
        # Set from here as soon as it is spawned, not by the child once its imports are done.
        if hasattr(os, "setpriority"):  # POSIX only
            with contextlib.suppress(OSError):  # it died already: noticed below like any dead child
                os.setpriority(os.PRIO_PROCESS, self.proc.pid,
                               min(19, os.getpriority(os.PRIO_PROCESS, 0) + NICER_BY))
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.stdin: IO[bytes] = self.proc.stdin
        self.ended = threading.Event()  # its reports reached EOF
        self._owner = owner
        self._reader = threading.Thread(target=self._read, args=(self.proc.stdout,),
                                        name=f"span-export-reports-{self.proc.pid}", daemon=True)
        self._reader.start()
        # A child that died at once is noticed (and replaced) like any other dead child.
        with contextlib.suppress(OSError, ValueError):
            _write(self.stdin, _CONFIG, config)

    def _read(self, out: IO[bytes]) -> None:
        try:
            while (msg := _read(out)) is not None:
                self._owner.report(*msg)
        except Exception:
            log.warning("span export process: unreadable report", exc_info=True)
        finally:
            self.ended.set()
            self._owner.child_ended(self)

    def close_input(self) -> None:
        with contextlib.suppress(OSError):
            self.stdin.close()

    def wait(self, timeout: float) -> bool:
        """Wait for the child to exit and its last reports to be read."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        return self.ended.wait(max(1.0, timeout / 10))

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.ended.wait(5)


class ExportProcessProcessor(SpanProcessor):
    """Hands finished spans to an exporter child process (see the module docstring)."""

    def __init__(self, exporters: Sequence[ChildExporter], resource: Resource, limits: QueueLimits,
                 counter: DropCounter, shutdown_timeout_s: float) -> None:
        """`limits`: this process's queue, and each of the child's queues but for its
        schedule delay (the exporter's own); `shutdown_timeout_s`: how long shutdown waits
        for the child to export what it holds."""
        self._names = [e.name for e in exporters]
        max_queue, max_queue_bytes, max_export_batch = limits.max_queue, limits.max_queue_bytes, limits.max_export_batch
        self._config = {
            "exporters": tuple((e.name, e.options, e.schedule_delay_ms) for e in exporters),
            "resource": (dict(resource.attributes), resource.schema_url),
            "max_queue": max_queue,
            "max_export_batch": max_export_batch,
            "max_queue_bytes": max_queue_bytes,
        }
        self._capacity = max_queue
        self._max_bytes = max_queue_bytes
        self._bytes = 0  # span_bytes() of what is queued
        self._batch = max(1, min(max_export_batch, max_queue))
        self._delay_s = limits.schedule_delay_ms / 1000
        self._shutdown_timeout_s = shutdown_timeout_s
        self._counter = counter
        self._queue: deque[tuple[ReadableSpan | Record, int]] = deque()
        self._cond = threading.Condition()
        self._flushes: list[_Flush] = []  # asked for, not yet sent to the child
        self._sent_flushes: dict[int, _Flush] = {}
        self._next_token = 0
        self._stopping = False
        self._report_lock = threading.Lock()
        self._in_flight = dict.fromkeys(self._names, 0)  # handed to the child, not yet reported
        self._respawns: deque[float] = deque()
        self._down_since: float | None = None  # given up on the child: when
        self._down_dropped = 0  # spans dropped since the last "down" log line
        self._down_logged = 0.0
        self._scopes: dict[int, tuple[str, str | None, str | None]] = {}
        self._child: _Child | None = self._spawn()
        self._thread = threading.Thread(target=self._run, name="span-export-handoff", daemon=True)
        self._thread.start()
        # A fork of this process (not an exec: those do not inherit the pipe) would keep
        # the child's stdin open, and the child would not see EOF when we die.
        me = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: _close_in_fork(me))

    # --- serving threads ---
    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        if not (span.context and span.context.trace_flags.sampled):
            return
        self._enqueue(span, span_bytes(span))

    def on_record(self, record: Record) -> None:
        """A span ended as a record (tracing/lean.py `RecordTracer`): already what the pipe carries."""
        self._enqueue(record, record_bytes(record))

    def _enqueue(self, span: ReadableSpan | Record, size: int) -> None:
        with self._cond:
            if self._stopping:
                return  # as the SDK's processor: nothing is taken after shutdown
            full = len(self._queue) >= self._capacity or self._bytes + size > self._max_bytes
            if not full:
                self._queue.append((span, size))
                self._bytes += size
                if len(self._queue) == self._batch:
                    self._cond.notify()  # a full batch; otherwise the thread wakes on its delay
        if full:
            self._drop(1, "queue_full")

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        flush = _Flush()
        with self._cond:
            if self._stopping:
                return False
            self._flushes.append(flush)
            self._cond.notify()
        return flush.done.wait(timeout_millis / 1000) and flush.ok

    def shutdown(self) -> None:
        with self._cond:
            if self._stopping:
                return
            self._stopping = True
            self._cond.notify()
        # The hand-off thread sends what is queued, closes the pipe and waits for the child
        # (bounded). A child that stopped reading (SIGSTOP, a hang) blocks the thread's
        # write instead: kill it, which fails the write, and the thread counts the rest.
        self._thread.join(self._shutdown_timeout_s + 5)
        child = self._child
        if self._thread.is_alive() and child is not None:
            log.warning("span export process %d stopped reading; killed", child.proc.pid)
            child.proc.kill()
            self._thread.join(10)

    # --- hand-off thread ---
    def _run(self) -> None:
        while True:
            with self._cond:
                if not (self._queue and len(self._queue) >= self._batch) and not self._flushes \
                        and not self._stopping:
                    self._cond.wait(self._delay_s)
                taken = [self._queue.popleft() for _ in range(min(self._batch, len(self._queue)))]
                self._bytes -= sum(size for _, size in taken)
                batch = [span for span, _ in taken]
                more = bool(self._queue)
                flushes = [] if more else self._flushes
                if not more:
                    self._flushes = []
                stopping = self._stopping and not more
            child = self._child
            if child is not None and child.ended.is_set() and not stopping:
                self._live_child()  # died while idle: count what it held, start another
            if batch:
                self._send(batch)
            for flush in flushes:
                self._send_flush(flush)
            if stopping:
                self._stop_child()
                return

    def _send(self, batch: list[ReadableSpan | Record]) -> None:
        child = self._live_child()
        if child is None:
            self._down(len(batch))
            return
        try:
            payload = [s if type(s) is tuple else encode_span(s, self._scopes) for s in batch]  # type: ignore[arg-type]
        except Exception:
            log.warning("span export process: could not encode %d spans", len(batch), exc_info=True)
            self._drop(len(batch), "export_failed")
            return
        with self._report_lock:
            for name in self._names:
                self._in_flight[name] += len(batch)
        try:
            _write(child.stdin, _SPANS, payload)
        except (OSError, ValueError):
            self._child_died(child)  # counts this batch as in flight, lost

    def _send_flush(self, flush: _Flush) -> None:
        child = self._live_child()
        if child is None:
            flush.ok = False
            flush.done.set()
            return
        with self._report_lock:
            token = self._next_token = self._next_token + 1
            self._sent_flushes[token] = flush
        try:
            _write(child.stdin, _FLUSH, token)
        except (OSError, ValueError):
            self._child_died(child)

    def _live_child(self) -> _Child | None:
        child = self._child
        if child is not None and (child.ended.is_set() or child.proc.poll() is not None):
            self._child_died(child)
        elif child is None and self._may_spawn():  # given up earlier; the window has passed
            self._child = self._spawn()
            if self._child is not None:
                log.warning("span export process started again as pid %d after %.0f s down; spans are exported "
                            "again", self._child.proc.pid, time.monotonic() - (self._down_since or time.monotonic()))
                self._down_since = None
        return self._child

    def _child_died(self, child: _Child) -> None:
        child.close_input()
        child.kill()  # reaps it; its reports are all read once `ended` is set
        self._count_lost()
        log.warning("span export process %d exited with %s", child.proc.pid, child.proc.returncode)
        if self._may_spawn():
            self._child = self._spawn()
        else:
            self._child = None
            self._down_since, self._down_logged = time.monotonic(), float("-inf")  # the first drop says so
            log.error("span export process: not restarted (%d starts in %.0f s); given up: every span is dropped "
                      "and counted (export_process_down) until it is tried again at most %.0f s from now. To "
                      "recover at once, restart spanmeter; find why it died in the lines above (docs/reliability.md)",
                      len(self._respawns), RESPAWN_WINDOW_S, RESPAWN_WINDOW_S)

    def _may_spawn(self) -> bool:
        now = time.monotonic()
        while self._respawns and now - self._respawns[0] > RESPAWN_WINDOW_S:
            self._respawns.popleft()
        return len(self._respawns) <= MAX_RESPAWNS

    def _spawn(self) -> _Child | None:
        self._respawns.append(time.monotonic())
        try:
            child = _Child(self, self._config)
        except (OSError, ValueError):
            log.error("span export process: could not start it; spans are counted as dropped", exc_info=True)
            return None
        if len(self._respawns) > 1:
            log.warning("span export process restarted as pid %d", child.proc.pid)
        return child

    def _stop_child(self) -> None:
        child = self._child
        if child is None:
            return
        child.close_input()  # EOF: the child flushes its exporters and exits
        if not child.wait(self._shutdown_timeout_s):
            log.warning("span export process %d did not finish exporting in %.0f s; stopped",
                        child.proc.pid, self._shutdown_timeout_s)
            child.kill()
        self._count_lost()
        self._child = None

    def _count_lost(self) -> None:
        with self._report_lock:
            lost = dict(self._in_flight)
            self._in_flight = dict.fromkeys(self._names, 0)
            flushes = list(self._sent_flushes.values())
            self._sent_flushes.clear()
        for name, n in lost.items():
            if n > 0:
                self._counter.add(n, {A.ERROR_TYPE: "export_failed", A.SPANMETER_EXPORTER: name})
        for flush in flushes:
            flush.done.set()

    def _down(self, n: int) -> None:
        """Spans dropped because the child is given up: counted apart, on /metrics at each
        drop, and said in the log (once a minute at most, with the count since)."""
        self._drop(n, "export_process_down")
        self._down_dropped += n
        now = time.monotonic()
        if now - self._down_logged >= _DOWN_LOG_EVERY_S:
            since = now - (self._down_since or now)
            log.error("span export process is down (given up %.0f s ago after %d starts): %d spans dropped since "
                      "the last line; restart spanmeter to export again (docs/reliability.md)",
                      since, MAX_RESPAWNS + 1, self._down_dropped)
            self._down_logged, self._down_dropped = now, 0

    def _drop(self, n: int, reason: str) -> None:
        for name in self._names:
            self._counter.add(n, {A.ERROR_TYPE: reason, A.SPANMETER_EXPORTER: name})

    # --- report reader threads ---
    def report(self, kind: int, payload: Any) -> None:
        if kind == _LOG:
            pid, level, name, message = payload
            # Through this process's logging: the child's lines take the configured format
            # (SPANMETER_LOG_FORMAT), with their level and time, like every other line.
            _CHILD_LOG.log(int(level), "span export process %d (%s): %s", pid, name, message)
        elif kind == _EXPORTED:
            name, n = payload
            with self._report_lock:
                self._in_flight[name] = max(0, self._in_flight.get(name, 0) - n)
        elif kind == _DROPPED:
            for name, reason, n in payload:
                with self._report_lock:
                    self._in_flight[name] = max(0, self._in_flight.get(name, 0) - n)
                self._counter.add(n, {A.ERROR_TYPE: reason, A.SPANMETER_EXPORTER: name})
        elif kind == _FLUSHED:
            token, ok = payload
            with self._report_lock:
                flush = self._sent_flushes.pop(token, None)
            if flush is not None:
                flush.ok = bool(ok)
                flush.done.set()

    def child_ended(self, child: _Child) -> None:
        # Wake the hand-off thread so a child that died while idle is replaced (and a
        # waiting flush released) without waiting for the next span.
        with self._cond:
            self._cond.notify()
        with self._report_lock:
            flushes = list(self._sent_flushes.values()) if child is self._child else []
        for flush in flushes:
            flush.done.set()


def _close_in_fork(ref: weakref.ref[ExportProcessProcessor]) -> None:
    processor = ref()
    child = processor._child if processor is not None else None
    if child is not None:
        # /dev/null over the fd rather than close(): the file object still owns the number.
        with contextlib.suppress(OSError, ValueError):
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, child.stdin.fileno())
            os.close(null)


# --- child ----------------------------------------------------------------------------


class _Reporter:
    """The child's counts, written back to the parent. Drops from a full queue are summed
    and sent after each message the child handles; export results are sent at once."""

    def __init__(self, out: IO[bytes]) -> None:
        self._out = out
        self._lock = threading.Lock()
        self._pending: dict[tuple[str, str], int] = {}

    def add(self, amount: int, attributes: Mapping[str, str]) -> None:
        key = (attributes[A.SPANMETER_EXPORTER], attributes[A.ERROR_TYPE])
        with self._lock:
            self._pending[key] = self._pending.get(key, 0) + amount
        if key[1] != "queue_full":
            self.flush()

    def exported(self, name: str, n: int) -> None:
        self.send(_EXPORTED, (name, n))

    def flush(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
        if pending:
            self.send(_DROPPED, tuple((name, reason, n) for (name, reason), n in pending.items()))

    def send(self, kind: int, payload: Any) -> None:
        # A parent that is gone leaves nobody to count: the report is dropped.
        with self._lock, contextlib.suppress(OSError, ValueError):
            _write(self._out, kind, payload)


class _ChildExports:
    """The child's exporters: those that encode span records themselves (the OTLP exporter
    that writes with tracing/otlp_wire.py), each behind a `RecordBatcher`, and the rest (the
    local files; the OTLP exporter as shipped), which take `ReadableSpan`s decoded from the
    records, each behind a `DropCountingProcessor`."""

    def __init__(self, config: Mapping[str, Any], reporter: _Reporter, resource: Resource) -> None:
        from tracing.batching import DropCountingProcessor, QueueLimits, RecordBatcher

        self.resource = resource
        self.batchers: list[tuple[RecordBatcher, Any]] = []  # and the exporter that writes its records
        self.processors: list[SpanProcessor] = []
        for name, options, delay in config["exporters"]:
            opts = dict(options)
            limits = QueueLimits(max_queue=config["max_queue"], max_export_batch=config["max_export_batch"],
                                 max_queue_bytes=config["max_queue_bytes"], schedule_delay_ms=delay)
            inner = _otlp(opts) if name == "otlp" else _local(opts)
            if opts.get("records", True) and getattr(inner, "records", False):
                batcher = RecordBatcher(_reporting_records(name, inner, resource, reporter), limits, reporter, name)
                self.batchers.append((batcher, inner))
            else:
                self.processors.append(DropCountingProcessor(_Reporting(name, inner, reporter), limits, reporter, name))

    def take(self, records: Sequence[Record]) -> None:
        # Each record is written as it comes, and the batcher queues its bytes (~1 kB a call
        # span, a third of the record's dict and tuple).
        for record in records:
            size = record_bytes(record)
            for batcher, exporter in self.batchers:
                batcher.on_record(exporter.encode_record(record, self.resource), size)
        if self.processors:
            for span in [decode_span(data, self.resource) for data in records]:
                for p in self.processors:
                    p.on_end(span)

    def force_flush(self) -> bool:
        return all([b.force_flush() for b, _ in self.batchers] + [p.force_flush() for p in self.processors])

    def shutdown(self) -> None:
        for b, _ in self.batchers:
            b.shutdown()
        for p in self.processors:
            p.shutdown()


class _Reporting(SpanExporter):
    def __init__(self, name: str, inner: SpanExporter, reporter: _Reporter) -> None:
        self._name, self._inner, self._reporter = name, inner, reporter

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        result = self._inner.export(spans)
        if result is SpanExportResult.SUCCESS:
            self._reporter.exported(self._name, len(spans))
        return result

    def shutdown(self) -> None:
        self._inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._inner.force_flush(timeout_millis)


def _reporting_records(name: str, inner: Any, resource: Resource, reporter: _Reporter) -> Any:
    def export(items: Sequence[Any]) -> bool:
        if inner.export_records(items, resource) is not SpanExportResult.SUCCESS:
            return False
        reporter.exported(name, len(items))
        return True

    return export


def _otlp(opts: Mapping[str, Any]) -> Any:
    from opentelemetry.exporter.otlp.proto.http import Compression

    from tracing import otel_compat

    compression = {"gzip": Compression.Gzip, "deflate": Compression.Deflate}.get(
        opts["compression"], Compression.NoCompression)
    return otel_compat.otlp_span_exporter(opts["endpoint"], opts["timeout"], compression,
                                          gzip_level=opts.get("gzip_level"))


def _local(opts: Mapping[str, Any]) -> Any:
    from tracing.local import JsonlSpanExporter

    return JsonlSpanExporter(opts["directory"], max_bytes=opts["max_bytes"])


class _Forward(logging.Handler):
    """The child's log records (its own and the SDK's: "Failed to export ...", retries), sent
    to the parent, which logs them in the configured format. A record like one sent within
    `_LOG_REPEAT_S` (same logger and message template) is counted instead, and the next one
    sent says how many were left out: a collector that is down makes one line a minute per
    kind of failure, not three per batch."""

    def __init__(self, reporter: _Reporter) -> None:
        super().__init__(logging.WARNING)
        self._reporter = reporter
        self._seen: dict[tuple[str, str], tuple[float, int]] = {}  # (logger, template) -> (sent at, left out)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            key = (record.name, str(record.msg))
            now = time.monotonic()
            sent, left_out = self._seen.get(key, (-_LOG_REPEAT_S, 0))
            if now - sent < _LOG_REPEAT_S:
                self._seen[key] = (sent, left_out + 1)
                return
            if len(self._seen) > 1000:  # templates are few; messages with ids in them are not
                self._seen.clear()
            self._seen[key] = (now, 0)
            message = record.getMessage()
            if left_out:
                message += f" ({left_out} more like this in the last {now - sent:.0f} s)"
            if record.exc_info:
                message += "\n" + logging.Formatter().formatException(record.exc_info)
            self._reporter.send(_LOG, (os.getpid(), record.levelno, record.name, message))
        except Exception:
            self.handleError(record)


def _log_to_parent(reporter: _Reporter) -> None:
    root = logging.getLogger()
    for old in root.handlers[:]:
        root.removeHandler(old)
    root.addHandler(_Forward(reporter))
    root.setLevel(logging.WARNING)
    logging.captureWarnings(True)

    def thread_failed(args: threading.ExceptHookArgs) -> None:
        exc_info = (args.exc_type, args.exc_value, args.exc_traceback) if args.exc_value is not None else None
        log.error("thread %s failed", args.thread.name if args.thread else "?", exc_info=exc_info)

    threading.excepthook = thread_failed


def main() -> None:
    """The child: read the config, then batches of spans, until EOF."""
    # Our reports own fd 1; anything a library prints goes to stderr instead.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    reporter = _Reporter(out)
    _log_to_parent(reporter)
    inp = sys.stdin.buffer
    first = _read(inp)
    if first is None or first[0] != _CONFIG:
        return
    config = first[1]
    attributes, schema_url = config["resource"]
    exports = _ChildExports(config, reporter, Resource(attributes, schema_url))
    try:
        while (msg := _read(inp)) is not None:
            kind, payload = msg
            if kind == _SPANS:
                try:
                    exports.take(payload)
                except Exception:
                    log.warning("could not take %d spans", len(payload), exc_info=True)
                    for name, _, _ in config["exporters"]:
                        reporter.add(len(payload), {A.ERROR_TYPE: "export_failed", A.SPANMETER_EXPORTER: name})
            elif kind == _FLUSH:
                ok = exports.force_flush()
                reporter.flush()
                reporter.send(_FLUSHED, (payload, ok))
            reporter.flush()
    finally:
        exports.shutdown()
        reporter.flush()


if __name__ == "__main__":
    main()
