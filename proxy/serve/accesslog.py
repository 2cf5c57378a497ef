"""The access log: one line per model call, and the process's log set-up (text or JSON).

    2026-03-02T10:14:07.412Z INFO spanmeter.access tenant=acme run=r-42 api=chat model=gpt-4o-mini
        status=200 upstream=200 duration=0.412s tokens=1830/96 cost=$0.000332 rewrites="max_tokens_clamp=4096"

`access()` writes it from the call's record (proxy.model.CallRecord), in the bookkeeping
after a call and on the refused and abandoned paths; `before_call()` from the app's error
middleware, for errors raised before a call was admitted. A line
carries no message content and no key: the reason text is spanmeter's own message, and
for an upstream's error only its status (an upstream's message may quote the request, or
a masked key). Calls that end in 5xx are logged at ERROR, everything else at INFO.

Log records are written by a thread of their own, from a bounded queue: a log sink that
stops reading (a full pipe, a stuck log driver) never blocks the event loop; lines that do
not fit are dropped and counted. A record is formatted where it is made, but for an access
line: its values are final when it is made, and its text (and JSON) is made by that thread.
"""

from __future__ import annotations

import contextvars
import functools
import json
import logging
import queue
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TextIO

from proxy.errors import StoreUnavailable, UpstreamConnectError, UpstreamProtocolError, UpstreamTimeout
from proxy.ledger.messages import usd
from proxy.model import Anatomy, CallRecord
from tracing import anatomy as anatomy_attrs

__all__ = [
    "access",
    "answered",
    "before_call",
    "configure_logging",
    "escape_controls",
    "identified",
    "logged",
    "request_finished",
    "request_logged",
    "request_seconds",
    "request_started",
]

log = logging.getLogger("spanmeter.access")

_SAFE = re.compile(r"^[A-Za-z0-9._:/@+\-$,]+$")
_MAX_VALUE = 200  # model names and tool names come from callers: bounded, quoted


@dataclass(slots=True)
class _Request:
    """Whether this request's access line is written (or will be, by the bookkeeping), and
    the statuses of an error spanmeter raised after the call was admitted."""

    started: float
    covered: bool = False
    status: int | None = None  # what the caller got when an error was raised after admission
    upstream_status: int | None = None
    tenant: str | None = None  # who called, once the key was checked: a later refusal names them
    run_id: str | None = None


_CURRENT: contextvars.ContextVar[_Request | None] = contextvars.ContextVar("spanmeter_access", default=None)


def request_started() -> contextvars.Token[_Request | None]:
    """The error middleware opens each request with this; `request_logged()` then tells it
    whether a call's own line already covers the request."""
    return _CURRENT.set(_Request(time.perf_counter()))


def request_finished(token: contextvars.Token[_Request | None]) -> None:
    _CURRENT.reset(token)


def answered(status: int, upstream_status: int | None) -> None:
    """An admitted call ended in an error spanmeter raised (upstream unreachable, timed
    out, output that violates its schema): the caller got `status`, the upstream had
    answered `upstream_status` (0 or None: nothing). The call's line is written by the
    bookkeeping after it, which runs with this context and reads both; the error middleware
    writes none. Called before the bookkeeping is spawned, so each call of a request (a
    repair retry makes two) sees its own."""
    current = _CURRENT.get()
    started = current.started if current is not None else time.perf_counter()
    _CURRENT.set(_Request(started, True, status, upstream_status or None))


def identified(tenant: str, run_id: str) -> None:
    """The caller is known (its key checked): a line written for an error raised after this
    (a body that is not JSON, ...) names the tenant and run, not `-`."""
    current = _CURRENT.get()
    if current is not None:
        current.tenant, current.run_id = tenant, run_id


def request_logged() -> bool:
    current = _CURRENT.get()
    return current is not None and current.covered


def request_seconds() -> float:
    current = _CURRENT.get()
    return time.perf_counter() - current.started if current is not None else 0.0


def access(record: CallRecord, *, parts: bool = False) -> None:
    """Log one call from its record. `status` is what the caller got, `upstream` what the
    upstream answered (`-` when the call was never forwarded or no answer came); `refused`
    is why spanmeter said no (run_calls, tenant_day, loop_detected, ...); `error` the call's
    error.type; `reason` spanmeter's own message, logged only for spanmeter's errors
    (error.type `spanmeter.*`). `parts`: add the call's cost anatomy as `input=`,
    `kind:tokens:micro-USD,...` (SPANMETER_ACCESS_LOG_ANATOMY)."""
    outcome, usage, an = record.outcome, record.outcome.usage, record.anatomy
    end = time.time_ns() if record.end_ns is None else record.end_ns
    _write(_Line(record.caller.tenant, record.caller.run_id, record.call.api, record.call.model, outcome.status,
                 outcome.status if record.forwarded else None, (end - record.start_ns) / 1e9,
                 usage.input_tokens, usage.output_tokens, record.cost_micros if record.forwarded else None,
                 [r.header_value() for r in record.rewrites], record.refusal, outcome.error_type,
                 outcome.error_message, _parts_line(an) if parts and an is not None else None))


def before_call(api: str, status: int, error: str, reason: str) -> None:
    """Log a model-call request that failed before its call was admitted (a body that is
    not JSON, a missing key, ...): the caller, if it was identified by then, and the error."""
    _write(_Line(None, None, api, None, status, None, request_seconds(), error=error, reason=reason))


def _parts_line(an: Anatomy) -> str:
    """The access line's `input=`: kind:tokens:micro-USD per kind of part."""
    return ",".join(f"{k}:{t}:{c}" for k, (t, _, c) in anatomy_attrs.kinds_of(an).items())


class _Line(NamedTuple):
    """One access line's values (None: not known, written `-` or left out)."""

    tenant: str | None
    run_id: str | None
    api: str | None
    model: str | None
    status: int
    upstream_status: int | None
    duration_s: float
    input_tokens: int | None = None
    output_tokens: int | None = None
    cost_micros: int | None = None
    rewrites: Sequence[str] = ()
    refusal: str | None = None
    error: str | None = None
    reason: str | None = None
    input_parts: str | None = None


def _write(line: _Line) -> None:
    """Decide the line on the loop (this request's statuses, its level); make its text where
    it is written (`_AccessLine`, the log's own thread)."""
    (tenant, run_id, api, model, status, upstream_status, duration_s, input_tokens, output_tokens, cost_micros,
     rewrites, refusal, error, reason, input_parts) = line
    current = _CURRENT.get()
    if current is not None:
        current.covered = True
        if current.status is not None:
            status, upstream_status = current.status, current.upstream_status
        if tenant is None:
            tenant, run_id = current.tenant, run_id or current.run_id
    failed = status >= 500 or (upstream_status or 0) >= 500 or error in _SERVICE_ERRORS
    level = logging.ERROR if failed else logging.INFO
    if not log.isEnabledFor(level):
        return
    msg = _AccessLine(_Line(tenant, run_id, api, model, status, upstream_status, duration_s, input_tokens,
                            output_tokens, cost_micros, rewrites, refusal, error, reason, input_parts))
    # makeRecord + handle is what log.log does, less findCaller's walk up the stack: the
    # line's origin is always this function.
    log.handle(log.makeRecord(log.name, level, __file__, 0, msg, (), None,
                              extra={"access": msg} if _FIELDS_WANTED else None))


class _AccessLine:
    """An access line's values, final (plain strings and numbers), made into its text and
    its JSON fields only when first read: by the log's writer thread (`_Offloaded`), which
    formats these records itself, or by any other handler as it formats the record
    (`str`, `LogRecord.getMessage`). Only the JSON formatter reads the fields."""

    __slots__ = ("_text", "line")

    def __init__(self, line: _Line) -> None:
        self.line = line
        self._text: str | None = None

    def __str__(self) -> str:
        text = self._text
        if text is None:
            text = self._text = _text(self.line)
        return text

    def fields(self) -> dict[str, Any]:
        (tenant, run_id, api, model, status, upstream_status, duration_s, input_tokens, output_tokens, cost_micros,
         rewrites, refusal, error, reason, input_parts) = self.line
        fields = {
            "tenant": tenant, "run_id": run_id, "api": api, "model": _bounded(model), "status": status,
            "upstream_status": upstream_status or None, "duration_s": round(max(0.0, duration_s), 4),
            "input_tokens": input_tokens, "output_tokens": output_tokens,
            "cost_usd": cost_micros / 1e6 if cost_micros is not None else None,
            "rewrites": [r[:_MAX_VALUE] for r in rewrites], "refusal": refusal, "error": error,
            "reason": _own(reason, error, refusal),
        }
        if input_parts is not None:
            fields["input_parts"] = input_parts
        return fields


def _own(reason: str | None, error: str | None, refusal: str | None) -> str | None:
    """spanmeter's own message, the only reason text a line carries (module docstring)."""
    return reason if reason and (error is None or error.startswith("spanmeter.") or refusal) else None


def _text(line: _Line) -> str:
    (tenant, run_id, api, model, status, upstream_status, duration_s, input_tokens, output_tokens, cost_micros,
     rewrites, refusal, error, reason, input_parts) = line
    bounded_rewrites = [r[:_MAX_VALUE] for r in rewrites]
    duration = round(max(0.0, duration_s), 4)
    tokens = (f"{_n(input_tokens)}/{_n(output_tokens)}"
              if input_tokens is not None or output_tokens is not None else None)
    parts = [f"tenant={_quote(tenant)} run={_quote(run_id)} api={_quote(api)} model={_quote(_bounded(model))} "
             f"status={status} upstream={upstream_status or '-'} duration={duration:.3f}s"]
    for key, value in (("tokens", tokens), ("cost", usd(cost_micros) if cost_micros is not None else None),
                       ("rewrites", ",".join(bounded_rewrites) or None), ("refused", refusal), ("error", error),
                       ("reason", _own(reason, error, refusal)), ("input", input_parts)):
        if value is not None:
            parts.append(f"{key}={_quote(value)}")
    return " ".join(parts)


# A stream that failed after its 200 went out: the upstream timed out, broke or vanished.
_SERVICE_ERRORS = frozenset(cls("").error_type for cls in (
    StoreUnavailable, UpstreamConnectError, UpstreamTimeout, UpstreamProtocolError))
# Whether records carry the fields as data: configure_logging turns it off for text logs.
_FIELDS_WANTED = True


def _n(v: int | None) -> str:
    return "?" if v is None else str(v)


def _bounded(v: str | None) -> str | None:
    return v[:_MAX_VALUE] if v is not None else None


def _quote(v: object) -> str:
    if v is None:
        return "-"
    text = str(v)
    # Quoted with JSON's escapes; the formatter escapes what JSON leaves raw (DEL, C1, U+2028).
    return text if _SAFE.fullmatch(text) else json.dumps(text, ensure_ascii=False)


# Every character that is more than text to a log consumer or a terminal: C0 controls (line
# breaks, ESC), DEL, C1 controls (U+0085 breaks lines for str.splitlines, U+009B starts a
# terminal's control sequence), the line and paragraph separators (JavaScript splits on
# them) and the bidirectional overrides (they reorder what a reader sees). Written as JSON
# writes them, in text and JSON logs alike, so one value reads the same in both.
_ESCAPES = {c: f"\\u{c:04x}" for c in (*range(0x20), *range(0x7F, 0xA0), 0x2028, 0x2029, *range(0x202A, 0x202F),
                                         *range(0x2066, 0x206A))} | {0x0A: "\\n", 0x0D: "\\r", 0x09: "\\t"}


def escape_controls(text: str) -> str:
    """`text` with no character that could end a line, forge a record or drive a terminal."""
    # Printable ASCII (nearly every line) holds none of them: no translate.
    return text if text.isascii() and text.isprintable() else text.translate(_ESCAPES)


# --- set-up -------------------------------------------------------------------------------


class TextFormatter(logging.Formatter):
    """`time LEVEL logger message`; a worker of `spanmeter serve --workers N` ends every
    line with ` worker=K`."""

    def __init__(self, worker: int | None = None) -> None:
        tail = f" worker={worker}" if worker is not None else ""
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s" + tail)

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        return _iso(record.created)

    def format(self, record: logging.LogRecord) -> str:
        # The formatter is the one place every line of every logger passes: a message may
        # quote anything a caller sent (a path, a header, an exception's text), so it is
        # escaped here, not at each call site. A traceback keeps its lines, each indented: a
        # line that starts at column 0 is always a record of its own.
        record.message = record.getMessage()
        record.asctime = self.formatTime(record)
        line = escape_controls(self.formatMessage(record))
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        for extra in (record.exc_text, record.stack_info and self.formatStack(record.stack_info)):
            if extra:
                line += "".join("\n    " + escape_controls(part) for part in extra.splitlines())
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, and an access line's fields
    (and `worker`, in a worker of `spanmeter serve --workers N`)."""

    def __init__(self, worker: int | None = None) -> None:
        super().__init__()
        self._worker = worker

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {"time": _iso(record.created), "level": record.levelname, "logger": record.name,
                               "message": record.getMessage()}
        for name in ("access", "fields"):  # an access line's fields, or another record's
            fields = getattr(record, name, None)
            if isinstance(fields, _AccessLine):
                fields = fields.fields()
            if isinstance(fields, dict):
                out.update(fields)
        if self._worker is not None:
            out["worker"] = self._worker
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        # json.dumps escapes C0 controls; what it leaves raw (DEL, C1, U+2028, ...) can
        # only stand inside a string, where a \\u escape reads back as the same character.
        return escape_controls(json.dumps(out, ensure_ascii=False, default=str))


def _iso(created: float) -> str:
    return _second(int(created)) + f".{int(created % 1 * 1000):03d}Z"


@functools.lru_cache(maxsize=4)
def _second(whole: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole))


# How long the writer waits after a line for more (`_Offloaded`): one wake-up and one write
# for every line of that window. Unnoticeable in a log; what a kill -9 can lose.
LINGER_S = 0.01


class _Offloaded(logging.Handler):
    """Formats on the emitting thread, writes on a thread of its own from a bounded queue.

    The writer wakes for a line, then lingers `linger_s` before it writes, so that the lines
    of the next calls join it: one wake-up and one write for a burst instead of for every
    line. Woken per line at one connection, it switched in and out about three times a line,
    and the process spent ~50 us more CPU a call than with the log off; lingering, the same
    as off (in process, bench/bench_percall.py --pin --concurrency 1: 1,544/1,566 us a call
    with the log on, 1,506/1,494 off, 1,504/1,484 lingering). Lines reach the sink at most
    `linger_s` later; `stop` writes what is queued."""

    def __init__(self, stream: TextIO, capacity: int, linger_s: float = LINGER_S) -> None:
        super().__init__()
        self._stream = stream
        self._linger_s = linger_s
        # SimpleQueue: a put is one C call, where queue.Queue takes a lock and notifies a
        # Condition per line (3% of the event loop's CPU under load). Bounded by its size.
        self._queue: queue.SimpleQueue[str | logging.LogRecord | None] = queue.SimpleQueue()
        self._capacity = capacity
        self._dropped = 0
        self._thread = threading.Thread(target=self._write, name="spanmeter-log", daemon=True)
        self._thread.start()

    def emit(self, record: logging.LogRecord) -> None:
        if self._queue.qsize() >= self._capacity:
            self._dropped += 1
            return
        if type(record.msg) is _AccessLine:
            # An access line holds only final values: formatted by the writer, off the loop.
            self._queue.put(record)
            return
        try:
            line = self.format(record)
        except Exception:
            self.handleError(record)
            return
        self._queue.put(line)

    def _formatted(self, item: str | logging.LogRecord | None) -> str | None:
        if not isinstance(item, logging.LogRecord):
            return item
        try:
            return self.format(item)
        except Exception:
            return None  # as `handleError` with logging.raiseExceptions off: the line is lost

    def _write(self) -> None:
        while True:
            lines = [self._queue.get()]
            if lines[0] is not None:
                time.sleep(self._linger_s)
            while len(lines) < 256:
                try:
                    lines.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            done = None in lines
            text = [line + "\n" for line in map(self._formatted, lines) if line is not None]
            if self._dropped:
                dropped, self._dropped = self._dropped, 0
                text.append(self.format(_dropped_record(dropped)) + "\n")
            try:
                for chunk in _whole_lines(text):
                    self._stream.write(chunk)
                    self._stream.flush()
            except (OSError, ValueError):
                pass  # a closed or broken sink: nothing left to tell
            if done:
                return

    def stop(self, timeout_s: float) -> None:
        self._queue.put(None)  # the end, past the bound: the writer must see it
        self._thread.join(timeout_s)


def _dropped_record(n: int) -> logging.LogRecord:
    """The notice of lines dropped, a record like any other: in JSON format, JSON."""
    return logged("spanmeter.log", logging.WARNING, "%d log lines dropped: the log output was not being read fast "
                  "enough", (n,), {"dropped": n})


def logged(name: str, level: int, msg: str, args: tuple[Any, ...], fields: dict[str, Any]) -> logging.LogRecord:
    """A log record with `fields` of its own, for a JSON line (the text line has the message)."""
    record = logging.LogRecord(name, level, __file__, 0, msg, args, None)
    record.fields = fields
    return record


def _whole_lines(lines: list[str]) -> Iterator[str]:
    """The lines in chunks of whole lines of at most PIPE_BUF bytes: each chunk is one
    write, and a write that small to a pipe (or an append to a file) is never interleaved
    with another process's, so the workers of `spanmeter serve --workers N` can share
    stderr without cutting each other's lines. (A single line longer than that goes alone.)"""
    chunk: list[str] = []
    size = 0
    for line in lines:
        n = len(line) if line.isascii() else len(line.encode("utf-8", "replace"))
        if chunk and size + n > _PIPE_BUF:
            yield "".join(chunk)
            chunk, size = [], 0
        chunk.append(line)
        size += n
    if chunk:
        yield "".join(chunk)


_PIPE_BUF = 4096  # POSIX guarantees at least 512; Linux has 4096


def configure_logging(level: str, fmt: str, *, stream: TextIO | None = None,
                      capacity: int = 10_000, worker: int | None = None) -> Callable[[], None]:
    """Route every log record of the process to `stream` (stderr) in `fmt` (text | json).
    `worker`: the slot of a worker of `spanmeter serve --workers N`, added to every line.
    Returns the function that flushes and stops the writer (bounded: a stuck sink cannot
    hold up the exit)."""
    global _FIELDS_WANTED
    _FIELDS_WANTED = fmt == "json"
    # Neither formatter prints thread or process names; the logging docs' optimisation
    # switches spare every record looking them up.
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    handler = _Offloaded(stream or sys.stderr, capacity)
    handler.setFormatter(JsonFormatter(worker) if fmt == "json" else TextFormatter(worker))
    root = logging.getLogger()
    before, before_level = root.handlers[:], root.level
    for old in before:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)

    def stop() -> None:
        root.removeHandler(handler)
        handler.stop(2.0)
        # What was there before (a test runner's capture, say) comes back.
        for old in before:
            root.addHandler(old)
        root.setLevel(before_level)

    return stop
