"""A model call's bookkeeping with SQLite is a plain callback, no task of its own
(proxy/serve/bookkeeping.py `answered`), and does all it did as one: the settle, the span
with its ledger-read attributes, the metrics and the run's totals; a run's next call still
sees the previous call's settle; a run made for one call still ends."""

from __future__ import annotations

import asyncio
from typing import Any

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from proxy.config import hash_key
from proxy.serve.appkeys import STORE
from tests.reliability.dialects import DIALECTS, post
from tracing.setup import TelemetryConfig, setup_telemetry

KEY = "sm-bookkeeping-callback-key"


async def test_no_task_per_call_and_everything_recorded(make_proxy, monkeypatch_env, tmp_path) -> None:
    monkeypatch_env("OPENAI_API_KEY", "sk-upstream")
    mem = InMemorySpanExporter()
    tel = setup_telemetry(TelemetryConfig(local_dir=str(tmp_path / "spans")), extra_exporters=(mem,), environ={})
    proxy = await make_proxy(inject={"telemetry": tel}, tenants={"acme": {"keys": [hash_key(KEY)]}})
    loop = asyncio.get_running_loop()
    made: list[str] = []
    factory = loop.get_task_factory()

    def counting(loop: asyncio.AbstractEventLoop, coro: Any, **kw: Any) -> asyncio.Task[Any]:
        made.append(getattr(coro, "__qualname__", ""))
        return factory(loop, coro, **kw) if factory else asyncio.Task(coro, loop=loop, **kw)

    loop.set_task_factory(counting)
    d = DIALECTS[0]
    try:
        for _ in range(6):  # one after another: each admission sees the previous settle
            r = await post(proxy.url, d.path(False), d.body("hi", False), key=KEY, headers={"X-Run-Id": "cb-1"})
            assert r.status == 200
        for _ in range(3):  # runs of their own, ended with their call
            r = await post(proxy.url, d.path(False), d.body("hi", False), key=KEY)
            assert r.status == 200
            await proxy.settled()
    finally:
        loop.set_task_factory(factory)
    bookkeeping = [name for name in made if name.startswith(("_finish", "finish", "_after_settle"))]
    assert bookkeeping == []  # no task per call
    # The tenant's first run of one call is admitted by the store and ended in a task; the
    # next two, served from the tenant's lease and held in memory, end at once (Runs.end_held).
    assert [name for name in made if name.startswith("_after_call")] == ["_after_call"]
    store = proxy.app[STORE]
    assert await store.run_calls("acme", "cb-1") == 6
    spend = await store.spend_detail("acme", run_id="cb-1")
    assert spend.reserved == 0 and spend.settled > 0
    tel.tracer_provider.force_flush()
    calls = [s for s in mem.get_finished_spans() if (s.attributes or {}).get("spanmeter.run.id") == "cb-1"
             and s.name.startswith("chat")]
    assert len(calls) == 6
    for span in calls:  # what only the settle's result gives: the headroom, and the access line's cost
        attrs = span.attributes or {}
        assert "spanmeter.cost.usd" in attrs and "output.value" in attrs
    runs = [s for s in mem.get_finished_spans() if s.name.startswith("invoke_agent")
            or (s.attributes or {}).get("spanmeter.run.status")]
    assert len({(s.attributes or {}).get("spanmeter.run.id") for s in runs}) == 3, \
        "each one-call run ended, with its run span"
