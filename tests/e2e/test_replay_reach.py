"""Real traffic of the providers beyond the big three through a running spanmeter: every
pair of ../shared/cassettes/reach-pairs.jsonl recorded against Azure OpenAI and the
OpenAI-compatible hosts (Groq, Mistral, Together, DeepSeek), each cassette one run, sent on
spanmeter's own route for that provider (the Azure route as the SDK sends it, the host's
path under /upstreams/{name}) to a replay upstream answering with the recorded bytes.

The client gets the recorded bytes; the span names the provider by its semconv name and
the model the request named; its tokens are the recorded usage; its cost is that usage at
the price table's rates, above 0 (every model these recordings name is priced) (an Azure deployment is
priced as the model its answer says ran); tool calls answered in a later request of the run
become execute_tool spans; nothing answers 5xx. Bedrock's pairs are replayed by
tests/e2e/test_replay_bedrock.py; Vertex's pair is replayed by tests/e2e/test_vertex.py."""

from __future__ import annotations

import base64
import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from proxy.ops.demo import serve_on_free_port
from proxy.pricing import PriceTable
from tests.fakes.replay import create_replay, decoded, replay_runs
from tests.fixtures.otlp import otlp_receiver  # noqa: F401

REACH = Path(__file__).resolve().parents[2].parent / "shared" / "cassettes" / "reach-pairs.jsonl"
KEY = "sm-reach-replay-0001"
PROVIDER = {"azure": "azure.ai.openai", "groq": "groq", "mistral": "mistral_ai", "together": "together_ai",
            "deepseek": "deepseek"}
# The deployments of the recordings, as an operator would map them; a deployment it does not
# map is learned from its answers.
DEPLOYMENTS = {"test-deployment": "text-embedding-3-large"}
# Azure runs the deployment its path names, whatever the body's `model` says.
_IN_PATH = re.compile(r"/openai/deployments/([^/]+)/")


def _pairs() -> list[dict[str, Any]]:
    if not REACH.exists():
        pytest.skip(f"{REACH} is missing: the recorded traffic lives beside the clone, in ../shared/cassettes")
    pairs = [json.loads(line) for line in REACH.read_text().splitlines() if line.strip()]
    return [p for p in pairs if p["provider"] in PROVIDER]


def _events(raw: bytes) -> list[Any]:
    out = []
    for block in re.split(rb"\n\n", raw.replace(b"\r\n", b"\n")):
        data = [line[5:].removeprefix(b" ") for line in block.split(b"\n") if line.startswith(b"data:")]
        if data:
            text = b"\n".join(data)
            try:
                out.append(json.loads(text))
            except ValueError:
                out.append(text.decode())
    return out


def _objects(pair: dict[str, Any]) -> list[dict[str, Any]]:
    body = decoded(pair)
    if pair["stream"]:
        return [e for e in _events(body) if isinstance(e, dict)]
    try:
        got = json.loads(body)
    except ValueError:
        return []
    return [got] if isinstance(got, dict) else []


def _usage(pair: dict[str, Any]) -> dict[str, int] | None:
    """The recorded usage (chat and embeddings bodies), the last report of a stream."""
    found = None
    for o in _objects(pair):
        u = o.get("usage") or (o.get("x_groq") or {}).get("usage")
        if isinstance(u, dict) and "prompt_tokens" in u:
            details = u.get("prompt_tokens_details") or {}
            read = details.get("cached_tokens") if isinstance(details, dict) else None
            if read is None:
                read = u.get("prompt_cache_hit_tokens", u.get("cached_tokens"))
            # An embedding has no output tokens (Mistral reports 0): the span reports none.
            out = None if pair["dialect"] == "embeddings" else u.get("completion_tokens")
            found = {"in": u["prompt_tokens"], "out": out, "read": read or 0}
    return found


def _answer_model(pair: dict[str, Any]) -> str | None:
    return next((o["model"] for o in _objects(pair) if isinstance(o.get("model"), str) and o["model"]), None)


def _calls_and_results(pair: dict[str, Any]) -> tuple[set[str], set[str]]:
    req = json.loads(base64.b64decode(pair["request"]["body_b64"]) or b"{}")
    calls = set()
    for o in _objects(pair):
        for ch in o.get("choices") or []:
            msg = ch.get("message") or ch.get("delta") or {}
            calls |= {tc["id"] for tc in msg.get("tool_calls") or [] if isinstance(tc, dict) and tc.get("id")}
    results = {m["tool_call_id"] for m in req.get("messages", []) if isinstance(m, dict) and m.get("role") == "tool"}
    return calls, results


def _expected_micros(prices: PriceTable, model: str, provider: str, u: dict[str, int]) -> int | None:
    """The usage at the table's rates, rounded up once; None for a model the table lacks."""
    price = prices.price(model, provider)
    if price is None:
        return None
    micro = (u["in"] - u["read"]) * price.input + u["read"] * price.cached_input + (u["out"] or 0) * price.output
    return -(-micro // 1_000_000)


async def _send(session: aiohttp.ClientSession, url: str, pair: dict[str, Any], run: str) -> dict[str, Any]:
    req = pair["request"]
    headers = {k: v for k, v in (req.get("headers") or {}).items() if k.lower() in ("accept", "content-type")}
    auth = {"api-key": KEY} if pair["provider"] == "azure" else {"Authorization": f"Bearer {KEY}"}
    headers.update({**auth, "X-Run-Id": run, "x-replay-pair": pair["id"]})
    async with session.post(url + pair["route"], data=base64.b64decode(req["body_b64"]), headers=headers) as r:
        return {"status": r.status, "body": await r.read(), "rewrites": r.headers.get("x-spanmeter-rewrites", "")}


async def _replay(make_proxy: Any, receiver: Any, tag: str, **settings: Any) -> None:
    pairs = _pairs()
    runner, upstream = await serve_on_free_port(create_replay({p["id"]: p for p in pairs}))
    try:
        hosts = {name: {"base_url": upstream} for name in ("groq", "mistral", "together", "deepseek")}
        proxy = await make_proxy(azure_openai_base_url=upstream, upstreams=hosts, azure_deployments=DEPLOYMENTS,
                                 otlp_endpoint=receiver.endpoint, **settings)
        got, spans = await replay_runs(proxy, pairs, _send, tag, receiver)
    finally:
        await runner.cleanup()
    _check(pairs, got, spans, tag)


def _check(pairs: list[dict[str, Any]], got: dict[str, dict[str, Any]], spans: list[dict[str, Any]],
           tag: str) -> None:
    prices = PriceTable.load()
    by_run: dict[str, list[dict[str, Any]]] = defaultdict(list)
    tool_ids = set()
    for s in spans:
        a = s["attributes"]
        if s["name"].startswith("execute_tool"):
            tool_ids.add(a.get("gen_ai.tool.call.id"))
        elif "gen_ai.request.model" in a and str(a.get("spanmeter.run.id", "")).startswith(f"{tag}-"):
            by_run[a["spanmeter.run.id"]].append(s)
    problems: list[str] = []
    answered: set[str] = set()
    calls_by_run: dict[str, set[str]] = defaultdict(set)
    for p in sorted(pairs, key=lambda p: (p["run"], p["seq"])):
        g, want_status = got[p["id"]], p["response"]["status"]
        where = f"{p['id']} ({p['provider']} {p['model']}{' stream' if p['stream'] else ''})"
        if g["status"] != want_status:
            problems.append(f"{where}: status {g['status']} for recorded {want_status}: {g['body'][:300]!r}")
            continue
        want = decoded(p)
        same = _events(g["body"]) == _events(want) if p["stream"] else g["body"] == want
        if want_status < 300 and not same:
            problems.append(f"{where}: the client got other bytes than recorded (rewrites {g['rewrites']!r})")
        calls, results = _calls_and_results(p)
        answered |= results & calls_by_run[p["run"]]
        calls_by_run[p["run"]] |= calls
        run_spans = sorted(by_run.get(f"{tag}-{p['run']}", []), key=lambda s: s["start_ns"])
        if len(run_spans) <= p["seq"]:
            problems.append(f"{where}: no model span")
            continue
        a = run_spans[p["seq"]]["attributes"]
        if a.get("gen_ai.provider.name") != PROVIDER[p["provider"]]:
            problems.append(f"{where}: provider {a.get('gen_ai.provider.name')!r}, not {PROVIDER[p['provider']]!r}")
        named = _IN_PATH.match(p["route"])
        if a.get("gen_ai.request.model") != (named[1] if named else p["model"]):
            problems.append(f"{where}: request model {a.get('gen_ai.request.model')!r}")
        u = _usage(p) if want_status < 300 else None
        if u is None:
            continue
        tokens = (a.get("gen_ai.usage.input_tokens"), a.get("gen_ai.usage.output_tokens"))
        if tokens != (u["in"], u["out"]):
            problems.append(f"{where}: span tokens {tokens}, recorded {(u['in'], u['out'])}")
        ran = _answer_model(p) or p["model"]
        want_cost = _expected_micros(prices, ran, PROVIDER[p["provider"]], u)
        cost = round(float(a.get("spanmeter.cost.usd", 0.0)) * 1e6)
        if want_cost is None:
            problems.append(f"{where}: {ran} has no price at {PROVIDER[p['provider']]}")
        elif cost != want_cost or cost <= 0:
            problems.append(f"{where}: cost {cost} micro-USD, the price table says {want_cost} for {ran}")
    missing = answered - tool_ids
    if missing:
        problems.append(f"tool calls answered in a later request with no execute_tool span: {sorted(missing)}")
    assert not problems, f"{len(problems)} of {len(pairs)} pairs:\n" + "\n".join(problems[:40])


async def test_every_recorded_reach_pair_replays_exactly(make_proxy, otlp_receiver):  # noqa: F811
    await _replay(make_proxy, otlp_receiver, "reach")
