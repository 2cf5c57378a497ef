"""Cost anatomy in telemetry: a call's anatomy as span attributes and run totals, and a
run's anatomy read back from its totals.

A call adds bounded counters to its run's totals in the ledger (the settle's one store
operation; the totals are name -> integer, summed), all named `anatomy|...`:

    anatomy|def|<tool>|bytes                    the tool's definition's bytes, once per tool list
    anatomy|called|<tool>                       the tool calls the answer made
    anatomy|part|<kind>|micros|tokens|cached    per kind of part, summed on the run's chain
    anatomy|result|<tool>|micros                what the tool's results cost, likewise
    anatomy|top|<tool>|<call id>|micros|sends|bytes   one of the run's largest results, likewise

The last three come from the run's chain (proxy/anatomy/shares.py `Chain`), which sums the
calls' parts and prices every result on every send without a per-call step per result:
they arrive with a call every `FLUSH_EVERY` calls of the chain, with the run's last call,
or on their own a moment after the run's calls pause (`flush_totals`). Summed over the run, a result's micros are
everything it cost: its first send and every re-send after it; `bytes` is its size times
its sends (a reader divides). A definition's cost over the run is the run's
tool-definition cost shared by the definitions' bytes (they are all in the same cached
prefix, so they bill alike); the bytes are counted when a run's tool list is first seen
(again when it changes, or after the run's chain left the cache), not on every call. Tool names are bounded
per call (`MAX_TOOLS`, the rest `_OTHER`), and a run's anatomy lists the `MAX_RUN_TOOLS`
dearest, the rest summed into `_OTHER` and counted in `folded`. The run span, `spanmeter runs` and the admin API read
these back (`run_anatomy`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

import orjson
from opentelemetry.util.types import AttributeValue

from proxy.model import Anatomy, Flushed, ToolCall
from tracing import attributes as A

__all__ = ["KINDS", "MAX_RUN_TOOLS", "MAX_TOOLS", "TOP_RESULTS", "call_attrs", "call_totals", "flush_totals",
           "folded_anatomy", "kinds_of", "run_anatomy", "run_attrs"]

KINDS: Final = ("system", "tools", "tool_result", "history", "new")
MAX_TOOLS: Final = 64  # tool names per call in the run totals; the rest are `_OTHER`
# Tool names a run's anatomy lists (run span, `spanmeter runs`, admin API): the dearest; the
# rest are summed into one `_OTHER` entry and counted in `folded`. A run's answers may name
# any number of tools (450 names once made a run span of 65 KB), the way a metric label
# may take any number of values (tracing/labels.py).
MAX_RUN_TOOLS: Final = 32
TOP_RESULTS: Final = 5  # results per call tracked by call id, and listed on the spans
_PREFIX: Final = "anatomy|"
_NAME_LIMIT: Final = 64
# Keys made once, not per call: (run-total keys) and (span attribute keys) per kind.
_TOTAL_KEYS: Final = {k: (f"{_PREFIX}part|{k}|tokens", f"{_PREFIX}part|{k}|cached", f"{_PREFIX}part|{k}|micros")
                      for k in KINDS}
_ATTR_KEYS: Final = {k: (f"spanmeter.input.{k}.tokens", f"spanmeter.input.{k}.cached_tokens",
                         f"spanmeter.input.{k}.cost_usd") for k in KINDS}


def kinds_of(an: Anatomy) -> dict[str, tuple[int, int, int]]:
    """(tokens, cached tokens, micro-USD) per kind of part, in `KINDS` order."""
    kinds = an.kinds
    return {k: kinds[k] for k in KINDS if k in kinds}


_SEEN: dict[str, tuple[str, str, str]] = {}  # tool name -> its keys: the same few, call after call


def _keys(name: str) -> tuple[str, str, str]:
    """(result micros, definition bytes, called) keys of a tool name."""
    found = _SEEN.get(name)
    if found is None:
        if len(_SEEN) > 4096:
            _SEEN.clear()
        safe = name[:_NAME_LIMIT].replace("|", "_") or A.LABEL_OTHER
        found = _SEEN[name] = (f"{_PREFIX}result|{safe}|micros", f"{_PREFIX}def|{safe}|bytes",
                               f"{_PREFIX}called|{safe}")
    return found


_DEFS: dict[int, tuple[dict[str, int], dict[str, int]]] = {}  # id(definitions) -> (them, their counters)


def _definition_totals(defs: dict[str, int]) -> dict[str, int]:
    """The definitions' byte counters; a run's requests share one dict while its tools stay
    the same (proxy/anatomy/shares.py), so they are made once per tool list, not per call."""
    found = _DEFS.get(id(defs))
    if found is not None and found[0] is defs:
        return found[1]
    out: dict[str, int] = {}
    for name, size in defs.items():
        key = _keys(name)[1] if len(out) < MAX_TOOLS else _keys(A.LABEL_OTHER)[1]
        out[key] = out.get(key, 0) + size
    if len(_DEFS) > 1024:
        _DEFS.clear()
    _DEFS[id(defs)] = (defs, out)
    return out


def call_totals(an: Anatomy, tool_calls: Sequence[ToolCall]) -> dict[str, int]:
    """The run-total counters one call adds (module docstring)."""
    out: dict[str, int] = {}
    if an.definitions_new:
        out.update(_definition_totals(an.definitions))
    named: set[str] = set()
    for tc in tool_calls:
        # Bounded per call as the definitions are: an answer names what the model likes.
        if tc.name not in named and len(named) >= MAX_TOOLS:
            key = _keys(A.LABEL_OTHER)[2]
        else:
            named.add(tc.name)
            key = _keys(tc.name)[2]
        out[key] = out.get(key, 0) + 1
    return out


def flush_totals(flushed: Flushed) -> dict[str, int]:
    """The run-total counters of what a chain summed since its last flush."""
    out: dict[str, int] = {}
    for _, kind, tokens, cached, micros in flushed.kinds:
        keys = _TOTAL_KEYS.get(kind)
        if keys is not None:
            out[keys[0]] = out.get(keys[0], 0) + tokens
            out[keys[1]] = out.get(keys[1], 0) + cached
            out[keys[2]] = out.get(keys[2], 0) + micros
    for name, micros in flushed.tools:
        key = _keys(name)[0]
        out[key] = out.get(key, 0) + micros
    for name, cid, size, micros, sends in flushed.results:
        k_micros, k_sends, k_bytes = _TOP_KEYS.get((name, cid)) or _top_keys(name, cid)
        out[k_micros] = out.get(k_micros, 0) + micros
        out[k_sends] = out.get(k_sends, 0) + sends
        out[k_bytes] = out.get(k_bytes, 0) + size * sends
    return out


_TOP_KEYS: dict[tuple[str, str], tuple[str, str, str]] = {}  # a run's largest results stay its largest


def _top_keys(name: str, cid: str) -> tuple[str, str, str]:
    if len(_TOP_KEYS) > 4096:
        _TOP_KEYS.clear()
    safe = _keys(name)[0][len(_PREFIX) + 7:-7]  # the tool's name as its keys spell it
    base = f"{_PREFIX}top|{safe}|{cid[:_NAME_LIMIT].replace('|', '_')}|"
    found = _TOP_KEYS[(name, cid)] = (base + "micros", base + "sends", base + "bytes")
    return found


def call_attrs(an: Anatomy) -> dict[str, AttributeValue]:
    """`spanmeter.input.*` on the model-call span: per kind of part, and the dearest results."""
    attrs: dict[str, AttributeValue] = {A.SPANMETER_INPUT_APPROXIMATION: "bytes"}
    for kind, (tokens, cached, micros) in an.kinds.items():
        keys = _ATTR_KEYS.get(kind)
        if keys is not None:
            attrs[keys[0]], attrs[keys[1]], attrs[keys[2]] = tokens, cached, micros / 1e6
    if an.definitions:
        attrs[A.SPANMETER_INPUT_TOOLS_DECLARED] = len(an.definitions)
    if an.top:  # largest first
        attrs[A.SPANMETER_INPUT_TOP_RESULTS] = orjson.dumps([
            {"tool": name[:_NAME_LIMIT], "call_id": cid[:_NAME_LIMIT], "bytes": size, "tokens": tokens,
             "cost_usd": micros / 1e6} for name, cid, size, tokens, micros in an.top]).decode()
    return attrs


_PART_FIELDS: Final = {"micros": "cost_usd", "tokens": "tokens", "cached": "cached_tokens"}


# A total's name split into its fields (() for a name not of the anatomy): the same names,
# run after run (they are made from the same few tool names and kinds).
_PARSED: dict[str, tuple[str, ...]] = {}


def _parsed(key: str) -> tuple[str, ...]:
    found = tuple(key[len(_PREFIX):].split("|")) if key.startswith(_PREFIX) else ()
    if len(_PARSED) > 8192:
        _PARSED.clear()
    _PARSED[key] = found
    return found


def run_anatomy(totals: Mapping[str, int], *, fold: bool = True) -> dict[str, Any] | None:
    """A run's anatomy from its totals (module docstring), or None when it has none:
    `parts` (kind -> tokens, cached_tokens, cost_usd), `tools` (name -> results_cost_usd,
    definitions_cost_usd, calls), `declared`, `called`, `unused`, `unused_cost_usd`,
    `top_results` (tool, call_id, bytes, sends, resent, cost_usd), dearest first, and
    `folded`: how many tools past the `MAX_RUN_TOOLS` dearest were summed into `_OTHER`
    (`fold=False`: none, every name, for a reader that bounds them itself)."""
    parts: dict[str, dict[str, float]] = {}
    tools: dict[str, dict[str, float]] = {}
    top: dict[tuple[str, str], dict[str, int]] = {}
    def_bytes: dict[str, int] = {}
    for key, value in totals.items():
        f = _PARSED.get(key)
        if f is None:
            f = _parsed(key)
        if not f:
            continue
        kind, n = f[0], len(f)
        if kind == "part" and n == 3:
            part = parts.get(f[1])
            if part is None:
                part = parts[f[1]] = {"tokens": 0, "cached_tokens": 0, "cost_usd": 0.0}
            field = _PART_FIELDS[f[2]]
            part[field] = value / 1e6 if field == "cost_usd" else value
        elif kind == "def" and n == 3:
            _tool(tools, f[1])
            def_bytes[f[1]] = value
        elif kind == "result" and n == 3:
            _tool(tools, f[1])["results_cost_usd"] = value / 1e6
        elif kind == "called" and n == 2:
            _tool(tools, f[1])["calls"] = value
        elif kind == "top" and n == 4:
            top.setdefault((f[1], f[2]), {})[f[3]] = value
    if not parts:
        return None
    declared = sorted(def_bytes)
    every = sum(def_bytes.values())
    defs_micros = totals.get(f"{_PREFIX}part|tools|micros", 0)
    for name, size in def_bytes.items():
        tools[name]["definitions_cost_usd"] = defs_micros * size // every / 1e6 if every else 0.0
    called = sorted(n for n, t in tools.items() if t["calls"])
    unused = [n for n in declared if not tools[n]["calls"] and n != A.LABEL_OTHER]
    results: list[dict[str, Any]] = [
        {"tool": name, "call_id": cid, "bytes": v.get("bytes", 0) // max(1, v.get("sends", 1)),
         "sends": v.get("sends", 0), "resent": max(0, v.get("sends", 0) - 1), "cost_usd": v.get("micros", 0) / 1e6}
        for (name, cid), v in top.items()]
    results.sort(key=lambda r: -float(r["cost_usd"]))
    unused_cost = round(sum(tools[n]["definitions_cost_usd"] for n in unused), 6)
    ranked = sorted(tools, key=lambda n: (-tools[n]["results_cost_usd"] - tools[n]["definitions_cost_usd"],
                                          -tools[n]["calls"], n))
    whole = {
        "parts": {k: parts[k] for k in KINDS if k in parts},
        "tools": {n: tools[n] for n in ranked},
        "declared": declared, "called": called, "unused": unused,
        "unused_cost_usd": unused_cost,
        "top_results": results[:TOP_RESULTS],
        "folded": 0,
    }
    return folded_anatomy(whole) if fold else whole


def folded_anatomy(ra: dict[str, Any]) -> dict[str, Any]:
    """`run_anatomy(totals, fold=False)`'s answer as `run_anatomy(totals)` gives it: the
    tools past the `MAX_RUN_TOOLS` dearest summed into `_OTHER` (the same dict when there
    are no more), so a run's end computes its anatomy once for the span and the metrics."""
    ranked = list(ra["tools"])
    if ra["folded"] or len(ranked) <= MAX_RUN_TOOLS:
        return ra
    tools, folded = _folded(ra["tools"], ranked[:MAX_RUN_TOOLS])
    ranked = [n for n in ranked[:MAX_RUN_TOOLS] if n != A.LABEL_OTHER] + [A.LABEL_OTHER]
    declared, called, unused = ([n for n in ra[names] if n in tools] for names in ("declared", "called", "unused"))
    return ra | {"tools": {n: tools[n] for n in ranked}, "declared": declared, "called": called, "unused": unused,
                 "folded": folded}


def _folded(tools: dict[str, dict[str, float]], kept: list[str]) -> tuple[dict[str, dict[str, float]], int]:
    """`tools` with every name but `kept` summed into `_OTHER`, and how many were (the
    per-call `_OTHER` of the totals joins them, uncounted: its names were never known)."""
    out = {n: tools[n] for n in kept if n != A.LABEL_OTHER}
    other = _tool(out, A.LABEL_OTHER)
    folded = 0
    for name, t in tools.items():
        if name in out and name != A.LABEL_OTHER:
            continue
        folded += name != A.LABEL_OTHER
        for field, value in t.items():
            other[field] += value
    return out, folded


def _tool(tools: dict[str, dict[str, float]], name: str) -> dict[str, float]:
    return tools.setdefault(name, {"results_cost_usd": 0.0, "definitions_cost_usd": 0.0, "calls": 0})


def run_attrs(ra: dict[str, Any] | None) -> dict[str, AttributeValue]:
    """The run span's anatomy (`run_anatomy`'s, folded or not): per kind of part, tools
    declared, called and unused, the unused definitions' cost, and the whole as JSON
    (`spanmeter.run.anatomy`)."""
    if ra is None:
        return {}
    ra = folded_anatomy(ra)
    attrs: dict[str, AttributeValue] = {A.SPANMETER_RUN_ANATOMY: orjson.dumps(ra).decode()}
    for kind, p in ra["parts"].items():
        attrs[f"spanmeter.run.input.{kind}.cost_usd"] = p["cost_usd"]
        attrs[f"spanmeter.run.input.{kind}.tokens"] = int(p["tokens"])
    # Tuples, as the SDK would store the lists: a span of plain values takes the lean path
    # (tracing/lean.py `_kept`), not the SDK's cleaning of every attribute.
    attrs[A.SPANMETER_RUN_TOOLS_DECLARED] = tuple(ra["declared"])
    attrs[A.SPANMETER_RUN_TOOLS_CALLED] = tuple(ra["called"])
    attrs[A.SPANMETER_RUN_TOOLS_UNUSED] = tuple(ra["unused"])
    attrs[A.SPANMETER_RUN_TOOLS_UNUSED_COST_USD] = ra["unused_cost_usd"]
    if ra["folded"]:
        attrs[A.SPANMETER_RUN_TOOLS_FOLDED] = ra["folded"]
    return attrs
