"""Tool calls and results joined by id wherever they stand (issue 54, item 1).

An agent framework that loads tools on demand (Anthropic `defer_loading` tools, tool
search and `tool_reference` results) writes its own assistant tool call and its result
between the model's call and the model's next answer. The model's call still has its
result in that next request: its `execute_tool` span carries it, and the run does not
count it missing. One real SDK per dialect, through a running proxy, against the simulator.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import anthropic
import openai
import pytest
from google import genai
from google.genai import types

from proxy.serve.appkeys import RUNS, TEL
from tests.fixtures.otlp import otlp_receiver  # noqa: F401

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
RESULT = {"temp_c": 14, "conditions": "rain"}
HEADERS = {"X-Run-Id": "deferred-1"}
ASK = "SCENARIO:tool weather in Paris?"
SEARCH = {"query": "forecast"}


async def messages_loop(url: str) -> None:
    tools: Any = [{"name": "get_weather", "description": "weather", "input_schema": WEATHER},
                  {"name": "tool_search", "description": "find tools", "input_schema": {"type": "object"}},
                  {"name": "get_forecast", "description": "forecast", "input_schema": WEATHER,
                   "defer_loading": True}]
    async with anthropic.AsyncAnthropic(base_url=url, api_key="k", max_retries=0, default_headers=HEADERS) as c:
        msgs: Any = [{"role": "user", "content": ASK}]
        first = await c.messages.create(model="claude-sonnet-5-5", max_tokens=200, tools=tools, messages=msgs)
        use = next(b for b in first.content if b.type == "tool_use")
        msgs += [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                               "content": json.dumps(RESULT)}]},
                 # The framework's own turn: it searches for a deferred tool and loads it.
                 {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_search_1",
                                                    "name": "tool_search", "input": SEARCH}]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_search_1",
                                               "content": [{"type": "tool_reference",
                                                            "tool_name": "get_forecast"}]}]}]
        await c.messages.create(model="claude-sonnet-5-5", max_tokens=200, tools=tools, messages=msgs)


async def chat_loop(url: str) -> None:
    tools: Any = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
                  {"type": "function", "function": {"name": "tool_search", "parameters": {"type": "object"}}}]
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0, default_headers=HEADERS) as c:
        msgs: Any = [{"role": "user", "content": ASK}]
        first = await c.chat.completions.create(model="sim-small", messages=msgs, tools=tools)
        call = first.choices[0].message.tool_calls[0]
        msgs += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps(RESULT)},
                 {"role": "assistant", "tool_calls": [{"id": "call_search_1", "type": "function", "function": {
                     "name": "tool_search", "arguments": json.dumps(SEARCH)}}]},
                 {"role": "tool", "tool_call_id": "call_search_1", "content": "loaded: get_forecast"}]
        await c.chat.completions.create(model="sim-small", messages=msgs, tools=tools)


async def responses_loop(url: str) -> None:
    tools: Any = [{"type": "function", "name": "get_weather", "parameters": WEATHER, "strict": False},
                  {"type": "function", "name": "tool_search", "parameters": {"type": "object"}, "strict": False}]
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0, default_headers=HEADERS) as c:
        first = await c.responses.create(model="gpt-5", input=ASK, tools=tools)
        call = next(o for o in first.output if o.type == "function_call")
        inputs: Any = [{"role": "user", "content": ASK}, call.model_dump(exclude_none=True),
                       {"type": "function_call_output", "call_id": call.call_id, "output": json.dumps(RESULT)},
                       {"type": "function_call", "call_id": "call_search_1", "name": "tool_search",
                        "arguments": json.dumps(SEARCH)},
                       {"type": "function_call_output", "call_id": "call_search_1", "output": "loaded: get_forecast"}]
        await c.responses.create(model="gpt-5", input=inputs, tools=tools)


async def gemini_loop(url: str) -> None:
    client = genai.Client(api_key="k", http_options=types.HttpOptions(base_url=url, headers=HEADERS))
    decls = [types.FunctionDeclaration(name="get_weather", parameters_json_schema=WEATHER),
             types.FunctionDeclaration(name="tool_search", parameters_json_schema={"type": "object"})]
    cfg = types.GenerateContentConfig(tools=[types.Tool(function_declarations=decls)],
                                      automatic_function_calling=types.AutomaticFunctionCallingConfig(disable=True))
    first = await client.aio.models.generate_content(model="gemini-2.5-flash", contents=ASK, config=cfg)
    fc = first.function_calls[0]
    contents = [types.Content(role="user", parts=[types.Part(text=ASK)]), first.candidates[0].content,
                types.Content(role="user", parts=[types.Part(function_response=types.FunctionResponse(
                    name=fc.name, id=fc.id, response=RESULT))]),
                types.Content(role="model", parts=[types.Part(function_call=types.FunctionCall(
                    name="tool_search", id="search-1", args=SEARCH))]),
                types.Content(role="user", parts=[types.Part(function_response=types.FunctionResponse(
                    name="tool_search", id="search-1", response={"loaded": ["get_forecast"]}))])]
    await client.aio.models.generate_content(model="gemini-2.5-flash", contents=contents, config=cfg)


LOOPS: dict[str, Callable[[str], Awaitable[None]]] = {
    "messages": messages_loop, "chat": chat_loop, "responses": responses_loop, "gemini": gemini_loop}


@pytest.mark.parametrize("dialect", list(LOOPS))
async def test_a_call_answered_before_a_framework_turn_has_its_result(otlp_receiver, make_proxy,  # noqa: F811
                                                                       dialect: str) -> None:
    proxy = await make_proxy(otlp_endpoint=otlp_receiver.endpoint)
    await LOOPS[dialect](proxy.url)
    await proxy.settled()
    assert await proxy.app[RUNS].end("default", "deferred-1")
    await proxy.settled()
    await asyncio.to_thread(proxy.app[TEL].force_flush)
    spans = await asyncio.to_thread(otlp_receiver.wait_for_spans, 4)

    tools = [s for s in spans if s["name"].startswith("execute_tool")]
    assert [s["name"] for s in tools] == ["execute_tool get_weather"]
    (tool,) = tools
    assert "error.type" not in tool["attributes"], tool["attributes"].get("error.type")
    assert tool["attributes"]["spanmeter.tool.call.result.digest"] == "{temp_c, conditions}"
    (run,) = [s for s in spans if s["name"].startswith("invoke_agent")]
    assert run["attributes"].get("spanmeter.run.tool_results_missing", 0) == 0
    assert run["attributes"]["spanmeter.run.tool_calls"] == 1
