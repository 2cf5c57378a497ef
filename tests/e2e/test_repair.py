"""Structured output that breaks each SDK's parser directly, and parses through spanmeter."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import anthropic
import openai
import pydantic
import pytest
from google import genai
from google.genai import types

from proxy.simulator.script import CLEAN_JSON


class Person(pydantic.BaseModel):
    name: str
    born: int
    tags: list[str]


FENCED = [{"role": "user", "content": "SCENARIO:json_fenced Who was Ada Lovelace?"}]
EXPECTED = Person(name="Ada Lovelace", born=1815, tags=["math", "poetry"])


async def test_openai_chat_parse_fails_directly_and_succeeds_through_the_proxy(sim, proxy):
    direct = openai.AsyncOpenAI(base_url=f"{sim.url}/v1", api_key="k")
    with pytest.raises(pydantic.ValidationError):
        await direct.chat.completions.parse(model="sim-small", messages=FENCED, response_format=Person)
    via = openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="k")
    raw = await via.chat.completions.with_raw_response.parse(model="sim-small", messages=FENCED,
                                                            response_format=Person)
    assert raw.parse().choices[0].message.parsed == EXPECTED
    header = raw.headers["x-spanmeter-rewrites"]
    assert header.startswith("repair=output:")
    actions = set(header.removeprefix("repair=output:").split("+"))
    assert actions == {"fence", "prose", "single_quotes", "trailing_comma"}
    await direct.close()
    await via.close()


async def test_openai_chat_stream_is_repaired_on_the_fly(sim, proxy):
    via = openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="k")
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "Person", "schema": Person.model_json_schema()}}
    stream = await via.chat.completions.create(model="sim-small", messages=FENCED, response_format=fmt, stream=True)
    pieces = [c.choices[0].delta.content or "" async for c in stream if c.choices]
    assert len([p for p in pieces if p]) > 3, "the repaired answer still streams in pieces"
    assert Person.model_validate_json("".join(pieces)) == EXPECTED
    await via.close()


async def test_openai_responses_parse_through_the_proxy(sim, proxy):
    direct = openai.AsyncOpenAI(base_url=f"{sim.url}/v1", api_key="k")
    with pytest.raises(pydantic.ValidationError):
        await direct.responses.parse(model="gpt-5", input=FENCED, text_format=Person)
    via = openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="k")
    got = await via.responses.parse(model="gpt-5", input=FENCED, text_format=Person)
    assert got.output_parsed == EXPECTED
    async with via.responses.stream(model="gpt-5", input=FENCED, text_format=Person) as stream:
        final = await stream.get_final_response()
    assert final.output_parsed == EXPECTED
    await direct.close()
    await via.close()


async def test_anthropic_messages_parse_through_the_proxy(sim, proxy):
    direct = anthropic.AsyncAnthropic(base_url=sim.url, api_key="k")
    with pytest.raises(pydantic.ValidationError):
        await direct.messages.parse(model="claude-sonnet-5-5", max_tokens=300, messages=FENCED, output_format=Person)
    via = anthropic.AsyncAnthropic(base_url=proxy.url, api_key="k")
    got = await via.messages.parse(model="claude-sonnet-5-5", max_tokens=300, messages=FENCED, output_format=Person)
    assert got.parsed_output == EXPECTED
    await direct.close()
    await via.close()


async def test_gemini_response_schema_parsed_is_not_none_through_the_proxy(sim, proxy):
    cfg = types.GenerateContentConfig(response_mime_type="application/json", response_schema=Person)
    direct = genai.Client(api_key="k", http_options=types.HttpOptions(base_url=sim.url))
    got = await direct.aio.models.generate_content(model="gemini-2.5-flash", contents=FENCED[0]["content"], config=cfg)
    assert got.parsed is None  # google-genai's silent failure
    via = genai.Client(api_key="k", http_options=types.HttpOptions(base_url=proxy.url))
    got = await via.aio.models.generate_content(model="gemini-2.5-flash", contents=FENCED[0]["content"], config=cfg)
    assert got.parsed == EXPECTED
    text = ""
    async for chunk in await via.aio.models.generate_content_stream(
            model="gemini-2.5-flash", contents=FENCED[0]["content"], config=cfg):
        text += chunk.text or ""
    assert Person.model_validate_json(text) == EXPECTED


TOOLS: Any = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
    "required": ["city"], "additionalProperties": False}}}]


@pytest.mark.parametrize("stream", [False, True])
async def test_malformed_tool_arguments_are_repaired(sim, proxy, stream):
    via = openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="k")
    msgs: Any = [{"role": "user", "content": "SCENARIO:bad_args"}]
    if not stream:
        resp = await via.chat.completions.create(model="sim-small", messages=msgs, tools=TOOLS)
        args = resp.choices[0].message.tool_calls[0].function.arguments
    else:
        args = ""
        async for c in await via.chat.completions.create(model="sim-small", messages=msgs, tools=TOOLS, stream=True):
            for tc in (c.choices[0].delta.tool_calls or []) if c.choices else []:
                args += tc.function.arguments or ""
    assert json.loads(args) == {"city": "Paris", "unit": "celsius"}
    await via.close()


async def test_plain_text_is_never_touched_even_with_tools(sim, proxy):
    body: Any = {"model": "sim-small", "messages": [{"role": "user", "content": "SCENARIO:braces"}], "tools": TOOLS}
    clients = [openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k") for url in (sim.url, proxy.url)]
    direct, via = [await c.chat.completions.with_raw_response.create(**body) for c in clients]
    assert via.http_response.content == direct.http_response.content


async def test_truncated_output_is_reported_not_completed(sim, proxy):
    via = openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="k")
    msgs: Any = [{"role": "user", "content": "SCENARIO:truncated"}]
    raw = await via.chat.completions.with_raw_response.create(
        model="sim-small", messages=msgs, response_format={"type": "json_object"})
    assert raw.parse().choices[0].message.content.endswith('"poe')
    assert "x-spanmeter-rewrites" not in raw.headers
    await via.close()


async def test_on_invalid_error_gives_a_422_naming_the_problem(make_proxy, sim):
    proxy = await make_proxy(policy={"repair": {"on_invalid": "error"}})
    via = openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="k", max_retries=0)

    class Strict(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        name: str

    with pytest.raises(openai.UnprocessableEntityError) as ei:
        await via.chat.completions.parse(model="sim-small", messages=FENCED, response_format=Strict)
    assert "does not match the schema" in ei.value.message and "born" in ei.value.message
    await via.close()


async def test_on_invalid_retry_asks_once_more_with_the_problems_fed_back(make_proxy, sim):
    proxy = await make_proxy(policy={"repair": {"on_invalid": "retry"}})
    via = openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="k", default_headers={"X-Run-Id": "retry-run"})

    class Strict(Person):
        model_config = pydantic.ConfigDict(extra="forbid")

    msgs: Any = [{"role": "user", "content": "SCENARIO:json_extra Who was Ada?"}]
    raw = await via.chat.completions.with_raw_response.parse(model="sim-small", messages=msgs, response_format=Strict)
    assert raw.parse().choices[0].message.parsed.model_dump() == EXPECTED.model_dump()
    assert "repair_retry=schema" in raw.headers["x-spanmeter-rewrites"]
    assert len(sim.received) == 2
    sent = sim.received[1].json()["messages"]
    # The answer that did not match is shown to the model again, then what was wrong with it.
    assert sent[-2] == {"role": "assistant", "content": CLEAN_JSON[:-1] + ', "nickname": "Ada"}'}
    assert "unknown field 'nickname'" in sent[-1]["content"]
    await via.close()


async def test_a_structured_stream_of_garbage_is_forwarded_not_cut(sim, proxy):
    # Junk events in a stream the proxy is repairing: forwarded as they came, never an exception.
    body = {"model": "sim-small", "stream": True, "stream_options": {"include_usage": True},
            "response_format": {"type": "json_object"},
            "messages": [{"role": "user", "content": "SCENARIO:garbage"}]}
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{sim.url}/v1/chat/completions", json=body) as r:
            direct = await r.read()
        async with s.post(f"{proxy.url}/v1/chat/completions", json=body) as r:
            assert r.status == 200
            via = await r.read()
    assert via.endswith(b"data: [DONE]\n\n") == direct.endswith(b"data: [DONE]\n\n")
    assert b"\xff\xfe" in via
