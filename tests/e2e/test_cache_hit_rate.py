"""The prompt cache's hit rate, visible: per call on the span, per run on the root span and
in `spanmeter runs`, and in metrics a cached share per model and tenant can be computed from.

The simulator's `cached` scenario reports 8 input tokens read from the cache, in each
dialect's own usage shape (OpenAI `cached_tokens`, Anthropic `cache_read_input_tokens`
beside an `input_tokens` that excludes them, Gemini `cachedContentTokenCount`). sim-small
costs $1.00/M input and $0.10/M cached input, so 8 cached tokens save 8 x 0.9 = 7.2
micro-USD, 7 once each cost is rounded up to a whole micro-USD (113 instead of 120 for
100 input and 10 output tokens).
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import anthropic
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from proxy.serve.appkeys import TEL
from tests.fixtures.otlp import otlp_receiver  # noqa: F401
from tracing import attributes as A

CALLS = 3
PADDING = "the same long system context every turn " * 4  # well over 8 tokens of input
SAVED_PER_CALL_USD = 7e-6


async def _chat(url: str, run: str) -> None:
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", default_headers={"X-Run-Id": run}) as c:
        for i in range(CALLS):
            end = {"X-Run-End": "true"} if i == CALLS - 1 else {}
            text = f"SCENARIO:cached turn {i} {PADDING}"
            await c.chat.completions.create(model="sim-small", extra_headers=end,
                                            messages=[{"role": "user", "content": text}])


async def _responses(url: str, run: str) -> None:
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", default_headers={"X-Run-Id": run}) as c:
        for i in range(CALLS):
            end = {"X-Run-End": "true"} if i == CALLS - 1 else {}
            await c.responses.create(model="sim-small", input=f"SCENARIO:cached turn {i} {PADDING}", extra_headers=end)


async def _anthropic(url: str, run: str) -> None:
    async with anthropic.AsyncAnthropic(base_url=url, api_key="k", default_headers={"X-Run-Id": run}) as c:
        for i in range(CALLS):
            end = {"X-Run-End": "true"} if i == CALLS - 1 else {}
            await c.messages.create(model="sim-small", max_tokens=100, extra_headers=end,
                                    messages=[{"role": "user", "content": f"SCENARIO:cached turn {i} {PADDING}"}])


async def _gemini(url: str, run: str) -> None:
    from google import genai
    from google.genai import types

    client = genai.Client(api_key="k", http_options=types.HttpOptions(base_url=url, headers={"X-Run-Id": run}))
    for i in range(CALLS):
        end = types.HttpOptions(headers={"X-Run-End": "true"}) if i == CALLS - 1 else None
        await client.aio.models.generate_content(model="sim-small", contents=f"SCENARIO:cached turn {i} {PADDING}",
                                                 config=types.GenerateContentConfig(http_options=end))


DIALECTS = {"chat": _chat, "responses": _responses, "anthropic": _anthropic, "gemini": _gemini}


def _samples(text: str, name: str) -> list[Any]:
    return [s for f in text_string_to_metric_families(text) for s in f.samples if s.name == name]


@pytest.mark.parametrize("dialect", list(DIALECTS))
async def test_cached_share_and_savings_on_spans_run_and_metrics(otlp_receiver, make_proxy, dialect):  # noqa: F811
    proxy = await make_proxy(otlp_endpoint=otlp_receiver.endpoint)
    await DIALECTS[dialect](proxy.url, f"cache-{dialect}")
    await proxy.settled()
    await asyncio.to_thread(proxy.app[TEL].force_flush)
    spans = await asyncio.to_thread(otlp_receiver.wait_for_spans, CALLS + 1)

    calls = [s["attributes"] for s in spans if s["kind"] == "SPAN_KIND_CLIENT"]
    assert len(calls) == CALLS
    for a in calls:  # per call: the cached tokens (semconv) and what they saved
        assert a[A.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS] == 8
        assert a[A.GEN_AI_USAGE_INPUT_TOKENS] > 8, "input includes the cached tokens"
        assert a[A.SPANMETER_COST_SAVED_USD] == pytest.approx(SAVED_PER_CALL_USD)
    inputs = sum(a[A.GEN_AI_USAGE_INPUT_TOKENS] for a in calls)

    run = next(s["attributes"] for s in spans
               if s["attributes"].get(A.GEN_AI_OPERATION_NAME) == A.OPERATION_INVOKE_AGENT)
    assert run[A.SPANMETER_RUN_CACHE_READ_INPUT_TOKENS] == 8 * CALLS
    assert run[A.GEN_AI_USAGE_INPUT_TOKENS] == inputs  # the run's totals, as invoke_agent carries them
    assert run[A.SPANMETER_RUN_CACHE_READ_SHARE] == pytest.approx(8 * CALLS / inputs)
    assert run[A.SPANMETER_RUN_COST_SAVED_USD] == pytest.approx(SAVED_PER_CALL_USD * CALLS)

    async with aiohttp.ClientSession() as http:
        text = (await (await http.get(proxy.url + "/metrics")).read()).decode()
    read = _samples(text, "spanmeter_cache_input_tokens_total")
    assert {s.labels["spanmeter_cache_operation"] for s in read} == {"read"}
    assert all(s.labels["gen_ai_request_model"] == "sim-small" and "spanmeter_tenant_id" in s.labels for s in read)
    assert sum(s.value for s in read) == 8 * CALLS
    input_sum = sum(s.value for s in _samples(text, "gen_ai_client_token_usage_sum")
                    if s.labels["gen_ai_token_type"] == "input")
    assert input_sum == inputs, "the share's denominator counts the same calls"
    saved = _samples(text, "spanmeter_cost_saved_total")
    assert sum(s.value for s in saved) == pytest.approx(SAVED_PER_CALL_USD * CALLS)
    assert not any("run" in label for s in read + saved for label in s.labels), "no per-run labels"


async def test_a_call_that_reads_no_cache_still_has_a_share_of_zero(make_proxy):
    proxy = await make_proxy()
    async with openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="k") as c:
        await c.chat.completions.create(model="sim-small", messages=[{"role": "user", "content": "hello"}])
    await proxy.settled()
    async with aiohttp.ClientSession() as http:
        text = (await (await http.get(proxy.url + "/metrics")).read()).decode()
    [read] = _samples(text, "spanmeter_cache_input_tokens_total")
    assert read.value == 0 and read.labels["spanmeter_cache_operation"] == "read"
    assert not _samples(text, "spanmeter_cost_saved_total"), "nothing saved, nothing counted"
