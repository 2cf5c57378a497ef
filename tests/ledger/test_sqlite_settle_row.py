"""Consecutive settles in one batch run as one row (proxy/ledger/sqlite.py `_settle_row`): three
statements for all of them instead of three each. The row must leave the ledger exactly as the
same settles leave it one after the other, and give each the same result: the contract suite
runs settles one or a few at a time, so this holds the two to each other over any row."""

from __future__ import annotations

import sqlite3
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.ledger import sqlite as S

TENANTS = ["acme", "beta"]
RUNS = ["r1", "r2", "r3"]
NAMES = ["model_calls", "input_tokens", "output_tokens", "cost_micros", "failures"]

# A reservation: (tenant, run, day, month, amount, expired, key id, tokens held)
reservation = st.tuples(st.sampled_from(TENANTS), st.sampled_from(RUNS), st.sampled_from(["2026-12-03", "2026-12-04"]),
                        st.just("2026-12"), st.integers(0, 10**9), st.booleans(),
                        st.sampled_from([None, "k1", "k2"]), st.sampled_from([0, 0, 500]))
# A settle: (which reservation, by index; past the end: one never made), actual cost, totals, tools, contexts
settle = st.tuples(st.integers(0, 7), st.integers(0, 2 * 10**9),
                   st.lists(st.tuples(st.sampled_from(NAMES), st.integers(0, 10**6)), max_size=4,
                            unique_by=lambda t: t[0]),
                   st.lists(st.sampled_from(["call_a", "call_b", "call_c"]), max_size=2, unique=True),
                   st.lists(st.tuples(st.sampled_from(["resp_1", "resp_2"]), st.integers(1, 10**5)), max_size=2,
                            unique_by=lambda t: t[0]))


def _ledger(reservations: list[tuple[Any, ...]]) -> sqlite3.Connection:
    conn = sqlite3.connect(":memory:", isolation_level=None)
    conn.executescript(S._SCHEMA)
    S._add_columns(conn)
    for i, (tenant, run_id, day, month, amount, expired, key_id, tokens) in enumerate(reservations):
        conn.execute("INSERT INTO reservations (id, tenant, run_id, day_key, month_key, amount, expires_at, expired, "
                     "key_id, tokens) VALUES (?,?,?,?,?,?,?,?,?,?)",
                     (f"res-{i}", tenant, run_id, day, month, amount, 0.0, int(expired), key_id, tokens))
        conn.execute("INSERT INTO runs (tenant, run_id, tokens_held, tokens_expired) VALUES (?,?,1000,1000) "
                     "ON CONFLICT DO NOTHING", (tenant, run_id))
        conn.execute("INSERT INTO ledger (tenant, scope, key, settled, reserved) VALUES (?, 'day', ?, 7, ?) "
                     "ON CONFLICT DO UPDATE SET reserved = reserved + excluded.reserved", (tenant, day, amount))
    return conn


def _state(conn: sqlite3.Connection) -> dict[str, list[tuple[Any, ...]]]:
    return {
        "ledger": conn.execute("SELECT * FROM ledger ORDER BY tenant, scope, key").fetchall(),
        "reservations": conn.execute("SELECT * FROM reservations ORDER BY id").fetchall(),
        "runs": conn.execute("SELECT tenant, run_id, tokens_held, tokens_expired FROM runs ORDER BY 1, 2").fetchall(),
        "run_totals": conn.execute("SELECT * FROM run_totals ORDER BY tenant, run_id, name").fetchall(),
        "tools": conn.execute("SELECT * FROM tools ORDER BY tenant, run_id, seq").fetchall(),
        # seen_at is the settle's own clock: not compared
        "contexts": conn.execute("SELECT tenant, ref, tokens FROM contexts ORDER BY tenant, ref").fetchall(),
    }


def _ops(settles: list[tuple[Any, ...]]) -> list[S._Settle]:
    return [S._Settle(f"res-{i}", actual, list(totals), [(c, f'{{"id": "{c}", "n": {k}}}') for c in calls],
                      list(seen))
            for k, (i, actual, totals, calls, seen) in enumerate(settles)]


@settings(max_examples=300, deadline=None)
@given(st.lists(reservation, min_size=1, max_size=6), st.lists(settle, min_size=1, max_size=12))
def test_a_row_of_settles_leaves_what_they_leave_one_by_one(reservations: list[tuple[Any, ...]],
                                                           settles: list[tuple[Any, ...]]) -> None:
    at_once, one_by_one = _ledger(reservations), _ledger(reservations)
    together = S._run_batch(at_once, _ops(settles))
    alone = [r for op in _ops(settles) for r in S._run_batch(one_by_one, [op])]
    assert together == alone
    assert _state(at_once) == _state(one_by_one)


def test_a_row_takes_every_reservation_once_and_pads_its_statements() -> None:
    conn = _ledger([("acme", "r1", "2026-12-03", "2026-12", 100, False, None, 0)] * 3)
    # Five settles: res-0 twice (the second finds it taken), res-1, res-2, and one never made.
    ops = _ops([(0, 150, [("model_calls", 1)], [], []), (0, 90, [("model_calls", 1)], [], []),
                (1, 40, [("model_calls", 1)], [], []), (2, 100, [], [], []), (9, 5, [], [], [])])
    assert S._run_batch(conn, ops) == [(True, 50), (True, 0), (True, 0), (True, 0), (True, 0)]
    assert _state(conn)["reservations"] == []
    assert ("acme", "r1", "model_calls", 2) in _state(conn)["run_totals"]
    day = {(scope, key): (settled, reserved) for _, scope, key, settled, reserved in _state(conn)["ledger"]}
    assert day["day", "2026-12-03"] == (7 + 150 + 40 + 100, 0)  # three reservations of 100 released
    assert day["run", "r1"] == (290, -300)  # the run's row held nothing here: only what the settles moved
    assert S._padded(5) == 8 and S._padded(8) == 8 and S._padded(1) == 1
