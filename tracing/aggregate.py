"""Metric instruments that aggregate in plain Python, and what reads them.

The OpenTelemetry SDK spends ~10 µs on every point (it cleans and copies the attributes,
hashes them into a frozenset, offers an exemplar to a reservoir, takes locks per view and
per reader); a model call records 5-8 points. These instruments keep the SDK's call
signatures (`record(value, labels, context=None)`, `add(value, labels, context=None)`) and
its results, for a fraction of the cost: a series is found by the tuple of its label items
(our label dicts are built once and shared, tracing/metrics.py, so the tuple is all a point
pays for), a histogram point is one bisect and a few additions.

Readers, all at collection time and never per point:
- `render_prometheus`: the Prometheus text exposition, the same names, labels, buckets
  and values opentelemetry-exporter-prometheus wrote before (tests/tracing/
  test_aggregate_exposition.py compares the two on the same points);
- `metrics_data`: the SDK's `MetricsData` (cumulative sums and histograms from the
  process start, exemplars of sampled spans), which `PushLoop` exports with the SDK's
  OTLP exporter every interval.

Thread safety: points come from the event loop thread and a few from others (the span
processors' threads count dropped spans), and collection runs in an executor thread or
the push thread. Each instrument has one lock around its series updates and snapshots:
uncontended it costs ~0.1 µs, and a point's fields (bucket, sum, count, min, max) then
never appear half-updated to a reader.
"""

from __future__ import annotations

import itertools
import json
import logging
import re
import threading
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Final, Generic, TypeVar

from opentelemetry.context import Context
from opentelemetry.sdk.metrics import Exemplar
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Gauge,
    HistogramDataPoint,
    Metric,
    MetricExporter,
    MetricExportResult,
    MetricsData,
    NumberDataPoint,
    ResourceMetrics,
    ScopeMetrics,
    Sum,
)
from opentelemetry.sdk.metrics.export import (
    Histogram as HistogramData,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import get_current_span
from opentelemetry.util.types import AttributeValue
from prometheus_client.utils import floatToGoString

from proxy.model import frozen

__all__ = [
    "Counter",
    "GaugeSeries",
    "Histogram",
    "Instrument",
    "MetricsOut",
    "PushLoop",
    "Scope",
    "SumSeries",
    "metrics_data",
    "render_prometheus",
]

log = logging.getLogger(__name__)

Labels = Mapping[str, AttributeValue]
Items = tuple[tuple[str, AttributeValue], ...]
Number = int | float

# The SDK's default cardinality limit per metric stream, and the label set that points
# past it are folded into.
MAX_SERIES: Final = 2000
OVERFLOW: Final[Items] = (("otel.metric.overflow", True),)


@frozen
class Scope:
    """The instrumentation scope: on every OTLP batch and, as `otel_scope_*` labels, on
    every Prometheus series (as the OTel exporter writes them)."""

    name: str
    version: str | None = None
    schema_url: str = ""


def _sampled_span(context: Context | None) -> tuple[int, int] | None:
    """(trace id, span id) of the context's span when it is sampled: the SDK's default
    trace-based exemplar filter. A call records its 5-9 points with one context, so the
    last answer is kept: a Context is immutable, and holding it keeps its id from being
    reused. One tuple, swapped in one assignment, so threads see a whole entry."""
    global _last_context
    if context is None:
        return None
    last = _last_context
    if last[0] is context:
        return last[1]
    sc = get_current_span(context).get_span_context()
    found = (sc.trace_id, sc.span_id) if sc.trace_flags.sampled and sc.is_valid else None
    _last_context = (context, found)
    return found


_last_context: tuple[Context | None, tuple[int, int] | None] = (None, None)


class _HistogramSeries:
    __slots__ = ("attrs", "count", "counts", "exemplars", "max", "min", "sum")

    def __init__(self, attrs: Items, buckets: int) -> None:
        self.attrs = attrs
        self.counts = [0] * buckets
        self.sum: Number = 0
        self.count = 0
        self.min: Number = float("inf")
        self.max: Number = float("-inf")
        # Per bucket, the latest point recorded with a sampled span: (value, time, trace, span).
        self.exemplars: list[tuple[Number, int, int, int] | None] = [None] * buckets


class _SumSeries:
    __slots__ = ("attrs", "exemplar", "value")

    def __init__(self, attrs: Items) -> None:
        self.attrs = attrs
        self.value: Number = 0
        self.exemplar: tuple[Number, int, int, int] | None = None


SumSeries = _SumSeries  # a counter's series, as `Counter.series` hands it out


# Which instrument had its first point first: expositions list families in that order, as
# the SDK's collection did. `next()` on a count is atomic under the GIL.
_FIRST_POINTS = itertools.count()


S = TypeVar("S", _HistogramSeries, _SumSeries)


class _Instrument(Generic[S]):
    """Series by label set. `_series` is keyed by the label items in the order the caller's
    dict has them (what a point can compute cheaply: our label dicts are cached and shared,
    and a fresh dict with the same items finds the same key); the same labels in another
    order find the same series through `_canonical` on their first use, so no series is
    split. Both maps only grow with distinct label sets, which the label bounds
    (tracing/labels.py) and the cardinality limit keep few."""

    def __init__(self, name: str, unit: str, description: str) -> None:
        self.name = name
        self.unit = unit
        self.description = description
        self.first_point: int | None = None
        self._lock = threading.Lock()
        self._series: dict[Items, S] = {}
        self._canonical: dict[Items, S] = {}

    def _make(self, attrs: Items) -> S:
        raise NotImplementedError

    def _new_series(self, items: Items) -> S:
        # Under the lock.
        if self.first_point is None:
            self.first_point = next(_FIRST_POINTS)
        canonical = tuple(sorted(items, key=lambda kv: kv[0]))
        s = self._canonical.get(canonical)
        if s is None:
            # The SDK's rule: past the limit, new label sets share one overflow series.
            if len(self._canonical) >= MAX_SERIES:
                canonical = OVERFLOW
                s = self._canonical.get(OVERFLOW)
            if s is None:
                s = self._canonical[canonical] = self._make(canonical)
        if len(self._series) < 4 * MAX_SERIES:  # orderings of one set are few; bound them anyway
            self._series[items] = s
        return s


class Histogram(_Instrument[_HistogramSeries]):
    """Explicit-bucket histogram, cumulative: what the SDK's default aggregation keeps,
    with the latest exemplar per bucket (its AlignedHistogramBucketExemplarReservoir)."""

    def __init__(self, name: str, unit: str, description: str, boundaries: Sequence[float]) -> None:
        super().__init__(name, unit, description)
        self.boundaries = tuple(boundaries)

    def _make(self, attrs: Items) -> _HistogramSeries:
        return _HistogramSeries(attrs, len(self.boundaries) + 1)

    def record(self, value: Number, labels: Labels, context: Context | None = None) -> None:
        if value < 0:
            log.warning("Histogram %s takes non-negative values only, dropped %r", self.name, value)
            return
        items = tuple(labels.items())
        i = bisect_left(self.boundaries, value)  # value == bound counts in that bound's bucket
        ex = _sampled_span(context)
        with self._lock:
            s = self._series.get(items)
            if s is None:
                s = self._new_series(items)
            s.counts[i] += 1
            s.sum += value
            s.count += 1
            if value < s.min:
                s.min = value
            if value > s.max:
                s.max = value
            if ex is not None:
                s.exemplars[i] = (value, time.time_ns(), ex[0], ex[1])

    def snapshot(self, *, take_exemplars: bool = False) -> list[_HistogramSeries]:
        """Copies of the series, in the order they first appeared; `take_exemplars` clears
        the originals' exemplars (an OTLP collection)."""
        out = []
        with self._lock:
            for s in self._canonical.values():
                c = _HistogramSeries(s.attrs, 0)
                c.counts, c.sum, c.count, c.min, c.max = list(s.counts), s.sum, s.count, s.min, s.max
                c.exemplars = list(s.exemplars)
                if take_exemplars:
                    s.exemplars = [None] * len(s.counts)
                out.append(c)
        return out


class Counter(_Instrument[_SumSeries]):
    """Monotonic sum, cumulative. Its exemplar is the latest point with a sampled span
    (the SDK kept a uniform sample of one)."""

    def _make(self, attrs: Items) -> _SumSeries:
        return _SumSeries(attrs)

    def add(self, value: Number, labels: Labels, context: Context | None = None) -> None:
        if value < 0:
            log.warning("Counter %s takes non-negative values only, dropped %r", self.name, value)
            return
        items = tuple(labels.items())
        ex = _sampled_span(context)
        with self._lock:
            s = self._series.get(items)
            if s is None:
                s = self._new_series(items)
            s.value += value
            if ex is not None:
                s.exemplar = (value, time.time_ns(), ex[0], ex[1])

    def series(self, labels: Labels) -> SumSeries:
        """The series of `labels`, for a caller that adds to the same few label sets call
        after call (`add_to`) and keeps them, rather than finding them again by their items."""
        items = tuple(labels.items())
        with self._lock:
            s = self._series.get(items)
            return s if s is not None else self._new_series(items)

    def add_to(self, points: Iterable[tuple[SumSeries, Number]]) -> None:
        """Add each value to its series (from `series`), under one lock; without exemplars.
        Negative values are dropped, as `add` drops them."""
        with self._lock:
            for s, value in points:
                if value >= 0:
                    s.value += value

    def snapshot(self, *, take_exemplars: bool = False) -> list[_SumSeries]:
        out = []
        with self._lock:
            for s in self._canonical.values():
                c = _SumSeries(s.attrs)
                c.value, c.exemplar = s.value, s.exemplar
                if take_exemplars:
                    s.exemplar = None
                out.append(c)
        return out


@frozen
class GaugeSeries:
    """A gauge read at collection time (the budget gauges): its points come from
    `observe()`, as an observable gauge's callback gives them."""

    name: str
    unit: str
    description: str
    observe: Callable[[], Iterable[tuple[float, Labels]]]


Instrument = Histogram | Counter | GaugeSeries


# --- Prometheus text --------------------------------------------------------------------

_NOT_LABEL = re.compile(r"[^a-zA-Z0-9]+")
_NOT_NAME = re.compile(r"[^a-zA-Z0-9:]+")
_UNIT_ANNOTATION = re.compile(r"{.*}")
# opentelemetry-exporter-prometheus' unit suffixes for the units an instrument may have.
_UNIT_SUFFIX: Final = {
    "d": "days", "h": "hours", "min": "minutes", "s": "seconds", "ms": "milliseconds", "us": "microseconds",
    "ns": "nanoseconds", "By": "bytes", "1": "", "%": "percent",
}  # fmt: skip


def prometheus_label(key: str) -> str:
    """An attribute key as the exporter writes it as a label name."""
    if key and key[0].isdigit():
        key = "_" + key[1:]
    return _NOT_LABEL.sub("_", key)


def prometheus_name(name: str, unit: str) -> str:
    """The family's base name: dots to underscores, plus the unit's suffix (none for an
    annotation such as `{token}`), as the exporter and prometheus_client spell it."""
    if name and name[0].isdigit():
        name = "_" + name[1:]
    base = _NOT_NAME.sub("_", name)
    u = _UNIT_ANNOTATION.sub("", unit)
    suffix = _UNIT_SUFFIX[u] if u in _UNIT_SUFFIX else _NOT_NAME.sub("_", u).strip("_")
    if suffix and not base.endswith("_" + suffix):
        base = f"{base}_{suffix}"
    return base


def _in_order(instruments: Iterable[Instrument]) -> list[Instrument]:
    """Recorded instruments by their first point, then the gauges."""
    recorded: list[Histogram | Counter] = []
    gauges: list[Instrument] = []
    for inst in instruments:
        if isinstance(inst, GaugeSeries):
            gauges.append(inst)
        elif inst.first_point is not None:
            recorded.append(inst)
    recorded.sort(key=lambda i: i.first_point or 0)
    return [*recorded, *gauges]


def _label_value(value: AttributeValue) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _help(text: str) -> str:
    return text.replace("\\", r"\\").replace("\n", r"\n")


def _go(value: Number) -> str:
    return str(floatToGoString(value))  # type: ignore[no-untyped-call]


def _rows(series_attrs: Sequence[Items], scope: Labels) -> tuple[list[str], list[dict[str, str]]]:
    """Label names (sorted, their union over the family, as the exporter writes every
    series with the union and "" where a series has no value) and each series' values."""
    rows = []
    keys: set[str] = set()
    for attrs in series_attrs:
        row = {prometheus_label(k): _label_value(v) for k, v in scope.items()}
        row.update((prometheus_label(k), _label_value(v)) for k, v in attrs)
        keys.update(row)
        rows.append(row)
    return sorted(keys), rows


def _label_text(names: Sequence[str], row: Mapping[str, str]) -> str:
    return ",".join(f'{n}="{row.get(n, "")}"' for n in names)


def _scope_labels(scope: Scope) -> dict[str, AttributeValue]:
    return {"otel_scope_name": scope.name, "otel_scope_version": scope.version or "",
            "otel_scope_schema_url": scope.schema_url}  # fmt: skip


def render_prometheus(resource: Resource, scope: Scope, instruments: Iterable[Instrument]) -> bytes:
    """The Prometheus text exposition (format 0.0.4) of the instruments' current values,
    and `target_info` with the resource attributes; nothing at all while no instrument
    has a point (as the OTel exporter, which writes nothing before the first point)."""
    scope_labels = _scope_labels(scope)
    out: list[str] = []
    for inst in _in_order(instruments):
        if isinstance(inst, Histogram):
            _render_histogram(out, inst, scope_labels)
        elif isinstance(inst, Counter):
            _render_counter(out, inst, scope_labels)
        else:
            _render_gauge(out, inst, scope_labels)
    if not out:
        return b""
    info = {prometheus_label(k): _label_value(v) for k, v in resource.attributes.items()}
    head = ("# HELP target_info Target metadata\n# TYPE target_info gauge\n"
            f"target_info{{{_label_text(sorted(info), info)}}} 1.0\n")  # fmt: skip
    return (head + "".join(out)).encode()


def _render_histogram(out: list[str], inst: Histogram, scope: Labels) -> None:
    series = inst.snapshot()
    if not series:
        return
    name = prometheus_name(inst.name, inst.unit)
    out.append(f"# HELP {name} {_help(inst.description)}\n# TYPE {name} histogram\n")
    names, rows = _rows([s.attrs for s in series], scope)
    # `le` sorts among the other labels (the client writes labels sorted): the text before
    # and after it is the same on all of a series' buckets.
    before = [n for n in names if n < "le"]
    after = [n for n in names if n > "le"]
    les = [f"{b}" for b in inst.boundaries] + ["+Inf"]
    for s, row in zip(series, rows, strict=True):
        plain = _label_text(names, row)
        head = f"{name}_bucket{{{_label_text(before, row)}{',' if before else ''}le=\""
        tail = f"\"{',' if after else ''}{_label_text(after, row)}}} "
        running = 0
        for le, n in zip(les, s.counts, strict=True):
            running += n
            out.append(f"{head}{le}{tail}{_go(running)}\n")
        out.append(f"{name}_count{{{plain}}} {_go(running)}\n{name}_sum{{{plain}}} {_go(s.sum)}\n")


def _render_counter(out: list[str], inst: Counter, scope: Labels) -> None:
    series = inst.snapshot()
    if not series:
        return
    name = prometheus_name(inst.name, inst.unit)
    if name.endswith("_total"):
        name = name[: -len("_total")]
    out.append(f"# HELP {name}_total {_help(inst.description)}\n# TYPE {name}_total counter\n")
    names, rows = _rows([s.attrs for s in series], scope)
    out.extend(f"{name}_total{{{_label_text(names, row)}}} {_go(s.value)}\n"
               for s, row in zip(series, rows, strict=True))  # fmt: skip


def _render_gauge(out: list[str], inst: GaugeSeries, scope: Labels) -> None:
    points = _observe(inst)
    if not points:
        return
    name = prometheus_name(inst.name, inst.unit)
    out.append(f"# HELP {name} {_help(inst.description)}\n# TYPE {name} gauge\n")
    names, rows = _rows([attrs for _, attrs in points], scope)
    out.extend(f"{name}{{{_label_text(names, row)}}} {_go(value)}\n"
               for (value, _), row in zip(points, rows, strict=True))  # fmt: skip


def _observe(inst: GaugeSeries) -> list[tuple[float, Items]]:
    # One point per label set, the last observed, as the SDK's last-value aggregation.
    try:
        points = {tuple(sorted(labels.items())): value for value, labels in inst.observe()}
    except Exception:
        log.warning("gauge %s: callback failed", inst.name, exc_info=True)
        return []
    return [(value, attrs) for attrs, value in points.items()]


# --- OTLP ------------------------------------------------------------------------------


def metrics_data(resource: Resource, scope: Scope, instruments: Iterable[Instrument], start_ns: int, *,
                 take_exemplars: bool = True) -> MetricsData | None:  # fmt: skip
    """The instruments as the SDK's MetricsData (cumulative from `start_ns`), None while
    nothing was recorded. Exemplars are taken: each goes out in one export only, as the
    SDK's reservoirs are reset at every collection."""
    now = time.time_ns()
    metrics: list[Metric] = []
    for inst in _in_order(instruments):
        if isinstance(inst, Histogram):
            hpoints = [
                HistogramDataPoint(
                    attributes=dict(s.attrs), start_time_unix_nano=start_ns, time_unix_nano=now, count=s.count,
                    sum=s.sum, bucket_counts=s.counts, explicit_bounds=inst.boundaries, min=s.min, max=s.max,
                    exemplars=_exemplars(s.exemplars),
                )
                for s in inst.snapshot(take_exemplars=take_exemplars)
            ]  # fmt: skip
            if hpoints:
                data = HistogramData(data_points=hpoints, aggregation_temporality=AggregationTemporality.CUMULATIVE)
                metrics.append(Metric(inst.name, inst.description, inst.unit, data))
        elif isinstance(inst, Counter):
            npoints = [
                NumberDataPoint(attributes=dict(s.attrs), start_time_unix_nano=start_ns, time_unix_nano=now,
                                value=s.value, exemplars=_exemplars([s.exemplar]))
                for s in inst.snapshot(take_exemplars=take_exemplars)
            ]  # fmt: skip
            if npoints:
                total = Sum(data_points=npoints, aggregation_temporality=AggregationTemporality.CUMULATIVE,
                            is_monotonic=True)  # fmt: skip
                metrics.append(Metric(inst.name, inst.description, inst.unit, total))
        else:
            gpoints = [
                NumberDataPoint(attributes=dict(attrs), start_time_unix_nano=0, time_unix_nano=now, value=value)
                for value, attrs in _observe(inst)
            ]
            if gpoints:
                metrics.append(Metric(inst.name, inst.description, inst.unit, Gauge(data_points=gpoints)))
    if not metrics:
        return None
    otel_scope = InstrumentationScope(scope.name, scope.version, scope.schema_url)
    return MetricsData(resource_metrics=[ResourceMetrics(
        resource=resource,
        scope_metrics=[ScopeMetrics(scope=otel_scope, metrics=metrics, schema_url=scope.schema_url)],
        schema_url=resource.schema_url,
    )])  # fmt: skip


def _exemplars(kept: Iterable[tuple[Number, int, int, int] | None]) -> list[Exemplar]:
    return [Exemplar({}, value, at, span_id, trace_id) for e in kept if e is not None
            for value, at, trace_id, span_id in (e,)]  # fmt: skip


class PushLoop:
    """Exports `collect()` with `exporter` every `interval_ms` on a daemon thread, as the
    SDK's PeriodicExportingMetricReader does; one export at a time."""

    def __init__(self, exporter: MetricExporter, collect: Callable[[], MetricsData | None], *,
                 interval_ms: float, timeout_ms: float) -> None:  # fmt: skip
        self._exporter = exporter
        self._collect = collect
        self._interval = interval_ms / 1e3
        self._timeout_ms = timeout_ms
        self._export_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="spanmeter-metrics-push", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.export()

    def export(self, timeout_ms: float | None = None) -> bool:
        with self._export_lock:
            try:
                data = self._collect()
                if data is None:
                    return True
                result = self._exporter.export(data, timeout_millis=timeout_ms or self._timeout_ms)
            except Exception:
                log.warning("metrics export failed", exc_info=True)
                return False
            return result is MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return self.export(min(timeout_millis, self._timeout_ms)) and bool(
            self._exporter.force_flush(int(timeout_millis)))

    def shutdown(self) -> None:
        """Stop the thread, export once more (what was recorded since the last interval)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(self._interval + self._timeout_ms / 1e3 + 1)
        self.export()
        self._exporter.shutdown()


class MetricsOut:
    """Where one process's instruments go: `/metrics` text on demand, OTLP pushes when
    configured (`pushes`)."""

    def __init__(self, resource: Resource, scope: Scope, instruments: Sequence[Instrument],
                 pushes: Sequence[Callable[[MetricsOut], PushLoop]] = ()) -> None:  # fmt: skip
        self.resource = resource
        self.scope = scope
        self.instruments = tuple(instruments)
        self.start_ns = time.time_ns()
        self.pushes = [start(self) for start in pushes]

    def text(self) -> bytes:
        return render_prometheus(self.resource, self.scope, self.instruments)

    def data(self) -> MetricsData | None:
        return metrics_data(self.resource, self.scope, self.instruments, self.start_ns)

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        ok = True
        for push in self.pushes:
            ok = push.force_flush(timeout_millis) and ok
        return ok

    def shutdown(self) -> None:
        for push in self.pushes:
            push.shutdown()
