"""Settings layering: defaults < file < env, and policy: global < tenant < request."""

from __future__ import annotations

import pytest

from proxy.ceilings import limits_for
from proxy.config import Settings, load_settings
from proxy.errors import ConfigError, RequestError
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
    with pytest.raises(ConfigError) as ei:
        load_settings(tenants={"acme": {"upstream": "nowhere"}})
    assert "'nowhere'" in ei.value.message


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
