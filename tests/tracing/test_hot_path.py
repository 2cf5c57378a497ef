"""What the per-call fast paths emit: exact span attributes, cached label sets, one
time-per-output-chunk point per call, and the OTLP compression switch."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from proxy.model import Call, Caller, CallRecord, Outcome, OutputSpec, Repair, Rewrite, Usage
from tracing import attributes as A
from tracing import spans
from tracing.metrics import CallLabels, LabelCache
from tracing.setup import Telemetry, TelemetryConfig, otlp_compression, setup_telemetry

CALLER = Caller("acme", "run_h", "header")
WHERE = spans.Peer("openai", "api.openai.com", 443)


@pytest.fixture
def tel_mem(tmp_path: object) -> Iterator[tuple[Telemetry, InMemorySpanExporter]]:
    memory = InMemorySpanExporter()
    tel = setup_telemetry(TelemetryConfig(local_dir=str(tmp_path)), environ={}, extra_exporters=(memory,))
    yield tel, memory
    tel.shutdown()


def samples(tel: Telemetry, name: str) -> list[tuple[dict[str, str], float]]:
    text = tel.metrics_text().decode()
    return [
        (s.labels, s.value) for family in text_string_to_metric_families(text) for s in family.samples if s.name == name
    ]


def test_a_call_with_every_parameter_emits_exactly_these_attributes(
    tel_mem: tuple[Telemetry, InMemorySpanExporter],
) -> None:
    tel, memory = tel_mem
    call = Call(
        api="chat", operation="chat", openai_api_type="chat_completions", model="gpt-4o", stream=True,
        max_output_tokens=256, temperature=0.5, top_p=0.9, top_k=40.0, seed=3, choice_count=2,
        stop_sequences=("END",), frequency_penalty=0.1, presence_penalty=0.2, output=OutputSpec(kind="json_schema"),
    )  # fmt: skip
    outcome = Outcome(
        status=200, response_id="r1", response_model="gpt-4o-2024", finish_reasons=("stop",),
        usage=Usage(10, 5, cache_read_tokens=2, cache_write_tokens=1, reasoning_tokens=3),
        first_chunk_s=0.25, notes=("unparsed_event",),
    )  # fmt: skip
    cs = spans.start_call(tel, CALLER, call, WHERE, spans.Lineage(run_trace=spans.new_run_trace()))
    spans.end_call(tel, cs, CallRecord(cs.caller, call, outcome, cs.start_ns, cost_micros=1500,
                                       usage_source="reported", budget_remaining_micros=2_000_000,
                   rewrites=[Rewrite("include_usage")], repairs=[Repair("output", ("fence",))],
                   chunk_gaps_s=[0.1]))  # fmt: skip
    (span,) = memory.get_finished_spans()
    assert dict(span.attributes or {}) == {
        A.GEN_AI_OPERATION_NAME: "chat",
        A.GEN_AI_PROVIDER_NAME: "openai",
        A.GEN_AI_REQUEST_MODEL: "gpt-4o",
        A.SERVER_ADDRESS: "api.openai.com",
        A.SERVER_PORT: 443,
        A.GEN_AI_REQUEST_STREAM: True,
        A.GEN_AI_REQUEST_MAX_TOKENS: 256,
        A.GEN_AI_REQUEST_TEMPERATURE: 0.5,
        A.GEN_AI_REQUEST_TOP_P: 0.9,
        A.GEN_AI_REQUEST_TOP_K: 40,
        A.GEN_AI_REQUEST_SEED: 3,
        A.GEN_AI_REQUEST_CHOICE_COUNT: 2,
        A.GEN_AI_REQUEST_STOP_SEQUENCES: ("END",),
        A.GEN_AI_REQUEST_FREQUENCY_PENALTY: 0.1,
        A.GEN_AI_REQUEST_PRESENCE_PENALTY: 0.2,
        A.GEN_AI_OUTPUT_TYPE: "json",
        A.OPENAI_API_TYPE: "chat_completions",
        A.SPANMETER_TENANT_ID: "acme",
        A.SPANMETER_RUN_ID: "run_h",
        A.SPANMETER_RUN_ID_SOURCE: "header",
        A.GEN_AI_RESPONSE_ID: "r1",
        A.GEN_AI_RESPONSE_MODEL: "gpt-4o-2024",
        A.GEN_AI_RESPONSE_FINISH_REASONS: ("stop",),
        A.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK: 0.25,
        A.GEN_AI_USAGE_INPUT_TOKENS: 10,
        A.GEN_AI_USAGE_OUTPUT_TOKENS: 5,
        A.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: 2,
        A.GEN_AI_USAGE_CACHE_CREATION_INPUT_TOKENS: 1,
        A.GEN_AI_USAGE_REASONING_OUTPUT_TOKENS: 3,
        A.SPANMETER_OBSERVER_NOTES: ("unparsed_event",),
        A.SPANMETER_COST_USD: 0.0015,
        A.SPANMETER_USAGE_SOURCE: "reported",
        A.SPANMETER_BUDGET_REMAINING_USD: 2.0,
        A.SPANMETER_REWRITES: ("include_usage",),
        A.SPANMETER_REPAIRS: ("output: fence",),
        A.INPUT_VALUE: "0 characters of prompt text; asks for json",
        A.INPUT_MIME_TYPE: "text/plain",
        A.OUTPUT_VALUE: "repaired: fence",
        A.OUTPUT_MIME_TYPE: "text/plain",
    }


def test_a_bare_call_emits_only_what_it_knows(tel_mem: tuple[Telemetry, InMemorySpanExporter]) -> None:
    tel, memory = tel_mem
    call = Call(api="chat", operation="chat", model=None, choice_count=1)
    cs = spans.start_call(tel, CALLER, call, spans.Peer("my_upstream", "", 0))
    spans.end_call(tel, cs, CallRecord(cs.caller, call, Outcome(status=200), cs.start_ns, cost_micros=None,
                                       usage_source="", budget_remaining_micros=None,
                   rewrites=[], repairs=[]))  # fmt: skip
    (span,) = memory.get_finished_spans()
    assert dict(span.attributes or {}) == {
        A.GEN_AI_OPERATION_NAME: "chat",
        A.GEN_AI_PROVIDER_NAME: "my_upstream",
        A.SPANMETER_TENANT_ID: "acme",
        A.SPANMETER_RUN_ID: "run_h",
        A.SPANMETER_RUN_ID_SOURCE: "header",
        A.INPUT_VALUE: "0 characters of prompt text",
        A.INPUT_MIME_TYPE: "text/plain",
        A.OUTPUT_VALUE: "(no output)",
        A.OUTPUT_MIME_TYPE: "text/plain",
    }


def test_time_per_output_chunk_is_one_point_per_call_at_the_mean_gap(
    tel_mem: tuple[Telemetry, InMemorySpanExporter],
) -> None:
    tel, _ = tel_mem
    call = Call(api="chat", operation="chat", model="gpt-4o", stream=True)
    for gaps in ([0.01, 0.03], [0.05, 0.05, 0.05, 0.05]):
        cs = spans.start_call(tel, CALLER, call, WHERE)
        spans.end_call(tel, cs, CallRecord(cs.caller, call, Outcome(status=200, first_chunk_s=0.1), cs.start_ns,
                                           cost_micros=None, usage_source="",
                       budget_remaining_micros=None, rewrites=[], repairs=[], chunk_gaps_s=gaps))  # fmt: skip
    name = "gen_ai_client_operation_time_per_output_chunk_seconds"
    ((_, count),) = samples(tel, f"{name}_count")
    ((_, total),) = samples(tel, f"{name}_sum")
    assert count == 2
    assert total == pytest.approx(0.02 + 0.05)


def test_failed_and_ok_calls_of_one_model_keep_their_own_series(
    tel_mem: tuple[Telemetry, InMemorySpanExporter],
) -> None:
    tel, _ = tel_mem
    call = Call(api="chat", operation="chat", model="gpt-4o")
    outcomes = [
        Outcome(status=200, response_model="gpt-4o-2024", usage=Usage(3, 4)),
        Outcome(status=200, response_model="gpt-4o-2024", usage=Usage(3, 4)),
        Outcome(status=500, error_type="500", error_message="boom"),
    ]
    for outcome in outcomes:
        cs = spans.start_call(tel, CALLER, call, WHERE)
        spans.end_call(tel, cs, CallRecord(cs.caller, call, outcome, cs.start_ns, cost_micros=7,
                                           usage_source="reported", budget_remaining_micros=None,
                       rewrites=[Rewrite("include_usage")], repairs=[]))  # fmt: skip
    durations = samples(tel, "gen_ai_client_operation_duration_seconds_count")
    by_error = {labels.get("error_type") or None: value for labels, value in durations}
    assert by_error == {None: 2, "500": 1}
    tokens = {labels["gen_ai_token_type"]: value for labels, value in samples(tel, "gen_ai_client_token_usage_sum")}
    assert tokens == {"input": 6, "output": 8}
    ((cost_labels, cost),) = samples(tel, "spanmeter_cost_total")
    assert cost == pytest.approx(21e-6)
    assert {k for k in cost_labels if k != "otel_scope_name"} >= {"gen_ai_provider_name", "gen_ai_request_model"}
    assert "server_address" not in cost_labels and "gen_ai_response_model" not in cost_labels
    ((rewrite_labels, rewrites),) = samples(tel, "spanmeter_rewrites_total")
    assert rewrites == 3 and rewrite_labels["spanmeter_kind"] == "include_usage"


def test_label_sets_are_built_once_and_the_cache_stays_bounded() -> None:
    built: list[str] = []

    def build(key: str) -> dict[str, str]:
        built.append(key)
        return {"k": key}

    cache: LabelCache[str, dict[str, str]] = LabelCache(build, max_entries=2)
    first = cache.get("a")
    assert cache.get("a") is first
    cache.get("b")
    cache.get("c")  # full: cleared, then refilled
    assert len(cache) == 1
    assert cache.get("a") == {"k": "a"}
    assert built == ["a", "b", "c", "a"]


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        pytest.param(
            ("acme", "chat", "openai", "gpt-4o", "gpt-4o-2024", "api.openai.com", 443, None),
            {A.GEN_AI_OPERATION_NAME: "chat", A.GEN_AI_PROVIDER_NAME: "openai", A.GEN_AI_REQUEST_MODEL: "gpt-4o",
             A.GEN_AI_RESPONSE_MODEL: "gpt-4o-2024", A.SERVER_ADDRESS: "api.openai.com", A.SERVER_PORT: 443,
             A.SPANMETER_TENANT_ID: "acme"},
            id="everything known",
        ),
        pytest.param(
            ("acme", "chat", "", None, None, "", 0, "timeout"),
            {A.GEN_AI_OPERATION_NAME: "chat", A.SPANMETER_TENANT_ID: "acme"},
            id="unknowns are left out, not empty",
        ),
    ],
)  # fmt: skip
def test_call_labels(key: Any, expected: dict[str, Any]) -> None:
    labels = CallLabels.build(key)
    assert dict(labels.base) == expected
    assert dict(labels.timed) == ({**expected, A.ERROR_TYPE: key[-1]} if key[-1] else expected)
    assert dict(labels.input_tokens) == {**expected, A.GEN_AI_TOKEN_TYPE: "input"}
    money = {k: v for k, v in expected.items() if k in (A.GEN_AI_PROVIDER_NAME, A.GEN_AI_REQUEST_MODEL)}
    assert dict(labels.money) == {**money, A.SPANMETER_TENANT_ID: "acme"}


@pytest.mark.parametrize(
    ("env", "traces", "metrics"),
    [
        pytest.param({}, "gzip", "gzip", id="gzip by default"),
        pytest.param({"OTEL_EXPORTER_OTLP_COMPRESSION": "none"}, "none", "none", id="none for a local collector"),
        pytest.param({"OTEL_EXPORTER_OTLP_COMPRESSION": " GZIP "}, "gzip", "gzip", id="case and spaces"),
        pytest.param({"OTEL_EXPORTER_OTLP_COMPRESSION": "zstd"}, "gzip", "gzip", id="unknown value: default"),
        pytest.param({"OTEL_EXPORTER_OTLP_COMPRESSION": "none", "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION": "gzip"},
                     "gzip", "none", id="a signal's own variable wins"),
    ],
)  # fmt: skip
def test_otlp_compression_follows_the_standard_variables(env: dict[str, str], traces: str, metrics: str) -> None:
    cfg = TelemetryConfig.from_env(env)
    assert (otlp_compression(cfg, env, "traces"), otlp_compression(cfg, env, "metrics")) == (traces, metrics)
