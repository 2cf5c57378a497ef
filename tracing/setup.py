"""Telemetry providers for one proxy process (or one test): traces, metrics, exporters.

`setup_telemetry(cfg)` builds its *own* TracerProvider and metric instruments and never
touches the global ones, so tests can create several side by side. Traces go, through a
bounded processor, to OTLP over HTTP/protobuf when an endpoint is configured and/or to a
local JSON-lines file (tracing/local.py) that `spanmeter runs` reads.
Endpoints, the export child, dropped spans and metrics: docs/telemetry.md, "Telemetry set-up".
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import field, replace
from typing import Any, Final, Literal

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator
from opentelemetry.trace import Tracer
from prometheus_client import CONTENT_TYPE_LATEST

from proxy.model import frozen
from tracing import attributes as A
from tracing import otel_compat
from tracing.aggregate import MetricsOut, PushLoop, Scope
from tracing.batching import DropCounter, DropCountingProcessor, QueueLimits
from tracing.export_process import ChildExporter, ExportProcessProcessor
from tracing.labels import KnownModel
from tracing.lean import RecordSink, Spans, spans_for
from tracing.local import DEFAULT_LOCAL_DIR, JsonlSpanExporter
from tracing.metrics import Instruments

__all__ = [
    "METRICS_CONTENT_TYPE",
    "CaptureMode",
    "Telemetry",
    "TelemetryConfig",
    "setup_telemetry",
]

log = logging.getLogger(__name__)

CaptureMode = Literal["NO_CONTENT", "SPAN_ONLY"]
METRICS_CONTENT_TYPE: Final = CONTENT_TYPE_LATEST
SCOPE: Final = "spanmeter"

ENV_CAPTURE: Final = "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"
ENV_SEMCONV: Final = "OTEL_SEMCONV_STABILITY_OPT_IN"
ENV_ENDPOINT: Final = "OTEL_EXPORTER_OTLP_ENDPOINT"
ENV_TRACES_ENDPOINT: Final = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
ENV_METRICS_ENDPOINT: Final = "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"
ENV_METRICS_EXPORTER: Final = "OTEL_METRICS_EXPORTER"
ENV_COMPRESSION: Final = "OTEL_EXPORTER_OTLP_COMPRESSION"
ENV_METRIC_INTERVAL: Final = "OTEL_METRIC_EXPORT_INTERVAL"
ENV_METRIC_TIMEOUT: Final = "OTEL_METRIC_EXPORT_TIMEOUT"
ENV_TIMEOUT: Final = "OTEL_EXPORTER_OTLP_TIMEOUT"
# Not settings to tune, switches to measure with (bench/run.py's sm-spans, sm-records-gz9):
# `off` ends spans as ReadableSpans on both sides of the export pipe, as before records.
ENV_SPAN_RECORDS: Final = "SPANMETER_SPAN_RECORDS"
ENV_GZIP_LEVEL: Final = "SPANMETER_OTLP_GZIP_LEVEL"  # 1-9, or sdk (the exporter's 9)
# When metrics are pushed: the docs render this sentence (proxy/ops/docgen.py), and
# `TelemetryConfig.otlp_metrics` below is its code.
METRIC_PUSH_RULE: Final = (
    "`GET /metrics` always serves Prometheus text. Metrics are pushed over OTLP only when asked: "
    "`otlp_metrics: true` (SPANMETER_OTLP_METRICS), `OTEL_METRICS_EXPORTER=otlp`, or an "
    "`OTEL_EXPORTER_OTLP_METRICS_ENDPOINT` of their own; `otlp_endpoint` or `OTEL_EXPORTER_OTLP_ENDPOINT` "
    "alone sends spans only, since trace-only backends (Phoenix, Langfuse, Tempo) refuse metrics. "
    "`OTEL_METRICS_EXPORTER=none` turns every push off. A push goes every `OTEL_METRIC_EXPORT_INTERVAL` "
    "milliseconds (60000 by default).")
# The standard variables this module reads (besides ENV_CAPTURE and ENV_SEMCONV), and
# those the OTLP exporter reads itself (headers, certificates): docs/operations.md lists
# them, and the ones not honoured, from here (proxy/ops/docgen.py).
HONOURED_OTEL_VARIABLES: Final = (
    ("OTEL_SERVICE_NAME", "the resource's service.name (default spanmeter)"),
    ("OTEL_RESOURCE_ATTRIBUTES", "more resource attributes (read by the SDK's Resource)"),
    ("OTEL_EXPORTER_OTLP_ENDPOINT", "base URL for traces (and metrics, when pushed); `/v1/traces` is added"),
    ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "a signal's URL, used as is"),
    ("OTEL_EXPORTER_OTLP_HEADERS, OTEL_EXPORTER_OTLP_TRACES_HEADERS, OTEL_EXPORTER_OTLP_METRICS_HEADERS",
     "headers on every export (a backend's `Authorization`)"),
    ("OTEL_EXPORTER_OTLP_TIMEOUT, OTEL_EXPORTER_OTLP_TRACES_TIMEOUT, OTEL_EXPORTER_OTLP_METRICS_TIMEOUT",
     "seconds per export, as the Python SDK reads them (default 5 for spanmeter)"),
    ("OTEL_EXPORTER_OTLP_COMPRESSION, OTEL_EXPORTER_OTLP_TRACES_COMPRESSION, OTEL_EXPORTER_OTLP_METRICS_COMPRESSION",
     "gzip (default), deflate or none"),
    ("OTEL_EXPORTER_OTLP_CERTIFICATE, OTEL_EXPORTER_OTLP_CLIENT_KEY, OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE "
     "(and their TRACES_/METRICS_ forms)", "TLS to the collector (read by the OTLP exporter)"),
    ("OTEL_METRICS_EXPORTER", "`otlp` pushes metrics too, `none` never; /metrics is always served"),
    ("OTEL_METRIC_EXPORT_INTERVAL", "milliseconds between metric pushes (default 60000)"),
    ("OTEL_METRIC_EXPORT_TIMEOUT", "milliseconds a metric push may take (default 5000)"),
    ("OTEL_BSP_SCHEDULE_DELAY, OTEL_BSP_MAX_QUEUE_SIZE, OTEL_BSP_MAX_EXPORT_BATCH_SIZE",
     "the span queue: milliseconds between exports (1000), spans queued (16384), spans per export "
     "(128; the SDK's 512 built a 12 MB protobuf tree per export)"),
    ("OTEL_EXPORTER_OTLP_PROTOCOL (and TRACES_/METRICS_)", "only `http/protobuf`; another value is warned about"),
    (ENV_CAPTURE, "message content on spans: SPAN_ONLY (or SPAN_AND_EVENT) records it, default none"),
    (ENV_SEMCONV, "`gen_ai_latest_experimental`: the newest GenAI attribute names"),
)
NOT_HONOURED_OTEL_VARIABLES: Final = (
    ("OTEL_TRACES_EXPORTER", "spans go over OTLP when an endpoint is set, else to local files"),
    ("OTEL_TRACES_SAMPLER, OTEL_TRACES_SAMPLER_ARG", "every call is recorded: spans carry its cost"),
    ("OTEL_LOGS_EXPORTER and OTEL_EXPORTER_OTLP_LOGS_*", "logs go to stderr (SPANMETER_LOG_FORMAT)"),
    ("OTEL_BSP_EXPORT_TIMEOUT", "the export's own timeout bounds it (OTEL_EXPORTER_OTLP_TRACES_TIMEOUT)"),
    ("OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE", "pushed metrics are cumulative, as /metrics"),
    ("OTEL_SDK_DISABLED", "turn exports off with OTEL_METRICS_EXPORTER=none and no OTLP endpoint"),
)

Compression = Literal["gzip", "deflate", "none"]
ExportProcess = Literal["auto", "on", "off"]
_COMPRESSIONS: Final[tuple[Compression, ...]] = ("gzip", "deflate", "none")


@frozen
class TelemetryConfig:
    service_name: str = "spanmeter"
    otlp_endpoint: str | None = None  # base URL (`http://collector:4318`); paths are added
    local_dir: str | None = None  # JSONL spans for `spanmeter runs`; default when no OTLP
    capture_content: CaptureMode = "NO_CONTENT"
    semconv_latest: bool = False  # OTEL_SEMCONV_STABILITY_OPT_IN=gen_ai_latest_experimental
    max_queue: int = 16384
    # The SDK's default is 512. The OTLP encoder builds a batch's whole protobuf tree at
    # once, ~10x its serialized size: 12 MB of peak RSS at 512 call spans, 2 MB at 128
    # (issue 29's memory target; docs/benchmarks.md, "Memory (issue 29)").
    max_export_batch: int = 128
    # Span records exported 512 to a POST would save the child ~4 us a span (each POST costs
    # it ~0.75 ms) but hold ~4 MB more of its memory at agent_c64 (docs/benchmarks.md, speed
    # round three): the records path keeps this batch too.
    schedule_delay_ms: int = 1000
    # The local file is read by `spanmeter runs` right after a call: written within 0.1 s.
    local_schedule_delay_ms: int = 100
    export_timeout: float = 5.0  # seconds, per OTLP export including retries
    metrics_timeout: float | None = None  # seconds, per OTLP metric export; None: export_timeout
    # gzip by default (a remote collector); OTEL_EXPORTER_OTLP_COMPRESSION=none saves the
    # export's gzip (level `gzip_level`, below) when the collector is on localhost.
    compression: Compression = "gzip"
    metric_export_interval_ms: int = 60_000  # OTLP metric push; Prometheus is pull
    metric_export_timeout_ms: int | None = None  # a push's whole time; None: metrics_timeout
    # The span queue is bounded by bytes too: 16,384 spans with captured 40 kB prompts
    # would be ~300 MB. The size of a span is estimated from its string attributes.
    max_queue_bytes: int = 64 << 20
    content_cap_bytes: int = 16 * 1024  # per content attribute
    local_max_bytes: int = 32 << 20
    resource_attributes: Mapping[str, str] = field(default_factory=dict)
    push_metrics: bool = False  # push metrics over OTLP even without the standard variables
    project_name: str | None = None  # resource openinference.project.name (Phoenix's project)
    # The price table's name for a model (itself, or the model a dated variant belongs to),
    # None when unpriced: metric labels keep priced models and collapse the rest to
    # `_OTHER` (tracing/labels.py). The proxy passes its PriceTable's lookup; None means no
    # table, and models are then admitted first come, first served up to a bound.
    known_model: KnownModel | None = None
    # Encode and send spans in a child process (tracing/export_process.py): `auto` when
    # spans go over OTLP (protobuf encoding is the cost), `on` always, `off` never.
    export_process: ExportProcess = "auto"
    # With the export child, a span ends as one flat record handed to it, encoded to OTLP
    # once, there (tracing/lean.py `RecordTracer`); False: a ReadableSpan on both sides of
    # the pipe, as before (bench/bench_export.py compares the two).
    span_records: bool = True
    # The gzip level of OTLP span exports; None: the exporter's (9). On call spans as traffic
    # varies them, level 1 takes ~35-40% of level 9's CPU (2.7-3.5 against 7.7-8.1 us a
    # span) for ~16% more bytes (137 against 118 a span); level 6 is 5.5-6.2 us, 121 bytes
    # (bench/bench_otlp_wire.py, docs/benchmarks.md, speed round three).
    gzip_level: int | None = 1

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> TelemetryConfig:
        """Defaults read from the standard OTel variables; keyword arguments win."""
        env = os.environ if environ is None else environ
        opt_in = {v.strip() for v in env.get(ENV_SEMCONV, "").split(",")}
        base = cls(
            service_name=env.get("OTEL_SERVICE_NAME") or "spanmeter",
            capture_content=capture_mode(env.get(ENV_CAPTURE)),
            semconv_latest="gen_ai_latest_experimental" in opt_in,
            compression=compression_setting(env.get(ENV_COMPRESSION)) or "gzip",
            span_records=(env.get(ENV_SPAN_RECORDS) or "").strip().lower() not in ("off", "false", "0", "no"),
            gzip_level=_gzip_level(env.get(ENV_GZIP_LEVEL)),
        )
        numbers: dict[str, Any] = {}
        for field_name, names, kind in _NUMBER_VARIABLES:
            value = _env_number(env, names, kind)
            if value is not None:
                numbers[field_name] = value
        _warn_protocols(env)
        return replace(base, **{**numbers, **overrides})

    def otlp_traces(self, environ: Mapping[str, str]) -> bool:
        return bool(self.otlp_endpoint or environ.get(ENV_ENDPOINT) or environ.get(ENV_TRACES_ENDPOINT))

    def otlp_metrics(self, environ: Mapping[str, str]) -> bool:
        """Push metrics over OTLP? Only when asked: `push_metrics`, OTEL_METRICS_EXPORTER
        naming otlp, or a metrics endpoint of their own. A general endpoint (ours or
        OTEL_EXPORTER_OTLP_ENDPOINT) sends traces only; /metrics serves metrics always.
        (The OTel SDK's default exporter is otlp; ours is Prometheus, which is always on.)
        OTEL_METRICS_EXPORTER=none turns every push off."""
        exporters = {v.strip().lower() for v in environ.get(ENV_METRICS_EXPORTER, "").split(",")}
        if "none" in exporters:
            return False
        return self.push_metrics or "otlp" in exporters or bool(environ.get(ENV_METRICS_ENDPOINT))


def _gzip_level(value: str | None) -> int | None:
    """SPANMETER_OTLP_GZIP_LEVEL: 1-9, `sdk` for the exporter's own (9); unset or not one: 1."""
    v = (value or "").strip().lower()
    if v == "sdk":
        return None
    if v.isdigit() and 1 <= int(v) <= 9:
        return int(v)
    if v:
        log.warning("ignoring %s=%r: expected 1-9 or sdk; using 1", ENV_GZIP_LEVEL, value)
    return 1


# field, variables (the first set wins), int (a count or milliseconds) or float (seconds)
_NUMBER_VARIABLES: Final = (
    ("metric_export_interval_ms", (ENV_METRIC_INTERVAL,), int),
    ("metric_export_timeout_ms", (ENV_METRIC_TIMEOUT,), int),
    ("export_timeout", ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", ENV_TIMEOUT), float),
    ("metrics_timeout", ("OTEL_EXPORTER_OTLP_METRICS_TIMEOUT", ENV_TIMEOUT), float),
    ("schedule_delay_ms", ("OTEL_BSP_SCHEDULE_DELAY",), int),
    ("max_queue", ("OTEL_BSP_MAX_QUEUE_SIZE",), int),
    ("max_export_batch", ("OTEL_BSP_MAX_EXPORT_BATCH_SIZE",), int),
)


def _env_number(env: Mapping[str, str], names: Sequence[str], kind: type[int] | type[float]) -> float | None:
    """The first of `names` that is set, as a positive number; a value that is not one is
    warned about and ignored (the default holds), as the SDK does."""
    for name in names:
        raw = (env.get(name) or "").strip()
        if not raw:
            continue
        try:
            value = kind(raw)
        except ValueError:
            value = 0
        if value > 0:
            return value
        unit = "seconds" if kind is float else "a whole number"
        log.warning("ignoring %s=%r: expected a positive number (%s); using the default", name, raw, unit)
        return None
    return None


def _warn_protocols(env: Mapping[str, str]) -> None:
    for name in ("OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
                 "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL"):
        value = (env.get(name) or "").strip()
        if value and value != "http/protobuf":
            log.warning("ignoring %s=%s: spanmeter exports OTLP over HTTP with protobuf only "
                        "(http/protobuf, port 4318 on a collector)", name, value)


def compression_setting(value: str | None) -> Compression | None:
    """An OTLP compression env value, or None when unset or not one the exporter knows."""
    v = (value or "").strip().lower()
    for known in _COMPRESSIONS:
        if v == known:
            return known
    if v:
        log.warning("ignoring unknown OTLP compression %r (gzip, deflate or none)", value)
    return None


def otlp_compression(cfg: TelemetryConfig, environ: Mapping[str, str], signal: str) -> Compression:
    """The signal's own variable (OTEL_EXPORTER_OTLP_TRACES_COMPRESSION, ...) wins over
    the config, which holds the general OTEL_EXPORTER_OTLP_COMPRESSION; gzip by default."""
    own = compression_setting(environ.get(f"OTEL_EXPORTER_OTLP_{signal.upper()}_COMPRESSION"))
    return own or cfg.compression


def capture_mode(value: str | None) -> CaptureMode:
    """The capture mode from the env var's value; spanmeter has no events pipeline, so the
    event modes count only for what they put on spans. Older releases used true/false."""
    v = (value or "").strip().upper()
    return "SPAN_ONLY" if v in ("SPAN_ONLY", "SPAN_AND_EVENT", "TRUE") else "NO_CONTENT"


class RunIdGenerator(IdGenerator):
    """Random ids, except inside `fixed()`: a run's root span is emitted when the run ends
    with the trace and span ids chosen when it started (children already point at them)."""

    def __init__(self) -> None:
        self._random = RandomIdGenerator()
        self._fixed = threading.local()

    @contextlib.contextmanager
    def fixed(self, trace_id: int, span_id: int) -> Iterator[None]:
        # Thread-local and used around one synchronous start_span: nothing else can see it.
        self._fixed.ids = (trace_id, span_id)
        try:
            yield
        finally:
            self._fixed.ids = None

    def generate_span_id(self) -> int:
        ids = getattr(self._fixed, "ids", None)
        return ids[1] if ids else self._random.generate_span_id()

    def generate_trace_id(self) -> int:
        ids = getattr(self._fixed, "ids", None)
        return ids[0] if ids else self._random.generate_trace_id()


def _queue_limits(cfg: TelemetryConfig, exporter: str) -> QueueLimits:
    delay = cfg.local_schedule_delay_ms if exporter == "local" else cfg.schedule_delay_ms
    return QueueLimits(cfg.max_queue, cfg.max_queue_bytes, cfg.max_export_batch, delay)


class Telemetry:
    """Providers, instruments and exporters of one spanmeter process."""

    def __init__(
        self,
        config: TelemetryConfig,
        tracer_provider: TracerProvider,
        metrics: MetricsOut,
        instruments: Instruments,
        ids: RunIdGenerator,
        records: RecordSink | None = None,
    ) -> None:
        """`records`: where spans may end as flat records (the export child's hand-off)."""
        self.config = config
        self.tracer_provider = tracer_provider
        self.metrics = metrics
        self.instruments = instruments
        self.ids = ids
        self.tracer: Tracer = tracer_provider.get_tracer(SCOPE, schema_url=A.SCHEMA_URL)
        # Call and tool spans: lean when the SDK's internals are as expected (tracing/lean.py).
        self.lean: Spans = spans_for(self.tracer, records)
        self._closed = False

    def metrics_text(self) -> bytes:
        """The Prometheus text exposition for the proxy's `/metrics` (content type
        `METRICS_CONTENT_TYPE`)."""
        return self.metrics.text()

    def set_budget(self, tenant: str, window: str, spent_micros: int, limit_micros: int | None) -> None:
        """Latest spend and limit of a tenant for `window` (day | month), for the gauges."""
        self.instruments.budgets.set(tenant, window, spent_micros, limit_micros)

    def force_flush(self, timeout_millis: int = 10_000) -> bool:
        """Export what is queued. Blocks: call it from a thread, never on the event loop."""
        ok = self.tracer_provider.force_flush(timeout_millis)
        return self.metrics.force_flush(timeout_millis) and ok

    def shutdown(self) -> None:
        """Flush and stop. Blocks (up to ~30 s plus the export timeout when the collector
        hangs, as the SDK's processor bounds it); run it in an executor."""
        if self._closed:
            return
        self._closed = True
        for stop in (self.tracer_provider.shutdown, self.metrics.shutdown):
            try:
                stop()
            except Exception:
                log.warning("telemetry shutdown failed", exc_info=True)


def setup_telemetry(
    cfg: TelemetryConfig,
    *,
    extra_exporters: tuple[SpanExporter, ...] = (),
    environ: Mapping[str, str] | None = None,
    span_exporters: Sequence[tuple[str, SpanExporter]] | None = None,
) -> Telemetry:
    """Build the providers for `cfg`. `extra_exporters` get every span synchronously
    (tests pass an InMemorySpanExporter). `span_exporters` (name, exporter) replace the
    ones `cfg` would choose, behind the same bounded, drop-counting processor
    (bench/bench_spans.py measures the hot path with a no-op one)."""
    env = os.environ if environ is None else environ
    project = {A.OPENINFERENCE_PROJECT_NAME: cfg.project_name} if cfg.project_name else {}
    resource = Resource.create(
        {
            "service.name": cfg.service_name,
            "service.instance.id": uuid.uuid4().hex,
            **project,
            **cfg.resource_attributes,
        }
    )
    instruments = Instruments.create(semconv_latest=cfg.semconv_latest, known_model=cfg.known_model)
    metrics = _metrics_out(cfg, env, resource, instruments)
    ids = RunIdGenerator()
    tracer_provider = TracerProvider(resource=resource, id_generator=ids)
    records: RecordSink | None = None
    if span_exporters is None and uses_export_process(cfg, env):
        handoff = _export_process(cfg, env, resource, instruments.dropped_spans)
        tracer_provider.add_span_processor(handoff)
        # Records only where the hand-off is the one reader of finished spans.
        records = handoff if cfg.span_records and not extra_exporters else None
    else:
        chosen = _span_exporters(cfg, env) if span_exporters is None else span_exporters
        for name, exporter in chosen:
            tracer_provider.add_span_processor(
                DropCountingProcessor(exporter, _queue_limits(cfg, name), instruments.dropped_spans, name))
    for exporter in extra_exporters:
        tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    if span_exporters is None:
        log.info("%s", describe_exports(cfg, env))
    return Telemetry(cfg, tracer_provider, metrics, instruments, ids, records)


def describe_exports(cfg: TelemetryConfig, env: Mapping[str, str]) -> str:
    """Where spans and metrics go, in one line for the start-up log."""
    spans = []
    if cfg.otlp_traces(env):
        spans.append(f"OTLP/HTTP {otlp_url(cfg, env, 'traces')}")
    if cfg.local_dir is not None or not spans:
        spans.append(f"local files under {cfg.local_dir or DEFAULT_LOCAL_DIR}")
    metrics = "/metrics (Prometheus)"
    if cfg.otlp_metrics(env):
        metrics += f" and OTLP/HTTP {otlp_url(cfg, env, 'metrics')}"
    elif cfg.otlp_traces(env):
        metrics += (" only; not pushed over OTLP (set OTEL_METRICS_EXPORTER=otlp or "
                    "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT to push them too)")
    project = f"; project {cfg.project_name}" if cfg.project_name else ""
    where = " (encoded and sent by an export process)" if uses_export_process(cfg, env) else ""
    return f"telemetry: spans to {' and '.join(spans)}{where}; metrics on {metrics}{project}"


def _span_exporters(cfg: TelemetryConfig, env: Mapping[str, str]) -> list[tuple[str, SpanExporter]]:
    exporters: list[tuple[str, SpanExporter]] = []
    if cfg.otlp_traces(env):
        exporters.append(("otlp", _otlp_span_exporter(cfg, env)))
    if cfg.local_dir is not None or not exporters:
        local = JsonlSpanExporter(cfg.local_dir or DEFAULT_LOCAL_DIR, max_bytes=cfg.local_max_bytes)
        exporters.append(("local", local))
    return exporters


def uses_export_process(cfg: TelemetryConfig, env: Mapping[str, str]) -> bool:
    """Are spans exported by a child process? `auto`: when they go over OTLP, whose
    encoding and sending (~31 µs a span on an export thread of the serving process,
    2026-12-03) becomes a ~7 µs hand-off; the child spends ~42 µs a span, on another core
    when there is one (bench/bench_export.py; on one core the two read the same end to end:
    `bench/run.py --targets sm-full,sm-inproc`, docs/benchmarks.md). The local files alone
    cost ~16-19 µs a span in-process against that hand-off, but the child then spends ~24 µs
    on them and is one more process per worker, and the spans `spanmeter runs` reads take
    one more hop: not worth it by default (bench/bench_export.py)."""
    return cfg.export_process == "on" or (cfg.export_process == "auto" and cfg.otlp_traces(env))


def _export_process(cfg: TelemetryConfig, env: Mapping[str, str], resource: Resource,
                    counter: DropCounter) -> ExportProcessProcessor:
    """The exporters `_span_exporters` would build, run by a child process."""
    exporters: list[ChildExporter] = []
    if cfg.otlp_traces(env):
        options: tuple[tuple[str, Any], ...] = (
            ("endpoint", otlp_url(cfg, env, "traces")), ("timeout", cfg.export_timeout),
            ("compression", otlp_compression(cfg, env, "traces")), ("gzip_level", cfg.gzip_level),
            ("records", cfg.span_records))
        exporters.append(ChildExporter("otlp", options, cfg.schedule_delay_ms))
    if cfg.local_dir is not None or not exporters:
        options = (("directory", str(cfg.local_dir or DEFAULT_LOCAL_DIR)), ("max_bytes", cfg.local_max_bytes))
        exporters.append(ChildExporter("local", options, cfg.local_schedule_delay_ms))
    # The hand-off needs no long delay (the child's processors batch again); it waits at
    # most the local file's, so a long OTLP delay does not hold spans in this process.
    delay = min(cfg.local_schedule_delay_ms, *(e.schedule_delay_ms for e in exporters))
    limits = QueueLimits(cfg.max_queue, cfg.max_queue_bytes, cfg.max_export_batch, delay)
    # The SDK's processor bounds its shutdown at ~30 s plus one export.
    return ExportProcessProcessor(exporters, resource, limits, counter, shutdown_timeout_s=30 + cfg.export_timeout)


def _signal_url(base: str, signal: str) -> str:
    """`http://c:4318` -> `http://c:4318/v1/traces`, like OTEL_EXPORTER_OTLP_ENDPOINT."""
    base = base.rstrip("/")
    return base if base.endswith(f"/v1/{signal}") else f"{base}/v1/{signal}"


def otlp_url(cfg: TelemetryConfig, env: Mapping[str, str], signal: str) -> str:
    """Where a signal is exported: its own variable (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, used
    as is) over the configured base URL over OTEL_EXPORTER_OTLP_ENDPOINT (`/v1/<signal>`
    appended), else the OTel default http://localhost:4318."""
    own = env.get(f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT")
    if own:
        return own
    base = cfg.otlp_endpoint or env.get(ENV_ENDPOINT) or "http://localhost:4318"
    return _signal_url(base, signal)


def _compression(cfg: TelemetryConfig, env: Mapping[str, str], signal: str) -> Any:
    # Always explicit: the exporter would otherwise read os.environ, not `environ`.
    from opentelemetry.exporter.otlp.proto.http import Compression as Otlp

    chosen = otlp_compression(cfg, env, signal)
    return {"gzip": Otlp.Gzip, "deflate": Otlp.Deflate}.get(chosen, Otlp.NoCompression)


def _otlp_span_exporter(cfg: TelemetryConfig, env: Mapping[str, str]) -> SpanExporter:
    compression = _compression(cfg, env, "traces")
    return otel_compat.otlp_span_exporter(otlp_url(cfg, env, "traces"), cfg.export_timeout, compression,
                                          gzip_level=cfg.gzip_level)


def _metrics_out(cfg: TelemetryConfig, env: Mapping[str, str], resource: Resource,
                 instruments: Instruments) -> MetricsOut:  # fmt: skip
    """/metrics always; an OTLP push every `metric_export_interval_ms` when asked for."""
    return MetricsOut(resource, Scope(SCOPE, None, A.SCHEMA_URL), instruments.all(), _metric_pushes(cfg, env))


def _metric_pushes(cfg: TelemetryConfig, env: Mapping[str, str]) -> list[Callable[[MetricsOut], PushLoop]]:
    if not cfg.otlp_metrics(env):
        return []
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

    compression = _compression(cfg, env, "metrics")
    metrics_timeout = cfg.metrics_timeout or cfg.export_timeout
    exporter = OTLPMetricExporter(endpoint=otlp_url(cfg, env, "metrics"), timeout=metrics_timeout,
                                  compression=compression)

    def start(out: MetricsOut) -> PushLoop:
        return PushLoop(exporter, out.data, interval_ms=cfg.metric_export_interval_ms,
                        timeout_ms=cfg.metric_export_timeout_ms or metrics_timeout * 1000)

    return [start]
