"""`prometheus_series()` against what the real Prometheus exporter writes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from proxy.anatomy import anatomy
from proxy.errors import CeilingReached
from proxy.model import (
    Call,
    Caller,
    CallRecord,
    Flushed,
    Outcome,
    Repair,
    Rewrite,
    ToolCall,
    ToolRecord,
    Usage,
)
from tests.tracing.refusals import refuse
from tracing import anatomy as anatomy_attrs
from tracing import attributes as A
from tracing import mcp, spans
from tracing.setup import Telemetry, TelemetryConfig, setup_telemetry

CALLER = Caller("acme", "run_p", "header")


def exercise(tel: Telemetry) -> None:
    """Record every metric at least once."""
    call = Call(api="chat", operation="chat", model="gpt-4o", stream=True)
    where = spans.Peer("openai", "api.openai.com", 443)
    cs = spans.start_call(tel, CALLER, call, where)
    outcome = Outcome(status=200, usage=Usage(10, 5, cache_read_tokens=4, cache_write_tokens=2), first_chunk_s=0.2)
    spans.end_call(tel, cs, CallRecord(cs.caller, call, outcome, cs.start_ns, cost_micros=5, usage_source="reported",
                   budget_remaining_micros=None, rewrites=[Rewrite("include_usage")],
                   repairs=[Repair("output", ("fence",))], chunk_gaps_s=[0.01], saved_micros=3,
                   premium_micros=2))  # fmt: skip
    parts = [("tools", 5, "t", ""), ("tools", 5, "u", ""), ("tool_result", 9, "t", "c")]
    an = anatomy(parts, Usage(10, 5), None)
    cs = spans.start_call(tel, CALLER, call, where)
    spans.end_call(tel, cs, CallRecord(CALLER, call, outcome, cs.start_ns, cost_micros=5, usage_source="reported",
                                       anatomy=an))
    assert an is not None
    costly = an.__class__(an.kinds_of_units, an.tokens, an.cached, [1, 1, 1], an.input_tokens, 3,
                          {**an.kinds, "tools": (4, 0, 2)}, an.top, an.definitions)
    spans.record_flushed(tel, CALLER.tenant, Flushed([("t", 1)], [], [(("openai", "gpt-4o"), "tools", 4, 0, 2)]))
    totals = {**anatomy_attrs.call_totals(costly, [ToolCall("x", "t", "{}")]),
              **anatomy_attrs.flush_totals(Flushed([], [], [((), "tools", 4, 0, 2)]))}
    spans.end_run(tel, CALLER, spans.new_run_trace(), totals, "ended")
    refuse(tel, CALLER, call, CeilingReached("too many calls", limit="run_calls"))
    spans.tool_span(tel, ToolRecord(CALLER, "t", "c", "{}", "ok", 1, 2, is_error=False))  # fmt: skip
    spans.record_guard_action(tel, CALLER, "remind", tool_name="t", repeats=3)
    spans.record_ledger_overshoot(tel, CALLER, 12)
    request = mcp.McpRequest(server="weather", method="tools/call", request_id="1", server_address="127.0.0.1",
                             server_port=8000, tool="get_weather", arguments="{}")
    mcp.record_request(tel, mcp.McpRecord(CALLER, request, mcp.McpOutcome(status=200, result="{}"), 1, 2))
    spans.record_wrap_up(tel, CALLER, "calls", cs=cs)
    spans.end_run(tel, CALLER, spans.new_run_trace(), {"wrap_up_notices": 1, "answers_after_notice": 1}, "ended")
    tel.instruments.dropped_spans.add(1, {A.ERROR_TYPE: "queue_full"})
    tel.set_budget("acme", "day", 1_000, 2_000)


@pytest.fixture(params=[False, True], ids=["semconv v1.41.1", "gen_ai_latest_experimental"])
def tel(request: pytest.FixtureRequest, tmp_path: object) -> Iterator[Telemetry]:
    t = setup_telemetry(TelemetryConfig(local_dir=str(tmp_path), semconv_latest=request.param), environ={})
    yield t
    t.shutdown()


def test_every_metric_appears_under_the_names_prometheus_series_gives(tel: Telemetry) -> None:
    exercise(tel)
    samples = {s.name for family in text_string_to_metric_families(tel.metrics_text().decode()) for s in family.samples}
    latest = {A.LATEST_GEN_AI_CLIENT_INFERENCE_DURATION, A.LATEST_GEN_AI_CLIENT_TIME_TO_FIRST_CHUNK,
              A.LATEST_GEN_AI_CLIENT_TIME_PER_OUTPUT_CHUNK}  # fmt: skip
    replaced = {A.GEN_AI_CLIENT_OPERATION_DURATION, A.GEN_AI_CLIENT_TIME_TO_FIRST_CHUNK,
                A.GEN_AI_CLIENT_TIME_PER_OUTPUT_CHUNK}  # fmt: skip
    emitted = replaced if not tel.config.semconv_latest else latest
    assert samples - A.all_prometheus_series() == {"target_info"}
    for spec in A.METRICS:
        series = set(A.prometheus_series(spec.name))
        if spec.name in (latest | replaced) - emitted:
            assert not series & samples, spec.name
        else:
            assert series <= samples, (spec.name, sorted(series - samples))


def test_known_names_match_the_reference_note() -> None:
    assert A.prometheus_series(A.GEN_AI_CLIENT_OPERATION_DURATION)[:3] == (
        "gen_ai_client_operation_duration_seconds_bucket",
        "gen_ai_client_operation_duration_seconds_sum",
        "gen_ai_client_operation_duration_seconds_count",
    )
    assert A.prometheus_series(A.GEN_AI_CLIENT_TOKEN_USAGE)[0] == "gen_ai_client_token_usage_bucket"
    assert A.prometheus_series(A.SPANMETER_COST)[0] == "spanmeter_cost_total"
    assert A.prometheus_series(A.SPANMETER_BUDGET_SPENT_USD) == ("spanmeter_budget_spent_usd",)
    assert A.prometheus_label(A.GEN_AI_TOKEN_TYPE) == "gen_ai_token_type"
    assert "spanmeter_telemetry_dropped_spans_total" in A.all_prometheus_series()
    assert A.prometheus_series(A.SPANMETER_CACHE_INPUT_TOKENS) == ("spanmeter_cache_input_tokens_total",)
    assert A.prometheus_series(A.SPANMETER_COST_SAVED) == ("spanmeter_cost_saved_total",)
    assert A.prometheus_label(A.SPANMETER_CACHE_OPERATION) == "spanmeter_cache_operation"


def test_histograms_use_the_spec_bucket_boundaries(tel: Telemetry) -> None:
    exercise(tel)
    text = tel.metrics_text().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    duration = A.prometheus_base_name(
        A.LATEST_GEN_AI_CLIENT_INFERENCE_DURATION if tel.config.semconv_latest
        else A.GEN_AI_CLIENT_OPERATION_DURATION
    )  # fmt: skip
    mcp_duration = A.prometheus_base_name(A.MCP_CLIENT_OPERATION_DURATION)
    for name, buckets in ((duration, A.DURATION_BUCKETS), ("gen_ai_client_token_usage", A.TOKEN_BUCKETS),
                          (mcp_duration, A.MCP_DURATION_BUCKETS)):
        les = sorted({float(s.labels["le"]) for s in families[name].samples if "le" in s.labels})
        assert les == [*map(float, buckets), float("inf")]
