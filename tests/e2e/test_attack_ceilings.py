"""Trying to cross a $0.05 run ceiling and a $0.08 daily budget with every request shape.

Against a greedy provider (tests/fixtures/greedy.py) that writes the most each request
allows and bills it: 40 concurrent calls per shape over three runs, streamed and not, in
every dialect. Spend must stay within both limits, equal what the provider billed, and
the shapes spanmeter cannot bound or route must be refused with nothing forwarded.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from yarl import URL

from proxy.config import hash_key
from proxy.ops.demo import serve_on_free_port
from proxy.serve.appkeys import STORE
from tests.fixtures.greedy import GREEDY, create_greedy

KEY = "sm-attacker-key"
RUN_CEILING, DAY_BUDGET = 50_000, 80_000  # micro-USD
HI = [{"role": "user", "content": "hi"}]
GEMINI_BODY = {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]}
CHAT, RESPONSES, MESSAGES = "/v1/chat/completions", "/v1/responses", "/v1/messages"


def gemini(stream: bool) -> str:
    return ("/v1beta/models/sim-small:streamGenerateContent?alt=sse" if stream
            else "/v1beta/models/sim-small:generateContent")


# name -> (path(stream), body(stream)); every one of these may run, within the limits.
BOUNDED: dict[str, tuple[Any, Any]] = {
    "chat n=8 with max_tokens": (lambda s: CHAT, lambda s: {"model": "sim-small", "messages": HI, "n": 8,
                                                             "max_tokens": 300, "stream": s}),
    "chat n=8 without max tokens (clamped)": (lambda s: CHAT, lambda s: {"model": "sim-small", "messages": HI,
                                                                         "n": 8, "stream": s}),
    "chat max_completion_tokens above the model's cap": (
        lambda s: CHAT, lambda s: {"model": "sim-small", "messages": HI, "max_completion_tokens": 1_000_000,
                                   "stream": s}),
    "gemini candidateCount=8 with maxOutputTokens": (
        gemini, lambda s: {**GEMINI_BODY, "generationConfig": {"candidateCount": 8, "maxOutputTokens": 300}}),
    "gemini candidateCount=8 without max tokens (clamped)": (
        gemini, lambda s: {**GEMINI_BODY, "generationConfig": {"candidateCount": 8}}),
    "anthropic max_tokens far above the cap": (
        lambda s: MESSAGES, lambda s: {"model": "sim-small", "messages": HI, "max_tokens": 2**31 - 1, "stream": s}),
    "chat on a priority-enabled project, no service_tier": (
        lambda s: CHAT, lambda s: {"model": "gpt-4o", "messages": HI, "max_tokens": 300, "stream": s}),
    "anthropic writing every input token to a 1-hour cache": (
        lambda s: MESSAGES, lambda s: {"model": "sim-small", "max_tokens": 300, "stream": s, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi " * 300,
                                          "cache_control": {"type": "ephemeral", "ttl": "1h"}}]}]}),
    "responses without max_output_tokens": (
        lambda s: RESPONSES, lambda s: {"model": "sim-small", "input": "hi", "stream": s}),
    "responses continuing a stored response it saw": (
        lambda s: RESPONSES, lambda s: {"model": "sim-small", "input": "hi", "previous_response_id": "resp_0",
                                        "max_output_tokens": 200, "stream": s}),
}

# name -> (method path, body, status): refused at the door, nothing forwarded.
REFUSED: dict[str, tuple[str, dict[str, Any], int]] = {
    "a stored response it never saw": (RESPONSES, {"model": "sim-small", "input": "hi",
                                                   "previous_response_id": "resp_foreign"}, 402),
    "a stored conversation it never saw": (RESPONSES, {"model": "sim-small", "input": "hi",
                                                       "conversation": "conv_foreign"}, 402),
    "a stored prompt it never saw": (RESPONSES, {"model": "sim-small", "prompt": {"id": "pmpt_1"}}, 402),
    "a Gemini cachedContent it never saw": (gemini(False), {**GEMINI_BODY, "cachedContent": "cachedContents/x"},
                                            402),
    "an unpriced model": (CHAT, {"model": "mystery-9", "messages": HI, "max_tokens": 10}, 402),
    "max_tokens -1": (CHAT, {"model": "sim-small", "messages": HI, "max_tokens": -1}, 400),
    "max_tokens 0": (MESSAGES, {"model": "sim-small", "messages": HI, "max_tokens": 0}, 400),
    "max_tokens 1.5": (CHAT, {"model": "sim-small", "messages": HI, "max_completion_tokens": 1.5}, 400),
    "max_tokens as a string": (RESPONSES, {"model": "sim-small", "input": "hi", "max_output_tokens": "9"}, 400),
    "max_tokens 2^62": (MESSAGES, {"model": "sim-small", "messages": HI, "max_tokens": 2**62}, 400),
    "n=0": (CHAT, {"model": "sim-small", "messages": HI, "n": 0}, 400),
    "n=1000": (CHAT, {"model": "sim-small", "messages": HI, "n": 1000}, 400),
    "candidateCount -1": (gemini(False), {**GEMINI_BODY, "generationConfig": {"candidateCount": -1}}, 400),
    "a dot-segment path to a dearer model": (
        "/v1beta/models/sim-small:generateContent/../../models/sim-large:generateContent", GEMINI_BODY, 404),
    "an encoded slash": ("/v1beta/models/sim-small%2F..%2Fsim-large:generateContent", GEMINI_BODY, 404),
    "an encoded question mark": ("/v1beta/models/sim-small:generateContent%3F/../../cachedContents", GEMINI_BODY,
                                 404),
    "an encoded hash": ("/v1beta/models/sim-small:generateContent%23", GEMINI_BODY, 404),
    "a batch method": ("/v1beta/models/sim-small:batchGenerateContent", GEMINI_BODY, 404),
    "an extra segment": ("/v1beta/models/sim-small:generateContent/extra", GEMINI_BODY, 404),
    "an empty segment": ("/v1//chat/completions", {"model": "sim-small", "messages": HI}, 404),
}


@pytest.fixture
async def greedy():
    app = create_greedy()
    runner, url = await serve_on_free_port(app)
    yield url, app[GREEDY]
    await runner.cleanup()


async def _proxy(make_proxy, monkeypatch_env, greedy_url: str):
    for var in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "GEMINI_API_KEY"):
        monkeypatch_env(var, "sk-upstream")
    policy = {"runs": {"max_cost_usd": RUN_CEILING / 1e6}, "budgets": {"daily_usd": DAY_BUDGET / 1e6}}
    return await make_proxy(openai_base_url=greedy_url, anthropic_base_url=greedy_url, gemini_base_url=greedy_url,
                            tenants={"atk": {"keys": [hash_key(KEY)], "policy": policy}})


async def _post(session: aiohttp.ClientSession, url: str, body: dict[str, Any], run: str) -> int:
    headers = {"Authorization": f"Bearer {KEY}", "X-Run-Id": run, "anthropic-version": "2023-06-01"}
    # encoded=True: the path goes out exactly as written (no dot-segment folding), as a
    # hand-rolled client would send it.
    async with session.post(URL(url, encoded=True), json=body, headers=headers) as resp:
        await resp.read()
        return resp.status


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("shape", list(BOUNDED))
async def test_forty_concurrent_calls_never_cross_a_ceiling(shape, stream, make_proxy, monkeypatch_env, greedy):
    url, provider = greedy
    proxy = await _proxy(make_proxy, monkeypatch_env, url)
    path, body = BOUNDED[shape]
    async with aiohttp.ClientSession(skip_auto_headers=["Accept-Encoding"]) as session:
        if "stored response" in shape:  # the response it continues, created through spanmeter
            assert await _post(session, proxy.url + RESPONSES, {"model": "sim-small", "input": "hello",
                                                                "max_output_tokens": 100}, "seed") == 200
            await proxy.settled()
        statuses = await asyncio.gather(*(_post(session, proxy.url + path(stream), body(stream), f"r-{i % 3}")
                                          for i in range(40)))
    await proxy.settled()
    assert set(statuses) <= {200, 402}, statuses
    assert statuses.count(200) >= 1, "a bounded shape must still be served"
    store = proxy.app[STORE]
    runs = [await store.spend("atk", run_id=f"r-{i}") for i in range(3)]
    day = await store.spend("atk")
    assert max(runs) <= RUN_CEILING, runs
    assert day <= DAY_BUDGET, day
    assert provider.billed_micros == day, "spanmeter charged exactly what the provider billed"


@pytest.mark.parametrize("shape", list(REFUSED))
async def test_shapes_that_cannot_be_bounded_or_routed_are_refused_unforwarded(
        shape, make_proxy, monkeypatch_env, greedy):
    url, provider = greedy
    proxy = await _proxy(make_proxy, monkeypatch_env, url)
    path, body, status = REFUSED[shape]
    async with aiohttp.ClientSession() as session:
        statuses = await asyncio.gather(*(_post(session, proxy.url + path, body, "r-x") for _ in range(5)))
    assert statuses == [status] * 5
    assert provider.paths == [], "nothing reached the provider"
    assert await proxy.app[STORE].spend("atk") == 0


TOKEN_CEILING = 5_000


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("shape", list(BOUNDED))
async def test_forty_concurrent_calls_never_cross_a_token_ceiling(shape, stream, make_proxy, monkeypatch_env,
                                                                  greedy):
    """The greedy provider writes every token a request allows: what it is allowed is what
    the ledger held for it, so the run's tokens stay within runs.max_tokens."""
    url, _ = greedy
    for var in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "GEMINI_API_KEY"):
        monkeypatch_env(var, "sk-upstream")
    proxy = await make_proxy(openai_base_url=url, anthropic_base_url=url, gemini_base_url=url, tenants={
        "atk": {"keys": [hash_key(KEY)], "policy": {"runs": {"max_tokens": TOKEN_CEILING}}}})
    path, body = BOUNDED[shape]
    async with aiohttp.ClientSession(skip_auto_headers=["Accept-Encoding"]) as session:
        if "stored response" in shape:
            assert await _post(session, proxy.url + RESPONSES, {"model": "sim-small", "input": "hello",
                                                                "max_output_tokens": 100}, "seed") == 200
            await proxy.settled()
        statuses = await asyncio.gather(*(_post(session, proxy.url + path(stream), body(stream), "t")
                                          for _ in range(40)))
    await proxy.settled()
    assert set(statuses) <= {200, 402}, statuses
    assert 402 in statuses, "40 greedy calls cannot all fit in 5,000 tokens"
    totals = await proxy.app[STORE].run_totals("atk", "t")
    used = sum(totals.get(k, 0) for k in ("input_tokens", "output_tokens", "estimated_tokens"))
    assert 0 < used <= TOKEN_CEILING, totals
