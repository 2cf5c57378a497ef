"""Every ceiling on the MCP route, tried as an attacker would (issue 26, items 1, 2, 3, 5).

The MCP server is the official SDK's (tests/fixtures/mcp_server.py), stateless with JSON
answers so that many tools/call can run at once without a session each; the answers no
real server sends on purpose (not JSON, an id of the wrong type, never) come from a
small scripted server below that counts the tools it ran.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from proxy.config import hash_key, key_id_of
from proxy.ops.demo import serve_on_free_port
from proxy.serve.appkeys import STORE
from tests.fixtures.mcp_server import McpServerRunning, serve_mcp

KEY, LIMITED = "sm-acme-mcp-open-key", "sm-acme-mcp-tight-key"
LIMITED_ID = key_id_of(hash_key(LIMITED))
HEADERS = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream",
           "MCP-Protocol-Version": "2025-06-18"}
_ids = itertools.count(1)


@pytest.fixture
async def stateless_mcp() -> AsyncIterator[McpServerRunning]:
    server, task, running = await serve_mcp(stateless_http=True, json_response=True)
    yield running
    server.should_exit = True
    await task


def _call(tool: str = "read_file", **arguments: Any) -> bytes:
    return json.dumps({"jsonrpc": "2.0", "id": next(_ids), "method": "tools/call",
                       "params": {"name": tool, "arguments": arguments or {"path": "/a"}}}).encode()


async def _post(url: str, body: bytes, key: str, run: str, timeout: float | None = None) -> tuple[int, Any]:
    headers = {**HEADERS, "Authorization": f"Bearer {key}", "X-Run-Id": run}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as http, http.post(
            url, data=body, headers=headers) as resp:
        text = await resp.text()
        try:
            return resp.status, json.loads(text) if text else None
        except json.JSONDecodeError:
            return resp.status, text


async def _proxy(make_proxy, server_url: str, *, tool_cost: float = 0.01, key_policy: dict[str, Any] | None = None,
                 settings: dict[str, Any] | None = None, **policy: Any):
    keys: list[Any] = [hash_key(KEY), {"hash": hash_key(LIMITED), "policy": key_policy or {}}]
    return await make_proxy(**(settings or {}), tenants={"acme": {"keys": keys, "policy": policy}},
                            mcp_servers={"tools": {"url": server_url, "tool_costs": {"read_file": tool_cost,
                                                                                     "slow": tool_cost}}})


def _ran(server: McpServerRunning) -> int:
    return sum(1 for r in server.requests if r["method"] == "POST")


# --- item 1: a key's own limits ------------------------------------------------------------


async def test_concurrent_tool_calls_hold_the_keys_own_run_ceilings_and_day_budget(make_proxy, stateless_mcp):
    proxy = await _proxy(make_proxy, stateless_mcp.url, runs={"max_tool_calls": 100, "max_cost_usd": 10},
                         budgets={"daily_usd": 10},
                         key_policy={"runs": {"max_tool_calls": 3, "max_cost_usd": 0.02},
                                     "budgets": {"daily_usd": 0.03}})
    url = f"{proxy.url}/mcp/tools"
    one_run = await asyncio.gather(*(_post(url, _call(path=str(i)), LIMITED, "one") for i in range(20)))
    ok = [a for s, a in one_run if s == 200 and "result" in a]
    refused = [a["error"] for s, a in one_run if s == 200 and "error" in a]
    assert len(ok) == 2 and len(refused) == 18, "$0.02 a run at $0.01 a call"
    assert {e["data"]["limit"] for e in refused} == {"run_cost"}
    assert "key setting runs.max_cost_usd" in refused[0]["message"]
    await proxy.settled()
    many = await asyncio.gather(*(_post(url, _call(path=str(i)), LIMITED, f"r{i}") for i in range(40)))
    assert sum(1 for s, a in many if s == 200 and "result" in a) == 1, "the key's day had $0.01 left"
    assert {a["error"]["data"]["limit"] for s, a in many if "error" in a} == {"key_day"}
    await proxy.settled()
    assert await proxy.app[STORE].spend("acme", day=_today(), key_id=LIMITED_ID) == 30_000
    assert _ran(stateless_mcp) == 3, "only the admitted calls reached the server"
    # The tool-call ceiling of the key, under a tenant that allows 100.
    proxy2 = await _proxy(make_proxy, stateless_mcp.url, tool_cost=0, runs={"max_tool_calls": 100},
                          key_policy={"runs": {"max_tool_calls": 3}})
    calls = await asyncio.gather(*(_post(f"{proxy2.url}/mcp/tools", _call(path=str(i)), LIMITED, "c") for i in
                                   range(20)))
    assert sum(1 for s, a in calls if "result" in a) == 3
    assert {a["error"]["data"]["limit"] for s, a in calls if "error" in a} == {"run_tool_calls"}
    other = await _post(f"{proxy2.url}/mcp/tools", _call(), KEY, "c2")
    assert "result" in other[1], "the tenant's other key is not held by that key's limits"


def _today() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%d")


# --- item 2: an answer never read is charged its reservation ---------------------------------


class Scripted:
    """An MCP server that answers tools/call as told: `json` (a good answer), `late` (after
    1.5 s), `not_json`, `wrong_id` (the id as a string), `error` (a JSON-RPC error), `status_500`."""

    def __init__(self) -> None:
        self.mode = "json"
        self.ran = 0
        self.url = ""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        msg = await request.json()
        if msg.get("method") != "tools/call":
            return web.json_response({"jsonrpc": "2.0", "id": msg.get("id"), "result": {}})
        if self.mode == "error":
            return web.json_response({"jsonrpc": "2.0", "id": msg["id"],
                                      "error": {"code": -32602, "message": "unknown tool"}})
        if self.mode == "status_500":
            return web.Response(status=500, text="down")
        self.ran += 1  # a paid tool runs
        if self.mode == "late":
            await asyncio.sleep(1.5)
        if self.mode == "not_json":
            return web.Response(text="<html>ok</html>", content_type="application/json")
        rid = str(msg["id"]) if self.mode == "wrong_id" else msg["id"]
        return web.json_response({"jsonrpc": "2.0", "id": rid,
                                  "result": {"content": [{"type": "text", "text": "done"}], "isError": False}})


@pytest.fixture
async def scripted() -> AsyncIterator[Scripted]:
    s = Scripted()
    app = web.Application()
    app.router.add_post("/mcp", s.handle)
    runner, url = await serve_on_free_port(app)
    s.url = f"{url}/mcp"
    yield s
    await runner.cleanup()


@pytest.mark.parametrize("mode", ["client_timeout", "read_timeout", "not_json", "wrong_id"])
async def test_a_tool_answer_never_read_is_charged_its_reservation_and_waves_stop_at_the_ceiling(
        make_proxy, scripted, mode):
    scripted.mode = {"client_timeout": "late", "read_timeout": "late"}.get(mode, mode)
    # Long enough for the admission and the forward on a busy machine, well short of the answer.
    extra = {"read_timeout_s": 0.6} if mode == "read_timeout" else {}
    proxy = await _proxy(make_proxy, scripted.url, runs={"max_cost_usd": 0.03}, settings=extra)
    url, timeout = f"{proxy.url}/mcp/tools", 0.6 if mode == "client_timeout" else None
    for _wave in range(3):  # each wave tries again once the last one's answers are given up on
        await asyncio.gather(*(_post(url, _call(), KEY, "unread", timeout) for _ in range(4)),
                             return_exceptions=True)
        await asyncio.sleep(0.05)
        await proxy.settled()
    assert scripted.ran == 3, "$0.03 at $0.01 a call: the fourth and every later wave refused"
    assert await proxy.app[STORE].spend("acme", run_id="unread") == 30_000


@pytest.mark.parametrize("mode", ["error", "status_500"])
async def test_a_tool_the_server_refused_is_charged_nothing(make_proxy, scripted, mode):
    scripted.mode = mode
    proxy = await _proxy(make_proxy, scripted.url, runs={"max_cost_usd": 0.03})
    for _ in range(5):
        await _post(f"{proxy.url}/mcp/tools", _call(), KEY, "refused")
    await proxy.settled()
    assert await proxy.app[STORE].spend("acme", run_id="refused") == 0


async def test_a_tool_call_to_a_server_that_is_down_is_charged_nothing(make_proxy):
    proxy = await _proxy(make_proxy, "http://127.0.0.1:9/mcp", runs={"max_cost_usd": 0.03})
    status, answer = await _post(f"{proxy.url}/mcp/tools", _call(), KEY, "down")
    assert status == 502 and "error" in answer
    await proxy.settled()
    assert await proxy.app[STORE].spend("acme", run_id="down") == 0


# --- item 3: runs.max_seconds holds on the MCP route too ----------------------------------


async def test_a_tool_call_after_the_runs_wall_time_is_refused(make_proxy, stateless_mcp):
    proxy = await _proxy(make_proxy, stateless_mcp.url, runs={"max_seconds": 0.5})
    first = await _post(f"{proxy.url}/mcp/tools", _call(), KEY, "timed")
    assert "result" in first[1]
    await asyncio.sleep(0.6)
    status, late = await _post(f"{proxy.url}/mcp/tools", _call(), KEY, "timed")
    assert status == 200 and late["error"]["data"]["limit"] == "run_seconds"
    assert "Raise runs.max_seconds" in late["error"]["message"] or "runs.max_seconds" in late["error"]["message"]
    assert _ran(stateless_mcp) == 1


# --- item 5: MCP edges -------------------------------------------------------------------------


async def test_a_tools_call_notification_is_refused_and_never_reaches_the_server(make_proxy, stateless_mcp):
    proxy = await _proxy(make_proxy, stateless_mcp.url, runs={"max_cost_usd": 0.03})
    body = json.dumps({"jsonrpc": "2.0", "method": "tools/call", "params": {"name": "read_file",
                                                                            "arguments": {"path": "/a"}}}).encode()
    results = await asyncio.gather(*(_post(f"{proxy.url}/mcp/tools", body, KEY, "note") for _ in range(10)))
    for status, answer in results:
        assert status == 400 and answer["id"] is None
        assert 'without an "id" is a notification' in answer["error"]["message"]
    assert _ran(stateless_mcp) == 0
    # Other notifications still pass (the protocol needs them).
    status, _ = await _post(f"{proxy.url}/mcp/tools",
                            b'{"jsonrpc": "2.0", "method": "notifications/initialized"}', KEY, "note")
    assert status == 202


async def test_mcp_requests_draw_on_the_tenants_and_the_keys_requests_per_minute(make_proxy, stateless_mcp):
    proxy = await _proxy(make_proxy, stateless_mcp.url, rate_limits={"requests_per_minute": 10},
                         key_policy={"rate_limits": {"requests_per_minute": 3}})
    url = f"{proxy.url}/mcp/tools"
    listing = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/list"}).encode()
    keyed = await asyncio.gather(*(_post(url, listing if i % 2 else _call(), LIMITED, "rl") for i in range(12)))
    assert sum(1 for s, a in keyed if "result" in a) == 3, "the key's 3 a minute, tools/list included"
    limited = [a["error"] for s, a in keyed if "error" in a]
    assert {e["code"] for e in limited} == {-32052} and {e["data"]["limit"] for e in limited} == {"rate_requests"}
    assert "3 requests per minute" in limited[0]["message"]
    tenant = await asyncio.gather(*(_post(url, _call(), KEY, "rl2") for _ in range(12)))
    assert sum(1 for s, a in tenant if "result" in a) == 7, "the tenant's 10, of which the key took 3"


@pytest.mark.parametrize(("key", "status", "says"), [
    (None, 401, "No spanmeter key was sent"),
    ("sm-wrong-key", 401, ""),
    (KEY, 404, "No MCP server named 'secret-admin-tools' is configured"),
])
async def test_an_unknown_server_name_is_told_only_to_a_caller_with_a_key_and_lists_nothing(
        make_proxy, stateless_mcp, key, status, says):
    proxy = await make_proxy(tenants={"acme": {"keys": [hash_key(KEY)]}},
                             mcp_servers={"tools": {"url": stateless_mcp.url}, "internal-db": {"url": "http://x"}})
    headers = {**HEADERS, **({"Authorization": f"Bearer {key}"} if key else {})}
    async with aiohttp.ClientSession() as http, http.post(f"{proxy.url}/mcp/secret-admin-tools",
                                                         data=_call(), headers=headers) as resp:
        got, text = resp.status, await resp.text()
    assert got == status and says in text
    assert "internal-db" not in text and "'tools'" not in text and "Configured" not in text
