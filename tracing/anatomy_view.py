"""The cost anatomy in the terminal: `spanmeter runs RUN_ID` (where a run's input cost
went) and `spanmeter runs --agent NAME --unused-tools` (tools an agent declares and never
calls), read back from the local span files.

A run's anatomy is its run span's `spanmeter.run.anatomy` (tracing/anatomy.py: the run's
totals, summed by the ledger); a run without one yet (still open, or joined to the agent's
own trace) is summed from its call spans' `spanmeter.input.*`, which have the parts and the
largest results but not the tools' definitions.

    input by part      TOKENS  CACHED     COST  SHARE
    tool definitions    9,120    8,960  $0.0031    41%
    ...
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from tracing import attributes as A
from tracing.anatomy import KINDS, TOP_RESULTS

__all__ = ["anatomy_of_spans", "render_anatomy", "render_unused", "unused_tools"]

Record = dict[str, Any]

_LABELS = {"system": "instructions", "tools": "tool definitions", "tool_result": "tool results",
           "history": "earlier turns", "new": "new content"}


def anatomy_of_spans(spans: list[Record]) -> dict[str, Any] | None:
    """The run's anatomy (tracing.anatomy.run_anatomy's shape), or None when its calls had none."""
    for s in spans:
        text = s["attributes"].get(A.SPANMETER_RUN_ANATOMY)
        if isinstance(text, str):
            try:
                found = json.loads(text)
            except ValueError:
                continue
            if isinstance(found, dict):
                return found
    return _from_calls([s["attributes"] for s in spans if s["kind"] == "CLIENT"])


def _from_calls(calls: list[Mapping[str, Any]]) -> dict[str, Any] | None:
    parts: dict[str, dict[str, float]] = {}
    top: dict[tuple[str, str], dict[str, Any]] = {}
    for a in calls:
        for kind in KINDS:
            tokens = a.get(f"spanmeter.input.{kind}.tokens")
            if tokens is None:
                continue
            row = parts.setdefault(kind, {"tokens": 0, "cached_tokens": 0, "cost_usd": 0.0})
            row["tokens"] += int(tokens)
            row["cached_tokens"] += int(a.get(f"spanmeter.input.{kind}.cached_tokens") or 0)
            row["cost_usd"] += float(a.get(f"spanmeter.input.{kind}.cost_usd") or 0.0)
        for r in _json_list(a.get(A.SPANMETER_INPUT_TOP_RESULTS)):
            t = top.setdefault((str(r.get("tool")), str(r.get("call_id"))),
                               {"tool": r.get("tool"), "call_id": r.get("call_id"), "bytes": r.get("bytes", 0),
                                "sends": 0, "resent": 0, "cost_usd": 0.0})
            t["sends"] += 1
            t["resent"] = t["sends"] - 1
            t["cost_usd"] += float(r.get("cost_usd") or 0.0)
    if not parts:
        return None
    results = sorted(top.values(), key=lambda r: -float(r["cost_usd"]))[:TOP_RESULTS]
    return {"parts": {k: parts[k] for k in KINDS if k in parts}, "tools": {}, "declared": [], "called": [],
            "unused": [], "unused_cost_usd": 0.0, "top_results": results, "from": "call spans"}


def _json_list(text: Any) -> list[dict[str, Any]]:
    if not isinstance(text, str):
        return []
    try:
        found = json.loads(text)
    except ValueError:
        return []
    return [r for r in found if isinstance(r, dict)] if isinstance(found, list) else []


def render_anatomy(ra: dict[str, Any]) -> str:
    """Tables: input by part, by tool, the largest results; the tools never called."""
    from tracing.summaries import money

    whole = sum(float(p["cost_usd"]) for p in ra["parts"].values()) or 0.0
    rows = [(_LABELS.get(k, k), f"{int(p['tokens']):,}", f"{int(p['cached_tokens']):,}", money(float(p["cost_usd"])),
             f"{float(p['cost_usd']) / whole:.0%}" if whole else "-") for k, p in ra["parts"].items()]
    lines = ["where the input went (shares by bytes, an approximation)", *_table(
        [("input by part", "TOKENS", "CACHED", "COST", "SHARE"), *rows])]
    tools = ra.get("tools") or {}
    if tools:
        trows = [(name, str(int(t["calls"])), money(float(t["results_cost_usd"])),
                  money(float(t["definitions_cost_usd"])),
                  "never called" if name in ra.get("unused", ()) else "") for name, t in tools.items()]
        lines += ["", *_table([("tool", "CALLS", "RESULTS COST", "DEFINITION COST", ""), *trows])]
    if ra.get("top_results"):
        rrows = [(str(r["tool"]), str(r["call_id"]), f"{int(r['bytes']):,}", str(int(r["sends"])),
                  money(float(r["cost_usd"]))) for r in ra["top_results"]]
        lines += ["", *_table([("largest tool results", "CALL ID", "BYTES", "SENT", "COST"), *rrows])]
    if ra.get("unused"):
        lines += ["", f"{len(ra['unused'])} of {len(ra['declared'])} declared tools never called: "
                  f"{', '.join(ra['unused'])} (their definitions cost {money(float(ra['unused_cost_usd']))})"]
    if ra.get("from") == "call spans":
        lines += ["", "(from the call spans: the run has not ended, so tools and their definitions are not summed yet)"]
    return "\n".join(lines)


def unused_tools(runs: Iterable[tuple[int, dict[str, Any]]], last: int) -> dict[str, Any]:
    """Over an agent's `last` runs that ended with an anatomy ((start_ns, anatomy) pairs):
    each tool declared in any of them and called in none, with the runs declaring it and
    what its definitions cost over them."""
    recent = sorted((r for r in runs if r[1].get("declared")), key=lambda r: -r[0])[:last]
    declared: dict[str, dict[str, Any]] = {}
    called: set[str] = set()
    for _, ra in recent:
        called.update(ra.get("called") or ())
        for name in ra.get("declared") or ():
            row = declared.setdefault(name, {"tool": name, "runs": 0, "definitions_cost_usd": 0.0})
            row["runs"] += 1
            row["definitions_cost_usd"] += float((ra.get("tools") or {}).get(name, {}).get("definitions_cost_usd", 0.0))
    unused = sorted((r for n, r in declared.items() if n not in called and n != A.LABEL_OTHER),
                    key=lambda r: -float(r["definitions_cost_usd"]))
    for r in unused:
        r["definitions_cost_usd"] = round(float(r["definitions_cost_usd"]), 6)
    return {"runs": len(recent), "declared": sorted(declared), "called": sorted(called), "unused": unused,
            "unused_cost_usd": round(sum(float(r["definitions_cost_usd"]) for r in unused), 6)}


def render_unused(agent: str, found: dict[str, Any]) -> str:
    from tracing.summaries import money

    if not found["runs"]:
        return (f"No ended run of agent {agent!r} has an anatomy (runs name their agent with X-Agent-Name; "
                "the anatomy needs SPANMETER_ANATOMY on).")
    head = (f"agent {agent}: {len(found['unused'])} of {len(found['declared'])} declared tools never called in its "
            f"last {found['runs']} run{'s' if found['runs'] != 1 else ''}; their definitions cost "
            f"{money(float(found['unused_cost_usd']))}")
    if not found["unused"]:
        return head
    rows = [(r["tool"], str(r["runs"]), money(float(r["definitions_cost_usd"]))) for r in found["unused"]]
    return "\n".join([head, "", *_table([("never called", "DECLARED IN RUNS", "DEFINITION COST"), *rows])])


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
            .rstrip() for r in rows]
