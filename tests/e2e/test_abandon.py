"""A client that leaves while its call waits for admission: the span says so, nothing leaks."""

from __future__ import annotations

import asyncio
import sqlite3
import threading

import aiohttp
import pytest

from proxy.serve.appkeys import STORE, TEL
from tracing.local import read_spans

BODY = {"model": "sim-small", "max_tokens": 50, "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("leases", [True, False], ids=["leases", "exact"])
async def test_a_client_leaving_during_admission_ends_its_span_and_releases(make_proxy, sim, tmp_path, leases):
    """With budget leases the call that leaves is the one taking its run's lease (a run's
    second call): the lease is kept, the call counted from it and released, the rest of the
    lease given back; counted as without leases, never 32 calls."""
    ledger = tmp_path / "ledger.db"
    proxy = await make_proxy(ledger_url=f"sqlite:///{ledger}", policy={"runs": {"max_cost_usd": 1.0}},
                             ledger_leases=leases)
    headers = {"Authorization": "Bearer k", "X-Run-Id": "leaver"}
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{proxy.url}/v1/chat/completions", json=BODY, headers=headers) as r:
            assert r.status == 200  # the run is known now: the next call goes straight to admission
        await proxy.settled()
        locked, release = threading.Event(), threading.Event()

        def hold_lock() -> None:  # another process's writer, as far as SQLite can tell
            conn = sqlite3.connect(ledger, isolation_level=None, timeout=5)
            conn.execute("BEGIN EXCLUSIVE")
            locked.set()
            release.wait(10)
            conn.execute("COMMIT")
            conn.close()

        holder = threading.Thread(target=hold_lock)
        holder.start()
        locked.wait(5)
        with pytest.raises(asyncio.TimeoutError):
            async with s.post(f"{proxy.url}/v1/chat/completions", json=BODY, headers=headers,
                              timeout=aiohttp.ClientTimeout(total=0.5)):
                pass
        release.set()
        await asyncio.to_thread(holder.join)
    for _ in range(300):  # the admission lands once the lock is gone, then is released
        detail = await proxy.app[STORE].spend_detail("default", run_id="leaver")
        calls = await proxy.app[STORE].run_calls("default", "leaver")
        if calls == 2 and detail.reserved == 0:
            break
        await asyncio.sleep(0.02)
    assert (calls, detail.reserved) == (2, 0)
    assert len(sim.received) == 1, "the abandoned call was never forwarded"
    await proxy.settled()
    await asyncio.to_thread(proxy.app[TEL].force_flush)
    spans = [s for s in read_spans(proxy.data_dir / "traces") if s["attributes"].get("spanmeter.run.id") == "leaver"]
    assert [s["attributes"].get("error.type") for s in spans if s["name"] == "chat sim-small"] == [
        None, "client_disconnected"]
