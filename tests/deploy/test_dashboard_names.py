"""Dashboards refer only to names spanmeter emits.

Metric and label names come from tracing/attributes.py through its Prometheus-name
mapping; TraceQL queries must refer to attributes spanmeter sets, and each must match at
least one span a real proxy exported under a simulator-driven load.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy import dashboards as D
from tests.deploy.load import drive_load, running_proxy, upstream_keys
from tracing import attributes as A

SERIES = A.all_prometheus_series()
# Every attribute name spanmeter defines (constants whose value is a dotted name).
ATTRIBUTES = frozenset(
    v for k, v in vars(A).items()
    if k.isupper() and isinstance(v, str) and "." in v and not v.startswith("http")
)
LABELS = frozenset(A.prometheus_label(a) for a in ATTRIBUTES) | {"le"}
SPAN_NAME_PREFIXES = (A.OPERATION_INVOKE_AGENT, A.OPERATION_EXECUTE_TOOL, A.OPERATION_CHAT,
                      A.OPERATION_GENERATE_CONTENT, A.OPERATION_EMBEDDINGS)
DATASOURCE_TYPES = {"prometheus", "tempo"}
PROMQL = D.all_queries("promql")
TRACEQL = D.all_queries("traceql")
FILES = D.dashboard_files()


def _ids(q: D.Query) -> str:
    return q.id


def test_there_are_four_dashboards_with_stable_uids():
    uids = {D.load(f)["uid"]: f.stem for f in FILES}
    assert uids == {"spanmeter-overview": "spanmeter-overview", "spanmeter-budgets": "spanmeter-budgets",
                    "spanmeter-tools": "spanmeter-tools", "spanmeter-run": "spanmeter-run"}
    for f in FILES:
        d = D.load(f)
        assert d["id"] is None and "__inputs" not in d, f"{f.name}: provisioned dashboards carry no id/__inputs"


@pytest.mark.parametrize("q", PROMQL, ids=_ids)
def test_promql_uses_only_metrics_and_labels_spanmeter_emits(q: D.Query):
    metrics, labels = D.promql_names(q.text)
    assert metrics, f"{q.id}: no metric found in {q.text!r}"
    assert metrics <= SERIES, f"{q.id}: not emitted by spanmeter: {sorted(metrics - SERIES)}"
    assert labels <= LABELS, f"{q.id}: labels spanmeter never sets: {sorted(labels - LABELS)}"


@pytest.mark.parametrize("q", [q for q in PROMQL if q.legend], ids=_ids)
def test_legends_name_labels_the_query_keeps(q: D.Query):
    _, labels = D.promql_names(q.text)
    missing = D.legend_labels(q.legend) - labels
    assert not missing, f"{q.id}: legend {q.legend!r} names labels the query drops: {sorted(missing)}"


@pytest.mark.parametrize("q", TRACEQL, ids=_ids)
def test_traceql_uses_only_attributes_spanmeter_sets(q: D.Query):
    scoped, intrinsics = D.traceql_names(q.text)
    assert scoped or intrinsics, f"{q.id}: no condition in {q.text!r}"
    for scope, attr in scoped:
        assert scope == "span", f"{q.id}: spanmeter's attributes are span attributes, not {scope}.{attr}"
        assert attr in ATTRIBUTES, f"{q.id}: span.{attr} is not an attribute of tracing/attributes.py"
    assert intrinsics <= {"name", "status"}, q.id
    for name in D.traceql_span_names(q.text):  # span names vary with models, tools and agents
        assert name.startswith(SPAN_NAME_PREFIXES), f"{q.id}: span name {name!r} is not one spanmeter uses"


def _datasource_refs(node: Any) -> list[dict[str, Any]]:
    if isinstance(node, dict):
        found = [node["datasource"]] if isinstance(node.get("datasource"), dict) else []
        return found + [r for k, v in node.items() if k != "templating" for r in _datasource_refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in _datasource_refs(v)]
    return []


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_dashboards_pick_datasources_through_variables(path: Path):
    d = D.load(path)
    variables = {v["name"]: v for v in d["templating"]["list"]}
    ds_vars = {name: v["query"] for name, v in variables.items() if v["type"] == "datasource"}
    refs = _datasource_refs(d["panels"]) + [v["datasource"] for v in variables.values() if "datasource" in v]
    assert refs
    for ref in refs:
        uid = ref["uid"]
        assert uid.startswith("${") and uid.endswith("}"), f"{path.name}: hard-coded datasource uid {uid!r}"
        name = uid[2:-1]
        assert ds_vars.get(name) == ref["type"], f"{path.name}: {uid} is not a {ref['type']} datasource variable"


def test_run_dashboard_finds_a_trace_by_run_id_from_a_textbox():
    d = D.load(D.DASHBOARDS / "spanmeter-run.json")
    run_id = next(v for v in d["templating"]["list"] if v["name"] == "run_id")
    assert run_id["type"] == "textbox"
    queries = {q.text for q in D.queries(D.DASHBOARDS / "spanmeter-run.json")}
    assert f'{{ span.{A.SPANMETER_RUN_ID} = "$run_id" }}' in queries


def test_trace_to_metrics_links_use_emitted_metrics_and_labels():
    cfg = yaml.safe_load(D.DATASOURCES.read_text())
    tempo = next(ds for ds in cfg["datasources"] if ds["type"] == "tempo")
    t2m = tempo["jsonData"]["tracesToMetrics"]
    uids = {ds["uid"] for ds in cfg["datasources"]}
    assert t2m["datasourceUid"] in uids
    for tag in t2m["tags"]:
        assert tag["key"] in ATTRIBUTES and tag["value"] == A.prometheus_label(tag["key"]), tag
    for q in t2m["queries"]:
        metrics, labels = D.promql_names(q["query"].replace("$$__tags", ""))
        assert metrics and metrics <= SERIES, q
        assert labels <= LABELS, q


async def test_every_traceql_query_matches_a_span_spanmeter_exported(tmp_path: Path):
    with upstream_keys():
        async with running_proxy(tmp_path) as proxy:
            await drive_load(proxy.proxy_url, "t")
    # The proxy flushed its spans to the local JSONL exporter on shutdown.
    lines = (tmp_path / "traces" / "spans.jsonl").read_text().splitlines()
    spans = [json.loads(line) for line in lines]
    assert spans
    unmatched = []
    for q in TRACEQL:
        query = q.text.replace("$run_id", "dash-acme-chat-t")
        if not any(D.traceql_matches(query, s) for s in spans):
            unmatched.append(q.id)
    assert not unmatched, f"TraceQL queries matching none of {len(spans)} exported spans: {unmatched}"
