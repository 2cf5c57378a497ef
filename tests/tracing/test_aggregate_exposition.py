"""tracing/aggregate.py against the OpenTelemetry SDK it replaced, on the same points.

Each case records the same points into spanmeter's instruments and into real SDK
instruments of the same names, units, descriptions and buckets (a MeterProvider with the
opentelemetry-exporter-prometheus reader on its own registry, as `/metrics` was produced
before, and an in-memory reader for what an OTLP push carried). Then:
- `/metrics`: the same bytes, and the same samples as prometheus_client's parser reads them;
- OTLP: the same metrics, data types, temporality, points (attributes, counts, buckets,
  sums, min, max, values) and exemplars (value, trace id, span id).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader, MetricsData
from opentelemetry.util.types import AttributeValue
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tests.fixtures.otlp import OtlpReceiver
from tracing import aggregate
from tracing import attributes as A
from tracing.aggregate import Counter, Histogram
from tracing.metrics import Instruments
from tracing.setup import SCOPE, Telemetry, TelemetryConfig, setup_telemetry

Labels = Mapping[str, AttributeValue]


def traced(trace_id: int, span_id: int, sampled: bool = True) -> Context:
    flags = trace.TraceFlags(trace.TraceFlags.SAMPLED if sampled else trace.TraceFlags.DEFAULT)
    sc = trace.SpanContext(trace_id, span_id, is_remote=False, trace_flags=flags)
    return trace.set_span_in_context(trace.NonRecordingSpan(sc))


@dataclass(frozen=True)
class Point:
    instrument: str  # an Instruments field
    value: float
    labels: Labels
    context: Context | None = None


@dataclass(frozen=True)
class Budget:
    tenant: str
    window: str
    spent_micros: int
    limit_micros: int | None


CALL: Labels = {A.GEN_AI_OPERATION_NAME: "chat", A.GEN_AI_PROVIDER_NAME: "openai", A.GEN_AI_REQUEST_MODEL: "gpt-4o",
                A.SERVER_ADDRESS: "api.openai.com", A.SERVER_PORT: 443, A.SPANMETER_TENANT_ID: "acme"}  # fmt: skip
FAILED: Labels = {**CALL, A.ERROR_TYPE: "timeout"}
MONEY: Labels = {A.GEN_AI_PROVIDER_NAME: "openai", A.GEN_AI_REQUEST_MODEL: "gpt-4o", A.SPANMETER_TENANT_ID: "acme"}
BETA: Labels = {**MONEY, A.SPANMETER_TENANT_ID: "beta"}

CASES: dict[str, list[Point | Budget]] = {
    "nothing recorded": [],
    "one call": [
        Point("operation_duration", 0.42, CALL, traced(1, 2)),
        Point("token_usage", 120, {**CALL, A.GEN_AI_TOKEN_TYPE: "input"}, traced(1, 2)),
        Point("token_usage", 30, {**CALL, A.GEN_AI_TOKEN_TYPE: "output"}, traced(1, 2)),
        Point("cost", 0.0006, MONEY, traced(1, 2)),
        Point("cache_tokens", 0, {**MONEY, A.SPANMETER_CACHE_OPERATION: "read"}, traced(1, 2)),
    ],
    "several calls, series with and without error_type": [
        Point("operation_duration", 0.4, CALL, traced(1, 2)),
        Point("operation_duration", 1.5, CALL, traced(3, 4)),
        Point("operation_duration", 1.6, CALL, traced(5, 6)),  # same bucket: the latest is the exemplar
        Point("operation_duration", 30.0, FAILED, traced(7, 8)),
        Point("operation_duration", 0.2, {**CALL, A.SPANMETER_TENANT_ID: "beta"}),
        Point("cost", 0.0144, MONEY),
        Point("cost", 7e-06, BETA, traced(9, 10)),
        Point("cost", 0.5, MONEY),
    ],
    "values on the bucket bounds, zero, past the last bound, negative (dropped)": [
        Point("operation_duration", 0.01, CALL),
        Point("operation_duration", 0.0, CALL),
        Point("operation_duration", 81.92, CALL),
        Point("operation_duration", 1e6, CALL),
        Point("operation_duration", -1.0, CALL),
        Point("token_usage", 1, CALL),
        Point("token_usage", 67108864, CALL),
        Point("token_usage", 67108865, CALL),
        Point("mcp_duration", 0.05, CALL),
        Point("mcp_duration", 300.0, CALL),
        Point("cost", -1.0, MONEY),
    ],
    "the same labels in another order are one series": [
        Point("cost", 1.0, MONEY),
        Point("cost", 2.0, dict(reversed(list(MONEY.items())))),
        Point("operation_duration", 1.0, CALL),
        Point("operation_duration", 2.0, dict(reversed(list(CALL.items())))),
    ],
    "label values of other types and characters to escape": [
        Point("tool_calls", 1, {A.GEN_AI_TOOL_NAME: 'say "hi"\\now\n', A.SPANMETER_OUTCOME: "ok"}),
        Point("tool_calls", 2, {A.GEN_AI_TOOL_NAME: "flag", "spanmeter.flag": True}),
        Point("tool_calls", 3, {A.GEN_AI_TOOL_NAME: "ratio", "spanmeter.ratio": 0.25}),
        Point("guard_actions", 1, {"9lives.label": "x", A.SPANMETER_TENANT_ID: "é ü"}),
    ],
    "every instrument once, integer and float counters, sampled and unsampled contexts": [
        Point("operation_duration", 1.0, CALL, traced(11, 12)),
        Point("token_usage", 10, CALL, traced(11, 12, sampled=False)),
        Point("time_to_first_chunk", 0.3, CALL, traced(11, 12)),
        Point("time_per_output_chunk", 0.02, CALL),
        Point("execute_tool_duration", 2.0, {A.GEN_AI_TOOL_NAME: "t"}, traced(11, 13)),
        Point("mcp_duration", 0.1, {A.GEN_AI_TOOL_NAME: "t"}, traced(11, 14)),
        Point("cost", 0.25, MONEY, traced(11, 12)),
        Point("limit_rejections", 1, {A.SPANMETER_REASON: "run_calls"}),
        Point("repairs", 1, {A.SPANMETER_KIND: "fence"}),
        Point("tool_calls", 1, {A.SPANMETER_OUTCOME: "ok"}),
        Point("guard_actions", 1, {"spanmeter.guard.action": "remind"}),
        Point("rewrites", 1, {A.SPANMETER_KIND: "include_usage"}),
        Point("ledger_overshoot", 0.001, MONEY),
        Point("dropped_spans", 3, {A.ERROR_TYPE: "queue_full"}),
        Point("cache_tokens", 4, MONEY),
        Point("cache_tokens", 2.5, MONEY),
        Point("cost_saved", 0.0001, MONEY),
        Point("wrap_up_notices", 1, {A.SPANMETER_REASON: "calls"}),
        Point("runs_ended", 1, {"spanmeter.run.outcome": "answered"}),
        Budget("acme", "day", 1_800, 10_000_000),
        Budget("acme", "month", 51_800, None),
        Budget("acme", "day", 2_000, 10_000_000),  # the latest is what the gauge shows
    ],
    "budget gauges alone": [Budget("beta", "day", 7, 500_000)],
}


class SdkMirror:
    """The SDK pipeline as tracing/setup.py built it before: SDK instruments of the same
    names, units and buckets as `ours`, and both readers."""

    def __init__(self, tel: Telemetry) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.memory = InMemoryMetricReader()
        self.provider = MeterProvider(resource=tel.metrics.resource,
                                      metric_readers=[PrometheusMetricReader(registry=self.registry), self.memory])
        meter = self.provider.get_meter(SCOPE, schema_url=A.SCHEMA_URL)
        self.by_field: dict[str, Any] = {}
        budgets = tel.instruments.budgets
        gauges = ((A.SPANMETER_BUDGET_SPENT_USD, budgets.spent), (A.SPANMETER_BUDGET_LIMIT_USD, budgets.limits))
        for gauge, read in gauges:
            spec = A.METRICS_BY_NAME[gauge]

            def callback(_options: CallbackOptions, read: Any = read) -> list[Observation]:
                return [Observation(v, dict(labels)) for v, labels in read()]

            meter.create_observable_gauge(spec.name, callbacks=[callback], unit=spec.unit,
                                          description=spec.description)  # fmt: skip
        for f in fields(Instruments):
            inst = getattr(tel.instruments, f.name)
            if isinstance(inst, Histogram):
                self.by_field[f.name] = meter.create_histogram(inst.name, unit=inst.unit, description=inst.description,
                                                               explicit_bucket_boundaries_advisory=list(inst.boundaries))
            elif isinstance(inst, Counter):
                self.by_field[f.name] = meter.create_counter(inst.name, unit=inst.unit, description=inst.description)

    def record(self, p: Point) -> None:
        inst = self.by_field[p.instrument]
        if hasattr(inst, "record"):
            inst.record(p.value, p.labels, context=p.context or Context())
        else:
            inst.add(p.value, p.labels, context=p.context or Context())


def record(tel: Telemetry, p: Point | Budget) -> None:
    if isinstance(p, Budget):
        tel.set_budget(p.tenant, p.window, p.spent_micros, p.limit_micros)
        return
    inst = getattr(tel.instruments, p.instrument)
    if isinstance(inst, Histogram):
        inst.record(p.value, p.labels, context=p.context)
    else:
        inst.add(p.value, p.labels, context=p.context)


@pytest.fixture
def tel(tmp_path: Any) -> Iterator[Telemetry]:
    t = setup_telemetry(TelemetryConfig(local_dir=str(tmp_path), resource_attributes={"service.instance.id": "i-1"}),
                        environ={})  # fmt: skip
    yield t
    t.shutdown()


def both(tel: Telemetry, points: list[Point | Budget]) -> SdkMirror:
    sdk = SdkMirror(tel)
    for p in points:
        record(tel, p)
        if isinstance(p, Point):
            sdk.record(p)
    return sdk


def samples(text: str) -> list[tuple[str, str, tuple[tuple[str, str], ...], float]]:
    return sorted((fam.type, s.name, tuple(sorted(s.labels.items())), s.value)
                  for fam in text_string_to_metric_families(text) for s in fam.samples)  # fmt: skip


@pytest.mark.parametrize("points", CASES.values(), ids=CASES.keys())
def test_metrics_text_is_what_the_sdk_and_its_prometheus_exporter_wrote(tel: Telemetry,
                                                                        points: list[Point | Budget]) -> None:
    sdk = both(tel, points)
    try:
        old = generate_latest(sdk.registry).decode()
        new = tel.metrics_text().decode()
        assert samples(new) == samples(old)
        assert new == old
        assert bool(new) == bool(points)
    finally:
        sdk.provider.shutdown()


def _points(data: MetricsData | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if data is None:
        return out
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                d = m.data
                points = sorted(
                    (
                        repr(sorted(p.attributes.items())),
                        tuple(getattr(p, k, None) for k in ("count", "sum", "min", "max", "value")),
                        tuple(getattr(p, "bucket_counts", ())), tuple(getattr(p, "explicit_bounds", ())),
                        sorted((e.value, e.trace_id, e.span_id, dict(e.filtered_attributes or {}) == {})
                               for e in p.exemplars),
                    )
                    for p in d.data_points
                )  # fmt: skip
                out[m.name] = (
                    (rm.resource.attributes, rm.schema_url, sm.scope.name, sm.scope.version, sm.scope.schema_url,
                     sm.schema_url),
                    (m.unit, m.description, type(d).__name__, getattr(d, "aggregation_temporality", None),
                     getattr(d, "is_monotonic", None)),
                    points,
                )  # fmt: skip
    return out


@pytest.mark.parametrize("points", CASES.values(), ids=CASES.keys())
def test_otlp_data_is_what_the_sdk_collected(tel: Telemetry, points: list[Point | Budget]) -> None:
    sdk = both(tel, points)
    try:
        old = _points(sdk.memory.get_metrics_data())
        new_data = tel.metrics.data()
        assert _points(new_data) == old
        if new_data is not None:
            for m in new_data.resource_metrics[0].scope_metrics[0].metrics:
                for p in m.data.data_points:
                    if m.data.__class__.__name__ != "Gauge":
                        assert p.start_time_unix_nano == tel.metrics.start_ns <= p.time_unix_nano
    finally:
        sdk.provider.shutdown()


def test_an_exemplar_goes_out_once() -> None:
    h = Histogram("h", "s", "d", (1.0,))
    h.record(0.5, {"a": "b"}, context=traced(1, 2))
    resource, scope = aggregate.Resource.create({}), aggregate.Scope("s")
    first = aggregate.metrics_data(resource, scope, [h], 0)
    second = aggregate.metrics_data(resource, scope, [h], 0)
    assert first is not None and second is not None
    (p1,) = first.resource_metrics[0].scope_metrics[0].metrics[0].data.data_points
    (p2,) = second.resource_metrics[0].scope_metrics[0].metrics[0].data.data_points
    assert [(e.trace_id, e.span_id, e.value) for e in p1.exemplars] == [(1, 2, 0.5)]
    assert p2.exemplars == [] and p2.count == 1  # type: ignore[union-attr]


def test_past_the_cardinality_limit_points_go_to_the_overflow_series(tel: Telemetry) -> None:
    sdk = SdkMirror(tel)
    try:
        for i in range(aggregate.MAX_SERIES + 5):
            p = Point("dropped_spans", 1, {A.ERROR_TYPE: f"e{i}"})
            record(tel, p)
            sdk.record(p)
        new = tel.metrics_text().decode()
        assert samples(new) == samples(generate_latest(sdk.registry).decode())
        overflow = [v for _, name, labels, v in samples(new) if ("otel_metric_overflow", "true") in labels]
        assert overflow == [5.0]
    finally:
        sdk.provider.shutdown()


def test_points_from_several_threads_all_count() -> None:
    c = Counter("c", "1", "d")
    h = Histogram("h", "s", "d", (0.5,))

    def hammer(n: int) -> None:
        for _ in range(20_000):
            c.add(1, {"t": str(n % 2)})
            h.record(0.25, {"t": str(n % 2)})

    threads = [threading.Thread(target=hammer, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(s.value for s in c.snapshot()) == 80_000
    assert [(s.count, s.counts, s.sum) for s in h.snapshot()] == [(40_000, [40_000, 0], 10_000.0)] * 2


def _pushed(receiver: OtlpReceiver) -> dict[str, list[Any]]:
    by_name: dict[str, list[Any]] = {}
    for req in receiver.metrics():
        for rm in req.resource_metrics:
            for sm in rm.scope_metrics:
                assert (sm.scope.name, sm.schema_url) == (SCOPE, A.SCHEMA_URL)
                for m in sm.metrics:
                    by_name.setdefault(m.name, []).append(m)
    return by_name


def test_otlp_push_carries_the_aggregates_to_a_real_receiver(tmp_path: Any, otlp_receiver: OtlpReceiver) -> None:
    cfg = TelemetryConfig(otlp_endpoint=otlp_receiver.endpoint, local_dir=str(tmp_path), push_metrics=True,
                          metric_export_interval_ms=3_600_000)  # fmt: skip
    tel = setup_telemetry(cfg, environ={})
    try:
        for p in CASES["several calls, series with and without error_type"]:
            record(tel, p)
        tel.set_budget("acme", "day", 1_500_000, 10_000_000)
        assert tel.force_flush()
        pushed = _pushed(otlp_receiver)
        (duration,) = pushed[A.GEN_AI_CLIENT_OPERATION_DURATION]
        assert duration.unit == "s" and duration.histogram.aggregation_temporality == 2  # cumulative
        by_tenant = {(dict((a.key, a.value.string_value) for a in p.attributes)[A.SPANMETER_TENANT_ID],
                      any(a.key == A.ERROR_TYPE for a in p.attributes)): p
                     for p in duration.histogram.data_points}  # fmt: skip
        ok = by_tenant[("acme", False)]
        assert (ok.count, ok.sum, ok.min, ok.max) == (3, pytest.approx(3.5), 0.4, 1.6)
        assert list(ok.explicit_bounds) == list(A.DURATION_BUCKETS) and sum(ok.bucket_counts) == 3
        assert sorted((int.from_bytes(e.trace_id, "big"), int.from_bytes(e.span_id, "big"), e.as_double)
                      for e in ok.exemplars) == [(1, 2, 0.4), (5, 6, 1.6)]  # fmt: skip
        assert ok.start_time_unix_nano == tel.metrics.start_ns
        (cost,) = pushed[A.SPANMETER_COST]
        assert cost.sum.is_monotonic and cost.sum.aggregation_temporality == 2
        assert sorted(p.as_double for p in cost.sum.data_points) == [7e-06, pytest.approx(0.5144)]
        (spent,) = pushed[A.SPANMETER_BUDGET_SPENT_USD]
        assert [p.as_double for p in spent.gauge.data_points] == [1.5]
        before = len(otlp_receiver.metrics())
        record(tel, Point("cost", 1.0, MONEY))
    finally:
        tel.shutdown()
    # Shutdown pushes what was recorded since: cumulative, so the total so far.
    last = _pushed(otlp_receiver)[A.SPANMETER_COST][-1]
    assert len(otlp_receiver.metrics()) == before + 1
    assert sorted(p.as_double for p in last.sum.data_points) == [7e-06, pytest.approx(1.5144)]


def test_otlp_push_runs_every_interval(tmp_path: Any, otlp_receiver: OtlpReceiver) -> None:
    cfg = TelemetryConfig(otlp_endpoint=otlp_receiver.endpoint, local_dir=str(tmp_path), push_metrics=True,
                          metric_export_interval_ms=50)  # fmt: skip
    tel = setup_telemetry(cfg, environ={})
    try:
        record(tel, Point("cost", 1.0, MONEY))
        assert len(otlp_receiver.wait_for_metrics(2, timeout=30)) >= 2  # without a flush: the interval's
    finally:
        tel.shutdown()
