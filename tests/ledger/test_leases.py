"""Budget leases (proxy/ledger/leases.py) on real SQLite and a real redis-server: a hot run's
calls are served from a lease, the ceilings hold exactly as without, and a kill -9 mid-load
only over-counts. The whole store contract runs leased too (test_store_contract.py)."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime
from pathlib import Path

import pytest

from proxy.errors import CeilingReached, LoopRefused
from proxy.ledger.backends import open_store
from proxy.ledger.leases import HOT_AFTER, LEASE_CALLS, LeasedStore
from proxy.ledger.store import Ask, GuardRule, Limits, Spend, Store, Turn
from tests.ledger.children import killed_after
from tests.ledger.test_store_contract import T0

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
async def pair(ledger: str) -> tuple[Store, Store]:
    """A leased store and a plain one on the same ledger (what another worker sees)."""
    leased, plain = open_store(ledger, leases=True), open_store(ledger, leases=False)
    yield leased, plain
    await leased.aclose()
    await plain.aclose()


def _ask(tenant: str, limits: Limits) -> Ask:
    return Ask(tenant, "hot", T0, limits)


async def test_a_hot_run_is_served_from_a_lease_that_stands_as_spent(pair: tuple[Store, Store]) -> None:
    leased, plain = pair
    assert isinstance(leased, LeasedStore)
    tenant, limits = f"t-{uuid.uuid4().hex[:8]}", Limits(run_max_calls=10_000, day_budget=10**9)
    for _ in range(10):
        await leased.settle(await leased.admit(_ask(tenant, limits), Turn(reserve=(1, 100))), 40)
    # What the call's path sees: exact.
    assert await leased.spend(tenant, run_id="hot") == 400
    assert await leased.run_calls(tenant, "hot") == 10
    # What the ledger holds meanwhile: the whole lease, calls and money, as spent.
    assert await plain.run_calls(tenant, "hot") == HOT_AFTER + LEASE_CALLS
    assert await plain.spend(tenant, day="2026-05-14") >= 400
    await leased.aclose()  # returns the lease
    assert await plain.run_calls(tenant, "hot") == 10
    assert await plain.spend_detail(tenant, run_id="hot") == await plain.spend_detail(tenant, day="2026-05-14")
    assert await plain.spend(tenant, run_id="hot") == 400


@pytest.mark.parametrize("cap", [5, 40, 100])
async def test_sequential_calls_stop_exactly_at_the_call_ceiling(pair: tuple[Store, Store], cap: int) -> None:
    leased, plain = pair
    tenant, limits = f"t-{uuid.uuid4().hex[:8]}", Limits(run_max_calls=cap)
    made = 0
    with pytest.raises(CeilingReached) as ei:
        while True:
            await leased.settle(await leased.admit(_ask(tenant, limits), Turn(reserve=(1, 10))), 10)
            made += 1
    assert ei.value.limit == "run_calls" and made == cap
    assert await leased.run_calls(tenant, "hot") == cap
    await leased.aclose()
    assert await plain.run_calls(tenant, "hot") == cap


async def test_concurrent_leased_calls_never_cross_a_cost_ceiling(pair: tuple[Store, Store]) -> None:
    leased, plain = pair
    tenant, limits = f"t-{uuid.uuid4().hex[:8]}", Limits(run_max_cost=20_000)

    async def agent() -> int:
        spent = 0
        while True:
            try:
                a = await leased.admit(_ask(tenant, limits), Turn(reserve=(30, 30)))
            except CeilingReached:
                return spent
            await asyncio.sleep(0)
            await leased.settle(a, 30)
            spent += 30

    spent = sum(await asyncio.gather(*(agent() for _ in range(8))))
    assert spent <= 20_000
    await leased.aclose()
    assert spent == await plain.spend(tenant, run_id="hot") <= 20_000


async def test_a_used_up_lease_goes_back_at_its_last_calls_settle(pair: tuple[Store, Store]) -> None:
    """Not when it expires: until it goes back, another process reads its unused part as spent."""
    leased, plain = pair
    assert isinstance(leased, LeasedStore)
    tenant, limits = f"t-{uuid.uuid4().hex[:8]}", Limits(day_budget=10**9)
    made = [await leased.admit(_ask(tenant, limits), Turn(reserve=(1, 100))) for _ in range(HOT_AFTER + LEASE_CALLS)]
    assert [a.id.startswith("lease-") for a in made] == [False] * HOT_AFTER + [True] * LEASE_CALLS
    for a in made:
        await leased.settle(a, 40)
    # Every call of the lease served and settled: the ledger holds what they cost, no more.
    assert await plain.spend_detail(tenant, day="2026-05-14") == Spend(40 * (HOT_AFTER + LEASE_CALLS), 0)
    assert await plain.run_calls(tenant, "hot") == HOT_AFTER + LEASE_CALLS


async def test_a_lease_is_taken_whole_or_not_at_all(pair: tuple[Store, Store]) -> None:
    """A run sized its lease from headroom another process has spent since: the lease the
    ledger can no longer hold whole is not taken cut short (its rest would stand unused as
    spent); the call takes the exact path."""
    leased, plain = pair
    tenant, limits = f"t-{uuid.uuid4().hex[:8]}", Limits(day_budget=100 * (HOT_AFTER + 8 * LEASE_CALLS + 10))
    for _ in range(HOT_AFTER):  # hot: its next call leases, sized from the headroom these left
        await leased.settle(await leased.admit(_ask(tenant, limits), Turn(reserve=(100, 100))), 100)
    other = await plain.admit(Ask(tenant, "other", T0, limits), Turn(reserve=(100, 100 * 8 * LEASE_CALLS)))
    await plain.settle(other, other.reserved)  # what is left holds 10 calls, not a lease of 32
    a = await leased.admit(_ask(tenant, limits), Turn(reserve=(100, 100)))
    assert not a.id.startswith("lease-")
    assert await plain.spend_detail(tenant, day="2026-05-14") == Spend(100 * (HOT_AFTER + 8 * LEASE_CALLS), 100)


def test_kill_9_with_leases_only_over_counts(ledger: str) -> None:
    admitted, charged = _kill_mid_load(ledger)

    async def check() -> None:
        store = open_store(ledger, leases=False)
        try:
            spend = await store.spend("crash", run_id="hot")
            calls = await store.run_calls("crash", "hot")
            assert spend >= charged, "a crash must never under-count money"
            assert calls >= len(admitted), "nor calls"
            assert calls <= 5_000 and spend <= 5_000 * 100, "and no ceiling is crossed"
        finally:
            await store.aclose()

    asyncio.run(check())


async def _hot(leased: Store, tenant: str, limits: Limits, calls: int = 5) -> None:
    for _ in range(calls):
        await leased.settle(await leased.admit(_ask(tenant, limits), Turn(reserve=(1, 100))), 40)


async def test_the_tool_calls_of_a_leased_call_are_closed_by_the_next_lease(pair: tuple[Store, Store]) -> None:
    """A lease that closed nothing does not know the run's loop-guard state: a call whose
    results answer its calls is admitted by a new lease, whose admission closes them."""
    leased, plain = pair
    tenant, limits = f"t-{uuid.uuid4().hex[:8]}", Limits()
    await _hot(leased, tenant, limits)
    a = await leased.admit(_ask(tenant, limits), Turn(reserve=(1, 100)))
    assert a.id.startswith("lease-")
    await leased.settle(a, 40, run_totals={"model_calls": 1}, tools=[{"id": "c1", "name": "search", "sig": "s"}])
    nxt = await leased.admit(_ask(tenant, limits), Turn(reserve=(1, 100), results=(("c1", True),)))
    assert [c["id"] for c in nxt.closed] == ["c1"]
    assert (await plain.run_totals(tenant, "hot"))["model_calls"] == 1, "the first lease went back first"
    assert not await plain.tools_pending(tenant, "hot")
    await leased.settle(nxt, 40)
    await leased.aclose()
    assert await plain.run_calls(tenant, "hot") == 7, "the leases' unused calls were given back"


async def test_a_leased_call_still_in_flight_keeps_its_lease_as_spent(pair: tuple[Store, Store]) -> None:
    leased, plain = pair
    tenant, limits = f"t-{uuid.uuid4().hex[:8]}", Limits()
    await _hot(leased, tenant, limits)
    first = await leased.admit(_ask(tenant, limits), Turn(reserve=(1, 100)))
    slow = await leased.admit(_ask(tenant, limits), Turn(reserve=(1, 100)))
    await leased.settle(first, 40, tools=[{"id": "c1", "name": "search", "sig": "s"}])
    nxt = await leased.admit(_ask(tenant, limits), Turn(reserve=(1, 100), results=(("c1", True),)))
    assert [c["id"] for c in nxt.closed] == ["c1"], "written behind before the next lease"
    # The lease stands as spent in the ledger until its last call settles; views stay exact here.
    assert await plain.spend(tenant, run_id="hot") >= 5 * 40 + 40 + 100 + 100
    assert await leased.spend(tenant, run_id="hot") == 5 * 40 + 40 + 100 + 100
    await leased.settle(slow, 30)
    await leased.settle(nxt, 20)
    await leased.aclose()
    assert await plain.spend(tenant, run_id="hot") == 5 * 40 + 40 + 30 + 20
    assert await plain.run_calls(tenant, "hot") == 8


async def test_a_power_cut_after_the_leases_fsync_only_over_counts(tmp_path: Path) -> None:
    """A power cut loses whatever reached the WAL after its last fsync. The lease's admission
    is fsynced before any call is served from it (synchronous=full): cut the WAL back to the
    end of that admission, after the lease has served calls and been given back, and the
    ledger that is left still counts every call and at least what they were charged."""
    db = tmp_path / "ledger.db"
    store = open_store(f"sqlite:///{db}", leases=True)
    tenant, limits = "cut", Limits(run_max_calls=1_000, run_max_cost=10**9)
    await _hot(leased := store, tenant, limits, calls=HOT_AFTER)
    first = await leased.admit(_ask(tenant, limits), Turn(reserve=(1, 100)))
    assert first.id.startswith("lease-")
    fsynced = (tmp_path / "ledger.db-wal").stat().st_size  # the lease's admission is the last write
    await leased.settle(first, 40)
    await _hot(leased, tenant, limits, calls=10)
    assert await leased.run_totals(tenant, "hot") == {}  # an exact view: gives the lease back
    cut = tmp_path / "cut"
    cut.mkdir()
    for name in ("ledger.db", "ledger.db-wal"):
        (cut / name).write_bytes((tmp_path / name).read_bytes())
    with (cut / "ledger.db-wal").open("r+b") as wal:
        assert wal.seek(0, 2) > fsynced, "the return was written after the lease"
        wal.truncate(fsynced)
    await store.aclose()

    after = open_store(f"sqlite:///{cut / 'ledger.db'}", leases=False)
    try:
        calls, spend = await after.run_calls(tenant, "hot"), await after.spend(tenant, run_id="hot")
        assert (calls, spend) == (HOT_AFTER + LEASE_CALLS, HOT_AFTER * 40 + LEASE_CALLS * 100), \
            "the ledger as the lease left it"
        assert calls >= HOT_AFTER + 11 and spend >= (HOT_AFTER + 11) * 40, "only over-counted"
        assert calls <= 1_000 and spend <= 10**9
    finally:
        await after.aclose()


async def test_a_leased_call_that_overshoots_is_charged_in_full_at_once(pair: tuple[Store, Store]) -> None:
    leased, plain = pair
    tenant, limits = f"t-{uuid.uuid4().hex[:8]}", Limits(run_max_cost=10**9)
    await _hot(leased, tenant, limits)
    a = await leased.admit(_ask(tenant, limits), Turn(reserve=(1, 100)))
    b = await leased.admit(_ask(tenant, limits), Turn(reserve=(1, 100)))
    assert a.id.startswith("lease-") and b.id.startswith("lease-")
    assert await leased.settle(a, 10_000) == 9_900, "the overshoot is reported"
    # Durable now, before the lease (b still in flight) is given back: a crash cannot lose it.
    assert await plain.spend(tenant, run_id="hot") >= 5 * 40 + 10_000 + 100
    assert await plain.spend(tenant, day="2026-05-14") >= 5 * 40 + 10_000 + 100
    await leased.settle(b, 40)
    assert await plain.spend(tenant, run_id="hot") == 5 * 40 + 10_000 + 40
    assert await plain.run_calls(tenant, "hot") == 7


# --- runs of one call (no X-Run-Id): tenant leases, runs kept in memory -------------------

DAY = "2026-05-14"


def _solo(tenant: str, i: int | str, limits: Limits) -> Ask:
    return Ask(tenant, f"gen-{i}", T0, limits)


def _turn(least: int = 1, most: int = 100, **kw: object) -> Turn:
    return Turn(reserve=(least, most), trace={"ids": f"trace-{uuid.uuid4().hex[:6]}"}, solo=True, **kw)  # type: ignore[arg-type]


async def test_runs_of_one_call_are_served_from_a_tenant_lease_and_written_whole(pair: tuple[Store, Store]) -> None:
    leased, plain = pair
    assert isinstance(leased, LeasedStore)
    tenant, limits = f"t-{uuid.uuid4().hex[:8]}", Limits(run_max_calls=5, day_budget=10**9)
    ids = []
    for i in range(60):
        a = await leased.admit(_solo(tenant, i, limits), _turn())
        ids.append(a.id)
        assert (a.calls, a.run_id) == (1, f"gen-{i}")
        await leased.settle(a, 40, run_totals={"model_calls": 1, "cost_micros": 40},
                            tools=[{"id": f"c{i}", "name": "search", "sig": "s"}])
        assert [t["id"] for t in await leased.tools_pending(tenant, f"gen-{i}")] == [f"c{i}"]
        rec = await leased.run_end(tenant, f"gen-{i}")
        assert rec is not None and (rec["calls"], rec["settled"], rec["ended"]) == (1, 40, True)
        assert rec["totals"] == {"model_calls": 1, "cost_micros": 40}
        assert await leased.run_end(tenant, f"gen-{i}") is None, "one run span"
    assert not ids[0].startswith("lease-"), "the tenant's first is exact: it sizes the lease"
    assert all(i.startswith("lease-") for i in ids[1:])
    assert await leased.spend(tenant, day=DAY) == 60 * 40, "the call's path sees it exact"
    assert await plain.spend(tenant, day=DAY) >= 60 * 40, "the ledger holds the lease as spent meanwhile"
    await leased.aclose()
    assert await plain.spend_detail(tenant, day=DAY) == Spend(60 * 40, 0)
    runs = await plain.list_runs(tenant, 100)
    listed = {r["run_id"]: r for r in runs if r["run_id"].startswith("gen-")}
    assert len(listed) == 60
    assert all((r["calls"], r["settled"], r["ended"], r["totals"]) == (1, 40, True, {"model_calls": 1,
                                                                                    "cost_micros": 40})
               for r in listed.values())
    assert all(r["trace"]["ids"].startswith("trace-") for r in listed.values())
    assert not [r for t, r in await plain.idle_runs(T0.replace(year=2100)) if t == tenant], \
        "no run is left open, the lease run neither"


@pytest.mark.parametrize("kind", ["run", "runs of one call"])
async def test_calls_that_come_slower_than_a_lease_lasts_are_admitted_exactly(ledger: str, kind: str) -> None:
    """An agent whose model answers in seconds sends each call after its run's lease has
    expired: a lease per call would be three ledger writes (take, settle, give back) for the
    exact path's two, with 32 calls counted and reserved meanwhile. Such calls take the exact
    path, counted one by one; the same calls back to back still lease."""
    plain = open_store(ledger, leases=False)
    # Slow: calls 0.12 s apart against leases of 0.2 s (leased only below 0.05 s apart). Fast:
    # back to back against the default 2 s (below 0.5 s): wide margins both ways on a busy machine.
    slow_store = LeasedStore(open_store(ledger, leases=False), lease_s=0.2)
    fast_store = LeasedStore(open_store(ledger, leases=False))
    tenant, limits = f"t-{uuid.uuid4().hex[:8]}", Limits(day_budget=10**9)

    async def call(store: LeasedStore, i: int) -> str:
        ask = _solo(tenant, i, limits) if kind != "run" else _ask(tenant, limits)
        a = await store.admit(ask, _turn() if kind != "run" else Turn(reserve=(1, 100)))
        await store.settle(a, 40)
        return a.id

    try:
        slow = []
        for i in range(5):
            slow.append(await call(slow_store, i))
            if kind == "run":  # counted as made, never ahead
                assert await plain.run_calls(tenant, "hot") == i + 1
            await asyncio.sleep(0.12)
        assert not [i for i in slow if i.startswith("lease-")], slow
        assert await plain.spend_detail(tenant, day=DAY) == Spend(5 * 40, 0), "nothing held ahead"
        fast = [await call(fast_store, i) for i in range(5, 12)]
        assert all(i.startswith("lease-") for i in fast[1:]), fast
        await fast_store.aclose()  # gives the lease back
        assert await plain.spend_detail(tenant, day=DAY) == Spend(12 * 40, 0)
    finally:
        for store in (slow_store, fast_store, plain):
            await store.aclose()


async def test_the_lease_run_is_never_listed(pair: tuple[Store, Store]) -> None:
    leased, _ = pair
    tenant, limits = f"t-{uuid.uuid4().hex[:8]}", Limits()
    for i in range(5):
        await leased.settle(await leased.admit(_solo(tenant, i, limits), _turn()), 10)
        await leased.run_end(tenant, f"gen-{i}")
    assert sorted(r["run_id"] for r in await leased.list_runs(tenant)) == [f"gen-{i}" for i in range(5)]


@pytest.mark.parametrize("limits", [
    Limits(),
    Limits(run_max_calls=1, run_max_cost=70, day_budget=10**6),  # the run's cost ceiling cuts the reservation
    Limits(run_max_cost=10**6, day_budget=10**6, month_budget=10**7, key_day_budget=10**6, key_month_budget=10**7),
], ids=["none", "run-cost-cuts", "every-scope"])
async def test_a_leased_run_of_one_call_is_admitted_as_the_store_admits_it(pair: tuple[Store, Store],
                                                                          limits: Limits) -> None:
    """What the handler reads of an admission (reservation, calls, headroom per scope, the
    limits in force with the admin API's budget) is the same from a lease as from the store."""
    leased, plain = pair
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    await plain.budget_set(tenant, 5 * 10**6, None)
    for i in range(3):  # warm: the tenant's lease is taken
        await leased.settle(await leased.admit(_solo(tenant, f"w{i}", limits), _turn(key="k1")), 0)
    from_lease = await leased.admit(_solo(tenant, "a", limits), _turn(key="k1"))
    assert from_lease.id.startswith("lease-")
    await leased.settle(from_lease, 0)
    await leased.aclose()  # the lease given back: the ledger as the exact path would have found it
    exact = await plain.admit(_solo(tenant, "b", limits), _turn(key="k1"))
    fields = ("reserved", "calls", "remaining", "day_key", "month_key", "key", "tokens", "closed")
    assert {f: getattr(from_lease, f) for f in fields} == {f: getattr(exact, f) for f in fields}
    assert from_lease.limits == exact.limits and from_lease.limits.origin == exact.limits.origin


async def test_concurrent_runs_of_one_call_never_cross_a_day_budget(pair: tuple[Store, Store]) -> None:
    leased, plain = pair
    tenant, limits = f"t-{uuid.uuid4().hex[:8]}", Limits(day_budget=200_000)
    refused = 0

    async def agent(n: int) -> int:
        nonlocal refused
        spent = 0
        for i in range(200):
            try:
                a = await leased.admit(_solo(tenant, f"{n}-{i}", limits), _turn(30, 300))
            except CeilingReached as e:
                assert e.limit == "tenant_day"
                refused += 1
                continue
            await asyncio.sleep(0)
            cost = min(250, a.reserved)  # a reservation cut to the headroom clamps the answer (ceilings.admit)
            await leased.settle(a, cost)
            spent += cost
            await leased.run_end(tenant, f"gen-{n}-{i}")
        return spent

    spent = sum(await asyncio.gather(*(agent(n) for n in range(16))))
    assert refused and spent <= 200_000
    await leased.aclose()
    assert await plain.spend_detail(tenant, day=DAY) == Spend(spent, 0)


async def test_a_run_of_one_call_with_a_second_call_is_taken_over_by_the_store(pair: tuple[Store, Store]) -> None:
    """A retry (repair.on_invalid=retry) is a second call of a run made for one: the run is
    written to the store first, and ends once, with both calls."""
    leased, plain = pair
    tenant, limits = f"t-{uuid.uuid4().hex[:8]}", Limits(run_max_calls=5)
    for i in range(3):
        await leased.settle(await leased.admit(_solo(tenant, i, limits), _turn()), 10)
        await leased.run_end(tenant, f"gen-{i}")
    first = await leased.admit(_solo(tenant, "r", limits), _turn())
    assert first.id.startswith("lease-")
    retry = await leased.admit(_solo(tenant, "r", limits), Turn(reserve=(1, 100)))
    assert retry.calls == 2 and not retry.id.startswith("lease-")
    await leased.settle(first, 30, run_totals={"model_calls": 1})  # settled after the store took the run
    await leased.settle(retry, 20, run_totals={"model_calls": 1})
    rec = await leased.run_end(tenant, "gen-r")
    assert rec is not None and (rec["calls"], rec["settled"], rec["totals"]) == (2, 50, {"model_calls": 2})
    assert await leased.run_end(tenant, "gen-r") is None
    await leased.aclose()
    assert await plain.spend(tenant, run_id="gen-r") == 50


async def test_a_run_of_one_call_never_ended_is_written_open_for_the_sweeper(
        pair: tuple[Store, Store], monkeypatch: pytest.MonkeyPatch) -> None:
    from proxy.ledger import solo

    monkeypatch.setattr(solo, "STALE_S", 0.2)
    leased, plain = pair
    tenant, limits = f"t-{uuid.uuid4().hex[:8]}", Limits()
    for i in range(4):
        await leased.settle(await leased.admit(_solo(tenant, i, limits), _turn()), 10,
                            tools=[{"id": f"c{i}", "name": "f", "sig": "s"}])
    for _ in range(50):
        idle = {r for t, r in await plain.idle_runs(T0.replace(year=2100)) if t == tenant}
        if idle == {f"gen-{i}" for i in range(4)}:
            break
        await asyncio.sleep(0.1)
    assert idle == {f"gen-{i}" for i in range(4)}
    assert [t["id"] for t in await plain.tools_pending(tenant, "gen-3")] == ["c3"], "its open tool calls too"
    assert await plain.run_end(tenant, "gen-3") is not None


async def test_a_stored_context_settled_into_a_lease_is_known_to_the_next_call(pair: tuple[Store, Store]) -> None:
    """A Responses call's stored size goes with its lease; a call naming it is exact, and the
    size is written before it is admitted, so a cost ceiling does not refuse it as unknown."""
    leased, _ = pair
    tenant, limits = f"t-{uuid.uuid4().hex[:8]}", Limits(day_budget=10**9)
    for i in range(3):
        await leased.settle(await leased.admit(_solo(tenant, i, limits), _turn()), 10)
    a = await leased.admit(_solo(tenant, "store", limits), _turn())
    assert a.id.startswith("lease-")
    await leased.settle(a, 10, contexts={"response:resp_9": 1_000})
    nxt = await leased.admit(_solo(tenant, "chain", limits),
                             _turn(context=("response:resp_9",), input_rate=2_000_000))
    assert nxt.context_tokens == 1_000


def test_kill_9_with_tenant_leases_only_over_counts(ledger: str) -> None:
    _, charged = _kill_mid_load(ledger, "solo")

    async def check() -> None:
        store = open_store(ledger, leases=False)
        try:
            day = await store.spend("crash", day=_today())
            assert day >= charged, "a crash must never under-count money"
        finally:
            await store.aclose()

    asyncio.run(check())


def _today() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%d")


# --- tool results closed in memory (an agent's every call carries the last answer's results) ---


async def _agent(store: Store, tenant: str, sigs: list[str], oks: list[bool], rule: GuardRule,
                 parallel: list[int]) -> tuple[list[object], list[str]]:
    """One run: each call answers the last answer's tool calls (ok or failed), and its own
    answer asks for `parallel[i]` calls of signature `sigs[i]`. What the ledger said of each."""
    said: list[object] = []
    ids: list[str] = []
    prev: list[str] = []
    for i, sig in enumerate(sigs):
        results = tuple((c, oks[i]) for c in prev)
        try:
            a = await store.admit(Ask(tenant, "agent", T0, Limits(run_max_calls=1_000, run_max_cost=10**9)),
                                  Turn(reserve=(1, 100), results=results, guard=rule))
        except LoopRefused as refused:
            said.append(("refused", refused.message.replace(tenant, "T"),
                         [(c["id"], c["streak"], c["failures"], c["ok"]) for c in refused.closed]))
            prev = []
            continue
        ids.append(a.id)
        said.append(("ok", a.calls, [(c["id"], c["name"], c["streak"], c["failures"], c["ok"]) for c in a.closed]))
        prev = [f"c{i}-{k}" for k in range(parallel[i])]
        await store.settle(a, 40, run_totals={"model_calls": 1},
                           tools=[{"id": c, "name": "search", "sig": sig} for c in prev])
    return said, ids


@pytest.mark.parametrize("rule", [GuardRule(threshold=4, refuse=True), GuardRule(threshold=3, refuse=False,
                                                                                  max_failures=3)],
                         ids=["loop-refused", "failures-refused"])
async def test_tool_results_closed_in_memory_say_what_the_store_says(pair: tuple[Store, Store],
                                                                     rule: GuardRule) -> None:
    """The same agent run through a leased store and a plain one: every call's closes (streak,
    failures, ok), every loop-guard refusal and every call count are the same; and the leased
    run's calls after the third are served from leases, closing their results in memory."""
    leased, plain = pair
    sigs = ["a", "a", "b", "c", "c", "c", "d", "e", "e", "e", "e", "e", "f", "g", "g", "h", "i", "i", "j", "k"] * 2
    oks = [True, True, False, True, False, False, False, True, True, True, True, True, False, False, False,
           True, True, False, True, True] * 2
    parallel = [1, 2, 1, 1, 1, 3, 1, 1, 1, 1, 1, 1, 2, 1, 1, 1, 1, 1, 1, 1] * 2
    t1, t2 = f"t-{uuid.uuid4().hex[:8]}", f"t-{uuid.uuid4().hex[:8]}"
    said_plain, _ = await _agent(plain, t1, sigs, oks, rule, parallel)
    said_leased, ids = await _agent(leased, t2, sigs, oks, rule, parallel)
    assert said_leased == said_plain
    assert any(kind == "refused" for kind, *_ in said_plain), "the run meets the guard"
    assert sum(i.startswith("lease-") for i in ids) >= len(ids) // 2, "most calls from leases"
    await leased.aclose()
    # Written back: the store goes on from where the leases left the run.
    assert await plain.run_calls(t2, "agent") == await plain.run_calls(t1, "agent")
    assert await plain.run_totals(t2, "agent") == await plain.run_totals(t1, "agent")
    assert ([c["id"] for c in await plain.tools_pending(t2, "agent")]
            == [c["id"] for c in await plain.tools_pending(t1, "agent")])
    pending = [c["id"] for c in await plain.tools_pending(t1, "agent")]
    assert pending, "the run's last answer asked for a tool call"
    # The loop guard's state too: the next close counts on from the same streak and failures.
    nxt = [await plain.admit(Ask(t, "agent", T0), Turn(reserve=(1, 100), results=((pending[0], False),)))
           for t in (t1, t2)]
    assert [(c["streak"], c["failures"]) for c in nxt[1].closed] == [(c["streak"], c["failures"])
                                                                     for c in nxt[0].closed] != []


async def test_a_lease_refused_after_closing_results_hands_its_closes_to_the_exact_call(
        pair: tuple[Store, Store]) -> None:
    """Another replica spent the run's headroom since this process last looked: the lease's
    admission closes the call's results, then finds no room for a lease; the call itself is
    admitted exactly, with those closes (they are not closed twice, nor lost)."""
    leased, plain = pair
    tenant, limits = f"t-{uuid.uuid4().hex[:8]}", Limits(run_max_cost=100_000)
    for _ in range(2):
        await leased.settle(await leased.admit(_ask(tenant, limits), Turn(reserve=(1, 100))), 40)
    a = await leased.admit(_ask(tenant, limits), Turn(reserve=(1, 100)))
    await leased.settle(a, 40, tools=[{"id": "c1", "name": "search", "sig": "s"}])
    other = await plain.admit(_ask(tenant, limits), Turn(reserve=(1, 99_830)))  # the other replica
    await plain.settle(other, 99_830)  # 50 left: less than one worst case, more than the least
    nxt = await leased.admit(_ask(tenant, limits), Turn(reserve=(1, 100), results=(("c1", True),)))
    assert not nxt.id.startswith("lease-") and nxt.reserved == 50
    assert [(c["id"], c["streak"]) for c in nxt.closed] == [("c1", 1)]
    assert not await plain.tools_pending(tenant, "hot")



async def test_near_a_budget_a_lease_held_by_calls_in_flight_still_serves_what_it_holds(
        pair: tuple[Store, Store]) -> None:
    """The tenant's lease is closed (renewed, or its time is up) while one of its calls is in
    flight: until that call settles the lease holds its unused part. A call the ledger then
    refuses for the budget is served from that part, as the exact path would have admitted it."""
    leased, plain = pair
    tenant, limits = f"t-{uuid.uuid4().hex[:8]}", Limits(day_budget=1_000_000)
    for i in range(3):
        await leased.settle(await leased.admit(_solo(tenant, i, limits), _turn()), 0)
        await leased.run_end(tenant, f"gen-{i}")
    assert isinstance(leased, LeasedStore)
    [lease] = list(leased._leases.values())
    held = lease.admission.reserved - lease.used
    in_flight = await leased.admit(_solo(tenant, "slow", limits), _turn())
    assert in_flight.id.startswith("lease-")
    leased._close_behind(lease.lkey)  # as its timer or a renewal does
    # Another replica spends all the budget but what this lease holds.
    day = await plain.spend(tenant, day=DAY)
    other = await plain.admit(Ask(tenant, "other", T0, limits), Turn(reserve=(1, 1_000_000 - day)))
    await plain.settle(other, other.reserved)
    a = await leased.admit(_solo(tenant, "late", limits), _turn())
    assert a.id.startswith("lease-") and a.reserved == 100
    assert held >= 200
    await leased.settle(in_flight, 50)
    await leased.settle(a, 60)
    await leased.aclose()
    assert await plain.spend(tenant, day=DAY) <= 1_000_000


async def test_a_leased_calls_settle_is_queued_without_a_task(pair: tuple[Store, Store], ledger: str) -> None:
    """What the bookkeeping asks before it settles as a plain callback (Store.queues_settle):
    a leased call's settle is done in memory, whatever the backend; an exact one's is queued
    at once by SQLite's writer, and is a round trip to Redis."""
    leased, plain = pair
    tenant, limits = f"t-{uuid.uuid4().hex[:8]}", Limits()
    exact = await leased.admit(_ask(tenant, limits), Turn(reserve=(1, 100)))
    assert leased.queues_settle(exact) is ledger.startswith("sqlite")
    assert plain.queues_settle(exact) is ledger.startswith("sqlite")
    await leased.settle(exact, 1)
    await _hot(leased, tenant, limits)
    a = await leased.admit(_ask(tenant, limits), Turn(reserve=(1, 100)))
    assert a.id.startswith("lease-") and leased.queues_settle(a)
    settling = leased.settle_in_order(a, 40)
    try:
        settling.send(None)
    except StopIteration as done:  # finished without waiting: no task needed
        assert done.value.result() == 0
    else:
        raise AssertionError("a leased call's settle waited")


def _kill_mid_load(ledger: str, *mode: str) -> tuple[list[bytes], int]:
    """Run lease_child.py until it has settled 500 calls, kill -9 it: (its admissions, what
    they cost: 70 each, the one in flight at the kill too (the child calls one at a time):
    its settle may have reached the ledger before the child printed it; if not, the ledger
    holds its reservation, more)."""
    lines = killed_after("lease_child.py", [ledger, *mode], settles=500)
    admitted = [line for line in lines if line.startswith(b"admitted")]
    settled = sum(1 for line in lines if line.startswith(b"settled"))
    unsettled = len(admitted) - settled
    assert unsettled in (0, 1), "one call at a time"
    return admitted, 70 * (settled + unsettled)
