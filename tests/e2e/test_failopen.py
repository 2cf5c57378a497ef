"""fail_open: an explicit, loudly logged choice of availability over enforcement."""

from __future__ import annotations

import logging

import openai
import pytest

from tests.fixtures.redis import BINARY, RedisServer


@pytest.mark.skipif(BINARY is None, reason="redis-server is not installed")
async def test_fail_open_serves_unmetered_and_logs_it(make_proxy, tmp_path, caplog):
    server = RedisServer(tmp_path)
    server.start()
    proxy = await make_proxy(ledger_url=server.url, fail_open=True,
                             policy={"runs": {"max_llm_calls": 1, "wrap_up_at": 0.5}})
    server.stop()
    async with openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="k", max_retries=0,
                                  default_headers={"X-Run-Id": "open"}) as c:
        with caplog.at_level(logging.ERROR, logger="spanmeter.ledger"):
            for _ in range(3):  # beyond the ceiling of 1: nothing can count while the ledger is away
                raw = await c.chat.completions.with_raw_response.create(
                    model="sim-small", messages=[{"role": "user", "content": "hi"}])
                assert raw.parse().choices[0].message.content
                # Nothing is known of what is left: no numbers, no note.
                assert not any(h.startswith("x-spanmeter-run-calls") for h in raw.headers)
                assert "x-spanmeter-rewrites" not in raw.headers
    assert any("UNMETERED" in r.getMessage() and "admit" in r.getMessage() for r in caplog.records)
