"""Spans that end as flat records (tracing/lean.py `RecordTracer`) and are encoded to OTLP
once, in the export child (tracing/otlp_wire.py `RecordEncoder`), against the SDK's own
path: what a collector receives must be the same.

The reference is the SDK as shipped, in process: `Tracer.start_span` and `Span.end`
(SPANMETER_OTEL_INTERNALS=off) and `OTLPSpanExporter` with its own encoder and gzip. Both
send over real OTLP/HTTP to a receiver; each request is decoded with opentelemetry-proto
and every span compared whole (name, ids, parent, kind, times, attributes, events, links,
status, flags), with its resource and scope."""

from __future__ import annotations

import random
import zlib
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp import web
from google.protobuf.json_format import MessageToDict
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans as reference
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Link, NonRecordingSpan, SpanKind, Status, StatusCode, TraceState, set_span_in_context

from tests.fixtures.otlp import OtlpReceiver, _body
from tests.tracing.test_lean_spans import SCENARIOS, Scenario, Seen
from tracing import otel_compat, otlp_wire
from tracing.batching import QueueLimits, RecordBatcher
from tracing.lean import LeanTracer, RecordTracer
from tracing.records import decode_span, encode_span
from tracing.setup import Telemetry, TelemetryConfig, setup_telemetry


class RawReceiver(OtlpReceiver):
    """The test receiver, keeping every trace request whole."""

    def __init__(self) -> None:
        super().__init__()
        self.requests_seen: list[ExportTraceServiceRequest] = []

    async def _traces(self, request: web.Request) -> web.Response:
        req = ExportTraceServiceRequest()
        req.ParseFromString(_body(await request.read(), request.headers.get("Content-Encoding", "")))
        self.requests_seen.append(req)
        return await super()._traces(request)


@pytest.fixture
def receivers() -> Iterator[tuple[RawReceiver, RawReceiver]]:
    made = (RawReceiver().start(), RawReceiver().start())
    try:
        yield made
    finally:
        for r in made:
            r.close()


def direct_spans(tel: Telemetry, seen: Seen) -> None:
    """Spans of the SDK's tracer itself (they reach the export child as ReadableSpans): a
    parent, links with attributes, an event, a trace state, a remote parent, arrays, an
    error status, every kind."""
    tracer = tel.tracer
    root = tracer.start_span("root", kind=SpanKind.SERVER, attributes={"a.int": 3, "a.list": ["x", "y"]},
                             start_time=10)
    inside = set_span_in_context(root)
    other = tracer.start_span("other", context=inside, start_time=11)
    other.end(end_time=12)
    child = tracer.start_span("child", context=inside, kind=SpanKind.CLIENT, start_time=13,
                              links=[Link(other.get_span_context(), {"why": "x"})],
                              attributes={"a.float": 1.5, "a.bool": True, "a.ints": [1, 2]})
    child.add_event("retry", {"attempt": 2}, timestamp=14)
    child.set_status(Status(StatusCode.ERROR, "upstream 502"))
    child.end(end_time=15)
    root.end(end_time=16)
    state = tracer.start_span("state", start_time=16)
    state.end(end_time=17)
    ctx = state.get_span_context()
    parent = NonRecordingSpan(type(ctx)(ctx.trace_id, ctx.span_id, True, ctx.trace_flags, TraceState([("k", "v")])))
    tracer.start_span("remote-child", context=set_span_in_context(parent), kind=SpanKind.CONSUMER,
                      start_time=18).end(end_time=19)


EVERY: list[Scenario] = [*SCENARIOS, direct_spans]


def _spans(receiver: RawReceiver) -> list[dict[str, Any]]:
    """Every span received, as a dict of all its fields, with its resource (less the
    instance id, one per process) and scope; in id order."""
    out = []
    for req in receiver.requests_seen:
        for rs in req.resource_spans:
            resource = MessageToDict(rs.resource)
            resource["attributes"] = [a for a in resource["attributes"] if a["key"] != "service.instance.id"]
            for ss in rs.scope_spans:
                scope = {**MessageToDict(ss.scope), "schema": ss.schema_url, "resource_schema": rs.schema_url}
                out += [{**MessageToDict(s), "resource": resource, "scope": scope} for s in ss.spans]
    return sorted(out, key=lambda s: (s["traceId"], s["spanId"]))


def _telemetry(endpoint: str, monkeypatch: pytest.MonkeyPatch, *, shipped: bool) -> Telemetry:
    if shipped:
        monkeypatch.setenv(otel_compat.ENV, "off")
    try:
        cfg = TelemetryConfig(otlp_endpoint=endpoint, capture_content="SPAN_ONLY", metric_export_interval_ms=3_600_000,
                              export_process="off" if shipped else "on")
        return setup_telemetry(cfg, environ={})
    finally:
        monkeypatch.delenv(otel_compat.ENV, raising=False)


def _send(tel: Telemetry, scenario: Scenario) -> None:
    random.seed(20261206)  # the same ids on both paths: the tracer's RandomIdGenerator draws them
    try:
        scenario(tel, Seen())
        assert tel.force_flush(20_000)
    finally:
        tel.shutdown()


@pytest.mark.parametrize("scenario", EVERY, ids=[s.__name__ for s in EVERY])
def test_a_collector_receives_from_records_what_the_sdk_sends(receivers: tuple[RawReceiver, RawReceiver],
                                                               scenario: Scenario,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    shipped_at, records_at = receivers
    shipped = _telemetry(shipped_at.endpoint, monkeypatch, shipped=True)
    assert not isinstance(shipped.lean, LeanTracer)  # the SDK's own start_span / end
    _send(shipped, scenario)
    records = _telemetry(records_at.endpoint, monkeypatch, shipped=False)
    assert isinstance(records.lean, RecordTracer)
    _send(records, scenario)

    expected, got = _spans(shipped_at), _spans(records_at)
    assert got == expected
    assert len(got) == {"unsampled_parent": 0, "tool_spans": 3, "mcp_requests": 2, "run_roots": 4,
                        "direct_spans": 5}.get(scenario.__name__, 1)


def test_records_encode_to_the_exporters_bytes() -> None:
    """For every scenario's spans, the record encoder writes, byte for byte, what the
    exporter's encoder writes for the spans the records decode to, and for the spans
    themselves."""
    memory = InMemorySpanExporter()
    tel = setup_telemetry(TelemetryConfig(capture_content="SPAN_ONLY"), span_exporters=[], environ={},
                          extra_exporters=(memory,))
    try:
        for scenario in EVERY:
            scenario(tel, Seen())
        spans = list(memory.get_finished_spans())
    finally:
        tel.shutdown()
    assert len(spans) == 19
    resource = spans[0].resource
    records = [encode_span(s, {}) for s in spans]
    encoder = otlp_wire.RecordEncoder(resource)
    expected = reference([decode_span(r, resource) for r in records]).SerializePartialToString()
    assert encoder.encode(records) == expected
    assert encoder.encode(records) == expected  # again, with what it keeps from the first batch
    assert expected == reference(spans).SerializePartialToString()  # the events' and links' dropped counts: none
    for record in records:
        assert encoder.encode([record]) == reference([decode_span(record, resource)]).SerializePartialToString()


def test_what_the_record_encoder_refuses_goes_through_the_exporters_encoder(
        receivers: tuple[RawReceiver, RawReceiver]) -> None:
    receiver = receivers[0]
    exporter = otel_compat.otlp_span_exporter(receiver.endpoint + "/v1/traces", 5.0, Compression.Gzip)
    memory = InMemorySpanExporter()
    tel = setup_telemetry(TelemetryConfig(), span_exporters=[], environ={}, extra_exporters=(memory,))
    tel.tracer.start_span("odd", attributes={"bad": "\ud800", "good": 1}).end()
    tel.tracer.start_span("fine", attributes={"good": 2}).end()
    span = memory.get_finished_spans()[0]
    tel.shutdown()
    record = encode_span(span, {})
    with pytest.raises(otlp_wire.NotEncodable):
        otlp_wire.RecordEncoder(span.resource).encode([record])
    good = encode_span(memory.get_finished_spans()[1], {})
    items = [exporter.encode_record(r, span.resource) for r in (record, good)]  # type: ignore[attr-defined]
    assert items[0] is record and type(items[1][1]) is bytes  # refused as it is; written
    assert exporter.export_records(items, span.resource).name == "SUCCESS"  # type: ignore[attr-defined]
    exporter.shutdown()
    got = {s["name"]: s["attributes"] for s in receiver.wait_for_spans(2)}
    assert got == {"odd": {"good": 1}, "fine": {"good": 2}}  # the exporter's encoder drops what it cannot write


def test_span_batches_are_gzipped_at_the_configured_level() -> None:
    data = b"spanmeter " * 1000
    for level, xfl in ((1, 4), (9, 2)):  # the gzip header's XFL byte: 4 fastest, 2 best
        exporter = otel_compat.otlp_span_exporter("http://127.0.0.1:9/v1/traces", 1.0, Compression.Gzip,
                                                  gzip_level=level)
        body = exporter._client._compress(data)  # type: ignore[attr-defined]
        assert body[:2] == b"\x1f\x8b" and body[8] == xfl
        assert zlib.decompress(body, wbits=31) == data
    shipped = otel_compat.otlp_span_exporter("http://127.0.0.1:9/v1/traces", 1.0, Compression.Gzip)
    assert shipped._client._compress(data)[8] == 2  # type: ignore[attr-defined]  # as shipped: 9


def test_records_only_where_nothing_else_reads_a_readable_span(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ReadableSpan stays where something reads one (a span exporter of the test's, a
    sampler other than the default, a value-length limit) or the export child is off."""
    endpoint = "http://127.0.0.1:9"

    def lean(**kw: Any) -> object:
        extra = kw.pop("extra", ())
        cfg = TelemetryConfig(otlp_endpoint=endpoint, export_timeout=0.1, metric_export_interval_ms=3_600_000, **kw)
        tel = setup_telemetry(cfg, environ={}, extra_exporters=extra)
        try:
            return type(tel.lean)
        finally:
            tel.shutdown()

    assert lean() is RecordTracer
    assert lean(span_records=False) is LeanTracer
    assert lean(export_process="off") is LeanTracer
    assert lean(extra=(InMemorySpanExporter(),)) is LeanTracer
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "traceidratio")
    assert lean() is LeanTracer
    monkeypatch.delenv("OTEL_TRACES_SAMPLER")
    monkeypatch.setenv("OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT", "12")
    assert lean() is LeanTracer


def test_the_switches_the_bench_measures_with() -> None:
    assert TelemetryConfig.from_env({}).span_records and TelemetryConfig.from_env({}).gzip_level == 1
    before = TelemetryConfig.from_env({"SPANMETER_SPAN_RECORDS": "off", "SPANMETER_OTLP_GZIP_LEVEL": "sdk"})
    assert not before.span_records and before.gzip_level is None
    assert TelemetryConfig.from_env({"SPANMETER_OTLP_GZIP_LEVEL": "6"}).gzip_level == 6
    assert TelemetryConfig.from_env({"SPANMETER_OTLP_GZIP_LEVEL": "11"}).gzip_level == 1  # warned, the default


class Counts:
    def __init__(self) -> None:
        self.seen: list[tuple[int, dict[str, str]]] = []

    def add(self, amount: int, attributes: Any) -> None:
        self.seen.append((amount, dict(attributes)))


def test_record_batches_are_counted_as_span_batches_are() -> None:
    batches: list[int] = []
    counts = Counts()

    def export(records: Any) -> bool:
        batches.append(len(records))
        return len(batches) != 2  # the second batch fails

    limits = QueueLimits(max_queue=12, max_queue_bytes=10_000, max_export_batch=5, schedule_delay_ms=60_000)
    batcher = RecordBatcher(export, limits, counts, "otlp")
    for _ in range(9):
        batcher.on_record(("small",), 100)
    batcher.on_record(("too big",), 9_500)  # past the bytes: dropped
    assert batcher.force_flush(10_000)
    assert batches == [5, 4]
    assert counts.seen == [(1, {"error.type": "queue_full", "spanmeter.exporter": "otlp"}),
                           (4, {"error.type": "export_failed", "spanmeter.exporter": "otlp"})]
    batcher.shutdown()
    batcher.on_record(("late",), 1)
    assert counts.seen[-1] == (1, {"error.type": "queue_full", "spanmeter.exporter": "otlp"})


def test_a_client_without_its_compress_keeps_the_exporters_gzip(monkeypatch: pytest.MonkeyPatch,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    shipped = otel_compat.otlp_span_exporter("http://127.0.0.1:9/v1/traces", 1.0, Compression.Gzip)
    client_class = type(shipped._client)  # type: ignore[attr-defined]
    monkeypatch.delattr(client_class, "_compress")
    monkeypatch.setattr(otel_compat, "_warned", set())
    exporter = otel_compat.otlp_span_exporter("http://127.0.0.1:9/v1/traces", 1.0, Compression.Gzip, gzip_level=1)
    assert exporter.wire  # type: ignore[attr-defined]  # still writes its own batches
    assert "_compress" not in exporter._client.__dict__  # type: ignore[attr-defined]
    assert "OTLPSpanExporter._client._compress moved" in caplog.text
