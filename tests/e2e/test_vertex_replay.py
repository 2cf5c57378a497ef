"""The Vertex AI exchange recorded against the real us-central1 host
(../shared/cassettes/reach-pairs.jsonl, provider `vertex`), replayed through spanmeter:
the client gets the recorded bytes, the span's tokens are the recorded usage, the cost is
the table's rates applied to it, and the path and its odd query (`$alt=json;enum-encoding=int`,
percent-encoded as google's older clients send it) go upstream exactly as sent."""

from __future__ import annotations

import asyncio
import base64
import json
import math
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from yarl import URL

from proxy.ops.demo import serve_on_free_port
from proxy.pricing import PriceTable
from proxy.serve.appkeys import TEL
from tests.conftest import ProxyFactory
from tests.fakes.replay import MISSING, RECORDED, create_replay, decoded
from tests.fixtures.otlp import OtlpReceiver, otlp_receiver  # noqa: F401

REACH = RECORDED.parent / "reach-pairs.jsonl"
ROUTE = ("/v1beta1/projects/test-project/locations/us-central1/publishers/google/models/gemini-2.5-flash"
         ":generateContent?%24alt=json%3Benum-encoding%3Dint")


def _vertex_pair() -> dict[str, Any]:
    if not REACH.exists():
        pytest.skip(MISSING)
    pairs = [json.loads(line) for line in REACH.read_text().splitlines() if line.strip()]
    found = [p for p in pairs if p["provider"] == "vertex" and p["route"] == ROUTE]
    assert len(found) == 1, "the recorded Vertex pair"
    return found[0]


async def test_the_recorded_vertex_pair_replays_as_recorded(make_proxy: ProxyFactory,
                                                            otlp_receiver: OtlpReceiver) -> None:  # noqa: F811
    pair = _vertex_pair()
    replay = create_replay({pair["id"]: pair})
    seen: list[str] = []

    async def record(request: web.Request, response: web.StreamResponse) -> None:
        seen.append(request.raw_path)

    replay.on_response_prepare.append(record)
    runner, upstream = await serve_on_free_port(replay)
    try:
        proxy = await make_proxy(vertex_base_url=upstream, otlp_endpoint=otlp_receiver.endpoint)
        sent = pair["request"]
        headers = {**sent["headers"], "x-replay-pair": pair["id"], "Authorization": "Bearer ya29.caller",
                   "X-Run-Id": "vertex-replay"}
        async with aiohttp.ClientSession() as s, s.post(
                URL(proxy.url + ROUTE, encoded=True), data=base64.b64decode(sent["body_b64"]), headers=headers) as r:
            status, body = r.status, await r.read()
        await proxy.settled()
        await asyncio.to_thread(proxy.app[TEL].force_flush)
        spans = await asyncio.to_thread(otlp_receiver.wait_for_spans, 1)
    finally:
        await runner.cleanup()
    assert status == pair["response"]["status"] == 200
    assert body == decoded(pair), "the recorded bytes, byte for byte"
    assert seen == [ROUTE], "the path and its percent-encoded query went upstream as sent"
    usage = json.loads(decoded(pair))["usageMetadata"]
    span = next(s for s in spans if s["name"] == "generate_content gemini-2.5-flash")
    a = span["attributes"]
    assert a["gen_ai.provider.name"] == "gcp.vertex_ai"
    assert a["gen_ai.request.model"] == "gemini-2.5-flash"
    assert a["gen_ai.usage.input_tokens"] == usage["promptTokenCount"] == 11
    # Output is billed with the thoughts: candidates 17 + thoughts 190.
    assert a["gen_ai.usage.output_tokens"] == usage["candidatesTokenCount"] + usage["thoughtsTokenCount"]
    assert a["gen_ai.usage.reasoning.output_tokens"] == 190
    price = PriceTable.load().price("gemini-2.5-flash")
    assert price is not None
    # The table's rates are micro-USD per million tokens; the ledger charges whole micro-USD, rounded up.
    want = math.ceil((11 * price.input + 207 * price.output) / 1e6) / 1e6
    assert a["spanmeter.cost.usd"] == pytest.approx(want) and want > 0
