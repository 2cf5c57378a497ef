"""Cost anatomy end to end: the openai SDK through the proxy to the simulator, two calls of
one run (a tool call, then its result), spans over real OTLP/HTTP and /metrics."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import aiohttp
import openai
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from proxy.app import create_app
from proxy.config import Settings
from proxy.ops.demo import serve_on_free_port
from proxy.serve.appkeys import BACKGROUND, RUNS, SPLITS, STORE, TEL
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
        await proxy.settled()
        kept = proxy.app[SPLITS].get(("default", "anat-1"))
        assert kept is not None and kept.split.items == 2, "the run's last split is kept for its next request"
        [tc] = first.choices[0].message.tool_calls
        result = json.dumps({"temp_c": 21, "sky": "clear" * 200})
        messages += [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": tc.id, "content": result}]
        await c.chat.completions.create(model="sim-small", messages=messages, tools=TOOLS,
                                        extra_headers={"X-Run-End": "true"})
    await proxy.settled()
    assert proxy.app[SPLITS].get(("default", "anat-1")) is None, "forgotten when the run ends"
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


async def test_anatomy_turned_off_adds_nothing(otlp_receiver, make_proxy):  # noqa: F811
    """On by default; `anatomy: false` (SPANMETER_ANATOMY=false) leaves no trace of it."""
    proxy = await make_proxy(otlp_endpoint=otlp_receiver.endpoint, anatomy=False)
    async with openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="k") as c:
        await c.chat.completions.create(model="sim-small", messages=[{"role": "user", "content": "hi"}], tools=TOOLS)
    await proxy.settled()
    await asyncio.to_thread(proxy.app[TEL].force_flush)
    spans = await asyncio.to_thread(otlp_receiver.wait_for_spans, 1)
    call = next(s["attributes"] for s in spans if s["kind"] == "SPAN_KIND_CLIENT")
    assert not any(k.startswith("spanmeter.input.") for k in call)


async def _agent_run(c: openai.AsyncOpenAI, run_id: str, call_tool: bool) -> None:
    headers = {"X-Run-Id": run_id, "X-Agent-Name": "coder"}
    messages = [{"role": "system", "content": "You are terse. " * 30},
                {"role": "user", "content": ("SCENARIO:tool weather in Paris?" if call_tool else "hello")}]
    first = await c.chat.completions.create(model="sim-small", messages=messages, tools=TOOLS,
                                            extra_headers=headers | ({} if call_tool else {"X-Run-End": "true"}))
    if call_tool:
        [tc] = first.choices[0].message.tool_calls
        messages += [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": tc.id, "content": json.dumps({"sky": "clear" * 300})}]
        await c.chat.completions.create(model="sim-small", messages=messages, tools=TOOLS,
                                        extra_headers=headers | {"X-Run-End": "true"})


async def test_runs_cli_shows_a_runs_anatomy_and_the_tools_an_agent_never_calls(make_proxy):
    """`spanmeter runs RUN` (text and --json) and `spanmeter runs --agent A --unused-tools`,
    run as a user runs them, over the span files of a real proxy."""
    proxy = await make_proxy(anatomy=True)
    async with openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="k") as c:
        await _agent_run(c, "coder-1", call_tool=True)
        await _agent_run(c, "coder-2", call_tool=False)
    await proxy.settled()
    await asyncio.to_thread(proxy.app[TEL].force_flush)
    data = str(proxy.data_dir)

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "proxy", "runs", *args, "--data-dir", data],
                              capture_output=True, text=True, timeout=60)

    text, as_json, both, last, no_agent = await asyncio.gather(*(asyncio.to_thread(cli, *a) for a in (
        ("coder-1",), ("coder-1", "--json"), ("--agent", "coder", "--unused-tools", "--json"),
        ("--agent", "coder", "--unused-tools", "--limit", "1"), ("--unused-tools",))))
    assert text.returncode == 0, text.stderr
    for label in ("instructions", "tool definitions", "tool results", "earlier turns"):
        assert label in text.stdout
    assert "2 of 3 declared tools never called: delete_all, send_email" in text.stdout
    [run] = json.loads(as_json.stdout)
    ra = run["anatomy"]
    assert run["run_id"] == "coder-1" and ra["called"] == ["get_weather"]
    assert sum(p["tokens"] for p in ra["parts"].values()) == run["tokens"] - _output_tokens(proxy, "coder-1")
    assert ra["tools"]["get_weather"]["results_cost_usd"] > 0 and ra["top_results"][0]["tool"] == "get_weather"
    # Over both runs only get_weather was ever called; over the last run alone, nothing was.
    found = json.loads(both.stdout)
    assert found["runs"] == 2 and [r["tool"] for r in found["unused"]] == ["delete_all", "send_email"]
    assert all(r["runs"] == 2 and r["definitions_cost_usd"] > 0 for r in found["unused"])
    assert "3 of 3 declared tools never called in its last 1 run" in last.stdout
    assert no_agent.returncode == 2 and "--unused-tools needs --agent NAME" in no_agent.stderr


def _output_tokens(proxy, run_id: str) -> int:
    from tracing.viewer import run_spans

    [(_, spans)] = run_spans(run_id, proxy.data_dir / "traces")
    return sum(int(s["attributes"].get(A.GEN_AI_USAGE_OUTPUT_TOKENS) or 0) for s in spans if s["kind"] == "CLIENT")


async def test_a_runs_next_request_through_the_sdk_is_found_appended(make_proxy):
    """The openai SDK's next request of a run is its last one with the new messages appended,
    byte for byte: the proxy finds that on the raw bytes and sizes only the new messages."""
    proxy = await make_proxy(anatomy=True)
    key = ("default", "anat-next")
    async with openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="k",
                                  default_headers={"X-Run-Id": "anat-next"}) as c:
        messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hi"}]
        ends = []
        for turn in range(3):
            answer = await c.chat.completions.create(model="sim-small", messages=messages, tools=TOOLS)
            await proxy.settled()
            kept = proxy.app[SPLITS].get(key)
            assert kept is not None and kept.split.items == len(messages)
            ends.append(kept.split.end)
            messages += [answer.choices[0].message.model_dump(exclude_none=True),
                         {"role": "user", "content": f"and then? {turn}"}]
    assert ends[0] is None and ends[1] is not None and ends[2] is not None


# --- what the run's tool results cost reaches its totals without X-Run-End ------------------

RESULT_MICROS = "anatomy|result|get_weather|micros"


async def _two_calls(c: openai.AsyncOpenAI, run_id: str) -> str:
    """A tool call, then a call that carries its result; the run is left open."""
    headers = {"X-Run-Id": run_id}
    messages = [{"role": "system", "content": "You are terse. " * 30},
                {"role": "user", "content": "SCENARIO:tool weather in Paris?"}]
    first = await c.chat.completions.create(model="sim-small", messages=messages, tools=TOOLS, extra_headers=headers)
    [tc] = first.choices[0].message.tool_calls
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": tc.id, "content": json.dumps({"sky": "clear" * 300})}]
    await c.chat.completions.create(model="sim-small", messages=messages, tools=TOOLS, extra_headers=headers)
    return tc.id


async def test_a_run_whose_calls_pause_has_its_results_cost_in_its_totals(make_proxy):
    proxy = await make_proxy(anatomy=True)
    async with openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="k") as c:
        call_id = await _two_calls(c, "paused")
    await proxy.settled()
    store = proxy.app[STORE]
    assert RESULT_MICROS not in await store.run_totals("default", "paused"), "flushed with a pause, not per call"
    for _ in range(50):  # the chain is flushed once the run's calls pause a second
        totals = await store.run_totals("default", "paused")
        if RESULT_MICROS in totals:
            break
        await asyncio.sleep(0.1)
    assert totals[RESULT_MICROS] > 0
    assert totals[f"anatomy|top|get_weather|{call_id}|sends"] == 1
    assert proxy.app[SPLITS].get(("default", "paused")) is not None, "the run may go on: its chain is kept"


async def test_a_run_the_sweeper_ends_has_its_results_cost(make_proxy):
    proxy = await make_proxy(anatomy=True)
    async with openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="k") as c:
        await _two_calls(c, "swept")
    await proxy.settled()
    assert await proxy.app[RUNS].end("default", "swept", status="idle_timeout")
    totals = await proxy.app[STORE].run_totals("default", "swept")
    assert totals[RESULT_MICROS] > 0 and proxy.app[SPLITS].get(("default", "swept")) is None


async def test_a_proxy_that_stops_adds_its_runs_results_cost_first(sim, tmp_path):
    """Shut down mid-run: the chains' sums go to the ledger before it closes; a proxy
    started again on the same data reads them."""
    fields = {"openai_base_url": sim.url, "data_dir": str(tmp_path), "port": 0, "anatomy": True}
    app = create_app(Settings(**fields).check())
    runner, url = await serve_on_free_port(app)
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k") as c:
        await _two_calls(c, "stopped")
    await app[BACKGROUND].drain()
    await runner.cleanup()
    again = create_app(Settings(**fields).check())
    runner, _ = await serve_on_free_port(again)
    try:
        assert (await again[STORE].run_totals("default", "stopped"))[RESULT_MICROS] > 0
    finally:
        await runner.cleanup()


def _many_tools_upstream(per_answer: int) -> web.Application:
    """A chat upstream whose every answer calls `per_answer` tools no other answer named."""
    answered = 0

    async def chat(request: web.Request) -> web.Response:
        nonlocal answered
        answered += 1
        calls = [{"id": f"call_{answered}_{i}", "type": "function",
                  "function": {"name": f"tool_{answered}_{i}_" + "x" * 100, "arguments": "{}"}}
                 for i in range(per_answer)]
        return web.json_response({
            "id": f"cc-{answered}", "object": "chat.completion", "created": 1, "model": "sim-small",
            "choices": [{"index": 0, "finish_reason": "tool_calls",
                         "message": {"role": "assistant", "content": None, "tool_calls": calls}}],
            "usage": {"prompt_tokens": 50, "completion_tokens": 20, "total_tokens": 70}})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    return app


async def test_a_run_whose_answers_name_many_tools_has_bounded_attributes_and_says_what_it_folded(
        otlp_receiver, make_proxy):  # noqa: F811
    runner, url = await serve_on_free_port(_many_tools_upstream(150))
    try:
        proxy = await make_proxy(otlp_endpoint=otlp_receiver.endpoint, anatomy=True, openai_base_url=url)
        async with openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="k",
                                      default_headers={"X-Run-Id": "many-tools"}) as c:
            for last in (False, False, True):
                await c.chat.completions.create(model="sim-small", messages=[{"role": "user", "content": "go"}],
                                                tools=TOOLS, extra_headers={"X-Run-End": "true"} if last else {})
                await proxy.settled()
        await asyncio.to_thread(proxy.app[TEL].force_flush)
        for _ in range(100):
            runs = [s for s in otlp_receiver.spans() if A.SPANMETER_RUN_ANATOMY in s["attributes"]]
            if runs:
                break
            await asyncio.sleep(0.1)
    finally:
        await runner.cleanup()
    [run] = runs
    a = run["attributes"]
    size = sum(len(k) + len(json.dumps(v)) for k, v in a.items())
    assert size < 16_000, size  # 450 names made it 65 KB
    anatomy = json.loads(a[A.SPANMETER_RUN_ANATOMY])
    assert len(anatomy["tools"]) <= 33 and A.LABEL_OTHER in anatomy["tools"]
    assert len(a[A.SPANMETER_RUN_TOOLS_CALLED]) <= 32
    # What was folded is said, and nothing is lost from the counts.
    assert a[A.SPANMETER_RUN_TOOLS_FOLDED] == anatomy["folded"] > 0
    assert sum(t["calls"] for t in anatomy["tools"].values()) == 450
    assert anatomy["declared"] == ["delete_all", "get_weather", "send_email"]
