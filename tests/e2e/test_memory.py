"""What a call leaves behind in the serving process once it is answered and settled.

Serving collects the young generation only every 20,000 allocations (SPANMETER_GC_TUNING),
so whatever a call leaves in a reference cycle outlives it, often into the older
generations, which are collected far more rarely: at 64 connections of 45 KB agent turns
that was 40-60 MB of peak RSS (docs/benchmarks.md, "Memory (issue 29)"). These tests hold
the cyclic collector off while real SDKs make calls that take every hook path (a repaired
body, a held and repaired stream, a dropped usage chunk, tool calls), and then look for
the call's objects: freed by reference counting, none is left.
"""

from __future__ import annotations

import asyncio
import gc
import sqlite3
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import anthropic
import openai
import pytest
from google import genai
from google.genai import types

from proxy.providers.base import Exchange
from proxy.providers.hooks import Hooks
from proxy.providers.translator import Answer
from proxy.serve.appkeys import STORE
from tests.conftest import Proxy, Sim

PERSON: Any = {"type": "object", "properties": {"name": {"type": "string"}, "born": {"type": "integer"}},
               "required": ["name", "born"]}
FENCED = "SCENARIO:json_fenced Who was Ada Lovelace?"
TOOLS: Any = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
FORMAT: Any = {"type": "json_schema", "json_schema": {"name": "Person", "schema": PERSON}}


@pytest.fixture
def no_cyclic_collection() -> Iterator[None]:
    gc.collect()  # what earlier tests left is not this test's
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def left_over() -> dict[str, int]:
    counts: dict[str, int] = {}
    for o in gc.get_objects():
        if type(o) in (Answer, Hooks):
            counts[type(o).__name__] = counts.get(type(o).__name__, 0) + 1
    return counts


async def chat_json(proxy: Proxy) -> None:
    async with openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="k") as via:
        await via.chat.completions.create(model="sim-small", messages=[{"role": "user", "content": FENCED}],
                                          response_format=FORMAT)


async def chat_stream(proxy: Proxy) -> None:
    async with openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="k") as via:
        stream = await via.chat.completions.create(model="sim-small", messages=[{"role": "user", "content": FENCED}],
                                                   response_format=FORMAT, stream=True)
        async for _ in stream:
            pass


async def chat_tools(proxy: Proxy) -> None:
    async with openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="k") as via:
        msgs: Any = [{"role": "user", "content": "SCENARIO:bad_args"}]
        await via.chat.completions.create(model="sim-small", messages=msgs, tools=TOOLS)
        async for _ in await via.chat.completions.create(model="sim-small", messages=msgs, tools=TOOLS, stream=True):
            pass


async def anthropic_stream(proxy: Proxy) -> None:
    tool: Any = {"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}
    msgs: Any = [{"role": "user", "content": "SCENARIO:bad_args"}]
    async with anthropic.AsyncAnthropic(base_url=proxy.url, api_key="k") as via, \
            via.messages.stream(model="claude-sonnet-5-5", max_tokens=300, messages=msgs, tools=[tool]) as stream:
        await stream.get_final_message()


async def gemini_both(proxy: Proxy) -> None:
    cfg = types.GenerateContentConfig(response_mime_type="application/json", response_schema=PERSON)
    via = genai.Client(api_key="k", http_options=types.HttpOptions(base_url=proxy.url))
    await via.aio.models.generate_content(model="gemini-2.5-flash", contents=FENCED, config=cfg)
    async for _ in await via.aio.models.generate_content_stream(model="gemini-2.5-flash", contents=FENCED, config=cfg):
        pass


@pytest.mark.parametrize("calls", [chat_json, chat_stream, chat_tools, anthropic_stream, gemini_both])
async def test_an_answered_call_leaves_nothing_for_the_cyclic_collector(
        proxy: Proxy, no_cyclic_collection: None, calls: Callable[[Proxy], Awaitable[None]]) -> None:
    await calls(proxy)
    await proxy.settled()
    assert left_over() == {}, "a call's answer and hooks are kept alive by a reference cycle"


async def test_a_call_waiting_for_the_ledger_holds_neither_its_request_nor_its_answer(proxy: Proxy, sim: Sim) -> None:
    """Bookkeeping waits for the ledger after the answer is delivered; meanwhile it holds the
    call's sums, not its request (an agent turn: its bytes and parsed body) nor its answer.
    Another writer takes the ledger's SQLite file once the call is admitted (as another
    process could), so the settle waits."""
    messages: Any = [{"role": "system", "content": "x" * 20_000}, {"role": "user", "content": "SCENARIO:stall:0.5"}]
    holder = sqlite3.connect(proxy.data_dir / "ledger.db", isolation_level=None)
    try:
        async with openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="k") as via:
            call = asyncio.ensure_future(via.chat.completions.create(
                model="sim-small", messages=messages, extra_headers={"X-Run-Id": "waiting"}))
            while not sim.received and not call.done():  # forwarded: admitted
                await asyncio.sleep(0.01)
            holder.execute("BEGIN IMMEDIATE")  # the settle waits for this lock
            await call
        # The handler returns and the bookkeeping reaches the ledger, where it waits for the lock.
        for _ in range(50):
            await asyncio.sleep(0.1)
            gc.collect()  # alive means held, not garbage not yet collected
            waiting = [type(o).__name__ for o in gc.get_objects() if isinstance(o, Exchange | Answer)]
            if not waiting:
                break
        assert waiting == [], "a settle waiting for the ledger keeps the call's request or answer alive"
    finally:
        holder.rollback()
        holder.close()
    await proxy.settled()
    totals = await proxy.app[STORE].run_totals("default", "waiting")
    assert totals.get("output_tokens", 0) > 0, "and the call was settled once the ledger was free"
