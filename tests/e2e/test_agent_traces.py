"""What GenAI UIs (Phoenix, Langfuse, Tempo) read off a run, per dialect, at a real OTLP receiver.

A real SDK runs an agent loop with one tool through the proxy, naming its agent and
conversation in headers; the spans are checked against tables in tests/data/tracing/:
- agent_runs.jsonl: the run as an `invoke_agent` span, conversation ids, tool definitions,
  readable summaries with and without content capture;
- repaired_output.jsonl: the model's answer and the answer the agent received after
  repair, side by side under content capture.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import openai
import pytest
from google import genai
from google.genai import types

from proxy.serve.appkeys import RUNS, TEL
from proxy.simulator.script import FENCED_JSON
from tests.fixtures.otlp import OtlpReceiver, otlp_receiver  # noqa: F401

DATA = Path(__file__).parent.parent / "data" / "tracing"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
DESCRIPTION = "Current weather in a city"
RESULT = {"temp_c": 14, "conditions": "rain"}
HEADERS = {"X-Run-Id": "trip-1", "X-Agent-Name": "weather-bot", "X-Conversation-Id": "conv-42"}
ASK = "SCENARIO:tool weather in Paris?"


def table(name: str) -> list[Any]:
    rows = [json.loads(line) for line in (DATA / name).read_text(encoding="utf-8").splitlines() if line.strip()]
    return [pytest.param(row, id=row["name"]) for row in rows]


# --- one agent loop with a tool, per dialect, through its real SDK ------------------------


async def chat_loop(url: str) -> None:
    tools: Any = [{"type": "function", "function": {"name": "get_weather", "description": DESCRIPTION,
                                                    "parameters": WEATHER}}]
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0, default_headers=HEADERS) as c:
        msgs: Any = [{"role": "user", "content": ASK}]
        first = await c.chat.completions.create(model="sim-small", messages=msgs, tools=tools)
        call = first.choices[0].message.tool_calls[0]
        msgs += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps(RESULT)}]
        await c.chat.completions.create(model="sim-small", messages=msgs, tools=tools)


async def responses_loop(url: str) -> None:
    tools: Any = [{"type": "function", "name": "get_weather", "description": DESCRIPTION, "parameters": WEATHER,
                   "strict": False}]
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0, default_headers=HEADERS) as c:
        first = await c.responses.create(model="gpt-5", input=ASK, tools=tools)
        call = next(o for o in first.output if o.type == "function_call")
        inputs: Any = [{"role": "user", "content": ASK}, call.model_dump(exclude_none=True),
                       {"type": "function_call_output", "call_id": call.call_id, "output": json.dumps(RESULT)}]
        await c.responses.create(model="gpt-5", input=inputs, tools=tools)


async def messages_loop(url: str) -> None:
    tools: Any = [{"name": "get_weather", "description": DESCRIPTION, "input_schema": WEATHER}]
    async with anthropic.AsyncAnthropic(base_url=url, api_key="k", max_retries=0, default_headers=HEADERS) as c:
        msgs: Any = [{"role": "user", "content": ASK}]
        first = await c.messages.create(model="claude-sonnet-5-5", max_tokens=200, tools=tools, messages=msgs)
        use = next(b for b in first.content if b.type == "tool_use")
        msgs += [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                               "content": json.dumps(RESULT)}]}]
        await c.messages.create(model="claude-sonnet-5-5", max_tokens=200, tools=tools, messages=msgs)


async def gemini_loop(url: str) -> None:
    client = genai.Client(api_key="k", http_options=types.HttpOptions(base_url=url, headers=HEADERS))
    decl = types.FunctionDeclaration(name="get_weather", description=DESCRIPTION, parameters_json_schema=WEATHER)
    cfg = types.GenerateContentConfig(tools=[types.Tool(function_declarations=[decl])],
                                      automatic_function_calling=types.AutomaticFunctionCallingConfig(disable=True))
    first = await client.aio.models.generate_content(model="gemini-2.5-flash", contents=ASK, config=cfg)
    fc = first.function_calls[0]
    contents = [types.Content(role="user", parts=[types.Part(text=ASK)]), first.candidates[0].content,
                types.Content(role="user", parts=[types.Part(function_response=types.FunctionResponse(
                    name=fc.name, id=fc.id, response=RESULT))])]
    await client.aio.models.generate_content(model="gemini-2.5-flash", contents=contents, config=cfg)


LOOPS: dict[str, Callable[[str], Awaitable[None]]] = {
    "chat": chat_loop, "responses": responses_loop, "messages": messages_loop, "gemini": gemini_loop}


async def exported(proxy: Any, receiver: OtlpReceiver, n: int) -> list[dict[str, Any]]:
    await proxy.settled()
    await asyncio.to_thread(proxy.app[TEL].force_flush)
    return await asyncio.to_thread(receiver.wait_for_spans, n)


def check(span: dict[str, Any], want: dict[str, Any]) -> None:
    """`attributes` equal (JSON-valued ones compared parsed), `absent` not set, `present` set."""
    got = span["attributes"]
    for key, value in want.get("attributes", {}).items():
        actual = json.loads(got[key]) if isinstance(value, list | dict) and key in got else got.get(key)
        assert actual == value, f"{span['name']}: {key} = {got.get(key)!r}, want {value!r}"
    assert not set(want.get("absent", [])) & got.keys(), f"{span['name']}: set but should not be"
    assert set(want.get("present", [])) <= got.keys(), f"{span['name']}: missing {want.get('present')}"


@pytest.mark.parametrize("case", table("agent_runs.jsonl"))
async def test_an_agent_loop_reads_as_an_agent_with_llm_and_tool_spans(otlp_receiver, make_proxy, sim,  # noqa: F811
                                                                       monkeypatch_env, case):
    monkeypatch_env("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", case["capture"])
    proxy = await make_proxy(otlp_endpoint=otlp_receiver.endpoint)
    await LOOPS[case["dialect"]](proxy.url)
    await proxy.settled()
    assert await proxy.app[RUNS].end("default", "trip-1")
    spans = await exported(proxy, otlp_receiver, 4)
    assert len(spans) == 4, [s["name"] for s in spans]

    root = next(s for s in spans if s["name"] == case["root"]["name"])
    models = sorted((s for s in spans if s["name"] == case["model"]["name"]), key=lambda s: s["start_ns"])
    (tool,) = [s for s in spans if s["name"] == case["tool"]["name"]]
    assert len(models) == 2
    # One trace, the run's span its root, every other span its child.
    assert root["kind"] == case["root"]["kind"] and root["parent_span_id"] is None
    assert all(s["trace_id"] == root["trace_id"] and s["parent_span_id"] == root["span_id"] for s in [*models, tool])

    check(root, case["root"])
    assert root["attributes"]["output.value"].startswith(case["root"]["output_starts"])
    assert root["attributes"]["gen_ai.usage.input_tokens"] == sum(
        m["attributes"]["gen_ai.usage.input_tokens"] for m in models)
    assert root["attributes"]["gen_ai.usage.output_tokens"] == sum(
        m["attributes"]["gen_ai.usage.output_tokens"] for m in models)
    for m in models:
        check(m, case["model"])
    assert models[0]["attributes"]["output.value"] == case["model"]["first_output"]
    assert re.fullmatch(r"[\d,]+ characters of prompt text" + re.escape(case["model"]["second_input_ends"]),
                        models[1]["attributes"]["input.value"]), models[1]["attributes"]["input.value"]
    check(tool, case["tool"])
    # Nothing of the caller's identity headers went to the model API.
    sent = {k.lower() for r in sim.received for k in r.headers}
    assert not sent & {"x-agent-name", "x-conversation-id", "x-run-id"}


@pytest.mark.parametrize("case", table("repaired_output.jsonl"))
async def test_the_repaired_answer_is_recorded_beside_the_models(otlp_receiver, make_proxy,  # noqa: F811
                                                                  monkeypatch_env, case):
    monkeypatch_env("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", case["capture"])
    proxy = await make_proxy(otlp_endpoint=otlp_receiver.endpoint)
    async with aiohttp.ClientSession() as s, s.post(proxy.url + case["path"], json=case["body"],
                                                    headers={"Authorization": "Bearer k"}) as r:
        assert r.status == 200, await r.text()
        await r.read()
    # A call without X-Run-Id is a run of its own: its call span and the run's invoke_agent span.
    spans = await exported(proxy, otlp_receiver, 2)
    (span,) = [s for s in spans if s["name"] == case["span"]]
    attrs = span["attributes"]
    assert attrs["output.value"] == case["output_value"]
    if case["capture"] == "NO_CONTENT":
        assert not {"gen_ai.output.messages", "spanmeter.output.messages.repaired"} & attrs.keys()
        return
    (model,) = json.loads(attrs["gen_ai.output.messages"])
    if "model_text" in case:
        raw = "".join(p["content"] for p in model["parts"] if p["type"] == "text")
        assert raw == FENCED_JSON if case["model_text"] == "fenced" else json.loads(raw) == case["model_text"]
    if "model_arguments" in case:
        assert [p["arguments"] for p in model["parts"] if p["type"] == "tool_call"] == [case["model_arguments"]]
    if "repaired_text" not in case and "repaired_arguments" not in case:
        assert "spanmeter.output.messages.repaired" not in attrs  # nothing was changed
        return
    (delivered,) = json.loads(attrs["spanmeter.output.messages.repaired"])
    assert delivered["role"] == "assistant" and delivered["finish_reason"] == model["finish_reason"]
    if "repaired_text" in case:
        text = "".join(p["content"] for p in delivered["parts"] if p["type"] == "text")
        assert json.loads(text) == case["repaired_text"]
    if "repaired_arguments" in case:
        assert [p["arguments"] for p in delivered["parts"] if p["type"] == "tool_call"] == [case["repaired_arguments"]]
