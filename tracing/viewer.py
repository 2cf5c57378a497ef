"""`spanmeter runs` and `spanmeter runs RUN_ID`: runs read back from the local span files.

Everything here is plain text in, plain text out; the CLI prints what it returns.

    RUN                 TENANT  STARTED              CALLS  TOKENS  CACHED  COST       STATUS
    run_01J8            acme    2026-11-29 20:14:37      3   2,130     48%  $0.012345  ended

    run run_01J8 (acme)  4.20s  3 calls  2,130 tokens  48% of input cached  $0.012345  ended
    ├─ chat gpt-4o  1.20s  1,830→96 tok (1,024 cached)  $0.0036
    ├─ execute_tool get_weather  0.74s  Paris  ✓ 12 lines
    └─ chat gpt-4o  ERROR 429  0.31s
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from proxy.model import frozen
from tracing import attributes as A
from tracing.local import DEFAULT_LOCAL_DIR, read_spans
from tracing.summaries import money

__all__ = ["RunSummary", "agent_anatomies", "load_runs", "render_run_tree", "render_runs_table", "run_spans",
           "run_trees", "summary_of"]

Record = dict[str, Any]


@frozen
class RunSummary:
    run_id: str
    tenant: str
    start_ns: int
    end_ns: int
    calls: int  # model calls that went upstream (or were meant to: refusals are apart)
    tool_calls: int
    tokens: int
    cost_usd: float
    failures: int  # failed model calls (the run span's spanmeter.run.failures)
    tool_failures: int  # failed or never answered tool calls (spanmeter.run.tool_failures)
    status: str  # the run span's status, or `open` while the run has not ended
    # Share of the run's input tokens read from the provider's prompt cache (0..1): the run
    # span's spanmeter.run.cache_read.share, else summed over its call spans; None: no input.
    cached_share: float | None = None
    agent: str | None = None  # gen_ai.agent.name of the run span (X-Agent-Name)
    refused: int = 0  # model calls spanmeter refused (a ceiling, a budget, the loop guard): never sent


def load_runs(local_dir: str | Path = DEFAULT_LOCAL_DIR, *, limit: int = 50) -> list[RunSummary]:
    """The most recent runs in `local_dir`, newest first."""
    by_run = _group(read_spans(local_dir))
    runs = [_summary(run_id, spans) for (_, run_id), spans in by_run.items()]
    runs.sort(key=lambda r: r.start_ns, reverse=True)
    return runs[:limit]


def render_runs_table(runs: list[RunSummary]) -> str:
    if not runs:
        return "No runs recorded yet (spans are written under the local directory)."
    header = ("RUN", "TENANT", "STARTED", "CALLS", "REFUSED", "TOKENS", "CACHED", "COST", "STATUS")
    rows = [
        (
            r.run_id,
            r.tenant,
            _clock(r.start_ns),
            str(r.calls),
            str(r.refused),
            f"{r.tokens:,}",
            _share(r.cached_share),
            money(r.cost_usd),
            r.status,
        )
        for r in runs
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    right = {3, 4, 5, 6, 7}
    lines = [
        "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))
        for row in [header, *rows]
    ]
    return "\n".join(line.rstrip() for line in lines)


def render_run_tree(run_id: str, local_dir: str | Path = DEFAULT_LOCAL_DIR, *, tenant: str | None = None) -> str:
    """The run as a tree: model calls and tool spans with durations, tokens, cost,
    digests, repairs and failures. Run ids are per tenant: each tenant's run with this
    id is drawn on its own (only `tenant`'s when given)."""
    trees = run_trees(run_id, local_dir, tenant=tenant)
    if not trees:
        return f"No run {run_id!r} in {local_dir}."
    return "\n\n".join(trees)


def run_trees(run_id: str, local_dir: str | Path = DEFAULT_LOCAL_DIR, *, tenant: str | None = None) -> list[str]:
    """One drawn tree per tenant that has a run `run_id` (none: no such run)."""
    return [_tree(run_id, spans) for (t, r), spans in _group(read_spans(local_dir)).items()
            if r == run_id and tenant in (None, t)]


def _tree(run_id: str, spans: list[Record]) -> str:
    summary = _summary(run_id, spans)
    ids = {s["span_id"] for s in spans}
    children: dict[str | None, list[Record]] = defaultdict(list)
    for s in spans:
        if _is_run(s):
            continue
        parent = s.get("parent_span_id")
        children[parent if parent in ids else None].append(s)
    run_span = next((s for s in spans if _is_run(s)), None)
    top = children.pop(run_span["span_id"], []) if run_span else []
    top += children.pop(None, [])
    lines = [_run_line(summary)]
    _draw(sorted(top, key=_start), children, "", lines)
    return "\n".join(lines)


def run_spans(run_id: str, local_dir: str | Path = DEFAULT_LOCAL_DIR, *,
              tenant: str | None = None) -> list[tuple[str, list[Record]]]:
    """(tenant, spans) of each tenant's run `run_id`, in run_trees' order."""
    return [(t, spans) for (t, r), spans in _group(read_spans(local_dir)).items()
            if r == run_id and tenant in (None, t)]


def summary_of(run_id: str, spans: list[Record]) -> RunSummary:
    return _summary(run_id, spans)


def agent_anatomies(local_dir: str | Path, agent: str, *, tenant: str | None = None) -> list[tuple[int, Any]]:
    """(start_ns, run anatomy) of each ended run of `agent` whose run span has one."""
    from tracing.anatomy_view import anatomy_of_spans

    out = []
    for (t, _), spans in _group(read_spans(local_dir)).items():
        run = next((s for s in spans if _is_run(s)), None)
        if run is None or run["attributes"].get(A.GEN_AI_AGENT_NAME) != agent or tenant not in (None, t):
            continue
        ra = anatomy_of_spans([run])
        if ra is not None:
            out.append((_start(run), ra))
    return out


# --- internals ---------------------------------------------------------------------------


def _group(records: Iterable[Record]) -> dict[tuple[str, str], list[Record]]:
    """Spans by (tenant, run id): two tenants may use the same run id for different runs."""
    by_run: dict[tuple[str, str], list[Record]] = defaultdict(list)
    for r in records:
        attrs = r.get("attributes") or {}
        run_id = attrs.get(A.SPANMETER_RUN_ID)
        if isinstance(run_id, str):
            by_run[(str(attrs.get(A.SPANMETER_TENANT_ID, "")), run_id)].append(r)
    return by_run


def _is_call(s: Record) -> bool:
    return bool(s["kind"] == "CLIENT")


def _is_tool(s: Record) -> bool:
    return bool(s["attributes"].get(A.GEN_AI_OPERATION_NAME) == A.OPERATION_EXECUTE_TOOL)


def _is_run(s: Record) -> bool:
    """The run's own span: the agent invocation (a span named `run` in files written by earlier versions)."""
    return bool(s["attributes"].get(A.GEN_AI_OPERATION_NAME) == A.OPERATION_INVOKE_AGENT or s["name"] == "run")


def _summary(run_id: str, spans: list[Record]) -> RunSummary:
    run_span = next((s for s in spans if _is_run(s)), None)
    every_call = [s for s in spans if _is_call(s)]
    calls = [s for s in every_call if not s["attributes"].get(A.SPANMETER_REFUSAL_REASON)]
    refused = len(every_call) - len(calls)
    failures = sum(1 for s in calls if s["status"] == "ERROR")
    tool_failures = sum(1 for s in spans if _is_tool(s) and s["status"] == "ERROR")
    tokens = sum(
        int(s["attributes"].get(k) or 0)
        for s in calls
        for k in (A.GEN_AI_USAGE_INPUT_TOKENS, A.GEN_AI_USAGE_OUTPUT_TOKENS)
    )
    cost = sum(float(s["attributes"].get(A.SPANMETER_COST_USD) or 0.0) for s in calls)
    status, agent = "open", None
    share = _cached_share(calls)
    if run_span is not None:
        status = str(run_span["attributes"].get(A.SPANMETER_RUN_STATUS, run_span["status"]))
        agent = run_span["attributes"].get(A.GEN_AI_AGENT_NAME)
        stored = run_span["attributes"].get(A.SPANMETER_RUN_CACHE_READ_SHARE)
        share = float(stored) if isinstance(stored, int | float) else share
    elif every_call and all(s["attributes"].get(A.SPANMETER_RUN_ID_SOURCE) == "generated" for s in every_call):
        status = "ended"  # a call without a run id is a run of its own, over when the call is
    elif failures or tool_failures:
        status = "open, failures"
    return RunSummary(
        run_id=run_id,
        tenant=str(spans[0]["attributes"].get(A.SPANMETER_TENANT_ID, "")),
        start_ns=min(_start(s) for s in spans),
        end_ns=max(int(s.get("end_ns") or 0) for s in spans),
        calls=len(calls),
        tool_calls=sum(1 for s in spans if _is_tool(s)),
        tokens=tokens,
        cost_usd=cost,
        failures=failures,
        tool_failures=tool_failures,
        status=status,
        cached_share=share,
        agent=str(agent) if agent is not None else None,
        refused=refused,
    )


def _cached_share(calls: list[Record]) -> float | None:
    inputs = sum(int(s["attributes"].get(A.GEN_AI_USAGE_INPUT_TOKENS) or 0) for s in calls)
    cached = sum(int(s["attributes"].get(A.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS) or 0) for s in calls)
    return min(1.0, cached / inputs) if inputs else None


def _share(share: float | None) -> str:
    return "-" if share is None else f"{share:.0%}"


def _start(s: Record) -> int:
    return int(s.get("start_ns") or 0)


def _draw(spans: list[Record], children: dict[str | None, list[Record]], prefix: str, lines: list[str]) -> None:
    for i, s in enumerate(spans):
        last = i == len(spans) - 1
        lines.append(f"{prefix}{'└─' if last else '├─'} {_span_line(s)}")
        for extra in _detail_lines(s):
            lines.append(f"{prefix}{'   ' if last else '│  '}   {extra}")
        kids = sorted(children.get(s["span_id"], []), key=_start)
        _draw(kids, children, prefix + ("   " if last else "│  "), lines)


def _run_line(r: RunSummary) -> str:
    seconds = max(0, r.end_ns - r.start_ns) / 1e9
    parts = [
        f"run {r.run_id} ({r.tenant}{f', agent {r.agent}' if r.agent else ''})",
        f"{seconds:.2f}s",
        f"{r.calls} call{'s' if r.calls != 1 else ''}",
        *([f"{r.refused} refused"] if r.refused else []),
        f"{r.tool_calls} tool call{'s' if r.tool_calls != 1 else ''}",
        f"{r.tokens:,} tokens",
        *([f"{_share(r.cached_share)} of input cached"] if r.cached_share is not None else []),
        money(r.cost_usd),
        r.status,
    ]
    if r.failures:
        parts.append(f"{r.failures} failed call{'s' if r.failures != 1 else ''}")
    if r.tool_failures:
        parts.append(f"{r.tool_failures} failed tool call{'s' if r.tool_failures != 1 else ''}")
    return "  ".join(parts)


def _span_line(s: Record) -> str:
    a = s["attributes"]
    parts = [s["name"]]
    if s["status"] == "ERROR":
        parts.append(f"ERROR {a.get(A.ERROR_TYPE, '')}".rstrip())
    parts.append(f"{max(0, int(s['end_ns'] or 0) - _start(s)) / 1e9:.2f}s")
    if _is_tool(s):
        parts += _tool_parts(a)
    else:
        parts += _call_parts(a)
    return "  ".join(p for p in parts if p)


def _call_parts(a: Record) -> list[str]:
    parts = []
    inp, out = a.get(A.GEN_AI_USAGE_INPUT_TOKENS), a.get(A.GEN_AI_USAGE_OUTPUT_TOKENS)
    if inp is not None or out is not None:
        estimate = " (estimate)" if a.get(A.SPANMETER_USAGE_SOURCE) == A.USAGE_ESTIMATE else ""
        cached = a.get(A.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS)
        cached_text = f" ({_count(cached)} cached)" if cached else ""
        parts.append(f"{_count(inp)}→{_count(out)} tok{cached_text}{estimate}")
    if a.get(A.SPANMETER_COST_USD) is not None:
        parts.append(money(float(a[A.SPANMETER_COST_USD])))
    if a.get(A.GEN_AI_RESPONSE_FINISH_REASONS):
        parts.append("finish: " + ",".join(a[A.GEN_AI_RESPONSE_FINISH_REASONS]))
    return parts


def _tool_parts(a: Record) -> list[str]:
    parts = [str(a.get(A.SPANMETER_TOOL_ARGUMENTS_DIGEST) or "")]
    if a.get(A.ERROR_TYPE) == A.ERROR_TOOL_RESULT_MISSING:
        parts.append("✗ no result")
    else:
        mark = "✓" if a.get(A.SPANMETER_TOOL_OK) else "✗"
        parts.append(f"{mark} {a.get(A.SPANMETER_TOOL_RESULT_DIGEST) or ''}".rstrip())
    return parts


def _detail_lines(s: Record) -> list[str]:
    a = s["attributes"]
    lines = [f"repair {r}" for r in a.get(A.SPANMETER_REPAIRS) or []]
    lines += [f"rewrite {r}" for r in a.get(A.SPANMETER_REWRITES) or []]
    if a.get(A.SPANMETER_REFUSAL_REASON):
        lines.append(f"refused: {a[A.SPANMETER_REFUSAL_REASON]}")
    elif s["status"] == "ERROR" and s.get("status_description") and not _is_tool(s):
        lines.append(f"error: {s['status_description']}")
    if a.get(A.SPANMETER_GUARD_ACTION):
        lines.append(f"loop guard: {a[A.SPANMETER_GUARD_ACTION]} ({a.get(A.SPANMETER_GUARD_TOOL, '')})")
    return lines


def _count(n: Any) -> str:
    return "?" if n is None else f"{int(n):,}"


def _clock(ns: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ns / 1e9))
