"""Settings: defaults < YAML file (SPANMETER_CONFIG) < environment (SPANMETER_*).

Policy is layered once more: global `policy` < the tenant's `policy`; a key's own `policy`
(under the tenant's `keys`) and request headers may only tighten it. Every field has an
environment variable: nested fields use `__`, e.g. `SPANMETER_POLICY__RUNS__MAX_LLM_CALLS=8`.
"""

from __future__ import annotations

import difflib
import hashlib
import ipaddress
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator
from pydantic_settings import (
    BaseSettings,
    InitSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from proxy.errors import ConfigError

__all__ = [
    "MAX_RATE",
    "MAX_RUN_CALLS",
    "MAX_RUN_SECONDS",
    "MAX_RUN_TOKENS",
    "MAX_USD",
    "GuardPolicy",
    "KeyConfig",
    "KeyPolicy",
    "McpServer",
    "Policy",
    "RateLimitPolicy",
    "RepairPolicy",
    "RunPolicy",
    "Settings",
    "TenantConfig",
    "Upstream",
    "hash_key",
    "key_id_of",
    "load_settings",
    "read_config_file",
    "unknown_env_variables",
    "unset_default_keys",
    "unset_keys_problem",
    "unset_upstream_keys",
]

# SPANMETER_* variables that are not settings: the CLI's own.
_CLIENT_VARIABLES = frozenset({"SPANMETER_URL"})
_REFERENCE_HINT = "`spanmeter config reference` prints every setting"

ENV_PREFIX = "SPANMETER_"
KEY_PREFIX = "sm-"  # how every spanmeter key starts (proxy/serve/tenants.py new_key)
MAX_WORKERS = 256


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# The largest ceilings spanmeter accepts, wherever they are set (config, admin API, request
# headers). The ledger keeps money as integer micro-USD exact below 2**53 (~$9e9, Redis Lua
# numbers are doubles): $1e9 is 1e15 micro-USD, with room to add reservations on top.
MAX_USD = 1_000_000_000
MAX_RUN_CALLS = 1_000_000_000
MAX_RUN_TOKENS = 10**15  # exact in the ledger (below 2**53)
MAX_RUN_SECONDS = 366 * 86400
# Rate limits are kept as integer "unit-milliseconds" (limit x 60,000 at most), exact in
# Redis's Lua numbers below 2**53.
MAX_RATE = 1_000_000_000


class RunPolicy(_Strict):
    max_llm_calls: int | None = Field(None, ge=1, le=MAX_RUN_CALLS)
    max_cost_usd: float | None = Field(None, gt=0, le=MAX_USD)
    # MCP tool calls through /mcp/{name} per run (0: none); tools the agent runs itself
    # never pass through spanmeter, so they are counted in the run's totals but not refused.
    max_tool_calls: int | None = Field(None, ge=0, le=MAX_RUN_CALLS)
    max_tokens: int | None = Field(None, ge=1, le=MAX_RUN_TOKENS)  # input + output over the run, as settled
    max_seconds: float | None = Field(None, gt=0, le=MAX_RUN_SECONDS)  # wall time from the run's first call
    # The share of any run ceiling above (calls, cost, tokens, time) from which each request
    # carries a wrap-up note for the model; off when unset (proxy/govern/wrapup.py).
    wrap_up_at: float | None = Field(None, gt=0, le=1)


class RateLimitPolicy(_Strict):
    """Rolling limits per minute, enforced inside the admission (proxy/ledger/store.py, GCRA)."""

    requests_per_minute: int | None = Field(None, ge=1, le=MAX_RATE)
    tokens_per_minute: int | None = Field(None, ge=1, le=MAX_RATE)  # input bound + reserved output


class BudgetPolicy(_Strict):
    daily_usd: float | None = Field(None, gt=0, le=MAX_USD)
    monthly_usd: float | None = Field(None, gt=0, le=MAX_USD)


class RepairPolicy(_Strict):
    mode: Literal["repair", "report", "off"] | None = None
    on_invalid: Literal["pass", "error", "retry"] | None = None
    close_truncated: bool | None = None


class GuardPolicy(_Strict):
    action: Literal["remind", "refuse", "off"] | None = None
    threshold: int | None = Field(None, ge=2)
    max_consecutive_failures: int | None = Field(None, ge=1)


class Policy(_Strict):
    """Policy knobs; `None` means "inherit from the layer below"."""

    runs: RunPolicy = RunPolicy()
    budgets: BudgetPolicy = BudgetPolicy()
    rate_limits: RateLimitPolicy = RateLimitPolicy()
    repair: RepairPolicy = RepairPolicy()
    guard: GuardPolicy = GuardPolicy()
    capture_content: Literal["NO_CONTENT", "SPAN_ONLY"] | None = None
    # auto: prompt-cache breakpoints (Anthropic) and a run's cache key (OpenAI) added where
    # they pay (proxy/govern/caching.py); off: requests go as the agent sent them.
    prompt_cache: Literal["auto", "off"] | None = None

    def over(self, base: Policy) -> Policy:
        """This policy layered over `base`: fields set here win."""
        merged: dict[str, Any] = {}
        for section in ("runs", "budgets", "rate_limits", "repair", "guard"):
            mine = getattr(self, section).model_dump(exclude_none=True)
            merged[section] = {**getattr(base, section).model_dump(), **mine}
        merged["capture_content"] = self.capture_content or base.capture_content
        merged["prompt_cache"] = self.prompt_cache or base.prompt_cache
        return Policy.model_validate(merged)


DEFAULT_POLICY = Policy(
    repair=RepairPolicy(mode="repair", on_invalid="pass", close_truncated=False),
    guard=GuardPolicy(action="remind", threshold=3),
    prompt_cache="auto",
)


# What an environment variable's name looks like (POSIX shells accept no other), and the
# starts of the keys providers issue: a key pasted where its variable's name belongs would
# otherwise be printed back as a "variable that is not set".
_VARIABLE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_KEY_STARTS = ("sk-", "sk_", "sm-", "AIza", "gsk_", "xai-", "csk-", "pk-", "ya29.")


def _check_variable(name: str) -> str:
    if not name:
        return name
    if not _VARIABLE_NAME.fullmatch(name) or name.startswith(_KEY_STARTS):
        raise ValueError(
            "expected the NAME of an environment variable that holds the key (e.g. OPENAI_API_KEY), and this "
            "is not one. If it is the key itself, it is now in the config: put it in spanmeter's environment "
            "under a name, write that name here, and consider the key exposed")
    return name


VariableName = Annotated[str, AfterValidator(_check_variable)]


class Upstream(_Strict):
    """A named upstream of one dialect (e.g. a local OpenAI-compatible server). An entry
    with the name of a built-in host (groq, mistral, ...: proxy/providers/hosts.py)
    overrides only the fields it gives; any other entry needs `base_url`."""

    # vertex: Vertex AI's routes (Gemini and Anthropic bodies, OAuth bearer; proxy/providers/vertex.py)
    # bedrock: AWS Bedrock's routes (Converse and InvokeModel; proxy/providers/bedrock.py)
    dialect: Literal["openai", "anthropic", "gemini", "azure", "vertex", "bedrock"] = "openai"
    base_url: str | None = None
    key_env: VariableName | None = None  # env var holding the upstream key
    # bedrock: calls are signed (SigV4) with this AWS profile's credentials, or with the keys in
    # these variables, rather than the standard chain's; and sent to this region's endpoint.
    aws_profile: str | None = None
    aws_access_key_id_env: VariableName | None = None
    aws_secret_access_key_env: VariableName | None = None
    aws_session_token_env: VariableName | None = None
    aws_region: str | None = None
    # gen_ai.provider.name; default: the provider a well-known host names, else the dialect's API
    provider_name: str | None = None



class McpServer(_Strict):
    """An MCP server served at /mcp/{name} (Streamable HTTP)."""

    url: str  # the server's MCP endpoint, e.g. http://tools.internal:8000/mcp
    key_env: VariableName | None = None  # env var holding the server's own credential (sent as a Bearer token)
    tool_costs: dict[str, float] = {}  # tool name -> USD per call, counted against run and tenant budgets


    @field_validator("tool_costs")
    @classmethod
    def _costs(cls, v: dict[str, float]) -> dict[str, float]:
        for tool, usd in v.items():
            if not 0 <= usd <= MAX_USD:  # also refuses nan
                raise ValueError(f"the cost of tool {tool!r} must be between 0 and {MAX_USD} USD, got {usd}")
        return v


class KeyPolicy(_Strict):
    """One key's own limits, within its tenant's: ceilings of the runs it makes (the
    tighter of the two wins), budgets and rate limits of its own (both must hold)."""

    runs: RunPolicy = RunPolicy()
    budgets: BudgetPolicy = BudgetPolicy()
    rate_limits: RateLimitPolicy = RateLimitPolicy()


def _check_hash(k: str) -> str:
    if len(k) != 64 or any(c not in "0123456789abcdef" for c in k):
        if k.startswith(KEY_PREFIX):
            raise ValueError(
                "this is a spanmeter key itself, pasted where its sha256 hash belongs; the config holds only "
                "hashes, never keys (anyone who reads the file could spend with it). Put the 64-character hash "
                "`spanmeter keys create` printed beside the key, and consider the key exposed: create a new one")
        raise ValueError(
            "a key entry is the sha256 hex digest of a key (64 characters, 0-9 and a-f), never the key in "
            "clear; `spanmeter keys create --tenant NAME` prints a key and its hash")
    return k


class KeyConfig(_Strict):
    """A key with limits of its own: `{hash: <sha256 hex>, policy: {...}}`."""

    hash: str
    policy: KeyPolicy = KeyPolicy()

    @field_validator("hash")
    @classmethod
    def _hash(cls, v: str) -> str:
        return _check_hash(v)

    @property
    def key_id(self) -> str:
        return key_id_of(self.hash)


class TenantConfig(_Strict):
    # sha256 hex of each spanmeter key (`spanmeter keys create` prints one), or
    # {hash, policy} for a key with limits of its own.
    keys: list[str | KeyConfig] = []
    upstream_keys: dict[str, VariableName] = {}  # dialect -> env var name of the upstream key
    upstream: str | None = None  # name of an extra upstream all this tenant's calls go to
    policy: Policy = Policy()

    @field_validator("keys")
    @classmethod
    def _hashes(cls, v: list[str | KeyConfig]) -> list[str | KeyConfig]:
        for k in v:
            if isinstance(k, str):
                _check_hash(k)
        return v

    def key_configs(self) -> list[KeyConfig]:
        """Every key as a KeyConfig (a plain hash has no limits of its own)."""
        return [KeyConfig(hash=k) if isinstance(k, str) else k for k in self.keys]


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_nested_delimiter="__", extra="forbid", frozen=True
    )

    host: str = "127.0.0.1"
    port: int = Field(8787, ge=0, le=65535)
    # Processes serving the port (`auto`: one per CPU); 1 is a single process (proxy/ops/workers.py).
    workers: int = Field(1, ge=1, le=MAX_WORKERS)
    config: str | None = None  # YAML file; read through SPANMETER_CONFIG

    openai_base_url: str = "https://api.openai.com"
    anthropic_base_url: str = "https://api.anthropic.com"
    gemini_base_url: str = "https://generativelanguage.googleapis.com"
    # Azure OpenAI: the resource's endpoint (https://{resource}.openai.azure.com); no default,
    # as every resource has its own host.
    azure_openai_base_url: str | None = None
    # Azure deployment -> the model it runs, to reserve a call at that model's price before
    # the answer names it (else learned from the deployment's earlier answers).
    azure_deployments: dict[str, str] = {}
    # Vertex AI; unset: the host of the location in each call's path ({location}-aiplatform.googleapis.com).
    vertex_base_url: str | None = None
    # AWS Bedrock; unset: https://bedrock-runtime.{region}.amazonaws.com, the region from
    # bedrock_region, else AWS_REGION / AWS_DEFAULT_REGION in spanmeter's environment.
    bedrock_base_url: str | None = None
    bedrock_region: str | None = None
    upstreams: dict[str, Upstream] = {}
    mcp_servers: dict[str, McpServer] = {}  # served at /mcp/{name}
    # Env vars holding upstream keys, per dialect, used in tenant mode when a tenant names none.
    upstream_keys: dict[str, VariableName] = {
        "openai": "OPENAI_API_KEY",
        "anthropic": "ANTHROPIC_API_KEY",
        "gemini": "GEMINI_API_KEY",
        "azure": "AZURE_OPENAI_API_KEY",
    }
    connect_timeout_s: float = Field(10.0, gt=0)
    read_timeout_s: float = Field(600.0, gt=0)  # between bytes; long generations stream slowly
    max_connections: int = Field(1024, ge=1)  # in-flight upstream calls; model calls last seconds
    max_body_bytes: int = Field(32 * 1024 * 1024, ge=1024)
    body_timeout_s: float = Field(60.0, gt=0)  # a request body must arrive within this (slow senders)
    allow_passthrough: bool = False  # unmetered forwarding of unknown paths
    gc_tuning: bool = True  # freeze start-up objects, collect the young generation less often

    data_dir: str = ".spanmeter"
    ledger_url: str | None = None  # default sqlite:///{data_dir}/ledger.db
    fail_open: bool = False  # Redis down: refuse (default) or forward unmetered, loudly
    ledger_leases: bool = True  # budget leases: calls admitted in memory from leased headroom (ledger/leases.py)
    timezone: str = "UTC"
    run_idle_timeout_s: float = Field(600.0, gt=0)
    admin_token: str | None = None
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    log_format: Literal["text", "json"] = "text"  # json: one object per line, for log pipelines

    tenants: dict[str, TenantConfig] = {}
    policy: Policy = Policy()
    # model -> {input, cached_input, cache_write, cache_write_1h, output,
    #           service_tiers: {tier: multiplier}, inference_geos: {geo: multiplier}}
    prices: dict[str, dict[str, float | dict[str, float]]] = {}
    # A genai-prices data file written by `spanmeter prices --refresh`, read at start-up only
    # (a running ceiling never has its prices swapped); None: the installed genai-prices' data.
    prices_file: str | None = None
    _policies: dict[str, Policy] = PrivateAttr(default_factory=dict)  # policy_for's cache
    _key_policies: dict[tuple[str, str], KeyPolicy] | None = PrivateAttr(default=None)  # key_policy's index

    otlp_endpoint: str | None = None  # else the standard OTEL_EXPORTER_OTLP_ENDPOINT
    # Metrics are pulled from /metrics; pushed over OTLP only when asked: this, or the
    # standard OTEL_METRICS_EXPORTER=otlp / OTEL_EXPORTER_OTLP_METRICS_ENDPOINT.
    otlp_metrics: bool = False
    # The project the spans land in, for backends that sort by project (Phoenix reads the
    # resource attribute openinference.project.name; Langfuse takes it from the key pair).
    project_name: str | None = Field(None, min_length=1, max_length=256)
    local_traces: bool = True  # keep spans under data_dir for `spanmeter runs`
    # Cost anatomy: each call's input split into parts (instructions, tool definitions,
    # tool results, earlier turns, new content) with their tokens and cost. On by default:
    # 32-35 us per call in a run on the quiet bench machine, 22-23% of a bare pass-through's
    # request there, above its 20 us target (bench/bench_anatomy.py, `make bench`, README);
    # SPANMETER_ANATOMY=false turns it off.
    anatomy: bool = True
    access_log_anatomy: bool = False  # the anatomy on the access line too (`input=`)
    # Encode and send spans in a child process: auto = when exporting over OTLP.
    export_process: Literal["auto", "on", "off"] = "auto"

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        path = os.environ.get(f"{ENV_PREFIX}CONFIG")
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        if path:
            sources.append(InitSettingsSource(settings_cls, read_config_file(path)))
        return tuple(sources)

    @field_validator("workers", mode="before")
    @classmethod
    def _auto_workers(cls, v: Any) -> Any:
        if isinstance(v, str) and v.strip().lower() == "auto":
            return min(os.cpu_count() or 1, MAX_WORKERS)
        return v

    @property
    def open_mode(self) -> bool:
        """No tenants configured: one tenant `default`, the caller's own key goes upstream."""
        return not self.tenants

    @property
    def ledger(self) -> str:
        return self.ledger_url or f"sqlite:///{Path(self.data_dir) / 'ledger.db'}"

    def policy_for(self, tenant: str) -> Policy:
        """The tenant's policy over the global one over the defaults; built once per tenant
        (settings are frozen, and layering with pydantic costs ~40 µs per call)."""
        policies: dict[str, Policy] = self._private()["_policies"]
        found = policies.get(tenant)
        if found is None:
            t = self.tenants.get(tenant)
            base = self.policy.over(DEFAULT_POLICY)
            found = policies[tenant] = t.policy.over(base) if t else base
        return found

    def key_policy(self, tenant: str, key_id: str | None) -> KeyPolicy | None:
        """The limits of one key of `tenant` (by `Caller.key_id`), or None if it has none."""
        if key_id is None:
            return None
        private = self._private()
        index: dict[tuple[str, str], KeyPolicy] | None = private["_key_policies"]
        if index is None:
            index = private["_key_policies"] = {(name, k.key_id): k.policy for name, t in self.tenants.items()
                                                for k in t.key_configs() if k.policy != KeyPolicy()}
        return index.get((tenant, key_id))

    def _private(self) -> dict[str, Any]:
        """The private attributes' storage. Both lookups above run on every call, and reading
        `self._policies` goes through BaseModel.__getattr__ (~1 µs each); pydantic keeps private
        attributes in this dict, which is an ordinary slot."""
        private = self.__pydantic_private__
        assert private is not None  # never None on a model that declares private attributes
        return private

    def check(self) -> Settings:
        """Cross-field rules pydantic cannot express; raises ConfigError with the fix."""
        if self.open_mode and not _is_loopback(self.host):
            raise ConfigError(
                f"Refusing to start in open mode on {self.host}: with no tenants configured, "
                "anyone who can reach the port could spend through it. Listen on 127.0.0.1, or "
                "configure tenants (`spanmeter keys create --tenant NAME`, then add the printed "
                "hash under tenants.NAME.keys in the file named by SPANMETER_CONFIG)."
            )
        if self.workers > 1 and ":memory:" in self.ledger:
            raise ConfigError(
                f"Refusing to start {self.workers} workers on the in-memory ledger {self.ledger}: each worker "
                "would count spend on its own, and ceilings would not hold. Use a ledger file "
                "(sqlite:///path/ledger.db, the default) or Redis, or run one worker."
            )
        for name, t in self.tenants.items():
            hashes = {k.hash for k in t.key_configs()}
            ids = [key_id_of(h) for h in hashes]
            if len(set(ids)) != len(ids):
                raise ConfigError(
                    f"Two keys of tenant {name!r} share the key id {sorted(i for i in ids if ids.count(i) > 1)[0]} "
                    "(the first 8 hex digits of their hashes), which names a key in spans and in the ledger of "
                    "per-key budgets. Create another key with `spanmeter keys create` and drop one of the two.")
            # A tenant's `upstream` may also name a built-in host: checked where those are
            # known (proxy.serve.routes.check_upstreams, at start-up and by check-config).
        for name in self.mcp_servers:
            if not _ROUTE_NAME.fullmatch(name):
                raise ConfigError(
                    f"MCP server name {name!r} cannot be part of the path /mcp/{{name}}: use letters, "
                    "digits, `.`, `_` and `-` (not starting with `.`)."
                )
        return self


_ROUTE_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def unknown_env_variables(environ: Mapping[str, str] | None = None) -> list[str]:
    """Warnings for SPANMETER_* variables that name no setting (SPANMETER_PORTT=1 would
    otherwise be ignored in silence). A misspelt nested one (SPANMETER_POLICY__RUNS__...)
    is refused by the settings themselves, with the same did-you-mean."""
    env = os.environ if environ is None else environ
    known = {ENV_PREFIX + name.upper() for name in Settings.model_fields}
    out = []
    for var in sorted(env):
        if not var.startswith(ENV_PREFIX) or var in _CLIENT_VARIABLES or "__" in var:
            continue
        if var.upper() not in known:
            # Compared without the prefix, which every candidate shares.
            names = sorted(k.removeprefix(ENV_PREFIX) for k in known | _CLIENT_VARIABLES)
            guess = difflib.get_close_matches(var.upper().removeprefix(ENV_PREFIX), names, n=1, cutoff=0.75)
            hint = f" did you mean {ENV_PREFIX}{guess[0]}?" if guess else ""
            out.append(f"the environment variable {var} is not a spanmeter setting and is ignored;{hint} "
                       f"({_REFERENCE_HINT})")
    return out


_SECTIONS: dict[str, type[BaseModel]] = {
    "runs": RunPolicy, "budgets": BudgetPolicy, "rate_limits": RateLimitPolicy, "repair": RepairPolicy,
    "guard": GuardPolicy, "policy": Policy}


_ENTRIES: dict[str, type[BaseModel]] = {"tenants": TenantConfig, "upstreams": Upstream, "mcp_servers": McpServer}


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def key_id_of(key_hash: str) -> str:
    """The short id of a key (`Caller.key_id`): never the key, only the start of its hash."""
    return key_hash[:8]


def load_settings(**overrides: Any) -> Settings:
    """Settings from file and env, or a ConfigError naming field, source and fix."""
    try:
        return Settings(**overrides).check()
    except ValidationError as exc:
        raise ConfigError(_explain(exc)) from None


def _explain(exc: ValidationError) -> str:
    """Every validation error of the settings, in our words. The one renderer of pydantic's
    errors: none of them is printed any other way, because pydantic's own text quotes the
    input, and an input under `keys` or `upstream_keys` may be a key pasted in clear."""
    path = os.environ.get(f"{ENV_PREFIX}CONFIG")
    lines = ["Invalid spanmeter configuration:"]
    for err in exc.errors(include_input=True, include_url=False):
        loc = [str(p) for p in err["loc"]]
        lines.append(f"- {'.'.join(loc)} (from {_source(loc, path)}): {_problem(loc, err)}.")
    lines.append(f"({_REFERENCE_HINT} with its type and default; `spanmeter check-config` checks a file.)")
    return "\n".join(lines)


def _source(loc: list[str], path: str | None) -> str:
    """Where the value at `loc` came from: the variable that set it or a section above it
    (SPANMETER_TENANTS holds every tenant's keys), else the file."""
    for end in range(len(loc), 0, -1):
        env = ENV_PREFIX + "__".join(loc[:end]).upper()
        if env in os.environ:
            return f"environment variable {env}"
    return f"config file {path}" if path else "defaults"


# Settings whose values are, or are mistaken for, secrets: a key where its hash goes, a
# provider key where a variable's name goes, the admin token. An error there never shows
# the value (logs and CI output keep what a terminal shows).
_SECRET_NAMES = frozenset({"keys", "hash", "upstream_keys", "key_env", "admin_token"})


def _secret_at(loc: list[str]) -> bool:
    # A tenant's whole block (`tenants.acme: ...`) holds its keys too.
    return bool(_SECRET_NAMES.intersection(loc)) or (loc[:1] == ["tenants"] and len(loc) <= 2)


def _shown(loc: list[str], given: Any) -> str:
    """The value an error was about, as the error may show it: never a secret's, and of a
    list or mapping only its kind (it may hold anything, a misplaced key among it)."""
    if isinstance(given, dict):
        return "a mapping"
    if isinstance(given, (list, tuple, set)):
        return "a list"
    if _secret_at(loc):
        return f"a {type(given).__name__} (not shown: this setting holds or names a secret)"
    return repr(given)


def _problem(loc: list[str], err: Any) -> str:
    """One configuration mistake in our words: what is wrong and what to write instead."""
    kind, given = err["type"], err.get("input")
    if kind == "extra_forbidden":
        guess = difflib.get_close_matches(loc[-1], _names_beside(loc), n=1, cutoff=0.6)
        hint = f"did you mean `{guess[0]}`? " if guess else ""
        return f"`{loc[-1]}` is not a setting here; {hint}remove it or fix its spelling"
    expected = _expected(loc, err)
    if kind in ("model_type", "dict_type", "model_attributes_type") and isinstance(given, str):
        text = _shown(loc, given[:80]) if _secret_at(loc) else f"the text {given[:80]!r}"
        return (f"expected a mapping of settings (`key: value` lines indented under `{loc[-1]}:`, or "
                f"`{{key: value}}`), got {text}: is a colon missing after a key, or the space after a colon?")
    if kind == "value_error":
        message = str((err.get("ctx") or {}).get("error") or err["msg"])
        return message if _secret_at(loc) else f"got {_shown(loc, given)}: {message}"
    return f"got {_shown(loc, given)}; expected {expected}"


def _expected(loc: list[str], err: Any) -> str:
    """What belongs at `loc`, from pydantic's message (which never quotes the input)."""
    msg = str(err["msg"])
    said = msg[0].lower() + msg[1:]
    if "keys" in loc and "upstream_keys" not in loc:
        return (f"{said}: `keys` is a list of sha256 hashes of spanmeter keys (64 hex characters, "
                "`spanmeter keys create` prints one) or of `{hash: ..., policy: {...}}`, never a key in clear")
    return said


def _names_beside(loc: list[str]) -> list[str]:
    """The setting names valid where `loc` points (its parent section's fields)."""
    parent = loc[-2] if len(loc) > 1 else ""
    grand = loc[-3] if len(loc) > 2 else ""
    model: type[BaseModel] = Settings
    if parent in _SECTIONS:
        model = KeyPolicy if parent == "policy" and "keys" in loc else _SECTIONS[parent]
    elif grand in _ENTRIES:
        model = _ENTRIES[grand]
    elif "keys" in (parent, grand):
        model = KeyConfig
    return list(model.model_fields)


_CHECK_HINT = "`spanmeter check-config` checks a configuration without starting the proxy."


def read_config_file(path: str) -> dict[str, Any]:
    """The settings in the YAML file named by SPANMETER_CONFIG, or a ConfigError that says
    what is wrong with it. A file that is named must exist and hold settings: starting in
    open mode because of a typo in its name would drop every tenant key and budget."""
    import yaml

    shown = repr(path) if Path(path).is_absolute() else f"{path!r} ({Path(path).absolute()})"
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(
            f"The config file {shown} named by SPANMETER_CONFIG (or --config) does not exist. "
            "spanmeter will not fall back to open mode, which has no tenant keys and no budgets. "
            "Check the path (relative paths start from the directory spanmeter runs in), or unset "
            "SPANMETER_CONFIG to run on defaults.") from None
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(f"The config file {shown} cannot be read: {reason}. {_CHECK_HINT}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        raise ConfigError(_yaml_problem(shown, text, exc)) from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"The config file {shown} is not valid YAML: {exc}. {_CHECK_HINT}") from None
    if data is None:
        raise ConfigError(
            f"The config file {shown} is empty (no settings, only comments or blank lines). "
            "spanmeter will not start from it in open mode, which has no tenant keys and no budgets. "
            "Add the settings (`spanmeter config reference` lists them), or unset "
            "SPANMETER_CONFIG to run on defaults.")
    if not isinstance(data, dict):
        raise ConfigError(
            f"The config file {shown} holds a {type(data).__name__}, not a mapping of settings "
            f"(`host: ...`, `tenants: ...`). {_CHECK_HINT}")
    return {str(k): v for k, v in data.items()}


def _yaml_problem(shown: str, text: str, exc: Any) -> str:
    mark = exc.problem_mark
    where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "an unknown place"
    lines = text.splitlines()
    quoted = ""
    if mark and mark.line < len(lines) and lines[mark.line].strip():
        quoted = f" (the line reads `{lines[mark.line].rstrip()[:120]}`)"
    problem = exc.problem or "a syntax error"
    context = ""
    if exc.context and exc.context_mark and exc.context_mark.line != (mark.line if mark else -1):
        context = f", {exc.context} that starts at line {exc.context_mark.line + 1}, " \
                  f"column {exc.context_mark.column + 1}"
    elif exc.context:
        context = f", {exc.context}"
    return (f"The config file {shown} is not valid YAML: at {where}: {problem}{context}{quoted}. "
            f"Fix the file and start again; {_CHECK_HINT}")


def _key_needs(settings: Settings) -> list[tuple[str, str, str, bool]]:
    """(variable, what needs it, tenant, named in the config) for each upstream key a tenant
    uses. The built-in `upstream_keys` (OPENAI_API_KEY, ...) are not named by the config
    unless it sets `upstream_keys` itself."""
    out: list[tuple[str, str, str, bool]] = []
    global_named = "upstream_keys" in settings.model_fields_set
    for name, tenant in sorted(settings.tenants.items()):
        if tenant.upstream:
            up = settings.upstreams.get(tenant.upstream)
            if up is not None and up.key_env:
                out.append((up.key_env, f"{up.dialect} API (upstream {tenant.upstream})", name, True))
            continue
        for dialect in ("openai", "anthropic", "gemini", "vertex"):  # vertex: only when a token variable is named
            own = tenant.upstream_keys.get(dialect)
            var = own or settings.upstream_keys.get(dialect)
            if var:
                out.append((var, f"{dialect} API", name, bool(own) or global_named))
    return out


def _who(needs: list[tuple[str, str, str, bool]], env: Mapping[str, str], named: bool) -> dict[str, list[str]]:
    by_var: dict[str, dict[str, list[str]]] = {}  # variable -> what needs it -> tenants
    for var, what, tenant, is_named in needs:
        if is_named == named and var not in env:
            by_var.setdefault(var, {}).setdefault(what, []).append(tenant)
    return {var: [f"{what} of tenant{'s' if len(ts) > 1 else ''} {', '.join(ts)}" for what, ts in whats.items()]
            for var, whats in by_var.items()}


def unset_upstream_keys(settings: Settings, environ: Mapping[str, str] | None = None) -> dict[str, list[str]]:
    """Tenant mode: environment variables the config names for upstream keys that are not
    set, each with who needs it ("openai API of tenants acme, beta"): spanmeter refuses to
    start without them. Empty in open mode, where callers bring their own keys. A variable
    set to an empty string counts as set: calls then go upstream without a key (a local
    server that needs none). The built-in defaults are not named by the config: see
    `unset_default_keys`."""
    env = os.environ if environ is None else environ
    if settings.open_mode:
        return {}
    out = _who(_key_needs(settings), env, named=True)
    for up_name, up in sorted(settings.upstreams.items()):
        if up.key_env and up.key_env not in env:
            out.setdefault(up.key_env, []).append(f"upstream {up_name}, {up.dialect} API, for any tenant")
    return out


def unset_default_keys(settings: Settings, environ: Mapping[str, str] | None = None) -> list[str]:
    """Warnings, not refusals: the built-in key variables (OPENAI_API_KEY, ...) that are not
    set. A config that names no `upstream_keys` starts with only the provider it uses; a
    call to another API is answered with an error naming the variable."""
    env = os.environ if environ is None else environ
    if settings.open_mode:
        return []
    return [f"{var} is not set: calls to the {', '.join(who)} will be refused with 500 naming it (set it and "
            f"restart to use that API)" for var, who in sorted(_who(_key_needs(settings), env, named=False).items())]


def unset_keys_problem(missing: Mapping[str, list[str]]) -> str:
    listed = "; ".join(f"{var} ({', '.join(who)})" for var, who in sorted(missing.items()))
    return (
        f"Refusing to start: in tenant mode spanmeter injects the upstream keys itself, and these "
        f"environment variables named by the config are not set: {listed}. Every call to those APIs "
        "would fail with 500 config_error. Set each variable in spanmeter's environment (an empty "
        "value sends calls without a key, for a local server that needs none), or list under "
        "`upstream_keys:` only the APIs your tenants use, e.g. `upstream_keys: {openai: OPENAI_API_KEY}`.")
