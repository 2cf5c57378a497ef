"""One ledger operation before forwarding and one after, however many tool results a turn carries,
on the exact path (budget leases off: with them, a hot run's calls take none; tests/e2e/test_leases.py).

Counted where the operations happen: the SQLite writer's queue and the real redis-server's
own command statistics.
"""

from __future__ import annotations

import threading
import time

import openai
import pytest
import redis

from proxy.ledger.sqlite import SqliteStore
from proxy.serve.appkeys import STORE


async def _open_calls(client: openai.AsyncOpenAI, n: int) -> list:
    """n answers, each with one tool call: n open tool calls in the run."""
    calls = []
    for i in range(n):
        r = await client.chat.completions.create(
            model="sim-small", messages=[{"role": "user", "content": f"SCENARIO:tool call {i}"}],
            tools=[{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}])
        calls.append(r.choices[0].message.tool_calls[0])
    return calls


def _turn(calls: list) -> list[dict]:
    """The next request of the agent: its tool calls, then every result."""
    return [{"role": "user", "content": "SCENARIO:tool go"},
            {"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in calls]},
            *({"role": "tool", "tool_call_id": c.id, "content": '{"ok": true, "temp": 14}'} for c in calls)]


class Counter:
    """Store operations: the SQLite writer's count, or the commands Redis received from
    clients (MONITOR; the commands a Lua script runs inside are not operations)."""

    MARK = "spanmeter-test-end-of-turn"

    def __init__(self, proxy, server) -> None:
        self.store, self.url = proxy.app[STORE], server.url if server else None
        self.seen: list[str] = []

    def _watch(self, ready: threading.Event) -> None:
        with redis.Redis.from_url(self.url).monitor() as m:
            ready.set()
            while True:
                cmd = m.next_command()
                if self.MARK in cmd["command"]:
                    return
                name = cmd["command"].split(" ")[0].upper()
                # Connection handshakes (a new pooled connection, the marker's own) are not operations.
                if cmd.get("client_type") != "lua" and name not in ("HELLO", "CLIENT", "AUTH", "SELECT"):
                    self.seen.append(name)

    def start(self) -> None:
        if self.url is None:
            self.base = self.store.operations
            return
        ready = threading.Event()
        self.thread = threading.Thread(target=self._watch, args=(ready,), daemon=True)
        self.thread.start()
        assert ready.wait(5)
        time.sleep(0.05)  # MONITOR is in force once its reply is back

    def count(self) -> int:
        if self.url is None:
            return self.store.operations - self.base
        with redis.Redis.from_url(self.url) as r:
            r.echo(self.MARK)
        self.thread.join(5)
        return len(self.seen)


@pytest.mark.parametrize("backend", ["sqlite", pytest.param("redis", marks=pytest.mark.redis)])
@pytest.mark.parametrize("results", [0, 1, 2, 7])
async def test_an_agent_turn_costs_two_ledger_operations(backend, results, make_proxy, request, tmp_path,
                                                         monkeypatch_env):
    monkeypatch_env("SPANMETER_LEDGER_LEASES", "false")
    server = request.getfixturevalue("redis_server") if backend == "redis" else None
    ledger = server.url if server else f"sqlite:///{tmp_path}/ledger.db"
    proxy = await make_proxy(ledger_url=ledger)
    assert isinstance(proxy.app[STORE], SqliteStore) == (backend == "sqlite")
    client = openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="k",
                                default_headers={"X-Run-Id": f"ops-{backend}-{results}"})
    calls = await _open_calls(client, max(results, 1))  # also loads the Lua scripts
    await proxy.settled()
    counter = Counter(proxy, server)
    counter.start()
    await client.chat.completions.create(model="sim-small", messages=_turn(calls[:results]) if results else
                                         [{"role": "user", "content": "hi"}])
    await proxy.settled()
    assert counter.count() == 2, ("one admission before forwarding, one settlement after", counter.seen)
    await client.close()


@pytest.mark.parametrize("backend", ["sqlite", pytest.param("redis", marks=pytest.mark.redis)])
async def test_every_limit_at_once_still_costs_two_ledger_operations(backend, make_proxy, request, tmp_path,
                                                                     monkeypatch_env):
    """Rate buckets of the tenant and the key, a key's budgets, token and time ceilings and a
    wrap-up note are all decided inside the one admission."""
    from proxy.config import hash_key

    server = request.getfixturevalue("redis_server") if backend == "redis" else None
    monkeypatch_env("SPANMETER_LEDGER_LEASES", "false")
    monkeypatch_env("OPENAI_API_KEY", "sk-upstream")
    key = {"hash": hash_key("sm-ops-key"), "policy": {"budgets": {"daily_usd": 5}, "runs": {"max_tokens": 90_000},
                                                      "rate_limits": {"requests_per_minute": 50}}}
    policy = {"runs": {"max_llm_calls": 4, "max_seconds": 600, "wrap_up_at": 0.1},
              "rate_limits": {"requests_per_minute": 100, "tokens_per_minute": 1_000_000},
              "budgets": {"daily_usd": 10}}
    proxy = await make_proxy(ledger_url=server.url if server else f"sqlite:///{tmp_path}/ledger.db",
                             tenants={"acme": {"keys": [key], "policy": policy}})
    client = openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="sm-ops-key",
                                default_headers={"X-Run-Id": f"ops-limits-{backend}"})
    calls = await _open_calls(client, 2)
    await proxy.settled()
    counter = Counter(proxy, server)
    counter.start()
    raw = await client.chat.completions.with_raw_response.create(model="sim-small", messages=_turn(calls))
    await proxy.settled()
    assert "wrap_up=" in raw.headers["x-spanmeter-rewrites"], "this call carried the note"
    assert counter.count() == 2, ("one admission before forwarding, one settlement after", counter.seen)
    await client.close()
