"""Tool calls through MCP, observed and governed like model calls (issue 18).

The outside world is real: the official MCP SDK's server (tests/fixtures/mcp_server.py)
under uvicorn, its Streamable HTTP client, an openai-agents agent whose model is the
simulator behind the proxy and whose tools come from that server through the proxy, and
spans at a real OTLP receiver.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import httpx2
import pytest
from agents import Agent, MaxTurnsExceeded, OpenAIChatCompletionsModel, Runner, set_tracing_disabled
from agents.mcp import MCPServerStreamableHttp
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from openai import AsyncOpenAI
from yarl import URL

from proxy.config import hash_key
from proxy.serve.appkeys import RUNS, STORE, TEL
from tests.fixtures.mcp_server import WEATHER_DELAY_S, McpServerRunning, mcp_server  # noqa: F401
from tests.fixtures.otlp import otlp_receiver  # noqa: F401

set_tracing_disabled(True)  # the agents SDK's own tracing would export to OpenAI

KEY, SERVER_KEY = "sm-acme-mcp-key-0001", "srv-weather-secret-42"


async def _proxy(make_proxy, monkeypatch_env, server: McpServerRunning, receiver, **policy: Any):
    monkeypatch_env("OPENAI_API_KEY", "sk-upstream-model-key")
    monkeypatch_env("WEATHER_MCP_KEY", SERVER_KEY)
    return await make_proxy(
        otlp_endpoint=receiver.endpoint,
        tenants={"acme": {"keys": [hash_key(KEY)], "policy": policy}},
        mcp_servers={"weather": {"url": server.url, "key_env": "WEATHER_MCP_KEY",
                                 "tool_costs": {"get_weather": 0.25}}})


def _client(proxy, run_id: str, mode: str) -> Client:
    http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {KEY}", "X-Run-Id": run_id})
    return Client(streamable_http_client(f"{proxy.url}/mcp/weather", http_client=http), mode=mode)


async def _spans(proxy, receiver, n: int) -> list[dict[str, Any]]:
    await proxy.settled()
    await asyncio.to_thread(proxy.app[TEL].force_flush)
    return await asyncio.to_thread(receiver.wait_for_spans, n)


def _by_name(spans: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {s["name"]: s for s in spans}


@pytest.mark.parametrize("mode", ["legacy", "auto"])
async def test_every_request_of_the_sdk_client_is_a_span_with_the_mcp_conventions(
        otlp_receiver, mcp_server, make_proxy, monkeypatch_env, mode):  # noqa: F811
    """legacy: the 2025 handshake, a session, SSE answers, the GET stream and a DELETE;
    auto: the 2026 stateless era (server/discover, JSON answers)."""
    proxy = await _proxy(make_proxy, monkeypatch_env, mcp_server, otlp_receiver)
    progress: list[float] = []

    async def on_progress(p: float, total: float | None, message: str | None) -> None:
        progress.append(p)

    async with _client(proxy, f"sdk-{mode}", mode) as c:
        assert [t.name for t in (await c.list_tools()).tools][:2] == ["get_weather", "flaky"]
        weather = await c.call_tool("get_weather", {"city": "Paris"})
        flaky = await c.call_tool("flaky", {"city": "Oslo"})
        steps = await c.call_tool("progress", {"steps": 3}, progress_callback=on_progress)
    assert json.loads(weather.content[0].text)["city"] == "Paris" and not weather.is_error
    assert flaky.is_error and steps.content[0].text == "3 steps done"
    assert progress == [1, 2, 3], "server notifications on the call's SSE stream reach the client"

    handshake = "initialize" if mode == "legacy" else "server/discover"
    spans = _by_name(await _spans(proxy, otlp_receiver, 5))
    assert set(spans) == {handshake, "tools/list", "tools/call get_weather", "tools/call flaky", "tools/call progress"}
    w = spans["tools/call get_weather"]
    a = w["attributes"]
    assert w["kind"] == "SPAN_KIND_CLIENT" and w["status"] == "STATUS_CODE_UNSET"
    assert (a["mcp.method.name"], a["gen_ai.operation.name"], a["gen_ai.tool.name"]) == (
        "tools/call", "execute_tool", "get_weather")
    assert a["jsonrpc.request.id"] and a["spanmeter.tool.timing"] == "observed"
    assert (a["spanmeter.run.id"], a["spanmeter.tenant.id"], a["spanmeter.mcp.server"]) == (
        f"sdk-{mode}", "acme", "weather")
    assert a["spanmeter.tool.call.arguments.digest"] == "Paris" and a["spanmeter.tool.call.arguments.size"] > 0
    assert len(a["spanmeter.tool.call.result.sha256"]) == 64 and a["spanmeter.tool.ok"] is True
    assert (w["end_ns"] - w["start_ns"]) / 1e9 >= WEATHER_DELAY_S, "timed at the proxy, around the server's work"
    f = spans["tools/call flaky"]
    assert f["status"] == "STATUS_CODE_ERROR" and f["attributes"]["error.type"] == "tool_error"
    assert f["attributes"]["spanmeter.tool.call.result.digest"] == "Error executing tool flaky"
    assert "gen_ai.tool.name" not in spans["tools/list"]["attributes"]
    trace_ids = {s["trace_id"] for s in spans.values()}
    assert len(trace_ids) == 1, "every request of the run is in the run's one trace"
    sessions = {s["attributes"].get("mcp.session.id") for s in spans.values()}
    if mode == "legacy":
        raw = next(r["headers"]["mcp-session-id"] for r in mcp_server.requests if "mcp-session-id" in r["headers"])
        assert len(sessions) == 1 and None not in sessions and raw not in sessions, "one session, recorded hashed"
        assert spans["tools/list"]["attributes"]["mcp.protocol.version"] == "2025-11-25"
        assert [r["method"] for r in mcp_server.requests].count("DELETE") == 1, "the session's end is relayed"
        assert "GET" in [r["method"] for r in mcp_server.requests], "the server's stream is relayed"
    else:
        assert sessions == {None}
    for r in mcp_server.requests:  # the server's credential goes out, the tenant's key never does
        assert r["headers"]["authorization"] == f"Bearer {SERVER_KEY}"
        assert KEY not in json.dumps(r["headers"]) and "x-run-id" not in r["headers"]
    totals = await proxy.app[STORE].run_totals("acme", f"sdk-{mode}")
    assert {k: totals[k] for k in ("mcp_tool_calls", "tool_calls", "tool_failures", "cost_micros")} == {
        "mcp_tool_calls": 3, "tool_calls": 3, "tool_failures": 1, "cost_micros": 250_000}


async def test_the_tool_call_ceiling_refuses_with_a_json_rpc_error_the_sdk_raises(
        otlp_receiver, mcp_server, make_proxy, monkeypatch_env):  # noqa: F811
    proxy = await _proxy(make_proxy, monkeypatch_env, mcp_server, otlp_receiver, runs={"max_tool_calls": 2})
    async with _client(proxy, "capped", "legacy") as c:
        for city in ("Paris", "Oslo"):
            await c.call_tool("read_file", {"path": city})
        sent = [r["method"] for r in mcp_server.requests].count("POST")
        with pytest.raises(MCPError) as ei:
            await c.call_tool("get_weather", {"city": "Rome"})
        assert [r["method"] for r in mcp_server.requests].count("POST") == sent, "the refused call never left"
    assert ei.value.error.code == -32050
    assert "ceiling of 2 MCP tool calls" in ei.value.error.message
    assert "Raise runs.max_tool_calls" in ei.value.error.message
    assert ei.value.error.data == {"type": "spanmeter.budget_exceeded", "limit": "run_tool_calls"}
    spans = await _spans(proxy, otlp_receiver, 4)
    refused = [s for s in spans if s["status"] == "STATUS_CODE_ERROR"]
    assert len(refused) == 1 and refused[0]["attributes"]["error.type"] == "spanmeter.budget_exceeded"
    totals = await proxy.app[STORE].run_totals("acme", "capped")
    assert (totals["mcp_tool_calls"], totals["ceilings_hit"]) == (2, 1)
    metrics = proxy.app[TEL].metrics_text().decode()
    assert 'gen_ai_tool_name="get_weather"' not in metrics, "a refused call mints no label value"
    refused = [line for line in metrics.splitlines()
               if line.startswith("spanmeter_tool_calls_total") and 'spanmeter_outcome="refused"' in line]
    assert len(refused) == 1 and 'gen_ai_tool_name="_OTHER"' in refused[0]


def _agent(proxy, run_id: str) -> tuple[Agent, MCPServerStreamableHttp]:
    headers = {"X-Run-Id": run_id}
    model = OpenAIChatCompletionsModel(model="sim-small", openai_client=AsyncOpenAI(
        base_url=f"{proxy.url}/v1", api_key=KEY, default_headers=headers, max_retries=0))
    tools = MCPServerStreamableHttp({"url": f"{proxy.url}/mcp/weather",
                                     "headers": {"Authorization": f"Bearer {KEY}", **headers}},
                                    cache_tools_list=True)
    return Agent(name="weather-agent", instructions="Be brief.", model=model, mcp_servers=[tools]), tools


async def test_an_agents_tool_calls_are_each_one_span_with_their_measured_duration(
        otlp_receiver, mcp_server, make_proxy, monkeypatch_env):  # noqa: F811
    """The model (the simulator, through the proxy) calls get_weather, then flaky; the
    agent runs both on the MCP server through the proxy. Each call is told once: by the
    MCP span, which carries the model's call id and links to the chat span that asked."""
    proxy = await _proxy(make_proxy, monkeypatch_env, mcp_server, otlp_receiver)
    agent, tools = _agent(proxy, "agent-1")
    async with tools:
        first = await Runner.run(agent, "SCENARIO:tool TOOL=get_weather")
        second = await Runner.run(agent, "SCENARIO:tool TOOL=flaky")
    assert '"temp": 14' in first.final_output and "Error executing tool flaky" in second.final_output
    await proxy.settled()
    assert await proxy.app[RUNS].end("acme", "agent-1")
    spans = await _spans(proxy, otlp_receiver, 8)
    names = sorted(s["name"] for s in spans)
    assert "execute_tool get_weather" not in names and "execute_tool flaky" not in names, "no inferred twin"
    assert names.count("chat sim-small") == 4 and names.count("tools/call get_weather") == 1
    assert names.count("tools/call flaky") == 1
    chats = {s["span_id"]: s for s in spans if s["name"] == "chat sim-small"}
    for tool in ("get_weather", "flaky"):
        span = next(s for s in spans if s["name"] == f"tools/call {tool}")
        (link,) = span["links"]
        asking = chats[link["span_id"]]
        assert span["attributes"]["gen_ai.tool.call.id"].startswith("call_")
        assert asking["end_ns"] <= span["start_ns"], "linked to the chat span whose answer made the call"
    weather = next(s for s in spans if s["name"] == "tools/call get_weather")
    assert (weather["end_ns"] - weather["start_ns"]) / 1e9 >= WEATHER_DELAY_S
    flaky = next(s for s in spans if s["name"] == "tools/call flaky")
    assert flaky["status"] == "STATUS_CODE_ERROR" and flaky["attributes"]["error.type"] == "tool_error"
    run = next(s for s in spans if s["attributes"].get("gen_ai.operation.name") == "invoke_agent")["attributes"]
    assert (run["spanmeter.run.model_calls"], run["spanmeter.run.tool_calls"], run["spanmeter.run.mcp_tool_calls"],
            run["spanmeter.run.tool_failures"]) == (4, 2, 2, 1)
    model_cost = sum(s["attributes"].get("spanmeter.cost.usd", 0) for s in chats.values())
    assert run["spanmeter.run.cost.usd"] == pytest.approx(model_cost + 0.25), "the tool's cost is in the run's"
    assert len({s["trace_id"] for s in spans}) == 1


async def test_a_looping_agent_is_reminded_on_the_third_identical_call_and_capped_after(
        otlp_receiver, mcp_server, sim, make_proxy, monkeypatch_env):  # noqa: F811
    proxy = await _proxy(make_proxy, monkeypatch_env, mcp_server, otlp_receiver,
                         guard={"action": "remind", "threshold": 3}, runs={"max_tool_calls": 3})
    agent, tools = _agent(proxy, "looping")
    async with tools:
        with pytest.raises(MaxTurnsExceeded):
            await Runner.run(agent, "SCENARIO:loop TOOL=read_file", max_turns=4)
    # What the model was told after each of its four identical calls (the tool result of request k+1).
    results = [json.dumps(r.json()["messages"][-1].get("content")) for r in sim.received[1:]]
    assert len(results) == 3
    assert "[spanmeter]" not in results[0] and "[spanmeter]" not in results[1]
    assert "called the tool `read_file` 3 times in a row" in results[2] and "contents of /etc/config.yaml" in results[2]
    assert results[2].count("[spanmeter]") == 1, "reminded once: by the MCP route, not again by the model route"
    assert [r["method"] for r in mcp_server.requests].count("POST") == 3 + 2  # 3 calls, the handshake, tools/list
    spans = await _spans(proxy, otlp_receiver, 9)
    calls = sorted((s for s in spans if s["name"] == "tools/call read_file"), key=lambda s: s["start_ns"])
    assert [s["attributes"].get("spanmeter.guard.action") for s in calls] == [None, None, "remind", None]
    assert calls[2]["attributes"]["spanmeter.rewrites"] == ["loop_reminder=read_filex3"]
    assert calls[3]["attributes"]["error.type"] == "spanmeter.budget_exceeded", "the 4th is past max_tool_calls"


async def _post(url: str, body: bytes, headers: dict[str, str]) -> tuple[int, dict[str, Any]]:
    # encoded=True: the path goes out exactly as written (no dot-segment folding).
    async with aiohttp.ClientSession() as http, http.post(URL(url, encoded=True), data=body, headers=headers) as resp:
        return resp.status, await resp.json(content_type=None)


INIT = b'{"jsonrpc": "2.0", "id": 7, "method": "tools/list"}'


@pytest.mark.parametrize(("path", "body", "auth", "status", "code", "says"), [
    ("/mcp/nope", INIT, True, 404, -32600, "No MCP server named 'nope' is configured"),
    ("/mcp/weather", INIT, False, 401, -32600, "No spanmeter key was sent"),
    ("/mcp/weather", b"[" + INIT + b"]", True, 400, -32600, "batches"),
    ("/mcp/weather", b'{"jsonrpc": "2.0", "id": 7, "method": ', True, 400, -32700, "not JSON"),
    ("/mcp/weather", b'{"id": 7, "method": "tools/list"}', True, 400, -32700, "not a JSON-RPC 2.0 message"),
    ("/mcp/weather/../weather", INIT, True, 404, -32600, "dot segments"),
    ("/mcp/", INIT, True, 404, -32600, "is not an MCP server name"),
], ids=["unknown server", "no key", "batch", "not json", "not json-rpc", "dot segments", "no name"])
async def test_what_cannot_be_served_is_a_json_rpc_error_and_never_reaches_the_server(
        otlp_receiver, mcp_server, make_proxy, monkeypatch_env, path, body, auth, status, code, says):  # noqa: F811
    proxy = await _proxy(make_proxy, monkeypatch_env, mcp_server, otlp_receiver)
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {KEY}"} if auth else {})}
    got, answer = await _post(proxy.url + path, body, headers)
    assert got == status
    assert answer["jsonrpc"] == "2.0" and answer["error"]["code"] == code
    assert says in answer["error"]["message"]
    assert answer["id"] in (7, None)
    assert mcp_server.requests == []


@pytest.mark.parametrize("key_env", [None, "WEATHER_MCP_KEY"], ids=["caller's own key", "server credential"])
async def test_open_mode_forwards_the_callers_own_key_unless_the_server_has_a_credential(
        mcp_server, make_proxy, monkeypatch_env, key_env):  # noqa: F811
    monkeypatch_env("WEATHER_MCP_KEY", SERVER_KEY)
    proxy = await make_proxy(mcp_servers={"weather": {"url": mcp_server.url, "key_env": key_env}})
    await _post(f"{proxy.url}/mcp/weather", INIT, {"Content-Type": "application/json",
                                                   "Accept": "application/json, text/event-stream",
                                                   "Authorization": "Bearer my-own-tools-token"})
    (seen,) = mcp_server.requests
    assert seen["headers"]["authorization"] == ("Bearer my-own-tools-token" if key_env is None
                                                else f"Bearer {SERVER_KEY}")


@pytest.mark.parametrize("mode", ["legacy", "auto"], ids=["SSE answers", "JSON answers"])
async def test_the_reminder_is_the_results_first_block_from_the_third_identical_call(
        otlp_receiver, mcp_server, make_proxy, monkeypatch_env, mode):  # noqa: F811
    proxy = await _proxy(make_proxy, monkeypatch_env, mcp_server, otlp_receiver, guard={"action": "remind"})
    async with _client(proxy, f"remind-{mode}", mode) as c:
        results = [await c.call_tool("read_file", {"path": "/a"}) for _ in range(4)]
    texts = [[block.text for block in r.content] for r in results]
    assert texts[0] == texts[1] == ["contents of /a: x: 1"]
    for n, got in ((3, texts[2]), (4, texts[3])):
        assert got[0].startswith(f"[spanmeter] Note: you have called the tool `read_file` {n} times in a row")
        assert got[1:] == ["contents of /a: x: 1"], "the result itself follows, unchanged"


async def test_a_tool_call_run_on_mcp_is_not_missing_when_the_run_ends_before_the_model_hears_back(
        otlp_receiver, mcp_server, make_proxy, monkeypatch_env):  # noqa: F811
    proxy = await _proxy(make_proxy, monkeypatch_env, mcp_server, otlp_receiver)
    tools: Any = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
                  {"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}}]
    async with AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key=KEY, default_headers={"X-Run-Id": "cut"}) as model:
        for tool in ("get_weather", "read_file"):  # two calls the model makes; only the first runs on MCP
            await model.chat.completions.create(model="sim-small", tools=tools, messages=[
                {"role": "user", "content": f"SCENARIO:tool TOOL={tool}"}])
    await proxy.settled()
    async with _client(proxy, "cut", "auto") as c:
        await c.call_tool("get_weather", {"city": "Paris", "unit": "celsius"})
    await proxy.settled()
    assert await proxy.app[RUNS].end("acme", "cut")
    spans = await _spans(proxy, otlp_receiver, 6)
    assert sorted(s["name"] for s in spans if "read_file" in s["name"] or "get_weather" in s["name"]) == [
        "execute_tool read_file", "tools/call get_weather"], "only the call never run is missing"
    run = next(s for s in spans if s["attributes"].get("gen_ai.operation.name") == "invoke_agent")["attributes"]
    assert (run["spanmeter.run.tool_calls"], run["spanmeter.run.tool_results_missing"]) == (2, 1)
