"""A collector that is down or hangs never blocks or fails a call; lost spans are counted."""

from __future__ import annotations

import re
from typing import Any

from proxy.model import Call, Caller, CallRecord, Outcome, Usage
from tests.fixtures.otlp import OtlpReceiver, closed_endpoint
from tracing import spans
from tracing.setup import Telemetry, TelemetryConfig, setup_telemetry

CALLER = Caller("acme", "run_down", "header")
CALL = Call(api="chat", operation="chat", model="gpt-4o")


def one_call(tel: Telemetry) -> None:
    cs = spans.start_call(tel, CALLER, CALL, spans.Peer("openai", "api.openai.com", 443))
    spans.end_call(
        tel, cs, CallRecord(cs.caller, CALL, Outcome(status=200, usage=Usage(3, 4)), cs.start_ns,
        cost_micros=10,
        usage_source="reported",
        budget_remaining_micros=None,
        rewrites=[],
        repairs=[]))


def dropped(tel: Telemetry, reason: str) -> float:
    text = tel.metrics_text().decode()
    pattern = rf'^spanmeter_telemetry_dropped_spans_total\{{[^}}]*error_type="{reason}"[^}}]*\}} (\S+)$'
    return sum(float(m) for m in re.findall(pattern, text, re.MULTILINE))


def test_a_hanging_collector_never_holds_up_calls_and_drops_are_counted(
    otlp_receiver: OtlpReceiver,
) -> None:
    otlp_receiver.hold()
    cfg = TelemetryConfig(
        otlp_endpoint=otlp_receiver.endpoint,
        max_queue=4,
        max_export_batch=1,
        schedule_delay_ms=10,
        export_timeout=60,  # the exporter would wait a minute: calls must not
        metric_export_interval_ms=3_600_000,
        export_process="off",  # the in-process queue alone; the child's: test_export_process.py
    )
    tel = setup_telemetry(cfg, environ={})
    try:
        one_call(tel)
        assert otlp_receiver.arrived.wait(10), "the exporter never reached the collector"
        # The export thread is now stuck inside a request the collector does not answer.
        for _ in range(50):
            one_call(tel)
        assert otlp_receiver.requests == 1  # all 50 calls returned while that export hung
        assert dropped(tel, "queue_full") == 50 - cfg.max_queue
    finally:
        otlp_receiver.release()
        tel.shutdown()
    assert len(otlp_receiver.spans()) == 1 + cfg.max_queue


def test_a_collector_that_is_down_fails_exports_and_counts_them() -> None:
    cfg = TelemetryConfig(
        otlp_endpoint=closed_endpoint(),
        export_timeout=0.5,
        schedule_delay_ms=3_600_000,  # export only when flushed, so the count is exact
        metric_export_interval_ms=3_600_000,
    )
    tel = setup_telemetry(cfg, environ={})
    try:
        for _ in range(5):
            one_call(tel)
        tel.force_flush()
        assert dropped(tel, "export_failed") == 5
        assert dropped(tel, "queue_full") == 0
    finally:
        tel.shutdown()


def test_the_export_queue_is_bounded_by_bytes_too() -> None:
    """Spans with captured 40 kB prompts against a collector that does not answer: the
    queue holds at most max_queue_bytes of them, far fewer than max_queue, and every span
    past that is counted as dropped."""
    import threading

    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    release = threading.Event()

    class Stuck(SpanExporter):  # a collector that hangs
        def export(self, spans: Any) -> SpanExportResult:
            release.wait(30)
            return SpanExportResult.SUCCESS

        def shutdown(self) -> None:
            release.set()

    cfg = TelemetryConfig(max_queue=16384, max_queue_bytes=1 << 20, schedule_delay_ms=10, max_export_batch=1,
                          metric_export_interval_ms=3_600_000)
    tel = setup_telemetry(cfg, environ={}, span_exporters=[("otlp", Stuck())])
    prompt = "x" * 40_000
    try:
        for i in range(100):
            tel.tracer.start_span(f"big-{i}", attributes={"gen_ai.input.messages": prompt}).end()
        # 1 MiB holds ~26 spans of ~40 kB (one more may be in the stuck export).
        assert 100 - 28 <= dropped(tel, "queue_full") <= 100 - 24
    finally:
        release.set()
        tel.shutdown()
