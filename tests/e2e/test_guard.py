"""Loop guard through the proxy: a real SDK agent loop against a model stuck on one call."""

from __future__ import annotations

import json

import openai
import pytest

TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]


async def _loop(client, rounds: int, result: str = '{"ok": true, "content": "x: 1"}') -> list[dict]:
    msgs: list[dict] = [{"role": "user", "content": "SCENARIO:loop read the config"}]
    for _ in range(rounds):
        resp = await client.chat.completions.create(model="sim-small", messages=msgs, tools=TOOLS)
        call = resp.choices[0].message.tool_calls[0]
        msgs += [resp.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": result}]
    return msgs


def _tool_results(received) -> list[str]:
    """The tool results each upstream request carried, last one per request."""
    out = []
    for r in received:
        tools = [m["content"] for m in r.json()["messages"] if m["role"] == "tool"]
        out.append(tools[-1] if tools else None)
    return out


async def test_reminder_is_prefixed_from_the_third_identical_result(make_proxy, sim):
    proxy = await make_proxy()
    client = openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="k", default_headers={"X-Run-Id": "loop-1"})
    msgs = await _loop(client, 4)
    await client.chat.completions.create(model="sim-small", messages=msgs, tools=TOOLS)
    results = _tool_results(sim.received)
    assert results[0] is None
    assert not results[1].startswith("[spanmeter]") and not results[2].startswith("[spanmeter]")
    assert results[3].startswith("[spanmeter] Note: you have called the tool `read_file` 3 times in a row")
    assert "4 times in a row" in results[4]
    assert results[3].endswith('{"ok": true, "content": "x: 1"}'), "the result itself is kept after the reminder"
    await client.close()


async def test_reminder_is_recorded_in_the_rewrites_header(make_proxy, sim):
    proxy = await make_proxy()
    client = openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="k", default_headers={"X-Run-Id": "loop-h"})
    msgs = await _loop(client, 3)
    raw = await client.chat.completions.with_raw_response.create(model="sim-small", messages=msgs, tools=TOOLS)
    assert "loop_reminder=read_filex3" in raw.headers["x-spanmeter-rewrites"]
    await client.close()


async def test_refuse_stops_the_loop_with_a_409_the_sdk_does_not_retry(make_proxy, sim):
    proxy = await make_proxy(policy={"guard": {"action": "refuse"}})
    client = openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="k", default_headers={"X-Run-Id": "loop-2"})
    msgs = await _loop(client, 3)
    sent = len(sim.received)
    with pytest.raises(openai.ConflictError) as ei:
        await client.chat.completions.create(model="sim-small", messages=msgs, tools=TOOLS)
    assert ei.value.response.headers["x-should-retry"] == "false"
    assert "called the tool `read_file` 3 times in a row with identical arguments" in ei.value.message
    assert "guard.action" in ei.value.message
    assert len(sim.received) == sent, "the upstream must see no further call"
    await client.close()


async def test_changed_arguments_reset_the_streak(make_proxy, sim):
    proxy = await make_proxy(policy={"guard": {"action": "refuse"}})
    client = openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="k", max_retries=0,
                                default_headers={"X-Run-Id": "loop-3"})
    msgs: list[dict] = []
    for path in ["/a", "/a", "/b", "/a", "/a", "/b"]:  # never three identical calls in a row
        msgs.append({"role": "user", "content": f"SCENARIO:loop PATH={path}"})
        resp = await client.chat.completions.create(model="sim-small", messages=msgs, tools=TOOLS)
        call = resp.choices[0].message.tool_calls[0]
        assert json.loads(call.function.arguments) == {"path": path}
        msgs += [resp.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "same"}]
    await client.chat.completions.create(model="sim-small", messages=msgs, tools=TOOLS)
    assert not any("[spanmeter]" in r.body.decode() for r in sim.received)
    # ...whereas a third identical call in a row is refused.
    for _ in range(2):
        msgs.append({"role": "user", "content": "SCENARIO:loop PATH=/b"})
        resp = await client.chat.completions.create(model="sim-small", messages=msgs, tools=TOOLS)
        call = resp.choices[0].message.tool_calls[0]
        msgs += [resp.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "same"}]
    with pytest.raises(openai.ConflictError):
        await client.chat.completions.create(model="sim-small", messages=msgs, tools=TOOLS)
    await client.close()


async def test_consecutive_tool_failures_ceiling_refuses(make_proxy, sim):
    proxy = await make_proxy(policy={"guard": {"action": "off", "max_consecutive_failures": 2}})
    client = openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="k", max_retries=0,
                                default_headers={"X-Run-Id": "fail-1"})
    msgs = await _loop(client, 1, result='{"ok": false, "error": "permission denied"}')
    resp = await client.chat.completions.create(model="sim-small", messages=msgs, tools=TOOLS)
    call = resp.choices[0].message.tool_calls[0]
    msgs += [resp.choices[0].message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": '{"exit_code": 2, "stderr": "boom"}'}]
    with pytest.raises(openai.ConflictError) as ei:
        await client.chat.completions.create(model="sim-small", messages=msgs, tools=TOOLS)
    assert "2 tool failures in a row" in ei.value.message
    await client.close()
