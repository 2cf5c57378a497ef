"""Cost anatomy in telemetry: a call's anatomy as span attributes and run totals, and a
run's anatomy read back from its totals.

A call adds bounded counters to its run's totals in the ledger (the settle's one store
operation; the totals are name -> integer, summed), all named `anatomy|...`:

    anatomy|part|<kind>|micros|tokens|cached    per kind of part
    anatomy|result|<tool>|micros                what the tool's results cost this call
    anatomy|def|<tool>|micros                   what the tool's definition cost this call
    anatomy|called|<tool>                       the tool calls the answer made
    anatomy|top|<tool>|<call id>|micros|sends|bytes   the call's largest results

Summed over the run's calls, a result's micros are everything it cost: its first send and
every re-send after it. Tool names are bounded per call (`MAX_TOOLS`, the rest `_OTHER`);
the per-result counters only for each call's `TOP_RESULTS` largest results (by bytes, which
do not change between sends, so a large result is counted on every send). The run span
reads these back (`run_anatomy`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Final

import orjson
from opentelemetry.util.types import AttributeValue

from proxy.model import Anatomy, ToolCall
from tracing import attributes as A

__all__ = ["KINDS", "MAX_TOOLS", "TOP_RESULTS", "call_attrs", "call_totals", "kinds_of", "run_anatomy", "run_attrs"]

KINDS: Final = ("system", "tools", "tool_result", "history", "new")
MAX_TOOLS: Final = 64  # tool names per call in the run totals; the rest are `_OTHER`
TOP_RESULTS: Final = 5  # results per call tracked by call id, and listed on the spans
_PREFIX: Final = "anatomy|"
_NAME_LIMIT: Final = 64


def kinds_of(an: Anatomy) -> dict[str, tuple[int, int, int]]:
    """(tokens, cached tokens, micro-USD) per kind of part, in `KINDS` order."""
    kinds = an.kinds
    return {k: kinds[k] for k in KINDS if k in kinds}


def _results(an: Anatomy) -> list[int]:
    """Indexes of the tool-result parts."""
    return [i for i, p in enumerate(an.parts) if p.kind == "tool_result"]


_SEEN: dict[str, str] = {}  # tool names as they go into keys: the same few, call after call


def _bounded(name: str) -> str:
    found = _SEEN.get(name)
    if found is None:
        if len(_SEEN) > 4096:
            _SEEN.clear()
        found = _SEEN[name] = name[:_NAME_LIMIT].replace("|", "_") or A.LABEL_OTHER
    return found


def call_totals(an: Anatomy, tool_calls: Sequence[ToolCall]) -> dict[str, int]:
    """The run-total counters one call adds (module docstring)."""
    out: dict[str, int] = {}
    for kind, (tokens, cached, micros) in kinds_of(an).items():
        out[f"{_PREFIX}part|{kind}|micros"] = micros
        out[f"{_PREFIX}part|{kind}|tokens"] = tokens
        out[f"{_PREFIX}part|{kind}|cached"] = cached
    names: set[str] = set()
    for p, micros in zip(an.parts, an.costs, strict=True):
        kind = p.kind
        if kind != "tools" and kind != "tool_result":
            continue
        name = _bounded(p.name)
        if name not in names and len(names) >= MAX_TOOLS:
            name = A.LABEL_OTHER
        names.add(name)
        key = f"{_PREFIX}def|{name}|micros" if kind == "tools" else f"{_PREFIX}result|{name}|micros"
        out[key] = out.get(key, 0) + micros
    for tc in tool_calls:
        name = _bounded(tc.name)
        key = f"{_PREFIX}called|{name if name in names or len(names) < MAX_TOOLS else A.LABEL_OTHER}"
        out[key] = out.get(key, 0) + 1
    parts = an.parts
    for i in sorted(_results(an), key=lambda i: -parts[i].size)[:TOP_RESULTS]:
        p = parts[i]
        base = f"{_PREFIX}top|{_bounded(p.name)}|{p.call_id[:_NAME_LIMIT]}|"
        out[base + "micros"] = an.costs[i]
        out[base + "sends"] = 1
        out[base + "bytes"] = p.size
    return out


def call_attrs(an: Anatomy) -> dict[str, AttributeValue]:
    """`spanmeter.input.*` on the model-call span: per kind of part, and the dearest results."""
    attrs: dict[str, AttributeValue] = {A.SPANMETER_INPUT_APPROXIMATION: "bytes"}
    for kind, (tokens, cached, micros) in kinds_of(an).items():
        attrs[f"spanmeter.input.{kind}.tokens"] = tokens
        attrs[f"spanmeter.input.{kind}.cached_tokens"] = cached
        attrs[f"spanmeter.input.{kind}.cost_usd"] = micros / 1e6
    declared = sum(1 for p in an.parts if p.kind == "tools")
    if declared:
        attrs[A.SPANMETER_INPUT_TOOLS_DECLARED] = declared
    costs = an.costs
    top = sorted(_results(an), key=lambda i: -costs[i])[:TOP_RESULTS]
    if top:
        attrs[A.SPANMETER_INPUT_TOP_RESULTS] = orjson.dumps([
            {"tool": an.parts[i].name[:_NAME_LIMIT], "call_id": an.parts[i].call_id[:_NAME_LIMIT],
             "bytes": an.parts[i].size, "tokens": an.tokens[i], "cost_usd": costs[i] / 1e6} for i in top]).decode()
    return attrs


def run_anatomy(totals: Mapping[str, int]) -> dict[str, Any] | None:
    """A run's anatomy from its totals (module docstring), or None when it has none:
    `parts` (kind -> tokens, cached_tokens, cost_usd), `tools` (name -> results_cost_usd,
    definitions_cost_usd, calls), `declared`, `called`, `unused`, `unused_cost_usd` and
    `top_results` (tool, call_id, bytes, sends, resent, cost_usd), dearest first."""
    parts: dict[str, dict[str, float]] = {}
    tools: dict[str, dict[str, float]] = {}
    top: dict[tuple[str, str], dict[str, int]] = {}
    for key, value in totals.items():
        if not key.startswith(_PREFIX):
            continue
        f = key[len(_PREFIX):].split("|")
        if f[0] == "part" and len(f) == 3:
            parts.setdefault(f[1], {"tokens": 0, "cached_tokens": 0, "cost_usd": 0.0})[
                {"micros": "cost_usd", "tokens": "tokens", "cached": "cached_tokens"}[f[2]]] = (
                value / 1e6 if f[2] == "micros" else value)
        elif f[0] in ("def", "result") and len(f) == 3:
            _tool(tools, f[1])["definitions_cost_usd" if f[0] == "def" else "results_cost_usd"] = value / 1e6
        elif f[0] == "called" and len(f) == 2:
            _tool(tools, f[1])["calls"] = value
        elif f[0] == "top" and len(f) == 4:
            top.setdefault((f[1], f[2]), {})[f[3]] = value
    if not parts:
        return None
    declared = sorted({k.split("|")[2] for k in totals if k.startswith(f"{_PREFIX}def|")})
    called = sorted(n for n, t in tools.items() if t["calls"])
    unused = [n for n in declared if not tools[n]["calls"] and n != A.LABEL_OTHER]
    results: list[dict[str, Any]] = [
        {"tool": name, "call_id": cid, "bytes": v.get("bytes", 0) // max(1, v.get("sends", 1)),
         "sends": v.get("sends", 0), "resent": max(0, v.get("sends", 0) - 1), "cost_usd": v.get("micros", 0) / 1e6}
        for (name, cid), v in top.items()]
    results.sort(key=lambda r: -float(r["cost_usd"]))
    return {
        "parts": {k: parts[k] for k in KINDS if k in parts},
        "tools": {n: tools[n] for n in sorted(tools, key=lambda n: -tools[n]["results_cost_usd"]
                                              - tools[n]["definitions_cost_usd"])},
        "declared": declared, "called": called, "unused": unused,
        "unused_cost_usd": round(sum(tools[n]["definitions_cost_usd"] for n in unused), 6),
        "top_results": results[:TOP_RESULTS],
    }


def _tool(tools: dict[str, dict[str, float]], name: str) -> dict[str, float]:
    return tools.setdefault(name, {"results_cost_usd": 0.0, "definitions_cost_usd": 0.0, "calls": 0})


def run_attrs(totals: Mapping[str, int]) -> dict[str, AttributeValue]:
    """The run span's anatomy: per kind of part, tools declared, called and unused, the
    unused definitions' cost, and the whole as JSON (`spanmeter.run.anatomy`)."""
    ra = run_anatomy(totals)
    if ra is None:
        return {}
    attrs: dict[str, AttributeValue] = {A.SPANMETER_RUN_ANATOMY: json.dumps(ra)}
    for kind, p in ra["parts"].items():
        attrs[f"spanmeter.run.input.{kind}.cost_usd"] = p["cost_usd"]
        attrs[f"spanmeter.run.input.{kind}.tokens"] = int(p["tokens"])
    attrs[A.SPANMETER_RUN_TOOLS_DECLARED] = ra["declared"][:MAX_TOOLS]
    attrs[A.SPANMETER_RUN_TOOLS_CALLED] = ra["called"][:MAX_TOOLS]
    attrs[A.SPANMETER_RUN_TOOLS_UNUSED] = ra["unused"][:MAX_TOOLS]
    attrs[A.SPANMETER_RUN_TOOLS_UNUSED_COST_USD] = ra["unused_cost_usd"]
    return attrs
