"""One contract for every store: each test runs against SQLite and a real redis-server."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from proxy.errors import CeilingReached, ConfigError, LoopRefused, RateLimited, StoreUnavailable
from proxy.ledger.backends import open_store
from proxy.ledger.sqlite import SqliteStore
from proxy.ledger.store import (
    NO_TURN,
    Admission,
    Ask,
    GuardRule,
    Limits,
    Rate,
    Spend,
    Store,
    ToolTurn,
    Turn,
    WholeRun,
)
from tests.fixtures.redis import BINARY, SKIP_REASON, RedisServer
from tests.ledger.children import killed_after

ROOT = Path(__file__).resolve().parents[2]
T0 = datetime(2026, 5, 14, 12, 0, tzinfo=UTC)

STORES = [
    pytest.param("sqlite", id="sqlite"),
    pytest.param("redis", id="redis", marks=pytest.mark.redis),
    pytest.param("cluster", id="cluster", marks=pytest.mark.redis),
    # The same contract with budget leases on (proxy/ledger/leases.py, SPANMETER_LEDGER_LEASES).
    pytest.param("sqlite-leased", id="sqlite-leased"),
    pytest.param("redis-leased", id="redis-leased", marks=pytest.mark.redis),
    pytest.param("cluster-leased", id="cluster-leased", marks=pytest.mark.redis),
]


def _url(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> str:
    request.getfixturevalue("monkeypatch").setenv("SPANMETER_LEDGER_LEASES", str(kind.endswith("-leased")).lower())
    kind = kind.removesuffix("-leased")
    if kind == "sqlite":
        return f"sqlite:///{tmp_path}/ledger.db"
    if kind == "cluster":
        return str(request.getfixturevalue("redis_cluster").url)
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
    turn = replace(kw.pop("turn", NO_TURN), reserve=(kw.pop("min_reserve", 10), kw.pop("max_reserve", 100)))
    kw.setdefault("limits", Limits())
    kw.setdefault("now", T0)
    return await store.admit(Ask(tenant, run_id, **kw), turn)


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


async def test_an_admission_submitted_once_a_settle_is_in_order_sees_it(store: Store, tenant: str) -> None:
    """What lets a run's next call skip waiting for its previous settle to finish
    (proxy/serve/background.py): once `settle_in_order` returns, the next admission counts
    the real cost (not the reservation) and closes the tool calls, even with the settle's
    own result not awaited yet."""
    limits = Limits(run_max_cost=150)
    first = await admit(store, tenant, limits=limits)
    assert first.reserved == 100
    done = await store.settle_in_order(first, 40, run_totals={"model_calls": 1}, tools=[_tool("c1")])
    nxt = await admit(store, tenant, limits=limits, turn=Turn(results=(("c1", True),)))
    assert (nxt.reserved, nxt.remaining["run_cost"]) == (100, 10), "150 - 40 settled, not - 100 reserved"
    assert [c["id"] for c in nxt.closed] == ["c1"]
    assert await done == 0
    assert await store.run_totals(tenant, "r-1") == {"model_calls": 1}
    assert await store.tools_pending(tenant, "r-1") == []


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
        stores = [first, second] * 250
        results = await asyncio.gather(
            *(admit(s, tenant, f"r-{i % 50}", min_reserve=13, max_reserve=13, limits=limits)
              for i, s in enumerate(stores)),
            return_exceptions=True,
        )
        ok = [(s, r) for s, r in zip(stores, results, strict=True) if isinstance(r, Admission)]
        refused = [r for r in results if isinstance(r, CeilingReached)]
        assert (len(ok), len(refused)) == (5_000 // 13, 500 - 5_000 // 13)
        assert await first.spend(tenant, day="2026-05-14") == 13 * (5_000 // 13)
        # Each call settled by the store that admitted it, as the proxy settles it (a budget
        # lease's calls are known to the process that leased them).
        await asyncio.gather(*(s.settle(a, 5) for s, a in ok))
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
    first = {"ids": "first"}
    a = await admit(store, tenant, turn=Turn(trace=first))
    assert a.trace == first
    b = await admit(store, tenant, turn=Turn(trace={"ids": "second"}))
    assert b.trace == first, "the first trace stored wins, on every replica"
    with pytest.raises(CeilingReached) as ei:
        await admit(store, tenant, limits=Limits(run_max_calls=2), turn=Turn(trace={"ids": "third"}))
    assert ei.value.trace == first, "a refusal still tells the run's trace"
    await store.release(a)
    await store.release(b)
    await store.run_add(tenant, "r-1", {"input_tokens": 10, "calls": 1})
    await store.run_add(tenant, "r-1", {"input_tokens": 5, "tool_calls": 2}, soon=True)  # readable once returned
    assert await store.run_totals(tenant, "r-1") == {
        "input_tokens": 15,
        "calls": 1,
        "tool_calls": 2,
    }
    await store.settle(await admit(store, tenant, now=T0 + timedelta(seconds=5)), 42)
    await admit(store, tenant, "r-2", now=T0 + timedelta(seconds=20), turn=Turn(trace={"ids": "r2"}))

    idle = [r for t, r in await store.idle_runs(T0 + timedelta(seconds=15)) if t == tenant]
    assert idle == ["r-1"]
    runs = await store.list_runs(tenant, limit=10)
    assert [r["run_id"] for r in runs] == ["r-2", "r-1"]

    ended = await asyncio.gather(*(store.run_end(tenant, "r-1") for _ in range(10)))
    records = [r for r in ended if r is not None]
    assert len(records) == 1
    record = records[0]
    assert record["trace"] == first and record["calls"] == 3 and record["spend"] == 42
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


async def _tool_turn(store: Store, tenant: str, sig: str, ok: bool = True, **kw: Any) -> Admission:
    """One agent turn: the previous answer's tool call, then the request carrying its result."""
    call_id = uuid.uuid4().hex[:8]
    await store.settle(await admit(store, tenant), 1, tools=[{"id": call_id, "name": sig, "arguments": "{}",
                                                               "sig": sig}])
    return await admit(store, tenant, turn=Turn(results=((call_id, ok),), **kw))


async def test_streaks_and_failures_are_counted_by_the_admission_that_closes_the_call(
        store: Store, tenant: str) -> None:
    streaks = [(await _tool_turn(store, tenant, s)).closed[0]["streak"] for s in "aaabaa"]
    assert streaks == [1, 2, 3, 1, 1, 2]
    failures = [(await _tool_turn(store, tenant, "c", ok)).closed[0]["failures"] for ok in (False, False, True, False)]
    assert failures == [1, 2, 0, 1]


async def test_one_admission_closes_every_result_of_a_turn_in_order(store: Store, tenant: str) -> None:
    calls = [{"id": f"c{i}", "name": "read", "arguments": "{}", "sig": "read:same"} for i in range(4)]
    await store.settle(await admit(store, tenant), 1, tools=calls)
    a = await admit(store, tenant, turn=Turn(results=(("c0", True), ("zz", True), ("c1", False), ("c2", True))))
    # Identical calls of one answer (parallel calls) are one step; failures count per result.
    assert [(c["id"], c["streak"], c["failures"], c["ok"]) for c in a.closed] == [
        ("c0", 1, 0, True), ("c1", 1, 1, False), ("c2", 1, 0, True)]
    assert [c["id"] for c in await store.tools_pending(tenant, "r-1")] == ["c3"]
    again = await admit(store, tenant, turn=Turn(results=(("c0", True),)))
    assert again.closed == (), "a tool call is closed once"


async def test_identical_parallel_calls_are_one_step_and_a_streak_counts_turns(store: Store, tenant: str) -> None:
    rule = GuardRule(threshold=3, refuse=True)
    streaks = []
    for turn in range(2):  # two answers, each asking three times for the same call at once
        calls = [{"id": f"t{turn}c{i}", "name": "topic", "arguments": "{}", "sig": "topic"} for i in range(3)]
        await store.settle(await admit(store, tenant), 1, tools=calls)
        a = await admit(store, tenant, turn=Turn(results=tuple((c["id"], True) for c in calls), guard=rule))
        streaks.append([c["streak"] for c in a.closed])
    assert streaks == [[1, 1, 1], [2, 2, 2]], "three parallel calls are not three in a row"
    with pytest.raises(LoopRefused, match="`topic` 3 times in a row"):
        await _tool_turn(store, tenant, "topic", guard=rule)  # the third answer asking it


async def test_the_guard_refuses_inside_the_admission_and_the_results_stay_closed(store: Store, tenant: str) -> None:
    rule = GuardRule(threshold=3, refuse=True)
    for _ in range(2):
        await _tool_turn(store, tenant, "loop", guard=rule)
    calls = await store.run_calls(tenant, "r-1")
    with pytest.raises(LoopRefused) as ei:
        await _tool_turn(store, tenant, "loop", guard=rule)
    assert "`loop` 3 times in a row" in ei.value.message
    assert [c["streak"] for c in ei.value.closed] == [3]
    assert await store.run_calls(tenant, "r-1") == calls + 1, "the refused call is not counted"
    assert await store.tools_pending(tenant, "r-1") == [], "the result that arrived closed its call"
    failing = GuardRule(threshold=3, refuse=False, max_failures=2)
    await _tool_turn(store, tenant, "x", ok=False, guard=failing)
    with pytest.raises(LoopRefused, match="2 tool failures in a row"):
        await _tool_turn(store, tenant, "y", ok=False, guard=failing)


async def test_admin_budgets_hold_from_the_next_admission_on_every_replica(url: str, tenant: str) -> None:
    one, two = open_store(url), open_store(url)
    try:
        limits = Limits(day_budget=1_000_000)
        await admit(one, tenant, min_reserve=100, max_reserve=100, limits=limits)
        await two.budget_set(tenant, 150, None)  # the other replica cuts the daily budget
        with pytest.raises(CeilingReached) as ei:
            await admit(one, tenant, min_reserve=100, max_reserve=100, limits=limits)
        assert ei.value.limit == "tenant_day" and "admin budget" in ei.value.message
        await two.budget_set(tenant, None, None)
        a = await admit(one, tenant, min_reserve=100, max_reserve=100, limits=limits)
        assert a.limits is not None and a.limits.day_budget == 1_000_000
    finally:
        await one.aclose()
        await two.aclose()


async def test_an_unpriced_model_is_refused_under_an_admin_budget_alone(store: Store, tenant: str) -> None:
    unpriced = Turn(priced=False, model="mystery-1")
    await admit(store, tenant, min_reserve=0, max_reserve=0, turn=unpriced)  # no cost limit: goes
    await store.budget_set(tenant, 5_000_000, None)
    with pytest.raises(CeilingReached, match="'mystery-1' has no known price") as ei:
        await admit(store, tenant, min_reserve=0, max_reserve=0, turn=unpriced)
    assert ei.value.limit == "unknown_price"


async def test_stored_context_is_bounded_by_what_the_ledger_saw(store: Store, tenant: str) -> None:
    ref = Turn(context=("response:resp_1",), input_rate=2_000_000)  # $2 per million tokens
    costed = Limits(run_max_cost=10_000_000)
    with pytest.raises(CeilingReached, match="response:resp_1") as ei:
        await admit(store, tenant, limits=costed, turn=ref)
    assert ei.value.limit == "stored_context"
    free = await admit(store, tenant, turn=ref)  # no cost ceiling: forwarded, charged as billed
    assert free.context_tokens == 0
    await store.settle(free, 5, contexts={"response:resp_1": 300_000, "conversation:c": 10})
    await store.settle(await admit(store, tenant), 5, contexts={"response:resp_1": 200})  # the largest stays
    a = await admit(store, tenant, min_reserve=10, max_reserve=100, limits=costed, turn=ref)
    assert a.context_tokens == 300_000
    assert a.reserved == 100 + 600_000, "300k stored tokens at $2/M are reserved on top"
    other = tenant + "-other"
    with pytest.raises(CeilingReached):
        await admit(store, other, limits=costed, turn=ref)  # another tenant's response is unknown


async def test_budget_overrides_round_trip(store: Store, tenant: str) -> None:
    assert await store.budget_get(tenant) == (None, None)
    await store.budget_set(tenant, 5_000_000, None)
    assert await store.budget_get(tenant) == (5_000_000, None)
    await store.budget_set(tenant, None, 90_000_000)
    assert await store.budget_get(tenant) == (None, 90_000_000)


async def test_the_same_run_id_in_two_tenants_shares_nothing(store: Store, tenant: str) -> None:
    other = tenant + ":x"
    for t in (tenant, other):
        a = await admit(store, t, "r-1", limits=Limits(run_max_calls=1), turn=Turn(trace={"ids": t}))
        assert a.trace == {"ids": t}
        await store.tools_put(t, "r-1", [{"id": "call-1", "tenant": t, "name": "f", "sig": "same"}])
    assert await store.run_calls(tenant, "r-1") == await store.run_calls(other, "r-1") == 1
    taken = await admit(store, tenant, "r-2", turn=Turn(results=(("call-1", True),)))
    assert taken.closed == (), "call-1 belongs to run r-1"
    assert await store.tools_take(tenant, "r-1", ["call-1"]) == [{"id": "call-1", "tenant": tenant, "name": "f",
                                                                  "sig": "same"}]
    assert await store.tools_pending(other, "r-1") == [{"id": "call-1", "tenant": other, "name": "f", "sig": "same"}]
    assert await store.spend(other) == 100
    # Separators inside names cannot make two keys meet.
    await admit(store, tenant + ":a", "b")
    assert await store.run_calls(tenant, "a:b") == 0


# --- durability and outages -------------------------------------------------------------


async def test_sqlite_spend_survives_a_reopen(tmp_path: Path, tenant: str) -> None:
    # SQLite's own durability: a budget lease held at the close over-counts by design (its
    # unused part stands until the call ttl: test_leases.py).
    url = f"sqlite:///{tmp_path}/ledger.db"
    store = open_store(url, leases=False)
    settled = await admit(store, tenant)
    await store.settle(settled, 64)
    in_flight = await admit(store, tenant)
    await store.aclose()

    store = open_store(url, leases=False)
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
    lines = killed_after("ledger_child.py", [url], settles=300)  # with those acknowledged before the kill

    settles = [line for line in lines if line.startswith(b"settled")]
    settled = sum(int(line.split()[1]) for line in settles)
    in_flight = sum(int(line.split()[1]) for line in lines if line.startswith(b"inflight"))

    async def check() -> None:
        store = open_store(url, leases=False)
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
    store = open_store(f"sqlite:///{tmp_path}/ledger.db{query}", leases=False)
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


# --- MCP tool calls (admit_tool) ------------------------------------------------------


def _mcp(name: str = "get_weather", args: str = "paris", **kw: Any) -> ToolTurn:
    return ToolTurn(name=name, sig=f"{name}:{args}", **kw)


async def admit_tool(store: Store, tenant: str, turn: ToolTurn, run_id: str = "r-1", **kw: Any) -> Admission:
    kw.setdefault("limits", Limits())
    kw.setdefault("now", T0)
    return await store.admit_tool(Ask(tenant, run_id, **kw), turn)


async def test_a_tool_call_is_counted_reserved_at_its_cost_and_settled_like_a_model_call(
        store: Store, tenant: str) -> None:
    a = await admit_tool(store, tenant, _mcp(cost=250), limits=Limits(run_max_cost=1000))
    assert (a.reserved, a.calls, a.remaining["run_cost"]) == (250, 1, 750)
    assert await store.spend_detail(tenant, run_id="r-1") == Spend(0, 250)
    assert await store.run_calls(tenant, "r-1") == 0, "a tool call is not a model call"
    await store.settle(a, 250, run_totals={"tool_failures": 1})
    assert await store.spend_detail(tenant, run_id="r-1") == Spend(250, 0)
    b = await admit_tool(store, tenant, _mcp(args="oslo"))
    assert b.calls == 2 and b.closed[0]["streak"] == 1
    assert await store.run_totals(tenant, "r-1") == {"mcp_tool_calls": 2, "tool_calls": 2, "tool_failures": 1}


async def test_the_tool_call_ceiling_refuses_exactly_past_max_calls_under_concurrency(
        store: Store, tenant: str) -> None:
    results = await asyncio.gather(*(admit_tool(store, tenant, _mcp(args=str(i), max_calls=5)) for i in range(20)),
                                   return_exceptions=True)
    admitted = [r for r in results if isinstance(r, Admission)]
    refused = [r for r in results if isinstance(r, CeilingReached)]
    assert (len(admitted), len(refused)) == (5, 15)
    assert sorted(a.calls for a in admitted) == [1, 2, 3, 4, 5]
    assert {r.limit for r in refused} == {"run_tool_calls"}
    assert "ceiling of 5 MCP tool calls" in refused[0].message and "runs.max_tool_calls" in refused[0].message
    assert (await store.run_totals(tenant, "r-1"))["mcp_tool_calls"] == 5


async def test_a_tool_cost_counts_against_the_run_cost_ceiling_and_tenant_budgets(store: Store, tenant: str) -> None:
    await admit_tool(store, tenant, _mcp(cost=600), limits=Limits(run_max_cost=1000))
    with pytest.raises(CeilingReached) as ei:
        await admit_tool(store, tenant, _mcp(cost=600), limits=Limits(run_max_cost=1000))
    assert ei.value.limit == "run_cost"
    await store.budget_set(tenant, 700, None)  # the admin API's day budget holds for tools too
    with pytest.raises(CeilingReached) as ei:
        await admit_tool(store, tenant, _mcp(cost=200), "r-2")
    assert ei.value.limit == "tenant_day"
    free = await admit_tool(store, tenant, _mcp(cost=0), "r-2")
    assert free.reserved == 0


async def test_a_tool_call_takes_the_model_call_it_executes_by_arguments_then_by_order(
        store: Store, tenant: str) -> None:
    calls = [{"id": "c1", "name": "get_weather", "arguments": '{"city": "Oslo"}', "sig": "get_weather:oslo",
              "link": [2**127 + 3, 2**63 + 5]},
             {"id": "c2", "name": "get_weather", "arguments": '{"city": "Paris"}', "sig": "get_weather:paris"},
             {"id": "c3", "name": "read_file", "arguments": "{}", "sig": "read_file:x"}]
    await store.tools_put(tenant, "r-1", calls)
    by_args = await admit_tool(store, tenant, _mcp(args="paris"))
    assert by_args.closed[0]["id"] == "c2" and by_args.closed[0]["mcp"] is True
    by_order = await admit_tool(store, tenant, _mcp(args="rome"))  # no exact match: the earliest of that name
    assert by_order.closed[0]["id"] == "c1"
    assert by_order.closed[0]["link"] == [2**127 + 3, 2**63 + 5], "ids survive exactly (no float rounding)"
    none_left = await admit_tool(store, tenant, _mcp(args="paris"))
    assert "id" not in none_left.closed[0], "a model call is executed once"
    # The request carrying the results still closes them, marked: no inferred span follows.
    a = await admit(store, tenant, turn=Turn(results=(("c1", True), ("c2", True), ("c3", True))))
    assert [(c["id"], c.get("mcp", False)) for c in a.closed] == [("c1", True), ("c2", True), ("c3", False)]
    # Matched calls were counted when the model made them: only the unmatched one is new.
    assert await store.run_totals(tenant, "r-1") == {"mcp_tool_calls": 3, "tool_calls": 1}


async def test_the_loop_guard_counts_identical_tool_calls_and_refuses_from_the_threshold(
        store: Store, tenant: str) -> None:
    remind = GuardRule(threshold=3, refuse=False)
    streaks = [(await admit_tool(store, tenant, _mcp(args=a, guard=remind))).closed[0]["streak"] for a in "xxxyxx"]
    assert streaks == [1, 2, 3, 1, 1, 2]
    refuse = GuardRule(threshold=3, refuse=True)
    await admit_tool(store, tenant, _mcp(args="x", guard=refuse), "r-2")
    await admit_tool(store, tenant, _mcp(args="x", guard=refuse), "r-2")
    with pytest.raises(LoopRefused) as ei:
        await admit_tool(store, tenant, _mcp(args="x", guard=refuse), "r-2")
    assert "called the tool `get_weather` 3 times in a row" in ei.value.message
    assert ei.value.closed[0]["streak"] == 3
    assert (await store.run_totals(tenant, "r-2"))["mcp_tool_calls"] == 2, "a refused call is not counted"


async def test_a_refused_tool_call_still_marks_its_model_call_and_fixes_the_trace(store: Store, tenant: str) -> None:
    await store.tools_put(tenant, "r-1", [{"id": "c1", "name": "get_weather", "arguments": "{}", "sig": "x"}])
    with pytest.raises(CeilingReached) as ei:
        await admit_tool(store, tenant, _mcp(max_calls=0, trace={"ids": "first"}))
    assert ei.value.closed[0]["id"] == "c1" and ei.value.trace == {"ids": "first"}
    assert (await store.tools_pending(tenant, "r-1"))[0]["mcp"] is True
    b = await admit(store, tenant, turn=Turn(trace={"ids": "second"}))
    assert b.trace == {"ids": "first"}


async def test_a_request_that_is_not_a_tool_call_only_keeps_the_trace(store: Store, tenant: str) -> None:
    a = await admit_tool(store, tenant, ToolTurn(trace={"ids": "t1"}))
    assert (a.id, a.reserved, a.closed, a.trace) == ("", 0, (), {"ids": "t1"})
    again = await admit_tool(store, tenant, ToolTurn(trace={"ids": "t2"}))
    assert again.trace == {"ids": "t1"}
    assert await store.run_totals(tenant, "r-1") == {}
    assert await store.spend(tenant, run_id="r-1") == 0
# --- rate limits (GCRA inside the admission) ----------------------------------------------


def _rates(*rates: Rate, key: str | None = None) -> Turn:
    return Turn(rates=rates, key=key)


async def _limited(coros: list[Any]) -> tuple[list[Admission], list[RateLimited]]:
    results = await asyncio.gather(*coros, return_exceptions=True)
    ok = [r for r in results if isinstance(r, Admission)]
    limited = [r for r in results if isinstance(r, RateLimited)]
    assert len(ok) + len(limited) == len(results), [r for r in results if not isinstance(r, Admission | RateLimited)]
    return ok, limited


async def test_500_concurrent_admissions_against_100_requests_a_minute_admit_exactly_100(
        store: Store, tenant: str) -> None:
    turn = _rates(Rate("tenant", "requests", 100, 1))
    ok, limited = await _limited([admit(store, tenant, f"r-{i % 7}", turn=turn) for i in range(500)])
    assert (len(ok), len(limited)) == (100, 400)
    assert sum([await store.run_calls(tenant, f"r-{i}") for i in range(7)]) == 100, "a refused call counts nothing"
    assert await store.spend(tenant) == 100 * 100, "and reserves nothing"
    assert sorted(a.rates[0].remaining for a in ok) == list(range(100))
    refusal = limited[0]
    assert (refusal.status, refusal.limit, refusal.wait_ms) == (429, "rate_requests", 600)
    assert refusal.headers() == {
        "x-should-retry": "true", "retry-after": "1", "retry-after-ms": "600",
        "x-ratelimit-limit-requests": "100", "x-ratelimit-remaining-requests": "0",
        "x-ratelimit-reset-requests": "1m0s"}
    assert "rate limit of 100 requests per minute (tenant setting rate_limits.requests_per_minute)" in refusal.message


async def test_tokens_per_minute_count_each_calls_tokens_exactly_under_concurrency(store: Store, tenant: str) -> None:
    turn = _rates(Rate("tenant", "tokens", 1_000, 30))
    ok, limited = await _limited([admit(store, tenant, turn=turn) for _ in range(300)])
    assert (len(ok), len(limited)) == (33, 267)  # 33 x 30 = 990; 10 tokens left
    assert limited[0].limit == "rate_tokens"
    assert "this call counts 30 tokens and 10 are free now" in limited[0].message
    assert limited[0].rate_headers["x-ratelimit-remaining-tokens"] == "10"


async def test_the_window_rolls_with_the_admission_clock(store: Store, tenant: str) -> None:
    turn = _rates(Rate("tenant", "requests", 100, 1))
    for _ in range(100):
        await admit(store, tenant, turn=turn)
    with pytest.raises(RateLimited) as ei:
        await admit(store, tenant, turn=turn, now=T0 + timedelta(milliseconds=599))
    assert ei.value.wait_ms == 1, "one unit comes back every 0.6 s"
    one = await admit(store, tenant, turn=turn, now=T0 + timedelta(milliseconds=600))
    assert one.rates[0].remaining == 0
    later = T0 + timedelta(seconds=30, milliseconds=600)  # 30 s more: half the window, 50 requests
    ok, limited = await _limited([admit(store, tenant, turn=turn, now=later) for _ in range(80)])
    assert (len(ok), len(limited)) == (50, 30)
    assert max(a.rates[0].reset_ms for a in ok) == 60_000, "the last one in fills the bucket"
    whole = later + timedelta(seconds=60)
    ok, _ = await _limited([admit(store, tenant, turn=turn, now=whole) for _ in range(120)])
    assert len(ok) == 100, "after a whole window the bucket is full again, never fuller"


async def test_a_clock_going_back_gives_nothing_back(store: Store, tenant: str) -> None:
    turn = _rates(Rate("tenant", "requests", 2, 1))
    await admit(store, tenant, turn=turn, now=T0 + timedelta(seconds=10))
    await admit(store, tenant, turn=turn, now=T0 + timedelta(seconds=10))
    with pytest.raises(RateLimited):  # another replica's clock is 5 s behind
        await admit(store, tenant, turn=turn, now=T0 + timedelta(seconds=5))
    await admit(store, tenant, turn=turn, now=T0 + timedelta(seconds=40))  # 30 s after the last: one back
    with pytest.raises(RateLimited):
        await admit(store, tenant, turn=turn, now=T0 + timedelta(seconds=40))


async def test_a_key_and_its_tenant_both_hold_and_the_tighter_speaks(store: Store, tenant: str) -> None:
    def turn(key: str) -> Turn:
        return _rates(Rate("tenant", "requests", 8, 1), Rate(f"key {key}", "requests", 5, 1), key=key)

    a = [await admit(store, tenant, turn=turn("aaaa1111")) for _ in range(5)]
    assert [x.rates[1].remaining for x in a] == [4, 3, 2, 1, 0]
    with pytest.raises(RateLimited) as ei:
        await admit(store, tenant, turn=turn("aaaa1111"))
    assert "Key aaaa1111 of tenant" in ei.value.message and "key setting rate_limits" in ei.value.message
    assert ei.value.rate_headers["x-ratelimit-remaining-requests"] == "0"
    assert ei.value.rate_headers["x-ratelimit-limit-requests"] == "5"
    for _ in range(3):
        await admit(store, tenant, turn=turn("bbbb2222"))  # the tenant's 8 are now used
    with pytest.raises(RateLimited) as ei:
        await admit(store, tenant, turn=turn("bbbb2222"))
    assert ei.value.message.startswith(f"Tenant {tenant} is over its rate limit of 8 requests per minute")
    assert ei.value.rate_headers["x-ratelimit-limit-requests"] == "8"


async def test_a_call_larger_than_its_token_rate_is_refused_for_good(store: Store, tenant: str) -> None:
    with pytest.raises(RateLimited) as ei:
        await admit(store, tenant, turn=_rates(Rate("tenant", "tokens", 1_000, 1_001)))
    assert ei.value.wait_ms is None and ei.value.headers()["x-should-retry"] == "false"
    assert "retry-after" not in ei.value.headers()
    assert "can never be admitted" in ei.value.message
    a = await admit(store, tenant, turn=_rates(Rate("tenant", "tokens", 1_000, 1_000)))
    assert a.rates[0].remaining == 0, "the refused call took nothing from the bucket"


async def test_a_ceiling_is_refused_before_a_rate_limit_and_keeps_the_bucket(store: Store, tenant: str) -> None:
    turn = _rates(Rate("tenant", "requests", 1, 1))
    await admit(store, tenant, limits=Limits(run_max_calls=1), turn=turn)
    with pytest.raises(CeilingReached):  # no retry would help: 402, not 429
        await admit(store, tenant, limits=Limits(run_max_calls=1), turn=turn)
    with pytest.raises(RateLimited):
        await admit(store, tenant, "r-2", turn=turn)


# --- run ceilings on tokens and wall time -------------------------------------------------


async def test_the_token_ceiling_counts_settled_input_and_output(store: Store, tenant: str) -> None:
    limits = Limits(run_max_tokens=1_000, origin={"run_tokens": "tenant setting runs.max_tokens"})
    a = await admit(store, tenant, limits=limits)
    assert a.run_tokens == 0
    await store.settle(a, 5, run_totals={"input_tokens": 600, "output_tokens": 399, "model_calls": 1})
    b = await admit(store, tenant, limits=limits)
    assert b.run_tokens == 999, "settled calls only: the call in flight is not counted"
    await store.settle(b, 5, run_totals={"input_tokens": 1, "output_tokens": 0})
    with pytest.raises(CeilingReached) as ei:
        await admit(store, tenant, limits=limits)
    assert ei.value.limit == "run_tokens"
    assert ei.value.message == (
        f"Run r-1 of tenant {tenant} reached its ceiling of 1,000 tokens (tenant setting runs.max_tokens): its "
        "answered calls used 1,000 input and output tokens. The call was not forwarded and nothing was charged. "
        "Raise runs.max_tokens for this tenant or start a new run.")
    assert await store.run_calls(tenant, "r-1") == 2


async def test_the_time_ceiling_runs_from_the_runs_first_call(store: Store, tenant: str) -> None:
    limits = Limits(run_max_seconds=90)
    first = await admit(store, tenant, limits=limits, now=T0)
    assert first.started_at == T0.timestamp()
    later = await admit(store, tenant, limits=limits, now=T0 + timedelta(seconds=89.5))
    assert later.started_at == T0.timestamp()
    with pytest.raises(CeilingReached) as ei:
        await admit(store, tenant, limits=limits, now=T0 + timedelta(seconds=90))
    assert ei.value.limit == "run_seconds"
    assert "ceiling of 90 s of wall time (setting runs.max_seconds): its first call arrived 90 s ago" in (
        ei.value.message)
    other = await admit(store, tenant, "r-2", limits=limits, now=T0 + timedelta(seconds=95))
    assert other.started_at == (T0 + timedelta(seconds=95)).timestamp(), "each run has its own clock"


# --- per-key budgets ---------------------------------------------------------------------


async def test_a_keys_budget_holds_within_its_tenants(store: Store, tenant: str) -> None:
    limits = Limits(day_budget=1_000, key_day_budget=300, key_month_budget=10_000)
    a = await admit(store, tenant, limits=limits, turn=Turn(key="k1k1k1k1"))
    assert a.remaining == {"run_cost": None, "tenant_day": 900, "tenant_month": None, "key_day": 200,
                           "key_month": 9_900}
    await store.settle(a, 250)
    b = await admit(store, tenant, min_reserve=10, max_reserve=100, limits=limits, turn=Turn(key="k1k1k1k1"))
    assert b.reserved == 50, "cut to what the key's day has left"
    with pytest.raises(CeilingReached) as ei:
        await admit(store, tenant, limits=limits, turn=Turn(key="k1k1k1k1"))
    assert ei.value.limit == "key_day"
    assert ei.value.message.startswith(
        f"Key k1k1k1k1 of tenant {tenant} reached its daily budget of $0.0003 for 2026-05-14 (UTC)")
    assert "tenants." in ei.value.message and ".keys in the config" in ei.value.message
    c = await admit(store, tenant, limits=limits, turn=Turn(key="k2k2k2k2"))  # another key has its own
    assert c.remaining["key_day"] == 200 and c.remaining["tenant_day"] == 600
    assert await store.spend(tenant, day="2026-05-14", key_id="k1k1k1k1") == 300
    assert await store.spend(tenant, month="2026-05", key_id="k2k2k2k2") == 100
    assert await store.spend(tenant, day="2026-05-14") == 400
    await store.settle(b, 20)
    await store.release(c)
    assert await store.spend_detail(tenant, day="2026-05-14", key_id="k1k1k1k1") == Spend(270, 0)
    assert await store.spend(tenant, day="2026-05-14", key_id="k2k2k2k2") == 0


async def test_an_expired_reservation_is_charged_on_its_keys_scopes_too(store: Store, tenant: str) -> None:
    past = datetime(2001, 2, 1, tzinfo=UTC)  # apart from every other test's reservations (shared Redis)
    await admit(store, tenant, ttl_s=60, now=past, turn=Turn(key="kkkkexpd"))
    assert await store.expire(past + timedelta(seconds=61)) == 1
    assert await store.spend_detail(tenant, day="2001-02-01", key_id="kkkkexpd") == Spend(100, 0)


async def test_spend_of_a_key_needs_a_day_or_a_month(store: Store, tenant: str) -> None:
    with pytest.raises(ValueError, match="day or a month"):
        await store.spend(tenant, key_id="k1k1k1k1")


# --- MCP tool calls under a key's limits, the rates and the run's clock (issue 26) ---------


async def test_a_tool_call_holds_money_on_its_keys_scopes_and_is_refused_by_them(store: Store, tenant: str) -> None:
    limits = Limits(day_budget=10_000, key_day_budget=500, key_month_budget=10_000)
    a = await admit_tool(store, tenant, _mcp(cost=300, key="kmcpkmcp"), limits=limits)
    assert a.remaining["key_day"] == 200 and a.key == "kmcpkmcp"
    assert await store.spend_detail(tenant, day="2026-05-14", key_id="kmcpkmcp") == Spend(0, 300)
    with pytest.raises(CeilingReached) as ei:
        await admit_tool(store, tenant, _mcp(args="oslo", cost=300, key="kmcpkmcp"), "r-2", limits=limits)
    assert ei.value.limit == "key_day" and ei.value.message.startswith(f"Key kmcpkmcp of tenant {tenant}")
    await store.settle(a, 300)
    assert await store.spend_detail(tenant, month="2026-05", key_id="kmcpkmcp") == Spend(300, 0)
    other = await admit_tool(store, tenant, _mcp(cost=300, key="kothkoth"), "r-3", limits=limits)
    assert other.remaining["key_day"] == 200, "another key has its own day"


async def test_concurrent_tool_calls_never_cross_a_keys_day(store: Store, tenant: str) -> None:
    limits = Limits(key_day_budget=30_000)
    results = await asyncio.gather(*(admit_tool(store, tenant, _mcp(args=str(i), cost=10_000, key="kconkcon"),
                                                f"r-{i}", limits=limits) for i in range(40)), return_exceptions=True)
    assert sum(isinstance(r, Admission) for r in results) == 3
    assert await store.spend(tenant, day="2026-05-14", key_id="kconkcon") == 30_000


async def test_an_expired_tool_reservation_is_charged_on_its_keys_scopes(store: Store, tenant: str) -> None:
    past = datetime(2001, 3, 1, tzinfo=UTC)
    await admit_tool(store, tenant, _mcp(cost=70, key="kexpkexp"), ttl_s=60, now=past)
    assert await store.expire(past + timedelta(seconds=61)) == 1
    assert await store.spend_detail(tenant, day="2001-03-01", key_id="kexpkexp") == Spend(70, 0)


async def test_every_mcp_request_draws_on_the_requests_per_minute(store: Store, tenant: str) -> None:
    rates = (Rate("tenant", "requests", 3, 1),)
    listing = await admit_tool(store, tenant, ToolTurn(rates=rates))
    assert listing.id == "" and listing.rates[0].remaining == 2
    await admit_tool(store, tenant, _mcp(rates=rates))
    results = await asyncio.gather(*(admit_tool(store, tenant, _mcp(args=str(i), rates=rates)) for i in range(10)),
                                   return_exceptions=True)
    assert sum(isinstance(r, Admission) for r in results) == 1
    limited = [r for r in results if isinstance(r, RateLimited)]
    assert len(limited) == 9 and limited[0].limit == "rate_requests" and limited[0].wait_ms
    with pytest.raises(RateLimited):
        await admit_tool(store, tenant, ToolTurn(rates=rates))
    assert (await store.run_totals(tenant, "r-1"))["mcp_tool_calls"] == 2, "a limited call is not counted"
    later = await admit_tool(store, tenant, ToolTurn(rates=rates), now=T0 + timedelta(seconds=20))
    assert later.rates[0].remaining == 0, "one request came back after 20 s"


async def test_a_tool_call_past_the_runs_wall_time_is_refused(store: Store, tenant: str) -> None:
    limits = Limits(run_max_seconds=60)
    await admit(store, tenant, limits=limits, now=T0)
    a = await admit_tool(store, tenant, _mcp(), limits=limits, now=T0 + timedelta(seconds=59))
    assert a.started_at == T0.timestamp()
    with pytest.raises(CeilingReached) as ei:
        await admit_tool(store, tenant, _mcp(args="oslo"), limits=limits, now=T0 + timedelta(seconds=60))
    assert ei.value.limit == "run_seconds" and "its first call arrived 60 s ago" in ei.value.message


# --- token ceilings reserved like cost (issue 26 item 3) -------------------------------------


async def test_tokens_are_held_at_admission_cut_to_the_headroom_and_replaced_at_settle(
        store: Store, tenant: str) -> None:
    free = await admit(store, tenant, "r-free", turn=Turn(tokens=(600, 4_000)))
    assert free.tokens == 0, "nothing held where no token ceiling reads it"
    limits = Limits(run_max_tokens=5_000)
    a = await admit(store, tenant, limits=limits, turn=Turn(tokens=(600, 4_000)))
    assert a.tokens == 4_000
    b = await admit(store, tenant, limits=limits, turn=Turn(tokens=(600, 4_000)))
    assert b.tokens == 1_000, "cut to what the run has left"
    with pytest.raises(CeilingReached) as ei:
        await admit(store, tenant, limits=limits, turn=Turn(tokens=(600, 4_000)))
    assert ei.value.limit == "run_tokens"
    assert "its answered calls used 0 input and output tokens, and 5,000 are held by its calls in flight" in (
        ei.value.message)
    await store.settle(a, 5, run_totals={"input_tokens": 700, "output_tokens": 300})
    c = await admit(store, tenant, limits=limits, turn=Turn(tokens=(600, 4_000)))
    assert c.tokens == 3_000 and c.run_tokens == 1_000, "5,000 - 1,000 settled - 1,000 held by b"
    with pytest.raises(CeilingReached) as ei:
        await admit(store, tenant, limits=limits, turn=Turn(tokens=(600, 4_000)))
    assert "This call needs at least 600" not in ei.value.message, "nothing left at all"


async def test_a_call_whose_least_does_not_fit_is_refused_saying_what_it_needs(store: Store, tenant: str) -> None:
    limits = Limits(run_max_tokens=1_000)
    await admit(store, tenant, limits=limits, turn=Turn(tokens=(100, 700)))
    with pytest.raises(CeilingReached) as ei:
        await admit(store, tenant, limits=limits, turn=Turn(tokens=(400, 900)))
    assert "700 are held by its calls in flight. This call needs at least 400" in ei.value.message


async def test_concurrent_calls_never_cross_a_token_ceiling(store: Store, tenant: str) -> None:
    limits = Limits(run_max_tokens=5_000)
    ok, refused = await outcomes([admit(store, tenant, limits=limits, turn=Turn(tokens=(300, 1_100)))
                                  for _ in range(40)])
    assert sum(a.tokens for a in ok) <= 5_000 and len(ok) == 5 and len(refused) == 35
    assert {r.limit for r in refused} == {"run_tokens"}


async def test_two_stores_on_one_ledger_share_a_runs_token_ceiling(url: str, tenant: str) -> None:
    stores = [open_store(url), open_store(url)]
    try:
        limits = Limits(run_max_tokens=5_000)
        ok, _ = await outcomes([admit(stores[i % 2], tenant, limits=limits, turn=Turn(tokens=(300, 1_000)))
                                for i in range(40)])
        assert sum(a.tokens for a in ok) == 5_000
    finally:
        for s in stores:
            await s.aclose()


async def test_an_expired_token_reservation_is_charged_and_a_late_settle_corrects_it(
        store: Store, tenant: str) -> None:
    past = datetime(2001, 4, 1, tzinfo=UTC)
    limits = Limits(run_max_tokens=1_000)
    a = await admit(store, tenant, limits=limits, ttl_s=60, now=past, turn=Turn(tokens=(100, 800)))
    assert await store.expire(past + timedelta(seconds=61)) == 1
    later = past + timedelta(seconds=62)
    b = await admit(store, tenant, limits=limits, now=later, turn=Turn(tokens=(100, 800)))
    assert (b.run_tokens, b.tokens) == (800, 200), "the expired call counts at the tokens it held"
    await store.settle(a, 5, run_totals={"input_tokens": 50, "output_tokens": 50})
    await store.release(b)
    c = await admit(store, tenant, limits=limits, now=later, turn=Turn(tokens=(100, 800)))
    assert (c.run_tokens, c.tokens) == (100, 800), "the late settle put the real count in its place"


async def test_estimated_tokens_of_an_unread_answer_count_against_the_ceiling(store: Store, tenant: str) -> None:
    limits = Limits(run_max_tokens=1_000)
    a = await admit(store, tenant, limits=limits, turn=Turn(tokens=(100, 900)))
    await store.settle(a, 5, run_totals={"input_tokens": 40, "estimated_tokens": 860})
    b = await admit(store, tenant, limits=limits, turn=Turn(tokens=(50, 900)))
    assert (b.run_tokens, b.tokens) == (900, 100)


# --- runs written whole (budget leases' runs of one call) --------------------------------


async def test_a_run_written_whole_reads_as_a_run(store: Store, tenant: str) -> None:
    """What budget leases keep of a run of one call reads, once written, as the same run made
    through admit, settle and run_end: its row, its spend, its totals, ended."""
    t = T0.timestamp()
    await store.runs_record([WholeRun(tenant, "solo-1", 1, t, t + 1, {"ids": "x1"}, 250,
                                      {"model_calls": 1, "cost_micros": 250}, ended_at=t + 1)])
    [run] = await store.list_runs(tenant)
    assert (run["run_id"], run["calls"], run["ended"], run["trace"]) == ("solo-1", 1, True, {"ids": "x1"})
    assert (run["settled"], run["reserved"], run["first_seen"], run["last_seen"]) == (250, 0, t, t + 1)
    assert run["totals"] == {"model_calls": 1, "cost_micros": 250}
    assert await store.spend(tenant, run_id="solo-1") == 250
    assert await store.run_end(tenant, "solo-1") is None  # ended: no second run span
    assert (tenant, "solo-1") not in await store.idle_runs(T0 + timedelta(days=1))


async def test_a_run_written_whole_adds_to_what_the_run_holds(store: Store, tenant: str) -> None:
    """Written open (it lived too long in memory), a run is swept as idle like any other;
    written onto a run the store already holds, its calls, money and totals add up."""
    t = T0.timestamp()
    a = await admit(store, tenant, "r-both", turn=Turn(trace={"ids": "first"}))
    await store.settle(a, 40, run_totals={"model_calls": 1, "cost_micros": 40})
    await store.runs_record([WholeRun(tenant, "r-both", 1, t - 5, t + 2, {"ids": "second"}, 60,
                                      {"model_calls": 1, "cost_micros": 60}),
                             WholeRun(tenant, "r-open", 1, t, t, None, 0, {"model_calls": 1})])
    assert {r for t, r in await store.idle_runs(T0 + timedelta(days=1)) if t == tenant} == {"r-both", "r-open"}
    rec = await store.run_end(tenant, "r-both")
    assert rec is not None
    assert (rec["calls"], rec["settled"], rec["trace"]) == (2, 100, {"ids": "first"})  # the first stored wins
    assert (rec["first_seen"], rec["last_seen"]) == (t - 5, t + 2)
    assert rec["totals"] == {"model_calls": 2, "cost_micros": 100}
    assert await store.run_calls(tenant, "r-open") == 1


async def test_a_run_written_whole_counts_its_totals_wherever_they_are_read(store: Store, tenant: str) -> None:
    """A run written whole first, then added to (a late settle written whole onto it, a
    run_add, a tool call's count): every reader sees the sum, and the run's token ceiling
    counts what it was written with."""
    t = T0.timestamp()
    whole = {"model_calls": 1, "input_tokens": 600, "output_tokens": 100, "cost_micros": 70}
    await store.runs_record([WholeRun(tenant, "w-1", 1, t, t, None, 70, whole),
                             WholeRun(tenant, "w-1", 1, t, t + 1, None, 30, {"model_calls": 1, "cost_micros": 30})])
    await store.runs_record([WholeRun(tenant, "w-1", 1, t + 2, t + 2, None, 5, {"output_tokens": 50})])
    await store.run_add(tenant, "w-1", {"tool_results_missing": 1, "cost_micros": 1})
    expected = {"model_calls": 2, "input_tokens": 600, "output_tokens": 150, "cost_micros": 101,
                "tool_results_missing": 1}
    assert await store.run_totals(tenant, "w-1") == expected
    [run] = [r for r in await store.list_runs(tenant) if r["run_id"] == "w-1"]
    assert (run["calls"], run["settled"], run["totals"]) == (3, 105, expected)
    limits = Limits(run_max_tokens=1_000)  # 750 of them used: a call needing 300 does not fit
    with pytest.raises(CeilingReached) as ei:
        await admit(store, tenant, "w-1", limits=limits, turn=Turn(tokens=(300, 300)))
    assert ei.value.limit == "run_tokens"
    await admit(store, tenant, "w-1", limits=limits, turn=Turn(tokens=(200, 200)))
    rec = await store.run_end(tenant, "w-1")
    assert rec is not None and rec["totals"] == expected


async def test_a_run_of_one_call_ends_the_same_whether_held_in_memory_or_not(store: Store, tenant: str) -> None:
    """`end_held` ends a run this process holds in memory (budget leases' runs of one call
    after the tenant's first) as `run_end` plus taking its tool calls would: the same record
    and tool calls, once; what its end adds reaches its row. A store of its own holds none."""
    from proxy.ledger.leases import LeasedStore

    held = 0
    for i in range(6):
        run = f"one-{i}"
        a = await admit(store, tenant, run, turn=Turn(trace={"ids": f"x{i}"}, solo=True))
        await store.settle(a, 30, run_totals={"model_calls": 1, "cost_micros": 30},
                           tools=[{"id": f"c{i}", "name": "search", "sig": "s"}])
        end = store.end_held(tenant, run)
        if end is None:
            rec = await store.run_end(tenant, run)
            assert rec is not None
            tools = await store.tools_take(tenant, run, [f"c{i}"])
            await store.run_add(tenant, run, {"tool_results_missing": 1})
        else:
            held += 1
            rec, tools = end.record, end.tools
            end.add({"tool_results_missing": 1})
        assert (rec["run_id"], rec["calls"], rec["settled"], rec["ended"], rec["trace"]) == (
            run, 1, 30, True, {"ids": f"x{i}"})
        assert rec["totals"] == {"model_calls": 1, "cost_micros": 30}
        assert [t["id"] for t in tools] == [f"c{i}"]
        assert store.end_held(tenant, run) is None and await store.run_end(tenant, run) is None, "ended once"
        assert await store.tools_pending(tenant, run) == []
    if isinstance(store, LeasedStore):
        assert held == 5, "every run of one call after the tenant's first is held"
    else:
        assert held == 0
    rows = {r["run_id"]: r for r in await store.list_runs(tenant)}
    assert sorted(rows) == [f"one-{i}" for i in range(6)]
    assert all(r["ended"] and r["totals"] == {"model_calls": 1, "cost_micros": 30, "tool_results_missing": 1}
               for r in rows.values())


async def test_a_runs_guard_state_set_is_where_its_next_close_counts_from(store: Store, tenant: str) -> None:
    """What budget leases write back after closing tool calls in memory: the next close of the
    same call continues the streak from it, and the failures count on."""
    a = await admit(store, tenant, "r-g")
    await store.settle(a, 1, tools=[{"id": "c1", "name": "search", "sig": "s-1"}])
    await store.run_guard(tenant, "r-g", ("s-1", 4, 2))
    b = await admit(store, tenant, "r-g", turn=Turn(results=(("c1", False),)))
    assert [(c["id"], c["streak"], c["failures"]) for c in b.closed] == [("c1", 5, 3)]
