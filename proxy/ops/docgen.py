"""The generated parts of the docs, rendered from the code so they cannot drift.

    python -m proxy.ops.docgen          rewrite them in place
    python -m proxy.ops.docgen --check  exit 1 if a committed doc differs from its rendering

Each generated part sits between `<!-- generated: NAME -->` and `<!-- end: NAME -->` in
its file; tests/unit/test_operator_texts.py holds the committed files to the rendering:

- `config-reference` (docs/operations.md): every setting of `proxy.config.Settings`,
  with its environment variable, type, bounds and default from the model, and its
  meaning from FIELD_DOCS below (which must name every field, and only fields);
- `metrics` (docs/operations.md): every metric in `tracing.attributes.METRICS`, under its
  Prometheus names, with what it tells an operator (METRIC_DOCS);
- `metric-push` and `otel-variables` (docs/operations.md): when metrics are pushed, and
  which standard OTEL_* variables spanmeter honours and which not, from tracing/setup.py;
- `scenarios` (docs/simulator.md): the simulator's markers (`proxy.simulator.script`).
"""

from __future__ import annotations

import re
import sys
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from proxy.config import DEFAULT_POLICY, ENV_PREFIX, Policy, Settings, TenantConfig, Upstream
from proxy.model import REFUSAL_KINDS

__all__ = ["FIELD_DOCS", "METRIC_DOCS", "fields", "generated_parts", "main", "render", "rewrite"]

ROOT = Path(__file__).resolve().parents[2]

# What each setting means. Keys are dotted paths as written in the YAML file; `tenants.*`
# and `upstreams.*` name the fields of one tenant or one upstream.
FIELD_DOCS: dict[str, str] = {
    "host": "Listen address. Open mode (no tenants) refuses anything but loopback.",
    "port": "Listen port; 0 picks a free one.",
    "workers": "Processes serving the port (`spanmeter serve --workers N`): `auto` is one per CPU, 1 a single "
               "process. Workers share the ledger (SQLite file or Redis; not `:memory:`) and one `/metrics`; a "
               "supervisor replaces a worker that dies. Sizing: docs/scale.md.",
    "config": "The YAML file these settings are read from (set it as SPANMETER_CONFIG or `--config`). A file "
              "that is named must exist and hold settings.",
    "openai_base_url": "OpenAI (and OpenAI-compatible) upstream: origin plus an optional path prefix; the "
                       "incoming path is appended.",
    "anthropic_base_url": "Anthropic upstream.",
    "gemini_base_url": "Gemini upstream.",
    "azure_openai_base_url": "Azure OpenAI upstream: the resource's endpoint, e.g. "
                             "`https://my-resource.openai.azure.com` (no default). Serves `/openai/...`; see "
                             "docs/providers.md.",
    "azure_deployments": "Azure deployment name -> the model it runs, e.g. `{prod-chat: gpt-4.1-mini}`: a call "
                         "to a deployment is reserved at that model's price. A deployment not listed is learned "
                         "from its answers; under a cost ceiling it is refused until then.",
    "vertex_base_url": "Vertex AI upstream (Gemini and Anthropic on `/v1/projects/...` routes). Unset: the host "
                       "of the location in each call's path, `https://{location}-aiplatform.googleapis.com` "
                       "(`global`: `https://aiplatform.googleapis.com`). See docs/providers.md.",
    "bedrock_base_url": "AWS Bedrock upstream (`/model/{id}/converse`, `/invoke`, ...). Unset: "
                        "`https://bedrock-runtime.{region}.amazonaws.com`. See docs/providers.md.",
    "bedrock_region": "The AWS region of Bedrock calls (the endpoint's, and SigV4's); unset: AWS_REGION, else "
                      "AWS_DEFAULT_REGION in spanmeter's environment.",
    "mcp_servers": "MCP servers served at `/mcp/NAME` over Streamable HTTP: `{NAME: {url, key_env, "
                   "tool_costs: {tool: usd}}}`; see docs/mcp.md.",
    "upstreams": "Named upstreams, chosen by a tenant's `upstream:` or the `/upstreams/NAME/` path prefix: "
                 "`{NAME: {dialect, base_url, key_env, provider_name}}`. Built in, with no config: groq, mistral, "
                 "openrouter, deepseek, cerebras, together, fireworks, xai, zai, ollama; an entry with one of "
                 "those names overrides only the fields it gives.",
    "upstream_keys": "Tenant mode: the environment variable holding the upstream key, per dialect (`openai`, "
                     "`anthropic`, `gemini`, `azure`; `vertex` names a fixed bearer token, else Vertex AI calls "
                     "take a token from Application Default Credentials) and per built-in host by its name "
                     "(`groq: GROQ_API_KEY`, each host's own variable by default). The built-in ones need be set "
                     "only for the APIs called (unset: a warning at start, and calls to that API get a 500 naming "
                     "the variable); once this setting is written in the config, every variable it names must be "
                     "set at start (empty: calls go without a key).",
    "otlp_metrics": "Also push metrics over OTLP (as do OTEL_METRICS_EXPORTER=otlp or "
                    "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT). Off by default: trace-only backends (Phoenix, "
                    "Langfuse, Tempo) refuse metrics; `/metrics` always serves them.",
    "project_name": "The project spans land in: the resource attribute `openinference.project.name` "
                    "(Phoenix). Langfuse takes its project from the key pair.",
    "connect_timeout_s": "Seconds to connect to an upstream (502 after).",
    "read_timeout_s": "Seconds an upstream may stay silent between bytes (504 after).",
    "max_connections": "Pooled upstream connections (in-flight upstream calls).",
    "max_body_bytes": "Largest request body; larger requests get 413.",
    "body_timeout_s": "Seconds a request body may take to arrive (408 after).",
    "gc_tuning": "Once serving, move everything built at start-up out of the garbage collector's reach "
                 "(`gc.freeze`) and collect the young generation every 20,000 allocations instead of 700: "
                 "less CPU per call (see docs/benchmarks.md). Off: Python's defaults.",
    "allow_passthrough": "Forward unknown paths to the upstream, unmetered (budgets do not apply to them).",
    "data_dir": "Directory of the SQLite ledger and the local span files (`spanmeter runs` reads them).",
    "ledger_url": "The ledger: `sqlite:///PATH` (default `sqlite:///{data_dir}/ledger.db`; "
                  "`?synchronous=normal` trades power-loss durability of the last commits for latency), "
                  "`redis://HOST:6379/0` for several replicas, or `redis+cluster://HOST:PORT[,HOST:PORT...]` "
                  "for a Redis Cluster (`rediss+cluster://` with TLS; Valkey works alike; docs/scale.md).",
    "ledger_leases": "Budget leases (on by default): calls are admitted in memory against headroom leased "
                     "ahead of need in one ledger write: a tenant's runs of one call (no X-Run-Id) from a lease "
                     "of its day, month and key scopes, a run's calls after its first from a lease of the run, "
                     "while the calls come less than 0.5 s apart (slower ones are exact). A crash or power cut "
                     "can only over-count, by a lease's unused part; no ceiling is crossed "
                     "(docs/budgets.md#budget-leases). `false`: every call is one exact ledger write.",
    "fail_open": "Ledger unreachable: refuse calls with 503 (false) or serve them unmetered, logged at ERROR "
                 "(true).",
    "timezone": "IANA timezone of the calendar days and months that daily and monthly budgets count in.",
    "run_idle_timeout_s": "A run with no call for this long ends (its run span is emitted, open tool calls "
                          "are recorded as missing).",
    "admin_token": "Bearer token of the admin API under `/admin` (`spanmeter spend`, `spanmeter budget`, which "
                   "read it from the same file or variable); unset: the admin API is off.",
    "log_level": "Log level; INFO logs one access line per call, 5xx answers are logged at ERROR.",
    "log_format": "`text` (one line per record) or `json` (one JSON object per line, for log pipelines).",
    "tenants": "Tenants by name; none configured means open mode (one tenant `default`, each caller's own "
               "provider key goes upstream).",
    "policy": "The global policy, under each tenant's own `policy`.",
    "prices": "Price overrides per model: `{MODEL: {input, cached_input, cache_write, output}}` in USD per "
              "million tokens, over genai-prices' data and the shipped rows (proxy/data/prices.yaml).",
    "prices_file": "A genai-prices data file written by `spanmeter prices --refresh`, read at start-up only; "
                   "unset: the data of the installed genai-prices package.",
    "otlp_endpoint": "OTLP/HTTP base URL for spans (`http://collector:4318`); metrics go there too only "
                     "with `otlp_metrics`. The standard OTEL_EXPORTER_OTLP_ENDPOINT works too.",
    "export_process": "Encode and send spans in a child process (one per worker), out of the serving "
                      "process: `auto` (default) when spans go over OTLP, `on` also for the local files "
                      "alone, `off` in the serving process. The child runs 10 nicer than its parent, so on a "
                      "shared core a request is served before a batch of spans is encoded. The child exits "
                      "with its parent; one killed is restarted, what it held counted in "
                      "`spanmeter.telemetry.dropped_spans`.",
    "anatomy": "Split each call's billed input into its parts (instructions, tool definitions, tool results, "
               "earlier turns, new content) with their tokens and cost, on spans, metrics, run totals, "
               "`spanmeter runs RUN_ID` and the overview dashboard. Costs 32-35 us of CPU per call in a run on "
               "the quiet bench machine (bench/bench_anatomy.py; README: Cost anatomy); `false` turns it off.",
    "access_log_anatomy": "With `anatomy`, add the parts to the access line (`input=kind:tokens:micro-USD,...`).",
    "local_traces": "Keep spans in `{data_dir}/traces` for `spanmeter runs` (also when exporting over OTLP).",
    "policy.runs.max_llm_calls": "Model calls per run. A request may lower it with `X-Run-Max-Calls`.",
    "policy.runs.max_cost_usd": "Cost per run in USD. A request may lower it with `X-Run-Max-Cost-Usd`.",
    "policy.runs.max_tool_calls": "MCP tool calls per run (through `/mcp/NAME`), refused with a JSON-RPC error "
                                  "past it. Tools the agent runs itself are counted, not refused.",
    "policy.runs.max_tokens": "Input + output tokens per run, reserved like cost: each call holds its worst "
                              "case (input bound + output bound, cut to what is left, the request's max-token "
                              "field clamped to it) until it settles, so concurrent calls never cross it (402). "
                              "A request may lower it with `X-Run-Max-Tokens`.",
    "policy.runs.max_seconds": "Wall time per run from its first call, in seconds; checked when a model or MCP "
                               "tool call is admitted (402). A call admitted before it runs to its end "
                               "(docs/budgets.md). A request may lower it with `X-Run-Max-Seconds`.",
    "policy.runs.wrap_up_at": "Off when unset. The share of any run ceiling (calls, cost, tokens, time) from "
                              "which each request carries a wrap-up note for the model after its last message "
                              "(and the last call the call ceiling allows always does); `X-Run-Wrap-Up-At` "
                              "brings it earlier, never turns it on. See docs/budgets.md.",
    "policy.rate_limits.requests_per_minute": "Requests per minute, rolling (GCRA, inside the admission): "
                                              "beyond it a 429 with Retry-After and `x-ratelimit-*` headers.",
    "policy.rate_limits.tokens_per_minute": "Tokens per minute, each call counted at admission as its input "
                                            "bound plus the output it may generate; a call larger than the "
                                            "limit is a 429 with `x-should-retry: false`.",
    "policy.budgets.daily_usd": "The tenant's budget per calendar day in `timezone`, in USD (the admin API "
                                "can override it).",
    "policy.budgets.monthly_usd": "The tenant's budget per calendar month in `timezone`, in USD (the admin "
                                  "API can override it).",
    "policy.repair.mode": "Structured output and tool arguments: `repair` them, `report` problems only, or "
                          "leave them (`off`).",
    "policy.repair.on_invalid": "Repaired output still violates its schema: `pass` it (recorded), answer "
                                "422 naming each problem (`error`), or ask once more with the problems fed "
                                "back (`retry`; counts as a call; not for streams).",
    "policy.repair.close_truncated": "Close JSON cut by the token limit (otherwise it is recorded as "
                                     "truncated and left as it came).",
    "policy.guard.action": "The same tool with the same arguments again and again: `remind` the model (a "
                           "note prefixed to the tool result), `refuse` the call (409), or `off`.",
    "policy.guard.threshold": ("Identical tool calls in consecutive model answers before the guard acts (identical "
                               "parallel calls within one answer count once)."),
    "policy.guard.max_consecutive_failures": "Refuse after this many failed tool results in a row.",
    "policy.capture_content": "`NO_CONTENT` lets a tenant turn message capture off when the process "
                              "captures it (OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=SPAN_ONLY).",
    "policy.prompt_cache": "`auto` (the default): Anthropic cache breakpoints added where they are expected "
                           "to be read (a stable prefix another run sent within 5 minutes, a run's third call "
                           "on; never to a request with its own `cache_control`), and an OpenAI "
                           "`prompt_cache_key` per run or agent; `off`: requests go as the agent sent them. "
                           "See README \"Prompt caching\".",
    "tenants.keys": "sha256 hex digests of the tenant's spanmeter keys (`spanmeter keys create` prints "
                    "one); keys are never stored in clear. A key with limits of its own is `{hash, policy}`, "
                    "its policy holding `runs` (the tighter of the key's and the tenant's wins), `budgets` "
                    "and `rate_limits` (its own, besides the tenant's).",
    "tenants.upstream_keys": "Per-tenant override of `upstream_keys`.",
    "tenants.upstream": "The named upstream (under `upstreams`) all of this tenant's calls go to.",
    "tenants.policy": "The tenant's policy, over the global one; same fields as `policy`.",
    "upstreams.dialect": "`openai` (the default), `anthropic`, `gemini`, `azure`, `vertex` (Vertex AI's "
                         "routes) or `bedrock` (AWS Bedrock's): the wire format the upstream speaks.",
    "upstreams.aws_profile": "bedrock: the AWS profile whose credentials sign the calls (SigV4); unset: AWS's "
                             "standard chain.",
    "upstreams.aws_access_key_id_env": "bedrock: environment variable holding the access key id that signs the "
                                       "calls (with `aws_secret_access_key_env`).",
    "upstreams.aws_secret_access_key_env": "bedrock: environment variable holding the secret access key.",
    "upstreams.aws_session_token_env": "bedrock: environment variable holding a session token, if the keys are "
                                       "temporary.",
    "upstreams.aws_region": "bedrock: the region its calls go to and are signed for (over `bedrock_region`).",
    "upstreams.base_url": "Origin plus optional path prefix of the upstream (a built-in host has its own).",
    "upstreams.key_env": "Environment variable holding its key (must be set when spanmeter starts); unset: "
                         "no key is sent.",
    "upstreams.provider_name": "`gen_ai.provider.name` on spans; default derived from the host.",
}

# What each metric tells an operator (the instrument's own description is in
# tracing/attributes.py; this is what to do with it).
def _refusal_reasons() -> str:
    """The refusal vocabulary (proxy.model.REFUSAL_KINDS), each run of reasons with what refused them."""
    groups: list[tuple[str, list[str]]] = []
    for reason, kind in REFUSAL_KINDS.items():
        if not groups or groups[-1][0] != kind:
            groups.append((kind, []))
        groups[-1][1].append(f"`{reason}`")
    return "; ".join(f"{', '.join(reasons)} ({kind})" for kind, reasons in groups)


METRIC_DOCS: dict[str, str] = {
    "gen_ai.client.operation.duration": "Whole model call through spanmeter, stream included, by model, "
                                        "provider, tenant and error.type. Rising p95 with no change in tokens: "
                                        "the upstream is slow.",
    "gen_ai.client.token.usage": "Input and output tokens per call (`gen_ai_token_type`). Spend follows it.",
    "gen_ai.client.operation.time_to_first_chunk": "Streams only: time until the first chunk reached spanmeter.",
    "gen_ai.client.operation.time_per_output_chunk": "Streams only: mean gap between chunks, one point per call.",
    "gen_ai.client.inference.duration": "The same as operation.duration under the newer GenAI name "
                                        "(OTEL_SEMCONV_STABILITY_OPT_IN=gen_ai_latest_experimental).",
    "gen_ai.client.inference.time_to_first_chunk": "time_to_first_chunk under the newer GenAI name.",
    "gen_ai.client.inference.time_per_output_chunk": "time_per_output_chunk under the newer GenAI name.",
    "gen_ai.execute_tool.duration": "Tool executions as inferred from the conversation: from the answer that "
                                    "asked for the tool to the request that brought its result (includes the "
                                    "agent's own work).",
    "spanmeter.cost": "US dollars charged, by tenant and model. `rate(...[1h]) * 3600` is spend per hour.",
    "spanmeter.cache.input_tokens": "Input tokens read from (`read`) or written to (`write`) the provider's "
                                    "prompt cache, by tenant and model. Divided by input tokens: the cache "
                                    "hit rate. A drop after a deploy: something rewrites the prompt's prefix.",
    "mcp.client.operation.duration": "Each MCP request through `/mcp/NAME`, by method, tool and outcome. "
                                     "Slow `tools/call`: the tool, not the model, is where the run waits.",
    "spanmeter.input.cost": "US dollars of input by kind of part (`spanmeter.input.part`), with `anatomy` on; "
                            "shares by bytes.",
    "spanmeter.tool.context.cost": "US dollars of input the tool's results cost, every send counted (re-sends "
                                   "included), by tool name and tenant.",
    "spanmeter.tool.definitions.unused_cost": "US dollars a run spent on the definitions of tools it never called, "
                                              "counted when the run ends, by tool name and tenant.",
    "spanmeter.cost.saved": "US dollars the cache reads saved at the price table's rates, by tenant and model.",
    "spanmeter.cost.cache_write_premium": "US dollars cache writes cost above plain input (Anthropic's "
                                          "1.25x/2x), by tenant and model: `saved` minus this is what "
                                          "caching saved, net.",
    "spanmeter.limit.rejections": "Calls refused before reaching the upstream, model calls and MCP requests "
                                  f"alike, by `spanmeter_reason`: {_refusal_reasons()}. An MCP refusal has "
                                  "`gen_ai_tool_name` (a `tools/call`) or `mcp_method_name` (any other request) "
                                  "where a model call has its model; the statuses are the model route's, the MCP "
                                  "route answers a refusal as a JSON-RPC error (docs/mcp.md). A step up after a "
                                  "change: a budget, ceiling or rate limit set too low.",
    "spanmeter.repairs": "Repairs made to structured output and tool arguments, by kind (fence, "
                         "trailing_comma, ...). A model or prompt change shows here first.",
    "spanmeter.tool.calls": "Tool calls by outcome: ok, failed (error envelope, is_error, non-zero exit "
                            "code) or missing (the run ended without a result).",
    "spanmeter.guard.actions": "Loop guard reminders and refusals, by tool: agents stuck on one call.",
    "spanmeter.rewrites": "Changes to requests or responses other than repairs, by kind (max_tokens_clamp, "
                          "include_usage, loop_reminder, wrap_up; and, counted only when a stream's event "
                          "was changed, usage_chunk and repair).",
    "spanmeter.wrap_up.notices": "Wrap-up notes sent to models, by the ceiling whose share was reached "
                                 "(`spanmeter_reason`: calls, cost, tokens, time, last_call).",
    "spanmeter.runs.ended": "Ended runs by `spanmeter_run_outcome`: answered_after_notice (the note worked), "
                            "ceiling_after_notice (it did not), ceiling (no note set), other. Many "
                            "ceiling_after_notice: lower `runs.wrap_up_at`.",
    "spanmeter.ledger.overshoot": "Cost settled above what was reserved (usage beyond the worst-case bound: "
                                  "media by URL, server-side tools). Non-zero: a budget can be passed by "
                                  "that much; check the model's price and the requests' size.",
    "spanmeter.telemetry.dropped_spans": "Spans dropped instead of exported, by exporter and reason "
                                         "(queue_full, export_failed). Non-zero: the collector is down or "
                                         "too slow; calls are unaffected.",
    "spanmeter.budget.spent_usd": "A tenant's spend in the current day or month (`spanmeter_budget_window`), "
                                  "as this replica last saw it. Several replicas: take max, never sum.",
    "spanmeter.budget.limit_usd": "The tenant's budget for that window.",
}


# --- settings -------------------------------------------------------------------------------


def fields() -> Iterator[tuple[str, str, Any, Any]]:
    """(dotted path, env var, field info, default) of every setting, in reference order."""
    for name, info in Settings.model_fields.items():
        yield name, ENV_PREFIX + name.upper(), info, info.get_default(call_default_factory=True)
    yield from _policy_fields("policy", Policy)
    models: tuple[tuple[str, type[BaseModel]], ...] = (("tenants", TenantConfig), ("upstreams", Upstream))
    for prefix, model in models:
        for name, info in model.model_fields.items():
            yield f"{prefix}.{name}", "", info, info.get_default(call_default_factory=True)


def _policy_fields(path: str, model: type[BaseModel]) -> Iterator[tuple[str, str, Any, Any]]:
    for name, info in model.model_fields.items():
        dotted = f"{path}.{name}"
        sub = info.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            yield from _policy_fields(dotted, sub)
            continue
        env = ENV_PREFIX + "__".join(dotted.split(".")).upper()
        yield dotted, env, info, _policy_default(dotted)


def _policy_default(dotted: str) -> Any:
    value: Any = DEFAULT_POLICY
    for part in dotted.split(".")[1:]:
        value = getattr(value, part, None)
    return value


def _type(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:  # a type with a validator: the type a reader writes
        return _type(args[0])
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        kept = [a for a in args if a is not type(None)]
        return " \\| ".join(_type(a) for a in kept)
    if origin is dict:
        return "mapping"
    if origin is list:
        return "list"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    return {str: "string", int: "integer", float: "number", bool: "boolean"}.get(annotation, str(annotation))


def _bounds(info: Any) -> str:
    parts = []
    for m in info.metadata:
        for attr, sign in (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<")):
            v = getattr(m, attr, None)
            if v is not None:
                parts.append(f"{sign} {v:g}" if isinstance(v, int | float) else f"{sign} {v}")
    return ", ".join(parts)


def _default(path: str, info: Any, value: Any) -> str:
    if value is PydanticUndefined:
        return "required"
    if path == "ledger_url":
        return "`sqlite:///{data_dir}/ledger.db`"
    if path == "tenants":
        return "none (open mode)"
    if value is None:
        return "none"
    if isinstance(value, BaseModel):
        return "see below"
    if isinstance(value, dict):
        return ", ".join(f"{k}: `{v}`" for k, v in value.items()) if value else "none"
    if isinstance(value, list):
        return "none" if not value else ", ".join(f"`{v}`" for v in value)
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, float):
        return f"`{value:g}`"
    return f"`{value}`"


def render_config_reference() -> str:
    rows = ["| setting | environment variable | type | default | meaning |", "|---|---|---|---|---|"]
    for path, env, info, value in fields():
        kind = _type(info.annotation)
        bounds = _bounds(info)
        if bounds:
            kind += f", {bounds}"
        meaning = FIELD_DOCS.get(path, "")
        env_cell = f"`{env}`" if env else ""
        if kind in ("mapping", "list") and env:
            env_cell += " (JSON)"
        elif kind == "section" and env:
            env_cell = f"`{env}__...`"
        rows.append(f"| `{path}` | {env_cell} | {kind} | {_default(path, info, value)} | {meaning} |")
    return "\n".join(rows) + "\n"


# --- metrics --------------------------------------------------------------------------------


def render_metrics() -> str:
    from tracing.attributes import METRICS, prometheus_series

    rows = ["| metric (Prometheus series) | kind, unit | what it tells you |", "|---|---|---|"]
    for spec in METRICS:
        series = ", ".join(f"`{s}`" for s in prometheus_series(spec.name))
        rows.append(f"| `{spec.name}` ({series}) | {spec.kind}, {spec.unit} | {METRIC_DOCS.get(spec.name, '')} |")
    return "\n".join(rows) + "\n"


# --- the files ------------------------------------------------------------------------------


def render_otel_variables() -> str:
    from tracing.setup import HONOURED_OTEL_VARIABLES, NOT_HONOURED_OTEL_VARIABLES

    rows = ["| variable | honoured | what it does in spanmeter |", "|---|---|---|"]
    rows += [f"| `{name}` | yes | {what} |" for name, what in HONOURED_OTEL_VARIABLES]
    rows += [f"| `{name}` | no | {why} |" for name, why in NOT_HONOURED_OTEL_VARIABLES]
    return "\n".join(rows) + "\n"


def render(name: str) -> str:
    if name == "config-reference":
        return render_config_reference()
    if name == "metric-push":
        from tracing.setup import METRIC_PUSH_RULE

        return METRIC_PUSH_RULE + "\n"
    if name == "otel-variables":
        return render_otel_variables()
    if name == "metrics":
        return render_metrics()
    if name == "scenarios":
        from proxy.simulator.script import render_scenarios

        return render_scenarios(markdown=True)
    raise KeyError(name)


GENERATED: dict[str, tuple[str, ...]] = {
    "docs/operations.md": ("config-reference", "metric-push", "otel-variables", "metrics"),
    "docs/simulator.md": ("scenarios",),
}


def _region(name: str) -> re.Pattern[str]:
    return re.compile(rf"(<!-- generated: {name} [^>]*-->\n)(.*?)(<!-- end: {name} -->)", re.S)


def generated_parts(text: str, name: str) -> str | None:
    m = _region(name).search(text)
    return m.group(2) if m else None


def rewrite(text: str, names: tuple[str, ...]) -> str:
    for name in names:
        pattern = _region(name)
        if not pattern.search(text):
            raise ValueError(f"no `<!-- generated: {name} ... -->` region")
        text = pattern.sub(lambda m, n=name: m.group(1) + render(n) + m.group(3), text)  # type: ignore[misc]
    return text


def main(argv: list[str] | None = None) -> int:
    check = "--check" in (argv if argv is not None else sys.argv[1:])
    stale = []
    for rel, names in GENERATED.items():
        path = ROOT / rel
        old = path.read_text(encoding="utf-8")
        new = rewrite(old, names)
        if new != old:
            stale.append(rel)
            if not check:
                path.write_text(new, encoding="utf-8")
    if stale:
        print(("out of date: " if check else "rewrote: ") + ", ".join(stale))
    return 1 if check and stale else 0


if __name__ == "__main__":
    raise SystemExit(main())
