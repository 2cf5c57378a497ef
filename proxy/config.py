"""Settings: defaults < YAML file (SPANMETER_CONFIG) < environment (SPANMETER_*).

Policy is layered once more: global `policy` < the tenant's `policy` < request headers
(which may only tighten). Every field has an environment variable: nested fields use
`__`, e.g. `SPANMETER_POLICY__RUNS__MAX_LLM_CALLS=8`.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
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
]

ENV_PREFIX = "SPANMETER_"


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
    max_tokens: int | None = Field(None, ge=1, le=MAX_RUN_TOKENS)  # input + output over the run, as settled
    max_seconds: float | None = Field(None, gt=0, le=MAX_RUN_SECONDS)  # wall time from the run's first call
    # The share of any run ceiling above (calls, cost, tokens, time) from which each request
    # carries a wrap-up note for the model; off when unset (proxy/wrapup.py).
    wrap_up_at: float | None = Field(None, gt=0, le=1)


class RateLimitPolicy(_Strict):
    """Rolling limits per minute, enforced inside the admission (proxy/policy/store.py, GCRA)."""

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

    def over(self, base: Policy) -> Policy:
        """This policy layered over `base`: fields set here win."""
        merged: dict[str, Any] = {}
        for section in ("runs", "budgets", "rate_limits", "repair", "guard"):
            mine = getattr(self, section).model_dump(exclude_none=True)
            merged[section] = {**getattr(base, section).model_dump(), **mine}
        merged["capture_content"] = self.capture_content or base.capture_content
        return Policy.model_validate(merged)


DEFAULT_POLICY = Policy(
    repair=RepairPolicy(mode="repair", on_invalid="pass", close_truncated=False),
    guard=GuardPolicy(action="remind", threshold=3),
)


class Upstream(_Strict):
    """A named extra upstream of one dialect (e.g. a local OpenAI-compatible server)."""

    dialect: Literal["openai", "anthropic", "gemini"]
    base_url: str
    key_env: str | None = None  # env var holding the upstream key
    # gen_ai.provider.name; default: the provider a well-known host names, else the dialect's API
    provider_name: str | None = None


class KeyPolicy(_Strict):
    """One key's own limits, within its tenant's: ceilings of the runs it makes (the
    tighter of the two wins), budgets and rate limits of its own (both must hold)."""

    runs: RunPolicy = RunPolicy()
    budgets: BudgetPolicy = BudgetPolicy()
    rate_limits: RateLimitPolicy = RateLimitPolicy()


def _check_hash(k: str) -> str:
    if len(k) != 64 or any(c not in "0123456789abcdef" for c in k):
        raise ValueError(
            "tenant keys are stored as sha256 hex digests, never in clear; "
            "create one with `spanmeter keys create --tenant NAME`"
        )
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
    upstream_keys: dict[str, str] = {}  # dialect -> env var name of the upstream key
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
    config: str | None = None  # YAML file; read through SPANMETER_CONFIG

    openai_base_url: str = "https://api.openai.com"
    anthropic_base_url: str = "https://api.anthropic.com"
    gemini_base_url: str = "https://generativelanguage.googleapis.com"
    upstreams: dict[str, Upstream] = {}
    # Env vars holding upstream keys, per dialect, used in tenant mode when a tenant names none.
    upstream_keys: dict[str, str] = {
        "openai": "OPENAI_API_KEY",
        "anthropic": "ANTHROPIC_API_KEY",
        "gemini": "GEMINI_API_KEY",
    }
    connect_timeout_s: float = Field(10.0, gt=0)
    read_timeout_s: float = Field(600.0, gt=0)  # between bytes; long generations stream slowly
    max_connections: int = Field(1024, ge=1)  # in-flight upstream calls; model calls last seconds
    max_body_bytes: int = Field(32 * 1024 * 1024, ge=1024)
    body_timeout_s: float = Field(60.0, gt=0)  # a request body must arrive within this (slow senders)
    allow_passthrough: bool = False  # unmetered forwarding of unknown paths

    data_dir: str = ".spanmeter"
    ledger_url: str | None = None  # default sqlite:///{data_dir}/ledger.db
    fail_open: bool = False  # Redis down: refuse (default) or forward unmetered, loudly
    timezone: str = "UTC"
    run_idle_timeout_s: float = Field(600.0, gt=0)
    admin_token: str | None = None
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"

    tenants: dict[str, TenantConfig] = {}
    policy: Policy = Policy()
    # model -> {input, cached_input, cache_write, cache_write_1h, output,
    #           service_tiers: {tier: multiplier}, inference_geos: {geo: multiplier}}
    prices: dict[str, dict[str, float | dict[str, float]]] = {}
    _policies: dict[str, Policy] = PrivateAttr(default_factory=dict)  # policy_for's cache
    _key_policies: dict[tuple[str, str], KeyPolicy] | None = PrivateAttr(default=None)  # key_policy's index

    otlp_endpoint: str | None = None  # else the standard OTEL_EXPORTER_OTLP_ENDPOINT
    local_traces: bool = True  # keep spans under data_dir for `spanmeter runs`

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
            sources.append(YamlConfigSettingsSource(settings_cls, yaml_file=path))
        return tuple(sources)

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
        found = self._policies.get(tenant)
        if found is None:
            t = self.tenants.get(tenant)
            base = self.policy.over(DEFAULT_POLICY)
            found = self._policies[tenant] = t.policy.over(base) if t else base
        return found

    def key_policy(self, tenant: str, key_id: str | None) -> KeyPolicy | None:
        """The limits of one key of `tenant` (by `Caller.key_id`), or None if it has none."""
        if key_id is None:
            return None
        if self._key_policies is None:
            self._key_policies = {(name, k.key_id): k.policy for name, t in self.tenants.items()
                                  for k in t.key_configs() if k.policy != KeyPolicy()}
        return self._key_policies.get((tenant, key_id))

    def check(self) -> Settings:
        """Cross-field rules pydantic cannot express; raises ConfigError with the fix."""
        if self.open_mode and not _is_loopback(self.host):
            raise ConfigError(
                f"Refusing to start in open mode on {self.host}: with no tenants configured, "
                "anyone who can reach the port could spend through it. Listen on 127.0.0.1, or "
                "configure tenants (`spanmeter keys create --tenant NAME`, then add the printed "
                "hash under tenants.NAME.keys in the file named by SPANMETER_CONFIG)."
            )
        for name, t in self.tenants.items():
            hashes = {k.hash for k in t.key_configs()}
            ids = [key_id_of(h) for h in hashes]
            if len(set(ids)) != len(ids):
                raise ConfigError(
                    f"Two keys of tenant {name!r} share the key id {sorted(i for i in ids if ids.count(i) > 1)[0]} "
                    "(the first 8 hex digits of their hashes), which names a key in spans and in the ledger of "
                    "per-key budgets. Create another key with `spanmeter keys create` and drop one of the two.")
            if t.upstream and t.upstream not in self.upstreams:
                raise ConfigError(
                    f"Tenant {name!r} names upstream {t.upstream!r}, which is not defined. "
                    f"Defined upstreams: {sorted(self.upstreams) or 'none'}. Add it under `upstreams:`."
                )
        return self


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


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
    path = os.environ.get(f"{ENV_PREFIX}CONFIG")
    lines = ["Invalid spanmeter configuration:"]
    for err in exc.errors():
        loc = [str(p) for p in err["loc"]]
        env = ENV_PREFIX + "__".join(loc).upper()
        source = f"environment variable {env}" if env in os.environ else (
            f"config file {path}" if path else "defaults")
        if err["type"] == "extra_forbidden":
            fix = "remove it, or check its spelling against the configuration reference in README.md"
        else:
            fix = f"expected {err['msg'].lower()}"
        lines.append(f"- {'.'.join(loc)} (from {source}): got {err.get('input')!r}; {fix}.")
    return "\n".join(lines)
