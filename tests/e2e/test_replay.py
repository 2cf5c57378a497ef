"""Real provider traffic through a running spanmeter: every recorded pair of
../shared/cassettes/pairs.jsonl (issue 25), each cassette one run, against a replay
upstream answering with the recorded bytes. The client gets the recorded bytes (or the
same SSE events, or an announced rewrite), the span's tokens equal the recorded usage,
the cost is the price table's rates applied to it (computed here), tool calls
answered in a later request become execute_tool spans, nothing answers 5xx. The same
under a cost ceiling and in tenant mode: nothing real is refused."""

from __future__ import annotations

import base64
import json
import re
from collections import defaultdict
from decimal import Decimal
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from proxy.config import hash_key
from proxy.ops.demo import serve_on_free_port
from proxy.pricing import PriceTable
from tests.fakes.replay import MISSING, RECORDED, create_replay, decoded, recorded_pairs, replay_runs
from tests.fixtures.otlp import otlp_receiver  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]
PRICES = PriceTable.load()
KEY = "sm-replay-key-0001"
_DROP = {"host", "content-length", "authorization", "x-api-key", "x-goog-api-key", "accept-encoding",
         "connection"}
_AUTH = {"openai": ("Authorization", f"Bearer {KEY}"), "anthropic": ("x-api-key", KEY),
         "gemini": ("x-goog-api-key", KEY)}


def _pairs() -> list[dict[str, Any]]:
    if not RECORDED.exists():
        pytest.skip(MISSING)
    return recorded_pairs()


# ------------------------------------------------------------------ what was recorded

def _events(raw: bytes) -> list[tuple[str, Any]]:
    """SSE events as (event name, data): data parsed as JSON where it is JSON."""
    out = []
    for block in re.split(rb"\r\n\r\n|\n\n|\r\r", raw.replace(b"\r\n", b"\n")):
        name, data = "", []
        for line in block.split(b"\n"):
            if line.startswith(b"event:"):
                name = line[6:].strip().decode()
            elif line.startswith(b"data:"):
                data.append(line[5:].removeprefix(b" ").decode())
        if data:
            text = "\n".join(data)
            try:
                out.append((name, json.loads(text)))
            except ValueError:
                out.append((name, text))
    return out


def _objects(pair: dict[str, Any]) -> list[Any]:
    body = decoded(pair)
    if pair["stream"]:
        return [d for _, d in _events(body) if isinstance(d, dict)]
    try:
        return [json.loads(body)]
    except ValueError:
        return []


def _usage(pair: dict[str, Any]) -> dict[str, int] | None:
    """The recorded usage in gen_ai terms: input includes cache reads and writes."""
    u: dict[str, int] = {}
    for o in _objects(pair):
        d = pair["dialect"]
        if d == "chat" and isinstance(o.get("usage"), dict):
            x = o["usage"]
            u = {"in": x["prompt_tokens"], "out": x["completion_tokens"],
                 "read": (x.get("prompt_tokens_details") or {}).get("cached_tokens") or 0}
        elif d == "responses":
            r = o.get("response", o)
            if isinstance(r, dict) and isinstance(r.get("usage"), dict):
                x = r["usage"]
                u = {"in": x["input_tokens"], "out": x["output_tokens"],
                     "read": (x.get("input_tokens_details") or {}).get("cached_tokens") or 0}
        elif d == "messages":
            x = (o.get("message") or {}).get("usage") if o.get("type") == "message_start" else o.get("usage")
            if isinstance(x, dict):
                merged = {**u.get("_raw", {}), **{k: v for k, v in x.items() if v is not None}}  # type: ignore[dict-item]
                read, write = merged.get("cache_read_input_tokens") or 0, merged.get("cache_creation_input_tokens") or 0
                u = {"_raw": merged, "in": merged.get("input_tokens", 0) + read + write,
                     "out": merged.get("output_tokens", 0), "read": read, "write": write,
                     "write_1h": (merged.get("cache_creation") or {}).get("ephemeral_1h_input_tokens") or 0}
        elif d == "gemini" and isinstance(o.get("usageMetadata"), dict):
            x = o["usageMetadata"]
            # An answer with no promptTokenCount reports no input count: unknown, not zero.
            u = {"in": x["promptTokenCount"] + x.get("toolUsePromptTokenCount", 0) if "promptTokenCount" in x else None,
                 "out": x.get("candidatesTokenCount", 0) + x.get("thoughtsTokenCount", 0),
                 "read": x.get("cachedContentTokenCount", 0)}
    u.pop("_raw", None)
    return u or None


def _answer_model(pair: dict[str, Any]) -> str | None:
    for o in _objects(pair):
        for src in (o, o.get("response"), o.get("message")):
            if isinstance(src, dict) and isinstance(src.get("model") or src.get("modelVersion"), str):
                return str(src.get("model") or src.get("modelVersion"))
    return None


# ------------------------------------------------------------------ the price table, read here

def _row(name: str | None) -> dict[str, Any] | None:
    """The table's rates for a name in USD per million tokens: the rows are compiled from
    genai-prices with prices.yaml over them, so the table is read, not the yaml file."""
    price = PRICES.price(name)
    if price is None:
        return None
    rates = {k: Decimal(getattr(price, k)) / 1_000_000 for k in ("input", "cached_input", "cache_write", "output")}
    if price.cache_write_1h is not None:
        rates["cache_write_1h"] = Decimal(price.cache_write_1h) / 1_000_000
    return {**rates, "service_tiers": {k: Decimal(f.numerator) / f.denominator for k, f in price.service_tiers},
            "inference_geos": {k: Decimal(f.numerator) / f.denominator for k, f in price.inference_geos}}


def _expected_cost(pair: dict[str, Any], u: dict[str, int]) -> int:
    row = _row(_answer_model(pair)) or _row(pair["model"])
    assert row is not None, f"{pair['model']} has no price"

    def rate(k: str, default: str = "input") -> Decimal:
        return Decimal(str(row.get(k, row[default]))) * 1_000_000

    write, w1h = u.get("write", 0), u.get("write_1h", 0)
    micro = (((u["in"] or 0) - u["read"] - write) * rate("input") + u["read"] * rate("cached_input")
             + (write - w1h) * rate("cache_write") + w1h * rate("cache_write_1h", "cache_write")
             + u["out"] * rate("output"))
    factor = Decimal(1)
    for key, table in (("service_tier", "service_tiers"), ("inference_geo", "inference_geos")):
        named = re.findall(rf'"{key}"\s*:\s*"([^"]+)"', decoded(pair).decode(errors="replace"))
        if named:
            factor *= Decimal(str((row.get(table) or {}).get(named[-1], 1)))
    micro *= factor
    return -(-int(micro) // 1_000_000)  # rounded up once, as a charge may be 1 micro-USD high, never low


def _calls_and_results(pair: dict[str, Any]) -> tuple[set[str], set[str]]:
    """Tool call ids the recorded answer made, and tool result ids its request carries."""
    req = json.loads(base64.b64decode(pair["request"]["body_b64"]) or b"{}")
    calls: set[str] = set()
    text = decoded(pair).decode(errors="replace")
    if pair["dialect"] == "chat":
        calls = set(re.findall(r'"id"\s*:\s*"(call_[^"]+)"', text))
        results = {m["tool_call_id"] for m in req.get("messages", [])
                   if isinstance(m, dict) and m.get("role") == "tool"}
    elif pair["dialect"] == "responses":
        calls = set(re.findall(r'"call_id"\s*:\s*"([^"]+)"', text))
        items = req.get("input") if isinstance(req.get("input"), list) else []
        results = {i["call_id"] for i in items if isinstance(i, dict) and i.get("type") == "function_call_output"}
    elif pair["dialect"] == "messages":
        calls = set(re.findall(r'"id"\s*:\s*"(toolu_[^"]+)"', text))
        results = {b["tool_use_id"] for m in req.get("messages", []) if isinstance(m.get("content"), list)
                   for b in m["content"] if isinstance(b, dict) and b.get("type") == "tool_result"}
    else:
        results = set()  # Gemini ids are names unless the model gives some: not matched here
    return calls, results


# ------------------------------------------------------------------ the replay

async def _send(session: aiohttp.ClientSession, url: str, pair: dict[str, Any], run: str) -> dict[str, Any]:
    req = pair["request"]
    raw = req.get("headers") or {}
    headers = {k: v for k, v in (raw.items() if isinstance(raw, dict) else raw) if k.lower() not in _DROP}
    name, value = _AUTH[pair["provider"]]
    headers.update({name: value, "X-Run-Id": run, "x-replay-pair": pair["id"]})
    query = req.get("query") or ""
    if isinstance(query, dict):
        query = "&".join(f"{k}={v}" for k, v in query.items() if k != "key")
    target = f"{url}{req['path']}" + (f"?{query}" if query else "")
    async with session.post(target, data=base64.b64decode(req["body_b64"]), headers=headers) as r:
        return {"status": r.status, "body": await r.read(), "rewrites": r.headers.get("x-spanmeter-rewrites", "")}


def _same_events(got: bytes, want: bytes, rewrites: str) -> bool:
    a, b = _events(got), _events(want)
    if a == b:
        return True
    if "include_usage" in rewrites:  # the usage chunk spanmeter asked for, dropped again
        b = [e for e in b if not (isinstance(e[1], dict) and e[1].get("choices") == [] and e[1].get("usage"))]
    return a == b


async def _replay(make_proxy: Any, receiver: Any, tag: str, **settings: Any) -> list[str]:
    pairs = _pairs()
    upstream_runner, upstream = await serve_on_free_port(create_replay({p["id"]: p for p in pairs}))
    try:
        proxy = await make_proxy(openai_base_url=upstream, anthropic_base_url=upstream, gemini_base_url=upstream,
                                 otlp_endpoint=receiver.endpoint, **settings)
        got, spans = await replay_runs(proxy, pairs, _send, tag, receiver, at_once=16)
    finally:
        await upstream_runner.cleanup()
    return _check(pairs, got, spans, tag)


def _check(pairs: list[dict[str, Any]], got: dict[str, dict[str, Any]], spans: list[dict[str, Any]],
           tag: str) -> list[str]:
    """Asserts everything but the stream events; returns the streams whose events changed
    or whose span records a stream repair."""
    model_spans: dict[str, list[dict[str, Any]]] = defaultdict(list)
    tool_ids: set[str] = set()
    for s in spans:
        a = s["attributes"]
        if s["name"].startswith("execute_tool"):
            tool_ids.add(str(a.get("gen_ai.tool.call.id")))
        elif "gen_ai.request.model" in a and str(a.get("spanmeter.run.id", "")).startswith(f"{tag}-"):
            model_spans[a["spanmeter.run.id"]].append(s)
    problems: list[str] = []
    rechunked: list[str] = []
    answered: set[str] = set()
    calls_by_run: dict[str, set[str]] = defaultdict(set)
    for p in sorted(pairs, key=lambda p: (p["run"], p["seq"])):
        g, want_status = got[p["id"]], p["response"]["status"]
        where = f"{p['id']} ({p['dialect']} {p['model']}{' stream' if p['stream'] else ''})"
        if g["status"] >= 500 or (want_status < 300 and g["status"] != want_status):
            problems.append(f"{where}: status {g['status']} for recorded {want_status}: {g['body'][:300]!r}")
            continue
        want = decoded(p)
        if want_status < 300:
            same = _same_events(g["body"], want, g["rewrites"]) if p["stream"] else (
                g["body"] == want or ("repair" in g["rewrites"]))
            if not same:
                (rechunked if p["stream"] else problems).append(
                    f"{where}: client got other bytes than recorded (rewrites: {g['rewrites']!r})")
        calls, results = _calls_and_results(p)
        answered |= results & calls_by_run[p["run"]]
        calls_by_run[p["run"]] |= calls
        run_spans = sorted(model_spans.get(f"{tag}-{p['run']}", []), key=lambda s: s["start_ns"])
        if len(run_spans) <= p["seq"]:
            problems.append(f"{where}: no model span")
            continue
        a = run_spans[p["seq"]]["attributes"]
        if p["stream"] and want_status < 300 and [r for r in a.get("spanmeter.rewrites", ()) if r.startswith("repair")]:
            rechunked.append(f"{where}: a stream repair is recorded: {a['spanmeter.rewrites']}")
        u = _usage(p) if want_status < 300 else None
        if u is None:
            continue
        tokens = (a.get("gen_ai.usage.input_tokens"), a.get("gen_ai.usage.output_tokens"))
        if tokens != (u["in"], u["out"]):
            problems.append(f"{where}: span tokens {tokens}, recorded {(u['in'], u['out'])}")
        cost = round(float(a.get("spanmeter.cost.usd", 0.0)) * 1e6)
        if cost != _expected_cost(p, u):
            problems.append(f"{where}: cost {cost} micro-USD, the price table says {_expected_cost(p, u)}")
    missing_tools = answered - tool_ids
    if missing_tools:
        problems.append(f"tool calls answered in a later request with no execute_tool span: {sorted(missing_tools)}")
    assert not problems, f"{len(problems)} of {len(pairs)} pairs:\n" + "\n".join(problems[:40])
    return rechunked


async def test_every_recorded_pair_replays_exactly(make_proxy, otlp_receiver):  # noqa: F811
    await _replay(make_proxy, otlp_receiver, "open")


async def test_a_clean_stream_reaches_the_client_with_its_recorded_events(make_proxy, otlp_receiver):  # noqa: F811
    # Every recorded stream needs no repair: each keeps its events, and its span records none.
    rechunked = await _replay(make_proxy, otlp_receiver, "events")
    assert not rechunked, f"{len(rechunked)} streams:\n" + "\n".join(rechunked[:40])


async def test_under_a_cost_ceiling_in_tenant_mode_nothing_real_is_refused(
        make_proxy, otlp_receiver, monkeypatch_env):  # noqa: F811
    for var in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "GEMINI_API_KEY"):
        monkeypatch_env(var, "upstream-key-for-replay")
    policy = {"runs": {"max_cost_usd": 25.0}}
    await _replay(make_proxy, otlp_receiver, "tenant", tenants={"acme": {"keys": [hash_key(KEY)], "policy": policy}})
