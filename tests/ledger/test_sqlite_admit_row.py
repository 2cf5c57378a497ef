"""Consecutive admissions in one batch run as one row (proxy/ledger/sqlite.py `_admit_row`): the
ledger and run rows they read and write are kept between them and written once at the row's end.
The row must give each admission what it gives when they run one after the other (the same
refusals, reservations, remaining headroom, run counts, closed tool calls) and leave every
table the same."""

from __future__ import annotations

import sqlite3
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.errors import Refusal
from proxy.ledger import sqlite as S
from proxy.ledger.rates import Rate
from proxy.ledger.store import Admission, Ask, GuardRule, Limits, Turn

TENANTS = ["acme", "beta"]
RUNS = ["r1", "r2", "r3"]
NOW = datetime(2026, 12, 3, 12, 0, tzinfo=UTC)

limits = st.builds(Limits, run_max_calls=st.sampled_from([None, 2, 5]),
                   run_max_cost=st.sampled_from([None, 5_000, 50_000]),
                   day_budget=st.sampled_from([None, 20_000, 10**9]), month_budget=st.sampled_from([None, 80_000]),
                   key_day_budget=st.sampled_from([None, 9_000]), run_max_tokens=st.sampled_from([None, 3_000]),
                   run_max_seconds=st.sampled_from([None, 30.0]))
reserve = st.integers(0, 8_000).flatmap(lambda lo: st.tuples(st.just(lo), st.integers(lo, lo + 12_000)))
turn = st.builds(
    Turn, reserve=reserve,
    results=st.lists(st.tuples(st.sampled_from(["t1", "t2", "t3"]), st.booleans()), max_size=2).map(tuple),
    guard=st.sampled_from([None, GuardRule(threshold=2, refuse=True, max_failures=2)]),
    trace=st.sampled_from([None, {"ids": "abc", "source": "header"}]),
    key=st.sampled_from([None, "k1"]),
    rates=st.sampled_from([(), (Rate("tenant", "requests", 4, 1),)]),
    tokens=st.integers(0, 1_000).flatmap(lambda lo: st.tuples(st.just(lo), st.integers(lo, lo + 2_000))),
)
ask = st.tuples(st.sampled_from(TENANTS), st.sampled_from(RUNS), limits, st.integers(0, 59))


def _ledger() -> sqlite3.Connection:
    conn = sqlite3.connect(":memory:", isolation_level=None)
    conn.executescript(S._SCHEMA)
    S._add_columns(conn)
    conn.execute("INSERT INTO budgets (tenant, day, month) VALUES ('beta', 15000, NULL)")
    conn.execute("INSERT INTO ledger VALUES ('acme', 'day', '2026-12-03', 4000, 1000)")
    conn.execute("INSERT INTO runs (tenant, run_id, calls, first_seen, last_seen, sig, streak, tokens_held, "
                 "tokens_expired) VALUES ('acme', 'r1', 1, ?, ?, 'sig-x', 1, 500, 200)",
                 (NOW.timestamp() - 20, NOW.timestamp() - 10))
    conn.execute("INSERT INTO run_totals VALUES ('acme', 'r1', 'input_tokens', 900)")
    for tenant in TENANTS:  # open tool calls the turns' results close (some twice, some never made)
        for run_id in RUNS:
            for call_id in ("t1", "t2"):
                conn.execute("INSERT INTO tools (tenant, run_id, id, seq, call) VALUES (?,?,?,?,?)",
                             (tenant, run_id, call_id, 1 if call_id == "t1" else 2,
                              f'{{"id": "{call_id}", "name": "search", "sig": "sig-x"}}'))
    return conn


def _ops(asks: list[tuple[Any, ...]], turns: list[Turn]) -> list[S._Admit]:
    return [S._admission(Ask(tenant, run_id, NOW.replace(second=s), lim), t)
            for (tenant, run_id, lim, s), t in zip(asks, turns, strict=False)]


def _same(result: tuple[bool, Any]) -> Any:
    """An admission's result with its random reservation id left out."""
    ok, value = result
    assert ok, value
    if isinstance(value, Admission):
        return replace(value, id="")
    assert isinstance(value, Refusal)
    return (type(value), str(value), getattr(value, "closed", None))


def _state(conn: sqlite3.Connection) -> dict[str, list[tuple[Any, ...]]]:
    return {
        "ledger": conn.execute("SELECT * FROM ledger ORDER BY tenant, scope, key").fetchall(),
        "reservations": conn.execute("SELECT tenant, run_id, day_key, month_key, amount, expires_at, key_id, tokens "
                                     "FROM reservations ORDER BY 1, 2, 6, 5").fetchall(),
        "runs": conn.execute("SELECT * FROM runs ORDER BY tenant, run_id").fetchall(),
        "tools": conn.execute("SELECT * FROM tools ORDER BY tenant, run_id, id").fetchall(),
        "rates": conn.execute("SELECT * FROM rates ORDER BY tenant, bucket").fetchall(),
    }


@settings(max_examples=300, deadline=None)
@given(st.lists(ask, min_size=1, max_size=10), st.lists(turn, min_size=10, max_size=10))
def test_a_row_of_admissions_gives_what_they_give_one_by_one(asks: list[tuple[Any, ...]],
                                                             turns: list[Turn]) -> None:
    at_once, one_by_one = _ledger(), _ledger()
    together = S._run_batch(at_once, _ops(asks, turns))
    alone = [r for op in _ops(asks, turns) for r in S._run_batch(one_by_one, [op])]
    assert [_same(r) for r in together] == [_same(r) for r in alone]
    assert _state(at_once) == _state(one_by_one)


def test_a_row_reads_what_the_admissions_before_it_wrote() -> None:
    """Three calls of one run under a two-call ceiling and a $0.01 run cost: in one row the
    third is refused for the calls the first two counted, and the second holds only what the
    first left of the cost ceiling."""
    conn = _ledger()
    lim = Limits(run_max_calls=2, run_max_cost=10_000)
    ops = _ops([("acme", "r2", lim, 0)] * 3, [Turn(reserve=(1_000, 6_000))] * 3)
    first, second, third = S._run_batch(conn, ops)
    assert first[1].reserved == 6_000 and first[1].calls == 1
    assert second[1].reserved == 4_000 and second[1].calls == 2  # cut to the headroom the first left
    assert isinstance(third[1], Refusal)
    assert conn.execute("SELECT calls FROM runs WHERE tenant='acme' AND run_id='r2'").fetchone() == (2,)
    assert conn.execute("SELECT reserved FROM ledger WHERE tenant='acme' AND scope='run' AND key='r2'").fetchone() \
        == (10_000,)
    assert conn.execute("SELECT count(*) FROM reservations").fetchone() == (2,)
