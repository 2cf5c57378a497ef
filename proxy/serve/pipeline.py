"""What a model call and an MCP request share of admit -> forward -> relay -> settle.

    admit    the route's one store operation (Store.admit, Store.admit_tool), after the run's
             bookkeeping in flight (`admission_turn`); a refusal is named by `refusal_reason`
             (proxy.model.RefusalReason: the same word on both routes) and adds
             `refusal_totals` to its run (`add_run_totals`)
    forward  proxy/serve/upstream.py, the only client
    relay    proxy/serve/relay.py through the route's answer reader (`relay.Relayed`)
    settle   after the answer, in the run's order (serve/background.py), so the answer never
             waits for the ledger and a client that leaves cancels the relay, never the
             settlement: `after_answer` (a task) for an MCP request and a refusal's totals;
             a model call's is a plain callback, a task only where it waits
             (serve/bookkeeping.py `answered`)

Each route plugs in its wire format (the error shape, the answer's reader) and its own
admission and settlement operation. Both routes go through all of it: proxy/mcp/route.py,
and the model route (proxy/serve/handler.py: `admission_turn`; bookkeeping.py `answered`,
and a refusal's reason and totals, added after the answer by `after_answer`).
"""

from __future__ import annotations

import logging
from collections.abc import Coroutine
from typing import Any

from aiohttp import web

from proxy.errors import (
    CeilingReached,
    LoopRefused,
    ProxyError,
    RateLimited,
    RequestError,
    StoreUnavailable,
)
from proxy.ledger.store import Store
from proxy.model import REFUSAL_KINDS, Caller, RefusalReason
from proxy.serve.appkeys import BACKGROUND

__all__ = ["add_run_totals", "admission_turn", "after_answer", "refusal_reason", "refusal_totals"]

log = logging.getLogger("spanmeter.pipeline")

_BY_NAME: dict[str, RefusalReason] = {reason: reason for reason in REFUSAL_KINDS}


def refusal_reason(exc: ProxyError) -> RefusalReason:
    """Why admission refused a call, in the one vocabulary: the limit a ceiling or rate
    limit names, else what kind of refusal it was."""
    if isinstance(exc, CeilingReached | RateLimited):
        # A limit the vocabulary lacks would mint a label no dashboard knows; a unit test
        # holds every limit the ledger names to the vocabulary.
        return _BY_NAME.get(exc.limit, "refused")
    if isinstance(exc, LoopRefused):
        return "loop_detected"
    if isinstance(exc, StoreUnavailable):
        return "ledger_unavailable"
    if isinstance(exc, RequestError):  # a run-limit header (X-Run-Max-*) it cannot read
        return "invalid_request"
    return "refused"


def refusal_totals(exc: ProxyError, failed_tools: int) -> dict[str, int]:
    """A refused call's additions to its run's totals: a ceiling hit, and the tool calls
    that failed (the results a refused model call carried; an MCP call a model made)."""
    totals = {"ceilings_hit": 1} if isinstance(exc, CeilingReached) else {}
    if failed_tools:
        totals["tool_failures"] = failed_tools
    return totals


async def add_run_totals(store: Store, caller: Caller, totals: dict[str, int]) -> None:
    """Add `totals` to the caller's run; a ledger that fails loses them, logged, never the
    refusal's answer."""
    if not totals:
        return
    try:
        await store.run_add(caller.tenant, caller.run_id, totals)
    except Exception:
        log.warning("could not record the totals of a refused call of run %s", caller.run_id, exc_info=True)


async def admission_turn(app: web.Application, caller: Caller) -> None:
    """Wait until the run's bookkeeping in flight here is ordered ahead: the tool calls the
    previous call made are stored, and its spend is what this admission counts."""
    await app[BACKGROUND].wait_ordered((caller.tenant, caller.run_id))


def after_answer(app: web.Application, caller: Caller, work: Coroutine[Any, Any, None]) -> None:
    """Run `work` (a settlement, its spans, the run's totals) off the answer's path, in the
    run's order: the run's next admission waits for it (`admission_turn`)."""
    app[BACKGROUND].spawn((caller.tenant, caller.run_id), work)
