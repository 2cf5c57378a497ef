"""The lean span path (tracing/lean.py) against the SDK's own spans, span for span.

Each scenario runs twice on one Telemetry, with the same random seed (the ids come from
the tracer's RandomIdGenerator): once as the proxy runs it, once with `SdkReference`, the
path spans.py took before: `Tracer.start_span` with the start attributes,
`Span.set_attributes`, `Span.set_status`, `Span.end`. What the span processors receive
must encode to the same OTLP protobuf bytes, the same local JSONL record and the same
export-process frame; the ids the caller gets back (`ref`) and the span a metric
exemplar reads from the call's context must be the same too. Nothing is ignored.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, SpanKind, Status
from opentelemetry.util.types import AttributeValue

from proxy.errors import CeilingReached
from proxy.govern.wrapup import Remaining
from proxy.model import Call, Caller, CallRecord, Outcome, OutputSpec, Repair, Rewrite, ToolRecord, ToolSpec, Usage
from tests.tracing.refusals import refuse
from tracing import mcp, spans
from tracing.export_process import encode_span
from tracing.lean import LeanTracer
from tracing.local import span_record
from tracing.setup import Telemetry, TelemetryConfig, setup_telemetry
from tracing.traceparent import TraceParent

T0 = 1_700_000_000_000_000_000
CALLER = Caller("acme", "run_01", "header", key_id="k1", agent_name="planner", conversation_id="conv-1",
                upstream_key="sk-live-0123456789abcdefSECRET")
JSON_CALL = Call(api="chat", operation="chat", openai_api_type="chat_completions", model="gpt-4o",
                 max_output_tokens=1024, tools=(ToolSpec("get_weather", "Weather", {"type": "object"}),))
# A caller-steered sequence that arrives as a list: the SDK stores a tuple.
STREAM_CALL = Call(api="chat", operation="chat", openai_api_type="chat_completions", model="gpt-4o-mini",
                   stream=True, temperature=0.2, top_k=40.0, seed=7, choice_count=2,
                   stop_sequences=["END", "STOP"], output=OutputSpec(kind="json_schema"))  # type: ignore[arg-type]
OK = Outcome(status=200, response_id="chatcmpl-1", response_model="gpt-4o-2024-08-06", finish_reasons=("stop",),
             usage=Usage(input_tokens=120, output_tokens=30, cache_read_tokens=20, cache_write_tokens=4,
                         reasoning_tokens=3), text="hi")
FAILED = Outcome(status=500, error_type="upstream_error", complete=False, first_chunk_s=0.25,
                 error_message="upstream said sk-live-0123456789abcdefSECRET is bad", notes=("unparsed_event",))
CAPTURE = {"input_messages": [{"role": "user", "parts": [{"type": "text", "content": "hi"}]}],
           "output_messages": [{"role": "assistant", "parts": [{"type": "text", "content": "hello"}]}],
           "system_instructions": None}


class SdkSpan:
    """The SDK's span behind the LeanSpan interface spans.py uses."""

    def __init__(self, span: trace.Span) -> None:
        self.span = span
        self.context = span.get_span_context()

    def set_attributes(self, attrs: dict[str, AttributeValue]) -> None:
        self.span.set_attributes(attrs)

    def set_status(self, status: Status) -> None:
        self.span.set_status(status)

    def parent_context(self) -> Context:
        return trace.set_span_in_context(self.span, Context())


class SdkReference:
    """The reference path: every span started, filled and ended by the SDK's tracer."""

    def __init__(self, tracer: trace.Tracer) -> None:
        self.tracer = tracer

    def open(self, name: str, parent: SpanContext | None, kind: SpanKind, attributes: dict[str, AttributeValue],
             start_ns: int, links: Sequence[Link] = ()) -> SdkSpan:
        ctx = trace.set_span_in_context(NonRecordingSpan(parent), Context()) if parent else Context()
        return SdkSpan(self.tracer.start_span(name, context=ctx, kind=kind, attributes=attributes,
                                              links=links or None, start_time=start_ns))

    def end(self, span: SdkSpan, end_ns: int) -> None:
        span.span.end(end_time=end_ns)


@dataclass
class Seen:
    """What a scenario hands back: span refs and the contexts metric points would carry."""

    refs: list[Any] = field(default_factory=list)
    contexts: list[Context] = field(default_factory=list)

    def call(self, cs: spans.CallSpan) -> spans.CallSpan:
        self.contexts.append(cs.context)
        return cs


Scenario = Callable[[Telemetry, Seen], None]


def json_call(tel: Telemetry, seen: Seen) -> None:
    cs = seen.call(spans.start_call(tel, CALLER, JSON_CALL, spans.Peer("openai", "api.openai.com", 443), start_ns=T0))
    spans.end_call(tel, cs, CallRecord(cs.caller, JSON_CALL, OK, cs.start_ns, cost_micros=1200,
                                       usage_source="reported", budget_remaining_micros=5000,
                   rewrites=[], repairs=[], end_ns=T0 + 5_000_000, saved_micros=30))
    seen.refs.append(cs.ref)


def stream_call_in_run(tel: Telemetry, seen: Seen) -> None:
    run = spans.new_run_trace(start_ns=T0)
    cs = seen.call(spans.start_call(tel, CALLER, STREAM_CALL, spans.Peer("openai", "api.openai.com", 443),
                                    spans.Lineage(run_trace=run), start_ns=T0 + 1))
    spans.record_guard_action(tel, CALLER, "remind", tool_name="search", repeats=3, cs=cs)
    spans.record_remaining(cs, Remaining(run_calls=4, run_cost_micros=1_000_000, run_seconds=12.5, month_micros=9))
    # Set again after others: the SDK moves a key set again to the end.
    spans.record_guard_action(tel, CALLER, "refuse", tool_name="search", repeats=4, cs=cs)
    spans.record_wrap_up(tel, CALLER, "run_cost", cs=cs)
    spans.end_call(tel, cs, CallRecord(cs.caller, STREAM_CALL, FAILED, cs.start_ns, cost_micros=None, usage_source="",
                                       budget_remaining_micros=None,
                   rewrites=[Rewrite("include_usage")], repairs=[Repair("output", ("fence",), valid=False)],
                   capture=CAPTURE, end_ns=T0 + 9_000_000, chunk_gaps_s=[0.01, 0.02]))
    seen.refs.append(cs.ref)


def traceparent_call(tel: Telemetry, seen: Seen) -> None:
    parent = TraceParent(0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331, True, "vendor=a,other=b")
    cs = seen.call(spans.start_call(tel, CALLER, JSON_CALL, spans.Peer("openai", "api.openai.com", 443),
                                    spans.Lineage(parent), start_ns=T0))
    spans.end_call(tel, cs, CallRecord(cs.caller, JSON_CALL, OK, cs.start_ns, cost_micros=0, usage_source="estimated",
                                       budget_remaining_micros=None,
                   rewrites=[], repairs=[], capture=CAPTURE, end_ns=T0 + 1))
    seen.refs.append(cs.ref)


def unsampled_parent(tel: Telemetry, seen: Seen) -> None:
    parent = TraceParent(0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331, False)
    cs = seen.call(spans.start_call(tel, CALLER, JSON_CALL, spans.Peer("openai", "", 0),
                                    spans.Lineage(parent), start_ns=T0))
    spans.end_call(tel, cs, CallRecord(cs.caller, JSON_CALL, OK, cs.start_ns, cost_micros=10, usage_source="reported",
                                       budget_remaining_micros=None,
                   rewrites=[], repairs=[], end_ns=T0 + 1))
    seen.refs.append(cs.ref)


def refused_call(tel: Telemetry, seen: Seen) -> None:
    run = spans.new_run_trace(start_ns=T0)
    cs = seen.call(refuse(tel, CALLER, JSON_CALL, CeilingReached("run cost limit reached", limit="run_cost"),
                          spans.Peer("openai"), spans.Lineage(run_trace=run), start_ns=T0, end_ns=T0 + 2))
    seen.refs.append(cs.ref)


def abandoned_call(tel: Telemetry, seen: Seen) -> None:
    run = spans.new_run_trace(start_ns=T0)
    cs = seen.call(spans.start_call(tel, CALLER, STREAM_CALL, spans.Peer("anthropic", "api.anthropic.com", 443),
                                    spans.Lineage(run_trace=run), start_ns=T0))
    outcome = Outcome(status=499, error_type="client_disconnected", complete=False,
                      error_message="the client closed the connection before the call was forwarded")
    spans.end_call(tel, cs, CallRecord(cs.caller, STREAM_CALL, outcome, cs.start_ns, cost_micros=0, usage_source="",
                                       budget_remaining_micros=None,
                   rewrites=[], repairs=[], refusal="run_calls", end_ns=T0 + 2))
    seen.refs.append(cs.ref)


def tool_spans(tel: Telemetry, seen: Seen) -> None:
    run = spans.new_run_trace(start_ns=T0)
    link = spans.SpanRef(0x1234, 0x5678)
    for result, is_error in (('{"ok": true}', False), ("Error: no such city", True), (None, False)):
        seen.refs.append(spans.tool_span(tel, ToolRecord(CALLER, "get_weather", "call_1", '{"city":"x"}', result, T0,
                                                         T0 + 7, is_error=is_error,
                                                         description="Weather"), run_trace=run, link=link))


def mcp_requests(tel: Telemetry, seen: Seen) -> None:
    run = spans.new_run_trace(start_ns=T0)
    req = mcp.McpRequest("files", "tools/call", "1", "mcp.local", 8080, session_id="s1", tool="read",
                         arguments='{"path": "/a"}')
    in_run = spans.Lineage(run_trace=run)
    mcp.record_request(tel, mcp.McpRecord(CALLER, req, mcp.McpOutcome(status=200, result="contents"), T0, T0 + 3,
                                          in_run, call_id="call_2", link=spans.SpanRef(0x99, 0x98), capture=True))
    mcp.record_request(tel, mcp.McpRecord(CALLER, mcp.McpRequest("files", "tools/list", "2", "mcp.local", 8080),
                                          mcp.McpOutcome(status=200, rpc_code=-32601, rpc_message="nope"), T0, T0 + 4,
                                          in_run))


def run_roots(tel: Telemetry, seen: Seen) -> None:
    """A run's root span, with the ids its start fixed: its own trace, and inside an
    agent's trace that was sampled and one that was not; ended ok, failed, at a ceiling,
    idle and unnamed."""
    caller = Caller("acme", "run_02", "header", agent_name="planner", conversation_id="conv-1")
    totals = {"model_calls": 3, "tool_calls": 2, "failures": 1, "tool_failures": 0, "input_tokens": 900,
              "output_tokens": 60, "cost_micros": 4_200, "cache_read_tokens": 300, "cost_saved_micros": 50,
              "cache_write_premium_micros": 5, "repairs": 1}
    agent = 0x0AF7651916CD43DD8448EB211C80319C
    for parent, status in ((None, "ended"), (TraceParent(agent, 0xB7AD6B7169203331, True), "error"),
                           (TraceParent(agent, 0xB7AD6B7169203332, False), "ceiling")):
        run = spans.new_run_trace(parent, start_ns=T0)
        spans.end_run(tel, caller, run, totals, status, end_ns=T0 + 50_000_000)
        seen.refs.append((run.trace_id, run.span_id))
    spans.end_run(tel, dataclasses.replace(CALLER, agent_name=None), spans.new_run_trace(start_ns=T0),
                  {"model_calls": 1}, "idle_timeout", end_ns=T0 + 1)
    # With its anatomy: tools declared, called and unused are sequences.
    anatomy = {"anatomy|part|tools|tokens": 40, "anatomy|part|tools|micros": 120, "anatomy|part|new|tokens": 9,
               "anatomy|part|new|micros": 27, "anatomy|def|get_weather|bytes": 30, "anatomy|def|search|bytes": 10,
               "anatomy|called|get_weather": 2}
    run = spans.new_run_trace(start_ns=T0)
    spans.end_run(tel, caller, run, {"model_calls": 1, **anatomy}, "ended", end_ns=T0 + 2)
    seen.refs.append((run.trace_id, run.span_id))


SCENARIOS: list[Scenario] = [json_call, stream_call_in_run, traceparent_call, unsampled_parent, refused_call,
                             abandoned_call, tool_spans, mcp_requests, run_roots]
# (environment the SDK reads when the tracer provider is built, expected spans: all, or none)
SETUPS = {
    "defaults": {},
    # The SDK's limits: attributes dropped oldest first and counted, strings cut.
    "limits": {"OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT": "9", "OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT": "12"},
    # Any sampler but the default is asked, as the SDK's tracer asks it.
    "ratio sampler": {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.5"},
    "always off": {"OTEL_TRACES_SAMPLER": "always_off"},
    "sdk disabled": {"OTEL_SDK_DISABLED": "true"},
}


@pytest.fixture(params=list(SETUPS), ids=list(SETUPS))
def tel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Telemetry, Any]]:
    for key, value in SETUPS[request.param].items():
        monkeypatch.setenv(key, value)
    memory = InMemorySpanExporter()
    made = setup_telemetry(TelemetryConfig(capture_content="SPAN_ONLY"), span_exporters=[], environ={},
                           extra_exporters=(memory,))
    yield made, memory
    made.shutdown()


def _run(tel: Telemetry, memory: InMemorySpanExporter, scenario: Scenario,
         path: Any) -> tuple[Seen, list[ReadableSpan]]:
    tel.lean = path
    memory.clear()
    random.seed(20261201)  # the same ids on both paths: the tracer's RandomIdGenerator draws them
    seen = Seen()
    scenario(tel, seen)
    return seen, list(memory.get_finished_spans())


def _exemplar(ctx: Context) -> SpanContext:
    return trace.get_current_span(ctx).get_span_context()


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.__name__ for s in SCENARIOS])
def test_lean_spans_export_as_the_sdk_spans(tel: tuple[Telemetry, Any], scenario: Scenario,
                                            request: pytest.FixtureRequest) -> None:
    telemetry, memory = tel
    lean = telemetry.lean
    # A disabled SDK gives no SDK tracer: the public path (its no-op tracer) is taken.
    assert isinstance(lean, LeanTracer) or request.node.callspec.id.startswith("sdk disabled")
    expected_seen, expected = _run(telemetry, memory, scenario, SdkReference(telemetry.tracer))
    seen, got = _run(telemetry, memory, scenario, lean)
    telemetry.lean = lean

    assert len(got) == len(expected)
    assert encode_spans(got).SerializeToString() == encode_spans(expected).SerializeToString()
    assert [json.dumps(span_record(s)) for s in got] == [json.dumps(span_record(s)) for s in expected]
    assert [encode_span(s, {}) for s in got] == [encode_span(s, {}) for s in expected]
    assert [s.dropped_attributes for s in got] == [s.dropped_attributes for s in expected]
    assert seen.refs == expected_seen.refs
    assert [_exemplar(c) for c in seen.contexts] == [_exemplar(c) for c in expected_seen.contexts]


def test_the_comparison_compares_spans(tel: tuple[Telemetry, Any], request: pytest.FixtureRequest) -> None:
    """The spans the comparison above compares are there (or, by the setup, not)."""
    telemetry, memory = tel
    counts = [len(_run(telemetry, memory, scenario, telemetry.lean)[1]) for scenario in SCENARIOS]
    setup = request.node.callspec.id
    every = [1, 1, 1, 0, 1, 1, 3, 2, 4]  # the unsampled agent's run records nothing
    if setup in ("defaults", "limits"):
        assert counts == every
    elif setup == "ratio sampler":
        assert 0 < sum(counts) < sum(every)
    else:
        assert counts == [0] * len(SCENARIOS)


class _Named(tuple[str, str]):
    """A tuple subclass: not one of the types the lean path keeps as it is."""


# Attribute values a span may end with, each as the SDK's span would store it.
VALUES: dict[str, AttributeValue | Any] = {
    "str": "x", "int": 7, "float": 1.5, "bool": True, "empty tuple": (),
    "tuple of str": ("a", "b"), "tuple of bool": (True, False),
    "tuple of int and str": (1, "a"), "tuple of int and bool": (1, True), "tuple with None": ("a", None),
    "list": ["a", "b"], "None": None, "mapping": {"k": 1}, "tuple subclass": _Named(("a", "b")),
    "bytes": b"raw", "nested tuple": (("a",),),
}
KEPT_AS_IS = {"str", "int", "float", "bool", "empty tuple", "tuple of str", "tuple of bool"}


@pytest.mark.parametrize("kind", list(VALUES))
def test_a_span_keeps_attributes_as_the_sdk_stores_them(kind: str) -> None:
    """The lean path hands the SDK's processors a value only where the SDK would store it
    unchanged; any other value goes through the SDK's own cleaning (dropped, or converted)."""
    telemetry = setup_telemetry(TelemetryConfig(), span_exporters=[], environ={})
    try:
        lean = telemetry.lean
        assert isinstance(lean, LeanTracer)
        attrs: dict[str, Any] = {"first": "kept", "value": VALUES[kind]}
        stored = lean._attributes(attrs)
        sdk = BoundedAttributes(None, dict(attrs), immutable=True)
        assert dict(stored) == dict(sdk)
        assert [type(v) for v in dict(stored).values()] == [type(v) for v in dict(sdk).values()]
        assert (stored is attrs) == (kind in KEPT_AS_IS)
    finally:
        telemetry.shutdown()
