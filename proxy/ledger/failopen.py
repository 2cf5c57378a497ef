"""Fail-open: when the ledger is unreachable, serve calls unmetered, loudly.

Off by default (`fail_open: false`): an unreachable ledger refuses calls with 503,
because a ceiling that is not checked is not a ceiling. An operator who prefers
availability over enforcement wraps the store in `FailOpenStore`; every call it lets
through unmetered is logged at ERROR with the operation that failed.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from proxy.errors import StoreUnavailable
from proxy.ledger.store import Admission, Ask, Store, done_future

__all__ = ["FailOpenStore"]

log = logging.getLogger("spanmeter.ledger")


_UNMETERED = "unmetered"  # the id of an admission made while the ledger was away


def _unmetered(ask: Ask, *args: Any, **kw: Any) -> Admission:
    return Admission(_UNMETERED, ask.tenant, ask.run_id, 0, 0, {}, "", "")


# What each operation answers while the ledger is away: neutral values, never a refusal.
_FALLBACKS: dict[str, Callable[..., Any]] = {
    "admit": _unmetered,
    "admit_tool": _unmetered,
    "settle": lambda *a, **k: 0,
    "release": lambda *a, **k: None,
    "expire": lambda *a, **k: 0,
    "run_add": lambda *a, **k: None,
    "run_totals": lambda *a, **k: {},
    "run_end": lambda *a, **k: None,
    "idle_runs": lambda *a, **k: [],
    "tools_put": lambda *a, **k: None,
    "tools_take": lambda *a, **k: [],
    "tools_pending": lambda *a, **k: [],
    "budget_get": lambda *a, **k: (None, None),
}


class FailOpenStore:
    """A Store whose operations, when the backend is unreachable, answer neutrally."""

    def __init__(self, inner: Store) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        target = getattr(self._inner, name)
        fallback = _FALLBACKS.get(name)
        if fallback is None:
            return target
        return _guarded(name, target, fallback)

    async def settle(
        self,
        admission: Admission,
        actual: int,
        *,
        run_totals: dict[str, int] | None = None,
        tools: list[dict[str, Any]] | None = None,
        contexts: dict[str, int] | None = None,
    ) -> int:
        if admission.id != _UNMETERED:
            settle = _guarded("settle", self._inner.settle, _FALLBACKS["settle"])
            result: int = await settle(admission, actual, run_totals=run_totals, tools=tools, contexts=contexts)
            return result
        # Admitted while the ledger was away: there is no reservation to settle, and the
        # store would treat it as settled before, dropping the totals and tool calls too.
        # Record those on their own (best effort, they are not money).
        if run_totals:
            await self.run_add(admission.tenant, admission.run_id, run_totals)
        if tools:
            await self.tools_put(admission.tenant, admission.run_id, tools)
        return 0

    def queues_settle(self, admission: Admission) -> bool:
        return False  # its settle waits for the store, to answer a failure neutrally

    async def settle_in_order(self, admission: Admission, actual: int, *, run_totals: dict[str, int] | None = None,
                              tools: list[dict[str, Any]] | None = None,
                              contexts: dict[str, int] | None = None) -> Awaitable[int]:
        # Ordered once done: the settle of an unmetered admission is two operations, and a
        # failure must be answered neutrally, not surface when the result is awaited.
        return done_future(await self.settle(admission, actual, run_totals=run_totals, tools=tools, contexts=contexts))


def _guarded(name: str, target: Callable[..., Any], fallback: Callable[..., Any]) -> Callable[..., Any]:
    async def guarded(*args: Any, **kwargs: Any) -> Any:
        try:
            return await target(*args, **kwargs)
        except StoreUnavailable as exc:
            log.error("ledger unreachable during %s; fail_open is on, so the call goes through "
                      "UNMETERED: %s", name, exc.message)
            return fallback(*args, **kwargs)

    return guarded
