"""Loop guard through the proxy: a real SDK agent loop against a model stuck on one call."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
from aiohttp import web

from proxy.demo import serve_on_free_port

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


@pytest.mark.parametrize("dialect", ["anthropic", "responses", "gemini"])
async def test_reminder_reaches_the_upstream_in_every_dialect(make_proxy, sim, dialect):
    proxy = await make_proxy()
    await _DIALECT_LOOPS[dialect](proxy.url, 4)
    assert len(sim.received) == 5  # 4 tool calls, then the request carrying the 4th result
    # Request k carries the result of identical call k: the reminder starts with the 3rd.
    assert ["[spanmeter] Note" in r.body.decode() for r in sim.received] == [False, False, False, True, True]


async def _anthropic_loop(url: str, rounds: int) -> None:
    import anthropic

    client = anthropic.AsyncAnthropic(base_url=url, api_key="k", default_headers={"X-Run-Id": "a-loop"})
    tools: Any = [{"name": "read_file", "input_schema": TOOLS[0]["function"]["parameters"]}]
    msgs: Any = [{"role": "user", "content": "SCENARIO:loop"}]
    for _ in range(rounds):
        resp = await client.messages.create(model="claude-sonnet-5-5", max_tokens=100, tools=tools, messages=msgs)
        use = next(b for b in resp.content if b.type == "tool_use")
        msgs += [{"role": "assistant", "content": [b.model_dump() for b in resp.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "same"}]}]
    await client.messages.create(model="claude-sonnet-5-5", max_tokens=100, tools=tools, messages=msgs)
    await client.close()


async def _responses_loop(url: str, rounds: int) -> None:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", default_headers={"X-Run-Id": "r-loop"})
    tools: Any = [{"type": "function", "name": "read_file", "parameters": TOOLS[0]["function"]["parameters"],
                   "strict": False}]
    inputs: Any = [{"role": "user", "content": "SCENARIO:loop"}]
    for _ in range(rounds):
        resp = await client.responses.create(model="gpt-5", input=inputs, tools=tools)
        call = next(o for o in resp.output if o.type == "function_call")
        inputs += [call.model_dump(exclude_none=True),
                   {"type": "function_call_output", "call_id": call.call_id, "output": "same"}]
    await client.responses.create(model="gpt-5", input=inputs, tools=tools)
    await client.close()


async def _gemini_loop(url: str, rounds: int) -> None:
    from google import genai
    from google.genai import types

    client = genai.Client(api_key="k", http_options=types.HttpOptions(base_url=url, headers={"X-Run-Id": "g-loop"}))
    decl = types.FunctionDeclaration(name="read_file", parameters_json_schema=TOOLS[0]["function"]["parameters"])
    cfg = types.GenerateContentConfig(tools=[types.Tool(function_declarations=[decl])],
                                      automatic_function_calling=types.AutomaticFunctionCallingConfig(disable=True))
    contents: list[Any] = [types.Content(role="user", parts=[types.Part(text="SCENARIO:loop")])]
    for _ in range(rounds):
        resp = await client.aio.models.generate_content(model="gemini-2.5-flash", contents=contents, config=cfg)
        fc = resp.function_calls[0]
        contents += [resp.candidates[0].content, types.Content(role="user", parts=[types.Part(
            function_response=types.FunctionResponse(name=fc.name, id=fc.id, response={"result": "same"}))])]
    await client.aio.models.generate_content(model="gemini-2.5-flash", contents=contents, config=cfg)


_DIALECT_LOOPS = {"anthropic": _anthropic_loop, "responses": _responses_loop, "gemini": _gemini_loop}


# A model that answers with parallel calls: `CALLS=n` in the first user message asks for the
# `random_topic` tool n times in every answer, always with the same (empty) arguments.
async def _parallel_model(request: web.Request) -> web.Response:
    body = await request.json()
    n = int(body["messages"][0]["content"].split("CALLS=")[1])
    turn = sum(1 for m in body["messages"] if m["role"] == "assistant")
    calls = [{"id": f"call_{turn}_{i}", "type": "function", "function": {"name": "random_topic", "arguments": "{}"}}
             for i in range(n)]
    return web.json_response({
        "id": f"chatcmpl-{turn}", "object": "chat.completion", "created": 1, "model": body["model"],
        "choices": [{"index": 0, "finish_reason": "tool_calls",
                     "message": {"role": "assistant", "content": None, "tool_calls": calls}}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}})


@pytest.fixture
async def parallel_model() -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", _parallel_model)
    runner, url = await serve_on_free_port(app)
    yield url
    await runner.cleanup()


RANDOM_TOPIC = [{"type": "function", "function": {"name": "random_topic", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("action", ["remind", "refuse"])
async def test_identical_parallel_calls_of_one_answer_are_one_step(make_proxy, parallel_model, action):
    proxy = await make_proxy(openai_base_url=parallel_model, policy={"guard": {"action": action}})
    client = openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="k", max_retries=0,
                                default_headers={"X-Run-Id": f"parallel-{action}"})
    msgs: list[dict] = [{"role": "user", "content": "three random topics, CALLS=3"}]
    for answer in range(3):  # each answer asks for random_topic three times at once; the agent runs all
        raw = await client.chat.completions.with_raw_response.create(model="gpt-4o-mini", messages=msgs,
                                                                      tools=RANDOM_TOPIC)
        # Request k carries the results of answer k-1: nine identical calls by now, in two answers.
        assert "loop_reminder" not in raw.headers.get("x-spanmeter-rewrites", ""), answer
        message = raw.parse().choices[0].message
        assert len(message.tool_calls) == 3
        msgs.append(message.model_dump(exclude_none=True))
        msgs += [{"role": "tool", "tool_call_id": c.id, "content": f"topic {c.id}"} for c in message.tool_calls]
    # The results of the third answer in a row asking for the same call: a streak of three.
    if action == "refuse":
        with pytest.raises(openai.ConflictError, match="`random_topic` 3 times in a row"):
            await client.chat.completions.create(model="gpt-4o-mini", messages=msgs, tools=RANDOM_TOPIC)
    else:
        raw = await client.chat.completions.with_raw_response.create(model="gpt-4o-mini", messages=msgs,
                                                                      tools=RANDOM_TOPIC)
        assert "loop_reminder=random_topicx3" in raw.headers["x-spanmeter-rewrites"]
    await client.close()
