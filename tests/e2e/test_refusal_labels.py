"""One refusal vocabulary (issue 52, item 2): a model call and an MCP tool call refused for
the same reason count under the same `spanmeter_reason` in `spanmeter_limit_rejections_total`,
so a dashboard filtering on a reason sees both.

One proxy, the simulator as the model API and the official MCP SDK's server; a tenant per
refusal, each driven into it on both routes: the loop guard (`guard.action: refuse`), a
requests-per-minute limit, a run's cost ceiling and a tenant's day budget. Then /metrics,
as Prometheus scrapes it.
"""

from __future__ import annotations

import itertools
import json
from collections import defaultdict
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from proxy.config import hash_key
from proxy.model import REFUSAL_REASONS
from tests.fixtures.mcp_server import McpServerRunning, serve_mcp

MCP_HEADERS = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream",
               "MCP-Protocol-Version": "2025-06-18"}
TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]
# tenant -> (its policy, the reason both routes must give, the model route's status, MCP's JSON-RPC code)
TENANTS: dict[str, tuple[dict[str, Any], str, int, int]] = {
    "loop": ({"guard": {"action": "refuse"}}, "loop_detected", 409, -32051),
    "rate": ({"rate_limits": {"requests_per_minute": 2}}, "rate_requests", 429, -32052),
    "cost": ({"runs": {"max_cost_usd": 0.000001}}, "run_cost", 402, -32050),
    "day": ({"budgets": {"daily_usd": 0.000001}}, "tenant_day", 402, -32050),
}
_ids = itertools.count(1)


def _key(tenant: str) -> str:
    return f"sm-{tenant}-refusal-labels-key"


@pytest.fixture
async def stateless_mcp() -> AsyncIterator[McpServerRunning]:
    server, task, running = await serve_mcp(stateless_http=True, json_response=True)
    yield running
    server.should_exit = True
    await task


async def _mcp_until_refused(http: aiohttp.ClientSession, url: str, tenant: str) -> dict[str, Any]:
    """The same tools/call again and again (a looping agent) until spanmeter refuses one."""
    headers = {**MCP_HEADERS, "Authorization": f"Bearer {_key(tenant)}", "X-Run-Id": f"mcp-{tenant}"}
    for _ in range(8):
        body = {"jsonrpc": "2.0", "id": next(_ids), "method": "tools/call",
                "params": {"name": "read_file", "arguments": {"path": "/etc/app.yaml"}}}
        async with http.post(url, data=json.dumps(body), headers=headers) as resp:
            answer = await resp.json()
        if "error" in answer:
            return dict(answer["error"])
    raise AssertionError(f"no MCP call of tenant {tenant} was refused")


async def _model_until_refused(base_url: str, tenant: str) -> openai.APIStatusError:
    """A model stuck on one tool call, its identical result sent back each turn, until refused."""
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=_key(tenant), max_retries=0,
                                default_headers={"X-Run-Id": f"model-{tenant}"})
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "SCENARIO:loop read the config"}]
    try:
        for _ in range(8):
            resp = await client.chat.completions.create(model="sim-small", messages=msgs, tools=TOOLS,
                                                        max_tokens=50)
            call = resp.choices[0].message.tool_calls[0]
            msgs += [resp.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": '{"ok": true, "content": "x: 1"}'}]
    except openai.APIStatusError as exc:
        return exc
    finally:
        await client.close()
    raise AssertionError(f"no model call of tenant {tenant} was refused")


def _rejections(text: str) -> dict[tuple[str, str], set[str]]:
    """(tenant, route) -> the reasons its refusals were counted under."""
    found: dict[tuple[str, str], set[str]] = defaultdict(set)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "spanmeter_limit_rejections_total" and s.value > 0:
                route = "mcp" if s.labels.get("gen_ai_operation_name") == "execute_tool" or (
                    "mcp_method_name" in s.labels) else "model"
                found[(s.labels["spanmeter_tenant_id"], route)].add(s.labels["spanmeter_reason"])
    return found


async def test_a_model_call_and_an_mcp_call_refused_alike_count_under_the_same_reason(
        make_proxy, stateless_mcp, monkeypatch_env):
    monkeypatch_env("OPENAI_API_KEY", "sk-upstream")
    proxy = await make_proxy(
        tenants={t: {"keys": [hash_key(_key(t))], "policy": spec[0]} for t, spec in TENANTS.items()},
        mcp_servers={"tools": {"url": stateless_mcp.url, "tool_costs": {"read_file": 0.01}}})
    async with aiohttp.ClientSession() as http:
        for tenant, (_, reason, status, code) in TENANTS.items():
            model = await _model_until_refused(proxy.url, tenant)
            tool = await _mcp_until_refused(http, f"{proxy.url}/mcp/tools", tenant)
            # What each route told the agent: its own error shape, the same refusal.
            assert model.status_code == status and tool["code"] == code, (tenant, model, tool)
            assert tool["data"].get("limit", reason) == reason, (tenant, tool)
        await proxy.settled()
        text = (await (await http.get(proxy.url + "/metrics")).read()).decode()

    counted = _rejections(text)
    for tenant, (_, reason, _, _) in TENANTS.items():
        assert counted[(tenant, "model")] == {reason}, (tenant, dict(counted))
        assert counted[(tenant, "mcp")] == {reason}, (tenant, dict(counted))
    emitted = set().union(*counted.values())
    assert emitted <= REFUSAL_REASONS, emitted - REFUSAL_REASONS
