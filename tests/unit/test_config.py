"""Settings layering: defaults < file < env, and policy: global < tenant < request."""

from __future__ import annotations

import pytest

from proxy.ceilings import limits_for
from proxy.config import Settings, load_settings
from proxy.errors import ConfigError, RequestError
from tracing.setup import TelemetryConfig


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
    with pytest.raises(ConfigError) as ei:
        load_settings(tenants={"acme": {"upstream": "nowhere"}})
    assert "'nowhere'" in ei.value.message


def test_metrics_push_can_be_turned_off_with_the_standard_variable():
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}
    assert TelemetryConfig().otlp_metrics(env) is True
    assert TelemetryConfig().otlp_metrics({**env, "OTEL_METRICS_EXPORTER": "none"}) is False


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
