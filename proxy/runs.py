"""Run bookkeeping: one trace per run, tool spans rebuilt across calls, run ends.

A tool call seen in response N is kept in run state (the shared store, so any replica
can close it); the request that carries its result closes it with an `execute_tool`
span timed from the delivery of N to the arrival of that request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from datetime import UTC, datetime, timedelta
from typing import Any

from proxy.model import Call, Caller, Outcome
from proxy.policy.store import Store
from proxy.tenants import RunIdSource
from tracing import spans
from tracing.digests import tool_result_digest
from tracing.setup import Telemetry

__all__ = ["Runs", "pending_tools"]

log = logging.getLogger("spanmeter.runs")
KNOWN_RUNS = 10_000


class Runs:
    def __init__(self, store: Store, tel: Telemetry | None, idle_timeout_s: float) -> None:
        self._store = store
        self._tel = tel
        self._idle = idle_timeout_s
        self._sweeper: asyncio.Task[None] | None = None
        # Runs this process has begun: their ids never change, so only a run's first call
        # here needs the store (a cache; any replica may begin or end any run).
        self._known: OrderedDict[tuple[str, str], spans.RunTrace] = OrderedDict()

    async def begin(self, caller: Caller, parent: spans.TraceParent | None) -> spans.RunTrace:
        """The run's trace ids, fixed by whichever replica saw the run first."""
        key = (caller.tenant, caller.run_id)
        known = self._known.get(key)
        if known is not None:
            self._known.move_to_end(key)
            return known
        fresh = spans.new_run_trace(parent)
        rec = await self._store.run_begin(caller.tenant, caller.run_id, datetime.now(UTC),
                                          {"ids": fresh.encode()})
        run = self._known[key] = spans.RunTrace.decode(rec["ids"])
        if len(self._known) > KNOWN_RUNS:
            self._known.popitem(last=False)
        return run

    async def close_tools(
        self, caller: Caller, call: Call, run: spans.RunTrace, parent: spans.TraceParent | None,
        *, capture: bool = True,
    ) -> list[tuple[dict[str, Any], bool]]:
        """Emit a tool span for each result this request carries; returns (call, ok) pairs."""
        if not call.tool_results:
            return []
        arrived = time.time_ns()
        pending = await self._store.tools_take(caller.tenant, caller.run_id, [r.call_id for r in call.tool_results])
        by_id = {p["id"]: p for p in pending}
        closed = []
        for result in call.tool_results:
            p = by_id.get(result.call_id)
            if p is None:
                continue  # a result for a call this proxy never delivered (or already closed)
            ok = tool_result_digest(result.content, is_error=result.is_error).ok
            if self._tel is not None:
                spans.tool_span(
                    self._tel, caller, name=p["name"], call_id=result.call_id, arguments=p["arguments"],
                    result=result.content, is_error=result.is_error, start_ns=p["delivered_ns"],
                    end_ns=arrived, parent=parent, run_trace=run, link=_link(p), capture=capture)
            closed.append((p, ok))
        return closed

    async def end(self, tenant: str, run_id: str, status: str = "ended",
                  source: RunIdSource = "header") -> bool:
        self._known.pop((tenant, run_id), None)
        rec = await self._store.run_end(tenant, run_id)
        if rec is None:
            return False  # already ended, by us or another replica
        open_ids = [p["id"] for p in await self._store.tools_pending(tenant, run_id)]
        pending = await self._store.tools_take(tenant, run_id, open_ids) if open_ids else []
        totals = await self._store.run_totals(tenant, run_id)
        if self._tel is not None:
            caller = Caller(tenant, run_id, source)
            run = spans.RunTrace.decode(rec["trace"]["ids"])
            now = time.time_ns()
            for p in pending:
                spans.tool_span(self._tel, caller, name=p["name"], call_id=p["id"], arguments=p["arguments"],
                                result=None, is_error=True, start_ns=p["delivered_ns"], end_ns=now,
                                parent=None, run_trace=run, link=_link(p))
            totals = {**totals, "tool_results_missing": totals.get("tool_results_missing", 0) + len(pending)}
            spans.end_run(self._tel, caller, run, totals, "ceiling" if totals.get("ceilings_hit") else status)
        return True

    async def after_call(self, caller: Caller, *, end: bool) -> None:
        """After a call's bookkeeping: end its run when the caller asked to (X-Run-End), or
        when the run was made for this one call (no X-Run-Id, no traceparent): such a run
        has no next call, and would otherwise stay open until the idle timeout. Never
        raises: the sweeper ends a run this could not."""
        if not end and caller.run_id_source != "generated":
            return
        try:
            await self.end(caller.tenant, caller.run_id, source=caller.run_id_source)
        except Exception:
            log.warning("could not end run %s; the idle sweeper will", caller.run_id)

    def start_sweeper(self, every_s: float = 15.0) -> None:
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep(every_s))

    async def stop_sweeper(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper

    async def sweep_once(self) -> int:
        now = datetime.now(UTC)
        # Reservations a crashed call never settled count at their full amount.
        await self._store.expire(now)
        before = now - timedelta(seconds=self._idle)
        ended = 0
        for tenant, run_id in await self._store.idle_runs(before):
            ended += await self.end(tenant, run_id, status="idle_timeout")
        return ended

    async def _sweep(self, every_s: float) -> None:
        while True:
            await asyncio.sleep(every_s)
            try:
                await self.sweep_once()
            except Exception:
                log.warning("run sweeper failed; will retry", exc_info=True)


def pending_tools(outcome: Outcome, delivered_ns: int, ref: spans.SpanRef | None) -> list[dict[str, Any]]:
    """The tool calls a response made, as kept in run state until their results arrive."""
    link = [ref.trace_id, ref.span_id] if ref else None  # the chat span that made the call
    return [{"id": tc.id, "name": tc.name, "arguments": tc.arguments, "delivered_ns": delivered_ns, "link": link}
            for tc in outcome.tool_calls]


def _link(pending: dict[str, Any]) -> spans.SpanRef | None:
    link = pending.get("link")
    return spans.SpanRef(int(link[0]), int(link[1])) if link else None
