"""A run's calls back to back, each carrying the previous answer's tool result, as an agent
loop sends them (the real openai SDK, SQLite and real Redis).

The next call of a run is admitted as soon as the previous call's settle is ordered ahead of
it in the ledger, not necessarily done (proxy/serve/background.py). Whatever the store, the
admission must see that settle: the run's real spend (not the reservation it replaced), its
tool calls to close, its call count. Several runs go at once so that the event loop is busy
with one run's bookkeeping while another's next call arrives.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import openai
import pytest

from proxy.config import hash_key
from proxy.ledger.messages import usd
from proxy.model import Usage
from proxy.pricing import PriceTable, cost
from proxy.serve.appkeys import STORE

KEY = "sm-chain-test-key"
RUN_COST = 6_000  # micro-USD: a handful of the cost run's calls
RUN_CALLS = 5  # the calls run's own ceiling (X-Run-Max-Calls)
TOOLS: Any = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                                "parameters": {"type": "object",
                                                               "properties": {"city": {"type": "string"}}}}}]



async def _chain(proxy, run: str, max_tokens: int, **headers: str) -> tuple[list[Usage], str]:
    """An agent loop until the run is refused: the usage of every answer, and the refusal."""
    price = PriceTable.load().price("sim-small")
    assert price is not None
    usages: list[Usage] = []
    # SCENARIO:wrap_up asks for a tool with new arguments every turn (no loop guard trips).
    msgs: Any = [{"role": "user", "content": "SCENARIO:wrap_up plan my trip"}]
    async with openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key=KEY, max_retries=0,
                                  default_headers={"X-Run-Id": run, **headers}) as client:
        for _ in range(100):
            try:
                answer = await client.chat.completions.create(model="sim-small", messages=msgs, tools=TOOLS,
                                                              max_tokens=max_tokens)
            except openai.APIStatusError as exc:
                assert exc.status_code == 402, exc.message
                return usages, exc.message
            u = answer.usage
            assert u is not None
            usages.append(Usage(u.prompt_tokens, u.completion_tokens, 0))
            call = answer.choices[0].message.tool_calls[0]
            msgs += [answer.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp_c": len(msgs)})}]
    raise AssertionError(f"run {run} was never refused")


@pytest.mark.parametrize("rounds", [3])
async def test_back_to_back_calls_see_the_previous_settle(make_proxy, sim, monkeypatch_env, ledger, rounds):
    monkeypatch_env("OPENAI_API_KEY", "sk-upstream")
    policy = {"runs": {"max_cost_usd": RUN_COST / 1e6, "max_llm_calls": 40}}
    proxy = await make_proxy(ledger_url=ledger, tenants={"acme": {"keys": [hash_key(KEY)], "policy": policy}})
    price = PriceTable.load().price("sim-small")
    store = proxy.app[STORE]
    for r in range(rounds):
        # Dear calls that hit the cost ceiling, cheap ones that hit the call ceiling, at once.
        chains = [_chain(proxy, f"cost-{r}-{i}", 1000) for i in range(2)]
        chains += [_chain(proxy, f"calls-{r}-{i}", 16, **{"X-Run-Max-Calls": str(RUN_CALLS)}) for i in range(2)]
        results = await asyncio.gather(*chains)
        await proxy.settled()
        for i, (usages, refusal) in enumerate(results):
            run = f"cost-{r}-{i}" if i < 2 else f"calls-{r}-{i - 2}"
            charged = sum(cost(price, u) for u in usages)
            spend = await store.spend_detail("acme", run_id=run)
            assert (spend.settled, spend.reserved) == (charged, 0), (run, spend, charged)
            assert spend.settled <= RUN_COST
            # The refusal saw every answer's settle: what they cost, nothing still held.
            if i < 2:
                assert len(usages) >= 2, (run, refusal)
                assert f"{usd(charged)} spent and $0.00 reserved by calls in flight" in refusal, (run, refusal)
            else:
                assert len(usages) == RUN_CALLS, (run, refusal)
                assert f"ceiling of {RUN_CALLS} model calls" in refusal, (run, refusal)
            # Every tool call was closed by the request carrying its result (the refused one
            # included), so none is left open, and the run's totals count every answer.
            assert await store.tools_pending("acme", run) == [], run
            totals = await store.run_totals("acme", run)
            assert totals["model_calls"] == totals["tool_calls"] == len(usages), (run, totals)
            assert totals["cost_micros"] == charged
