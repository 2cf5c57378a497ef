"""Prompt-cache breakpoints spelled with JSON escapes (issue 54, item 2), through a running
proxy, against a provider that reads requests with a JSON parser (tests/fixtures/greedy.py:
it writes every input token of a request with a breakpoint to the cache, at 2x the input
rate for a 1-hour one, and answers 400 to a member twice in one object or more than four
breakpoints, as Anthropic does).

- 40 concurrent calls of one run whose 1-hour breakpoints are spelled with escapes stay
  within a $0.20 run ceiling: the reservation covers the writes the provider bills.
- A looping agent's own escaped breakpoint is left alone by automatic caching: none is
  added beside it, so the request goes as it came and is served.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from proxy.config import hash_key
from proxy.ops.demo import serve_on_free_port
from proxy.serve.appkeys import STORE
from tests.fixtures.greedy import GREEDY, Ledger, create_greedy

KEY = "sm-escaper-key"
RUN_CEILING = 200_000  # micro-USD: $0.20
TEXT = "Read the attached report and summarise it. " * 400  # ~17 KB: ~17k tokens as the provider bills

# name -> how the breakpoint's key and lifetime are spelled in the request's bytes
SPELLINGS: dict[str, dict[str, str]] = {
    "the key escaped": {'"cache_control"': '"cache\\u005fcontrol"'},
    "the 1h value escaped": {'"1h"': '"1\\u0068"'},
    "the key and the value escaped": {'"cache_control"': '"\\u0063ache_control"', '"1h"': '"\\u0031h"'},
}


def _spelled(body: dict[str, Any], spelling: dict[str, str]) -> bytes:
    text = json.dumps(body)
    for plain, escaped in spelling.items():
        assert plain in text
        text = text.replace(plain, escaped)
    return text.encode()


@pytest.fixture
async def provider() -> AsyncIterator[tuple[str, Ledger]]:
    app = create_greedy()
    runner, url = await serve_on_free_port(app)
    yield url, app[GREEDY]
    await runner.cleanup()


async def _post(session: aiohttp.ClientSession, url: str, raw: bytes, run: str) -> int:
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01", "X-Run-Id": run,
               "content-type": "application/json"}
    async with session.post(url + "/v1/messages", data=raw, headers=headers) as resp:
        await resp.read()
        return resp.status


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("spelling", list(SPELLINGS))
async def test_forty_concurrent_one_hour_writes_spelled_with_escapes_stay_within_the_ceiling(
        spelling: str, stream: bool, make_proxy, monkeypatch_env, provider) -> None:
    url, ledger = provider
    monkeypatch_env("ANTHROPIC_API_KEY", "sk-upstream")
    proxy = await make_proxy(anthropic_base_url=url, tenants={"atk": {"keys": [hash_key(KEY)], "policy": {
        "runs": {"max_cost_usd": RUN_CEILING / 1e6}}}})
    body = {"model": "sim-small", "max_tokens": 300, "stream": stream, "messages": [
        {"role": "user", "content": [{"type": "text", "text": TEXT,
                                      "cache_control": {"type": "ephemeral", "ttl": "1h"}}]}]}
    raw = _spelled(body, SPELLINGS[spelling])
    async with aiohttp.ClientSession(skip_auto_headers=["Accept-Encoding"]) as session:
        statuses = await asyncio.gather(*(_post(session, proxy.url, raw, "r") for _ in range(40)))
    await proxy.settled()
    assert set(statuses) <= {200, 402}, statuses
    assert 200 in statuses and 402 in statuses, statuses
    spent = await proxy.app[STORE].spend("atk", run_id="r")
    assert ledger.billed_micros == spent, "spanmeter charged what the provider billed"
    assert spent <= RUN_CEILING, f"spent ${spent / 1e6:.3f} under a ${RUN_CEILING / 1e6:.2f} ceiling"


async def test_a_looping_agents_escaped_breakpoint_gets_no_second_one(make_proxy, monkeypatch_env,
                                                                      provider) -> None:
    url, ledger = provider
    monkeypatch_env("ANTHROPIC_API_KEY", "sk-upstream")
    proxy = await make_proxy(anthropic_base_url=url, tenants={"atk": {"keys": [hash_key(KEY)]}})
    # The model has answered twice, and the prompt is long: automatic caching would add a
    # breakpoint on the system prompt and on the last block, which already carries one.
    body = {"model": "sim-small", "max_tokens": 300, "system": TEXT, "messages": [
        {"role": "user", "content": "go"}, {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "more"}, {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"type": "text", "text": "again", "cache_control": {"type": "ephemeral"}}]}]}
    raw = _spelled(body, SPELLINGS["the key escaped"])
    async with aiohttp.ClientSession(skip_auto_headers=["Accept-Encoding"]) as session:
        assert await _post(session, proxy.url, raw, "loop") == 200
    await proxy.settled()
    assert ledger.bodies[-1] == json.loads(raw), "the request went as the client sent it"
