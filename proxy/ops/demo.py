"""`spanmeter demo`: the whole thing offline, against the built-in simulated model API."""

from __future__ import annotations

import json
import secrets
import shlex
import tempfile
import time
from pathlib import Path
from typing import Any

from aiohttp import web

from proxy.app import create_app
from proxy.config import Settings
from proxy.simulator import create_simulator

__all__ = ["run_demo", "serve_on_free_port"]

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
                   "required": ["city"]}}},
    # Declared and never called: what the run's anatomy shows as paid for and unused.
    {"type": "function", "function": {
        "name": "send_email", "description": "Send an email to one or more recipients, with a subject and body",
        "parameters": {"type": "object", "properties": {"to": {"type": "array", "items": {"type": "string"}},
                                                         "subject": {"type": "string"}, "body": {"type": "string"}},
                       "required": ["to", "subject", "body"]}}},
    {"type": "function", "function": {
        "name": "search_files", "description": "Search the workspace's files for a pattern and list the matches",
        "parameters": {"type": "object", "properties": {"pattern": {"type": "string"}, "path": {"type": "string"}},
                       "required": ["pattern"]}}}]
SYSTEM = "You are a concise assistant. Use a tool when the question needs live data; answer in one sentence."


async def serve_on_free_port(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]  # the port the OS gave: aiohttp's public view of it
    return runner, f"http://127.0.0.1:{port}"


def get_weather(city: str, unit: str = "celsius") -> dict[str, Any]:
    return {"ok": True, "city": city, "temperature": 14, "unit": unit, "conditions": "light rain"}


async def run_demo(data_dir: str = ".spanmeter") -> int:
    """The demo against the simulator. Its spans go to `data_dir`/traces, where `spanmeter
    runs` reads them, so the run it shows can be drawn again afterwards; its ledger is a
    scratch one (the demo's made-up spend never mixes with a real proxy's)."""
    try:
        from openai import AsyncOpenAI
    except ImportError:
        print("The demo drives the real openai SDK: pip install 'spanmeter[demo]'")
        return 2
    run_id = f"demo-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
    with tempfile.TemporaryDirectory(prefix="spanmeter-demo-") as tmp:
        sim_runner, sim_url = await serve_on_free_port(create_simulator())
        settings = Settings(openai_base_url=sim_url, data_dir=data_dir, port=0, anatomy=True,
                            ledger_url=f"sqlite:///{Path(tmp) / 'ledger.db'}")
        proxy_runner, proxy_url = await serve_on_free_port(create_app(settings))
        print(f"simulated model API at {sim_url}\nspanmeter proxy at     {proxy_url}\n")
        client = AsyncOpenAI(base_url=f"{proxy_url}/v1", api_key="sk-demo-not-a-real-key",
                             default_headers={"X-Run-Id": run_id, "X-Agent-Name": "demo-agent"})
        try:
            await _agent_loop(client)
            await _stream(client)
            await _structured(client, run_id)
        finally:
            await client.close()
            await proxy_runner.cleanup()  # ends telemetry: spans flushed to the local file
            await sim_runner.cleanup()
    from tracing.anatomy_view import anatomy_of_spans, render_anatomy
    from tracing.viewer import render_run_tree, run_spans

    traces = Path(data_dir) / "traces"
    again = f"spanmeter runs {run_id}" + ("" if data_dir == ".spanmeter" else f" --data-dir {shlex.quote(data_dir)}")
    print(f"\nThe run, as `{again}` draws it again from {traces}:\n")
    print(render_run_tree(run_id, traces))
    for _, spans in run_spans(run_id, traces):
        ra = anatomy_of_spans(spans)
        if ra is not None:
            print("\n" + render_anatomy(ra))
    return 0


async def _agent_loop(client: Any) -> None:
    print("1. An agent loop with a tool call (chat completions, not streamed)")
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM},
                                      {"role": "user", "content": "SCENARIO:tool What is the weather in Paris?"}]
    raw = await client.chat.completions.with_raw_response.create(model="sim-small", messages=messages, tools=TOOLS)
    first = raw.parse()
    call = first.choices[0].message.tool_calls[0]
    print(f"   model asked for {call.function.name}({call.function.arguments})"
          f"  [{first.usage.prompt_tokens} in / {first.usage.completion_tokens} out tokens]")
    result = get_weather(**json.loads(call.function.arguments))
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)}]
    raw = await client.chat.completions.with_raw_response.create(model="sim-small", messages=messages, tools=TOOLS)
    final = raw.parse()
    print(f"   tool ran, result sent back; model answered: {final.choices[0].message.content!r}")
    print(f"   run id echoed by spanmeter: {raw.headers.get('x-spanmeter-run-id')}\n")


async def _stream(client: Any) -> None:
    print("2. A streamed answer (spanmeter injects include_usage upstream and hides the usage chunk)")
    raw = await client.chat.completions.with_raw_response.create(
        model="sim-small", messages=[{"role": "user", "content": "Say hello"}], stream=True)
    text = ""
    async for chunk in raw.parse():
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
    print(f"   streamed: {text!r}")
    print(f"   rewrites: {raw.headers.get('x-spanmeter-rewrites')}\n")


async def _structured(client: Any, run_id: str) -> None:
    print("3. Structured output: the model wraps JSON in a fence with trailing commas")
    fmt = {"type": "json_schema", "json_schema": {"name": "Person", "strict": True, "schema": {
        "type": "object", "additionalProperties": False, "required": ["name", "born", "tags"],
        "properties": {"name": {"type": "string"}, "born": {"type": "integer"},
                       "tags": {"type": "array", "items": {"type": "string"}}}}}}
    raw = await client.chat.completions.with_raw_response.create(
        model="sim-small", response_format=fmt, extra_headers={"X-Run-End": "true"},
        messages=[{"role": "user", "content": "SCENARIO:json_fenced Who was Ada Lovelace?"}])
    out = raw.parse()
    print(f"   content the agent received: {out.choices[0].message.content}")
    print(f"   rewrites: {raw.headers.get('x-spanmeter-rewrites')}")
    print(f"   (X-Run-End: true ended run {run_id})")
