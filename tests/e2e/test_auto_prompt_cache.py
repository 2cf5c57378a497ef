"""Prompt caching for agents that never ask for it (issue 30), through the real anthropic
SDK, at a fake provider that caches as Anthropic documents (tests/fixtures/anthropic_cache.py).

A tool agent with a long system prompt and tools, and no `cache_control` of its own, runs
seven turns. spanmeter adds the breakpoints: billed input at most 60% of what the same
input costs uncached; the prefix of every turn is the previous turn's, only the rolling
marker moved; a request with a breakpoint of its own goes byte for byte; the tenant
setting `prompt_cache: off` adds nothing; the reservation covers the write premium.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import aiohttp
import anthropic
import orjson
import pytest

from proxy.config import hash_key
from proxy.ops.demo import serve_on_free_port
from proxy.providers.anthropic_cache import MARKER
from proxy.providers.splice import locate
from proxy.serve.appkeys import RUNS, STORE
from tests.fixtures.anthropic_cache import CACHE, create_caching_anthropic
from tests.reliability.dialects import local_spans
from tracing import attributes as A

MODEL = "claude-sonnet-4-6"  # 4-5 is deprecated: SDKs warn, and the suite makes warnings errors
KEY = "sm-cache-key"
SYSTEM = "You are a careful research agent. " + "Follow the house rules on sources and citations. " * 120
TOOLS = [{"name": f"tool_{i}", "description": f"Tool {i}: " + "looks things up in the archive. " * 25,
          "input_schema": {"type": "object", "properties": {"step": {"type": "integer"}}}} for i in range(3)]
MARKER_TEXT = b',"cache_control":' + orjson.dumps(MARKER)


@pytest.fixture
async def provider():
    app = create_caching_anthropic(turns=6)
    runner, url = await serve_on_free_port(app)
    yield url, app[CACHE]
    await runner.cleanup()


async def _agent(url: str, run: str, **extra: Any) -> int:
    """The agent loop: call, run the tool it asks for, hand the result back, until it answers."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Find the three sources on the archive."}]
    calls = 0
    async with anthropic.AsyncAnthropic(base_url=url, api_key=KEY, default_headers={"X-Run-Id": run}) as c:
        while True:
            msg = await c.messages.create(model=MODEL, max_tokens=512, system=SYSTEM, tools=TOOLS,
                                          messages=messages, **extra)
            calls += 1
            messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]})
            uses = [b for b in msg.content if b.type == "tool_use"]
            if not uses:
                return calls
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": u.id, "content": f"result of {u.name}: " + "row " * 40}
                for u in uses]})


@pytest.fixture(autouse=True)
def _upstream_key(monkeypatch_env):
    monkeypatch_env("ANTHROPIC_API_KEY", "sk-upstream")


async def _proxy(make_proxy, url: str, **policy: Any):
    return await make_proxy(anthropic_base_url=url, tenants={"t": {"keys": [hash_key(KEY)], "policy": policy}})


async def test_a_tool_agent_with_no_caching_of_its_own_is_billed_at_most_60_percent_of_uncached_input(
        make_proxy, provider):
    url, billing = provider
    proxy = await make_proxy(anthropic_base_url=url, run_idle_timeout_s=0.05,
                             tenants={"t": {"keys": [hash_key(KEY)], "policy": {"runs": {"max_cost_usd": 5}}}})
    assert await _agent(proxy.url, "agent") == 7
    billed, uncached = billing.billed_micros(MODEL), billing.uncached_micros(MODEL)
    print(f"billed input {billed} of {uncached} micro-USD uncached: {billed / uncached:.1%}")
    assert billed <= 0.6 * uncached, (billed, uncached)
    # A run alone waits for its third call (the agent is looping: a run that ended at its
    # second would pay the write premium and read nothing), then marks the end of its tools
    # and system prompt and the end of the conversation: two, never the API's four.
    assert [raw.count(MARKER_TEXT) for raw in billing.raws] == [0, 0, 2, 2, 2, 2, 2]
    assert all(u.cache_read_tokens for u in billing.usages[3:])
    await proxy.settled()
    assert await proxy.app[STORE].spend("t", run_id="agent") > 0
    # What caching saved is shown net of the write premium: per call, on the run span, in metrics.
    await asyncio.sleep(0.1)
    assert await proxy.app[RUNS].sweep_once() == 1
    spans = await local_spans(proxy)
    calls = [sp["attributes"] for sp in spans if sp["attributes"].get("spanmeter.run.id") == "agent"
             and sp["name"].startswith("chat")]
    premium = sum(a.get(A.SPANMETER_COST_CACHE_WRITE_PREMIUM_USD, 0) for a in calls)
    saved = sum(a.get(A.SPANMETER_COST_SAVED_USD, 0) for a in calls)
    assert 0 < premium < saved
    run = next(sp["attributes"] for sp in spans if sp["name"].startswith("invoke_agent"))
    assert run[A.SPANMETER_RUN_COST_SAVED_USD] == pytest.approx(saved)
    assert run[A.SPANMETER_RUN_COST_CACHE_WRITE_PREMIUM_USD] == pytest.approx(premium)
    assert run[A.SPANMETER_RUN_COST_CACHE_NET_SAVED_USD] == pytest.approx(saved - premium)
    async with aiohttp.ClientSession() as http:
        text = (await (await http.get(proxy.url + "/metrics")).read()).decode()
    assert 'spanmeter_cost_cache_write_premium_total{' in text and "spanmeter_cost_saved_total{" in text


async def test_the_prefix_of_each_turn_is_the_previous_turns_only_the_rolling_marker_moves(make_proxy, provider):
    url, billing = provider
    proxy = await _proxy(make_proxy, url)
    await _agent(proxy.url, "prefix")
    paths = [("system",), ("tools",), ("messages",)]
    parts = []
    for raw in billing.raws[2:]:  # the turns with the rolling breakpoint
        text = raw.decode()
        found = locate(text, paths)
        parts.append({p[0]: text[slice(*found[p])].encode() for p in paths})
    for before, after in itertools.pairwise(parts):
        assert after["system"] == before["system"] and after["tools"] == before["tools"]
        assert MARKER_TEXT in after["system"]  # the stable prefix's breakpoint, in the same bytes every turn
        old, new = (p["messages"].replace(MARKER_TEXT, b"") for p in (before, after))
        assert new.startswith(old[:-1]), "turn N+1's conversation starts with turn N's, byte for byte"


async def test_a_request_with_a_breakpoint_of_its_own_goes_byte_for_byte(make_proxy, provider):
    url, billing = provider
    proxy = await _proxy(make_proxy, url)
    body = {"model": MODEL, "max_tokens": 100, "system": [{"type": "text", "text": SYSTEM,
                                                          "cache_control": {"type": "ephemeral"}}],
            "tools": TOOLS, "messages": [{"role": "user", "content": "go"},
                                         {"role": "assistant", "content": "ok"},
                                         {"role": "user", "content": "again"}]}
    raw = orjson.dumps(body)
    async with aiohttp.ClientSession() as s, s.post(proxy.url + "/v1/messages", data=raw, headers={
            "x-api-key": KEY, "anthropic-version": "2023-06-01", "content-type": "application/json"}) as r:
        assert r.status == 200
        assert "cache_breakpoint" not in r.headers.get("x-spanmeter-rewrites", "")
    assert billing.raws[-1] == raw


async def test_the_tenant_setting_off_adds_nothing(make_proxy, provider):
    url, billing = provider
    proxy = await _proxy(make_proxy, url, prompt_cache="off")
    await _agent(proxy.url, "off")
    assert not any(MARKER_TEXT in raw for raw in billing.raws)
    assert billing.billed_micros(MODEL) == billing.uncached_micros(MODEL)


async def test_each_breakpoint_is_a_recorded_rewrite(make_proxy, provider):
    url, _ = provider
    proxy = await _proxy(make_proxy, url)
    messages = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "again"}, {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "and again"}]
    seen = []
    async with anthropic.AsyncAnthropic(base_url=proxy.url, api_key=KEY) as c:
        for _ in range(1):
            resp = await c.messages.with_raw_response.create(model=MODEL, max_tokens=100, system=SYSTEM,
                                                             tools=TOOLS, messages=messages)
            seen.append(resp.headers.get("x-spanmeter-rewrites", "").split(", "))
    for rewrites in seen:
        assert "cache_breakpoint=system" in rewrites and "cache_breakpoint=messages" in rewrites


async def test_forty_concurrent_agent_turns_never_cross_a_ceiling_with_the_writes_they_cause(
        make_proxy, monkeypatch_env):
    # The greedy provider bills every input token of a request with a breakpoint as a cache
    # write (1.25x) and every answer at its full length: the reservation must cover both.
    import asyncio

    from tests.fixtures.greedy import GREEDY, create_greedy

    app = create_greedy()
    runner, url = await serve_on_free_port(app)
    try:
        proxy = await make_proxy(anthropic_base_url=url, tenants={"t": {"keys": [hash_key(KEY)], "policy": {
            "runs": {"max_cost_usd": 0.05}, "budgets": {"daily_usd": 0.08}}}})
        body = {"model": "sim-small", "max_tokens": 300, "system": SYSTEM, "tools": TOOLS,
                "messages": [{"role": "user", "content": "go"}, {"role": "assistant", "content": "ok"},
                             {"role": "user", "content": "again"}]}

        async def one(i: int) -> int:
            async with aiohttp.ClientSession() as s, s.post(proxy.url + "/v1/messages", json=body, headers={
                    "x-api-key": KEY, "anthropic-version": "2023-06-01", "X-Run-Id": f"r-{i % 3}"}) as r:
                await r.read()
                return r.status

        statuses = await asyncio.gather(*(one(i) for i in range(40)))
        await proxy.settled()
        assert set(statuses) <= {200, 402} and 200 in statuses
        provider = app[GREEDY]
        # The breakpoints went out (the first sighting of the prefix excepted).
        assert sum(b"cache_control" in orjson.dumps(b) for b in provider.bodies) >= len(provider.bodies) - 1 > 0
        store = proxy.app[STORE]
        assert max([await store.spend("t", run_id=f"r-{i}") for i in range(3)]) <= 50_000
        assert provider.billed_micros == await store.spend("t") <= 80_000
    finally:
        await runner.cleanup()


async def test_the_stable_prefix_is_marked_once_a_second_run_sends_it(make_proxy, provider):
    # Ten one-call runs of one agent: the first two runs send the prefix unmarked and the
    # second is where it becomes shared; from then on it is written once and read.
    url, billing = provider
    proxy = await _proxy(make_proxy, url)
    async with anthropic.AsyncAnthropic(base_url=proxy.url, api_key=KEY) as c:
        for i in range(10):
            await c.messages.create(model=MODEL, max_tokens=100, system=SYSTEM, tools=TOOLS,
                                    messages=[{"role": "user", "content": f"question {i}"}],
                                    extra_headers={"X-Run-Id": f"one-{i}"})
    assert [raw.count(MARKER_TEXT) for raw in billing.raws] == [0] + [1] * 9
    assert [bool(u.cache_read_tokens) for u in billing.usages] == [False, False] + [True] * 8
    assert billing.billed_micros(MODEL) <= 0.35 * billing.uncached_micros(MODEL)


async def test_breakpoints_and_loop_guard_reminders_keep_each_turns_prefix(make_proxy, sim):
    """A stuck agent (simulator `loop`) whose prompt is above the minimum: from the third
    call the guard prefixes reminders to tool results and spanmeter adds its breakpoints.
    With the rolling marker taken out (the provider's cache ignores where a breakpoint sat
    before), every turn starts with the previous one, element by element, to the byte."""
    from tests.e2e.test_prompt_cache import READ_FILE, assert_prefix_kept, reminders

    proxy = await make_proxy()
    tools: Any = [{"name": "read_file", "description": "Reads a file. " * 40, "input_schema": READ_FILE}]
    msgs: list[Any] = [{"role": "user", "content": "SCENARIO:loop read the config"}]
    async with anthropic.AsyncAnthropic(base_url=proxy.url, api_key="k", default_headers={"X-Run-Id": "stuck"}) as c:
        for _ in range(6):
            resp = await c.messages.create(model=MODEL, max_tokens=100, system=SYSTEM, tools=tools, messages=msgs)
            use = next(b for b in resp.content if b.type == "tool_use")
            msgs += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in resp.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "same"}]}]
    turns = [r.body for r in sim.received]
    assert [reminders(t) for t in turns] == [0, 0, 0, 1, 2, 3]
    assert [t.count(MARKER_TEXT) for t in turns] == [0, 0, 2, 2, 2, 2]
    stripped = [t.replace(MARKER_TEXT, b"") for t in turns[2:]]
    # The stable prefix's marker never moves: taking it out everywhere changes no comparison.
    assert_prefix_kept(stripped, "messages")
