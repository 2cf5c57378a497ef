"""The span queues: a batch processor that counts what it drops, bounded by count and by bytes.
Used by the serving process and by the export child alike."""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, Protocol

from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from proxy.model import frozen
from tracing import attributes as A

__all__ = ["DropCounter", "DropCountingProcessor", "QueueLimits", "RecordBatcher", "record_bytes", "span_bytes"]

log = logging.getLogger(__name__)


class DropCounter(Protocol):
    def add(self, amount: int, attributes: Mapping[str, str]) -> None: ...


@frozen
class QueueLimits:
    """One exporter's queue: at most `max_queue` spans and `max_queue_bytes` (by
    `span_bytes`), exported in batches of `max_export_batch` every `schedule_delay_ms`."""

    max_queue: int
    max_queue_bytes: int
    max_export_batch: int
    schedule_delay_ms: int


# What a span costs in memory besides its string attributes (ids, times, the SDK's objects,
# the small attributes): measured ~1-2 kB for a call span; counted low on purpose, since
# the bound is there for what content capture adds (prompts of tens of kB).
_SPAN_OVERHEAD: Final = 512


def span_bytes(span: ReadableSpan) -> int:
    """An estimate of the memory a queued span holds: its string attributes (where captured
    content lives) plus a fixed overhead. A lean span's attributes are a plain dict behind
    the public read-only view, read at C speed."""
    n = _SPAN_OVERHEAD
    for value in (span.attributes or {}).values():
        if type(value) is str:
            n += len(value)
    return n


def record_bytes(record: Sequence[Any]) -> int:
    """`span_bytes` of the span a record (tracing/lean.py `Record`) holds."""
    n = _SPAN_OVERHEAD
    for value in record[10].values():
        if type(value) is str:
            n += len(value)
    return n


class _CountingExporter(SpanExporter):
    """Tells the processor how many spans left its queue and how many failed to export."""

    def __init__(self, inner: SpanExporter, processor: DropCountingProcessor) -> None:
        self._inner = inner
        self._processor = processor

    def export(self, spans: Any) -> SpanExportResult:
        self._processor.taken(spans)
        try:
            result = self._inner.export(spans)
        except Exception:
            log.warning("span exporter raised", exc_info=True)
            result = SpanExportResult.FAILURE
        if result is not SpanExportResult.SUCCESS:
            self._processor.dropped(len(spans), "export_failed")
        return result

    def shutdown(self) -> None:
        self._inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._inner.force_flush(timeout_millis)


class DropCountingProcessor(SpanProcessor):
    """A BatchSpanProcessor that counts what it drops.

    The SDK's processor drops the oldest queued span when its bounded queue is full, and
    only logs it (its own counter needs an env switch and the global meter). We keep a
    count of queued spans beside it: a span ended while the count is at capacity is one
    span lost. The count can briefly lag the worker taking a batch, so it may over-count
    by a few under extreme load; it never misses a lost span.
    """

    def __init__(self, exporter: SpanExporter, limits: QueueLimits, counter: DropCounter, name: str):
        self._capacity = limits.max_queue
        self._max_bytes = limits.max_queue_bytes
        self._queued = 0
        self._queued_bytes = 0
        self._lock = threading.Lock()
        self._counter = counter
        self._name = name
        self._batch = BatchSpanProcessor(
            _CountingExporter(exporter, self),
            max_queue_size=limits.max_queue,
            schedule_delay_millis=limits.schedule_delay_ms,
            max_export_batch_size=min(limits.max_export_batch, limits.max_queue),
        )

    def taken(self, spans: Sequence[ReadableSpan]) -> None:
        size = sum(map(span_bytes, spans))
        with self._lock:
            self._queued = max(0, self._queued - len(spans))
            self._queued_bytes = max(0, self._queued_bytes - size)

    def dropped(self, n: int, reason: str) -> None:
        self._counter.add(n, {A.ERROR_TYPE: reason, A.SPANMETER_EXPORTER: self._name})

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        if not (span.context and span.context.trace_flags.sampled):
            return
        size = span_bytes(span)
        with self._lock:
            too_big = self._queued_bytes + size > self._max_bytes
            full = self._queued >= self._capacity
            if not (full or too_big):
                self._queued += 1
                self._queued_bytes += size
        if full or too_big:
            self.dropped(1, "queue_full")
        if not too_big:  # a full count: the SDK's queue drops its oldest, as it always has
            self._batch.on_end(span)

    def shutdown(self) -> None:
        self._batch.shutdown()  # type: ignore[no-untyped-call]

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._batch.force_flush(timeout_millis)


class RecordBatcher:
    """`DropCountingProcessor` for span records an exporter encodes itself (the export child's
    OTLP exporter, tracing/export_process.py): the same bounds by count and by bytes, the
    same batches every `schedule_delay_ms` or at `max_export_batch`, the same counts of what
    is dropped (`queue_full`) or fails to export (`export_failed`). `export` takes one batch
    and says whether it was exported."""

    def __init__(self, export: Callable[[Sequence[Any]], bool], limits: QueueLimits, counter: DropCounter,
                 name: str) -> None:
        self._export = export
        self._capacity = limits.max_queue
        self._max_bytes = limits.max_queue_bytes
        self._batch = max(1, min(limits.max_export_batch, limits.max_queue))
        self._delay_s = limits.schedule_delay_ms / 1000
        self._counter = counter
        self._name = name
        self._queue: deque[tuple[Any, int]] = deque()
        self._bytes = 0
        self._cond = threading.Condition()
        self._flushes: list[threading.Event] = []
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=f"span-records-{name}", daemon=True)
        self._thread.start()

    def on_record(self, record: Any, size: int) -> None:
        with self._cond:
            full = self._stopping or len(self._queue) >= self._capacity or self._bytes + size > self._max_bytes
            if not full:
                self._queue.append((record, size))
                self._bytes += size
                if len(self._queue) == self._batch:
                    self._cond.notify()
        if full:
            self._dropped(1, "queue_full")

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        done = threading.Event()
        with self._cond:
            if self._stopping:
                return False
            self._flushes.append(done)
            self._cond.notify()
        return done.wait(timeout_millis / 1000)

    def shutdown(self) -> None:
        """Export what is queued, then stop (bounded by the exporter's own timeout per batch)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                if len(self._queue) < self._batch and not self._flushes and not self._stopping:
                    self._cond.wait(self._delay_s)
                taken = [self._queue.popleft() for _ in range(min(self._batch, len(self._queue)))]
                self._bytes -= sum(size for _, size in taken)
                more = bool(self._queue)
                flushes = [] if more else self._flushes
                if not more:
                    self._flushes = []
                stop = self._stopping and not more
            if taken:
                self._send([record for record, _ in taken])
            for done in flushes:
                done.set()
            if stop:
                return

    def _send(self, batch: list[Any]) -> None:
        try:
            ok = self._export(batch)
        except Exception:
            log.warning("span exporter raised", exc_info=True)
            ok = False
        if not ok:
            self._dropped(len(batch), "export_failed")

    def _dropped(self, n: int, reason: str) -> None:
        self._counter.add(n, {A.ERROR_TYPE: reason, A.SPANMETER_EXPORTER: self._name})
