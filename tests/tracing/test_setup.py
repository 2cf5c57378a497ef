"""Config from the standard env vars, run ids, private providers (traceparent: test_traceparent.py)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from proxy.errors import Unauthorized
from proxy.model import Call, Caller, CallRecord, Outcome, ToolRecord
from tests.tracing.refusals import refuse
from tracing import spans
from tracing.local import read_spans
from tracing.setup import TelemetryConfig, capture_mode, setup_telemetry


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        pytest.param({}, {"capture_content": "NO_CONTENT", "semconv_latest": False, "service_name": "spanmeter"},
                     id="defaults: no content, v1.41.1 names"),
        pytest.param({"OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT": "SPAN_ONLY"},
                     {"capture_content": "SPAN_ONLY"}, id="SPAN_ONLY"),
        pytest.param({"OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT": "span_and_event"},
                     {"capture_content": "SPAN_ONLY"}, id="SPAN_AND_EVENT records on spans"),
        pytest.param({"OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT": "EVENT_ONLY"},
                     {"capture_content": "NO_CONTENT"}, id="EVENT_ONLY puts nothing on spans"),
        pytest.param({"OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT": "true"},
                     {"capture_content": "SPAN_ONLY"}, id="legacy true"),
        pytest.param({"OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT": "bogus"},
                     {"capture_content": "NO_CONTENT"}, id="unknown value: no content"),
        pytest.param({"OTEL_SEMCONV_STABILITY_OPT_IN": "http, gen_ai_latest_experimental"},
                     {"semconv_latest": True}, id="opt-in in a comma list"),
        pytest.param({"OTEL_SERVICE_NAME": "proxy-eu"}, {"service_name": "proxy-eu"}, id="service name"),
        pytest.param({"OTEL_METRIC_EXPORT_INTERVAL": "250", "OTEL_METRIC_EXPORT_TIMEOUT": "900"},
                     {"metric_export_interval_ms": 250, "metric_export_timeout_ms": 900}, id="metric push interval"),
        pytest.param({"OTEL_EXPORTER_OTLP_TIMEOUT": "2.5", "OTEL_EXPORTER_OTLP_METRICS_TIMEOUT": "7"},
                     {"export_timeout": 2.5, "metrics_timeout": 7.0}, id="timeouts in seconds, as the SDK"),
        pytest.param({"OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "3", "OTEL_EXPORTER_OTLP_TIMEOUT": "9"},
                     {"export_timeout": 3.0, "metrics_timeout": 9.0}, id="a signal's own timeout wins"),
        pytest.param({"OTEL_BSP_MAX_QUEUE_SIZE": "100", "OTEL_BSP_SCHEDULE_DELAY": "50",
                      "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "10"},
                     {"max_queue": 100, "schedule_delay_ms": 50, "max_export_batch": 10}, id="span queue"),
        pytest.param({"OTEL_METRIC_EXPORT_INTERVAL": "soon", "OTEL_BSP_MAX_QUEUE_SIZE": "-3"},
                     {"metric_export_interval_ms": 60_000, "max_queue": 16384}, id="not numbers: defaults"),
    ],
)  # fmt: skip
def test_config_from_env(env: dict[str, str], expected: dict[str, Any]) -> None:
    cfg = TelemetryConfig.from_env(env)
    assert {k: getattr(cfg, k) for k in expected} == expected


def test_config_overrides_win_over_env() -> None:
    env = {"OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT": "SPAN_ONLY"}
    assert TelemetryConfig.from_env(env, capture_content="NO_CONTENT").capture_content == "NO_CONTENT"
    assert capture_mode(None) == "NO_CONTENT"


def test_run_trace_round_trips_through_its_stored_form() -> None:
    parent = spans.TraceParent(1, 2, False)
    for run in (spans.new_run_trace(), spans.new_run_trace(parent, start_ns=5)):
        assert spans.RunTrace.decode(run.encode()) == run
    joined = spans.new_run_trace(parent)
    assert (joined.trace_id, joined.parent_span_id, joined.sampled) == (1, 2, False)


def test_two_telemetries_side_by_side_share_nothing(tmp_path: Path) -> None:
    mem_a, mem_b = InMemorySpanExporter(), InMemorySpanExporter()
    a = setup_telemetry(TelemetryConfig(local_dir=str(tmp_path / "a")), extra_exporters=(mem_a,), environ={})
    b = setup_telemetry(TelemetryConfig(local_dir=str(tmp_path / "b")), extra_exporters=(mem_b,), environ={})
    try:
        call = Call(api="chat", operation="chat", model="m")
        cs = spans.start_call(a, Caller("t", "r", "header"), call, spans.Peer("p", "h", 1))  # fmt: skip
        spans.end_call(a, cs, CallRecord(cs.caller, call, Outcome(status=200), cs.start_ns, cost_micros=7,
                                         usage_source="reported",
                       budget_remaining_micros=None, rewrites=[], repairs=[]))  # fmt: skip
        assert [s.name for s in mem_a.get_finished_spans()] == ["chat m"]
        assert mem_b.get_finished_spans() == ()
        assert b"spanmeter_cost_total" in a.metrics_text()
        assert b"spanmeter_cost_total" not in b.metrics_text()
    finally:
        a.shutdown()
        b.shutdown()


def test_budget_gauges_report_what_the_proxy_pushed(tmp_path: Path) -> None:
    tel = setup_telemetry(TelemetryConfig(local_dir=str(tmp_path)), environ={})
    try:
        tel.set_budget("acme", "day", 1_500_000, 10_000_000)
        tel.set_budget("acme", "month", 2_000_000, None)
        tel.set_budget("acme", "day", 2_500_000, 10_000_000)
        text = tel.metrics_text().decode()
        assert 'spanmeter_budget_spent_usd{otel_scope_name="spanmeter"' in text
        lines = [line for line in text.splitlines() if line.startswith("spanmeter_budget_")]
        spent_day = [line for line in lines if "spent" in line and 'window="day"' in line]
        assert [line.rsplit(" ", 1)[1] for line in spent_day] == ["2.5"]
        assert not [line for line in lines if "limit" in line and 'window="month"' in line]
    finally:
        tel.shutdown()


def test_telemetry_failures_never_raise(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    tel = setup_telemetry(TelemetryConfig(local_dir=str(tmp_path)), environ={})
    tel.shutdown()
    caller, call = Caller("t", "r", "header"), Call(api="chat", operation="chat", model="m")
    # After shutdown and with nonsense inputs, each call returns quietly and logs what failed.
    with caplog.at_level(logging.ERROR, logger="tracing.spans"):
        cs = spans.start_call(tel, caller, call, spans.Peer("p", "h", 1))  # fmt: skip
        spans.end_call(tel, cs, CallRecord(cs.caller, call, None, cs.start_ns, cost_micros=None, usage_source="",
                                           budget_remaining_micros=None,  # type: ignore[arg-type]
                       rewrites=[], repairs=[]))  # fmt: skip
        spans.end_run(tel, caller, None, {}, "ok")  # type: ignore[arg-type]
        spans.tool_span(tel, ToolRecord(caller, "t", "c", None, None, 1, 2))  # type: ignore[arg-type]
    assert isinstance(cs, spans.CallSpan)  # usable by end_call, even after shutdown
    failures = [(r.getMessage(), r.exc_info is not None) for r in caplog.records]
    assert failures == [("end_call failed", True), ("end_run failed", True), ("tool_span failed", True)]
    assert not list(read_spans(tmp_path))  # nothing half-written after shutdown


@pytest.mark.parametrize(
    "secret",
    [
        "sm-Xk3v9QhZ2m_Tq8Yb4LdR7sWc1PfN6gJu0aEo5iKt",
        "sk-proj-abcdEFGH1234ijkl5678",
        "AIzaSyA1b2C3d4E5f6G7h8I9j0KlMnOpQrStU",
    ],
    ids=["spanmeter key", "openai key", "google key"],
)
def test_keys_in_messages_are_redacted_from_spans(secret: str, tmp_path: Path) -> None:
    mem = InMemorySpanExporter()
    tel = setup_telemetry(TelemetryConfig(local_dir=str(tmp_path)), extra_exporters=(mem,), environ={})
    try:
        call = Call(api="chat", operation="chat", model="m")
        refuse(tel, Caller("t", "r", "header"), call, Unauthorized(f"bad key {secret}."))
        [span] = mem.get_finished_spans()
        assert span.status.description == "bad key [redacted]."
        assert secret not in repr(dict(span.attributes or {}))
    finally:
        tel.shutdown()


def test_the_metric_push_interval_comes_from_otel_metric_export_interval(otlp_receiver: Any) -> None:
    """Pushes arrive at the standard variable's interval, not the 60 s default."""
    cfg = TelemetryConfig.from_env({"OTEL_METRIC_EXPORT_INTERVAL": "100"}, otlp_endpoint=otlp_receiver.endpoint,
                                   push_metrics=True, local_dir=None, export_process="off")
    tel = setup_telemetry(cfg, environ={})
    try:
        tel.set_budget("acme", "day", 1_000, 2_000_000)  # something to push
        assert len(otlp_receiver.wait_for_metrics(2, timeout=15)) >= 2
    finally:
        tel.shutdown()
