"""Rate limits per tenant and per key, through the proxy with the real SDKs.

A rate-limited call is a 429 with `Retry-After` / `retry-after-ms` and OpenAI's
`x-ratelimit-*` headers, in the caller's dialect: SDKs retry it, and here that is what
should happen (a ceiling's 402 says the opposite). Per-key limits: a key's own ceilings,
budgets and rate limits hold within its tenant's.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import anthropic
import openai
import pytest
from google import genai
from google.genai import errors as genai_errors
from google.genai import types as genai_types

from proxy.config import hash_key
from proxy.pricing import PROVIDER_OVERHEAD_TOKENS
from proxy.serve.appkeys import STORE, TEL
from proxy.serve.handler import CLAMP_BYTES
from tracing.local import read_spans

KEY = "sm-rate-test-key"
LIMITED_KEY = "sm-rate-test-key-limited"



async def _proxy(make_proxy, monkeypatch_env, ledger=None, keys=None, **policy):
    for name in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "GEMINI_API_KEY"):
        monkeypatch_env(name, "sk-upstream")
    extra = {"ledger_url": ledger} if ledger else {}
    return await make_proxy(tenants={"acme": {"keys": keys or [hash_key(KEY)], "policy": policy}}, **extra)


def _ask(client: openai.AsyncOpenAI, **kw):
    return client.chat.completions.create(model="sim-small", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=20, **kw)


async def test_the_openai_sdk_retries_a_429_and_succeeds_once_the_window_gives_a_request_back(
        make_proxy, sim, monkeypatch_env, ledger):
    proxy = await _proxy(make_proxy, monkeypatch_env, ledger, rate_limits={"requests_per_minute": 60})
    hasty = openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key=KEY, max_retries=0)
    started = time.monotonic()
    results = await asyncio.gather(*(_ask(hasty) for _ in range(65)), return_exceptions=True)
    took = time.monotonic() - started
    limited = [r for r in results if isinstance(r, openai.RateLimitError)]
    assert len(limited) + len(sim.received) == 65
    # The limit, plus one request for each second the burst took on a busy machine (exactly
    # 60 of 500 at one instant: tests/ledger/test_store_contract.py).
    assert 60 <= len(sim.received) <= 60 + int(took), (len(sim.received), took)
    headers = limited[0].response.headers
    assert headers["x-should-retry"] == "true" and headers["x-ratelimit-limit-requests"] == "60"
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert 0 < int(headers["retry-after-ms"]) <= 1000 and headers["retry-after"] == "1"
    assert limited[0].code == "rate_limit_exceeded"
    assert "rate limit of 60 requests per minute (tenant setting rate_limits.requests_per_minute)" in (
        limited[0].message)
    # The patient call's first attempt must meet an empty bucket. On a busy machine the moment
    # between a refusal and the next request can be long enough to earn a request back: empty
    # the bucket until the next request is due at least 0.5 s later, and judge only a round
    # whose first attempt was answered before then (so it reached the bucket before then).
    answered: list[tuple[float, int]] = []  # the patient's attempts: when each was answered, its status

    async def note(response: Any) -> None:  # the SDK's HTTP client's response
        answered.append((time.monotonic(), response.status_code))

    due, refusals = await _empty_bucket(hasty)
    patient_refused = 0
    for _ in range(10):
        before = len(sim.received)
        answered.clear()
        http = openai.DefaultAsyncHttpxClient(event_hooks={"response": [note]})
        patient = openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key=KEY, http_client=http)  # 2 retries
        answer = await _ask(patient)
        await patient.close()
        assert answer.choices[0].message.content
        assert len(sim.received) == before + 1
        patient_refused += sum(status == 429 for _, status in answered)
        if answered[0][0] < due:
            assert [status for _, status in answered] == [429, 200], answered
            assert sim.last.headers["x-stainless-retry-count"] == "1", "refused once, then admitted on the retry"
            break
        due, more = await _empty_bucket(hasty)  # too slow to tell: again
        refusals += more
    else:
        raise AssertionError("in 10 rounds no first attempt was answered within 0.5 s of emptying the bucket")
    await proxy.settled()
    await asyncio.to_thread(proxy.app[TEL].force_flush)
    refused = [s for s in read_spans(proxy.data_dir / "traces")
               if s["attributes"].get("error.type") == "spanmeter.rate_limit_exceeded"]
    assert len(refused) == len(limited) + refusals + patient_refused, \
        "the hasty calls refused, the drains' refusals, the patient's first attempts"
    assert {s["attributes"]["spanmeter.refusal.reason"] for s in refused} == {"rate_requests"}
    await hasty.close()


async def _empty_bucket(client: openai.AsyncOpenAI) -> tuple[float, int]:
    """Ask until refused with the next request due at least 0.5 s later: (the earliest time,
    by time.monotonic, that it can be due; the refusals it took)."""
    refusals = 0
    while True:
        sent = time.monotonic()
        try:
            await _ask(client)
        except openai.RateLimitError as exc:
            refusals += 1
            wait_s = int(exc.response.headers["retry-after-ms"]) / 1000
            if wait_s >= 0.5:
                return sent + wait_s, refusals  # computed by the proxy after `sent`
            await asyncio.sleep(wait_s)


async def test_a_429_speaks_each_dialect(make_proxy, sim, monkeypatch_env):
    proxy = await _proxy(make_proxy, monkeypatch_env, rate_limits={"requests_per_minute": 1})
    oa = openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key=KEY, max_retries=0)
    await _ask(oa)
    with pytest.raises(openai.RateLimitError):
        await oa.responses.create(model="sim-small", input="hi")
    an = anthropic.AsyncAnthropic(base_url=proxy.url, api_key=KEY, max_retries=0)
    with pytest.raises(anthropic.RateLimitError) as ei:
        await an.messages.create(model="sim-small", max_tokens=20, messages=[{"role": "user", "content": "hi"}])
    assert ei.value.body["error"]["type"] == "rate_limit_error"
    assert ei.value.response.headers["x-ratelimit-reset-requests"].endswith("s")
    client = genai.Client(api_key=KEY, http_options=genai_types.HttpOptions(base_url=proxy.url))
    with pytest.raises(genai_errors.ClientError) as gi:
        await client.aio.models.generate_content(model="sim-small", contents="hi")
    assert gi.value.code == 429 and gi.value.status == "RESOURCE_EXHAUSTED"
    assert len(sim.received) == 1
    await oa.close()
    await an.close()


async def test_tokens_per_minute_count_the_input_bound_and_the_output_asked_for(make_proxy, sim, monkeypatch_env):
    body = b'{"model":"sim-small","max_tokens":100,"messages":[{"role":"user","content":"hi"}]}'
    # The input bound (bytes, the provider's overhead, room for spanmeter's own patches) and the output.
    cost = len(body) + PROVIDER_OVERHEAD_TOKENS + CLAMP_BYTES + 100
    proxy = await _proxy(make_proxy, monkeypatch_env, rate_limits={"tokens_per_minute": 2 * cost + cost // 2})
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    async with aiohttp.ClientSession() as http:
        for _ in range(2):
            async with http.post(f"{proxy.url}/v1/chat/completions", data=body, headers=headers) as resp:
                assert resp.status == 200
        async with http.post(f"{proxy.url}/v1/chat/completions", data=body, headers=headers) as resp:
            assert resp.status == 429
            assert int(resp.headers["x-ratelimit-remaining-tokens"]) in range(cost // 2, cost)
            assert f"this call counts {cost:,} tokens" in (await resp.json())["error"]["message"]
        big = body.replace(b'"max_tokens":100', b'"max_tokens":4000')
        async with http.post(f"{proxy.url}/v1/chat/completions", data=big, headers=headers) as resp:
            assert resp.status == 429 and resp.headers["x-should-retry"] == "false"
            assert "retry-after" not in resp.headers
            assert "can never be admitted" in (await resp.json())["error"]["message"]
    assert len(sim.received) == 2


async def test_a_keys_own_limits_hold_within_its_tenants(make_proxy, sim, monkeypatch_env):
    keys = [hash_key(KEY), {"hash": hash_key(LIMITED_KEY), "policy": {
        "runs": {"max_llm_calls": 2}, "rate_limits": {"requests_per_minute": 3},
        "budgets": {"daily_usd": 0.005}}}]
    proxy = await _proxy(make_proxy, monkeypatch_env, keys=keys, runs={"max_llm_calls": 10})
    limited = openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key=LIMITED_KEY, max_retries=0)
    plain = openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key=KEY, max_retries=0)
    await _ask(limited, extra_headers={"X-Run-Id": "k-1"})
    await _ask(limited, extra_headers={"X-Run-Id": "k-1"})
    with pytest.raises(openai.APIStatusError) as ei:
        await _ask(limited, extra_headers={"X-Run-Id": "k-1"})
    assert ei.value.status_code == 402 and "ceiling of 2 model calls (key setting runs.max_llm_calls)" in (
        ei.value.message)
    for _ in range(3):  # the plain key runs on under the tenant's ceiling of 10
        await _ask(plain, extra_headers={"X-Run-Id": "k-1"})
    # A long answer costs more than the key's $0.005 a day (charged in full, as reported).
    long = [{"role": "user", "content": "SCENARIO:long:3000"}]
    await limited.chat.completions.create(model="sim-small", messages=long, extra_headers={"X-Run-Id": "k-2"})
    await proxy.settled()
    day = time.strftime("%Y-%m-%d", time.gmtime())
    spent = await proxy.app[STORE].spend("acme", day=day, key_id=hash_key(LIMITED_KEY)[:8])
    assert spent > 5_000
    assert await proxy.app[STORE].spend("acme", day=day, key_id=hash_key(KEY)[:8]) < spent
    with pytest.raises(openai.APIStatusError) as ei:
        await _ask(limited, extra_headers={"X-Run-Id": "k-3"})
    assert ei.value.status_code == 402 and "daily budget of $0.005" in ei.value.message
    assert f"Key {hash_key(LIMITED_KEY)[:8]} of tenant acme" in ei.value.message
    await _ask(plain, extra_headers={"X-Run-Id": "k-3"})  # the tenant's other key is not held by it
    await limited.close()
    await plain.close()


async def test_a_keys_rate_limit_is_its_own(make_proxy, sim, monkeypatch_env):
    keys = [hash_key(KEY), {"hash": hash_key(LIMITED_KEY), "policy": {"rate_limits": {"requests_per_minute": 2}}}]
    proxy = await _proxy(make_proxy, monkeypatch_env, keys=keys, rate_limits={"requests_per_minute": 4})
    limited = openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key=LIMITED_KEY, max_retries=0)
    plain = openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key=KEY, max_retries=0)
    for _ in range(2):
        await _ask(limited)
    with pytest.raises(openai.RateLimitError, match=r"Key \w+ of tenant acme is over its rate limit of 2"):
        await _ask(limited)
    for _ in range(2):
        await _ask(plain)
    with pytest.raises(openai.RateLimitError, match="Tenant acme is over its rate limit of 4"):
        await _ask(plain)
    await limited.close()
    await plain.close()
