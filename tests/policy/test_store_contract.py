"""One contract for every store: each test runs against SQLite and a real redis-server."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from proxy.errors import CeilingReached, ConfigError, StoreUnavailable
from proxy.policy.sqlite import SqliteStore
from proxy.policy.store import Admission, Limits, Spend, Store, open_store
from tests.fixtures.redis import BINARY, SKIP_REASON, RedisServer

ROOT = Path(__file__).resolve().parents[2]
T0 = datetime(2026, 5, 14, 12, 0, tzinfo=UTC)

STORES = [
    pytest.param("sqlite", id="sqlite"),
    pytest.param("redis", id="redis", marks=pytest.mark.redis),
]


def _url(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if kind == "sqlite":
        return f"sqlite:///{tmp_path}/ledger.db"
    return str(request.getfixturevalue("redis_server").url)


@pytest.fixture(params=STORES)
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return _url(request.param, request, tmp_path)


@pytest.fixture
async def store(url: str) -> AsyncIterator[Store]:
    s = open_store(url)
    yield s
    await s.aclose()


@pytest.fixture
def tenant() -> str:
    # The Redis server is shared by the session: every test gets its own tenant.
    return f"t-{uuid.uuid4().hex[:10]}"


async def admit(store: Store, tenant: str, run_id: str = "r-1", **kw: Any) -> Admission:
    kw.setdefault("min_reserve", 10)
    kw.setdefault("max_reserve", 100)
    kw.setdefault("limits", Limits())
    kw.setdefault("now", T0)
    return await store.admit(tenant, run_id, **kw)


async def outcomes(coros: list[Any]) -> tuple[list[Admission], list[CeilingReached]]:
    results = await asyncio.gather(*coros, return_exceptions=True)
    ok = [r for r in results if isinstance(r, Admission)]
    refused = [r for r in results if isinstance(r, CeilingReached)]
    assert len(ok) + len(refused) == len(results), [r for r in results if not isinstance(r, Admission | CeilingReached)]
    return ok, refused


# --- reserve, settle, release -------------------------------------------------------


async def test_admission_reserves_on_every_scope_and_counts_the_call(store: Store, tenant: str) -> None:
    a = await admit(store, tenant, limits=Limits(run_max_cost=1000, day_budget=5000))
    assert (a.reserved, a.calls, a.day_key, a.month_key) == (100, 1, "2026-05-14", "2026-05")
    assert a.remaining == {"run_cost": 900, "tenant_day": 4900, "tenant_month": None}
    for scope in ({"run_id": "r-1"}, {"day": "2026-05-14"}, {"month": "2026-05"}, {}):
        detail = await store.spend_detail(tenant, **scope)
        assert (detail.settled, detail.reserved) == (0, 100), scope
    assert await store.run_calls(tenant, "r-1") == 1


async def test_settle_replaces_the_reservation_by_the_actual_cost(store: Store, tenant: str) -> None:
    a = await admit(store, tenant)
    assert await store.settle(a, 40) == 0
    for scope in ({"run_id": "r-1"}, {"day": "2026-05-14"}, {"month": "2026-05"}, {}):
        detail = await store.spend_detail(tenant, **scope)
        assert (detail.settled, detail.reserved) == (40, 0), scope


async def test_release_settles_at_zero_but_the_call_still_counts(store: Store, tenant: str) -> None:
    a = await admit(store, tenant)
    await store.release(a)
    assert await store.spend(tenant, run_id="r-1") == 0
    assert await store.run_calls(tenant, "r-1") == 1


async def test_a_second_settle_is_a_no_op(store: Store, tenant: str) -> None:
    a = await admit(store, tenant)
    await store.settle(a, 40)
    assert await store.settle(a, 90) == 0
    await store.release(a)
    detail = await store.spend_detail(tenant, run_id="r-1")
    assert (detail.settled, detail.reserved) == (40, 0)


async def test_overshoot_is_charged_in_full_and_reported(store: Store, tenant: str) -> None:
    a = await admit(store, tenant, limits=Limits(run_max_cost=100))
    assert await store.settle(a, 150) == 50
    assert await store.spend(tenant, run_id="r-1") == 150
    with pytest.raises(CeilingReached) as info:
        await admit(store, tenant, limits=Limits(run_max_cost=100))
    assert info.value.limit == "run_cost"


async def test_the_last_reservation_is_cut_to_the_headroom_left(store: Store, tenant: str) -> None:
    limits = Limits(run_max_cost=250)
    sizes = [(await admit(store, tenant, limits=limits)).reserved for _ in range(3)]
    assert sizes == [100, 100, 50]
    with pytest.raises(CeilingReached):
        await admit(store, tenant, limits=limits)


async def test_large_budgets_stay_exact_integers(store: Store, tenant: str) -> None:
    # A billion dollars in micro-USD; Lua must not print it as 1e+15.
    big = 10**15
    a = await admit(store, tenant, max_reserve=123, limits=Limits(run_max_cost=big, day_budget=big))
    assert a.remaining == {"run_cost": big - 123, "tenant_day": big - 123, "tenant_month": None}
    await store.settle(a, 2**40 + 1)
    assert await store.spend(tenant, run_id="r-1") == 2**40 + 1
    with pytest.raises(ValueError, match="2\\^53"):
        Limits(day_budget=2**53)


# --- settle with run totals and tool calls (one operation per answered call) -----------


def _tool(call_id: str, **extra: Any) -> dict[str, Any]:
    return {"id": call_id, "name": "search", "arguments": '{"q": "x"}', **extra}


async def test_settle_records_run_totals_and_tool_calls_in_the_same_step(store: Store, tenant: str) -> None:
    await store.run_add(tenant, "r-1", {"ceilings_hit": 1, "calls": 2})
    a = await admit(store, tenant)
    totals = {"calls": 1, "input_tokens": 2**40 + 1, "cost_micros": 40}
    overshoot = await store.settle(a, 140, run_totals=totals, tools=[_tool("c1"), _tool("c2")])
    assert overshoot == 40
    detail = await store.spend_detail(tenant, run_id="r-1")
    assert (detail.settled, detail.reserved) == (140, 0)
    assert await store.run_totals(tenant, "r-1") == {
        "ceilings_hit": 1,
        "calls": 3,
        "input_tokens": 2**40 + 1,
        "cost_micros": 40,
    }
    assert await store.tools_pending(tenant, "r-1") == [_tool("c1"), _tool("c2")]
    # The admission's run only: another run and another tenant get nothing.
    assert await store.run_totals(tenant, "r-2") == {}
    assert await store.tools_pending(tenant + ":x", "r-1") == []


async def test_settle_keeps_the_order_of_tool_calls_put_before(store: Store, tenant: str) -> None:
    await store.tools_put(tenant, "r-1", [_tool("c1"), _tool("c2")])
    a = await admit(store, tenant)
    await store.settle(a, 10, tools=[_tool("c3"), _tool("c1", again=True)])
    pending = await store.tools_pending(tenant, "r-1")
    assert [c["id"] for c in pending] == ["c1", "c2", "c3"]
    assert pending[0] == _tool("c1", again=True)


async def test_a_second_combined_settle_adds_nothing(store: Store, tenant: str) -> None:
    a = await admit(store, tenant)
    await store.settle(a, 40, run_totals={"calls": 1, "output_tokens": 7}, tools=[_tool("c1")])
    assert await store.tools_take(tenant, "r-1", ["c1"]) == [_tool("c1")]
    again = await asyncio.gather(
        *(store.settle(a, 90, run_totals={"calls": 1, "output_tokens": 7}, tools=[_tool("c1"), _tool("c2")])
          for _ in range(5))
    )
    assert again == [0] * 5
    await store.release(a)
    detail = await store.spend_detail(tenant, run_id="r-1")
    assert (detail.settled, detail.reserved) == (40, 0)
    assert await store.run_totals(tenant, "r-1") == {"calls": 1, "output_tokens": 7}
    assert await store.tools_pending(tenant, "r-1") == []  # c1 was taken, c2 never came


async def test_concurrent_combined_settles_of_one_run_add_up_exactly(store: Store, tenant: str) -> None:
    admissions = await asyncio.gather(*(admit(store, tenant, "r-7") for _ in range(200)))
    await asyncio.gather(
        *(
            store.settle(a, i, run_totals={"calls": 1, "input_tokens": i}, tools=[_tool(f"c{i}")] * (i % 2))
            for i, a in enumerate(admissions)
        )
    )
    assert await store.spend_detail(tenant, run_id="r-7") == Spend(sum(range(200)), 0)
    assert await store.run_totals(tenant, "r-7") == {"calls": 200, "input_tokens": sum(range(200))}
    pending = await store.tools_pending(tenant, "r-7")
    assert sorted(c["id"] for c in pending) == sorted(f"c{i}" for i in range(1, 200, 2))


async def test_a_late_combined_settle_of_an_expired_reservation_still_records_the_run(
    store: Store, tenant: str
) -> None:
    a = await admit(store, tenant, ttl_s=60)
    await store.expire(T0 + timedelta(seconds=61))
    assert await store.settle(a, 130, run_totals={"calls": 1}, tools=[_tool("c1")]) == 30
    assert await store.spend_detail(tenant, run_id="r-1") == Spend(130, 0)
    assert await store.run_totals(tenant, "r-1") == {"calls": 1}
    assert [c["id"] for c in await store.tools_pending(tenant, "r-1")] == ["c1"]


# --- refusals -------------------------------------------------------------------------


async def test_the_call_ceiling_message_names_the_limit_and_how_to_raise_it(store: Store) -> None:
    limits = Limits(run_max_calls=8, origin={"run_calls": "tenant setting runs.max_llm_calls"})
    tenant = f"acme-{uuid.uuid4().hex[:6]}"
    for _ in range(8):
        await admit(store, tenant, "r-42", limits=limits)
    with pytest.raises(CeilingReached) as info:
        await admit(store, tenant, "r-42", limits=limits)
    assert info.value.limit == "run_calls"
    assert info.value.message == (
        f"Run r-42 of tenant {tenant} reached its ceiling of 8 model calls (tenant setting "
        "runs.max_llm_calls). The call was not forwarded and nothing was charged. Raise the "
        "ceiling for this tenant or start a new run."
    )
    assert await store.run_calls(tenant, "r-42") == 8


async def test_a_cost_refusal_says_which_budget_and_the_numbers(store: Store, tenant: str) -> None:
    limits = Limits(day_budget=1_000_000)
    a = await admit(store, tenant, min_reserve=1, max_reserve=700_000, limits=limits)
    await store.settle(a, 600_000)
    await admit(store, tenant, min_reserve=1, max_reserve=350_000, limits=limits)
    with pytest.raises(CeilingReached) as info:
        await admit(store, tenant, min_reserve=100_000, max_reserve=200_000, limits=limits)
    assert info.value.limit == "tenant_day"
    text = info.value.message
    for part in (
        "daily budget of $1.00 for 2026-05-14 (UTC)",
        "$0.60 spent",
        "$0.35 reserved",
        "leave $0.05",
        "needs at least $0.10",
        "nothing was charged",
        "spanmeter budget set",
    ):
        assert part in text, (part, text)
    # A refusal counts nothing.
    assert await store.run_calls(tenant, "r-1") == 2


# --- windows --------------------------------------------------------------------------


async def test_day_and_month_windows_roll_over_without_a_reset(store: Store, tenant: str) -> None:
    limits = Limits(day_budget=100, month_budget=150)
    last = datetime(2026, 1, 31, 23, 59, 59, tzinfo=UTC)
    a = await admit(store, tenant, limits=limits, now=last)
    assert (a.day_key, a.month_key) == ("2026-01-31", "2026-01")
    with pytest.raises(CeilingReached) as info:
        await admit(store, tenant, limits=limits, now=last)
    assert info.value.limit == "tenant_day"
    b = await admit(store, tenant, limits=limits, now=last + timedelta(seconds=2))
    assert (b.day_key, b.month_key, b.reserved) == ("2026-02-01", "2026-02", 100)
    c = await admit(store, tenant, limits=limits, now=last + timedelta(days=1, seconds=2))
    assert (c.reserved, c.remaining["tenant_month"]) == (50, 0)
    assert await store.spend(tenant, day="2026-01-31") == 100
    assert await store.spend(tenant, month="2026-02") == 150
    assert await store.spend(tenant) == 250


async def test_windows_follow_the_configured_time_zone(store: Store, tenant: str) -> None:
    # 03:00 UTC on 1 March is still 28 February, 22:00 in New York.
    a = await admit(store, tenant, now=datetime(2026, 3, 1, 3, 0, tzinfo=UTC), tz="America/New_York")
    assert (a.day_key, a.month_key) == ("2026-02-28", "2026-02")
    b = await admit(store, tenant, now=datetime(2026, 3, 1, 3, 0, tzinfo=UTC), tz="Asia/Tokyo")
    assert (b.day_key, b.month_key) == ("2026-03-01", "2026-03")


async def test_a_naive_time_is_refused(store: Store, tenant: str) -> None:
    with pytest.raises(ValueError, match="timezone-aware"):
        await admit(store, tenant, now=datetime(2026, 1, 1))


# --- concurrency ----------------------------------------------------------------------


async def test_500_concurrent_admissions_never_cross_a_cost_ceiling(store: Store, tenant: str) -> None:
    limits = Limits(run_max_cost=10_000)
    ok, refused = await outcomes(
        [admit(store, tenant, min_reserve=20, max_reserve=30, limits=limits) for _ in range(500)]
    )
    # 333 x 30 = 9,990; the 10 left is below the minimum of 20.
    assert (len(ok), len(refused)) == (333, 167)
    assert {r.limit for r in refused} == {"run_cost"}
    assert await store.spend(tenant, run_id="r-1") == 9_990 <= 10_000
    assert sorted(a.calls for a in ok) == list(range(1, 334))


async def test_two_stores_on_one_ledger_share_a_tenant_budget(url: str, tenant: str) -> None:
    first, second = open_store(url), open_store(url)
    try:
        limits = Limits(day_budget=5_000)
        ok, refused = await outcomes(
            [
                admit(s, tenant, f"r-{i % 50}", min_reserve=13, max_reserve=13, limits=limits)
                for i, s in zip(range(500), [first, second] * 250, strict=True)
            ]
        )
        assert (len(ok), len(refused)) == (5_000 // 13, 500 - 5_000 // 13)
        assert await first.spend(tenant, day="2026-05-14") == 13 * (5_000 // 13)
        await asyncio.gather(*(s.settle(a, 5) for s, a in zip([first, second] * 250, ok, strict=False)))
        assert await second.spend(tenant, day="2026-05-14") == 5 * len(ok)
    finally:
        await first.aclose()
        await second.aclose()


async def test_the_call_ceiling_is_exact_under_concurrency(store: Store, tenant: str) -> None:
    ok, refused = await outcomes([admit(store, tenant, "r-9", limits=Limits(run_max_calls=8)) for _ in range(500)])
    assert (len(ok), len(refused)) == (8, 492)
    assert {r.limit for r in refused} == {"run_calls"}
    assert await store.run_calls(tenant, "r-9") == 8
    assert await store.spend(tenant, run_id="r-9") == 800


# --- expiry ---------------------------------------------------------------------------


async def test_an_expired_reservation_is_charged_not_refunded(store: Store, tenant: str) -> None:
    # expire() counts every tenant's reservations and the Redis server is shared by the
    # session: this one is dated years before any other test's, so the counts are exact.
    past = datetime(2001, 1, 1, tzinfo=UTC)
    await admit(store, tenant, ttl_s=60, limits=Limits(run_max_cost=150), now=past)
    assert await store.expire(past + timedelta(seconds=30)) == 0
    assert (await store.spend_detail(tenant, run_id="r-1")).reserved == 100
    assert await store.expire(past + timedelta(seconds=61)) == 1
    detail = await store.spend_detail(tenant, run_id="r-1")
    assert (detail.settled, detail.reserved) == (100, 0)
    assert await store.expire(past + timedelta(seconds=3600)) == 0  # charged once, not again
    with pytest.raises(CeilingReached):  # the headroom did not come back
        await admit(store, tenant, min_reserve=60, limits=Limits(run_max_cost=150), now=past)


async def test_a_late_settle_corrects_an_expired_reservation(store: Store, tenant: str) -> None:
    a = await admit(store, tenant, ttl_s=60)
    b = await admit(store, tenant, ttl_s=60)
    await store.expire(T0 + timedelta(seconds=61))
    assert await store.settle(a, 30) == 0
    assert await store.settle(b, 130) == 30
    assert await store.settle(b, 500) == 0
    detail = await store.spend_detail(tenant, day="2026-05-14")
    assert (detail.settled, detail.reserved) == (160, 0)


# --- run state ------------------------------------------------------------------------


async def test_run_state_is_shared_and_ends_once(store: Store, tenant: str) -> None:
    first = {"trace_id": "a" * 32, "span_id": "b" * 16, "started_at": 1.5}
    assert await store.run_begin(tenant, "r-1", T0, first) == first
    assert await store.run_begin(tenant, "r-1", T0, {"trace_id": "c" * 32}) == first
    await store.run_add(tenant, "r-1", {"input_tokens": 10, "calls": 1})
    await store.run_add(tenant, "r-1", {"input_tokens": 5, "tool_calls": 2})
    assert await store.run_totals(tenant, "r-1") == {
        "input_tokens": 15,
        "calls": 1,
        "tool_calls": 2,
    }
    await store.settle(await admit(store, tenant, now=T0 + timedelta(seconds=5)), 42)
    await store.run_begin(tenant, "r-2", T0 + timedelta(seconds=20), {"trace_id": "d" * 32})

    idle = [r for t, r in await store.idle_runs(T0 + timedelta(seconds=15)) if t == tenant]
    assert idle == ["r-1"]
    runs = await store.list_runs(tenant, limit=10)
    assert [r["run_id"] for r in runs] == ["r-2", "r-1"]

    ended = await asyncio.gather(*(store.run_end(tenant, "r-1") for _ in range(10)))
    records = [r for r in ended if r is not None]
    assert len(records) == 1
    record = records[0]
    assert record["trace"] == first and record["calls"] == 1 and record["spend"] == 42
    assert record["totals"]["input_tokens"] == 15 and record["ended"] is True
    assert [r for t, r in await store.idle_runs(T0 + timedelta(days=1)) if t == tenant] == ["r-2"]
    assert await store.run_end(tenant, "never-seen") is None


async def test_tool_calls_are_taken_once(store: Store, tenant: str) -> None:
    calls = [{"id": i, "name": "search", "arguments": "{}", "at": n} for n, i in enumerate("abc")]
    await store.tools_put(tenant, "r-1", calls)
    assert [c["id"] for c in await store.tools_pending(tenant, "r-1")] == ["a", "b", "c"]
    assert await store.tools_take(tenant, "r-1", ["b", "zz"]) == [calls[1]]
    assert await store.tools_take(tenant, "r-1", ["b"]) == []
    assert [c["id"] for c in await store.tools_pending(tenant, "r-1")] == ["a", "c"]
    takes = await asyncio.gather(*(store.tools_take(tenant, "r-1", ["a", "c"]) for _ in range(20)))
    assert sorted(c["id"] for got in takes for c in got) == ["a", "c"]
    assert await store.tools_pending(tenant, "r-1") == []


async def test_streaks_and_failures_count_consecutive_events(store: Store, tenant: str) -> None:
    assert [await store.streak(tenant, "r-1", s) for s in "aaabaa"] == [1, 2, 3, 1, 1, 2]
    flags = [True, True, False, True]
    assert [await store.failures(tenant, "r-1", f) for f in flags] == [1, 2, 0, 1]


async def test_budget_overrides_round_trip(store: Store, tenant: str) -> None:
    assert await store.budget_get(tenant) == (None, None)
    await store.budget_set(tenant, 5_000_000, None)
    assert await store.budget_get(tenant) == (5_000_000, None)
    await store.budget_set(tenant, None, 90_000_000)
    assert await store.budget_get(tenant) == (None, 90_000_000)


async def test_the_same_run_id_in_two_tenants_shares_nothing(store: Store, tenant: str) -> None:
    other = tenant + ":x"
    for t in (tenant, other):
        await admit(store, t, "r-1", limits=Limits(run_max_calls=1))
        assert await store.run_begin(t, "r-1", T0, {"trace_id": t}) == {"trace_id": t}
        await store.tools_put(t, "r-1", [{"id": "call-1", "tenant": t}])
        assert await store.streak(t, "r-1", "same") == 1
    assert await store.run_calls(tenant, "r-1") == await store.run_calls(other, "r-1") == 1
    assert await store.tools_take(tenant, "r-1", ["call-1"]) == [{"id": "call-1", "tenant": tenant}]
    assert await store.tools_pending(other, "r-1") == [{"id": "call-1", "tenant": other}]
    assert await store.spend(other) == 100
    # Separators inside names cannot make two keys meet.
    await admit(store, tenant + ":a", "b")
    assert await store.run_calls(tenant, "a:b") == 0


# --- durability and outages -------------------------------------------------------------


async def test_sqlite_spend_survives_a_reopen(tmp_path: Path, tenant: str) -> None:
    url = f"sqlite:///{tmp_path}/ledger.db"
    store = open_store(url)
    settled = await admit(store, tenant)
    await store.settle(settled, 64)
    in_flight = await admit(store, tenant)
    await store.aclose()

    store = open_store(url)
    try:
        detail = await store.spend_detail(tenant, run_id="r-1")
        assert (detail.settled, detail.reserved) == (64, 100)
        assert await store.run_calls(tenant, "r-1") == 2
        assert await store.settle(in_flight, 10) == 0
        assert await store.spend(tenant, month="2026-05") == 74
    finally:
        await store.aclose()


@pytest.mark.parametrize("synchronous", ["full", "normal"])
def test_sqlite_ledger_survives_kill_9_under_load(tmp_path: Path, synchronous: str) -> None:
    # NORMAL skips the fsync per commit, but a commit is in the OS's hands before the
    # store returns, so killing the process loses nothing acknowledged either.
    url = f"sqlite:///{tmp_path / 'ledger.db'}?synchronous={synchronous}"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("ledger_child.py")), url],
        stdout=subprocess.PIPE,
        env=env,
        cwd=ROOT,
    )
    assert child.stdout is not None
    lines: list[bytes] = []
    while sum(line.startswith(b"settled") for line in lines) < 300:
        line = child.stdout.readline()
        assert line, f"the child died early with {child.wait()}"
        lines.append(line)
    os.kill(child.pid, signal.SIGKILL)
    lines += child.stdout.read().splitlines()  # acknowledged before the kill
    child.wait()

    settles = [line for line in lines if line.startswith(b"settled")]
    settled = sum(int(line.split()[1]) for line in settles)
    in_flight = sum(int(line.split()[1]) for line in lines if line.startswith(b"inflight"))

    async def check() -> None:
        store = open_store(url)
        try:
            detail = await store.spend_detail("crash")
            # Unacknowledged work may have committed too, so these are lower bounds.
            assert detail.settled >= settled
            assert detail.reserved >= in_flight
            assert detail.total >= settled + in_flight
            runs = [f"r{i}" for i in range(5)]
            totals = [await store.run_totals("crash", r) for r in runs]
            tools = [await store.tools_pending("crash", r) for r in runs]
            # Each combined settle's totals and tool call committed with its charge.
            assert sum(t.get("calls", 0) for t in totals) >= len(settles)
            assert sum(len(t) for t in tools) >= len(settles)
            assert all(c["run"] == r for r, pending in zip(runs, tools, strict=True) for c in pending)
        finally:
            await store.aclose()

    asyncio.run(check())


@pytest.mark.redis
@pytest.mark.skipif(BINARY is None, reason=SKIP_REASON)
async def test_redis_restart_fails_closed_then_recovers(tmp_path: Path, tenant: str) -> None:
    server = RedisServer(tmp_path)
    server.start()
    store = open_store(server.url)
    try:
        await store.settle(await admit(store, tenant), 10)
        server.stop()
        with pytest.raises(StoreUnavailable, match="unreachable"):
            await admit(store, tenant)
        with pytest.raises(StoreUnavailable):
            await store.spend(tenant)
        server.start()  # same port, empty (no persistence), scripts no longer loaded
        a = await admit(store, tenant, limits=Limits(run_max_calls=1))
        assert a.calls == 1
        assert await store.settle(a, 7) == 0
        assert await store.spend(tenant) == 7
    finally:
        await store.aclose()
        server.stop()


async def test_an_unknown_store_url_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="sqlite:///"):
        open_store("postgres://localhost/ledger")


@pytest.mark.parametrize(
    ("query", "pragma"),
    [("", 2), ("?synchronous=full", 2), ("?synchronous=normal", 1), ("?synchronous=NORMAL", 1)],
)
async def test_sqlite_durability_is_chosen_in_the_url(tmp_path: Path, query: str, pragma: int) -> None:
    store = open_store(f"sqlite:///{tmp_path}/ledger.db{query}")
    try:
        assert isinstance(store, SqliteStore) and store.path == f"{tmp_path}/ledger.db"
        # The connection's own setting (0 OFF, 1 NORMAL, 2 FULL), read on the writer thread.
        assert await store._do(lambda conn: conn.execute("PRAGMA synchronous").fetchone()[0]) == pragma
    finally:
        await store.aclose()


@pytest.mark.parametrize("query", ["?synchronous=off", "?synchronous=", "?journal_mode=delete", "?sync=normal"])
async def test_an_unknown_sqlite_option_is_a_config_error(tmp_path: Path, query: str) -> None:
    with pytest.raises(ConfigError, match="synchronous=full\\|normal\\|extra"):
        open_store(f"sqlite:///{tmp_path}/ledger.db{query}")


async def test_a_broken_sqlite_path_is_unavailable(tmp_path: Path) -> None:
    store = open_store(f"sqlite:///{tmp_path}/missing-dir/ledger.db")
    with pytest.raises(StoreUnavailable, match="ledger"):
        await store.ping()
    await store.aclose()


async def test_an_admission_whose_caller_is_cancelled_is_released_not_leaked(store: Store, tenant: str) -> None:
    # The agent went away while the admission was being committed: nothing was forwarded,
    # so the reservation must come back (not linger until it expires at its full amount).
    task = asyncio.ensure_future(admit(store, tenant, "r-gone", min_reserve=100, max_reserve=100))
    await asyncio.sleep(0)  # the admission is on its way to the store
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(300):  # the admission lands, then its release
        calls = await store.run_calls(tenant, "r-gone")
        detail = await store.spend_detail(tenant, run_id="r-gone")
        if calls == 1 and detail.reserved == 0:
            break
        await asyncio.sleep(0.01)
    assert calls == 1  # the call was counted...
    assert detail == Spend(0, 0)  # ...and its reservation released
