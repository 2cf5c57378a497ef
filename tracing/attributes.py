"""Every span attribute and metric name spanmeter emits, once.

`gen_ai.*`, `server.*` and `error.type` are OpenTelemetry semantic conventions v1.41.1
(the last published GenAI release, see shared/reference/otel-genai.md section 0). Newer
names from the semantic-conventions-genai repo appear only under
`OTEL_SEMCONV_STABILITY_OPT_IN=gen_ai_latest_experimental` and are marked `LATEST_`.
Our own names live under `spanmeter.` and never inside `gen_ai.*`. The only others are
the few OpenInference names GenAI UIs read a span's summary and session from
(`input.value`, `output.value`, `session.id`; see "UI summaries" below).

Metric names: we are a *client* of the model API (we call the upstream on the agent's
behalf), so the `gen_ai.client.*` family applies, as envoyproxy/ai-gateway argues too.
`gen_ai.server.*` is for model servers.

`prometheus_series()` says which series the Prometheus exporter turns each metric into;
dashboards are tested against it.
"""

from __future__ import annotations

import re
from typing import Final, Literal

from proxy.model import frozen

SCHEMA_URL: Final = "https://opentelemetry.io/schemas/1.41.0"

# --- gen_ai.* (semconv v1.41.1) -------------------------------------------------------
GEN_AI_OPERATION_NAME: Final = "gen_ai.operation.name"
GEN_AI_PROVIDER_NAME: Final = "gen_ai.provider.name"
GEN_AI_CONVERSATION_ID: Final = "gen_ai.conversation.id"  # only from the caller (X-Conversation-Id)
GEN_AI_AGENT_NAME: Final = "gen_ai.agent.name"  # from X-Agent-Name, on the run (invoke_agent) span
GEN_AI_OUTPUT_TYPE: Final = "gen_ai.output.type"
GEN_AI_REQUEST_MODEL: Final = "gen_ai.request.model"
GEN_AI_REQUEST_CHOICE_COUNT: Final = "gen_ai.request.choice.count"
GEN_AI_REQUEST_SEED: Final = "gen_ai.request.seed"
GEN_AI_REQUEST_STREAM: Final = "gen_ai.request.stream"
GEN_AI_REQUEST_FREQUENCY_PENALTY: Final = "gen_ai.request.frequency_penalty"
GEN_AI_REQUEST_PRESENCE_PENALTY: Final = "gen_ai.request.presence_penalty"
GEN_AI_REQUEST_MAX_TOKENS: Final = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_STOP_SEQUENCES: Final = "gen_ai.request.stop_sequences"
GEN_AI_REQUEST_TEMPERATURE: Final = "gen_ai.request.temperature"
GEN_AI_REQUEST_TOP_K: Final = "gen_ai.request.top_k"
GEN_AI_REQUEST_TOP_P: Final = "gen_ai.request.top_p"
GEN_AI_RESPONSE_FINISH_REASONS: Final = "gen_ai.response.finish_reasons"
GEN_AI_RESPONSE_ID: Final = "gen_ai.response.id"
GEN_AI_RESPONSE_MODEL: Final = "gen_ai.response.model"
GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK: Final = "gen_ai.response.time_to_first_chunk"
GEN_AI_USAGE_INPUT_TOKENS: Final = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS: Final = "gen_ai.usage.output_tokens"
GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: Final = "gen_ai.usage.cache_read.input_tokens"
GEN_AI_USAGE_CACHE_CREATION_INPUT_TOKENS: Final = "gen_ai.usage.cache_creation.input_tokens"
# genai repo main (#440), unreleased: only under the opt-in.
LATEST_GEN_AI_USAGE_CACHE_WRITE_INPUT_TOKENS: Final = "gen_ai.usage.cache_write.input_tokens"
GEN_AI_USAGE_REASONING_OUTPUT_TOKENS: Final = "gen_ai.usage.reasoning.output_tokens"
GEN_AI_INPUT_MESSAGES: Final = "gen_ai.input.messages"
GEN_AI_OUTPUT_MESSAGES: Final = "gen_ai.output.messages"
GEN_AI_SYSTEM_INSTRUCTIONS: Final = "gen_ai.system_instructions"
# Opt-in by the letter of the table, yet v1.41.1 only advises against its *non-required*
# properties by default: each tool's `type` and `name` always, `description` and
# `parameters` only under content capture.
GEN_AI_TOOL_DEFINITIONS: Final = "gen_ai.tool.definitions"
GEN_AI_TOOL_NAME: Final = "gen_ai.tool.name"
GEN_AI_TOOL_CALL_ID: Final = "gen_ai.tool.call.id"
GEN_AI_TOOL_DESCRIPTION: Final = "gen_ai.tool.description"
GEN_AI_TOOL_TYPE: Final = "gen_ai.tool.type"
GEN_AI_TOOL_CALL_ARGUMENTS: Final = "gen_ai.tool.call.arguments"
GEN_AI_TOOL_CALL_RESULT: Final = "gen_ai.tool.call.result"
GEN_AI_TOKEN_TYPE: Final = "gen_ai.token.type"
OPENAI_API_TYPE: Final = "openai.api.type"

# MCP (semconv v1.41.1 mcp.md; the proxy is the server's client, so spans are CLIENT).
MCP_METHOD_NAME: Final = "mcp.method.name"
MCP_SESSION_ID: Final = "mcp.session.id"  # spanmeter records a hash of it: a session id is a credential
MCP_PROTOCOL_VERSION: Final = "mcp.protocol.version"
MCP_RESOURCE_URI: Final = "mcp.resource.uri"
JSONRPC_REQUEST_ID: Final = "jsonrpc.request.id"
RPC_RESPONSE_STATUS_CODE: Final = "rpc.response.status_code"  # the JSON-RPC error code, as a string
GEN_AI_PROMPT_NAME: Final = "gen_ai.prompt.name"
NETWORK_TRANSPORT: Final = "network.transport"
NETWORK_PROTOCOL_NAME: Final = "network.protocol.name"

SERVER_ADDRESS: Final = "server.address"
SERVER_PORT: Final = "server.port"
ERROR_TYPE: Final = "error.type"

# Well-known values.
OPERATION_CHAT: Final = "chat"
OPERATION_GENERATE_CONTENT: Final = "generate_content"
OPERATION_EMBEDDINGS: Final = "embeddings"
OPERATION_TEXT_COMPLETION: Final = "text_completion"
OPERATION_EXECUTE_TOOL: Final = "execute_tool"
OPERATION_INVOKE_AGENT: Final = "invoke_agent"
TOKEN_TYPE_INPUT: Final = "input"
TOKEN_TYPE_OUTPUT: Final = "output"
# The one value a metric label takes when what the caller, its model or an upstream sent is
# not a known or bounded value (tracing/labels.py): a model that is not in the price table
# (`gen_ai.request.model`, `gen_ai.response.model`), an error type, tool name or kind past
# its bound. Spelled like semconv's `error.type` fallback. Spans keep the real value (cut to
# SPAN_NAME_LIMIT); only metrics collapse it.
LABEL_OTHER: Final = "_OTHER"
ERROR_OTHER: Final = LABEL_OTHER
ERROR_TOOL: Final = "tool_error"
ERROR_TOOL_RESULT_MISSING: Final = "tool_result_missing"

# --- spanmeter.* (ours) ---------------------------------------------------------------
SPANMETER_TENANT_ID: Final = "spanmeter.tenant.id"
SPANMETER_RUN_ID: Final = "spanmeter.run.id"
SPANMETER_RUN_ID_SOURCE: Final = "spanmeter.run.id_source"
SPANMETER_COST_USD: Final = "spanmeter.cost.usd"
# What the call's cache reads saved: its cache-read tokens at the input rate minus at the
# cache-read rate (the price table's), in USD. Cache writes are not netted out.
SPANMETER_COST_SAVED_USD: Final = "spanmeter.cost.saved_usd"
# What the call's cache writes cost above plain input (Anthropic's write premium), in USD:
# with the saving above, what caching saved net.
SPANMETER_COST_CACHE_WRITE_PREMIUM_USD: Final = "spanmeter.cost.cache_write_premium_usd"
SPANMETER_BUDGET_REMAINING_USD: Final = "spanmeter.budget.remaining_usd"
SPANMETER_REWRITES: Final = "spanmeter.rewrites"
SPANMETER_REPAIRS: Final = "spanmeter.repairs"
# Under content capture, beside gen_ai.output.messages (the answer as the model returned it):
# the answer as the agent received it after repair, in the same JSON shape; set only when a
# repair changed it.
SPANMETER_OUTPUT_MESSAGES_REPAIRED: Final = "spanmeter.output.messages.repaired"
SPANMETER_OBSERVER_NOTES: Final = "spanmeter.observer.notes"  # e.g. unparsed_event: the upstream sent unreadable data
SPANMETER_USAGE_SOURCE: Final = "spanmeter.usage.source"  # reported | estimate
SPANMETER_REFUSAL_REASON: Final = "spanmeter.refusal.reason"
SPANMETER_TOOL_TIMING: Final = "spanmeter.tool.timing"  # inferred
SPANMETER_TOOL_ARGUMENTS_DIGEST: Final = "spanmeter.tool.call.arguments.digest"
SPANMETER_TOOL_ARGUMENTS_SHA256: Final = "spanmeter.tool.call.arguments.sha256"
SPANMETER_TOOL_ARGUMENTS_SIZE: Final = "spanmeter.tool.call.arguments.size"
SPANMETER_TOOL_RESULT_DIGEST: Final = "spanmeter.tool.call.result.digest"
SPANMETER_TOOL_RESULT_SHA256: Final = "spanmeter.tool.call.result.sha256"
SPANMETER_TOOL_RESULT_SIZE: Final = "spanmeter.tool.call.result.size"
SPANMETER_TOOL_RESULT_PREVIEW: Final = "spanmeter.tool.call.result.preview"
SPANMETER_TOOL_OK: Final = "spanmeter.tool.ok"
SPANMETER_MCP_SERVER: Final = "spanmeter.mcp.server"  # the configured name of /mcp/{name}
SPANMETER_GUARD_ACTION: Final = "spanmeter.guard.action"  # remind | refuse
SPANMETER_GUARD_TOOL: Final = "spanmeter.guard.tool"
SPANMETER_GUARD_REPEATS: Final = "spanmeter.guard.repeats"
SPANMETER_RUN_STATUS: Final = "spanmeter.run.status"
SPANMETER_RUN_MODEL_CALLS: Final = "spanmeter.run.model_calls"
SPANMETER_RUN_TOOL_CALLS: Final = "spanmeter.run.tool_calls"
SPANMETER_RUN_FAILURES: Final = "spanmeter.run.failures"  # failed model calls
# Failed tool results and tool calls never answered: the run's execute_tool spans with status ERROR.
SPANMETER_RUN_TOOL_FAILURES: Final = "spanmeter.run.tool_failures"
SPANMETER_RUN_TOOL_RESULTS_MISSING: Final = "spanmeter.run.tool_results_missing"  # of which never answered
SPANMETER_RUN_COST_USD: Final = "spanmeter.run.cost.usd"
SPANMETER_RUN_REPAIRS: Final = "spanmeter.run.repairs"
SPANMETER_RUN_CEILINGS_HIT: Final = "spanmeter.run.ceilings_hit"
# Calls of the run that carried a wrap-up note, and of those the ones answered without a tool call.
SPANMETER_RUN_WRAP_UP_NOTICES: Final = "spanmeter.run.wrap_up_notices"
SPANMETER_RUN_ANSWERS_AFTER_NOTICE: Final = "spanmeter.run.answers_after_notice"
# What was left of each ceiling when a call was admitted (only those that are set):
# calls and run cost after this call (its worst case), tokens and seconds before it.
SPANMETER_REMAINING_RUN_CALLS: Final = "spanmeter.remaining.run_calls"
SPANMETER_REMAINING_RUN_COST_USD: Final = "spanmeter.remaining.run_cost_usd"
SPANMETER_REMAINING_RUN_TOKENS: Final = "spanmeter.remaining.run_tokens"
SPANMETER_REMAINING_RUN_SECONDS: Final = "spanmeter.remaining.run_seconds"
SPANMETER_REMAINING_DAY_USD: Final = "spanmeter.remaining.day_usd"
SPANMETER_REMAINING_MONTH_USD: Final = "spanmeter.remaining.month_usd"
SPANMETER_WRAP_UP_REASON: Final = "spanmeter.wrap_up.reason"  # last_call | calls | cost | tokens | time
# Prompt cache over the run: input tokens read from the provider's cache, their share of
# the run's input tokens (0..1, only when the run had input), and the money they saved.
SPANMETER_RUN_CACHE_READ_INPUT_TOKENS: Final = "spanmeter.run.cache_read.input_tokens"
SPANMETER_RUN_CACHE_READ_SHARE: Final = "spanmeter.run.cache_read.share"
SPANMETER_RUN_COST_SAVED_USD: Final = "spanmeter.run.cost.saved_usd"
# The run's cache-write premiums, and what caching saved it net (saved minus premiums; below
# zero when its writes were never read).
SPANMETER_RUN_COST_CACHE_WRITE_PREMIUM_USD: Final = "spanmeter.run.cost.cache_write_premium_usd"
SPANMETER_RUN_COST_CACHE_NET_SAVED_USD: Final = "spanmeter.run.cost.cache_net_saved_usd"
SPANMETER_RUN_MCP_TOOL_CALLS: Final = "spanmeter.run.mcp_tool_calls"  # of the run's tool calls, through /mcp

# Labels of our own metrics.
SPANMETER_REASON: Final = "spanmeter.reason"  # limit.rejections: call_limit | cost_limit | ...
SPANMETER_KIND: Final = "spanmeter.kind"  # repairs / rewrites: the kind of change
SPANMETER_OUTCOME: Final = "spanmeter.outcome"  # tool.calls: ok | failed | missing | refused
SPANMETER_WINDOW: Final = "spanmeter.budget.window"  # day | month
SPANMETER_SCOPE: Final = "spanmeter.scope"  # ledger.overshoot: run | day | month
SPANMETER_EXPORTER: Final = "spanmeter.exporter"  # telemetry.dropped_spans: otlp | local
# runs.ended: answered_after_notice | ceiling_after_notice | ceiling | other
SPANMETER_RUN_OUTCOME: Final = "spanmeter.run.outcome"
RUN_OUTCOMES: Final = ("answered_after_notice", "ceiling_after_notice", "ceiling", "other")
SPANMETER_CACHE_OPERATION: Final = "spanmeter.cache.operation"  # cache.input_tokens: read | write
CACHE_READ: Final = "read"
CACHE_WRITE: Final = "write"

# Span attributes a caller steers are cut (tracing/spans.py), and marked with a trailing
# `…` when they were: names and ids (models, tools, tool call and response ids, error
# types, finish reasons, stop sequences, run ids) at SPAN_NAME_LIMIT runes; messages and
# free text (refusal reasons, tool descriptions, rewrite and repair records, observer
# notes) at SPAN_TEXT_LIMIT; lists at SPAN_LIST_LIMIT items. Digests keep their own caps
# (tracing/digests.py) and opt-in content its byte cap (TelemetryConfig.content_cap_bytes).
SPAN_NAME_LIMIT: Final = 256
SPAN_TEXT_LIMIT: Final = 1024
SPAN_LIST_LIMIT: Final = 128

TOOL_TIMING_INFERRED: Final = "inferred"
# Measured on the MCP route, from the request's arrival to the answer's last byte; such a
# span replaces the inferred one of the same model tool call (proxy/govern/runs.py).
TOOL_TIMING_OBSERVED: Final = "observed"
USAGE_REPORTED: Final = "reported"
USAGE_ESTIMATE: Final = "estimate"

# The span that carries a run's totals is the agent invocation the run is (semconv v1.41.1
# gen-ai-agent-spans.md, INTERNAL): `invoke_agent {gen_ai.agent.name}`, or `invoke_agent`
# when the caller named no agent. The run id is an attribute, never part of the name (span
# names stay low-cardinality); its token totals are gen_ai.usage.*, the rest spanmeter.run.*.
# Not set on it: gen_ai.provider.name (a run may call several providers; each model call
# carries its own, and the genai repo's main drops it from INTERNAL invoke_agent spans).

# --- UI summaries (OpenInference names, not OTel semconv) ------------------------------
# What Phoenix and Langfuse show as a span's input and output, and Phoenix's session key.
# spanmeter puts readable summaries there (digests: never content, never empty), so a span
# reads well with content capture off; content itself stays in the opt-in gen_ai.*
# attributes, which those UIs read too. session.id repeats gen_ai.conversation.id.
INPUT_VALUE: Final = "input.value"
INPUT_MIME_TYPE: Final = "input.mime_type"
OUTPUT_VALUE: Final = "output.value"
OUTPUT_MIME_TYPE: Final = "output.mime_type"
SESSION_ID: Final = "session.id"
MIME_TEXT: Final = "text/plain"
# Resource attribute: the Phoenix project the spans land in (SPANMETER_PROJECT_NAME).
OPENINFERENCE_PROJECT_NAME: Final = "openinference.project.name"

# --- metrics --------------------------------------------------------------------------
GEN_AI_CLIENT_OPERATION_DURATION: Final = "gen_ai.client.operation.duration"
GEN_AI_CLIENT_TOKEN_USAGE: Final = "gen_ai.client.token.usage"
GEN_AI_CLIENT_TIME_TO_FIRST_CHUNK: Final = "gen_ai.client.operation.time_to_first_chunk"
GEN_AI_CLIENT_TIME_PER_OUTPUT_CHUNK: Final = "gen_ai.client.operation.time_per_output_chunk"
# genai repo main (#521), unreleased: inference metrics renamed; only under the opt-in.
LATEST_GEN_AI_CLIENT_INFERENCE_DURATION: Final = "gen_ai.client.inference.duration"
LATEST_GEN_AI_CLIENT_TIME_TO_FIRST_CHUNK: Final = "gen_ai.client.inference.time_to_first_chunk"
LATEST_GEN_AI_CLIENT_TIME_PER_OUTPUT_CHUNK: Final = "gen_ai.client.inference.time_per_output_chunk"
GEN_AI_EXECUTE_TOOL_DURATION: Final = "gen_ai.execute_tool.duration"
# The MCP client metric, not mcp.server.*: the proxy calls the MCP server on the agent's
# behalf, as it calls model APIs (gen_ai.client.*); the server side is the server's to report.
MCP_CLIENT_OPERATION_DURATION: Final = "mcp.client.operation.duration"
SPANMETER_COST: Final = "spanmeter.cost"
SPANMETER_LIMIT_REJECTIONS: Final = "spanmeter.limit.rejections"
SPANMETER_REPAIRS_METRIC: Final = "spanmeter.repairs"
SPANMETER_TOOL_CALLS: Final = "spanmeter.tool.calls"
SPANMETER_GUARD_ACTIONS: Final = "spanmeter.guard.actions"
SPANMETER_REWRITES_METRIC: Final = "spanmeter.rewrites"
SPANMETER_LEDGER_OVERSHOOT: Final = "spanmeter.ledger.overshoot"
SPANMETER_TELEMETRY_DROPPED_SPANS: Final = "spanmeter.telemetry.dropped_spans"
SPANMETER_BUDGET_SPENT_USD: Final = "spanmeter.budget.spent_usd"
SPANMETER_BUDGET_LIMIT_USD: Final = "spanmeter.budget.limit_usd"
SPANMETER_WRAP_UP_NOTICES: Final = "spanmeter.wrap_up.notices"
SPANMETER_RUNS_ENDED: Final = "spanmeter.runs.ended"
# Prompt-cache tokens as a counter of their own, not a `gen_ai.token.type` value of
# gen_ai.client.token.usage: semconv v1.41.1 allows only `input` | `output` there, and
# cached tokens are a subset of input, so a third value would be counted twice by every
# query that sums the histogram over its types (our "Tokens" panels, Grafana's GenAI
# apps). Cached share of input per model and tenant (`by (m, t)` = by model and tenant label):
#     sum by (m, t) (rate(spanmeter_cache_input_tokens_total{spanmeter_cache_operation="read"}[5m]))
#   / sum by (m, t) (rate(gen_ai_client_token_usage_sum{gen_ai_token_type="input"}[5m]))
SPANMETER_CACHE_INPUT_TOKENS: Final = "spanmeter.cache.input_tokens"
# Money the cache reads saved, from the price table (PromQL has no prices to do it with).
SPANMETER_COST_SAVED: Final = "spanmeter.cost.saved"
# Cost anatomy (proxy/anatomy/shares.py): input cost by kind of part (`spanmeter.input.part`:
# system | tools | tool_result | history | new), the input cost tool results caused by
# tool name (every send counts: over a run, their re-sends), and at a run's end the cost
# of the definitions of tools the run never called.
SPANMETER_INPUT_COST: Final = "spanmeter.input.cost"
SPANMETER_TOOL_CONTEXT_COST: Final = "spanmeter.tool.context.cost"
SPANMETER_TOOL_UNUSED_COST: Final = "spanmeter.tool.definitions.unused_cost"
SPANMETER_INPUT_PART: Final = "spanmeter.input.part"
# Span attributes of the anatomy (per kind: spanmeter.input.<kind>.tokens|cached_tokens|cost_usd).
SPANMETER_INPUT_APPROXIMATION: Final = "spanmeter.input.approximation"
SPANMETER_INPUT_TOOLS_DECLARED: Final = "spanmeter.input.tools.declared"
SPANMETER_INPUT_TOP_RESULTS: Final = "spanmeter.input.tool_results.top"
SPANMETER_RUN_ANATOMY: Final = "spanmeter.run.anatomy"
SPANMETER_RUN_TOOLS_DECLARED: Final = "spanmeter.run.tools.declared"
SPANMETER_RUN_TOOLS_CALLED: Final = "spanmeter.run.tools.called"
SPANMETER_RUN_TOOLS_UNUSED: Final = "spanmeter.run.tools.unused"
SPANMETER_RUN_TOOLS_UNUSED_COST_USD: Final = "spanmeter.run.tools.unused_cost_usd"
# Tools past the run anatomy's bound (tracing/anatomy.py MAX_RUN_TOOLS), summed into `_OTHER`.
SPANMETER_RUN_TOOLS_FOLDED: Final = "spanmeter.run.tools.folded"
# Money the cache writes cost above plain input: `saved - cache_write_premium` is the net.
SPANMETER_COST_CACHE_WRITE_PREMIUM: Final = "spanmeter.cost.cache_write_premium"

DURATION_BUCKETS: Final = (
    0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92,
)  # fmt: skip
# semconv mcp.md: the MCP duration histograms' advisory boundaries.
MCP_DURATION_BUCKETS: Final = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TOKEN_BUCKETS: Final = (
    1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864,
)  # fmt: skip

MetricKind = Literal["histogram", "counter", "gauge"]


@frozen
class MetricSpec:
    name: str
    kind: MetricKind
    unit: str
    description: str


# Money is counted in USD with the annotation unit `{USD}`: annotations in braces add no
# suffix in the Prometheus translation, so `spanmeter.cost` becomes `spanmeter_cost_total`
# (a plain `USD` unit would give `spanmeter_cost_USD_total`).
METRICS: Final[tuple[MetricSpec, ...]] = (
    MetricSpec(GEN_AI_CLIENT_OPERATION_DURATION, "histogram", "s", "GenAI operation duration."),
    MetricSpec(GEN_AI_CLIENT_TOKEN_USAGE, "histogram", "{token}", "Number of input and output tokens used."),
    MetricSpec(
        GEN_AI_CLIENT_TIME_TO_FIRST_CHUNK,
        "histogram",
        "s",
        "Time to receive the first chunk of a streamed response.",
    ),
    MetricSpec(
        GEN_AI_CLIENT_TIME_PER_OUTPUT_CHUNK,
        "histogram",
        "s",
        "Mean time between consecutive chunks of a streamed response, one point per call.",
    ),
    MetricSpec(LATEST_GEN_AI_CLIENT_INFERENCE_DURATION, "histogram", "s", "GenAI inference duration."),
    MetricSpec(
        LATEST_GEN_AI_CLIENT_TIME_TO_FIRST_CHUNK,
        "histogram",
        "s",
        "Time to receive the first chunk of a streamed response.",
    ),
    MetricSpec(
        LATEST_GEN_AI_CLIENT_TIME_PER_OUTPUT_CHUNK,
        "histogram",
        "s",
        "Mean time between consecutive chunks of a streamed response, one point per call.",
    ),
    MetricSpec(
        GEN_AI_EXECUTE_TOOL_DURATION,
        "histogram",
        "s",
        "Tool execution duration: measured on the MCP route, else inferred from the run.",
    ),
    MetricSpec(
        MCP_CLIENT_OPERATION_DURATION,
        "histogram",
        "s",
        "Duration of MCP requests relayed to MCP servers, from arrival to the answer's last byte.",
    ),
    MetricSpec(SPANMETER_COST, "counter", "{USD}", "Cost of model calls in US dollars."),
    MetricSpec(
        SPANMETER_LIMIT_REJECTIONS,
        "counter",
        "{request}",
        "Calls refused by a ceiling before reaching the upstream.",
    ),
    MetricSpec(SPANMETER_REPAIRS_METRIC, "counter", "{repair}", "Repairs made to model output, by kind."),
    MetricSpec(SPANMETER_TOOL_CALLS, "counter", "{call}", "Tool calls seen in runs, by outcome."),
    MetricSpec(SPANMETER_GUARD_ACTIONS, "counter", "{action}", "Loop guard actions."),
    MetricSpec(
        SPANMETER_REWRITES_METRIC,
        "counter",
        "{rewrite}",
        "Rewrites of requests or responses, by kind.",
    ),
    MetricSpec(
        SPANMETER_LEDGER_OVERSHOOT,
        "counter",
        "{USD}",
        "Settled cost above the reservation, in US dollars.",
    ),
    MetricSpec(
        SPANMETER_TELEMETRY_DROPPED_SPANS,
        "counter",
        "{span}",
        "Spans dropped instead of exported (queue full or export failed).",
    ),
    MetricSpec(
        SPANMETER_WRAP_UP_NOTICES,
        "counter",
        "{notice}",
        "Wrap-up notes added to requests, by the ceiling whose share was reached (spanmeter.reason).",
    ),
    MetricSpec(
        SPANMETER_RUNS_ENDED,
        "counter",
        "{run}",
        "Runs ended, by outcome: answered after a wrap-up note, or cut off by a ceiling (with or without one).",
    ),
    MetricSpec(
        SPANMETER_CACHE_INPUT_TOKENS,
        "counter",
        "{token}",
        "Input tokens read from (read) or written to (write) the provider's prompt cache.",
    ),
    MetricSpec(
        SPANMETER_COST_SAVED,
        "counter",
        "{USD}",
        "Money saved by prompt-cache reads: cached tokens at the input rate minus the cache-read rate.",
    ),
    MetricSpec(SPANMETER_INPUT_COST, "counter", "{USD}",
               "Input cost of model calls by kind of part (cost anatomy; shares by bytes)."),
    MetricSpec(SPANMETER_TOOL_CONTEXT_COST, "counter", "{USD}",
               "Input cost of tool results by tool name, every send counted (re-sends included)."),
    MetricSpec(SPANMETER_TOOL_UNUSED_COST, "counter", "{USD}",
               "Input cost of tool definitions a run declared and never called, counted when the run ends."),
    MetricSpec(
        SPANMETER_COST_CACHE_WRITE_PREMIUM,
        "counter",
        "{USD}",
        "Money prompt-cache writes cost above plain input (Anthropic's write premium).",
    ),
    MetricSpec(SPANMETER_BUDGET_SPENT_USD, "gauge", "{USD}", "Tenant spend in the current budget window."),
    MetricSpec(SPANMETER_BUDGET_LIMIT_USD, "gauge", "{USD}", "Tenant budget limit for the window."),
)

METRICS_BY_NAME: Final[dict[str, MetricSpec]] = {m.name: m for m in METRICS}

# The part of opentelemetry-exporter-prometheus' unit mapping our units need; the test
# tests/tracing/test_prometheus_names.py checks these names against the real exporter.
_UNIT_SUFFIX: Final[dict[str, str]] = {"s": "seconds", "ms": "milliseconds", "By": "bytes"}
_NOT_NAME = re.compile(r"[^a-zA-Z0-9:]+")


def prometheus_base_name(metric: str) -> str:
    """The Prometheus family name of an OTel metric we emit, e.g. `..._duration_seconds`."""
    spec = METRICS_BY_NAME[metric]
    base = _NOT_NAME.sub("_", spec.name)
    suffix = _UNIT_SUFFIX.get(spec.unit, "")
    if suffix and not base.endswith("_" + suffix):
        base = f"{base}_{suffix}"
    return base


def prometheus_series(metric: str) -> tuple[str, ...]:
    """Every series name the Prometheus exporter produces for the OTel metric `metric`.

    Histograms give `_bucket`, `_sum` and `_count`, counters `_total`, gauges the base
    name (the exporter writes no `_created` series). Raises KeyError for a metric
    spanmeter does not emit. Labels are the attribute names with dots as underscores,
    plus `otel_scope_name|version|schema_url`; resource attributes go to `target_info`.
    """
    spec = METRICS_BY_NAME[metric]
    base = prometheus_base_name(metric)
    if spec.kind == "histogram":
        return (f"{base}_bucket", f"{base}_sum", f"{base}_count")
    if spec.kind == "counter":
        return (f"{base}_total",)
    return (base,)


def prometheus_label(attribute: str) -> str:
    """The Prometheus label of a metric attribute: `gen_ai.token.type` -> `gen_ai_token_type`."""
    return re.sub(r"[^a-zA-Z0-9]+", "_", attribute)


def all_prometheus_series() -> frozenset[str]:
    """Every series name spanmeter's own metrics can produce (for dashboard tests)."""
    return frozenset(s for m in METRICS for s in prometheus_series(m.name))
