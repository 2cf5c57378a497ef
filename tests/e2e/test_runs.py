"""Runs: one trace per run, a root span with totals when the run ends, and the admin API."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import openai
import pytest

from proxy.config import hash_key
from proxy.govern.runs import CALL_COUNTERS
from proxy.serve.appkeys import RUNS, STORE, TEL
from tests.fixtures.otlp import otlp_receiver  # noqa: F401
from tracing import attributes as A
from tracing.viewer import load_runs, render_run_tree

TOOLS: Any = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
ACME, BETA, ADMIN = "sm-acme-key-0001", "sm-beta-key-0002", "admin-token-xyz"


async def _flush(proxy, receiver, n):
    await proxy.settled()
    await asyncio.to_thread(proxy.app[TEL].force_flush)
    return await asyncio.to_thread(receiver.wait_for_spans, n)


async def _tool_round(client) -> None:
    msgs: Any = [{"role": "user", "content": "SCENARIO:tool weather?"}]
    first = await client.chat.completions.create(model="sim-small", messages=msgs, tools=TOOLS)
    call = first.choices[0].message.tool_calls[0]
    msgs += [first.choices[0].message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    await client.chat.completions.create(model="sim-small", messages=msgs, tools=TOOLS,
                                         extra_headers={"X-Run-End": "true"})


async def test_run_end_header_emits_the_root_span_with_totals(otlp_receiver, make_proxy):  # noqa: F811
    proxy = await make_proxy(otlp_endpoint=otlp_receiver.endpoint)
    async with openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="k",
                                  default_headers={"X-Run-Id": "run-total"}) as client:
        await _tool_round(client)
    spans = await _flush(proxy, otlp_receiver, 4)
    root = next(s for s in spans if s["name"] == "invoke_agent")
    children = [s for s in spans if s is not root]
    assert {s["name"] for s in children} == {"chat sim-small", "execute_tool get_weather"}
    assert all(s["trace_id"] == root["trace_id"] and s["parent_span_id"] == root["span_id"] for s in children)
    attrs = root["attributes"]
    assert attrs["spanmeter.run.id"] == "run-total"
    assert attrs["spanmeter.run.model_calls"] == 2 and attrs["spanmeter.run.tool_calls"] == 1
    assert attrs["gen_ai.operation.name"] == "invoke_agent"
    assert attrs["gen_ai.usage.input_tokens"] > 0 and attrs["gen_ai.usage.output_tokens"] > 0
    assert root["start_ns"] <= min(s["start_ns"] for s in children)


async def test_traceparent_joins_the_agents_trace(otlp_receiver, make_proxy):  # noqa: F811
    proxy = await make_proxy(otlp_endpoint=otlp_receiver.endpoint)
    tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    async with openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="k", default_headers={"traceparent": tp}) as c:
        await c.chat.completions.create(model="sim-small", messages=[{"role": "user", "content": "hi"}])
    (span,) = await _flush(proxy, otlp_receiver, 1)
    assert span["trace_id"] == "0af7651916cd43dd8448eb211c80319c"
    assert span["parent_span_id"] == "b7ad6b7169203331"
    assert span["attributes"]["spanmeter.run.id"] == "0af7651916cd43dd8448eb211c80319c"


async def test_unanswered_tool_call_gets_a_missing_span_when_the_run_idles_out(otlp_receiver, make_proxy):  # noqa: F811
    proxy = await make_proxy(otlp_endpoint=otlp_receiver.endpoint, run_idle_timeout_s=0.05)
    async with openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="k",
                                  default_headers={"X-Run-Id": "abandoned"}) as client:
        await client.chat.completions.create(model="sim-small", tools=TOOLS,
                                             messages=[{"role": "user", "content": "SCENARIO:tool"}])
    await proxy.settled()
    await asyncio.sleep(0.1)
    assert await proxy.app[RUNS].sweep_once() == 1
    spans = await _flush(proxy, otlp_receiver, 3)
    missing = next(s for s in spans if s["name"] == "execute_tool get_weather")
    assert missing["attributes"]["error.type"] == "tool_result_missing"
    root = next(s for s in spans if s["name"] == "invoke_agent")
    assert root["attributes"]["spanmeter.run.status"] == "idle_timeout"


async def test_run_totals_count_failed_tool_results_as_the_spans_and_the_viewer_do(otlp_receiver, make_proxy):  # noqa: F811
    """One failed model call, one failed tool result, one tool call never answered: the
    run span, the ledger's totals and `spanmeter runs` all say the same."""
    proxy = await make_proxy(otlp_endpoint=otlp_receiver.endpoint)
    async with openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="k", max_retries=0,
                                  default_headers={"X-Run-Id": "run-fails"}) as client:
        msgs: Any = [{"role": "user", "content": "SCENARIO:loop"}]
        first = await client.chat.completions.create(model="sim-small", messages=msgs, tools=TOOLS)
        call = first.choices[0].message.tool_calls[0]
        msgs += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": '{"ok": false, "error": "denied"}'}]
        await client.chat.completions.create(model="sim-small", messages=msgs, tools=TOOLS)  # a call left open
        with pytest.raises(openai.InternalServerError):
            await client.chat.completions.create(model="sim-small",
                                                 messages=[{"role": "user", "content": "SCENARIO:error:500"}])
    await proxy.settled()
    assert await proxy.app[RUNS].end("default", "run-fails")
    spans = await _flush(proxy, otlp_receiver, 6)
    tools = [s for s in spans if s["name"] == "execute_tool get_weather"]
    assert sorted(s["attributes"]["error.type"] for s in tools) == ["tool_error", "tool_result_missing"]
    attrs = next(s for s in spans if s["name"] == "invoke_agent")["attributes"]
    assert (attrs["spanmeter.run.failures"], attrs["spanmeter.run.tool_failures"],
            attrs["spanmeter.run.tool_results_missing"]) == (1, 2, 1)
    totals = await proxy.app[STORE].run_totals("default", "run-fails")
    assert (totals["failures"], totals["tool_failures"]) == (1, 2)
    [run] = load_runs(proxy.data_dir / "traces")
    assert (run.failures, run.tool_failures) == (1, 2)
    assert render_run_tree("run-fails", proxy.data_dir / "traces").splitlines()[0].endswith(
        "1 failed call  2 failed tool calls")


async def _tenants(make_proxy, monkeypatch_env, **settings):
    monkeypatch_env("OPENAI_API_KEY", "sk-upstream")
    return await make_proxy(admin_token=ADMIN, **settings, tenants={
        "acme": {"keys": [hash_key(ACME)], "policy": {"budgets": {"daily_usd": 10}}},
        "beta": {"keys": [hash_key(BETA)]}})


async def _get(url: str, token: str, method: str = "GET", **kw) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.request(
            method, url, headers={"Authorization": f"Bearer {token}"}, **kw) as r:
        return r.status, await r.json()


async def test_post_runs_end_ends_only_the_callers_own_run(make_proxy, monkeypatch_env):
    proxy = await _tenants(make_proxy, monkeypatch_env)
    for key in (ACME, BETA):  # the same run id in two tenants: two runs
        async with openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key=key,
                                      default_headers={"X-Run-Id": "shared-id"}) as c:
            await c.chat.completions.create(model="sim-small", messages=[{"role": "user", "content": "hi"}])
    assert await _get(f"{proxy.url}/runs/shared-id/end", ACME, "POST") == (200, {"run_id": "shared-id", "ended": True})
    assert await _get(f"{proxy.url}/runs/shared-id/end", ACME, "POST") == (200, {"run_id": "shared-id", "ended": False})
    assert await _get(f"{proxy.url}/runs/shared-id/end", BETA, "POST") == (200, {"run_id": "shared-id", "ended": True})


async def test_admin_api_needs_the_admin_token_and_reports_spend(make_proxy, monkeypatch_env):
    proxy = await _tenants(make_proxy, monkeypatch_env)
    async with openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key=ACME,
                                  default_headers={"X-Run-Id": "paid"}) as c:
        await c.chat.completions.create(model="sim-small", messages=[{"role": "user", "content": "hi"}])
    await proxy.settled()
    status, body = await _get(f"{proxy.url}/admin/spend?tenant=acme", ACME)
    assert status == 401 and "admin token" in body["error"]["message"]
    status, body = await _get(f"{proxy.url}/admin/spend?tenant=acme&run=paid", ADMIN)
    assert status == 200 and body["day_usd"] > 0 and body["run_usd"] == body["day_usd"] and body["run_calls"] == 1
    status, body = await _get(f"{proxy.url}/admin/spend?tenant=beta", ADMIN)
    assert body["day_usd"] == 0
    status, body = await _get(f"{proxy.url}/admin/runs?tenant=beta", ADMIN)
    assert status == 200 and body["runs"] == []


async def test_admin_budget_override_takes_effect(make_proxy, monkeypatch_env):
    proxy = await _tenants(make_proxy, monkeypatch_env)
    status, body = await _get(f"{proxy.url}/admin/budgets/acme", ADMIN)
    assert body == {"tenant": "acme", "daily_usd": 10, "monthly_usd": None, "source": "config",
                    "sources": {"daily_usd": "config", "monthly_usd": "config"},
                    "config": {"daily_usd": 10, "monthly_usd": None}}
    status, body = await _get(f"{proxy.url}/admin/budgets/acme", ADMIN, "PUT", json={"daily_usd": 0.000001})
    assert status == 200 and body["source"] == "admin"
    async with openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key=ACME, max_retries=0) as c:
        with pytest.raises(openai.APIStatusError) as ei:
            await c.chat.completions.create(model="sim-small", messages=[{"role": "user", "content": "hi"}])
    assert ei.value.status_code == 402 and "daily" in ei.value.message


async def test_admin_api_is_off_without_a_token(proxy):
    status, body = await _get(f"{proxy.url}/admin/tenants", "anything")
    assert status == 401 and "SPANMETER_ADMIN_TOKEN" in body["error"]["message"]


async def test_a_run_reads_whole_though_its_calls_store_only_what_they_add(otlp_receiver, make_proxy,  # noqa: F811
                                                                         monkeypatch_env):
    # Calls that add zero to a counter (no tool call, no failure, no cache) do not write it:
    # a row on every call. The run's span and the admin API still show every counter.
    proxy = await _tenants(make_proxy, monkeypatch_env, otlp_endpoint=otlp_receiver.endpoint)
    async with openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key=ACME,
                                  default_headers={"X-Run-Id": "quiet"}) as c:
        for _ in range(2):
            await c.chat.completions.create(model="sim-small", messages=[{"role": "user", "content": "hi"}])
    await proxy.settled()
    stored = await proxy.app[STORE].run_totals("acme", "quiet")
    assert stored["model_calls"] == 2 and "repairs" not in stored and "failures" not in stored
    status, body = await _get(f"{proxy.url}/admin/runs/acme/quiet", ADMIN)
    assert status == 200
    totals = body["totals"]
    assert set(CALL_COUNTERS) <= set(totals)
    assert totals["model_calls"] == 2 and totals["repairs"] == totals["tool_calls"] == totals["failures"] == 0
    assert totals["input_tokens"] == stored["input_tokens"] > 0
    status, body = await _get(f"{proxy.url}/admin/runs?tenant=acme", ADMIN)
    (listed,) = [r for r in body["runs"] if r["run_id"] == "quiet"]
    assert listed["totals"] == totals  # the list reads each run whole too
    assert await _get(f"{proxy.url}/runs/quiet/end", ACME, "POST") == (200, {"run_id": "quiet", "ended": True})
    spans = await _flush(proxy, otlp_receiver, 3)
    attrs = next(s for s in spans if s["name"] == "invoke_agent")["attributes"]
    assert attrs["spanmeter.run.model_calls"] == 2
    for name in (A.SPANMETER_RUN_TOOL_CALLS, A.SPANMETER_RUN_FAILURES, A.SPANMETER_RUN_TOOL_FAILURES,
                 A.SPANMETER_RUN_REPAIRS, A.SPANMETER_RUN_CACHE_READ_INPUT_TOKENS,
                 A.SPANMETER_RUN_COST_SAVED_USD, A.SPANMETER_RUN_COST_CACHE_NET_SAVED_USD):
        assert attrs[name] == 0, name


# Per run, what differs between any two runs: its ids and its times.
_VOLATILE = ("spanmeter.run.id", "gen_ai.conversation.id", "input.value")


async def _runs_of_one_call(make_proxy, otlp_endpoint: str, *, leases: bool) -> list[dict[str, Any]]:
    """Three calls without a run id, each answered with a tool call it never gets back; what
    their runs' ends left: the root spans and missing-result spans, and the run rows."""
    proxy = await make_proxy(otlp_endpoint=otlp_endpoint, ledger_leases=leases)
    async with openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="k") as client:
        for _ in range(3):
            await client.chat.completions.create(model="sim-small", tools=TOOLS,
                                                 messages=[{"role": "user", "content": "SCENARIO:tool"}])
            await proxy.settled()
    return await proxy.app[STORE].list_runs(None)


async def test_a_run_of_one_call_ends_the_same_held_in_memory_or_in_the_store(otlp_receiver, make_proxy):  # noqa: F811
    """With budget leases, a run of one call after the tenant's first is held in memory and
    ended there by the call's own bookkeeping (Runs.end_held: no ledger operation, no task);
    without, the store ends it. Its root span, its unanswered tool call's span and its row
    are the same either way."""
    seen: dict[bool, tuple[list[dict[str, Any]], list[dict[str, Any]]]] = {}
    for leases in (False, True):
        before = len(otlp_receiver.spans())
        rows = await _runs_of_one_call(make_proxy, otlp_receiver.endpoint, leases=leases)
        spans = await asyncio.to_thread(otlp_receiver.wait_for_spans, before + 9)  # 3 calls, 3 runs, 3 tools
        seen[leases] = (spans[before:], rows)
    for leases, (spans, rows) in seen.items():
        roots = [s for s in spans if s["name"] == "invoke_agent"]
        missing = [s for s in spans if s["name"] == "execute_tool get_weather"]
        assert len(roots) == 3 and len(missing) == 3, leases
        for root in roots:
            attrs = root["attributes"]
            assert attrs["spanmeter.run.id_source"] == "generated"
            assert (attrs["spanmeter.run.model_calls"], attrs["spanmeter.run.tool_calls"],
                    attrs["spanmeter.run.tool_results_missing"], attrs["spanmeter.run.tool_failures"]) == (1, 1, 1, 1)
            kin = [s for s in missing if s["trace_id"] == root["trace_id"]]
            assert len(kin) == 1 and kin[0]["parent_span_id"] == root["span_id"]
            assert kin[0]["attributes"]["error.type"] == "tool_result_missing"
        assert len(rows) == 3 and all(r["ended"] and r["calls"] == 1 for r in rows), rows
        assert all(r["totals"]["tool_results_missing"] == 1 and r["totals"]["tool_failures"] == 1 for r in rows)

    def shape(leases: bool) -> list[dict[str, Any]]:
        spans, _ = seen[leases]
        return sorted(({k: v for k, v in s["attributes"].items() if k not in _VOLATILE}
                       for s in spans if s["name"] == "invoke_agent"), key=repr)

    assert shape(True) == shape(False)
    totals = {leases: sorted(repr(r["totals"]) for r in rows) for leases, (_, rows) in seen.items()}
    assert totals[True] == totals[False]
