"""Reading grafana/dashboards/*.json: every query a panel or variable runs, and the names
in it. Pure functions over the JSON, shared by the dashboard tests."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = ROOT / "grafana" / "dashboards"
DATASOURCES = ROOT / "grafana" / "provisioning" / "datasources" / "datasources.yaml"

# What Grafana puts in for its own variables when the test runs a query by hand.
GRAFANA_VARIABLES = {
    "$__rate_interval": "30s",
    "$__interval": "15s",
    "$__range": "5m",
}


@dataclass(frozen=True)
class Query:
    dashboard: str
    panel: str
    ref: str
    language: str  # promql | traceql
    text: str
    legend: str = ""

    @property
    def id(self) -> str:
        return f"{self.dashboard}/{self.panel}/{self.ref}"


def load(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def dashboard_files() -> list[Path]:
    return sorted(DASHBOARDS.glob("*.json"))


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for p in panels:
        yield p
        yield from _panels(p.get("panels", []))  # panels inside collapsed rows


def queries(path: Path) -> list[Query]:
    """Every PromQL and TraceQL query of every panel and query variable of a dashboard."""
    d = load(path)
    name = path.stem
    out: list[Query] = []
    for p in _panels(d.get("panels", [])):
        for t in p.get("targets", []):
            kind = (t.get("datasource") or p.get("datasource") or {}).get("type")
            if kind == "prometheus":
                out.append(Query(name, p["title"], t["refId"], "promql", t["expr"],
                                 t.get("legendFormat", "")))
            elif kind == "tempo":
                out.append(Query(name, p["title"], t["refId"], "traceql", t["query"]))
    for v in d.get("templating", {}).get("list", []):
        if v.get("type") == "query":
            q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            out.append(Query(name, f"variable {v['name']}", "query", "promql", label_values_promql(q)))
    return out


def all_queries(language: str | None = None) -> list[Query]:
    return [q for f in dashboard_files() for q in queries(f) if language in (None, q.language)]


_LABEL_VALUES = re.compile(r"^label_values\(\s*([a-zA-Z_:][\w:]*)\s*,\s*([a-zA-Z_]\w*)\s*\)$")


def label_values_promql(query: str) -> str:
    """Grafana's `label_values(metric, label)` as the PromQL that has the same answer."""
    m = _LABEL_VALUES.match(query.strip())
    if not m:
        raise ValueError(f"unsupported variable query {query!r}: use label_values(metric, label)")
    return f"count by ({m.group(2)}) ({m.group(1)})"


def concrete(expr: str) -> str:
    """A panel's PromQL as Prometheus can run it: Grafana's variables get concrete values,
    the dashboard's own variables (tenant, model, ...) the regex that matches anything."""
    for var, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(var, value)
    return re.sub(r"\$\{?[a-zA-Z_]\w*(?::\w+)?\}?", ".*", expr)


# --- names in PromQL -------------------------------------------------------------------

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_MATCHERS = re.compile(r"\{([^{}]*)\}")
_MATCHER_LABEL = re.compile(r"([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^()]*)\)")
_RANGE = re.compile(r"\[[^\]]*\]")
_IDENT = re.compile(r"[a-zA-Z_:][\w:]*")
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring",
             "group_left", "group_right", "inf", "nan"}


def promql_names(expr: str) -> tuple[set[str], set[str]]:
    """(metric names, label names) an expression refers to."""
    text = _STRING.sub('""', expr)
    labels: set[str] = set()
    for body in _MATCHERS.findall(text):
        labels.update(_MATCHER_LABEL.findall(body))
    for group in _GROUPING.findall(text):
        labels.update(x.strip() for x in group.split(",") if x.strip())
    text = _GROUPING.sub(" ", _MATCHERS.sub(" ", _RANGE.sub(" ", text)))
    metrics = set()
    for m in _IDENT.finditer(text):
        following = text[m.end():].lstrip()
        if following.startswith("(") or m.group().lower() in _KEYWORDS:
            continue  # a function or an operator keyword
        if text[m.start() - 1 : m.start()] in ("$",) or m.group()[0].isdigit():
            continue
        metrics.add(m.group())
    return metrics, labels


def legend_labels(legend: str) -> set[str]:
    return set(re.findall(r"\{\{\s*([a-zA-Z_]\w*)\s*\}\}", legend))


# --- names in TraceQL ------------------------------------------------------------------

_SCOPED = re.compile(r"\b(span|resource)\.([a-zA-Z_][\w.]*)")
INTRINSICS = ("name", "status", "kind", "duration", "statusMessage", "rootName", "rootServiceName",
              "traceDuration")
_INTRINSIC = re.compile(r"(?<![.\w])(" + "|".join(INTRINSICS) + r")\s*(?:=~|!~|!=|>=|<=|=|>|<)")


def traceql_names(query: str) -> tuple[set[tuple[str, str]], set[str]]:
    """((scope, attribute) pairs, intrinsics) a TraceQL query refers to."""
    text = _STRING.sub('""', query)
    return set(_SCOPED.findall(text)), set(_INTRINSIC.findall(text))


def traceql_span_names(query: str) -> set[str]:
    """The literal span names a query matches with `name = "..."`."""
    return set(re.findall(r'(?<![.\w])name\s*=\s*"([^"]*)"', query))


# --- TraceQL against spans spanmeter exported ------------------------------------------

_CONDITION = re.compile(
    r"^\s*(span\.[\w.]+|name|status)\s*(=~|!~|!=|>=|<=|=|>|<)\s*"
    r'("(?:[^"\\]|\\.)*"|-?\d+(?:\.\d+)?|true|false|error|ok|unset)\s*$')


def traceql_matches(query: str, span: dict[str, Any]) -> bool:
    """Whether one exported span (tracing.local.span_record) satisfies a TraceQL spanset
    filter of the simple form `{ a op v && b op v ... }`. Anything else raises ValueError,
    so dashboards keep to what this test can check."""
    body = query.strip()
    if not (body.startswith("{") and body.endswith("}")) or "||" in body or "}" in body[1:-1]:
        raise ValueError(f"not a single `&&` spanset filter: {query!r}")
    return all(_condition(c, span) for c in body[1:-1].split("&&"))


def _condition(text: str, span: dict[str, Any]) -> bool:
    m = _CONDITION.match(text)
    if not m:
        raise ValueError(f"unsupported TraceQL condition {text!r}")
    lhs, op, raw = m.groups()
    if lhs == "name":
        actual: Any = span["name"]
    elif lhs == "status":
        actual = span["status"].lower()
    else:
        actual = span["attributes"].get(lhs.removeprefix("span."))
    if actual is None:
        return False
    want: Any = json.loads(raw) if raw[0] in '"-0123456789' or raw in ("true", "false") else raw
    if op in ("=~", "!~"):
        hit = re.fullmatch(str(want), str(actual)) is not None
        return hit if op == "=~" else not hit
    if op in ("=", "!="):
        return bool(actual == want) == (op == "=")
    if isinstance(actual, bool) or not isinstance(actual, int | float):
        return False
    return bool({">": actual > want, "<": actual < want, ">=": actual >= want, "<=": actual <= want}[op])
