"""Backend faults: the collector, Redis, the SQLite file. The proxy answers clearly,
recovers without a restart, and never corrupts the ledger.

Collector down/hanging at the exporter level: tests/tracing/test_export_health.py.
"""

from __future__ import annotations

import asyncio
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import orjson
import pytest

from proxy.serve.appkeys import STORE
from tests.fixtures.otlp import otlp_receiver  # noqa: F401
from tests.fixtures.redis import BINARY as REDIS_BINARY
from tests.fixtures.redis import RedisServer
from tests.reliability.dialects import DIALECTS, post, settled_span


async def test_requests_succeed_while_the_collector_hangs(otlp_receiver, make_proxy):  # noqa: F811
    otlp_receiver.hold()
    proxy = await make_proxy(otlp_endpoint=otlp_receiver.endpoint)
    try:
        d = DIALECTS[0]
        replies = await asyncio.gather(*(post(proxy.url, d.path(i % 2 == 0), d.body("hi", i % 2 == 0),
                                              headers={"X-Run-Id": f"col-{i}"}) for i in range(30)))
        assert [r.status for r in replies] == [200] * 30
        await settled_span(proxy, "col-29", flush=False)  # the local file exporter is unaffected
    finally:
        otlp_receiver.release()


@pytest.mark.skipif(REDIS_BINARY is None, reason="redis-server is not installed")
async def test_redis_down_is_a_clear_503_in_each_dialect_then_recovers_without_restart(make_proxy, tmp_path):
    server = RedisServer(tmp_path)  # our own server: stopping the session one would hurt other tests
    server.start()
    try:
        proxy = await make_proxy(ledger_url=server.url)
        for d in DIALECTS:
            assert (await post(proxy.url, d.path(False), d.body("hi", False))).status == 200
        server.stop()
        for d in DIALECTS:
            r = await post(proxy.url, d.path(False), d.body("hi", False), headers={"X-Run-Id": "down"})
            assert r.status == 503, r.body
            message = d.error_message(orjson.loads(r.body))
            assert "unreachable" in message and "No call is forwarded" in message
            assert r.headers["x-should-retry"] == "true"
        ready = await _get(proxy.url + "/readyz")
        assert ready[0] == 503
        server.start()  # same port, empty: nothing of ours survived in it
        for d in DIALECTS:
            r = await post(proxy.url, d.path(True), d.body("hi", True), headers={"X-Run-Id": "back"})
            assert r.status == 200, r.body
        assert (await _get(proxy.url + "/readyz"))[0] == 200
        await settled_span(proxy, "back", n=4)
        assert await proxy.app[STORE].run_calls("default", "back") == 4
    finally:
        server.stop()


async def _get(url: str) -> tuple[int, bytes]:
    import aiohttp

    async with aiohttp.ClientSession() as s, s.get(url) as r:
        return r.status, await r.read()


_LOCK_HOLDER = textwrap.dedent("""
    import sqlite3, sys, time
    conn = sqlite3.connect(sys.argv[1], isolation_level=None)
    conn.execute("BEGIN EXCLUSIVE")
    print("locked", flush=True)
    time.sleep(float(sys.argv[2]))
    conn.execute("COMMIT")
""")


async def test_a_ledger_locked_by_another_process_delays_calls_and_loses_nothing(proxy):
    ledger = Path(proxy.data_dir) / "ledger.db"
    d = DIALECTS[0]
    assert (await post(proxy.url, d.path(False), d.body("hi", False), headers={"X-Run-Id": "lock"})).status == 200
    await settled_span(proxy, "lock")
    holder = await asyncio.create_subprocess_exec(sys.executable, "-c", _LOCK_HOLDER, str(ledger), "0.5",
                                                  stdout=subprocess.PIPE)
    assert holder.stdout is not None
    assert (await holder.stdout.readline()).strip() == b"locked"
    replies = await asyncio.gather(*(post(proxy.url, d.path(False), d.body("hi", False),
                                          headers={"X-Run-Id": "lock"}) for _ in range(5)))
    await holder.wait()
    assert [r.status for r in replies] == [200] * 5  # they waited for the lock (busy_timeout), then ran
    await settled_span(proxy, "lock", n=6)
    assert await proxy.app[STORE].run_calls("default", "lock") == 6
    with sqlite3.connect(ledger) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
