"""Budget leases through the proxy (SPANMETER_LEDGER_LEASES=true, proxy/ledger/leases.py), with
the real openai SDK, on every ledger: a hot run's calls are served from a lease counted in the
ledger ahead of them, and its ceilings hold to the call."""

from __future__ import annotations

import openai
import pytest

from proxy.config import hash_key
from proxy.ledger.backends import open_store
from proxy.ledger.leases import LeasedStore
from proxy.serve.appkeys import STORE

KEY = "sm-lease-test-key"


async def _ask(client: openai.AsyncOpenAI) -> None:
    await client.chat.completions.create(model="sim-small", messages=[{"role": "user", "content": "hi"}],
                                         max_tokens=50)


async def test_a_hot_run_leases_and_stops_exactly_at_its_ceilings(make_proxy, sim, monkeypatch_env, ledger):
    monkeypatch_env("SPANMETER_LEDGER_LEASES", "true")
    monkeypatch_env("OPENAI_API_KEY", "sk-upstream")
    policy = {"runs": {"max_llm_calls": 60, "max_cost_usd": 5.0}, "budgets": {"daily_usd": 100.0}}
    proxy = await make_proxy(ledger_url=ledger, tenants={"acme": {"keys": [hash_key(KEY)], "policy": policy}})
    store = proxy.app[STORE]
    assert isinstance(store, LeasedStore)
    client = openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key=KEY, default_headers={"X-Run-Id": "hot"})
    plain = open_store(ledger, leases=False)  # what another worker reads in the same ledger
    try:
        for _ in range(30):
            await _ask(client)
        await proxy.settled()
        assert await store.run_calls("acme", "hot") == 30
        assert await plain.run_calls("acme", "hot") > 30, "the lease's calls are counted ahead of them"
        assert await plain.spend("acme", run_id="hot") >= await store.spend("acme", run_id="hot")
        for _ in range(30):
            await _ask(client)
        before = len(sim.received)
        with pytest.raises(openai.APIStatusError) as ei:
            await _ask(client)
        assert ei.value.status_code == 402 and "60 model calls" in ei.value.message
        assert len(sim.received) == before
        await proxy.settled()
        assert await plain.run_calls("acme", "hot") == 60, "the last lease was given back exactly"
        assert await plain.spend("acme", run_id="hot") == await store.spend("acme", run_id="hot") > 0
    finally:
        await client.close()
        await plain.aclose()
