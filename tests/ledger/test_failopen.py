"""FailOpenStore around a real store: neutral answers while it is away, the real ones after."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from proxy.errors import StoreUnavailable
from proxy.ledger.backends import open_store
from proxy.ledger.failopen import FailOpenStore
from proxy.ledger.store import Admission, Ask, Limits, Store, Turn
from tests.fixtures.redis import BINARY, SKIP_REASON, RedisServer

T0 = datetime(2026, 5, 14, 12, 0, tzinfo=UTC)
TOOL = {"id": "c1", "name": "search", "arguments": "{}"}


async def admit(store: Any) -> Any:
    return await store.admit(Ask("acme", "r-1", T0, Limits()), Turn(reserve=(10, 100)))


@pytest.fixture
async def away(tmp_path: Path) -> AsyncIterator[Store]:
    """A ledger that cannot be reached: its directory does not exist."""
    store = open_store(f"sqlite:///{tmp_path}/missing-dir/ledger.db")
    yield store
    await store.aclose()


async def test_a_combined_settle_answers_zero_while_the_ledger_is_away(
    away: Store, caplog: pytest.LogCaptureFixture
) -> None:
    store = FailOpenStore(away)
    with caplog.at_level(logging.ERROR, logger="spanmeter.ledger"):
        admission = await admit(store)
        assert (admission.id, admission.reserved) == ("unmetered", 0)
        # A metered admission whose ledger went away before its settle.
        metered = Admission("abc", "acme", "r-1", 100, 1, {}, "2026-05-14", "2026-05")
        assert await store.settle(metered, 40, run_totals={"calls": 1}, tools=[TOOL]) == 0
        assert await store.settle(admission, 40, run_totals={"calls": 1}, tools=[TOOL]) == 0
    logged = [r.getMessage() for r in caplog.records]
    assert any("UNMETERED" in m and "settle" in m for m in logged)
    assert any("UNMETERED" in m and "run_add" in m for m in logged)
    with pytest.raises(StoreUnavailable):  # without the wrapper it fails closed
        await away.settle(metered, 40, run_totals={"calls": 1})


async def test_a_settle_in_order_answers_zero_while_the_ledger_is_away(away: Store) -> None:
    """The bookkeeping's settle (`settle_in_order`) is guarded too: neither its call nor
    the result it hands back raises, where the bare store's result does."""
    metered = Admission("abc", "acme", "r-1", 100, 1, {}, "2026-05-14", "2026-05")
    assert await (await FailOpenStore(away).settle_in_order(metered, 40, tools=[TOOL])) == 0
    with pytest.raises(StoreUnavailable):
        await (await away.settle_in_order(metered, 40, tools=[TOOL]))


@pytest.mark.redis
@pytest.mark.skipif(BINARY is None, reason=SKIP_REASON)
async def test_an_unmetered_call_settled_after_the_ledger_returns_keeps_its_totals(tmp_path: Path) -> None:
    server = RedisServer(tmp_path)
    server.start()
    store = FailOpenStore(open_store(server.url))
    try:
        server.stop()
        admission = await admit(store)
        assert admission.id == "unmetered"
        server.start()
        assert await store.settle(admission, 40, run_totals={"calls": 1}, tools=[TOOL]) == 0
        assert await store.run_totals("acme", "r-1") == {"calls": 1}
        assert await store.tools_pending("acme", "r-1") == [TOOL]
        assert await store.spend("acme") == 0  # nothing was reserved, nothing is charged
        metered = await admit(store)
        assert await store.settle(metered, 40, run_totals={"calls": 1}) == 0
        assert await store.run_totals("acme", "r-1") == {"calls": 2}
        assert await store.spend("acme") == 40
    finally:
        await store.aclose()
        server.stop()
