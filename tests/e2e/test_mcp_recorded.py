"""Recorded MCP exchanges replayed through the proxy (tests/data/mcp/cases.yaml).

The server side is a replay of what the official SDK's server sent, chunk for chunk; the
client side sends what the official SDK's client sent, plus the tenant's key and run.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web

from proxy.config import hash_key
from proxy.ops.demo import serve_on_free_port
from proxy.serve.appkeys import TEL
from tests.fixtures.otlp import otlp_receiver  # noqa: F401

DATA = Path(__file__).resolve().parents[1] / "data" / "mcp"
CASES = yaml.safe_load((DATA / "cases.yaml").read_text())
KEY, SERVER_KEY = "sm-acme-replay-key-01", "srv-replay-secret-77"
# What the protocol needs to reach the other side unchanged.
REQUEST_HEADERS = ("accept", "content-type", "mcp-session-id", "mcp-protocol-version", "mcp-method", "mcp-name",
                   "last-event-id")
RESPONSE_HEADERS = ("content-type", "mcp-session-id")


class Replay:
    """An MCP server that answers with one recorded exchange and keeps what it received."""

    def __init__(self, exchange: dict[str, Any], hold: str | None) -> None:
        self.exchange, self.hold = exchange, hold
        self.received: list[tuple[str, dict[str, str], bytes]] = []
        self.gate = asyncio.Event()  # the client read what came before the held part

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.received.append((request.method, {k.lower(): v for k, v in request.headers.items()},
                              await request.read()))
        recorded = self.exchange["response"]
        resp = web.StreamResponse(status=recorded["status"], headers=recorded["headers"])
        await resp.prepare(request)
        chunks = recorded["chunks"]
        for i, chunk in enumerate(chunks):
            if self.hold == "before_last" and i == len(chunks) - 1:
                await self.gate.wait()
            await resp.write(chunk.encode())
        if self.hold == "before_end":
            await self.gate.wait()
        await resp.write_eof()
        return resp


def _request(case: dict[str, Any], exchange: dict[str, Any]) -> tuple[dict[str, str], bytes]:
    headers = {**exchange["request"]["headers"], "Authorization": f"Bearer {KEY}"}
    body = exchange["request"]["body"].encode()
    if "meta_traceparent" in case:
        message = json.loads(body)
        message["params"]["_meta"]["traceparent"] = case["meta_traceparent"]
        body = json.dumps(message).encode()
    else:
        headers["X-Run-Id"] = "replayed"
    return headers, body


async def _read(resp: aiohttp.ClientResponse, chunks: list[str], replay: Replay) -> bytes:
    """The answer, releasing the held part only once what came before it has arrived."""
    if replay.hold is None:
        return await resp.read()
    before = "".join(chunks[:-1] if replay.hold == "before_last" else chunks).encode()
    async with asyncio.timeout(5):  # a proxy that buffers never delivers it
        head = await resp.content.readexactly(len(before))
    replay.gate.set()
    return head + await resp.read()


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
async def test_a_recorded_exchange_crosses_the_proxy_intact(otlp_receiver, make_proxy, monkeypatch_env,  # noqa: F811
                                                            case: dict[str, Any]) -> None:
    exchange = json.loads((DATA / "recorded" / f"{case['file']}.json").read_text())
    replay = Replay(exchange, case.get("hold"))
    app = web.Application()
    app.router.add_route("*", "/mcp", replay.handle)
    runner, url = await serve_on_free_port(app)
    monkeypatch_env("REPLAY_MCP_KEY", SERVER_KEY)
    proxy = await make_proxy(otlp_endpoint=otlp_receiver.endpoint, tenants={"acme": {"keys": [hash_key(KEY)]}},
                             mcp_servers={"tools": {"url": f"{url}/mcp", "key_env": "REPLAY_MCP_KEY"}})
    headers, body = _request(case, exchange)
    recorded = exchange["response"]
    try:
        async with aiohttp.ClientSession() as http, http.request(
                exchange["request"]["method"], f"{proxy.url}/mcp/tools", data=body or None, headers=headers) as resp:
            got = await _read(resp, recorded["chunks"], replay)
            got_headers = {k.lower(): v for k, v in resp.headers.items()}
            status = resp.status
    finally:
        replay.gate.set()
        await runner.cleanup()

    assert status == recorded["status"]
    assert got == "".join(recorded["chunks"]).encode(), "the answer arrives byte for byte"
    for h in RESPONSE_HEADERS:
        assert got_headers.get(h) == recorded["headers"].get(h), h
    ((method, upstream_headers, upstream_body),) = replay.received
    assert (method, upstream_body) == (exchange["request"]["method"], body), "the request arrives byte for byte"
    for h in REQUEST_HEADERS:
        assert upstream_headers.get(h) == exchange["request"]["headers"].get(h), h
    assert upstream_headers["authorization"] == f"Bearer {SERVER_KEY}", "the server's own credential"
    assert KEY not in json.dumps(upstream_headers) and "x-run-id" not in upstream_headers

    await proxy.settled()
    await asyncio.to_thread(proxy.app[TEL].force_flush)
    spans = [s for s in otlp_receiver.spans() if s["name"] != "run"]
    want = case["span"]
    if want is None:
        assert spans == []
        return
    (span,) = spans
    assert span["name"] == want["name"] and span["kind"] == "SPAN_KIND_CLIENT"
    assert span["status"] == want.get("status", "STATUS_CODE_UNSET")
    for key in ("trace_id", "parent_span_id"):
        if key in want:
            assert span[key] == want[key], key
    assert {k: span["attributes"].get(k) for k in want["attributes"]} == want["attributes"]
    assert span["attributes"]["spanmeter.mcp.server"] == "tools"
