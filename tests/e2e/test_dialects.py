"""Every dialect through the proxy with its real SDK, spans checked at a real OTLP receiver."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import anthropic
import openai
import pytest
from google import genai
from google.genai import types

from proxy.config import hash_key
from proxy.serve.appkeys import TEL
from tests.fixtures.otlp import otlp_receiver  # noqa: F401

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
KEY = "sm-dialect-key"


@pytest.fixture
async def traced(otlp_receiver, make_proxy):  # noqa: F811 - receiver outlives the proxy
    proxy = await make_proxy(otlp_endpoint=otlp_receiver.endpoint)

    async def spans(n: int) -> list[dict[str, Any]]:
        await proxy.settled()
        await asyncio.to_thread(proxy.app[TEL].force_flush)
        return await asyncio.to_thread(otlp_receiver.wait_for_spans, n)

    return proxy, spans


def _named(spans: list[dict[str, Any]], prefix: str) -> list[dict[str, Any]]:
    return [s for s in spans if s["name"].startswith(prefix)]


async def test_anthropic_tool_round_trip_gives_chat_and_tool_spans(traced):
    proxy, spans = traced
    client = anthropic.AsyncAnthropic(base_url=proxy.url, api_key="k", max_retries=0,
                                      default_headers={"X-Run-Id": "a-run"})
    tools: Any = [{"name": "get_weather", "description": "Weather", "input_schema": WEATHER}]
    msgs: Any = [{"role": "user", "content": "SCENARIO:tool weather in Paris?"}]
    first = await client.messages.create(model="claude-sonnet-5-5", max_tokens=200, tools=tools, messages=msgs)
    use = next(b for b in first.content if b.type == "tool_use")
    msgs += [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                           "content": '{"ok": true, "temp": 14}'}]}]
    async with client.messages.stream(model="claude-sonnet-5-5", max_tokens=200, tools=tools,
                                      messages=msgs) as stream:
        text = "".join([t async for t in stream.text_stream])
    assert "temp" in text
    got = await spans(3)
    chats = _named(got, "chat claude-sonnet-5-5")
    tool = _named(got, "execute_tool get_weather")[0]
    assert [c["kind"] for c in chats] == ["SPAN_KIND_CLIENT"] * 2
    # An unknown host: the API the client speaks, the host itself in server.address.
    assert chats[0]["attributes"]["gen_ai.provider.name"] == "anthropic"
    assert chats[0]["attributes"]["server.address"] == "127.0.0.1"
    assert chats[0]["attributes"]["gen_ai.usage.input_tokens"] > 0
    assert chats[1]["attributes"]["gen_ai.request.stream"] is True
    assert tool["kind"] == "SPAN_KIND_INTERNAL"
    assert tool["attributes"]["gen_ai.tool.call.id"] == use.id
    assert tool["attributes"]["spanmeter.tool.timing"] == "inferred"
    assert tool["trace_id"] == chats[0]["trace_id"] == chats[1]["trace_id"]
    assert chats[0]["end_ns"] <= tool["start_ns"] <= tool["end_ns"] <= chats[1]["start_ns"]
    await client.close()


async def test_gemini_function_call_round_trip_and_stream(traced):
    proxy, spans = traced
    client = genai.Client(api_key="k", http_options=types.HttpOptions(
        base_url=proxy.url, headers={"X-Run-Id": "g-run"}))
    decl = types.FunctionDeclaration(name="get_weather", description="Weather", parameters_json_schema=WEATHER)
    cfg = types.GenerateContentConfig(tools=[types.Tool(function_declarations=[decl])],
                                      automatic_function_calling=types.AutomaticFunctionCallingConfig(disable=True))
    first = await client.aio.models.generate_content(model="gemini-2.5-flash", contents="SCENARIO:tool weather?",
                                                     config=cfg)
    fc = first.function_calls[0]
    contents = [types.Content(role="user", parts=[types.Part(text="SCENARIO:tool weather?")]),
                first.candidates[0].content,
                types.Content(role="user", parts=[types.Part(function_response=types.FunctionResponse(
                    name=fc.name, id=fc.id, response={"result": {"ok": True, "temp": 14}}))])]
    text = ""
    async for chunk in await client.aio.models.generate_content_stream(
            model="gemini-2.5-flash", contents=contents, config=cfg):
        text += chunk.text or ""
    assert "temp" in text
    got = await spans(3)
    gen = _named(got, "generate_content gemini-2.5-flash")
    assert len(gen) == 2 and gen[1]["attributes"]["gen_ai.request.stream"] is True
    assert gen[0]["attributes"]["gen_ai.operation.name"] == "generate_content"
    assert _named(got, "execute_tool get_weather")


async def test_openai_responses_create_stream_and_function_call(traced):
    proxy, spans = traced
    client = openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="k", max_retries=0,
                                default_headers={"X-Run-Id": "r-run"})
    tools: Any = [{"type": "function", "name": "get_weather", "description": "Weather",
                   "parameters": WEATHER, "strict": False}]
    first = await client.responses.create(model="gpt-5", input="SCENARIO:tool weather?", tools=tools)
    call = next(o for o in first.output if o.type == "function_call")
    inputs: Any = [{"role": "user", "content": "SCENARIO:tool weather?"}, call.model_dump(exclude_none=True),
                   {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 14}'}]
    async with client.responses.stream(model="gpt-5", input=inputs, tools=tools) as stream:
        final = await stream.get_final_response()
    assert "temp" in final.output_text
    got = await spans(3)
    chats = _named(got, "chat gpt-5")
    assert len(chats) == 2
    assert chats[1]["attributes"]["gen_ai.usage.output_tokens"] > 0
    assert _named(got, "execute_tool get_weather")[0]["attributes"]["gen_ai.tool.call.id"] == call.call_id


@pytest.mark.parametrize("dialect", ["anthropic", "gemini", "responses"])
async def test_each_sdk_raises_spanmeters_message(make_proxy, monkeypatch_env, dialect):
    proxy = await make_proxy(tenants={"acme": {"keys": [hash_key(KEY)]}})
    expected = "not a spanmeter key"
    if dialect == "anthropic":
        with pytest.raises(anthropic.AuthenticationError) as ei:
            await anthropic.AsyncAnthropic(base_url=proxy.url, api_key="bad", max_retries=0).messages.create(
                model="claude-sonnet-5-5", max_tokens=10, messages=[{"role": "user", "content": "hi"}])
        assert expected in str(ei.value)
    elif dialect == "gemini":
        client = genai.Client(api_key="bad", http_options=types.HttpOptions(base_url=proxy.url))
        with pytest.raises(genai.errors.ClientError) as ei:
            await client.aio.models.generate_content(model="gemini-2.5-flash", contents="hi")
        assert ei.value.code == 401 and expected in str(ei.value)
    else:
        with pytest.raises(openai.AuthenticationError) as ei:
            await openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="bad", max_retries=0).responses.create(
                model="gpt-5", input="hi")
        assert expected in str(ei.value)


async def test_anthropic_ceiling_refusal_is_payment_required(make_proxy, monkeypatch_env):
    monkeypatch_env("ANTHROPIC_API_KEY", "sk-ant-upstream")
    proxy = await make_proxy(tenants={"acme": {"keys": [hash_key(KEY)], "policy": {"runs": {"max_llm_calls": 1}}}})
    client = anthropic.AsyncAnthropic(base_url=proxy.url, api_key=KEY, default_headers={"X-Run-Id": "cap"})
    await client.messages.create(model="claude-sonnet-5-5", max_tokens=10, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(anthropic.PaymentRequiredError) as ei:
        await client.messages.create(model="claude-sonnet-5-5", max_tokens=10,
                                     messages=[{"role": "user", "content": "hi"}])
    assert "ceiling of 1 model call (tenant setting runs.max_llm_calls)" in str(ei.value)
    await client.close()


async def test_content_is_captured_only_when_opted_in_and_a_tenant_can_lower_it(otlp_receiver, make_proxy,  # noqa: F811
                                                                              monkeypatch_env):
    monkeypatch_env("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", "SPAN_ONLY")
    monkeypatch_env("OPENAI_API_KEY", "sk-upstream-secret-123456")
    proxy = await make_proxy(otlp_endpoint=otlp_receiver.endpoint, tenants={
        "open": {"keys": [hash_key("sm-open-key-1")]},
        "private": {"keys": [hash_key("sm-private-key")], "policy": {"capture_content": "NO_CONTENT"}}})
    for key in ("sm-open-key-1", "sm-private-key"):
        async with openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key=key) as c:
            await c.chat.completions.create(model="sim-small", messages=[
                {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}])
    await proxy.settled()
    await asyncio.to_thread(proxy.app[TEL].force_flush)
    # Each call without a run id is a run of its own: a call span and a run span per tenant.
    spans = await asyncio.to_thread(otlp_receiver.wait_for_spans, 4)
    got = {s["attributes"]["spanmeter.tenant.id"]: s for s in spans if s["kind"].endswith("CLIENT")}
    captured = json.loads(got["open"]["attributes"]["gen_ai.input.messages"])
    assert captured[1] == {"role": "user", "parts": [{"type": "text", "content": "hi there"}]}
    assert "Hello!" in got["open"]["attributes"]["gen_ai.output.messages"]
    assert "gen_ai.input.messages" not in got["private"]["attributes"]
    everything = json.dumps(otlp_receiver.spans())
    assert "sk-upstream-secret-123456" not in everything and "sm-open-key-1" not in everything


async def test_tool_span_links_to_the_chat_span_that_made_the_call(traced):
    proxy, spans = traced
    client = openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="k", default_headers={"X-Run-Id": "link"})
    tools: Any = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    msgs: Any = [{"role": "user", "content": "SCENARIO:tool weather?"}]
    first = await client.chat.completions.create(model="sim-small", messages=msgs, tools=tools)
    call = first.choices[0].message.tool_calls[0]
    msgs += [first.choices[0].message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": '{"ok": false, "error": "city not found"}'}]
    await client.chat.completions.create(model="sim-small", messages=msgs, tools=tools)
    got = await spans(3)
    chat = _named(got, "chat sim-small")[0]
    tool = _named(got, "execute_tool get_weather")[0]
    assert tool["links"] == [{"trace_id": chat["trace_id"], "span_id": chat["span_id"]}]
    assert tool["status"] == "STATUS_CODE_ERROR"
    assert tool["attributes"]["spanmeter.tool.call.result.digest"] == "city not found"
    await client.close()
