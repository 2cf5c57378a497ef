"""The observation model: what spanmeter knows about a call, as plain data.

Stdlib only. Every layer may import this module; it imports nothing of ours.
Provider adapters translate wire bytes into these types, policy and tracing read them.
What is handed on is a value type declared `@frozen` (`Call`, `Outcome`, `CallRecord`,
`ToolRecord`, the stream events, ...): immutable as mypy checks it, a plain slotted dataclass
at run time (see `frozen`). What one turn makes dozens of is a NamedTuple (`ToolSpec`) or a
plain tuple (`InputPart`). `Anatomy` is filled in after it is built, so it is a plain dataclass.

`Call` is frozen once handed on: `providers.base.open_exchange` sets its two byte-derived
fields (`body_bytes`, `cache_write`) right after the API module built it and before anything
reads it, in place, to save a copy per call.

`None` always means "the provider never said" and is never the same as zero
(see `Usage`): unknown usage settles at the reservation, not at nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, TypeVar, dataclass_transform

__all__ = [
    "NO_BYTE_FACTS",
    "REFUSAL_KINDS",
    "REFUSAL_REASONS",
    "Anatomy",
    "Api",
    "ByteFacts",
    "Call",
    "CallRecord",
    "Caller",
    "Finish",
    "Flushed",
    "InputPart",
    "MetaEvent",
    "Outcome",
    "OutputSpec",
    "RefusalReason",
    "Repair",
    "Rewrite",
    "RunIdSource",
    "StreamError",
    "StreamEvent",
    "TextDelta",
    "ToolCall",
    "ToolCallDelta",
    "ToolRecord",
    "ToolResult",
    "ToolSpec",
    "Usage",
    "UsageEvent",
    "frozen",
]


_C = TypeVar("_C")


@dataclass_transform(frozen_default=True, field_specifiers=(field,))
def frozen(cls: type[_C]) -> type[_C]:
    """A value type: a slotted dataclass that is never assigned to once built.

    mypy enforces that (this is a PEP 681 dataclass transform, frozen by default: an
    assignment to a field is a type error), so the run time does not. A frozen dataclass's
    `__init__` sets each field through `object.__setattr__`, several times the cost of a
    plain one (`Call`, 25 fields: 2.4 against 0.4 us), and the proxy builds a few dozen of
    them on every call. Equality and hashing are a frozen dataclass's: by the fields."""
    return dataclass(slots=True, unsafe_hash="__hash__" not in cls.__dict__)(cls)

# converse, invoke: AWS Bedrock's Converse and InvokeModel (proxy/providers/bedrock.py)
Api = Literal["chat", "responses", "messages", "gemini", "embeddings", "converse", "invoke"]
"""Which wire format a call speaks. One adapter per value."""


# How a call's run id was found: an X-Run-Id header, an incoming traceparent, or made up.
RunIdSource = Literal["header", "traceparent", "generated"]

# Why spanmeter refused a call before it reached the upstream, model call or MCP tool call
# alike: the `spanmeter.reason` of `spanmeter.limit.rejections`, the span's refusal and the
# access line's `refused=`. The one list of these words: the ledger's refusals name their
# limit in them, proxy/serve/pipeline.py maps every refusal to one, tracing/labels.py admits
# no other, and docs/operations.md is generated from REFUSAL_KINDS.
RefusalReason = Literal[
    "run_calls", "run_tool_calls", "run_cost", "run_tokens", "run_seconds",
    "tenant_day", "tenant_month", "key_day", "key_month", "unknown_price", "stored_context",
    "rate_requests", "rate_tokens",
    "loop_detected",
    "ledger_unavailable",
    "invalid_request",
    "refused",
]  # fmt: skip

# Each reason with what refused the call (its HTTP status on the model route), for the docs.
REFUSAL_KINDS: Mapping[RefusalReason, str] = {
    "run_calls": "ceilings, 402", "run_tool_calls": "ceilings, 402", "run_cost": "ceilings, 402",
    "run_tokens": "ceilings, 402", "run_seconds": "ceilings, 402", "tenant_day": "ceilings, 402",
    "tenant_month": "ceilings, 402", "key_day": "ceilings, 402", "key_month": "ceilings, 402",
    "unknown_price": "a cost it cannot bound under a cost ceiling, 402",
    "stored_context": "a cost it cannot bound under a cost ceiling, 402",
    "rate_requests": "rate limits, 429", "rate_tokens": "rate limits, 429",
    "loop_detected": "the loop guard, 409",
    "ledger_unavailable": "the ledger unreachable, 503",
    "invalid_request": "a run-limit header it cannot read, 400",
    "refused": "any other refusal at admission",
}  # fmt: skip
REFUSAL_REASONS: frozenset[str] = frozenset(REFUSAL_KINDS)

@frozen
class Caller:
    """Who is calling: resolved from the spanmeter key and the run headers."""

    tenant: str
    run_id: str
    run_id_source: Literal["header", "traceparent", "generated"]
    key_id: str | None = None  # short id of the spanmeter key, never the key itself
    upstream_key: str | None = None  # open mode: the caller's own key, passed upstream
    agent_name: str | None = None  # X-Agent-Name: the agent the run belongs to (gen_ai.agent.name)
    conversation_id: str | None = None  # X-Conversation-Id, never invented (gen_ai.conversation.id)


class ToolSpec(NamedTuple):
    """A tool the request declares. A NamedTuple: an agent turn declares dozens, and a
    frozen dataclass costs several times more to build."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # JSON Schema of the arguments


@frozen
class ToolResult:
    """A tool result the client sends back in a request (the end of a tool span)."""

    call_id: str
    content: str  # the result as the client sent it, serialised to text if it was JSON
    name: str | None = None
    is_error: bool = False  # the dialect said so (Anthropic is_error); envelopes are judged later
    # It follows the model's last turn that called tools: what this request brings back (the
    # call span's summary). An earlier one still closes a call left open by id: an agent
    # framework may write its own call and result (tool search) after it.
    new: bool = True


@frozen
class ToolCall:
    """A tool call the model made in a response (the start of a tool span)."""

    id: str
    name: str
    arguments: str  # JSON text, as assembled from the response or its stream fragments
    index: int = 0


@frozen
class OutputSpec:
    """The structured output a request asked for; repair applies only when this is set."""

    kind: Literal["json_schema", "json_object", "tool"]
    schema: dict[str, Any] | None = None
    name: str | None = None
    strict: bool = False


class ByteFacts(NamedTuple):
    """What a request's bytes, not its parsed body, say of its call: read once by
    `providers.base.open_exchange` and handed to the API module's `parse_request`, which
    builds its `Call` with them. A NamedTuple: one is built on every call."""

    body_bytes: int = 0  # Call.body_bytes
    cache_write: str = ""  # Call.cache_write: "", "5m" or "1h"


NO_BYTE_FACTS = ByteFacts()  # a request parsed without its bytes (the provider tables' tests)


@frozen
class Call:
    """One model call as the request describes it. Built whole by the API module's
    `parse_request`, with the facts `providers.base.open_exchange` read from the bytes
    (`ByteFacts`), and never changed after."""

    api: Api
    operation: str  # gen_ai.operation.name: chat | generate_content | embeddings
    model: str | None
    stream: bool = False
    max_output_tokens: int | None = None
    tools: tuple[ToolSpec, ...] = ()
    tool_results: tuple[ToolResult, ...] = ()
    output: OutputSpec | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: float | None = None
    seed: int | None = None
    choice_count: int | None = None
    stop_sequences: tuple[str, ...] = ()
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    input_chars: int = 0  # text characters of the prompt: an input-token bound for pricing
    body_bytes: int = 0
    # Every answer the call asks for (chat `n`, Gemini `candidateCount`): output x this.
    output_multiplier: int = 1
    # Context the provider holds and bills as input that the body only names, as
    # "kind:id" (response:resp_1, conversation:conv_1, prompt:pmpt_1, cached_content:x).
    stored_context: tuple[str, ...] = ()
    # The request field that bounds output for this model family (admission's clamp).
    max_tokens_field: str = ""
    service_tier: str | None = None  # OpenAI `service_tier` as requested (None: the project's default)
    # The prompt-cache writes the request may cause, billed above plain input: "" none
    # (no cache breakpoint; automatic caches bill no write premium), "5m", or "1h".
    cache_write: str = ""
    # False for a call billed on its input alone (embeddings): no output to bound, clamp
    # or wait for, and reported input is the final usage.
    generates_output: bool = True
    openai_api_type: str | None = None  # semconv openai.api.type: chat_completions | responses


@frozen
class Usage:
    """Token usage in gen_ai terms: input includes cached; cache and reasoning are subsets.

    `None` means the provider never reported the field: unknown is not zero.
    `cache_write_1h_tokens` is the part of `cache_write_tokens` written with a 1-hour
    lifetime (Anthropic bills it at 2x input, the 5-minute rest at 1.25x).
    `service_tier` and `inference_geo` are what the provider says it billed the call as
    (OpenAI `service_tier` flex/priority, Anthropic `usage.service_tier` and
    `usage.inference_geo`); pricing applies the model's multiplier for them, if any.
    """

    input_tokens: int | None = None
    output_tokens: int | None = None
    cache_read_tokens: int | None = None
    cache_write_tokens: int | None = None
    reasoning_tokens: int | None = None
    cache_write_1h_tokens: int | None = None
    service_tier: str | None = None
    inference_geo: str | None = None
    # What the host says it billed, in micro-USD (OpenRouter's `usage.cost`): it wins over
    # the price table, and a free model's 0 is 0.
    billed_micros: int | None = None

    def merge(self, newer: Usage) -> Usage:
        """Fields the newer report sets replace ours; providers report cumulative totals."""
        return Usage(
            input_tokens=_newer(self.input_tokens, newer.input_tokens),
            output_tokens=_newer(self.output_tokens, newer.output_tokens),
            cache_read_tokens=_newer(self.cache_read_tokens, newer.cache_read_tokens),
            cache_write_tokens=_newer(self.cache_write_tokens, newer.cache_write_tokens),
            reasoning_tokens=_newer(self.reasoning_tokens, newer.reasoning_tokens),
            cache_write_1h_tokens=_newer(self.cache_write_1h_tokens, newer.cache_write_1h_tokens),
            service_tier=_newer(self.service_tier, newer.service_tier),
            inference_geo=_newer(self.inference_geo, newer.inference_geo),
            billed_micros=_newer(self.billed_micros, newer.billed_micros),
        )


_T = TypeVar("_T")


def _newer(old: _T | None, new: _T | None) -> _T | None:
    return old if new is None else new


@frozen
class Rewrite:
    """A change spanmeter made to a request or response. Never silent."""

    kind: str  # e.g. include_usage, usage_chunk_dropped, max_tokens_clamp, loop_reminder
    detail: str = ""

    def header_value(self) -> str:
        return f"{self.kind}={self.detail}" if self.detail else self.kind


@frozen
class Repair:
    """A change made to model output so that it parses: what was wrong and where."""

    target: str  # "output" or "tool:<call id>"
    actions: tuple[str, ...]  # fence, prose, trailing_comma, quotes, comment, truncation, ...
    valid: bool | None = None  # schema verdict after repair; None when there was no schema
    problems: tuple[str, ...] = ()


# Stream events: what an adapter's parse_event extracts from one SSE event.


@frozen
class MetaEvent:
    response_id: str | None = None
    model: str | None = None


@frozen
class TextDelta:
    text: str
    index: int = 0


@frozen
class ToolCallDelta:
    """A piece of a tool call: the first delta of an index carries id and name."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""
    complete: bool = False  # the dialect delivered the whole arguments at once (Gemini)


@frozen
class UsageEvent:
    usage: Usage


@frozen
class Finish:
    reason: str
    index: int = 0


@frozen
class StreamError:
    """The upstream put an error into the stream."""

    type: str
    message: str = ""


StreamEvent = MetaEvent | TextDelta | ToolCallDelta | UsageEvent | Finish | StreamError


@frozen
class Outcome:
    """What the response said, as far as it arrived."""

    status: int = 0
    response_id: str | None = None
    response_model: str | None = None
    usage: Usage = field(default_factory=Usage)
    finish_reasons: tuple[str, ...] = ()
    tool_calls: tuple[ToolCall, ...] = ()
    text: str = ""
    error_type: str | None = None  # set when the call failed; low cardinality
    error_message: str | None = None
    complete: bool = True  # False when the stream was cut before its end
    first_chunk_s: float | None = None
    notes: tuple[str, ...] = ()  # observer notes (unparsed_event, ...)


# One part of a request's input, in prompt order, as its API module splits it:
# (kind, size, name, call_id). `kind`: system | tools (one tool definition) | tool_result |
# history (earlier turns) | new (this turn's new content). `size`: its bytes as the request
# carries them, approximated by the length of its text (see proxy/anatomy/shares.py). `name`:
# the tool's (tools, tool_result), else "". `call_id`: the tool call a result answers, else "".
# A plain tuple, not a NamedTuple: an agent turn has dozens of parts, split on every call,
# and a NamedTuple's Python-level constructor cost more than the rest of the split.
InputPart = tuple[str, int, str, str]


@dataclass(slots=True)  # not frozen: proxy/anatomy/shares.py fills in its `top`, `late` and costs after building it
class Anatomy:
    """Where a call's billed input went, by unit (proxy/anatomy/shares.py: a kind of part, or a
    part): unit i, of kind `kinds_of_units[i]`, has `tokens[i]` of the billed input tokens,
    `cached[i]` of them read from the prompt cache, and costs `costs[i]` micro-USD. The units
    add up exactly to `input_tokens` and `input_cost_micros` (the call's cost with its output
    taken out). Parallel lists, not an object per unit: this is made on every call."""

    kinds_of_units: list[str]
    tokens: list[int]
    cached: list[int]
    costs: list[int]
    input_tokens: int
    input_cost_micros: int
    # (tokens, cached tokens, micro-USD) per kind of part, in the order the kinds first appear.
    kinds: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    # The request's largest tool results: (tool, call id, bytes, tokens, micro-USD this call), largest first.
    top: list[tuple[str, str, int, int, int]] = field(default_factory=list)
    definitions: dict[str, int] = field(default_factory=dict)  # tool name -> its definition's bytes
    # False when the definitions are those of the run's last request, already counted in its
    # totals: they are counted once per tool list, not on every call (tracing/anatomy.py).
    definitions_new: bool = True
    # What the run's chain prices its tool results with (proxy/anatomy/shares.py `Chain`), in
    # nano-micro-USD: a byte at the prompt's first window (its cached prefix, when it has one);
    # the results wholly past that window, by their index among the request's results:
    # (first, end, what a byte of them cost above that); and the results across a window's
    # end: (part index, result group, what they cost above that).
    byte_cost: int = 0
    late_marks: list[tuple[int, int, int]] = field(default_factory=list)
    late: list[tuple[int, int, int]] = field(default_factory=list)


@frozen
class Flushed:
    """What a run's chain (proxy/anatomy/shares.py `Chain`) summed since its last flush: its
    tool results' micro-USD per tool (grouped as the split groups them) and per tracked
    result (tool, call id, bytes, micro-USD, sends), and its calls' parts per kind (the
    labels the calls came with, kind, tokens, cached tokens, micro-USD)."""

    tools: list[tuple[str, int]]
    results: list[tuple[str, str, int, int, int]]
    kinds: list[tuple[tuple[str, ...], str, int, int, int]] = field(default_factory=list)


@frozen
class CallRecord:
    """One model call once it is over, answered, refused or abandoned: built once by the
    bookkeeping (proxy/serve/bookkeeping.py) from the call, its answer and its admission, and
    read by the call's span and metrics (tracing/spans.end_call), its access line
    (proxy/serve/accesslog.access) and its run's totals. Plain facts, no behaviour.

    `start_ns`/`end_ns`: when the request arrived and its last byte was delivered (None:
    when the span ends). `forwarded`: False for a call refused or abandoned before it
    reached the upstream (its access line then has no upstream status and no cost).
    `cost_micros`: what was charged, as `usage_source` says it was counted (reported |
    estimate | unpriced | ...; "" when nothing was settled). `budget_remaining_micros`: the
    smallest budget headroom after the call. `saved_micros`, `premium_micros`: what its
    prompt-cache reads saved and its cache writes cost above plain input.
    `delivered_text`, `delivered_arguments` (by tool call id): the answer as the agent
    received it where a repair changed it (`outcome` is what the model wrote).
    `chunk_gaps_s`: a stream's time between consecutive chunks after the first.
    `capture`: message content for the span (None when it is not captured).
    `anatomy`: where its input went. `refusal`: why spanmeter refused it (`RefusalReason`)."""

    caller: Caller
    call: Call
    outcome: Outcome
    start_ns: int
    end_ns: int | None = None
    forwarded: bool = True
    cost_micros: int | None = None
    usage_source: str = ""
    budget_remaining_micros: int | None = None
    saved_micros: int = 0
    premium_micros: int = 0
    rewrites: Sequence[Rewrite] = ()
    repairs: Sequence[Repair] = ()
    chunk_gaps_s: Sequence[float] = ()
    delivered_text: str | None = None
    delivered_arguments: Mapping[str, str] | None = None
    capture: Mapping[str, object] | None = None
    anatomy: Anatomy | None = None
    refusal: RefusalReason | None = None


@frozen
class ToolRecord:
    """One tool execution as spanmeter saw it across two requests: from the delivery of the
    answer that made the call (`start_ns`) to the arrival of the request that carried its
    result (`end_ns`). `result=None`: the run ended without one. `capture=False` when the
    tenant lowered content capture. Read by tracing/spans.tool_span."""

    caller: Caller
    name: str
    call_id: str
    arguments: str
    result: str | None
    start_ns: int
    end_ns: int
    is_error: bool = False
    description: str | None = None
    tool_type: str = "function"
    capture: bool = True
