"""Automatic prompt caching costs no more than `off` in the agent shapes where it did
(issue 54, item 3), through a running proxy, at a fake provider that caches as Anthropic
documents (tests/fixtures/anthropic_cache.py): `off` is what the same requests cost with no
breakpoint, plain input (`uncached_micros`).

- An agent that prefills the assistant turn: the breakpoint goes on the block before the
  prefill, which the next turn keeps, not on the prefill, which it replaces.
- Turns of 11 parallel tool calls and their results (more blocks than the API's 20-block
  lookback): a second breakpoint where the previous turn wrote keeps that write read.
- A run's last call: once the agent's runs are known to stop at their third call, a third
  call writes nothing and reads what the second wrote; a run alone that ends on its third
  call is the documented worst case (README, "Prompt caching").
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anthropic
import pytest

from proxy.config import hash_key
from proxy.ops.demo import serve_on_free_port
from proxy.serve.appkeys import PREFIXES
from tests.fixtures.anthropic_cache import CACHE, PRICES, Billing, create_caching_anthropic, input_micros

MODEL = "claude-sonnet-4-6"
KEY = "sm-cache-key"
SHORT_SYSTEM = "You are a research agent."  # below the minimum: only the conversation's breakpoints pay
LONG_SYSTEM = "You are a careful research agent. " + "Follow the house rules on sources and citations. " * 120
TOOLS = [{"name": f"tool_{i}", "description": f"Tool {i}: looks things up.",
          "input_schema": {"type": "object", "properties": {"step": {"type": "integer"}}}} for i in range(3)]
RESULT = "sunny, 21 C, light wind " * 60


@pytest.fixture(autouse=True)
def _upstream_key(monkeypatch_env):
    monkeypatch_env("ANTHROPIC_API_KEY", "sk-upstream")


async def _provider(turns: int, parallel: int = 1) -> AsyncIterator[tuple[str, Billing]]:
    runner, url = await serve_on_free_port(app := create_caching_anthropic(turns=turns, parallel=parallel))
    yield url, app[CACHE]
    await runner.cleanup()


async def _agent(url: str, run: str, system: str, prefill: str | None = None) -> int:
    """The agent loop (prefilling each assistant turn with `prefill`), until a text answer."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"Find the three sources on the archive ({run})."}]
    calls = 0
    async with anthropic.AsyncAnthropic(base_url=url, api_key=KEY, default_headers={"X-Run-Id": run}) as c:
        while True:
            tail = [{"role": "assistant", "content": prefill}] if prefill else []
            msg = await c.messages.create(model=MODEL, max_tokens=512, system=system, tools=TOOLS,
                                          messages=messages + tail)
            calls += 1
            answer = [b.model_dump(exclude_none=True) for b in msg.content]
            if prefill:
                answer = [{"type": "text", "text": prefill + "}"}, *answer]
            messages.append({"role": "assistant", "content": answer})
            uses = [b for b in msg.content if b.type == "tool_use"]
            if not uses:
                return calls
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": u.id, "content": RESULT} for u in uses]})


async def _proxy(make_proxy, url: str):
    return await make_proxy(anthropic_base_url=url, tenants={"t": {"keys": [hash_key(KEY)]}})


def _each_turn_reads_the_one_before(billing: Billing) -> None:
    first = next(i for i, u in enumerate(billing.usages) if u.cache_write_tokens)
    assert all(u.cache_read_tokens for u in billing.usages[first + 1:]), [
        (u.input_tokens, u.cache_read_tokens, u.cache_write_tokens) for u in billing.usages]


def _cost(billing: Billing, calls: slice, *, cached: bool = True) -> int:
    assert PRICES.price(MODEL) is not None
    return input_micros(MODEL, billing.usages[calls], cached=cached)


async def test_an_agent_that_prefills_its_turn_pays_less_than_off(make_proxy) -> None:
    async for url, billing in _provider(turns=5):
        proxy = await _proxy(make_proxy, url)
        assert await _agent(proxy.url, "prefill", SHORT_SYSTEM, prefill="{") == 6
        billed, off = billing.billed_micros(MODEL), billing.uncached_micros(MODEL)
        assert billed < off, f"auto {billed} against off {off}: {billed / off - 1:+.1%}"
        _each_turn_reads_the_one_before(billing)
        for raw in billing.raws:
            assert b"cache_control" not in raw[raw.rindex(b'"role":"assistant"'):], "the prefill is never marked"


async def test_turns_of_eleven_parallel_calls_keep_the_previous_write_read(make_proxy) -> None:
    async for url, billing in _provider(turns=5, parallel=11):
        proxy = await _proxy(make_proxy, url)
        assert await _agent(proxy.url, "wide", SHORT_SYSTEM) == 6
        billed, off = billing.billed_micros(MODEL), billing.uncached_micros(MODEL)
        assert billed < off, f"auto {billed} against off {off}: {billed / off - 1:+.1%}"
        _each_turn_reads_the_one_before(billing)
        assert all(raw.count(b"cache_control") <= 4 for raw in billing.raws)


async def test_a_run_that_ends_on_its_third_call_pays_at_most_the_documented_bound_alone(make_proxy) -> None:
    async for url, billing in _provider(turns=2):
        proxy = await _proxy(make_proxy, url)
        assert await _agent(proxy.url, "alone", LONG_SYSTEM) == 3
        billed, off = billing.billed_micros(MODEL), billing.uncached_micros(MODEL)
        # The worst case the README states: one write nobody reads, a quarter of the last
        # call's input (+8.6% in bench/bench_cache_worst.py).
        assert billed <= off + 0.25 * _cost(billing, slice(2, 3), cached=False) + 1, (billed, off)  # +1: rounding


async def test_once_runs_stop_at_their_third_call_the_third_reads_and_writes_nothing(make_proxy) -> None:
    async for url, billing in _provider(turns=2):
        proxy = await _proxy(make_proxy, url)
        proxy.app[PREFIXES].stopped_s = 0.0  # a run quiet since its last call has ended (not waited for here)
        assert await _agent(proxy.url, "first", LONG_SYSTEM) == 3
        assert await _agent(proxy.url, "second", LONG_SYSTEM) == 3
        second = slice(3, 6)
        assert billing.usages[5].cache_write_tokens == 0, "the last call writes nothing nobody reads"
        assert billing.usages[5].cache_read_tokens, "it reads what the second call wrote"
        assert _cost(billing, second) < _cost(billing, second, cached=False)


async def test_a_run_that_stops_at_its_second_call_never_pays_for_a_third(make_proxy) -> None:
    async for url, billing in _provider(turns=1):
        proxy = await _proxy(make_proxy, url)
        proxy.app[PREFIXES].stopped_s = 0.0
        for run in ("a", "b", "c"):
            assert await _agent(proxy.url, run, SHORT_SYSTEM) == 2
        assert all(not u.cache_write_tokens for u in billing.usages), "no write: no run has a third call"
        assert billing.billed_micros(MODEL) == billing.uncached_micros(MODEL)
