"""Spans and metrics for model calls, tool executions and runs: the API the handler calls.

Every function here that records telemetry catches its own failures and logs them:
telemetry never fails or slows a request. Metric labels a caller steers are bounded
(tracing/labels.py); span attributes keep their value, cut to tracing/attributes.py's
limits. A request with a `traceparent` joins the agent's trace; otherwise a run's spans
are children of its root `invoke_agent` span, emitted with the run's totals when it ends.

    cs = start_call(tel, caller, call, Peer("openai", "api.openai.com", 443), Lineage(run_trace=run_trace))
    end_call(tel, cs, CallRecord(caller, call, outcome, cs.start_ns, cost_micros=1200, usage_source="reported"))
Parenting and summaries: docs/telemetry.md, "Spans and metrics".
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

from opentelemetry.context import Context
from opentelemetry.trace import (
    Link,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    TraceState,
)
from opentelemetry.util.types import AttributeValue

from proxy.model import Call, Caller, CallRecord, Flushed, Outcome, Repair, ToolRecord, frozen
from tracing import anatomy as anatomy_attrs
from tracing import attributes as A
from tracing import digests, lean, summaries
from tracing.lean import LeanSpan
from tracing.metrics import LABEL_CACHE_ENTRIES, CallKey, CallLabels, Instruments, LabelCache
from tracing.setup import Telemetry
from tracing.traceparent import TraceParent, parse_traceparent

__all__ = [
    "CallSpan",
    "Left",
    "Lineage",
    "Peer",
    "RunTrace",
    "SpanRef",
    "TraceParent",
    "count_refusal",
    "end_call",
    "end_run",
    "new_run_trace",
    "parse_traceparent",
    "record_flushed",
    "record_guard_action",
    "record_input_cost",
    "record_ledger_overshoot",
    "record_remaining",
    "redact_keylike",
    "run_span_name",
    "start_call",
    "tool_span",
]

log = logging.getLogger(__name__)

Attrs = dict[str, AttributeValue]

# Things that look like API keys, in case an upstream error message echoes one.
_KEYLIKE = re.compile(r"\b(?:sk|sm|gsk|xai)[-_][A-Za-z0-9_\-*]{8,}|\bAIza[0-9A-Za-z_\-]{20,}")
# Every match of _KEYLIKE holds one of these ("gsk-" holds "sk-"). `re` has no literal to
# scan for in that pattern and tries it at every position (~20 ns a character: 3 us for a
# call's summaries, 260 us for a 12.6 KB captured tool result); `in` finds a literal at C speed.
_KEYLIKE_MARKS: Final = ("sk-", "sk_", "sm-", "sm_", "xai-", "xai_", "AIza")
_STATUS_LIMIT: Final = 200
_CAPTURE_KEYS: Final = {
    "input_messages": A.GEN_AI_INPUT_MESSAGES,
    "output_messages": A.GEN_AI_OUTPUT_MESSAGES,
    "system_instructions": A.GEN_AI_SYSTEM_INSTRUCTIONS,
    "output_messages_repaired": A.SPANMETER_OUTPUT_MESSAGES_REPAIRED,
}
_RUN_TOTALS: Final = {
    "model_calls": A.SPANMETER_RUN_MODEL_CALLS,
    "tool_calls": A.SPANMETER_RUN_TOOL_CALLS,
    "failures": A.SPANMETER_RUN_FAILURES,
    "tool_failures": A.SPANMETER_RUN_TOOL_FAILURES,
    "tool_results_missing": A.SPANMETER_RUN_TOOL_RESULTS_MISSING,
    "input_tokens": A.GEN_AI_USAGE_INPUT_TOKENS,  # the run's totals, as invoke_agent spans carry them
    "output_tokens": A.GEN_AI_USAGE_OUTPUT_TOKENS,
    "repairs": A.SPANMETER_RUN_REPAIRS,
    "ceilings_hit": A.SPANMETER_RUN_CEILINGS_HIT,
    "cache_read_tokens": A.SPANMETER_RUN_CACHE_READ_INPUT_TOKENS,
}
_FAILED_RUN: Final = frozenset({"error", "failed"})
_NO_RESULT: Final = "no result before the run ended"
_NO_CONTEXT: Final = Context()  # never changed: OTel contexts are copied on every set


# --- ids -------------------------------------------------------------------------------


@frozen
class RunTrace:
    """The ids of a run's root span, fixed when the run starts. `encode()` to store it."""

    trace_id: int
    span_id: int
    start_ns: int
    parent_span_id: int | None = None  # the agent's span when the run began in its trace
    sampled: bool = True
    # Every call of a run asks for it twice (the admission's candidate, the stored ids' check).
    _text: str = field(default="", init=False, repr=False, compare=False)

    def encode(self) -> str:
        if not self._text:
            parent = f"{self.parent_span_id:016x}" if self.parent_span_id else ""
            flag = "1" if self.sampled else "0"
            text = f"{self.trace_id:032x}-{self.span_id:016x}-{self.start_ns}-{parent}-{flag}"
            object.__setattr__(self, "_text", text)  # frozen: the text of fixed ids, kept
        return self._text

    @classmethod
    def decode(cls, text: str) -> RunTrace:
        trace_id, span_id, start, parent, flag = text.split("-")
        return cls(
            int(trace_id, 16),
            int(span_id, 16),
            int(start),
            int(parent, 16) if parent else None,
            flag == "1",
        )


@frozen
class Lineage:
    """Where a request's spans hang: under the agent's span when it sent a traceparent
    (`parent`), else under the run's root span (`run_trace`); a root without either."""

    parent: TraceParent | None = None
    run_trace: RunTrace | None = None


NO_LINEAGE: Final = Lineage()


@frozen
class Peer:
    """The upstream a model call goes to: `gen_ai.provider.name`, `server.address`, `server.port`."""

    provider: str
    address: str = ""
    port: int = 0


@frozen
class SpanRef:
    """Where a span is, e.g. the chat span that emitted a tool call (kept in run state)."""

    trace_id: int
    span_id: int


def new_run_trace(parent: TraceParent | None = None, *, start_ns: int | None = None) -> RunTrace:
    """Ids for a new run's root span: a new trace, or the agent's trace when it sent one."""
    from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

    ids = RandomIdGenerator()
    return RunTrace(
        trace_id=parent.trace_id if parent else ids.generate_trace_id(),
        span_id=ids.generate_span_id(),
        start_ns=time.time_ns() if start_ns is None else start_ns,
        parent_span_id=parent.span_id if parent else None,
        sampled=parent.sampled if parent else True,
    )


def _parent_span(parent: TraceParent | None, run_trace: RunTrace | None) -> SpanContext | None:
    """Explicit, never the ambient context: a server span of the proxy is not our parent."""
    if parent is not None:
        return SpanContext(
            parent.trace_id,
            parent.span_id,
            is_remote=True,
            trace_flags=TraceFlags(TraceFlags.SAMPLED if parent.sampled else TraceFlags.DEFAULT),
            trace_state=TraceState.from_header([parent.tracestate]) if parent.tracestate else None,
        )
    if run_trace is not None:
        return SpanContext(
            run_trace.trace_id,
            run_trace.span_id,
            is_remote=False,
            trace_flags=TraceFlags(TraceFlags.SAMPLED if run_trace.sampled else TraceFlags.DEFAULT),
        )
    return None


# Every call of a run has the same parent: build it once per run.
_RUN_PARENTS: Final[LabelCache[RunTrace, SpanContext | None]] = LabelCache(lambda run: _parent_span(None, run))


def _call_parent(parent: TraceParent | None, run_trace: RunTrace | None) -> SpanContext | None:
    if parent is None and run_trace is not None:
        return _RUN_PARENTS.get(run_trace)
    return _parent_span(parent, run_trace)


# --- model calls -------------------------------------------------------------------------


@dataclass(slots=True)
class CallSpan:
    """An open model-call span and what end_call needs to finish it.

    `context` holds the span (a NonRecordingSpan of its SpanContext): the parent of child
    spans and the exemplar of the call's metric points."""

    span: LeanSpan
    start_ns: int
    caller: Caller
    provider: str
    server_address: str
    server_port: int
    context: Context = field(default_factory=Context)

    @property
    def ref(self) -> SpanRef | None:
        ctx = self.span.context
        return SpanRef(ctx.trace_id, ctx.span_id) if ctx.is_valid else None


def call_span_name(call: Call) -> str:
    return f"{call.operation} {_name(call.model)}" if call.model else call.operation


def start_call(tel: Telemetry, caller: Caller, call: Call, peer: Peer, lineage: Lineage = NO_LINEAGE, *,
               start_ns: int | None = None) -> CallSpan:
    """Open the CLIENT span of a model call; sampling-relevant attributes are set at start.

    Only its ids and sampling are decided here (tracing/lean.py): the span is built whole
    and handed to the span processors when it ends."""
    start = time.time_ns() if start_ns is None else start_ns
    cs = CallSpan(lean.INVALID, start, caller, peer.provider, peer.address, peer.port, _NO_CONTEXT)
    try:
        cs.span = tel.lean.open(
            call_span_name(call),
            _call_parent(lineage.parent, lineage.run_trace),
            SpanKind.CLIENT,
            _request_attrs(caller, call, peer.provider, peer.address, peer.port),
            start,
        )
        cs.context = cs.span.parent_context()
    except Exception:
        log.exception("start_call failed")
    return cs


def end_call(tel: Telemetry, cs: CallSpan, record: CallRecord) -> None:
    """Finish a model-call span with the call's record and record the call's metrics.

    `record.capture` is plain data (`input_messages`, `output_messages`,
    `system_instructions` in the semconv JSON shapes, and `output_messages_repaired` when
    repair changed the answer); it is recorded only when the process runs with SPAN_ONLY,
    and with it the tools' descriptions and schemas in `gen_ai.tool.definitions` (names
    only otherwise). `delivered_text`, `delivered_arguments` make the readable summary say
    what the agent received. `chunk_gaps_s` is recorded as their mean, one
    `time_per_output_chunk` point per call. A `refusal` is also counted in
    `spanmeter.limit.rejections`. `saved_micros` and `premium_micros` become the cache
    cost attributes and metrics; `anatomy` the `spanmeter.input.*` attributes (its metrics
    by part and by tool come with its run chain's flushes: `record_flushed`).
    """
    try:
        end = time.time_ns() if record.end_ns is None else record.end_ns
        call, outcome, admit = record.call, record.outcome, record.refusal is None
        attrs = _end_attrs(tel, record)
        content = _content_attrs(tel, record.capture)
        attrs.update(content)
        attrs.update(_call_summary_attrs(record, tel.config.content_cap_bytes, full_tools=bool(content)))
        if record.saved_micros:
            attrs[A.SPANMETER_COST_SAVED_USD] = record.saved_micros / 1e6
        if record.anatomy is not None:
            attrs.update(anatomy_attrs.call_attrs(record.anatomy))
        if record.premium_micros:
            attrs[A.SPANMETER_COST_CACHE_WRITE_PREMIUM_USD] = record.premium_micros / 1e6
        cs.span.set_attributes(attrs)
        if outcome.error_type:
            cs.span.set_status(Status(StatusCode.ERROR, _status_text(outcome.error_message, cs.caller)))
        labels = _call_labels(tel, cs, call, outcome, admit)
        _record_call_metrics(tel, cs, record, labels, end)
        _record_cache_metrics(tel, cs, record, labels)
        if record.refusal:
            _count_refusal(tel, cs.caller, call, cs.provider, record.refusal, cs.context)
        tel.lean.end(cs.span, end)
    except Exception:
        log.exception("end_call failed")


def _count_refusal(tel: Telemetry, caller: Caller, call: Call, provider: str, reason: str, ctx: Context) -> None:
    # A refused call never mints a label value: its model is one already known or `_OTHER`.
    model = _model_labels(call, provider, tel.instruments.labels.model(call.model, admit=False))
    count_refusal(tel, caller, reason, model, ctx)


def count_refusal(tel: Telemetry, caller: Caller, reason: str, labels: Attrs, ctx: Context | None) -> None:
    """One call refused before its upstream, a model's or an MCP tool's, in
    `spanmeter.limit.rejections`: `reason` from the one vocabulary (proxy.model.RefusalReason),
    so a dashboard filtering on a reason sees both; `labels` say which call it was."""
    bounded = {A.SPANMETER_REASON: tel.instruments.labels.refusal(reason), **_tenant(caller), **labels}
    tel.instruments.limit_rejections.add(1, bounded, context=ctx)


def _request_attrs(caller: Caller, call: Call, provider: str, address: str, port: int) -> Attrs:
    # One pass that never inserts None (no filtering afterwards); the order is the
    # attributes' order on the wire. Sequences go in as tuples: the SDK stores tuples.
    attrs: Attrs = {
        A.GEN_AI_OPERATION_NAME: call.operation,
        A.GEN_AI_PROVIDER_NAME: provider,
    }
    if call.model is not None:
        attrs[A.GEN_AI_REQUEST_MODEL] = _name(call.model)
    if address:
        attrs[A.SERVER_ADDRESS] = address
    if port:
        attrs[A.SERVER_PORT] = port
    if call.stream:
        attrs[A.GEN_AI_REQUEST_STREAM] = True
    _put_request_params(attrs, call)
    if call.output and call.output.kind != "tool":
        attrs[A.GEN_AI_OUTPUT_TYPE] = "json"
    if provider == "openai" and call.openai_api_type is not None:
        attrs[A.OPENAI_API_TYPE] = call.openai_api_type
    attrs[A.SPANMETER_TENANT_ID] = caller.tenant
    attrs[A.SPANMETER_RUN_ID] = _name(caller.run_id)
    attrs[A.SPANMETER_RUN_ID_SOURCE] = caller.run_id_source
    _put_conversation(attrs, caller)
    return attrs


def _put_conversation(attrs: Attrs, caller: Caller) -> None:
    """The caller's conversation id, when it sent one (never invented: semconv), and the
    same value as Phoenix's and Langfuse's session key."""
    if caller.conversation_id is not None:
        attrs[A.GEN_AI_CONVERSATION_ID] = attrs[A.SESSION_ID] = caller.conversation_id


def _put_request_params(attrs: Attrs, call: Call) -> None:
    """The sampling parameters the request set, each only when present."""
    if call.max_output_tokens is not None:
        attrs[A.GEN_AI_REQUEST_MAX_TOKENS] = call.max_output_tokens
    if call.temperature is not None:
        attrs[A.GEN_AI_REQUEST_TEMPERATURE] = call.temperature
    if call.top_p is not None:
        attrs[A.GEN_AI_REQUEST_TOP_P] = call.top_p
    if call.top_k is not None:
        attrs[A.GEN_AI_REQUEST_TOP_K] = _int_if_whole(call.top_k)
    if call.seed is not None:
        attrs[A.GEN_AI_REQUEST_SEED] = call.seed
    if call.choice_count is not None and call.choice_count != 1:
        attrs[A.GEN_AI_REQUEST_CHOICE_COUNT] = call.choice_count
    if call.stop_sequences:
        attrs[A.GEN_AI_REQUEST_STOP_SEQUENCES] = _names(call.stop_sequences)
    if call.frequency_penalty is not None:
        attrs[A.GEN_AI_REQUEST_FREQUENCY_PENALTY] = call.frequency_penalty
    if call.presence_penalty is not None:
        attrs[A.GEN_AI_REQUEST_PRESENCE_PENALTY] = call.presence_penalty


def _end_attrs(tel: Telemetry, record: CallRecord) -> Attrs:
    """Response, usage, spanmeter and content attributes, in one dict without Nones."""
    call, outcome = record.call, record.outcome
    attrs: Attrs = {}
    if outcome.response_id is not None:
        attrs[A.GEN_AI_RESPONSE_ID] = _name(outcome.response_id)
    if outcome.response_model is not None:
        attrs[A.GEN_AI_RESPONSE_MODEL] = _name(outcome.response_model)
    if outcome.finish_reasons:
        attrs[A.GEN_AI_RESPONSE_FINISH_REASONS] = _names(outcome.finish_reasons)
    if call.stream and outcome.first_chunk_s is not None:
        attrs[A.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK] = outcome.first_chunk_s
    _put_usage(attrs, tel, outcome)
    if outcome.error_type is not None:
        attrs[A.ERROR_TYPE] = _name(outcome.error_type)
    if outcome.notes:
        attrs[A.SPANMETER_OBSERVER_NOTES] = _names(outcome.notes, A.SPAN_TEXT_LIMIT)
    if record.cost_micros is not None:
        attrs[A.SPANMETER_COST_USD] = record.cost_micros / 1e6
    if record.usage_source:
        attrs[A.SPANMETER_USAGE_SOURCE] = record.usage_source
    if record.budget_remaining_micros is not None:
        attrs[A.SPANMETER_BUDGET_REMAINING_USD] = record.budget_remaining_micros / 1e6
    rewrites, repairs, refusal = record.rewrites, record.repairs, record.refusal
    if rewrites:
        attrs[A.SPANMETER_REWRITES] = tuple(_text(r.header_value()) for r in rewrites[: A.SPAN_LIST_LIMIT])
    if repairs:
        attrs[A.SPANMETER_REPAIRS] = tuple(_text(repair_text(r)) for r in repairs[: A.SPAN_LIST_LIMIT])
    if refusal is not None:
        attrs[A.SPANMETER_REFUSAL_REASON] = _text(refusal)
    return attrs


def _put_usage(attrs: Attrs, tel: Telemetry, outcome: Outcome) -> None:
    usage = outcome.usage
    if usage.input_tokens is not None:
        attrs[A.GEN_AI_USAGE_INPUT_TOKENS] = usage.input_tokens
    if usage.output_tokens is not None:
        attrs[A.GEN_AI_USAGE_OUTPUT_TOKENS] = usage.output_tokens
    if usage.cache_read_tokens is not None:
        attrs[A.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS] = usage.cache_read_tokens
    if usage.cache_write_tokens is not None:
        cache_write = (
            A.LATEST_GEN_AI_USAGE_CACHE_WRITE_INPUT_TOKENS
            if tel.config.semconv_latest
            else A.GEN_AI_USAGE_CACHE_CREATION_INPUT_TOKENS
        )
        attrs[cache_write] = usage.cache_write_tokens
    if usage.reasoning_tokens is not None:
        attrs[A.GEN_AI_USAGE_REASONING_OUTPUT_TOKENS] = usage.reasoning_tokens


def repair_text(repair: Repair) -> str:
    """`output: fence, trailing_comma` plus the schema verdict when there was one."""
    text = f"{repair.target}: {', '.join(repair.actions)}"
    if repair.valid is False:
        text += f" (invalid: {'; '.join(repair.problems)})" if repair.problems else " (invalid)"
    return text


def _content_attrs(tel: Telemetry, capture: Mapping[str, Any] | None) -> Attrs:
    if tel.config.capture_content != "SPAN_ONLY" or not capture:
        return {}
    cap = tel.config.content_cap_bytes
    return {
        attr: digests.capped_json(capture[key], cap)
        for key, attr in _CAPTURE_KEYS.items()
        if capture.get(key) is not None
    }


def _call_summary_attrs(record: CallRecord, cap: int, *, full_tools: bool) -> Attrs:
    """What a UI shows of a model call whatever is captured: the tools offered
    (`gen_ai.tool.definitions`, `full_tools` under content capture) and readable
    input/output summaries (digests, not content)."""
    caller, call = record.caller, record.call
    attrs: Attrs = {}
    if call.tools:
        attrs[A.GEN_AI_TOOL_DEFINITIONS] = _tool_definitions(call, cap, full=full_tools)
    attrs[A.INPUT_VALUE] = _redact(summaries.call_input(call), caller)
    attrs[A.INPUT_MIME_TYPE] = A.MIME_TEXT
    attrs[A.OUTPUT_VALUE] = _redact(summaries.call_output(record.outcome, record.repairs, record.delivered_text,
                                                                 record.delivered_arguments), caller)
    attrs[A.OUTPUT_MIME_TYPE] = A.MIME_TEXT
    return attrs


# (tool names, cap) -> `gen_ai.tool.definitions` without content: made once per tool list.
_TOOL_NAMES: dict[tuple[tuple[str, ...], int], str] = {}
_TOOL_NAMES_KEPT = 4096  # characters of names a kept list holds at most (1024 lists: ~8 MB at worst)


def _tool_definitions(call: Call, cap: int, *, full: bool) -> str:
    """The tools the request offers, per the v1.41.1 tool-definitions schema, as JSON of at
    most `cap` bytes: `type` and `name` (the required properties) always; `description`
    and `parameters` only when `full` (content capture), as the convention advises
    against populating them by default."""
    if not full:  # names only: the same few tool lists, call after call
        names = tuple(t.name for t in call.tools[: A.SPAN_LIST_LIMIT])
        found = _TOOL_NAMES.get((names, cap))
        if found is None:
            found = digests.capped_json([{"type": "function", "name": _name(name)} for name in names], cap)
            if sum(map(len, names)) <= _TOOL_NAMES_KEPT:  # a caller's long names are not kept
                if len(_TOOL_NAMES) >= 1024:
                    _TOOL_NAMES.clear()
                _TOOL_NAMES[(names, cap)] = found
        return found
    tools: list[dict[str, Any]] = []
    for t in call.tools[: A.SPAN_LIST_LIMIT]:
        tool: dict[str, Any] = {"type": "function", "name": _name(t.name)}
        if full and isinstance(t.description, str):
            tool["description"] = t.description
        if full and isinstance(t.parameters, dict):
            tool["parameters"] = t.parameters
        tools.append(tool)
    return digests.capped_json(tools, cap)


def _call_labels(tel: Telemetry, cs: CallSpan, call: Call, outcome: Outcome, admit: bool) -> CallLabels:
    """The call's metric labels, bounded; `admit=False` for a refused call: its labels take
    only values already known."""
    bounds = tel.instruments.labels
    key: CallKey = (
        cs.caller.tenant,
        call.operation,
        cs.provider,
        bounds.model(call.model, admit=admit),
        bounds.model(outcome.response_model, admit=admit),
        cs.server_address,
        cs.server_port,
        bounds.error_type(outcome.error_type, admit=admit),
    )
    return tel.instruments.call_labels.get(key)


def _record_call_metrics(tel: Telemetry, cs: CallSpan, record: CallRecord, labels: CallLabels, end_ns: int) -> None:
    """Recorded with the call span as context so histogram points carry exemplars."""
    m, ctx, tenant = tel.instruments, cs.context, cs.caller.tenant
    bounds = m.labels
    call, outcome, chunk_gaps_s, cost_micros = record.call, record.outcome, record.chunk_gaps_s, record.cost_micros
    m.operation_duration.record(max(0, end_ns - cs.start_ns) / 1e9, labels.timed, context=ctx)
    usage = outcome.usage
    if usage.input_tokens is not None:
        m.token_usage.record(usage.input_tokens, labels.input_tokens, context=ctx)
    if usage.output_tokens is not None:
        m.token_usage.record(usage.output_tokens, labels.output_tokens, context=ctx)
    if call.stream and outcome.first_chunk_s is not None:
        m.time_to_first_chunk.record(outcome.first_chunk_s, labels.base, context=ctx)
    if chunk_gaps_s:
        # One point per call, the mean gap, instead of one per chunk: each point costs
        # the SDK ~10 us (label cleaning, hashing, exemplar offer), so per-chunk points
        # made a call's telemetry cost grow with its stream (49 points for 50 chunks,
        # ~0.5 ms). No exemplar: the duration histogram already links to the call span.
        m.time_per_output_chunk.record(sum(chunk_gaps_s) / len(chunk_gaps_s), labels.base)
    if cost_micros:
        m.cost.add(cost_micros / 1e6, labels.money, context=ctx)
    for rewrite in record.rewrites:
        m.rewrites.add(1, m.kind_labels.get((bounds.kind(rewrite.kind), tenant)), context=ctx)
    for repair in record.repairs:
        for action in repair.actions:
            m.repairs.add(1, m.kind_labels.get((bounds.kind(action), tenant)), context=ctx)


def _record_cache_metrics(tel: Telemetry, cs: CallSpan, record: CallRecord, labels: CallLabels) -> None:
    """Prompt-cache tokens and savings, labelled as cost is. A cache-read point (0 when
    the provider reported none) goes with every call that reported input tokens, so the
    cached share of input exists for every model, not only those that hit the cache."""
    usage = record.outcome.usage
    if usage.input_tokens is None:
        return
    m = tel.instruments
    saved_micros, premium_micros = record.saved_micros, record.premium_micros
    m.cache_tokens.add(usage.cache_read_tokens or 0, labels.cache_read, context=cs.context)
    if usage.cache_write_tokens:
        m.cache_tokens.add(usage.cache_write_tokens, labels.cache_write, context=cs.context)
    if saved_micros > 0:
        m.cost_saved.add(saved_micros / 1e6, labels.money, context=cs.context)
    if premium_micros > 0:
        m.cache_write_premium.add(premium_micros / 1e6, labels.money, context=cs.context)


def record_input_cost(m: Instruments, key: tuple[str, str, str | None], micros: Iterable[tuple[str, int]]) -> None:
    """Input cost by kind of part (kind, micro-USD), labelled as cost is (`key`: tenant,
    provider, the model's label): each label set's series is found once and kept (bounded
    as the label caches are)."""
    series = m.input_cost_series.get(key)
    if series is None:
        if len(m.input_cost_series) >= LABEL_CACHE_ENTRIES:
            m.input_cost_series.clear()
        tenant, provider, model = key
        money = {A.SPANMETER_TENANT_ID: tenant}
        if provider:
            money[A.GEN_AI_PROVIDER_NAME] = provider
        if model is not None:
            money[A.GEN_AI_REQUEST_MODEL] = model
        series = m.input_cost_series[key] = {
            kind: m.input_cost.series({**money, A.SPANMETER_INPUT_PART: kind}) for kind in anatomy_attrs.KINDS}
    m.input_cost.add_to([(series[kind], value / 1e6) for kind, value in micros if kind in series])


def record_flushed(tel: Telemetry, tenant: str, flushed: Flushed) -> None:
    """What a run's chain summed since its last flush (proxy/anatomy/shares.py: it sums its
    calls and prices its tool results, and they arrive with its flushes, not per call): the
    input cost by kind of part, by the provider and model its calls were labelled with, and
    what its tool results cost by tool name."""
    m = tel.instruments
    by_labels: dict[tuple[str, ...], list[tuple[str, int]]] = {}
    for labels, kind, _, _, micros in flushed.kinds:
        by_labels.setdefault(labels, []).append((kind, micros))
    for labels, by_kind in by_labels.items():
        provider, model = labels if len(labels) == 2 else ("", "")
        record_input_cost(m, (tenant, provider, m.labels.model(model or None)), by_kind)
    if not flushed.tools:
        return
    found = m.tool_context_series
    points = []
    for tool, value in flushed.tools:
        series = found.get((tenant, tool))
        if series is None:
            if len(found) >= LABEL_CACHE_ENTRIES:
                found.clear()
            series = found[(tenant, tool)] = m.tool_context_cost.series(
                {A.SPANMETER_TENANT_ID: tenant, A.GEN_AI_TOOL_NAME: m.labels.tool(tool)})
        points.append((series, value / 1e6))
    m.tool_context_cost.add_to(points)


def _model_labels(call: Call, provider: str, model_label: str | None) -> Attrs:
    """Operation, provider and the request model's (bounded) label value."""
    return _present(
        {
            A.GEN_AI_OPERATION_NAME: call.operation,
            A.GEN_AI_PROVIDER_NAME: provider or None,
            A.GEN_AI_REQUEST_MODEL: model_label,
        }
    )


# --- tools -------------------------------------------------------------------------------


def tool_span(
    tel: Telemetry,
    record: ToolRecord,
    *,
    parent: TraceParent | None = None,
    run_trace: RunTrace | None = None,
    link: SpanRef | None = None,
) -> SpanRef | None:
    """Emit `execute_tool {name}` for a tool call observed across two requests (`record`).

    Runs from the delivery of the response that carried the call (`record.start_ns`) to the
    arrival of the request that carried its result (`record.end_ns`). `result=None`: the run
    ended without an answer (`error.type=tool_result_missing`). `link`: the chat span
    that made the call.
    """
    try:
        caller, name, result = record.caller, record.name, record.result
        start_ns, end_ns = record.start_ns, record.end_ns
        verdict = digests.tool_result_digest(result, is_error=record.is_error) if result is not None else None
        error_type = A.ERROR_TOOL_RESULT_MISSING if verdict is None else None if verdict.ok else A.ERROR_TOOL
        content = record.capture and tel.config.capture_content == "SPAN_ONLY"
        cap = tel.config.content_cap_bytes if content else None
        attrs = _tool_attrs(record, verdict, cap)
        links = [Link(SpanContext(link.trace_id, link.span_id, is_remote=False))] if link else None
        span = tel.lean.open(
            f"{A.OPERATION_EXECUTE_TOOL} {_name(name)}",
            _parent_span(parent, run_trace),
            SpanKind.INTERNAL,
            {**attrs, A.ERROR_TYPE: error_type} if error_type else attrs,
            start_ns,
            links or (),
        )
        if error_type:
            why = _NO_RESULT if verdict is None else verdict.digest
            span.set_status(Status(StatusCode.ERROR, _status_text(why, caller)))
        _record_tool_metrics(tel, record, error_type, verdict, span.parent_context())
        tel.lean.end(span, end_ns)
        ref = span.context
        return SpanRef(ref.trace_id, ref.span_id) if ref.is_valid else None
    except Exception:
        log.exception("tool_span failed")
        return None


def _tool_attrs(record: ToolRecord, verdict: digests.ResultDigest | None, content_cap: int | None) -> Attrs:
    """`content_cap`: bytes of opt-in content per attribute, None when content is not captured.

    The argument and result digests are also the span's readable input and output
    (`input.value`, `output.value`); the output is left to the captured result when there
    is one, which UIs that read gen_ai.* show there."""
    caller, arguments, result, description = record.caller, record.arguments, record.result, record.description
    args_digest = _redact(digests.tool_arguments_digest(arguments), caller)
    attrs: dict[str, AttributeValue | None] = {
        A.GEN_AI_OPERATION_NAME: A.OPERATION_EXECUTE_TOOL,
        A.GEN_AI_TOOL_NAME: _name(record.name),
        A.GEN_AI_TOOL_CALL_ID: _name(record.call_id),
        A.GEN_AI_TOOL_TYPE: _name(record.tool_type),
        A.GEN_AI_TOOL_DESCRIPTION: _text(description) if description is not None else None,
        A.SPANMETER_TENANT_ID: caller.tenant,
        A.SPANMETER_RUN_ID: _name(caller.run_id),
        A.SPANMETER_TOOL_TIMING: A.TOOL_TIMING_INFERRED,
        A.SPANMETER_TOOL_ARGUMENTS_DIGEST: args_digest,
        A.SPANMETER_TOOL_ARGUMENTS_SHA256: digests.canonical_sha256(arguments),
        A.SPANMETER_TOOL_ARGUMENTS_SIZE: len(arguments.encode()),
        A.SPANMETER_TOOL_OK: verdict.ok if verdict else False,
        A.GEN_AI_CONVERSATION_ID: caller.conversation_id,
        A.SESSION_ID: caller.conversation_id,
        A.INPUT_VALUE: args_digest,
        A.INPUT_MIME_TYPE: A.MIME_TEXT,
    }
    if content_cap is not None:
        attrs[A.GEN_AI_TOOL_CALL_ARGUMENTS] = _cap_bytes(_redact(arguments, caller), content_cap)
    if result is not None and verdict is not None:
        attrs[A.SPANMETER_TOOL_RESULT_DIGEST] = _redact(verdict.digest, caller)
        attrs[A.SPANMETER_TOOL_RESULT_SHA256] = digests.canonical_sha256(result)
        attrs[A.SPANMETER_TOOL_RESULT_SIZE] = len(result.encode())
        if content_cap is not None:
            attrs[A.SPANMETER_TOOL_RESULT_PREVIEW] = _redact(verdict.preview, caller)
            if verdict.ok:  # semconv: the result only if execution succeeded
                attrs[A.GEN_AI_TOOL_CALL_RESULT] = _cap_bytes(_redact(result, caller), content_cap)
    if A.GEN_AI_TOOL_CALL_RESULT not in attrs:
        summary = _NO_RESULT if verdict is None else f"{'✓' if verdict.ok else '✗'} {verdict.digest}"
        attrs[A.OUTPUT_VALUE] = _redact(summary, caller)
        attrs[A.OUTPUT_MIME_TYPE] = A.MIME_TEXT
    return _present(attrs)


def _record_tool_metrics(
    tel: Telemetry, record: ToolRecord, error_type: str | None, verdict: digests.ResultDigest | None, ctx: Context,
) -> None:
    caller, name, seconds = record.caller, record.name, (record.end_ns - record.start_ns) / 1e9
    # Tool names come from a model's answer to an accepted call: admitted up to the bound.
    tool = tel.instruments.labels.tool(name)
    labels: Attrs = {A.GEN_AI_OPERATION_NAME: A.OPERATION_EXECUTE_TOOL, A.GEN_AI_TOOL_NAME: tool}
    labels.update(_tenant(caller))
    timed = {**labels, A.ERROR_TYPE: error_type} if error_type else labels
    tel.instruments.execute_tool_duration.record(max(0.0, seconds), timed, context=ctx)
    outcome = "missing" if verdict is None else "ok" if verdict.ok else "failed"
    tel.instruments.tool_calls.add(1, {**labels, A.SPANMETER_OUTCOME: outcome}, context=ctx)


# --- runs --------------------------------------------------------------------------------


def end_run(
    tel: Telemetry,
    caller: Caller,
    run_trace: RunTrace,
    totals: Mapping[str, int],
    status: str,
    *,
    end_ns: int | None = None,
) -> None:
    """Emit the run's root span with the ids fixed at its start: the agent invocation the
    run is (semconv v1.41.1, `invoke_agent {gen_ai.agent.name}`, INTERNAL); and count the
    ended run (`_count_run_end`). Its anatomy is read out of `totals` once, for both.

    `totals` keys: model_calls, tool_calls, failures (failed model calls), tool_failures
    (failed tool results and tool calls never answered; tool_results_missing of them),
    input_tokens and output_tokens (as `gen_ai.usage.*`), cost_micros, repairs, ceilings_hit,
    cache_read_tokens (with input_tokens: the run's cached share of input), cost_saved_micros,
    cache_write_premium_micros (with cost_saved_micros: what caching saved the run, net)
    (others become `spanmeter.run.<key>`).
    `status`: e.g. ok | error | ceiling | idle_timeout; error/failed mark the span ERROR.
    `caller`: the run's agent name and conversation id, if its first call gave them.
    """
    ra: dict[str, Any] | None = None
    try:
        ra = anatomy_attrs.run_anatomy(totals, fold=False)
        attrs = _run_attrs(caller, totals, status, ra)
        _emit_run(tel, caller, run_trace, attrs, status, time.time_ns() if end_ns is None else end_ns)
    except Exception:
        log.exception("end_run failed")
    _count_run_end(tel, caller, totals, ra)


def _run_attrs(caller: Caller, totals: Mapping[str, int], status: str, ra: dict[str, Any] | None) -> Attrs:
    """The root span's attributes (`end_run`), `ra` the run's anatomy (`run_anatomy`'s)."""
    attrs: Attrs = {A.GEN_AI_OPERATION_NAME: A.OPERATION_INVOKE_AGENT}
    if caller.agent_name is not None:
        attrs[A.GEN_AI_AGENT_NAME] = _name(caller.agent_name)
    _put_conversation(attrs, caller)
    attrs.update({
        A.SPANMETER_TENANT_ID: caller.tenant,
        A.SPANMETER_RUN_ID: _name(caller.run_id),
        A.SPANMETER_RUN_ID_SOURCE: caller.run_id_source,
        A.SPANMETER_RUN_STATUS: status,
        **_run_totals(totals),
        **anatomy_attrs.run_attrs(ra),
        A.INPUT_VALUE: summaries.run_input(caller),
        A.INPUT_MIME_TYPE: A.MIME_TEXT,
        A.OUTPUT_VALUE: summaries.run_output(totals, status),
        A.OUTPUT_MIME_TYPE: A.MIME_TEXT,
    })
    return attrs


def _emit_run(tel: Telemetry, caller: Caller, run_trace: RunTrace, attrs: Attrs, status: str, end_ns: int) -> None:
    parent = (
        TraceParent(run_trace.trace_id, run_trace.parent_span_id, run_trace.sampled)
        if run_trace.parent_span_id
        else None
    )
    # Lean like the call spans: the SDK's start_span and end were two thirds of the root
    # span's CPU (bench/bench_percall.py --run-calls 0 --profile). Its ids are the run's,
    # as the tracer's id generator gives them inside `fixed`.
    with tel.ids.fixed(run_trace.trace_id, run_trace.span_id):
        span = tel.lean.open(run_span_name(caller), _parent_span(parent, None), SpanKind.INTERNAL, attrs,
                             run_trace.start_ns)
    if status in _FAILED_RUN:
        span.set_status(Status(StatusCode.ERROR, status))
    tel.lean.end(span, end_ns)


def run_span_name(caller: Caller) -> str:
    """`invoke_agent {agent name}`, or `invoke_agent` when the run's caller named none."""
    op = A.OPERATION_INVOKE_AGENT
    return f"{op} {_name(caller.agent_name)}" if caller.agent_name else op


def _run_totals(totals: Mapping[str, int]) -> Attrs:
    out: Attrs = {}
    for key, value in totals.items():
        if key.startswith("anatomy|"):
            continue  # bounded per call, not per run: the run's anatomy is summarised apart
        if key == "cost_micros":
            out[A.SPANMETER_RUN_COST_USD] = value / 1e6
        elif key == "cost_saved_micros":
            out[A.SPANMETER_RUN_COST_SAVED_USD] = value / 1e6
        elif key == "cache_write_premium_micros":
            out[A.SPANMETER_RUN_COST_CACHE_WRITE_PREMIUM_USD] = value / 1e6
        else:
            out[_RUN_TOTALS.get(key, f"spanmeter.run.{key}")] = value
    if "cost_saved_micros" in totals or "cache_write_premium_micros" in totals:
        net = totals.get("cost_saved_micros", 0) - totals.get("cache_write_premium_micros", 0)
        out[A.SPANMETER_RUN_COST_CACHE_NET_SAVED_USD] = net / 1e6
    cached, total = totals.get("cache_read_tokens"), totals.get("input_tokens")
    if cached is not None and total:
        out[A.SPANMETER_RUN_CACHE_READ_SHARE] = min(1.0, cached / total)
    return out


# --- guard and ledger --------------------------------------------------------------------


def record_guard_action(
    tel: Telemetry,
    caller: Caller,
    action: str,
    *,
    tool_name: str,
    repeats: int,
    cs: CallSpan | None = None,
) -> None:
    """The loop guard reminded (`remind`) or refused (`refuse`); on the call span if given."""
    try:
        if cs is not None:
            guard: Attrs = {A.SPANMETER_GUARD_ACTION: action, A.SPANMETER_GUARD_TOOL: _name(tool_name)}
            cs.span.set_attributes({**guard, A.SPANMETER_GUARD_REPEATS: repeats})
        bounds = tel.instruments.labels
        labels = {
            A.SPANMETER_GUARD_ACTION: bounds.kind(action),
            # A refusal refuses the call it is on: it takes only a tool name already known.
            A.GEN_AI_TOOL_NAME: bounds.tool(tool_name, admit=action != "refuse"),
            **_tenant(caller),
        }
        tel.instruments.guard_actions.add(1, labels, context=cs.context if cs else None)
    except Exception:
        log.exception("record_guard_action failed")


def record_ledger_overshoot(tel: Telemetry, caller: Caller, overshoot_micros: int, *, scope: str = "run") -> None:
    """Settled cost above what was reserved (the estimate was too low)."""
    try:
        if overshoot_micros > 0:
            labels = {A.SPANMETER_SCOPE: scope, **_tenant(caller)}
            tel.instruments.ledger_overshoot.add(overshoot_micros / 1e6, labels)
    except Exception:
        log.exception("record_ledger_overshoot failed")


# --- budgets an agent can see coming ---------------------------------------------------------


class Left(Protocol):
    """What is left of each ceiling that is set (None: not set), as an admission saw it
    (proxy/govern/wrapup.Remaining has this shape; tracing imports nothing of proxy/ but
    its model)."""

    @property
    def run_calls(self) -> int | None: ...
    @property
    def run_cost_micros(self) -> int | None: ...
    @property
    def run_tokens(self) -> int | None: ...
    @property
    def run_seconds(self) -> float | None: ...
    @property
    def day_micros(self) -> int | None: ...
    @property
    def month_micros(self) -> int | None: ...


def record_remaining(cs: CallSpan, left: Left) -> None:
    """What was left of each ceiling that is set when the call was admitted, on its span."""
    try:
        cost, day, month = left.run_cost_micros, left.day_micros, left.month_micros
        attrs = _present({
            A.SPANMETER_REMAINING_RUN_CALLS: left.run_calls,
            A.SPANMETER_REMAINING_RUN_COST_USD: None if cost is None else cost / 1e6,
            A.SPANMETER_REMAINING_RUN_TOKENS: left.run_tokens,
            A.SPANMETER_REMAINING_RUN_SECONDS: left.run_seconds,
            A.SPANMETER_REMAINING_DAY_USD: None if day is None else day / 1e6,
            A.SPANMETER_REMAINING_MONTH_USD: None if month is None else month / 1e6,
        })
        if attrs:
            cs.span.set_attributes(attrs)
    except Exception:
        log.exception("record_remaining failed")


def record_wrap_up(tel: Telemetry, caller: Caller, reason: str, *, cs: CallSpan | None = None) -> None:
    """A wrap-up note went to the model with this call (`reason`: the ceiling whose share it reached)."""
    try:
        if cs is not None:
            cs.span.set_attributes({A.SPANMETER_WRAP_UP_REASON: reason})
        labels = {A.SPANMETER_REASON: tel.instruments.labels.kind(reason), **_tenant(caller)}
        tel.instruments.wrap_up_notices.add(1, labels, context=cs.context if cs else None)
    except Exception:
        log.exception("record_wrap_up failed")


def run_outcome(totals: Mapping[str, int]) -> str:
    """How a run ended, for `spanmeter.runs.ended` (one of attributes.RUN_OUTCOMES)."""
    noticed = totals.get("wrap_up_notices", 0) > 0
    if totals.get("ceilings_hit", 0) > 0:
        return "ceiling_after_notice" if noticed else "ceiling"
    return "answered_after_notice" if noticed and totals.get("answers_after_notice", 0) > 0 else "other"


def _count_run_end(tel: Telemetry, caller: Caller, totals: Mapping[str, int], ra: dict[str, Any] | None) -> None:
    """Count an ended run by its outcome, and what its unused tools' definitions cost
    (`ra`: its anatomy unfolded: the labels are bounded where they are made)."""
    try:
        labels = {A.SPANMETER_RUN_OUTCOME: run_outcome(totals), **_tenant(caller)}
        tel.instruments.runs_ended.add(1, labels)
        for name in ra["unused"] if ra is not None else ():
            usd = ra["tools"][name]["definitions_cost_usd"] if ra is not None else 0
            if usd:
                tel.instruments.tool_unused_cost.add(usd, {**_tenant(caller),
                                                              A.GEN_AI_TOOL_NAME: tel.instruments.labels.tool(name)})
    except Exception:
        log.exception("counting an ended run failed")


# --- small helpers -----------------------------------------------------------------------


def _present(attrs: Mapping[str, AttributeValue | None]) -> Attrs:
    return {k: v for k, v in attrs.items() if v is not None}


def _tenant(caller: Caller) -> Attrs:
    return {A.SPANMETER_TENANT_ID: caller.tenant}


def _int_if_whole(value: float | None) -> float | int | None:
    return int(value) if value is not None and float(value).is_integer() else value


def _redact(text: str, caller: Caller) -> str:
    """Upstream keys never reach telemetry, even when an error message echoes one."""
    if caller.upstream_key and len(caller.upstream_key) >= 8:
        text = text.replace(caller.upstream_key, "[redacted]")
    return redact_keylike(text)


def redact_keylike(text: str) -> str:
    """`text` with whatever looks like an API key (_KEYLIKE) replaced by `[redacted]`."""
    for mark in _KEYLIKE_MARKS:
        if mark in text:
            return _KEYLIKE.sub("[redacted]", text)
    return text


def _status_text(message: str | None, caller: Caller) -> str:
    return digests.cut(_redact(message or "", caller), _STATUS_LIMIT)


def _name(text: str) -> str:
    """A name or id a caller steers, as a span attribute: cut at SPAN_NAME_LIMIT runes."""
    return text if len(text) <= A.SPAN_NAME_LIMIT else digests.cut(text, A.SPAN_NAME_LIMIT)


def _text(text: str) -> str:
    """A message or other free text a caller steers: cut at SPAN_TEXT_LIMIT runes."""
    return text if len(text) <= A.SPAN_TEXT_LIMIT else digests.cut(text, A.SPAN_TEXT_LIMIT)


def _names(items: Sequence[str], limit: int = A.SPAN_NAME_LIMIT) -> Sequence[str]:
    """Each item cut at `limit` runes, at most SPAN_LIST_LIMIT items; as given when it fits."""
    if len(items) <= A.SPAN_LIST_LIMIT and all(len(i) <= limit for i in items):
        return items
    return tuple(digests.cut(i, limit) for i in items[: A.SPAN_LIST_LIMIT])


def _cap_bytes(text: str, cap: int) -> str:
    """Opt-in content at most `cap` UTF-8 bytes (plus a `…` marker when it was cut)."""
    if len(text) * 4 <= cap:
        return text
    data = text.encode("utf-8", "surrogatepass")
    if len(data) <= cap:
        return text
    return data[:cap].decode("utf-8", "ignore") + digests.ELLIPSIS
