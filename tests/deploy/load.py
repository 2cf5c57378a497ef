"""A bounded, simulator-driven load through a real proxy that touches every dashboard panel.

Used by test_dashboards_prometheus.py. Each step is one scenario a panel needs; all go
through the proxy's public HTTP API exactly as an agent's SDK would send them.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import httpx2
from aiohttp import web
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from proxy.app import create_app
from proxy.config import Settings, hash_key
from proxy.ops.demo import serve_on_free_port
from proxy.simulator import create_simulator
from tests.fixtures.mcp_server import serve_mcp

__all__ = ["KEYS", "Running", "drive_load", "running_proxy", "upstream_keys"]

# Two tenants so "by tenant" panels have more than one line; both have day and month
# budgets (the budget gauges exist only for tenants with one).
KEYS = {"acme": "sm-dash-acme-key", "globex": "sm-dash-globex-key"}
# A second key of acme with a rate limit of its own: one request a minute.
RATE_LIMITED_KEY = "sm-dash-acme-rate-limited-key"
MODEL = "sim-small"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CACHED_PROMPT = "a long agent context the provider has seen before " * 4  # ~50 input tokens, 8 cached
# Declared beside get_weather in the tool round trip and never called: unused definition cost.
UNUSED_TOOL = [{"type": "function", "function": {
    "name": "send_email", "description": "Send an email",
    "parameters": {"type": "object", "properties": {"to": {"type": "string"}}, "required": ["to"]}}}]
READ_TOOL = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]


@dataclass
class Running:
    proxy_url: str
    proxy_port: int


def settings_for(sim_url: str, data_dir: Path, mcp_url: str | None = None) -> Settings:
    budgets = {"daily_usd": 5.0, "monthly_usd": 100.0}
    # acme's loop guard reminds, globex's refuses: both guard actions show up.
    guard = {"acme": {"action": "remind", "threshold": 3}, "globex": {"action": "refuse", "threshold": 3}}
    # acme's runs get a wrap-up note from half of any ceiling on.
    runs = {"acme": {"max_llm_calls": 20, "wrap_up_at": 0.5}, "globex": {"max_llm_calls": 20}}
    tenants = {name: {"keys": [hash_key(key)],
                      "policy": {"budgets": budgets, "runs": runs[name], "guard": guard[name]}}
               for name, key in KEYS.items()}
    mcp = {"tools": {"url": mcp_url, "tool_costs": {"get_weather": 0.01}}} if mcp_url else {}
    tenants["acme"]["keys"].append({"hash": hash_key(RATE_LIMITED_KEY),
                                    "policy": {"rate_limits": {"requests_per_minute": 1}}})
    return Settings(openai_base_url=sim_url, anthropic_base_url=sim_url, gemini_base_url=sim_url,
                    data_dir=str(data_dir), port=0, tenants=tenants, mcp_servers=mcp, anatomy=True).check()


@contextmanager
def upstream_keys() -> Iterator[None]:
    """Tenant mode injects the provider key from the environment; restore it afterwards."""
    names = ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "GEMINI_API_KEY")
    saved = {n: os.environ.get(n) for n in names}
    os.environ.update({n: "sk-upstream-dashboard-test" for n in names})
    try:
        yield
    finally:
        for n, v in saved.items():
            if v is None:
                os.environ.pop(n, None)
            else:
                os.environ[n] = v


@asynccontextmanager
async def running_proxy(data_dir: Path) -> AsyncIterator[Running]:
    sim_runner, sim_url = await serve_on_free_port(create_simulator())
    mcp_server, mcp_task, mcp = await serve_mcp()
    app: web.Application = create_app(settings_for(sim_url, data_dir, mcp.url))
    runner, url = await serve_on_free_port(app)
    try:
        yield Running(url, int(url.rsplit(":", 1)[1]))
    finally:
        await runner.cleanup()
        await sim_runner.cleanup()
        mcp_server.should_exit = True
        await mcp_task


class Agent:
    """One run of one tenant, speaking Chat Completions over plain HTTP."""

    def __init__(self, http: aiohttp.ClientSession, url: str, tenant: str, run: str, key: str | None = None) -> None:
        self.http, self.url, self.run = http, url, run
        self.headers = {"Authorization": f"Bearer {key or KEYS[tenant]}", "X-Run-Id": run}

    async def chat(self, messages: list[dict[str, Any]], **extra: Any) -> tuple[int, Any]:
        body = {"model": MODEL, "messages": messages, **extra}
        async with self.http.post(f"{self.url}/v1/chat/completions", json=body,
                                  headers=self.headers) as resp:
            if body.get("stream"):
                return resp.status, await resp.text()
            return resp.status, await resp.json(content_type=None)

    async def end(self) -> None:
        async with self.http.post(f"{self.url}/runs/{self.run}/end", headers=self.headers) as resp:
            await resp.read()


def _user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


async def _tool_round_trip(agent: Agent, scenario: str, tools: list[dict[str, Any]], rounds: int,
                           result: str) -> int:
    """Answer every tool call with `result`; stops at the first refusal, returning its status."""
    messages = _user(scenario)
    for _ in range(rounds):
        status, reply = await agent.chat(messages, tools=tools)
        if status != 200:
            return status
        msg = reply["choices"][0]["message"]
        messages = [*messages, msg]
        for call in msg.get("tool_calls") or []:
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    return 200


async def drive_load(url: str, tag: str = "1") -> dict[str, int]:
    """Every scenario a panel needs, once each; returns the HTTP status of each step.

    `tag` keeps run ids apart when the load is driven more than once.
    """
    statuses: dict[str, int] = {}
    async with aiohttp.ClientSession() as http:
        for tenant in KEYS:
            agent = Agent(http, url, tenant, f"dash-{tenant}-chat-{tag}")
            for stream in (False, True):
                extra = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
                statuses[f"{tenant} stream={stream}"], _ = await agent.chat(_user("hello"), **extra)
            statuses[f"{tenant} error"], _ = await agent.chat(_user("SCENARIO:error:500"))
            # A prompt-cache hit: the simulator reports 8 of the call's input tokens as cached.
            statuses[f"{tenant} cached"], _ = await agent.chat(_user("SCENARIO:cached " + CACHED_PROMPT))
            await agent.end()
        # A tool round trip: the call in response 1, its result in request 2.
        tools = Agent(http, url, "acme", f"dash-tool-{tag}")
        statuses["tool ok"] = await _tool_round_trip(tools, "SCENARIO:tool", [*TOOLS, *UNUSED_TOOL], 2,
                                                     '{"ok": true, "temp": 14}')
        failing = Agent(http, url, "globex", f"dash-tool-fail-{tag}")
        statuses["tool failed"] = await _tool_round_trip(failing, "SCENARIO:tool", TOOLS, 2,
                                                         '{"ok": false, "error": "down"}')
        # The same tool call with the same identical result again and again: from the 3rd
        # repeat acme's guard reminds the model, globex's refuses the call.
        loop = Agent(http, url, "acme", f"dash-loop-{tag}")
        statuses["loop remind"] = await _tool_round_trip(loop, "SCENARIO:loop", READ_TOOL, 5,
                                                         '{"ok": true, "text": "x"}')
        refused = Agent(http, url, "globex", f"dash-loop-refused-{tag}")
        statuses["loop refuse"] = await _tool_round_trip(refused, "SCENARIO:loop", READ_TOOL, 5,
                                                         '{"ok": true, "text": "x"}')
        # A run ceiling: the 3rd call of a run capped at 2 calls is refused.
        capped = Agent(http, url, "globex", f"dash-capped-{tag}")
        capped.headers["X-Run-Max-Calls"] = "2"
        for i in range(3):
            statuses[f"capped {i}"], _ = await capped.chat(_user("hello"))
        # Structured output that needs repair (a fenced, JSON5-ish answer).
        repair = Agent(http, url, "acme", f"dash-repair-{tag}")
        statuses["repair"], _ = await repair.chat(_user("SCENARIO:json_fenced"),
                                                  response_format={"type": "json_object"})
        # A run that sees its ceiling coming: at half of 4 calls acme's wrap-up note arrives
        # and the simulated agent answers instead of calling its tool again.
        wrap = Agent(http, url, "acme", f"dash-wrap-up-{tag}")
        wrap.headers["X-Run-Max-Calls"] = "4"
        statuses["wrap up"] = await _tool_round_trip(wrap, "SCENARIO:wrap_up", TOOLS, 3, '{"ok": true, "temp": 14}')
        # acme's rate-limited key: one request a minute, the next one is a 429.
        hasty = Agent(http, url, "acme", f"dash-rate-{tag}", key=RATE_LIMITED_KEY)
        for i in range(2):
            statuses[f"rate {i}"], _ = await hasty.chat(_user("hello"))
        for agent in (tools, failing, loop, refused, capped, repair, wrap, hasty):
            await agent.end()
    statuses.update(await _mcp_calls(url, tag))
    return statuses


async def _mcp_calls(url: str, tag: str) -> dict[str, int]:
    """Tools on the MCP route, through the official SDK's client: one that answers, one
    that fails (isError)."""
    http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {KEYS['acme']}", "X-Run-Id": f"dash-mcp-{tag}"})
    async with Client(streamable_http_client(f"{url}/mcp/tools", http_client=http), mode="legacy") as mcp:
        ok = await mcp.call_tool("get_weather", {"city": "Paris"})
        failed = await mcp.call_tool("flaky", {"city": "Oslo"})
    return {"mcp ok": 200 if not ok.is_error else 500, "mcp failed": 200 if failed.is_error else 500}


async def _main() -> None:  # pragma: no cover - manual exploration helper
    import tempfile

    with upstream_keys(), tempfile.TemporaryDirectory() as d:
        async with running_proxy(Path(d)) as run:
            print(await drive_load(run.proxy_url))
            async with aiohttp.ClientSession() as http, http.get(run.proxy_url + "/metrics") as r:
                print(await r.text())


if __name__ == "__main__":  # pragma: no cover
    asyncio.run(_main())
