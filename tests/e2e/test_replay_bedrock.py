"""Real AWS Bedrock traffic through a running spanmeter: every Bedrock pair of
../shared/cassettes/reach-pairs.jsonl (Converse and InvokeModel, six model families, streamed
as AWS event-stream frames and not), sent on Bedrock's own route exactly as the client sent
it (`%3A`, inference profiles, ARNs with `%2F`) to a replay upstream answering with the
recorded bytes, frames cut at awkward offsets, with the recorded token-count headers.

The client gets the recorded bytes, byte for byte; the span names `aws.bedrock`, the
operation, and the model the path names; its tokens are what Bedrock billed (the token-count
headers of a whole InvokeModel answer, the last chunk's invocation metrics of a stream,
Converse's own usage, input counted with cache reads and writes); its cost is that usage at
the price table's Bedrock rates; tool calls answered in a later request of the run become
execute_tool spans; nothing answers 5xx."""

from __future__ import annotations

import base64
import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import aiohttp
import pytest

from proxy.ops.demo import serve_on_free_port
from proxy.pricing import PriceTable
from tests.fakes.replay import create_replay, decoded, replay_runs
from tests.fixtures.otlp import otlp_receiver  # noqa: F401

botocore_eventstream = pytest.importorskip("botocore.eventstream")

REACH = Path(__file__).resolve().parents[2].parent / "shared" / "cassettes" / "reach-pairs.jsonl"
KEY = "bedrock-api-key-replay-0001"  # a Bedrock API key, passed through in open mode
# Models of the recordings no price table lists: a SageMaker endpoint served through Bedrock.
UNPRICED = {"endpoint-quick-start-idr7y"}


def _pairs() -> list[dict[str, Any]]:
    if not REACH.exists():
        pytest.skip(f"{REACH} is missing: the recorded traffic lives beside the clone, in ../shared/cassettes")
    pairs = [json.loads(line) for line in REACH.read_text().splitlines() if line.strip()]
    return [p for p in pairs if p["provider"] == "bedrock"]


def _frames(raw: bytes) -> list[tuple[dict[str, Any], Any]]:
    buf = botocore_eventstream.EventStreamBuffer()
    buf.add_data(raw)
    out = []
    for m in buf:
        data = json.loads(m.payload) if m.payload else {}
        if isinstance(data, dict) and isinstance(data.get("bytes"), str):
            data = json.loads(base64.b64decode(data["bytes"]))
        out.append((m.headers, data))
    return out


def _headers(pair: dict[str, Any]) -> dict[str, str]:
    raw = pair["response"].get("headers") or []
    return {str(k).lower(): str(v) for k, v in (raw.items() if isinstance(raw, dict) else raw)}


def _billed(inp: int, out: int | None, read: int, write: int) -> dict[str, Any]:
    return {"in": inp + read + write, "out": out, "read": read, "write": write}


def _usage(pair: dict[str, Any]) -> dict[str, Any] | None:
    """What Bedrock billed, read from the recording independently of spanmeter."""
    body = decoded(pair)
    if pair["stream"]:
        found = None
        for _, data in _frames(body):
            if not isinstance(data, dict):
                continue
            m = data.get("amazon-bedrock-invocationMetrics")
            if m:
                found = _billed(m["inputTokenCount"], m["outputTokenCount"], m.get("cacheReadInputTokenCount", 0),
                                m.get("cacheWriteInputTokenCount", 0))
            if found is None and "totalOutputTextTokenCount" in data:
                # A guardrail that blocks the input answers one Titan chunk with Titan's own
                # counts and no invocation metrics: the counts the model family reports.
                found = _billed(int(data["inputTextTokenCount"]), int(data["totalOutputTextTokenCount"]), 0, 0)
            u = data.get("usage") if pair["dialect"] == "converse" else None
            if isinstance(u, dict):
                found = _billed(u["inputTokens"], u["outputTokens"], u.get("cacheReadInputTokens", 0),
                                u.get("cacheWriteInputTokens", 0))
        return found
    h = _headers(pair)
    if "x-amzn-bedrock-input-token-count" in h:
        return _billed(int(h["x-amzn-bedrock-input-token-count"]), int(h["x-amzn-bedrock-output-token-count"]),
                       int(h.get("x-amzn-bedrock-cache-read-input-token-count", 0)),
                       int(h.get("x-amzn-bedrock-cache-write-input-token-count", 0)))
    u = json.loads(body).get("usage")
    return _billed(u["inputTokens"], u["outputTokens"], u.get("cacheReadInputTokens", 0),
                   u.get("cacheWriteInputTokens", 0)) if isinstance(u, dict) else None


def _path_model(pair: dict[str, Any]) -> str:
    segment = unquote(pair["route"].split("/")[2])
    return segment.rpartition("/")[2] if segment.startswith("arn:") else segment


def _calls_and_results(pair: dict[str, Any]) -> tuple[set[str], set[str]]:
    req = json.loads(base64.b64decode(pair["request"]["body_b64"]) or b"{}")
    calls: set[str] = set()
    body = decoded(pair)
    objects = [d for _, d in _frames(body)] if pair["stream"] else [json.loads(body)]
    for o in objects:
        if not isinstance(o, dict):
            continue
        start = (o.get("start") or {}).get("toolUse") or (o.get("content_block") or {})
        if start.get("toolUseId") or start.get("type") == "tool_use":
            calls.add(start.get("toolUseId") or start["id"])
        for b in ((o.get("output") or {}).get("message") or {}).get("content") or []:
            if "toolUse" in b:
                calls.add(b["toolUse"]["toolUseId"])
    results = set()
    for m in req.get("messages") or []:
        for b in m.get("content") or [] if isinstance(m.get("content"), list) else []:
            if isinstance(b, dict) and "toolResult" in b:
                results.add(b["toolResult"]["toolUseId"])
            elif isinstance(b, dict) and b.get("type") == "tool_result":
                results.add(b["tool_use_id"])
    return calls, results


def _expected_micros(prices: PriceTable, model: str, u: dict[str, Any]) -> int | None:
    price = prices.price(model, "aws.bedrock")
    if price is None:
        return None
    micro = ((u["in"] - u["read"] - u["write"]) * price.input + u["read"] * price.cached_input
             + u["write"] * price.cache_write + (u["out"] or 0) * price.output)
    return math.ceil(micro / 1_000_000)


async def _send(session: aiohttp.ClientSession, url: str, pair: dict[str, Any], run: str) -> dict[str, Any]:
    req = pair["request"]
    headers = {k: v for k, v in (req.get("headers") or {}).items() if k.lower() in ("accept", "content-type")}
    headers.update({"Authorization": f"Bearer {KEY}", "X-Run-Id": run, "x-replay-pair": pair["id"]})
    # The route exactly as the client sent it: yarl must not re-encode its %3A and %2F.
    target = aiohttp.client.URL(url + pair["route"], encoded=True)
    async with session.post(target, data=base64.b64decode(req["body_b64"]), headers=headers) as r:
        return {"status": r.status, "body": await r.read(), "rewrites": r.headers.get("x-spanmeter-rewrites", "")}


async def test_every_recorded_bedrock_pair_replays_exactly(make_proxy, otlp_receiver):  # noqa: F811
    pairs = _pairs()
    runner, upstream = await serve_on_free_port(create_replay({p["id"]: p for p in pairs}))
    try:
        proxy = await make_proxy(bedrock_base_url=upstream, otlp_endpoint=otlp_receiver.endpoint)
        got, spans = await replay_runs(proxy, pairs, _send, "bedrock", otlp_receiver)
    finally:
        await runner.cleanup()
    _check(pairs, got, spans)


def _check(pairs: list[dict[str, Any]], got: dict[str, dict[str, Any]], spans: list[dict[str, Any]]) -> None:
    prices = PriceTable.load()
    by_run: dict[str, list[dict[str, Any]]] = defaultdict(list)
    tool_ids = set()
    for s in spans:
        a = s["attributes"]
        if s["name"].startswith("execute_tool"):
            tool_ids.add(a.get("gen_ai.tool.call.id"))
        elif "gen_ai.request.model" in a and str(a.get("spanmeter.run.id", "")).startswith("bedrock-"):
            by_run[a["spanmeter.run.id"]].append(s)
    problems: list[str] = []
    answered: set[str] = set()
    calls_by_run: dict[str, set[str]] = defaultdict(set)
    exact = 0
    for p in sorted(pairs, key=lambda p: (p["run"], p["seq"])):
        g, want_status = got[p["id"]], p["response"]["status"]
        where = f"{p['id']} ({p['kind']} {p.get('invoke_family') or ''} {p['model']})"
        before = len(problems)
        if g["status"] != want_status:
            problems.append(f"{where}: status {g['status']} for recorded {want_status}: {g['body'][:300]!r}")
            continue
        if g["body"] != decoded(p):
            problems.append(f"{where}: the client got other bytes than recorded (rewrites {g['rewrites']!r})")
        if "cache_breakpoint" in g["rewrites"]:  # prompt_cache is auto here: no recorded request may need one
            problems.append(f"{where}: prompt caching rewrote the recorded request ({g['rewrites']!r})")
        calls, results = _calls_and_results(p)
        answered |= results & calls_by_run[p["run"]]
        calls_by_run[p["run"]] |= calls
        run_spans = sorted(by_run.get(f"bedrock-{p['run']}", []), key=lambda s: s["start_ns"])
        if len(run_spans) <= p["seq"]:
            problems.append(f"{where}: no model span")
            continue
        a = run_spans[p["seq"]]["attributes"]
        model = _path_model(p)
        if a.get("gen_ai.provider.name") != "aws.bedrock":
            problems.append(f"{where}: provider {a.get('gen_ai.provider.name')!r}")
        if a.get("gen_ai.request.model") != model:
            problems.append(f"{where}: request model {a.get('gen_ai.request.model')!r}, the path names {model!r}")
        u = _usage(p)
        if u is None:
            problems.append(f"{where}: the recording has no usage")
            continue
        tokens = (a.get("gen_ai.usage.input_tokens"), a.get("gen_ai.usage.output_tokens"))
        if tokens != (u["in"], u["out"]):
            problems.append(f"{where}: span tokens {tokens}, Bedrock billed {(u['in'], u['out'])}")
        want_cost = _expected_micros(prices, model, u)
        cost = round(float(a.get("spanmeter.cost.usd", 0.0)) * 1e6)
        if want_cost is None:
            if model not in UNPRICED:
                problems.append(f"{where}: {model} has no price at aws.bedrock")
        elif cost != want_cost or cost <= 0:
            problems.append(f"{where}: cost {cost} micro-USD, the price table says {want_cost} for {model}")
        exact += len(problems) == before
    missing = answered - tool_ids
    if missing:
        problems.append(f"tool calls answered in a later request with no execute_tool span: {sorted(missing)}")
    assert not problems, f"{len(problems)} problems, {exact} of {len(pairs)} pairs exact:\n" + "\n".join(problems[:40])
    assert exact == len(pairs) == 45
