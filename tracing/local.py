"""The local default exporter: finished spans as JSON lines, no collector needed.

Spans are appended to `<local_dir>/spans.jsonl`. When the file passes `max_bytes` it is
rotated to `spans.1.jsonl` (and older ones shift up to `keep` files), so the directory
stays bounded. Each worker of `spanmeter serve --workers N` has its own directory,
`<traces>/worker-K/`, so every file has one writer; `read_spans` reads them all. The
exporter runs on the batch processor's worker thread, never on the request path.
`spanmeter runs` reads the files back (tracing/viewer.py).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Final

import orjson
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

__all__ = ["DEFAULT_LOCAL_DIR", "JsonlSpanExporter", "read_spans", "span_record"]

DEFAULT_LOCAL_DIR: Final = ".spanmeter/spans"
FILE_NAME: Final = "spans.jsonl"
WORKER_DIR_PREFIX: Final = "worker-"  # {local_dir}/worker-K/: the spans of worker K

log = logging.getLogger(__name__)


def span_record(span: ReadableSpan) -> dict[str, Any]:
    """A span as one JSON-ready dict (ids in lower-case hex, as in W3C traceparent)."""
    ctx = span.context
    parent = span.parent
    return {
        "trace_id": f"{ctx.trace_id:032x}" if ctx else None,
        "span_id": f"{ctx.span_id:016x}" if ctx else None,
        "parent_span_id": f"{parent.span_id:016x}" if parent else None,
        "name": span.name,
        "kind": span.kind.name,
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "status": span.status.status_code.name,
        "status_description": span.status.description,
        "attributes": {k: _plain(v) for k, v in (span.attributes or {}).items()},
        "links": [
            {"trace_id": f"{link.context.trace_id:032x}", "span_id": f"{link.context.span_id:016x}"}
            for link in span.links
        ],
    }


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _line(span: ReadableSpan) -> bytes:
    """One span's JSON line, UTF-8. orjson: without sm-local's export child this runs
    under the serving process's GIL, and json.dumps was most of the exporter's time."""
    record = span_record(span)
    try:
        return orjson.dumps(record) + b"\n"
    except TypeError:  # orjson refuses what json writes (an integer past 64 bits)
        return json.dumps(record, ensure_ascii=False).encode("utf-8", "replace") + b"\n"


class JsonlSpanExporter(SpanExporter):
    def __init__(self, local_dir: str | Path, *, max_bytes: int = 32 << 20, keep: int = 4) -> None:
        self._dir = Path(local_dir)
        self._max_bytes = max_bytes
        self._keep = keep
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = b"".join([_line(s) for s in spans])
        try:
            with self._lock:
                self._dir.mkdir(parents=True, exist_ok=True)
                path = self._dir / FILE_NAME
                self._rotate_if_full(path)
                with path.open("ab") as f:
                    f.write(lines)
        except OSError:
            log.warning("could not write %d spans to %s", len(spans), self._dir, exc_info=True)
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def _rotate_if_full(self, path: Path) -> None:
        if not path.exists() or path.stat().st_size < self._max_bytes:
            return
        for n in range(self._keep - 1, 0, -1):
            older = self._dir / f"spans.{n}.jsonl"
            if older.exists():
                older.replace(self._dir / f"spans.{n + 1}.jsonl")
        path.replace(self._dir / "spans.1.jsonl")
        (self._dir / f"spans.{self._keep + 1}.jsonl").unlink(missing_ok=True)

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def read_spans(local_dir: str | Path) -> Iterator[dict[str, Any]]:
    """Every span record in `local_dir` and its `worker-K/` directories (one per worker of
    `spanmeter serve --workers N`, each with one writer), oldest file first in each; bad
    lines are skipped."""
    directory = Path(local_dir)
    workers = sorted(directory.glob(f"{WORKER_DIR_PREFIX}*"), key=lambda p: p.name) if directory.is_dir() else []
    for d in [directory, *(w for w in workers if w.is_dir())]:
        yield from _read_dir(d)


def _read_dir(directory: Path) -> Iterator[dict[str, Any]]:
    rotated = sorted(directory.glob("spans.*.jsonl"), key=_rotation_number, reverse=True)
    for path in [*rotated, directory / FILE_NAME]:
        if not path.exists():
            continue
        with path.open(encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    yield json.loads(line)
                except ValueError:
                    continue  # a line cut by a crash mid-write


def _rotation_number(path: Path) -> int:
    try:
        return int(path.name.split(".")[1])
    except (IndexError, ValueError):
        return 0
