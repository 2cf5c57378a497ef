"""Settings layering: defaults < file < env, and policy: global < tenant < request."""

from __future__ import annotations

import pytest
from multidict import CIMultiDict

from proxy.config import KeyPolicy, Settings, load_settings
from proxy.errors import ConfigError, RequestError
from proxy.govern.ceilings import Plans, limits_for, plan
from tracing.setup import TelemetryConfig, otlp_url


def test_env_overrides_the_file_and_nested_fields_use_double_underscore(tmp_path, monkeypatch_env):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("port: 9001\npolicy:\n  runs: {max_llm_calls: 5}\n  guard: {threshold: 4}\n")
    monkeypatch_env("SPANMETER_CONFIG", str(cfg))
    monkeypatch_env("SPANMETER_POLICY__RUNS__MAX_LLM_CALLS", "7")
    s = load_settings()
    assert s.port == 9001
    assert s.policy.runs.max_llm_calls == 7


def test_tenant_policy_overrides_global_which_overrides_defaults():
    s = Settings(policy={"runs": {"max_llm_calls": 10}, "guard": {"threshold": 5}},
                 tenants={"acme": {"policy": {"runs": {"max_llm_calls": 3}, "repair": {"mode": "report"}}}})
    acme, other = s.policy_for("acme"), s.policy_for("beta")
    assert (acme.runs.max_llm_calls, acme.guard.threshold, acme.guard.action) == (3, 5, "remind")
    assert (acme.repair.mode, acme.repair.on_invalid) == ("report", "pass")
    assert (other.runs.max_llm_calls, other.repair.mode) == (10, "repair")


def test_request_headers_tighten_and_never_loosen():
    policy = Settings(policy={"runs": {"max_llm_calls": 10, "max_cost_usd": 1.0}}).policy_for("default")
    tight = limits_for(policy, {"x-run-max-calls": "2", "x-run-max-cost-usd": "0.5"}, None, None)
    assert (tight.run_max_calls, tight.run_max_cost) == (2, 500_000)
    assert tight.origin["run_calls"] == "request header X-Run-Max-Calls"
    loose = limits_for(policy, {"x-run-max-calls": "99", "x-run-max-cost-usd": "50"}, None, None)
    assert (loose.run_max_calls, loose.run_max_cost) == (10, 1_000_000)
    assert loose.origin["run_calls"] == "tenant setting runs.max_llm_calls"


@pytest.mark.parametrize("header,value", [("x-run-max-calls", "0"), ("x-run-max-calls", "many"),
                                          ("x-run-max-cost-usd", "-1"), ("x-run-max-cost-usd", "nan")])
def test_bad_ceiling_headers_are_a_400_naming_the_header(header, value):
    with pytest.raises(RequestError) as ei:
        limits_for(Settings().policy_for("default"), {header: value}, None, None)
    assert ei.value.param.lower() == header


def test_tenant_keys_must_be_hashes_not_keys():
    with pytest.raises(ConfigError) as ei:
        load_settings(tenants={"acme": {"keys": ["sm-plain-text-key"]}})
    assert "sha256" in ei.value.message and "spanmeter keys create" in ei.value.message


def test_a_tenant_naming_an_undefined_upstream_is_refused():
    # Checked where the built-in hosts are known: at start-up and by check-config.
    from proxy.serve.routes import check_upstreams

    with pytest.raises(ConfigError) as ei:
        check_upstreams(load_settings(tenants={"acme": {"upstream": "nowhere"}}))
    assert "'nowhere'" in ei.value.message and "groq" in ei.value.message


METRICS_PUSH = [
    pytest.param({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://phoenix:6006"}, {}, False,
                 id="a general endpoint sends traces only"),
    pytest.param({}, {"otlp_endpoint": "http://phoenix:6006"}, False, id="so does spanmeter's own endpoint"),
    pytest.param({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_METRICS_EXPORTER": "otlp"}, {}, True,
                 id="OTEL_METRICS_EXPORTER=otlp asks for the push"),
    pytest.param({"OTEL_METRICS_EXPORTER": "prometheus, otlp"}, {}, True, id="otlp among several exporters"),
    pytest.param({"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://c:4318/v1/metrics"}, {}, True,
                 id="a metrics endpoint of its own asks for the push"),
    pytest.param({}, {"push_metrics": True}, True, id="SPANMETER_OTLP_METRICS=true asks for it"),
    pytest.param({"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://c:4318/v1/metrics", "OTEL_METRICS_EXPORTER": "none"},
                 {"push_metrics": True}, False, id="OTEL_METRICS_EXPORTER=none turns every push off"),
    pytest.param({"OTEL_METRICS_EXPORTER": "prometheus"}, {}, False, id="prometheus is /metrics, always on"),
]


@pytest.mark.parametrize(("env", "fields", "push"), METRICS_PUSH)
def test_metrics_are_pushed_over_otlp_only_when_asked(env, fields, push):
    assert TelemetryConfig(**fields).otlp_metrics(env) is push


def test_a_signal_endpoint_wins_over_the_general_ones():
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://general:4318",
           "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://metrics:9090/api/v1/otlp/v1/metrics"}
    cfg = TelemetryConfig(otlp_endpoint="http://phoenix:6006/")
    assert otlp_url(cfg, env, "traces") == "http://phoenix:6006/v1/traces"
    assert otlp_url(cfg, env, "metrics") == "http://metrics:9090/api/v1/otlp/v1/metrics"
    assert otlp_url(TelemetryConfig(), env, "traces") == "http://general:4318/v1/traces"
    assert otlp_url(TelemetryConfig(), {}, "traces") == "http://localhost:4318/v1/traces"
    langfuse = {"OTEL_EXPORTER_OTLP_ENDPOINT": "https://cloud.langfuse.com/api/public/otel"}
    assert otlp_url(TelemetryConfig(), langfuse, "traces") == "https://cloud.langfuse.com/api/public/otel/v1/traces"


def test_keys_are_hashes_or_objects_with_a_policy_of_their_own():
    plain, limited = "a" * 64, "b" * 64
    s = load_settings(tenants={"acme": {"keys": [plain, {"hash": limited, "policy": {
        "runs": {"max_llm_calls": 4}, "budgets": {"daily_usd": 2}, "rate_limits": {"requests_per_minute": 30}}}]}})
    assert [k.hash for k in s.tenants["acme"].key_configs()] == [plain, limited]
    assert s.key_policy("acme", plain[:8]) is None, "a plain key has no limits of its own"
    key = s.key_policy("acme", limited[:8])
    assert key is not None and key.runs.max_llm_calls == 4 and key.rate_limits.requests_per_minute == 30
    assert s.key_policy("other", limited[:8]) is None and s.key_policy("acme", None) is None
    with pytest.raises(ConfigError, match="sha256"):
        load_settings(tenants={"acme": {"keys": [{"hash": "sm-plain-text-key"}]}})
    with pytest.raises(ConfigError, match="guard"):  # a key's policy holds limits only
        load_settings(tenants={"acme": {"keys": [{"hash": limited, "policy": {"guard": {"action": "off"}}}]}})


def test_two_keys_of_a_tenant_may_not_share_a_key_id():
    with pytest.raises(ConfigError, match="share the key id aaaaaaaa"):
        load_settings(tenants={"acme": {"keys": ["a" * 64, "a" * 8 + "b" * 56]}})
    assert load_settings(tenants={"acme": {"keys": ["a" * 64, "a" * 64]}}), "the same key twice is one key"


def test_the_tighter_of_tenant_key_and_request_wins_and_says_where_it_came_from():
    policy = Settings(policy={"runs": {"max_llm_calls": 10, "max_tokens": 50_000, "max_seconds": 600}}
                      ).policy_for("default")
    key = KeyPolicy(runs={"max_llm_calls": 4, "max_tokens": 90_000}, budgets={"daily_usd": 1.5})
    limits = limits_for(policy, {"x-run-max-seconds": "30", "x-run-max-tokens": "80000"}, None, None, key)
    assert (limits.run_max_calls, limits.run_max_tokens, limits.run_max_seconds) == (4, 50_000, 30.0)
    assert (limits.key_day_budget, limits.key_month_budget) == (1_500_000, None)
    assert limits.origin["run_calls"] == "key setting runs.max_llm_calls"
    assert limits.origin["run_tokens"] == "tenant setting runs.max_tokens"
    assert limits.origin["run_seconds"] == "request header X-Run-Max-Seconds"


def test_a_plan_carries_the_rate_limits_and_the_earliest_wrap_up():
    policy = Settings(policy={"runs": {"wrap_up_at": 0.8}, "rate_limits": {"requests_per_minute": 100}}
                      ).policy_for("default")
    key = KeyPolicy(rate_limits={"tokens_per_minute": 5_000}, runs={"wrap_up_at": 0.7})
    p = plan(policy, {"x-run-wrap-up-at": "0.75"}, key, "abcd1234")
    assert p.rates == (("tenant", "requests", 100), ("key abcd1234", "tokens", 5_000))
    assert p.wrap_up_at == 0.7
    assert plan(policy, {"x-run-wrap-up-at": "0.25"}).wrap_up_at == 0.25
    off = Settings().policy_for("default")
    assert plan(off, {"x-run-wrap-up-at": "0.25"}).wrap_up_at is None, "a request cannot turn notes on"


@pytest.mark.parametrize("header", ["x-run-max-calls", "X-Run-Max-Calls", "X-RUN-MAX-CALLS"])
def test_a_plan_remembered_without_headers_never_answers_a_request_that_sends_them(header):
    """Plans of header-less requests are cached per policy and key; a request that tightens
    its run, in any spelling of the header, a key of its own, or another tenant's policy,
    gets its own plan."""
    settings = Settings(policy={"runs": {"max_llm_calls": 10}}, tenants={"other": {"policy": {"runs": {
        "max_llm_calls": 3}}}})
    policy = settings.policy_for("default")
    assert plan(policy, CIMultiDict()).limits.run_max_calls == 10
    plans = Plans()
    assert plans.plan("t", policy, CIMultiDict()) is plans.plan("t", policy, CIMultiDict())  # remembered
    assert plans.plan("t", policy, CIMultiDict({header: "2"})).limits.run_max_calls == 2  # headers: built anew
    assert plan(policy, CIMultiDict({header: "2"})).limits.run_max_calls == 2
    assert plan(policy, CIMultiDict({"x-run-wrap-up-at": "0.5"})).wrap_up_at is None
    key = KeyPolicy(runs={"max_llm_calls": 4})
    assert plan(policy, CIMultiDict(), key, "k1").limits.run_max_calls == 4
    assert plan(settings.policy_for("other"), CIMultiDict()).limits.run_max_calls == 3
    assert plan(policy, CIMultiDict()).limits.run_max_calls == 10


@pytest.mark.parametrize("header,value", [("x-run-max-tokens", "0"), ("x-run-max-seconds", "-3"),
                                          ("x-run-max-seconds", "inf"), ("x-run-wrap-up-at", "1.5")])
def test_bad_new_headers_are_a_400_naming_the_header(header, value):
    policy = Settings(policy={"runs": {"wrap_up_at": 0.5}}).policy_for("default")
    with pytest.raises(RequestError) as ei:
        plan(policy, {header: value})
    assert ei.value.param.lower() == header


def test_workers_default_to_one_process_and_auto_is_one_per_cpu(tmp_path, monkeypatch_env):
    import os

    assert Settings().workers == 1
    monkeypatch_env("SPANMETER_WORKERS", "auto")
    assert load_settings().workers == min(os.cpu_count() or 1, 256)
    assert load_settings(workers=3).workers == 3  # `--workers` wins over the variable
    with pytest.raises(ConfigError, match=r"workers \(from environment variable SPANMETER_WORKERS\)"):
        monkeypatch_env("SPANMETER_WORKERS", "0")
        load_settings()
    with pytest.raises(ConfigError, match="in-memory ledger"):
        Settings(workers=2, ledger_url="sqlite:///:memory:").check()
    Settings(workers=2, data_dir=str(tmp_path)).check()  # a ledger file: fine


def _mistakes() -> list[dict[str, object]]:
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "data" / "config" / "mistakes.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("case", _mistakes(), ids=lambda c: str(c["id"]))
def test_config_mistakes_are_told_in_our_words(case, tmp_path, monkeypatch_env):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(str(case["yaml"]))
    monkeypatch_env("SPANMETER_CONFIG", str(cfg))
    with pytest.raises(ConfigError) as caught:
        load_settings()
    for text in case["says"]:
        assert text in caught.value.message
    for text in case["never"]:
        assert text not in caught.value.message


def test_unknown_spanmeter_variables_are_warned_about_with_a_guess():
    from proxy.config import unknown_env_variables

    warned = unknown_env_variables({"SPANMETER_PORTT": "1", "SPANMETER_PORT": "2", "SPANMETER_URL": "x",
                                    "SPANMETER_POLICY__RUNS__MAX_LLM_CALLS": "3", "SPANMETER_WHATEVER": "4"})
    assert len(warned) == 2
    assert warned[0].startswith("the environment variable SPANMETER_PORTT is not a spanmeter setting and is "
                                "ignored; did you mean SPANMETER_PORT?")
    assert "SPANMETER_WHATEVER is not a spanmeter setting" in warned[1] and "did you mean" not in warned[1]


def test_a_nested_misspelt_variable_is_refused_with_a_guess(monkeypatch_env):
    monkeypatch_env("SPANMETER_POLICY__RUNS__MAX_LLM_CALL", "8")
    with pytest.raises(ConfigError) as caught:
        load_settings()
    assert "did you mean `max_llm_calls`?" in caught.value.message
