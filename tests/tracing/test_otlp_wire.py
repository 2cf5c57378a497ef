"""tracing/otlp_wire.py against the OTLP exporter's own encoder, byte for byte; and the
exporter that uses it (tracing/otel_compat.py) against the exporter as shipped, over
real OTLP/HTTP to a receiver.

The reference is what `OTLPSpanExporter.export` sends: `encode_spans(spans)
.SerializePartialToString()` from opentelemetry-exporter-otlp-proto-common."""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans as reference
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.trace.export import SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState

from tests.fixtures.otlp import OtlpReceiver, closed_endpoint
from tests.tracing.test_lean_spans import SCENARIOS, Seen
from tracing import otel_compat, otlp_wire
from tracing.setup import TelemetryConfig, setup_telemetry

T0 = 1_700_000_000_000_000_000
CTX = SpanContext(0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331, is_remote=False,
                  trace_flags=TraceFlags(TraceFlags.SAMPLED))
REMOTE = SpanContext(0x0AF7651916CD43DD8448EB211C80319C, 0x00F067AA0BA902B7, is_remote=True,
                     trace_flags=TraceFlags(TraceFlags.SAMPLED), trace_state=TraceState([("vendor", "a"), ("k", "v")]))
RESOURCE = Resource({"service.name": "spanmeter", "service.instance.id": "i-1", "process.pid": 4242})
SCOPE = InstrumentationScope("spanmeter", "0.9.0", "https://opentelemetry.io/schemas/1.37.0")


def _span(attributes: dict[str, Any] | None = None, **kw: Any) -> ReadableSpan:
    fields: dict[str, Any] = {"name": "chat gpt-4o", "context": CTX, "kind": SpanKind.CLIENT,
                              "attributes": attributes if attributes is not None else {"gen_ai.system": "openai"},
                              "start_time": T0, "end_time": T0 + 5_000_000, "resource": RESOURCE,
                              "instrumentation_scope": SCOPE}
    fields.update(kw)
    return ReadableSpan(**fields)


def _same(spans: list[ReadableSpan]) -> None:
    assert otlp_wire.encode_spans(spans) == reference(spans).SerializePartialToString()


# Every value shape an attribute can hold, at the edges of its encoding.
VALUES: list[Any] = [
    "", "openai", "é" * 70, "日本語 🙂", "x" * 300, True, False, 0, 1, 127, 128, 300, -1, -(1 << 63), (1 << 63) - 1,
    0.0, -0.0, 1.5, -2.25e-308, math.inf, -math.inf, 1e308, b"", b"\x00\xff", (), ("END", "STOP"), (1, 2, -3),
    (0.5, 2.0), (True, False), [b"a", b"b"],
]


@pytest.mark.parametrize("value", VALUES, ids=[repr(v)[:30] for v in VALUES])
def test_each_value_shape_is_written_as_the_exporter_writes_it(value: Any) -> None:
    _same([_span({"k": value, "a.longer.key.with.dots": "v"})])


def test_span_fields_at_their_edges() -> None:
    _same([
        _span(),
        _span(parent=REMOTE, context=SpanContext(CTX.trace_id, CTX.span_id, False, trace_state=REMOTE.trace_state)),
        _span(parent=SpanContext(CTX.trace_id, 0x1, is_remote=False), kind=SpanKind.INTERNAL, name=""),
        _span({}, kind=SpanKind.SERVER, start_time=0, end_time=None, status=Status(StatusCode.ERROR, "boom")),
        _span(kind=SpanKind.PRODUCER, status=Status(StatusCode.OK)),
        _span(kind=SpanKind.CONSUMER, status=Status(StatusCode.ERROR)),
        _span(context=SpanContext(CTX.trace_id, CTX.span_id, False, trace_state=TraceState())),
        _span(events=[Event("gen_ai.choice", {"index": 0, "finish_reason": "stop"}, timestamp=T0 + 1),
                      Event("", None, timestamp=T0 + 2)],
              links=[Link(REMOTE, {"link.kind": "tool_call"}), Link(CTX)]),
        _span({"k": "v"}, resource=Resource({}), instrumentation_scope=None),
    ])


def test_batches_are_grouped_by_resource_then_scope_in_first_seen_order() -> None:
    other_resource = Resource({"service.name": "other"}, schema_url="https://example.com/r")
    equal_resource = Resource(dict(RESOURCE.attributes))  # another object, equal: merged with RESOURCE
    other_scope = InstrumentationScope("tracing.mcp", None, None, {"scope.attr": "x"})
    spans = [_span(name="a"), _span(name="b", resource=other_resource),
             _span(name="c", instrumentation_scope=other_scope), _span(name="d", resource=equal_resource),
             _span(name="e", resource=other_resource, instrumentation_scope=None), _span(name="f")]
    _same(spans)
    _same([])


def test_the_proxys_own_spans_are_written_as_the_exporter_writes_them() -> None:
    """Every span the lean-path scenarios make (calls, streams, refusals, tools, MCP, runs)."""
    memory = InMemorySpanExporter()
    tel = setup_telemetry(TelemetryConfig(capture_content="SPAN_ONLY"), span_exporters=[], environ={},
                          extra_exporters=(memory,))
    try:
        random.seed(20261202)
        for scenario in SCENARIOS:
            scenario(tel, Seen())
        assert tel.force_flush()
        spans = list(memory.get_finished_spans())
    finally:
        tel.shutdown()
    assert len(spans) >= 13
    _same(spans)
    for span in spans:
        _same([span])


def test_attributes_that_come_again_are_written_as_the_first_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Short strings and ints are kept per key once written; a key past the values kept
    per key (ids, counts) is written plainly from then on. Each encoding, first or kept,
    is the exporter's."""
    monkeypatch.setattr(otlp_wire, "_PAIRS", {})  # as a fresh process has them
    monkeypatch.setattr(otlp_wire, "_VARIED", set())
    many = otlp_wire._VALUES_PER_KEY + 5
    spans = [_span({"test.model": "gpt-4o", "test.tokens": i, "test.id": f"call-{i}",
                    "test.flag": i % 2 == 0, "test.long": "x" * 200 + str(i % 3), "test.port": 443})
             for i in range(many)]
    for _ in range(2):
        _same(spans)
        for span in spans:
            _same([span])
    assert "test.id" in otlp_wire._VARIED and "test.tokens" in otlp_wire._VARIED
    assert otlp_wire._PAIRS["test.model"] == {"gpt-4o": otlp_wire._span_attributes({"test.model": "gpt-4o"})[0]}
    assert set(otlp_wire._PAIRS["test.port"]) == {443}
    assert "test.long" not in otlp_wire._PAIRS and "test.flag" not in otlp_wire._PAIRS  # too long; bools are not kept
    with pytest.raises(otlp_wire.NotEncodable):  # a value it refuses is refused every time, never kept
        otlp_wire.encode_spans([_span({"test.model": "\ud800"})])
    with pytest.raises(otlp_wire.NotEncodable):
        otlp_wire.encode_spans([_span({"test.model": "\ud800"})])
    with pytest.raises(otlp_wire.NotEncodable):
        otlp_wire.encode_spans([_span({"test.port": 1 << 63})])


def test_past_the_keys_kept_attributes_are_written_plainly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(otlp_wire, "_PAIRS", {})
    monkeypatch.setattr(otlp_wire, "_KEYS_MAX", 2)
    spans = [_span({"a": "x", "b": 1, "c": "y", "d": 2}) for _ in range(3)]
    _same(spans)
    assert list(otlp_wire._PAIRS) == ["a", "b"]


_scalars = st.one_of(st.text(max_size=200), st.booleans(), st.integers(-(1 << 63), (1 << 63) - 1),
                     st.floats(allow_nan=False), st.binary(max_size=40))
_values = st.one_of(_scalars, st.lists(st.text(max_size=20), max_size=4).map(tuple),
                    st.lists(st.integers(-(1 << 63), (1 << 63) - 1), max_size=4).map(tuple),
                    st.lists(st.floats(allow_nan=False), max_size=3).map(tuple))


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.text(max_size=30), _values, max_size=12), st.text(max_size=40),
       st.integers(0, (1 << 64) - 1), st.sampled_from(list(SpanKind)))
def test_any_attributes_are_written_as_the_exporter_writes_them(attributes: dict[str, Any], name: str, start: int,
                                                                kind: SpanKind) -> None:
    try:
        _same([_span(attributes, name=name, start_time=start, kind=kind)])
    except otlp_wire.NotEncodable:
        # Only text that is not UTF-8 (lone surrogates) is refused among these values.
        assert any(_not_utf8(k) or (isinstance(v, str) and _not_utf8(v)) or
                   (isinstance(v, tuple) and any(isinstance(x, str) and _not_utf8(x) for x in v))
                   for k, v in attributes.items()) or _not_utf8(name)


def _not_utf8(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return True
    return False


@pytest.mark.parametrize("value", [None, {"a": 1}, 1 << 63, -(1 << 63) - 1, "\ud800", ("ok", "\udfff"), object()],
                         ids=["none", "mapping", "past-int64", "under-int64", "lone-surrogate", "in-a-tuple", "object"])
def test_what_it_does_not_write_it_refuses(value: Any) -> None:
    with pytest.raises(otlp_wire.NotEncodable):
        otlp_wire.encode_spans([_span({"k": value})])


# --- the exporter ------------------------------------------------------------------------


@pytest.fixture
def exporters(otlp_receiver: OtlpReceiver) -> Iterator[tuple[Any, OTLPSpanExporter]]:
    wire = otel_compat.otlp_span_exporter(otlp_receiver.endpoint + "/v1/traces", 5.0, Compression.Gzip, environ={})
    shipped = OTLPSpanExporter(endpoint=otlp_receiver.endpoint + "/v1/traces", timeout=5.0,
                               compression=Compression.Gzip)
    yield wire, shipped
    wire.shutdown()
    shipped.shutdown()


def test_the_installed_exporter_is_as_the_wire_path_expects(exporters: tuple[Any, OTLPSpanExporter]) -> None:
    wire, _ = exporters
    assert otel_compat.exporter_moved(wire) == []
    assert wire.wire is True


def _delivered(receiver: OtlpReceiver, exporter: Any, spans: list[ReadableSpan]) -> tuple[Any, list[dict[str, Any]]]:
    before = len(receiver.spans())
    result = exporter.export(spans)
    return result, receiver.spans()[before:]


@pytest.mark.parametrize("batch", ["calls", "refused", "too large"])
def test_the_wire_exporter_delivers_what_the_shipped_one_delivers(exporters: tuple[Any, OTLPSpanExporter],
                                                                  otlp_receiver: OtlpReceiver, batch: str,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    wire, shipped = exporters
    spans = [_span({"i": i, "gen_ai.system": "openai"}, name=f"chat {i}") for i in range(5)]
    if batch == "refused":  # the exporter's encoder drops the attribute and logs; so the wire path does
        spans.append(_span({"bad": "\ud800", "good": 1}, name="with a lone surrogate"))
    if batch == "too large":
        wire._max_request_size = shipped._max_request_size = 64
    with caplog.at_level(logging.WARNING):
        expected = _delivered(otlp_receiver, shipped, spans)
        said = [r.getMessage() for r in caplog.records]
        caplog.clear()
        got = _delivered(otlp_receiver, wire, spans)
    assert got == expected
    assert [r.getMessage() for r in caplog.records] == said
    if batch == "too large":
        assert got == (SpanExportResult.FAILURE, [])
    else:
        assert got[0] is SpanExportResult.SUCCESS and [s["name"] for s in got[1]] == [s.name for s in spans]


def test_a_collector_that_is_down_fails_the_batch_as_shipped() -> None:
    wire = otel_compat.otlp_span_exporter(closed_endpoint() + "/v1/traces", 0.5, Compression.NoCompression,
                                          environ={})
    try:
        assert wire.export([_span()]) is SpanExportResult.FAILURE
    finally:
        wire.shutdown()


def test_the_setting_and_a_moved_internal_give_the_exporter_as_shipped(caplog: pytest.LogCaptureFixture,
                                                                       otlp_receiver: OtlpReceiver,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    plain = otel_compat.otlp_span_exporter(otlp_receiver.endpoint, 1.0, Compression.NoCompression,
                                           environ={otel_compat.ENV: "off"})
    assert type(plain) is OTLPSpanExporter
    plain.shutdown()

    shipped_init = OTLPSpanExporter.__init__

    def renamed(self: Any, *args: Any, **kw: Any) -> None:  # as a release that renamed its client
        shipped_init(self, *args, **kw)
        self._http_client = self.__dict__.pop("_client")

    monkeypatch.setattr(OTLPSpanExporter, "__init__", renamed)
    with caplog.at_level(logging.WARNING):
        moved = otel_compat.otlp_span_exporter(otlp_receiver.endpoint, 1.0, Compression.NoCompression, environ={})
    monkeypatch.undo()
    assert moved.wire is False
    moved._client = moved._http_client
    moved.shutdown()
    said = [r.getMessage() for r in caplog.records if r.name == otel_compat.__name__]
    assert len(said) == 1 and "OTLPSpanExporter._client.export" in said[0], said
    assert "opentelemetry-exporter-otlp-proto-http" in said[0]


def test_a_span_the_writer_cannot_write_at_all_fails_as_the_shipped_exporter_fails(
        exporters: tuple[Any, OTLPSpanExporter], otlp_receiver: OtlpReceiver, caplog: pytest.LogCaptureFixture) -> None:
    wire, shipped = exporters
    spans = [_span(name="ok"), _span(name="id past 128 bits", context=SpanContext(1 << 130, 1, False))]
    with caplog.at_level(logging.ERROR):
        expected = _delivered(otlp_receiver, shipped, spans)
        said = [r.getMessage() for r in caplog.records]
        caplog.clear()
        got = _delivered(otlp_receiver, wire, spans)
    assert got == expected == (SpanExportResult.FAILURE, [])
    assert [r.getMessage() for r in caplog.records] == said and said
