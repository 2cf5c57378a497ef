"""The SDK internals the lean span path reads (tracing/otel_compat.py): probed when the
telemetry is set up, a moved one logged once and the public path taken; and both paths put
the same spans on the wire, received by a real OTLP/HTTP receiver.
"""

from __future__ import annotations

import importlib.metadata
import logging
import random
from collections.abc import Iterator
from typing import Any

import pytest

from tests.fixtures.otlp import OtlpReceiver
from tests.tracing.test_lean_spans import SCENARIOS, Scenario, Seen, refused_call
from tracing import otel_compat
from tracing.lean import LeanTracer, SdkSpans, spans_for
from tracing.setup import Telemetry, TelemetryConfig, setup_telemetry


@pytest.fixture
def tel(otlp_receiver: OtlpReceiver) -> Iterator[Telemetry]:
    made = setup_telemetry(TelemetryConfig(otlp_endpoint=otlp_receiver.endpoint, capture_content="SPAN_ONLY",
                                           export_process="off", compression="none"), environ={})
    yield made
    made.shutdown()


def _received(tel: Telemetry, receiver: OtlpReceiver, scenario: Scenario, path: Any) -> list[dict[str, Any]]:
    before = len(receiver.spans())
    tel.lean = path
    random.seed(20261201)  # the same ids on both paths: the tracer's RandomIdGenerator draws them
    scenario(tel, Seen())
    assert tel.force_flush()
    got = receiver.spans()[before:]
    if scenario is refused_call:
        for span in got:  # ended at "now" on either path
            span.pop("end_ns")
    return got


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.__name__ for s in SCENARIOS])
def test_both_paths_deliver_the_same_spans_over_otlp(tel: Telemetry, otlp_receiver: OtlpReceiver,
                                                     scenario: Scenario) -> None:
    lean = tel.lean
    assert isinstance(lean, LeanTracer)
    public = _received(tel, otlp_receiver, scenario, SdkSpans(tel.tracer))
    bypass = _received(tel, otlp_receiver, scenario, lean)
    assert bypass == public
    expected = {"unsampled_parent": 0, "tool_spans": 3, "mcp_requests": 2, "run_roots": 4}
    assert len(public) == expected.get(scenario.__name__, 1)


def test_the_setting_takes_the_public_path(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(otel_compat.ENV, "off")
    with caplog.at_level(logging.WARNING):
        made = setup_telemetry(TelemetryConfig(), span_exporters=[], environ={})
    try:
        assert isinstance(made.lean, SdkSpans)
        assert not [r for r in caplog.records if r.name == otel_compat.__name__]  # chosen, not a surprise
    finally:
        made.shutdown()


def test_a_moved_internal_is_said_once_and_the_public_path_taken(otlp_receiver: OtlpReceiver,
                                                                  caplog: pytest.LogCaptureFixture,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from opentelemetry.sdk import trace as sdk_trace

    # As a release that renamed it would leave the SDK (whose own spans here carry no links).
    monkeypatch.delattr(sdk_trace, "_is_valid_link")
    with caplog.at_level(logging.WARNING):
        made = setup_telemetry(TelemetryConfig(otlp_endpoint=otlp_receiver.endpoint, export_process="off",
                                               compression="none"), environ={})
        paths = [made.lean, *(spans_for(made.tracer) for _ in range(3))]
    try:
        assert all(isinstance(p, SdkSpans) for p in paths)
        said = [r.getMessage() for r in caplog.records if r.name == otel_compat.__name__]
        assert len(said) == 1, said  # once a process
        assert "opentelemetry.sdk.trace._is_valid_link" in said[0]
        assert f"opentelemetry-sdk {importlib.metadata.version('opentelemetry-sdk')}" in said[0]
        # The public path still delivers the span.
        made.lean = paths[0]
        SCENARIOS[0](made, Seen())
        assert made.force_flush()
        assert [s["name"] for s in otlp_receiver.spans()] == ["chat gpt-4o"]
    finally:
        made.shutdown()


def test_the_probe_finds_nothing_moved_in_the_installed_sdk(tel: Telemetry) -> None:
    from opentelemetry.sdk.trace import Tracer as SdkTracer

    assert isinstance(tel.tracer, SdkTracer)
    assert otel_compat.moved(tel.tracer) == []
