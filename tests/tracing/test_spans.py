"""Spans through the real OTLP/HTTP exporter to a real receiver (opentelemetry-proto)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.errors import CeilingReached
from proxy.model import Call, Caller, CallRecord, Outcome, OutputSpec, Repair, Rewrite, ToolRecord, Usage
from tests.fixtures.otlp import OtlpReceiver
from tests.tracing.refusals import refuse
from tracing import attributes as A
from tracing import spans
from tracing.setup import Telemetry, TelemetryConfig, setup_telemetry

CALLER = Caller("acme", "run_01", "header", key_id="k1")
UPSTREAM_KEY = "sk-live-0123456789abcdefSECRET"


@pytest.fixture
def make_tel(otlp_receiver: OtlpReceiver) -> Iterator[Any]:
    made: list[Telemetry] = []

    def make(**overrides: Any) -> Telemetry:
        cfg = TelemetryConfig(otlp_endpoint=otlp_receiver.endpoint, schedule_delay_ms=50, **overrides)
        tel = setup_telemetry(cfg, environ={})
        made.append(tel)
        return tel

    yield make
    for tel in made:
        tel.shutdown()


def flushed(tel: Telemetry, receiver: OtlpReceiver) -> list[dict[str, Any]]:
    assert tel.force_flush()
    return receiver.spans()


def by_name(found: list[dict[str, Any]], name: str) -> dict[str, Any]:
    matches = [s for s in found if s["name"] == name]
    assert len(matches) == 1, [s["name"] for s in found]
    return matches[0]


DIALECTS = [
    pytest.param(
        Call(
            api="chat",
            operation="chat",
            openai_api_type="chat_completions",
            model="gpt-4o",
            stream=True,
            max_output_tokens=1024,
            temperature=0.2,
            output=OutputSpec(kind="json_schema"),
        ),
        "openai",
        "api.openai.com",
        "chat gpt-4o",
        {
            A.OPENAI_API_TYPE: "chat_completions",
            A.GEN_AI_REQUEST_STREAM: True,
            A.GEN_AI_REQUEST_MAX_TOKENS: 1024,
            A.GEN_AI_REQUEST_TEMPERATURE: 0.2,
            A.GEN_AI_OUTPUT_TYPE: "json",
            A.INPUT_VALUE: "0 characters of prompt text; asks for json",
        },
        id="openai chat completions, streaming, json output",
    ),
    pytest.param(
        Call(api="responses", operation="chat", openai_api_type="responses", model="gpt-4.1-mini", top_p=0.9, seed=7),
        "openai",
        "api.openai.com",
        "chat gpt-4.1-mini",
        {A.OPENAI_API_TYPE: "responses", A.GEN_AI_REQUEST_TOP_P: 0.9, A.GEN_AI_REQUEST_SEED: 7},
        id="openai responses",
    ),
    pytest.param(
        Call(
            api="messages",
            operation="chat",
            model="claude-sonnet-4-5",
            top_k=40.0,
            stop_sequences=("END",),
        ),
        "anthropic",
        "api.anthropic.com",
        "chat claude-sonnet-4-5",
        {A.GEN_AI_REQUEST_TOP_K: 40, A.GEN_AI_REQUEST_STOP_SEQUENCES: ["END"]},
        id="anthropic messages: top_k as an int, no openai.* attributes",
    ),
    pytest.param(
        Call(api="gemini", operation="generate_content", model="gemini-2.5-flash", choice_count=2),
        "gcp.gemini",
        "generativelanguage.googleapis.com",
        "generate_content gemini-2.5-flash",
        {A.GEN_AI_REQUEST_CHOICE_COUNT: 2},
        id="gemini generateContent",
    ),
    pytest.param(
        Call(api="embeddings", operation="embeddings", model="text-embedding-3-small"),
        "openai",
        "api.openai.com",
        "embeddings text-embedding-3-small",
        {},
        id="embeddings",
    ),
    pytest.param(
        Call(api="chat", operation="chat", model=None),
        "my_upstream",
        "llm.internal",
        "chat",
        {},
        id="no model: the span name is the operation",
    ),
]


@pytest.mark.parametrize(("call", "provider", "host", "name", "extra"), DIALECTS)
def test_model_call_span_for_each_dialect(
    make_tel: Any,
    otlp_receiver: OtlpReceiver,
    call: Call,
    provider: str,
    host: str,
    name: str,
    extra: dict[str, Any],
) -> None:
    tel = make_tel()
    run = spans.new_run_trace()
    cs = spans.start_call(tel, CALLER, call, spans.Peer(provider, host, 443), spans.Lineage(run_trace=run))
    outcome = Outcome(
        status=200,
        response_id="resp_1",
        response_model="m-2026",
        usage=Usage(input_tokens=1830, output_tokens=96, cache_read_tokens=1024, reasoning_tokens=10),
        finish_reasons=("stop",),
        first_chunk_s=0.41,
    )
    spans.end_call(tel, cs, CallRecord(
        cs.caller, call, outcome, cs.start_ns,
        cost_micros=3610,
        usage_source="reported",
        budget_remaining_micros=4_500_000,
        rewrites=[Rewrite("include_usage")],
        repairs=[Repair("output", ("fence",), valid=True)],
        capture=None,
    ))

    span = by_name(flushed(tel, otlp_receiver), name)
    assert span["kind"] == "SPAN_KIND_CLIENT"
    assert span["trace_id"] == f"{run.trace_id:032x}"
    assert span["parent_span_id"] == f"{run.span_id:016x}"
    assert span["status"] == "STATUS_CODE_UNSET"
    expected = {
        A.GEN_AI_OPERATION_NAME: call.operation,
        A.GEN_AI_PROVIDER_NAME: provider,
        A.SERVER_ADDRESS: host,
        A.SERVER_PORT: 443,
        A.GEN_AI_RESPONSE_ID: "resp_1",
        A.GEN_AI_RESPONSE_MODEL: "m-2026",
        A.GEN_AI_RESPONSE_FINISH_REASONS: ["stop"],
        A.GEN_AI_USAGE_INPUT_TOKENS: 1830,
        A.GEN_AI_USAGE_OUTPUT_TOKENS: 96,
        A.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: 1024,
        A.GEN_AI_USAGE_REASONING_OUTPUT_TOKENS: 10,
        A.SPANMETER_TENANT_ID: "acme",
        A.SPANMETER_RUN_ID: "run_01",
        A.SPANMETER_RUN_ID_SOURCE: "header",
        A.SPANMETER_COST_USD: 0.00361,
        A.SPANMETER_USAGE_SOURCE: "reported",
        A.SPANMETER_BUDGET_REMAINING_USD: 4.5,
        A.SPANMETER_REWRITES: ["include_usage"],
        A.SPANMETER_REPAIRS: ["output: fence"],
        **({A.GEN_AI_REQUEST_MODEL: call.model} if call.model else {}),
        **({A.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK: 0.41} if call.stream else {}),
        # What Phoenix and Langfuse show as the span's input and output: summaries, not content.
        A.INPUT_VALUE: "0 characters of prompt text",
        A.INPUT_MIME_TYPE: "text/plain",
        A.OUTPUT_VALUE: "repaired: fence",
        A.OUTPUT_MIME_TYPE: "text/plain",
        **extra,
    }
    assert span["attributes"] == expected
    assert span["resource"]["service.name"] == "spanmeter"
    assert span["scope"] == "spanmeter"


def test_a_request_with_traceparent_joins_the_agents_trace(make_tel: Any, otlp_receiver: OtlpReceiver) -> None:
    tel = make_tel()
    parent = spans.parse_traceparent("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
    assert parent is not None
    call = Call(api="chat", operation="chat", model="gpt-4o")
    cs = spans.start_call(tel, CALLER, call, spans.Peer("openai", "api.openai.com", 443),
                          spans.Lineage(parent, spans.new_run_trace()))
    spans.end_call(tel, cs, CallRecord(
        cs.caller, call, Outcome(status=200), cs.start_ns,
        cost_micros=None,
        usage_source="estimate",
        budget_remaining_micros=None,
        rewrites=[],
        repairs=[],
    ))
    span = by_name(flushed(tel, otlp_receiver), "chat gpt-4o")
    assert span["trace_id"] == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert span["parent_span_id"] == "00f067aa0ba902b7"


def test_a_failed_call_has_error_type_and_error_status(make_tel: Any, otlp_receiver: OtlpReceiver) -> None:
    tel = make_tel()
    call = Call(api="messages", operation="chat", model="claude-haiku-4-5")
    caller = Caller("acme", "run_err", "generated", upstream_key=UPSTREAM_KEY)
    cs = spans.start_call(tel, caller, call, spans.Peer("anthropic", "api.anthropic.com", 443))
    outcome = Outcome(
        status=429,
        error_type="rate_limit_error",
        error_message=f"Too many requests for key {UPSTREAM_KEY}",
    )
    spans.end_call(tel, cs, CallRecord(
        cs.caller, call, outcome, cs.start_ns,
        cost_micros=0,
        usage_source="estimate",
        budget_remaining_micros=None,
        rewrites=[],
        repairs=[],
    ))
    span = by_name(flushed(tel, otlp_receiver), "chat claude-haiku-4-5")
    assert span["status"] == "STATUS_CODE_ERROR"
    assert span["attributes"][A.ERROR_TYPE] == "rate_limit_error"
    assert span["status_message"] == "Too many requests for key [redacted]"
    assert span["parent_span_id"] is None  # no run trace, no traceparent: a root
    assert 'error_type="rate_limit_error"' in tel.metrics_text().decode()


def test_a_refused_call_gets_a_span_that_says_why(make_tel: Any, otlp_receiver: OtlpReceiver) -> None:
    tel = make_tel()
    run = spans.new_run_trace()
    call = Call(api="chat", operation="chat", model="gpt-4o")
    message = "Tenant 'acme' daily budget is exhausted: $10.00 of $10.00 spent."
    cs = refuse(tel, CALLER, call, CeilingReached(message, limit="tenant_day"),
                spans.Peer("openai", "api.openai.com", 443), spans.Lineage(run_trace=run))
    span = by_name(flushed(tel, otlp_receiver), "chat gpt-4o")
    assert cs.ref is not None and span["span_id"] == f"{cs.ref.span_id:016x}"
    assert span["kind"] == "SPAN_KIND_CLIENT"
    assert span["status"] == "STATUS_CODE_ERROR"
    assert span["status_message"] == message  # the words the agent got
    assert span["parent_span_id"] == f"{run.span_id:016x}"
    assert span["attributes"][A.ERROR_TYPE] == "spanmeter.budget_exceeded"
    assert span["attributes"][A.SPANMETER_REFUSAL_REASON] == "tenant_day"  # the ceiling that refused it
    assert not any(k.startswith("gen_ai.usage.") for k in span["attributes"])
    text = tel.metrics_text().decode()
    assert 'spanmeter_limit_rejections_total{gen_ai_operation_name="chat"' in text
    assert 'spanmeter_reason="tenant_day"' in text


def test_run_root_span_is_emitted_at_the_end_with_the_ids_fixed_at_the_start(
    make_tel: Any, otlp_receiver: OtlpReceiver
) -> None:
    tel = make_tel()
    run = spans.new_run_trace(start_ns=time.time_ns() - 5_000_000_000)
    stored = spans.RunTrace.decode(run.encode())  # what another replica would read back
    assert stored == run
    call = Call(api="chat", operation="chat", model="gpt-4o")
    cs = spans.start_call(tel, CALLER, call, spans.Peer("openai", "api.openai.com", 443),
                          spans.Lineage(run_trace=stored))
    spans.end_call(tel, cs, CallRecord(
        cs.caller, call, Outcome(status=200), cs.start_ns,
        cost_micros=1000,
        usage_source="reported",
        budget_remaining_micros=None,
        rewrites=[],
        repairs=[],
    ))
    totals = {
        "model_calls": 1,
        "tool_calls": 2,
        "failures": 0,
        "input_tokens": 10,
        "output_tokens": 5,
        "cost_micros": 1000,
        "repairs": 1,
        "ceilings_hit": 0,
    }
    spans.end_run(tel, CALLER, stored, totals, "ok")

    found = flushed(tel, otlp_receiver)
    root, child = by_name(found, "invoke_agent"), by_name(found, "chat gpt-4o")
    assert root["kind"] == "SPAN_KIND_INTERNAL"
    assert root["parent_span_id"] is None
    assert (root["trace_id"], root["span_id"]) == (f"{run.trace_id:032x}", f"{run.span_id:016x}")
    assert root["start_ns"] == run.start_ns
    assert child["parent_span_id"] == root["span_id"]
    assert root["attributes"] == {
        # An agent invocation (semconv v1.41.1): no agent name was given, so none is set.
        A.GEN_AI_OPERATION_NAME: "invoke_agent",
        A.SPANMETER_TENANT_ID: "acme",
        A.SPANMETER_RUN_ID: "run_01",
        A.SPANMETER_RUN_ID_SOURCE: "header",
        A.SPANMETER_RUN_STATUS: "ok",
        A.SPANMETER_RUN_MODEL_CALLS: 1,
        A.SPANMETER_RUN_TOOL_CALLS: 2,
        A.SPANMETER_RUN_FAILURES: 0,
        A.GEN_AI_USAGE_INPUT_TOKENS: 10,  # the run's totals, under the conventions' names
        A.GEN_AI_USAGE_OUTPUT_TOKENS: 5,
        A.SPANMETER_RUN_COST_USD: 0.001,
        A.SPANMETER_RUN_REPAIRS: 1,
        A.SPANMETER_RUN_CEILINGS_HIT: 0,
        A.INPUT_VALUE: "run run_01",
        A.INPUT_MIME_TYPE: "text/plain",
        A.OUTPUT_VALUE: "ok: 1 model call, 2 tool calls, 15 tokens, $0.0010",
        A.OUTPUT_MIME_TYPE: "text/plain",
    }
    # Random ids resume after the fixed ones were used.
    assert spans.new_run_trace().span_id != run.span_id


def test_a_run_begun_in_an_agent_trace_hangs_its_run_span_under_the_agent(
    make_tel: Any, otlp_receiver: OtlpReceiver
) -> None:
    tel = make_tel()
    parent = spans.parse_traceparent("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
    run = spans.new_run_trace(parent)
    spans.end_run(tel, CALLER, run, {"model_calls": 0}, "error")
    root = by_name(flushed(tel, otlp_receiver), "invoke_agent")
    assert root["trace_id"] == "0af7651916cd43dd8448eb211c80319c"
    assert root["parent_span_id"] == "b7ad6b7169203331"
    assert root["span_id"] == f"{run.span_id:016x}"
    assert root["status"] == "STATUS_CODE_ERROR"


TOOL_CASES = [
    pytest.param(
        '{"city": "Paris"}',
        '{"temp_c": 14, "conditions": "rain"}',
        False,
        True,
        "{temp_c, conditions}",
        None,
        id="a plain result is ok: its shape, not its values",
    ),
    pytest.param(
        '{"path": "a.py", "mode": "r"}',
        "l1\nl2\nl3",
        False,
        True,
        "3 lines",
        None,
        id="text result: a line count",
    ),
    pytest.param(
        '{"q": "x"}',
        '{"ok": false, "error": "denied"}',
        False,
        False,
        "denied",
        "tool_error",
        id="an ok:false envelope fails",
    ),
    pytest.param(
        '{"cmd": "make"}',
        '{"exit_code": 2, "stderr": "boom"}',
        False,
        False,
        "boom",
        "tool_error",
        id="a non-zero exit code fails",
    ),
    pytest.param(
        '{"q": "x"}',
        "it broke",
        True,
        False,
        "it broke",
        "tool_error",
        id="the dialect's is_error flag fails",
    ),
]


@pytest.mark.parametrize(("args", "result", "is_error", "ok", "digest", "error_type"), TOOL_CASES)
def test_tool_span_parent_timing_digests_and_ok_flag(
    make_tel: Any,
    otlp_receiver: OtlpReceiver,
    args: str,
    result: str,
    is_error: bool,
    ok: bool,
    digest: str,
    error_type: str | None,
) -> None:
    tel = make_tel()
    run = spans.new_run_trace()
    call = Call(api="chat", operation="chat", model="gpt-4o")
    cs = spans.start_call(tel, CALLER, call, spans.Peer("openai", "api.openai.com", 443), spans.Lineage(run_trace=run))
    spans.end_call(tel, cs, CallRecord(
        cs.caller, call, Outcome(status=200), cs.start_ns,
        cost_micros=None,
        usage_source="reported",
        budget_remaining_micros=None,
        rewrites=[],
        repairs=[],
    ))
    start, end = 1_786_000_002_310_000_000, 1_786_000_003_050_000_000
    spans.tool_span(
        tel, ToolRecord(CALLER, "get_weather", "call_VSPy", args, result, start, end, is_error=is_error,
                        description="Get the weather"), run_trace=run, link=cs.ref)

    found = flushed(tel, otlp_receiver)
    chat, tool = by_name(found, "chat gpt-4o"), by_name(found, "execute_tool get_weather")
    assert tool["kind"] == "SPAN_KIND_INTERNAL"
    assert tool["parent_span_id"] == f"{run.span_id:016x}"
    assert tool["links"] == [{"trace_id": chat["trace_id"], "span_id": chat["span_id"]}]
    assert (tool["start_ns"], tool["end_ns"]) == (start, end)
    a = tool["attributes"]
    assert a[A.GEN_AI_OPERATION_NAME] == "execute_tool"
    assert a[A.GEN_AI_TOOL_NAME] == "get_weather"
    assert a[A.GEN_AI_TOOL_CALL_ID] == "call_VSPy"
    assert a[A.GEN_AI_TOOL_TYPE] == "function"
    assert a[A.GEN_AI_TOOL_DESCRIPTION] == "Get the weather"
    assert a[A.SPANMETER_TOOL_TIMING] == "inferred"
    assert a[A.SPANMETER_TOOL_OK] is ok
    assert a[A.SPANMETER_TOOL_RESULT_DIGEST] == digest
    assert a[A.SPANMETER_TOOL_ARGUMENTS_SIZE] == len(args.encode())
    assert len(a[A.SPANMETER_TOOL_ARGUMENTS_SHA256]) == 64
    assert a[A.SPANMETER_TOOL_RESULT_SIZE] == len(result.encode())
    assert a.get(A.ERROR_TYPE) == error_type
    assert tool["status"] == ("STATUS_CODE_UNSET" if ok else "STATUS_CODE_ERROR")
    # Content is off by default: digests only.
    assert A.GEN_AI_TOOL_CALL_ARGUMENTS not in a and A.SPANMETER_TOOL_RESULT_PREVIEW not in a
    outcome = "ok" if ok else "failed"
    assert f'spanmeter_outcome="{outcome}"' in tel.metrics_text().decode()


def test_a_tool_call_never_answered_gets_tool_result_missing(make_tel: Any, otlp_receiver: OtlpReceiver) -> None:
    tel = make_tel()
    run = spans.new_run_trace()
    spans.tool_span(
        tel, ToolRecord(CALLER, "search", "toolu_1", '{"query": "q"}', None, 1_000, 2_000,
                        is_error=False), run_trace=run)
    tool = by_name(flushed(tel, otlp_receiver), "execute_tool search")
    assert tool["attributes"][A.ERROR_TYPE] == "tool_result_missing"
    assert tool["attributes"][A.SPANMETER_TOOL_ARGUMENTS_DIGEST] == "q"
    assert tool["attributes"][A.SPANMETER_TOOL_OK] is False
    assert A.SPANMETER_TOOL_RESULT_SHA256 not in tool["attributes"]
    assert tool["status"] == "STATUS_CODE_ERROR"
    assert 'spanmeter_outcome="missing"' in tel.metrics_text().decode()


def test_span_only_capture_records_content_capped_and_keys_never_leak(
    make_tel: Any, otlp_receiver: OtlpReceiver
) -> None:
    tel = make_tel(capture_content="SPAN_ONLY", content_cap_bytes=300)
    caller = Caller("acme", "run_c", "header", upstream_key=UPSTREAM_KEY)
    call = Call(api="messages", operation="chat", model="claude-sonnet-4-5")
    cs = spans.start_call(tel, caller, call, spans.Peer("anthropic", "api.anthropic.com", 443))
    capture = {
        "system_instructions": [{"type": "text", "content": "Be brief."}],
        "input_messages": [{"role": "user", "parts": [{"type": "text", "content": "x" * 2000}]}],
        "output_messages": [
            {
                "role": "assistant",
                "parts": [{"type": "text", "content": "ok"}],
                "finish_reason": "stop",
            }
        ],
    }
    spans.end_call(tel, cs, CallRecord(
        cs.caller, call, Outcome(status=200), cs.start_ns,
        cost_micros=None,
        usage_source="reported",
        budget_remaining_micros=None,
        rewrites=[],
        repairs=[],
        capture=capture,
    ))
    spans.tool_span(
        tel, ToolRecord(caller, "fetch", "c1", '{"url": "https://x"}', f'{{"text": "token {UPSTREAM_KEY}"}}', 1, 2,
                        is_error=False, capture=True))
    found = flushed(tel, otlp_receiver)
    chat = by_name(found, "chat claude-sonnet-4-5")["attributes"]
    assert json.loads(chat[A.GEN_AI_SYSTEM_INSTRUCTIONS]) == capture["system_instructions"]
    assert json.loads(chat[A.GEN_AI_OUTPUT_MESSAGES]) == capture["output_messages"]
    assert len(chat[A.GEN_AI_INPUT_MESSAGES].encode()) <= 300
    assert json.loads(chat[A.GEN_AI_INPUT_MESSAGES])[0]["role"] == "user"
    tool = by_name(found, "execute_tool fetch")["attributes"]
    assert tool[A.GEN_AI_TOOL_CALL_ARGUMENTS] == '{"url": "https://x"}'
    assert tool[A.SPANMETER_TOOL_RESULT_PREVIEW] == '{"text": "token [redacted]"}'
    everything = json.dumps(found) + tel.metrics_text().decode()
    assert UPSTREAM_KEY not in everything


def test_no_content_by_default_even_when_the_caller_passes_it(make_tel: Any, otlp_receiver: OtlpReceiver) -> None:
    tel = make_tel()
    call = Call(api="chat", operation="chat", model="gpt-4o")
    cs = spans.start_call(tel, CALLER, call, spans.Peer("openai", "api.openai.com", 443))
    spans.end_call(tel, cs, CallRecord(
        cs.caller, call, Outcome(status=200), cs.start_ns,
        cost_micros=None,
        usage_source="reported",
        budget_remaining_micros=None,
        rewrites=[],
        repairs=[],
        capture={"input_messages": [{"role": "user", "parts": []}]},
    ))
    attrs = by_name(flushed(tel, otlp_receiver), "chat gpt-4o")["attributes"]
    assert not {A.GEN_AI_INPUT_MESSAGES, A.GEN_AI_OUTPUT_MESSAGES} & attrs.keys()


def test_latest_semconv_opt_in_renames_cache_write_and_inference_metrics(
    make_tel: Any, otlp_receiver: OtlpReceiver
) -> None:
    tel = make_tel(semconv_latest=True)
    call = Call(api="messages", operation="chat", model="claude-sonnet-4-5")
    cs = spans.start_call(tel, CALLER, call, spans.Peer("anthropic", "api.anthropic.com", 443))
    outcome = Outcome(status=200, usage=Usage(input_tokens=50, output_tokens=5, cache_write_tokens=40))
    spans.end_call(tel, cs, CallRecord(
        cs.caller, call, outcome, cs.start_ns,
        cost_micros=None,
        usage_source="reported",
        budget_remaining_micros=None,
        rewrites=[],
        repairs=[],
    ))
    attrs = by_name(flushed(tel, otlp_receiver), "chat claude-sonnet-4-5")["attributes"]
    assert attrs[A.LATEST_GEN_AI_USAGE_CACHE_WRITE_INPUT_TOKENS] == 40
    assert A.GEN_AI_USAGE_CACHE_CREATION_INPUT_TOKENS not in attrs
    text = tel.metrics_text().decode()
    assert "gen_ai_client_inference_duration_seconds_count" in text
    assert "gen_ai_client_operation_duration_seconds_count" not in text


def test_metrics_are_pushed_over_otlp_when_asked(make_tel: Any, otlp_receiver: OtlpReceiver) -> None:
    tel = make_tel(push_metrics=True)
    call = Call(api="chat", operation="chat", model="gpt-4o", stream=True)
    cs = spans.start_call(tel, CALLER, call, spans.Peer("openai", "api.openai.com", 443))
    outcome = Outcome(status=200, usage=Usage(input_tokens=5, output_tokens=7), first_chunk_s=0.1)
    spans.end_call(tel, cs, CallRecord(
        cs.caller, call, outcome, cs.start_ns,
        cost_micros=42,
        usage_source="reported",
        budget_remaining_micros=None,
        rewrites=[],
        repairs=[],
        chunk_gaps_s=[0.01],
    ))
    tel.set_budget("acme", "day", 1_500_000, 10_000_000)
    assert tel.force_flush()
    assert {
        A.GEN_AI_CLIENT_OPERATION_DURATION,
        A.GEN_AI_CLIENT_TOKEN_USAGE,
        A.GEN_AI_CLIENT_TIME_TO_FIRST_CHUNK,
        A.GEN_AI_CLIENT_TIME_PER_OUTPUT_CHUNK,
        A.SPANMETER_COST,
        A.SPANMETER_BUDGET_SPENT_USD,
        A.SPANMETER_BUDGET_LIMIT_USD,
    } <= otlp_receiver.metric_names()


def test_a_traces_endpoint_never_gets_a_metrics_push(make_tel: Any, otlp_receiver: OtlpReceiver) -> None:
    """Phoenix, Langfuse and Tempo take traces only (Phoenix answers /v1/metrics with 405):
    an endpoint for traces is not a place to push metrics to; /metrics still has them."""
    tel = make_tel(project_name="agents-prod")
    call = Call(api="chat", operation="chat", model="gpt-4o")
    cs = spans.start_call(tel, CALLER, call, spans.Peer("openai", "api.openai.com", 443))
    spans.end_call(tel, cs, CallRecord(cs.caller, call, Outcome(status=200, usage=Usage(5, 7)), cs.start_ns,
                                       cost_micros=42, usage_source="reported",
                   budget_remaining_micros=None, rewrites=[], repairs=[]))  # fmt: skip
    span = by_name(flushed(tel, otlp_receiver), "chat gpt-4o")
    assert "gen_ai_client_token_usage_count" in tel.metrics_text().decode()
    tel.shutdown()  # a periodic reader would push once more at shutdown
    assert otlp_receiver.metric_names() == set() and otlp_receiver.metric_requests == 0
    # The project setting names the resource's Phoenix project.
    assert span["resource"][A.OPENINFERENCE_PROJECT_NAME] == "agents-prod"


def test_metric_labels_never_carry_run_or_response_ids(make_tel: Any) -> None:
    tel = make_tel()
    call = Call(api="chat", operation="chat", model="gpt-4o")
    cs = spans.start_call(tel, CALLER, call, spans.Peer("openai", "api.openai.com", 443),
                          spans.Lineage(run_trace=spans.new_run_trace()))
    outcome = Outcome(status=200, response_id="chatcmpl-UNIQUE", usage=Usage(1, 1))
    spans.end_call(tel, cs, CallRecord(
        cs.caller, call, outcome, cs.start_ns,
        cost_micros=1,
        usage_source="reported",
        budget_remaining_micros=None,
        rewrites=[],
        repairs=[],
    ))
    spans.tool_span(
        tel, ToolRecord(CALLER, "t", "call_UNIQUE", "{}", "", 1, 2, is_error=False))
    text = tel.metrics_text().decode()
    assert "run_01" not in text and "UNIQUE" not in text


@pytest.mark.parametrize("run", [
    spans.RunTrace(0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331, 1_764_460_800_000_000_000),
    spans.RunTrace(1, 2, 3, parent_span_id=0xB7AD6B7169203331, sampled=False),
])  # fmt: skip
def test_a_run_traces_text_is_kept_and_reads_back_to_equal_ids(run: spans.RunTrace) -> None:
    text = run.encode()
    assert run.encode() is text  # kept: asked on every call of the run
    fresh = spans.RunTrace(run.trace_id, run.span_id, run.start_ns, run.parent_span_id, run.sampled)
    assert fresh == run and hash(fresh) == hash(run) and fresh.encode() == text
    assert spans.RunTrace.decode(text) == run
    assert text.split("-")[0] == f"{run.trace_id:032x}" and text.endswith("-1" if run.sampled else "-0")


_KEYISH = [
    "no key here, only prose about a task-list and a desk_lamp",
    "sk-proj-abcdEFGH1234ijkl5678",
    "error: key gsk_0123456789abcdef was refused",
    "xai-ABCDEFGH12 and sm_abc (too short) and sk-*******1234",
    "AIzaSyA1b2C3d4E5f6G7h8I9j0KlMnOpQrStU in a URL ?key=AIzaSyA1b2C3d4E5f6G7h8I9j0KlMn",
    "task-abcdefgh1234 ask_abcdefgh1234: inside a word, not a key",
    "AIza-short",
    "",
]


@pytest.mark.parametrize("text", _KEYISH)
def test_redaction_finds_what_the_key_pattern_finds(text: str) -> None:
    # The literal pre-check may only skip texts the pattern cannot match.
    assert spans.redact_keylike(text) == spans._KEYLIKE.sub("[redacted]", text)


@given(st.text(alphabet="skmgxaiAIz-_*0123456789abcXYZ .\n", max_size=80))
def test_redaction_agrees_with_the_key_pattern_on_any_text(text: str) -> None:
    assert spans.redact_keylike(text) == spans._KEYLIKE.sub("[redacted]", text)
