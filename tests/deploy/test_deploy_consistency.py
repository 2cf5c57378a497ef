"""deploy/ is correct by construction: files exist, names and ports agree, configs parse.

Docker is not needed: the compose file, the collector/Tempo/Prometheus configs, the
Grafana provisioning and the Kubernetes manifests are read as data and cross-checked.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import yaml

from proxy.config import Settings, load_settings
from tests.deploy.dashboards import DASHBOARDS, DATASOURCES, ROOT
from tracing import attributes as A

DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
COMPOSE = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
SERVICES: dict[str, Any] = COMPOSE["services"]
COLLECTOR = yaml.safe_load((DEPLOY / "otel-collector.yaml").read_text())
TEMPO = yaml.safe_load((DEPLOY / "tempo.yaml").read_text())
PROMETHEUS = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
PINNED = re.compile(r"^[\w./-]+:(?!latest$)[\w.-]*\d[\w.-]*$")  # a tag with a version number


def _env(service: str) -> dict[str, str]:
    return {k: str(v) for k, v in SERVICES[service].get("environment", {}).items()}


def _port(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def _host_port(url: str) -> tuple[str, int]:
    u = urlparse(url if "://" in url else f"x://{url}")
    assert u.hostname and u.port, url
    return u.hostname, u.port


def _mounts(service: str) -> dict[str, str]:
    """Bind mounts of a service: container path -> host path (resolved from deploy/)."""
    out = {}
    for v in SERVICES[service].get("volumes", []):
        src, dst = v.split(":")[:2]
        if src.startswith("."):
            out[dst] = str((DEPLOY / src).resolve())
    return out


def _flag(service: str, name: str) -> str:
    cmd = SERVICES[service]["command"]
    return str(next(c.split("=", 1)[1] for c in cmd if c.startswith(name + "=")))


# --- compose -------------------------------------------------------------------------------


def test_compose_has_the_whole_stack():
    assert {"spanmeter", "redis", "otel-collector", "tempo", "prometheus", "grafana"} <= set(SERVICES)


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_every_image_is_pinned(service: str):
    image = SERVICES[service]["image"]
    assert PINNED.match(image), f"{service}: image {image!r} is not pinned to a version"


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_every_mounted_file_exists(service: str):
    for dst, src in _mounts(service).items():
        assert Path(src).exists(), f"{service}: mounts {src} at {dst}, which does not exist"
    named = {v.split(":")[0] for v in SERVICES[service].get("volumes", []) if not v.startswith(".")}
    assert named <= set(COMPOSE.get("volumes", {})), f"{service}: undeclared volumes {named}"


def test_build_context_and_dockerfile_exist():
    build = SERVICES["spanmeter"]["build"]
    context = (DEPLOY / build["context"]).resolve()
    assert (context / build["dockerfile"]).is_file() and (context / "pyproject.toml").is_file()


def test_each_service_reads_the_config_file_it_mounts():
    assert _flag("otel-collector", "--config") in _mounts("otel-collector")
    tempo_cfg = next(c.split("=", 1)[1] for c in SERVICES["tempo"]["command"] if c.startswith("-config.file="))
    assert _mounts("tempo")[tempo_cfg].endswith("deploy/tempo.yaml")
    assert _mounts("prometheus")[_flag("prometheus", "--config.file")].endswith("deploy/prometheus.yml")
    assert _mounts("spanmeter")[_env("spanmeter")["SPANMETER_CONFIG"]].endswith("deploy/spanmeter.yaml")


def test_spanmeter_talks_to_redis_and_the_collector_by_service_name():
    env = _env("spanmeter")
    assert env["SPANMETER_LEDGER_URL"] == "redis://redis:6379/0"
    assert env["SPANMETER_HOST"] == "0.0.0.0"
    host, port = _host_port(env["OTEL_EXPORTER_OTLP_ENDPOINT"])
    assert host == "otel-collector" and host in SERVICES
    assert port == _port(COLLECTOR["receivers"]["otlp"]["protocols"]["http"]["endpoint"]) == 4318
    assert env["OTEL_EXPORTER_OTLP_PROTOCOL"] == "http/protobuf"
    published = {p.rsplit(":", 1)[1] for p in SERVICES["spanmeter"]["ports"]}
    assert published == {env["SPANMETER_PORT"]}


def test_the_example_config_starts_in_tenant_mode_on_all_interfaces(monkeypatch_env):
    # The container listens on 0.0.0.0, which open mode refuses: the config must have tenants.
    monkeypatch_env("SPANMETER_CONFIG", str(DEPLOY / "spanmeter.yaml"))
    settings = load_settings(host="0.0.0.0")
    assert not settings.open_mode
    for name, tenant in settings.tenants.items():
        policy = settings.policy_for(name)
        assert tenant.keys and policy.budgets.daily_usd and policy.budgets.monthly_usd


# --- collector, Tempo, Prometheus ------------------------------------------------------------


def test_collector_pipelines_reference_defined_components():
    for kind in ("receivers", "processors", "exporters"):
        for name, pipeline in COLLECTOR["service"]["pipelines"].items():
            missing = set(pipeline.get(kind, [])) - set(COLLECTOR.get(kind, {}))
            assert not missing, f"pipeline {name}: undefined {kind} {missing}"
    assert set(COLLECTOR["service"]["extensions"]) <= set(COLLECTOR["extensions"])


def test_collector_uses_current_exporter_names_and_sends_traces_to_tempo():
    for name in COLLECTOR["exporters"]:
        assert name.split("/")[0] not in ("otlp", "otlphttp"), f"{name}: renamed to otlp_grpc/otlp_http"
    traces = COLLECTOR["service"]["pipelines"]["traces"]["exporters"]
    assert traces == ["otlp_grpc/tempo"]
    host, port = _host_port(COLLECTOR["exporters"]["otlp_grpc/tempo"]["endpoint"])
    assert host == "tempo" and host in SERVICES
    assert port == _port(TEMPO["distributor"]["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"])


def test_collector_health_and_metrics_ports_match_prometheus():
    assert _port(COLLECTOR["extensions"]["health_check"]["endpoint"]) == 13133
    reader = COLLECTOR["service"]["telemetry"]["metrics"]["readers"][0]["pull"]["exporter"]["prometheus"]
    assert _targets("otel-collector") == [f"otel-collector:{reader['port']}"]


def test_tempo_generates_metrics_into_prometheus_with_exemplars():
    assert "span-metrics" in TEMPO["overrides"]["defaults"]["metrics_generator"]["processors"]
    (rw,) = TEMPO["metrics_generator"]["storage"]["remote_write"]
    host, port = _host_port(rw["url"])
    assert (host, port) == ("prometheus", 9090) and host in SERVICES
    assert rw["send_exemplars"] is True
    assert "--web.enable-remote-write-receiver" in SERVICES["prometheus"]["command"]
    dims = TEMPO["metrics_generator"]["processor"]["span_metrics"]["dimensions"]
    assert set(dims) <= {v for v in vars(A).values() if isinstance(v, str)}, dims
    for key in ("ingester", "compactor", "ingester_client", "metrics_generator_client"):
        assert key not in TEMPO, f"{key}: removed in Tempo 3"
    assert _targets("tempo") == [f"tempo:{TEMPO['server']['http_listen_port']}"]


def _targets(job: str) -> list[str]:
    cfg = next(j for j in PROMETHEUS["scrape_configs"] if j["job_name"] == job)
    return [t for sc in cfg["static_configs"] for t in sc["targets"]]


def test_prometheus_scrapes_spanmeter_metrics_with_exemplar_storage():
    job = next(j for j in PROMETHEUS["scrape_configs"] if j["job_name"] == "spanmeter")
    assert job.get("metrics_path", "/metrics") == "/metrics"
    assert _targets("spanmeter") == [f"spanmeter:{_env('spanmeter')['SPANMETER_PORT']}"]
    assert "--enable-feature=exemplar-storage" in SERVICES["prometheus"]["command"]
    for target in (t for sc in PROMETHEUS["scrape_configs"] for s in sc["static_configs"] for t in s["targets"]):
        host = target.split(":")[0]
        assert host == "localhost" or host in SERVICES, f"scrape target {target}: no such service"


@pytest.mark.skipif(not shutil.which("promtool"), reason="promtool is not installed")
def test_promtool_accepts_the_prometheus_config():
    r = subprocess.run(["promtool", "check", "config", str(DEPLOY / "prometheus.yml")],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stdout + r.stderr


# --- Grafana -----------------------------------------------------------------------------


def test_grafana_mounts_provisioning_and_the_dashboards_the_provider_reads():
    mounts = _mounts("grafana")
    assert mounts["/etc/grafana/provisioning"] == str(ROOT / "grafana" / "provisioning")
    provider = yaml.safe_load((ROOT / "grafana/provisioning/dashboards/dashboards.yaml").read_text())
    (p,) = provider["providers"]
    assert mounts[p["options"]["path"]] == str(DASHBOARDS)
    home = _env("grafana")["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home.startswith(p["options"]["path"] + "/")
    assert (DASHBOARDS / home.rsplit("/", 1)[1]).is_file()


def test_datasources_point_at_compose_services_with_fixed_uids():
    cfg = yaml.safe_load(DATASOURCES.read_text())
    by_type = {ds["type"]: ds for ds in cfg["datasources"]}
    assert {ds["uid"] for ds in cfg["datasources"]} == {"prometheus", "tempo"}
    assert _host_port(by_type["prometheus"]["url"]) == ("prometheus", 9090)
    assert _host_port(by_type["tempo"]["url"]) == ("tempo", TEMPO["server"]["http_listen_port"])
    (dest,) = by_type["prometheus"]["jsonData"]["exemplarTraceIdDestinations"]
    assert dest["datasourceUid"] == "tempo"
    assert by_type["tempo"]["jsonData"]["tracesToMetrics"]["datasourceUid"] == "prometheus"
    assert by_type["tempo"]["jsonData"]["serviceMap"]["datasourceUid"] == "prometheus"


# --- Dockerfile ----------------------------------------------------------------------------

DOCKERFILE = (DEPLOY / "Dockerfile").read_text()


def test_dockerfile_is_slim_pinned_non_root_and_healthchecked():
    images = re.findall(r"^FROM\s+(\S+)", DOCKERFILE, re.M)
    assert images and all(i.startswith("python:3.11.") and "slim" in i for i in images), images
    users = re.findall(r"^USER\s+(\S+)", DOCKERFILE, re.M)
    assert users and users[-1].split(":")[0] not in ("root", "0")
    health = re.search(r"^HEALTHCHECK .*?/healthz", DOCKERFILE, re.M | re.S)
    assert health, "HEALTHCHECK must probe /healthz"
    assert '".[redis]"' in DOCKERFILE
    assert re.search(r"^EXPOSE 8787$", DOCKERFILE, re.M)
    for src in re.findall(r"^COPY (?!--from)(.+) \S+$", DOCKERFILE, re.M):
        for path in src.split():
            assert (ROOT / path).exists() or path == "README.md", f"COPY {path}: missing"


# --- Kubernetes ---------------------------------------------------------------------------


def _k8s() -> list[dict[str, Any]]:
    return [d for f in sorted(K8S.glob("*.yaml")) for d in yaml.safe_load_all(f.read_text()) if d]


def _kind(kind: str, name: str) -> dict[str, Any]:
    return next(d for d in _k8s() if d["kind"] == kind and d["metadata"]["name"] == name)


def test_manifests_parse_and_kustomization_lists_existing_files():
    docs = _k8s()
    assert {"Deployment", "Service", "ConfigMap", "Secret", "StatefulSet"} <= {d["kind"] for d in docs}
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    for res in kustomization["resources"]:
        assert (K8S / res).is_file(), res
    assert "secret.example.yaml" not in kustomization["resources"], "never apply placeholder secrets"


def test_deployment_runs_several_non_root_replicas_with_probes_and_resources():
    dep = _kind("Deployment", "spanmeter")
    assert dep["spec"]["replicas"] >= 3
    pod = dep["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    (c,) = pod["containers"]
    assert PINNED.match(c["image"])
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    for probe in (c["readinessProbe"], c["livenessProbe"]):
        assert probe["httpGet"]["port"] in ports
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert int(env["SPANMETER_PORT"]) == ports["http"]
    assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_replicas_share_the_redis_service_and_read_the_configmap():
    dep = _kind("Deployment", "spanmeter")
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    host, port = _host_port(env["SPANMETER_LEDGER_URL"])
    redis_svc = _kind("Service", host)
    assert port in {p["port"] for p in redis_svc["spec"]["ports"]}
    redis = _kind("StatefulSet", "redis")
    assert redis_svc["spec"]["selector"].items() <= redis["spec"]["template"]["metadata"]["labels"].items()
    assert PINNED.match(redis["spec"]["template"]["spec"]["containers"][0]["image"])
    # The config file the env names is the ConfigMap key mounted there, and it is valid.
    mount = next(m for m in c["volumeMounts"] if env["SPANMETER_CONFIG"].startswith(m["mountPath"] + "/"))
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    cm = _kind("ConfigMap", volume["configMap"]["name"])
    key = env["SPANMETER_CONFIG"].rsplit("/", 1)[1]
    cfg = yaml.safe_load(cm["data"][key])
    assert not Settings(**cfg, host="0.0.0.0").check().open_mode
    secret = _kind("Secret", c["envFrom"][0]["secretRef"]["name"])
    assert set(cfg["upstream_keys"].values()) <= set(secret["stringData"])


def test_service_routes_to_the_pods_http_port():
    svc = _kind("Service", "spanmeter")
    dep = _kind("Deployment", "spanmeter")
    assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    names = {p["name"] for p in dep["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert {p["targetPort"] for p in svc["spec"]["ports"]} <= names
