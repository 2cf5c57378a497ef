"""Budgets an agent can see coming: real agents through the proxy, against the simulator.

`SCENARIO:wrap_up` is an agent's model that keeps calling its tool until a request
carries spanmeter's wrap-up note, and then answers (proxy/simulator/script.py). With
`max_llm_calls: 6` and `wrap_up_at: 0.5` the fourth call carries the note and the run
ends with an answer; without the note the same agent runs into the ceiling (402).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import openai
import pytest
from agents import Agent, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

from proxy.config import hash_key
from proxy.serve.appkeys import STORE, TEL
from proxy.simulator.script import WRAP_UP_MARK, WRAPPED_UP
from tracing.local import read_spans

KEY = "sm-wrap-up-test-key"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "step": {"type": "integer"}}}}}]


async def _proxy(make_proxy, monkeypatch_env, **runs: Any):
    monkeypatch_env("OPENAI_API_KEY", "sk-upstream")
    monkeypatch_env("ANTHROPIC_API_KEY", "sk-upstream")
    monkeypatch_env("GEMINI_API_KEY", "sk-upstream")
    return await make_proxy(tenants={"acme": {"keys": [hash_key(KEY)], "policy": {"runs": runs}}})


def _noted(sim) -> list[bool]:
    return [WRAP_UP_MARK.encode() in r.body for r in sim.received]


async def _tool_loop(client: openai.AsyncOpenAI, run: str) -> tuple[str, list[Any]]:
    """The openai SDK agent loop: call the model, run its tool calls, until it answers."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "SCENARIO:wrap_up What is the weather?"}]
    answers = []
    while True:
        raw = await client.chat.completions.with_raw_response.create(
            model="sim-small", messages=messages, tools=TOOLS, max_tokens=200, extra_headers={"X-Run-Id": run})
        answers.append(raw)
        msg = raw.parse().choices[0].message
        if not msg.tool_calls:
            return msg.content or "", answers
        messages.append(msg.model_dump(exclude_none=True))
        for call in msg.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": '{"ok": true, "temp": 14}'})


async def test_the_openai_tool_loop_gets_the_note_and_answers_within_the_ceiling(make_proxy, sim, monkeypatch_env):
    proxy = await _proxy(make_proxy, monkeypatch_env, max_llm_calls=6, wrap_up_at=0.5)
    client = openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key=KEY)
    answer, answers = await _tool_loop(client, "r-loop")
    assert answer == WRAPPED_UP
    assert len(answers) == 4, "three tool calls, then the note, then the answer"
    assert _noted(sim) == [False, False, False, True]
    headers = [a.headers for a in answers]
    assert [h["x-spanmeter-run-calls-remaining"] for h in headers] == ["5", "4", "3", "2"]
    assert "wrap_up=calls" in headers[3]["x-spanmeter-rewrites"]
    assert all("wrap_up" not in h.get("x-spanmeter-rewrites", "") for h in headers[:3])
    last = sim.last.json()["messages"]
    assert last[-1]["role"] == "user" and last[-1]["content"].startswith(
        f"{WRAP_UP_MARK}: this run has 2 model calls left after this one.")
    await proxy.settled()
    assert await proxy.app[STORE].run_calls("acme", "r-loop") == 4
    await client.close()


async def test_without_the_note_the_same_agent_runs_into_the_ceiling(make_proxy, sim, monkeypatch_env):
    proxy = await _proxy(make_proxy, monkeypatch_env, max_llm_calls=6)
    client = openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key=KEY)
    with pytest.raises(openai.APIStatusError) as ei:
        await _tool_loop(client, "r-cut")
    assert ei.value.status_code == 402
    assert len(sim.received) == 6 and not any(_noted(sim))
    await client.close()


@function_tool
def get_weather(city: str, step: int) -> str:
    """The weather in a city."""
    return json.dumps({"city": city, "temp": 14, "step": step})


def _agent(proxy) -> tuple[Agent, openai.AsyncOpenAI]:
    set_tracing_disabled(True)  # else the Agents SDK sends the key to OpenAI's trace ingest
    client = openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key=KEY, default_headers={"X-Run-Id": "r-agents"})
    return Agent(name="weather", instructions="Answer with the weather.", tools=[get_weather],
                 model=OpenAIResponsesModel("sim-small", client)), client


async def test_the_agents_runner_gets_the_note_and_ends_with_a_final_answer(make_proxy, sim, monkeypatch_env):
    proxy = await _proxy(make_proxy, monkeypatch_env, max_llm_calls=6, wrap_up_at=0.5)
    agent, client = _agent(proxy)
    result = await Runner.run(agent, "SCENARIO:wrap_up What is the weather in Paris?")
    await client.close()
    assert result.final_output == WRAPPED_UP
    assert [r.path for r in sim.received] == ["/v1/responses"] * 4
    assert _noted(sim) == [False, False, False, True]
    note = sim.last.json()["input"][-1]
    assert note["role"] == "user" and note["content"].startswith(WRAP_UP_MARK)
    await proxy.settled()
    assert await proxy.app[STORE].run_calls("acme", "r-agents") == 4


async def test_without_the_note_the_agents_runner_ends_in_a_402(make_proxy, sim, monkeypatch_env):
    proxy = await _proxy(make_proxy, monkeypatch_env, max_llm_calls=6)
    agent, client = _agent(proxy)
    with pytest.raises(openai.APIStatusError) as ei:
        await Runner.run(agent, "SCENARIO:wrap_up What is the weather in Paris?")
    await client.close()
    assert ei.value.status_code == 402 and "ceiling of 6 model calls" in ei.value.message
    assert len(sim.received) == 6


# --- every dialect, over plain HTTP ------------------------------------------------------------

_DIALECTS = {
    "chat": ("/v1/chat/completions", {"model": "sim-small", "max_tokens": 50,
                                      "messages": [{"role": "user", "content": "SCENARIO:wrap_up {braces}"}]}),
    "responses": ("/v1/responses", {"model": "sim-small", "max_output_tokens": 50,
                                    "input": [{"role": "user", "content": "SCENARIO:wrap_up {braces}"}]}),
    "messages": ("/v1/messages", {"model": "sim-small", "max_tokens": 50, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "SCENARIO:wrap_up {braces}"}]}]}),
    "gemini": ("/v1beta/models/sim-small:generateContent", {
        "contents": [{"role": "user", "parts": [{"text": "SCENARIO:wrap_up {braces}"}]}],
        "generationConfig": {"maxOutputTokens": 50}}),
}


@pytest.mark.parametrize("api", list(_DIALECTS))
async def test_each_dialect_carries_the_note_on_the_last_call_and_the_model_answers(
        api, make_proxy, sim, monkeypatch_env):
    proxy = await _proxy(make_proxy, monkeypatch_env, max_llm_calls=2, wrap_up_at=0.9)
    path, body = _DIALECTS[api]
    raw = json.dumps(body, indent=1).encode()  # spacing no serialiser would reproduce
    headers = {"Authorization": f"Bearer {KEY}", "X-Run-Id": f"r-{api}", "Content-Type": "application/json"}
    async with aiohttp.ClientSession() as http:
        async with http.post(proxy.url + path, data=raw, headers=headers) as first:
            assert first.status == 200 and "x-spanmeter-rewrites" not in first.headers
        assert sim.last.body == raw, "no note yet: the request goes byte for byte"
        async with http.post(proxy.url + path, data=raw, headers=headers) as second:
            assert second.status == 200
            assert second.headers["x-spanmeter-rewrites"] == "wrap_up=last_call"
            assert second.headers["x-spanmeter-run-calls-remaining"] == "0"
            text = await second.text()
    forwarded = sim.last.body
    assert WRAP_UP_MARK.encode() in forwarded and WRAPPED_UP.split(",")[0] in text
    cut = raw.rindex(b"{braces}") + len(b"{braces}")
    assert forwarded[:cut] == raw[:cut], "every byte before the note is the client's"
    await proxy.settled()
    await asyncio.to_thread(proxy.app[TEL].force_flush)
    spans = [s for s in read_spans(proxy.data_dir / "traces") if s["attributes"].get("spanmeter.run.id") == f"r-{api}"
             and s["name"].startswith(("chat", "generate_content"))]
    noted = [s for s in spans if s["attributes"].get("spanmeter.wrap_up.reason") == "last_call"]
    assert len(noted) == 1 and "wrap_up=last_call" in noted[0]["attributes"]["spanmeter.rewrites"]
    assert sorted(s["attributes"]["spanmeter.remaining.run_calls"] for s in spans) == [0, 1]


async def test_a_tenant_without_wrap_up_at_is_never_changed_even_when_a_request_asks(make_proxy, sim, monkeypatch_env):
    proxy = await _proxy(make_proxy, monkeypatch_env, max_llm_calls=2)
    raw = b'{"model": "sim-small",  "messages": [{"role": "user", "content": "Use {\\"a\\": 1} as is"}]}'
    headers = {"Authorization": f"Bearer {KEY}", "X-Run-Id": "r-plain", "X-Run-Wrap-Up-At": "0.1",
               "Content-Type": "application/json"}
    async with aiohttp.ClientSession() as http:
        for _ in range(2):
            async with http.post(f"{proxy.url}/v1/chat/completions", data=raw, headers=headers) as resp:
                assert resp.status == 200 and "x-spanmeter-rewrites" not in resp.headers
                assert sim.last.body == raw


async def test_a_request_header_brings_the_note_earlier(make_proxy, sim, monkeypatch_env):
    proxy = await _proxy(make_proxy, monkeypatch_env, max_llm_calls=10, wrap_up_at=0.9)
    client = openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key=KEY,
                                default_headers={"X-Run-Wrap-Up-At": "0.2"})
    answer, answers = await _tool_loop(client, "r-early")
    assert answer == WRAPPED_UP and len(answers) == 3, "2 of 10 calls used: the third call carries the note"
    with pytest.raises(openai.BadRequestError, match="X-Run-Wrap-Up-At must be a fraction"):
        await client.chat.completions.create(model="sim-small", messages=[{"role": "user", "content": "x"}],
                                             extra_headers={"X-Run-Wrap-Up-At": "2"})
    await client.close()


async def test_remaining_budgets_are_on_every_answer(make_proxy, sim, monkeypatch_env):
    monkeypatch_env("OPENAI_API_KEY", "sk-upstream")
    policy = {"runs": {"max_llm_calls": 5, "max_cost_usd": 1.0, "max_tokens": 100_000, "max_seconds": 600},
              "budgets": {"daily_usd": 10.0, "monthly_usd": 100.0}}
    proxy = await make_proxy(tenants={"acme": {"keys": [hash_key(KEY)], "policy": policy}})
    client = openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key=KEY, default_headers={"X-Run-Id": "r-left"})
    raw = await client.chat.completions.with_raw_response.create(
        model="sim-small", messages=[{"role": "user", "content": "hi"}], max_tokens=100)
    h = raw.headers
    assert h["x-spanmeter-run-calls-remaining"] == "4"
    assert h["x-spanmeter-run-tokens-remaining"] == "100000"
    assert 599 < float(h["x-spanmeter-run-seconds-remaining"]) <= 600
    cost = float(h["x-spanmeter-run-cost-remaining-usd"])
    assert 0.99 < cost < 1.0, "after this call's worst case"
    assert float(h["x-spanmeter-budget-day-remaining-usd"]) == pytest.approx(9 + cost, abs=1e-6)
    assert float(h["x-spanmeter-budget-month-remaining-usd"]) == pytest.approx(99 + cost, abs=1e-6)
    await proxy.settled()
    second = await client.chat.completions.with_raw_response.create(
        model="sim-small", messages=[{"role": "user", "content": "hi"}], max_tokens=100)
    tokens = int(second.headers["x-spanmeter-run-tokens-remaining"])
    assert tokens == 100_000 - raw.parse().usage.total_tokens, "the settled tokens of the first call"
    await client.close()
