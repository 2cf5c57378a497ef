"""Ceilings through the proxy with the real openai SDK: a ceiling is a ceiling."""

from __future__ import annotations

import asyncio

import openai
import pytest

from proxy.config import hash_key
from proxy.model import Usage
from proxy.pricing import PriceTable, cost
from proxy.serve.appkeys import STORE

KEY = "sm-ceiling-test-key"


async def _tenant_proxy(make_proxy, monkeypatch_env, ledger: str, **policy):
    monkeypatch_env("OPENAI_API_KEY", "sk-upstream")
    return await make_proxy(ledger_url=ledger, tenants={"acme": {"keys": [hash_key(KEY)], "policy": policy}})


def _client(proxy, run: str, **headers) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key=KEY,
                              default_headers={"X-Run-Id": run, **headers})


async def _ask(client, **kw):
    return await client.chat.completions.create(model="sim-small", messages=[{"role": "user", "content": "hi"}], **kw)


async def test_ninth_call_of_a_run_with_ceiling_8_is_refused_and_not_retried(make_proxy, sim, monkeypatch_env, ledger):
    proxy = await _tenant_proxy(make_proxy, monkeypatch_env, ledger, runs={"max_llm_calls": 8})
    client = _client(proxy, "r-42")  # default max_retries=2: a retryable status would show up as 3 attempts
    for _ in range(8):
        await _ask(client)
    before = len(sim.received)
    with pytest.raises(openai.APIStatusError) as ei:
        await _ask(client)
    assert ei.value.status_code == 402
    assert ei.value.response.headers["x-should-retry"] == "false"
    assert ei.value.message == "Error code: 402 - " + (
        "Run r-42 of tenant acme reached its ceiling of 8 model calls (tenant setting runs.max_llm_calls). "
        "The call was not forwarded and nothing was charged. Raise the ceiling for this tenant or start a new run.")
    assert len(sim.received) == before, "a refused call must never reach the upstream"
    await client.close()


async def test_parallel_calls_never_overshoot_a_run_cost_ceiling(make_proxy, sim, monkeypatch_env, ledger):
    limit_usd = 0.004
    proxy = await _tenant_proxy(make_proxy, monkeypatch_env, ledger, runs={"max_cost_usd": limit_usd})
    client = _client(proxy, "r-par", )
    results = await asyncio.gather(*(_ask(client, max_tokens=200) for _ in range(40)), return_exceptions=True)
    ok = [r for r in results if not isinstance(r, BaseException)]
    refused = [r for r in results if isinstance(r, openai.APIStatusError) and r.status_code == 402]
    assert len(ok) + len(refused) == 40
    assert ok and refused
    await proxy.settled()
    spent = await proxy.app[STORE].spend("acme", run_id="r-par")
    assert spent <= limit_usd * 1_000_000
    assert len(sim.received) == len(ok)
    await client.close()


async def test_streamed_call_without_client_usage_is_still_charged(make_proxy, sim, monkeypatch_env, ledger):
    proxy = await _tenant_proxy(make_proxy, monkeypatch_env, ledger, runs={"max_cost_usd": 1.0})
    client = _client(proxy, "r-stream")
    stream = await _ask(client, stream=True, max_tokens=100)
    chunks = [c async for c in stream]
    assert all(c.usage is None for c in chunks)
    # The upstream reported usage in the chunk spanmeter asked for and hid; charge exactly that.
    usage = sim.last.json()
    assert usage["stream_options"] == {"include_usage": True}
    await proxy.settled()
    spent = await proxy.app[STORE].spend("acme", run_id="r-stream")
    direct = await openai.AsyncOpenAI(base_url=f"{sim.url}/v1", api_key="x").chat.completions.create(
        model="sim-small", messages=[{"role": "user", "content": "hi"}], max_tokens=100)
    price = PriceTable.load().price("sim-small")
    assert spent == cost(price, Usage(direct.usage.prompt_tokens, direct.usage.completion_tokens, 0))
    await client.close()


async def test_stream_cut_before_usage_settles_at_the_reservation(make_proxy, sim, monkeypatch_env, ledger):
    proxy = await _tenant_proxy(make_proxy, monkeypatch_env, ledger, runs={"max_cost_usd": 1.0})
    client = _client(proxy, "r-cut")
    with pytest.raises(openai.APIError):
        async for _ in await client.chat.completions.create(
                model="sim-small", stream=True, max_tokens=100,
                messages=[{"role": "user", "content": "SCENARIO:reset:3"}]):
            pass
    await proxy.settled()
    spent = await proxy.app[STORE].spend("acme", run_id="r-cut")
    assert spent > 0, "unknown is not zero: a cut stream is charged its reservation"
    await client.close()


async def test_request_header_can_tighten_but_not_loosen(make_proxy, sim, monkeypatch_env, ledger):
    proxy = await _tenant_proxy(make_proxy, monkeypatch_env, ledger, runs={"max_llm_calls": 3})
    tight = _client(proxy, "r-tight", **{"X-Run-Max-Calls": "1"})
    await _ask(tight)
    with pytest.raises(openai.APIStatusError) as ei:
        await _ask(tight)
    assert "ceiling of 1 model call (request header X-Run-Max-Calls)" in ei.value.message
    assert "Raise X-Run-Max-Calls on this run's requests" in ei.value.message
    assert "for this tenant" not in ei.value.message  # the header is the knob, not the tenant's setting
    loose = _client(proxy, "r-loose", **{"X-Run-Max-Calls": "100"})
    for _ in range(3):
        await _ask(loose)
    with pytest.raises(openai.APIStatusError) as ei:
        await _ask(loose)
    assert "ceiling of 3 model calls" in ei.value.message
    await tight.close()
    await loose.close()


async def test_missing_max_tokens_is_clamped_to_the_budget_and_recorded(make_proxy, sim, monkeypatch_env, ledger):
    proxy = await _tenant_proxy(make_proxy, monkeypatch_env, ledger, runs={"max_cost_usd": 0.01})
    client = _client(proxy, "r-clamp")
    raw = await client.chat.completions.with_raw_response.create(
        model="sim-small", messages=[{"role": "user", "content": "hi"}])
    sent = sim.last.json()
    assert 16 <= sent["max_tokens"] < 4096
    assert f"max_tokens_clamp={sent['max_tokens']}" in raw.headers["x-spanmeter-rewrites"]
    await client.close()


async def test_model_without_price_is_refused_under_a_cost_ceiling(make_proxy, sim, monkeypatch_env, ledger):
    proxy = await _tenant_proxy(make_proxy, monkeypatch_env, ledger, budgets={"daily_usd": 5})
    client = _client(proxy, "r-price")
    with pytest.raises(openai.APIStatusError) as ei:
        await client.chat.completions.create(model="mystery-1", messages=[{"role": "user", "content": "hi"}])
    assert ei.value.status_code == 402
    assert "'mystery-1' has no known price" in ei.value.message and "prices:" in ei.value.message
    assert sim.received == []
    await client.close()


async def test_tenant_daily_budget_is_shared_by_all_runs(make_proxy, sim, monkeypatch_env, ledger):
    proxy = await _tenant_proxy(make_proxy, monkeypatch_env, ledger, budgets={"daily_usd": 0.002})
    refused = 0
    for i in range(20):
        client = _client(proxy, f"r-day-{i}")
        try:
            await _ask(client, max_tokens=200)
        except openai.APIStatusError as exc:
            assert exc.status_code == 402 and "budgets.daily_usd" in exc.message
            refused += 1
        await client.close()
    assert refused > 0
    await proxy.settled()
    assert await proxy.app[STORE].spend("acme", day=_today()) <= 2000


def _today() -> str:
    from datetime import UTC, datetime

    return datetime.now(UTC).strftime("%Y-%m-%d")
