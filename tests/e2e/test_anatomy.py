"""Cost anatomy end to end: the openai SDK through the proxy to the simulator, two calls of
one run (a tool call, then its result), spans over real OTLP/HTTP and /metrics."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
from prometheus_client.parser import text_string_to_metric_families

from proxy.serve.appkeys import TEL
from tests.fixtures.otlp import otlp_receiver  # noqa: F401
from tracing import attributes as A

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": name, "description": f"{name} tool " * 20, "parameters": SCHEMA}}
         for name in ("get_weather", "send_email", "delete_all")]
KINDS = ("system", "tools", "tool_result", "history", "new")


async def test_anatomy_on_call_spans_run_span_and_metrics(otlp_receiver, make_proxy):  # noqa: F811
    proxy = await make_proxy(otlp_endpoint=otlp_receiver.endpoint, anatomy=True)
    async with openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="k",
                                  default_headers={"X-Run-Id": "anat-1"}) as c:
        messages = [{"role": "system", "content": "You are terse. " * 30},
                    {"role": "user", "content": "SCENARIO:tool weather in Paris?"}]
        first = await c.chat.completions.create(model="sim-small", messages=messages, tools=TOOLS)
        [tc] = first.choices[0].message.tool_calls
        result = json.dumps({"temp_c": 21, "sky": "clear" * 200})
        messages += [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": tc.id, "content": result}]
        await c.chat.completions.create(model="sim-small", messages=messages, tools=TOOLS,
                                        extra_headers={"X-Run-End": "true"})
    await proxy.settled()
    await asyncio.to_thread(proxy.app[TEL].force_flush)
    spans = await asyncio.to_thread(otlp_receiver.wait_for_spans, 4)

    calls = sorted((s for s in spans if s["kind"] == "SPAN_KIND_CLIENT"), key=lambda s: s["start_ns"])
    assert len(calls) == 2
    for span in calls:
        a = span["attributes"]
        kinds = [k for k in KINDS if f"spanmeter.input.{k}.tokens" in a]
        assert sum(a[f"spanmeter.input.{k}.tokens"] for k in kinds) == a[A.GEN_AI_USAGE_INPUT_TOKENS]
        assert a[A.SPANMETER_INPUT_APPROXIMATION] == "bytes"
        assert a[A.SPANMETER_INPUT_TOOLS_DECLARED] == 3
    second = calls[1]["attributes"]
    [top] = json.loads(second[A.SPANMETER_INPUT_TOP_RESULTS])
    assert top["tool"] == "get_weather" and top["call_id"] == tc.id and top["bytes"] > 1000
    assert second["spanmeter.input.tool_result.tokens"] > second["spanmeter.input.new.tokens"] if (
        "spanmeter.input.new.tokens" in second) else second["spanmeter.input.tool_result.tokens"] > 0

    run = next(s["attributes"] for s in spans
               if s["attributes"].get(A.GEN_AI_OPERATION_NAME) == A.OPERATION_INVOKE_AGENT)
    ra = json.loads(run[A.SPANMETER_RUN_ANATOMY])
    assert ra["declared"] == ["delete_all", "get_weather", "send_email"]
    assert ra["called"] == ["get_weather"]
    assert ra["unused"] == ["delete_all", "send_email"] == list(run[A.SPANMETER_RUN_TOOLS_UNUSED])
    assert ra["unused_cost_usd"] > 0
    assert ra["top_results"][0]["call_id"] == tc.id and ra["top_results"][0]["sends"] == 1
    run_input = sum(p["tokens"] for p in ra["parts"].values())
    assert run_input == run[A.GEN_AI_USAGE_INPUT_TOKENS], "the run's parts add up to its input tokens"
    assert not any(k.startswith("spanmeter.run.anatomy|") for k in run), "no raw counters on the span"

    async with aiohttp.ClientSession() as http:
        text = (await (await http.get(proxy.url + "/metrics")).read()).decode()
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
    parts = {s.labels["spanmeter_input_part"] for s in samples if s.name == "spanmeter_input_cost_total"}
    assert {"system", "tools", "tool_result"} <= parts
    tools = {s.labels["gen_ai_tool_name"] for s in samples if s.name == "spanmeter_tool_context_cost_total"}
    assert tools == {"get_weather"}
    unused = {s.labels["gen_ai_tool_name"] for s in samples
              if s.name == "spanmeter_tool_definitions_unused_cost_total"}
    assert unused == {"delete_all", "send_email"}


async def test_anatomy_off_by_default_adds_nothing(otlp_receiver, make_proxy):  # noqa: F811
    proxy = await make_proxy(otlp_endpoint=otlp_receiver.endpoint)
    async with openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="k") as c:
        await c.chat.completions.create(model="sim-small", messages=[{"role": "user", "content": "hi"}], tools=TOOLS)
    await proxy.settled()
    await asyncio.to_thread(proxy.app[TEL].force_flush)
    spans = await asyncio.to_thread(otlp_receiver.wait_for_spans, 1)
    call = next(s["attributes"] for s in spans if s["kind"] == "SPAN_KIND_CLIENT")
    assert not any(k.startswith("spanmeter.input.") for k in call)
