"""The simulator speaks each wire format the real SDKs accept, and our adapters read it.

The SDKs talk to the simulator directly (no proxy in between): these tests pin the
simulator's formats; the proxy's own end-to-end tests build on them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import anthropic
import openai
import pydantic
import pytest
from aiohttp import web
from google import genai
from google.genai import types

from proxy.providers.anthropic import ANTHROPIC
from proxy.providers.chat import CHAT
from proxy.providers.gemini import GEMINI
from proxy.providers.observer import Observer
from proxy.providers.responses import RESPONSES
from proxy.providers.sse import Framer
from proxy.simulator import create_simulator
from proxy.simulator.script import GREETING
from tests.providers.cases import ApiObject

MODEL = "claude-sonnet-5-5"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


class Ada(pydantic.BaseModel):
    name: str
    born: int
    tags: list[str]


@pytest.fixture
async def sim() -> AsyncIterator[str]:
    runner = web.AppRunner(create_simulator())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]  # the port the OS gave: aiohttp's public view of it
    yield f"http://127.0.0.1:{port}"
    await runner.cleanup()


# ---- anthropic


def _anthropic(base: str) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=base, api_key="k", max_retries=0)


async def test_anthropic_create_gets_the_scripted_text(sim: str) -> None:
    msg = await _anthropic(sim).messages.create(
        model=MODEL, max_tokens=100, messages=[{"role": "user", "content": "hi"}])
    assert msg.content[0].type == "text"
    assert msg.content[0].text == GREETING
    assert msg.stop_reason == "end_turn"
    assert msg.usage.output_tokens > 0


async def test_anthropic_stream_gets_the_scripted_text(sim: str) -> None:
    async with _anthropic(sim).messages.stream(
        model=MODEL, max_tokens=100, messages=[{"role": "user", "content": "hi"}]
    ) as stream:
        pieces = [t async for t in stream.text_stream]
        final = await stream.get_final_message()
    assert "".join(pieces) == GREETING
    assert final.usage.input_tokens > 0


async def test_anthropic_tool_round_trip(sim: str) -> None:
    client = _anthropic(sim)
    tools: Any = [{"name": "get_weather", "description": "Weather", "input_schema": WEATHER}]
    messages: Any = [{"role": "user", "content": "SCENARIO:tool weather in Paris?"}]
    async with client.messages.stream(model=MODEL, max_tokens=100, messages=messages,
                                      tools=tools) as stream:
        first = await stream.get_final_message()
    call = next(b for b in first.content if b.type == "tool_use")
    assert (call.name, call.input, first.stop_reason) == (
        "get_weather", {"city": "Paris", "unit": "celsius"}, "tool_use")
    messages += [{"role": "assistant", "content": first.content},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                               "content": "18 C"}]}]
    second = await client.messages.create(model=MODEL, max_tokens=100, messages=messages,
                                          tools=tools)
    assert second.content[0].type == "text"
    assert "The tool answered: 18 C" in second.content[0].text


async def test_anthropic_parse_with_output_format(sim: str) -> None:
    msg = await _anthropic(sim).messages.parse(
        model=MODEL, max_tokens=100, output_format=Ada,
        messages=[{"role": "user", "content": "SCENARIO:json"}])
    assert msg.parsed_output == Ada(name="Ada Lovelace", born=1815, tags=["math", "poetry"])


# ---- google-genai


def _genai(base: str) -> genai.Client:
    # Callers keep the client while they use it, as an application does: google-genai 1.50
    # (our floor) closes its aiohttp session when a Client is collected, even mid-call.
    return genai.Client(api_key="k", http_options=types.HttpOptions(base_url=base))


async def test_genai_generate_content_gets_the_scripted_text(sim: str) -> None:
    client = _genai(sim)
    resp = await client.aio.models.generate_content(model="gemini-2.5-flash", contents="hi")
    assert resp.text == GREETING
    assert resp.usage_metadata is not None and resp.usage_metadata.candidates_token_count


async def test_genai_generate_content_stream_gets_the_scripted_text(sim: str) -> None:
    client = _genai(sim)
    stream = await client.aio.models.generate_content_stream(
        model="gemini-2.5-flash", contents="hi")
    pieces = [chunk.text async for chunk in stream]
    assert "".join(p or "" for p in pieces) == GREETING
    assert len(pieces) > 1


async def test_genai_function_call_round_trip(sim: str) -> None:
    client = _genai(sim)
    decl = types.FunctionDeclaration(name="get_weather", description="Weather",
                                     parameters_json_schema=WEATHER)
    config = types.GenerateContentConfig(tools=[types.Tool(function_declarations=[decl])])
    question = types.Content(role="user", parts=[types.Part(text="SCENARIO:tool Paris?")])
    first = await client.aio.models.generate_content(
        model="gemini-2.5-flash", contents=[question], config=config)
    assert first.function_calls is not None
    call = first.function_calls[0]
    assert (call.name, call.args) == ("get_weather", {"city": "Paris", "unit": "celsius"})
    assert first.candidates and first.candidates[0].content
    answer = types.Content(role="user", parts=[types.Part(function_response=types.FunctionResponse(
        name="get_weather", response={"result": "18 C"}))])
    second = await client.aio.models.generate_content(
        model="gemini-2.5-flash", contents=[question, first.candidates[0].content, answer],
        config=config)
    assert second.text is not None and "18 C" in second.text


async def test_genai_response_schema_is_parsed(sim: str) -> None:
    client = _genai(sim)
    resp = await client.aio.models.generate_content(
        model="gemini-2.5-flash", contents="SCENARIO:json",
        config=types.GenerateContentConfig(response_mime_type="application/json",
                                           response_schema=Ada))
    assert resp.parsed == Ada(name="Ada Lovelace", born=1815, tags=["math", "poetry"])


# ---- openai responses


def _openai(base: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="k", max_retries=0)


async def test_responses_create_gets_the_scripted_text(sim: str) -> None:
    resp = await _openai(sim).responses.create(model="gpt-4.1", input="hi")
    assert resp.output_text == GREETING
    assert resp.usage is not None and resp.usage.output_tokens > 0


async def test_responses_stream_helper_gets_the_final_response(sim: str) -> None:
    async with _openai(sim).responses.stream(model="gpt-4.1", input="hi") as stream:
        deltas = [e.delta async for e in stream if e.type == "response.output_text.delta"]
        final = await stream.get_final_response()
    assert "".join(deltas) == final.output_text == GREETING


async def test_responses_function_call_round_trip(sim: str) -> None:
    client = _openai(sim)
    tools: Any = [{"type": "function", "name": "get_weather", "parameters": WEATHER,
                   "strict": False}]
    items: Any = [{"role": "user", "content": "SCENARIO:tool Paris?"}]
    first = await client.responses.create(model="gpt-4.1", input=items, tools=tools)
    call = first.output[0]
    assert call.type == "function_call"
    assert (call.name, call.arguments) == ("get_weather", '{"city": "Paris", "unit": "celsius"}')
    items += [call.model_dump(exclude_none=True),
              {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}]
    second = await client.responses.create(model="gpt-4.1", input=items, tools=tools)
    assert "The tool answered: 18 C" in second.output_text


async def test_responses_parse_with_text_format(sim: str) -> None:
    resp = await _openai(sim).responses.parse(model="gpt-4.1", input="SCENARIO:json",
                                              text_format=Ada)
    assert resp.output_parsed == Ada(name="Ada Lovelace", born=1815, tags=["math", "poetry"])


# ---- our adapters read the simulator's streams

STREAMS: list[tuple[str, ApiObject, str, dict[str, Any]]] = [
    ("chat", CHAT, "/v1/chat/completions",
     {"model": "m", "stream": True, "stream_options": {"include_usage": True},
      "messages": [{"role": "user", "content": "SCENARIO:tool"}],
      "tools": [{"type": "function", "function": {"name": "get_weather"}}]}),
    ("responses", RESPONSES, "/v1/responses",
     {"model": "m", "stream": True, "input": "SCENARIO:tool",
      "tools": [{"type": "function", "name": "get_weather"}]}),
    ("anthropic", ANTHROPIC, "/v1/messages",
     {"model": "m", "stream": True, "max_tokens": 9,
      "messages": [{"role": "user", "content": "SCENARIO:tool"}],
      "tools": [{"name": "get_weather", "input_schema": WEATHER}]}),
    ("gemini", GEMINI, "/v1beta/models/m:streamGenerateContent?alt=sse",
     {"contents": [{"role": "user", "parts": [{"text": "SCENARIO:tool"}]}],
      "tools": [{"functionDeclarations": [{"name": "get_weather"}]}]}),
]


@pytest.mark.parametrize(("dialect", "adapter", "path", "body"), STREAMS,
                         ids=[s[0] for s in STREAMS])
async def test_our_adapter_reads_a_simulated_tool_call_stream(
    sim: str, dialect: str, adapter: ApiObject, path: str, body: dict[str, Any]
) -> None:
    framer, observer = Framer(), Observer()
    async with aiohttp.ClientSession() as session, session.post(sim + path, json=body) as resp:
        async for chunk in resp.content.iter_any():
            for event in framer.feed(chunk):
                observer.feed(adapter.parse_event(event))
    outcome = observer.finish(resp.status)
    assert [(c.name, c.arguments) for c in outcome.tool_calls] == [
        ("get_weather", '{"city":"Paris","unit":"celsius"}' if dialect == "gemini"
         else '{"city": "Paris", "unit": "celsius"}')]
    assert outcome.usage.input_tokens and outcome.usage.output_tokens
    assert outcome.error_type is None
