"""Run bookkeeping: one trace per run, tool spans rebuilt across calls, run ends.

A tool call seen in response N is kept in run state (the shared store, so any replica
can close it); the request that carries its result closes it with an `execute_tool`
span timed from the delivery of N to the arrival of that request.

A tool call executed through the MCP route is marked `mcp` there (Store.admit_tool), and
its MCP span (tracing/mcp.py), measured and linked to the chat span that made the call,
replaces the inferred one: no inferred span, no second count, no "missing" result.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any, Final

from proxy.ledger.store import Store
from proxy.model import Call, Caller, Outcome, RunIdSource, ToolRecord, ToolResult
from tracing import spans
from tracing.digests import canonical_sha256, tool_result_digest
from tracing.setup import Telemetry

__all__ = ["CALL_COUNTERS", "Runs", "pending_tools", "read_whole", "results_ok"]

log = logging.getLogger("spanmeter.runs")
KNOWN_RUNS = 10_000

# What every model call adds to its run's totals (proxy/serve/bookkeeping.py). A counter is
# stored only when the call adds to it: most calls add zero to most of them, and each
# stored one is a row written (or a hash field) on every call. A run with calls reads as
# having every one of them (`read_whole`), so its span and the admin API show the zeros.
CALL_COUNTERS: Final = ("model_calls", "tool_failures", "tool_calls", "failures", "input_tokens", "output_tokens",
                        "cost_micros", "repairs", "cache_read_tokens", "cost_saved_micros",
                        "cache_write_premium_micros")
_ZEROS: Final = dict.fromkeys(CALL_COUNTERS, 0)


def read_whole(totals: dict[str, int]) -> dict[str, int]:
    """A run's totals as the store gave them, with the per-call counters its calls left at
    zero (none for a run that made no model call: only a refusal's counters)."""
    return _ZEROS | totals if "model_calls" in totals else totals


class Runs:
    def __init__(self, store: Store, tel: Telemetry | None, idle_timeout_s: float) -> None:
        self._store = store
        self._tel = tel
        self._idle = idle_timeout_s
        self._sweeper: asyncio.Task[None] | None = None
        # Runs this process has begun: their ids never change, so only a run's first call
        # here needs the store (a cache; any replica may begin or end any run).
        self._known: OrderedDict[tuple[str, str], spans.RunTrace] = OrderedDict()
        # Ids made for a run's first call here, until its admission says whether the store kept them.
        self._fresh: OrderedDict[tuple[str, str], spans.RunTrace] = OrderedDict()
        # Tool-call ids whose results the ledger has admitted, per run (`unsent`), bounded as _known.
        self._sent: OrderedDict[tuple[str, str], set[str]] = OrderedDict()
        # What must reach a run's totals before it ends (the cost anatomy's unflushed sums).
        self.before_end: Callable[[str, str], Awaitable[None]] | None = None

    def candidate(self, caller: Caller, parent: spans.TraceParent | None, start_ns: int) -> dict[str, str]:
        """Trace ids for the run (starting at its first call's arrival), kept by the
        admission if the run has none yet, with what the run span says of the run's
        caller: how the run was named, its agent and conversation (the first call's)."""
        key = (caller.tenant, caller.run_id)
        known = self._known.get(key)
        if known is None:  # kept for `trace`, which would otherwise decode what the store kept of it
            known = self._fresh[key] = spans.new_run_trace(parent, start_ns=start_ns)
            if len(self._fresh) > KNOWN_RUNS:
                self._fresh.popitem(last=False)
        found: dict[str, str] = {"ids": known.encode(), "source": caller.run_id_source}
        if caller.agent_name is not None:
            found["agent"] = caller.agent_name
        if caller.conversation_id is not None:
            found["conversation"] = caller.conversation_id
        return found

    def known(self, caller: Caller) -> spans.RunTrace | None:
        """The run's trace ids, when this process has begun the run (no store needed)."""
        return self._known.get((caller.tenant, caller.run_id))

    def trace(self, caller: Caller, stored: dict[str, Any] | None, parent: spans.TraceParent | None) -> spans.RunTrace:
        """The run's trace ids as the store fixed them (whichever replica saw the run first);
        fresh ones when the store had none to give (fail-open)."""
        key = (caller.tenant, caller.run_id)
        fresh = self._fresh.pop(key, None)
        if stored is None:
            return self._known.get(key) or fresh or spans.new_run_trace(parent)
        known = self._known.get(key)
        if known is not None and known.encode() == stored["ids"]:
            self._known.move_to_end(key)
            return known
        ids = stored["ids"]
        run = self._known[key] = fresh if fresh is not None and fresh.encode() == ids else spans.RunTrace.decode(ids)
        if len(self._known) > KNOWN_RUNS:
            self._known.popitem(last=False)
        return run

    def close_tools(self, caller: Caller, call: Call, closed: tuple[dict[str, Any], ...], lineage: spans.Lineage,
                    arrived_ns: int, *, capture: bool = True) -> None:
        """An `execute_tool` span for each tool call this request's results closed, under
        `lineage` (the agent's span, or the run's root)."""
        if self._tel is None or not closed:
            return
        results = {r.call_id: r for r in call.tool_results}
        # The request that answers a tool call usually declares the tools again.
        described = {t.name: t.description for t in call.tools if isinstance(t.description, str)}
        for p in closed:
            result = results.get(p["id"])
            if result is None or p.get("mcp"):
                continue
            record = ToolRecord(caller, p["name"], result.call_id, p["arguments"], result.content,
                                p["delivered_ns"], arrived_ns, is_error=result.is_error,
                                description=described.get(p["name"]), capture=capture)
            spans.tool_span(self._tel, record, parent=lineage.parent, run_trace=lineage.run_trace, link=_link(p))

    def unsent(self, caller: Caller, results: tuple[ToolResult, ...]) -> tuple[ToolResult, ...]:
        """The results the ledger must see: every new one, and each earlier one this process
        has not already had admitted for the run. An agent resends its whole history every
        call; joining each earlier result by id again (issue 54) would make every admission
        look up the run's every result. Another process sends them once more: harmless, as
        the ledger closes a call once."""
        sent = self._sent.get((caller.tenant, caller.run_id))
        if not sent:
            return results
        return tuple(r for r in results if r.new or r.call_id not in sent)

    def admitted(self, caller: Caller, results: tuple[tuple[str, bool], ...]) -> None:
        """An admission carrying `results` went through: the ledger has seen them."""
        if not results:
            return
        key = (caller.tenant, caller.run_id)
        sent = self._sent.get(key)
        if sent is None:
            sent = self._sent[key] = set()
            if len(self._sent) > KNOWN_RUNS:
                self._sent.popitem(last=False)
        else:
            self._sent.move_to_end(key)
        sent.update(call_id for call_id, _ in results)

    async def end(self, tenant: str, run_id: str, status: str = "ended",
                  source: RunIdSource = "header") -> bool:
        known = self._known.pop((tenant, run_id), None)
        self._sent.pop((tenant, run_id), None)
        if self.before_end is not None:
            await self.before_end(tenant, run_id)
        rec = await self._store.run_end(tenant, run_id)
        if rec is None:
            return False  # already ended, by us or another replica
        open_ids = [p["id"] for p in await self._store.tools_pending(tenant, run_id)]
        taken = await self._store.tools_take(tenant, run_id, open_ids) if open_ids else []
        pending = [p for p in taken if not p.get("mcp")]  # executed on the MCP route: its span says so
        if pending:  # tool calls never answered: failed, as their spans say
            await self._store.run_add(tenant, run_id, _missing(pending))
            counted = await self._store.run_totals(tenant, run_id)
        else:
            # The run's record carries its totals, read in the same store operation that
            # ended it (Store.run_end); nothing here has added to them since. Asking again
            # cost a ledger round trip on every ended run: with runs of one call (no
            # X-Run-Id), on every call.
            counted = rec["totals"]
        self._ended(rec, pending, counted, status, source, known)
        return True

    def end_held(self, caller: Caller) -> bool:
        """End a run made for one call (no X-Run-Id, no traceparent) that the store holds in
        this process's memory (`Store.end_held`: budget leases' runs of one call) here and
        now, as `end` would: no ledger operation, no task. False: not held here; end it
        with `end`. Its cost anatomy has no chain to flush: a run of one call prices its
        results with its call (serve/bookkeeping.py)."""
        if caller.run_id_source != "generated":
            return False
        held = self._store.end_held(caller.tenant, caller.run_id)
        if held is None:
            return False
        key = (caller.tenant, caller.run_id)
        known = self._known.pop(key, None)
        self._sent.pop(key, None)
        pending = [p for p in held.tools if not p.get("mcp")]
        counted = held.record["totals"]
        if pending:
            missing = _missing(pending)
            held.add(missing)
            counted = {name: counted.get(name, 0) + missing.get(name, 0) for name in counted.keys() | missing}
        self._ended(held.record, pending, counted, "ended", caller.run_id_source, known)
        return True

    def _ended(self, rec: dict[str, Any], pending: list[dict[str, Any]], counted: dict[str, int], status: str,
               source: RunIdSource, known: spans.RunTrace | None = None) -> None:
        """A run's end in telemetry (`rec`: its record as the store ended it): a failed span
        for each of its tool calls never answered, its root span and its count."""
        if self._tel is None:
            return
        totals = {"failures": 0, "tool_failures": 0, **read_whole(counted)}
        stored = rec.get("trace")
        caller = _run_caller(rec["tenant"], rec["run_id"], stored, source)
        if stored and known is not None and known.encode() == stored["ids"]:
            run = known  # the ids this process began the run with: nothing to decode
        else:
            run = spans.RunTrace.decode(stored["ids"]) if stored else spans.new_run_trace()
        now = time.time_ns()
        for p in pending:
            missing = ToolRecord(caller, p["name"], p["id"], p["arguments"], None, p["delivered_ns"], now,
                                 is_error=True)
            spans.tool_span(self._tel, missing, run_trace=run, link=_link(p))
        spans.end_run(self._tel, caller, run, totals, "ceiling" if totals.get("ceilings_hit") else status)

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
                if await self._store.sweep_turn(every_s):  # one replica per period on a shared ledger
                    await self.sweep_once()
            except Exception:
                log.warning("run sweeper failed; will retry", exc_info=True)


def pending_tools(outcome: Outcome, delivered_ns: int, ref: spans.SpanRef | None,
                  delivered: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    """The tool calls a response made, as kept in run state until their results arrive,
    with the arguments the agent received (`delivered`: by call id, where a repair changed
    them): the tool ran with those. `sig` (name + hash of canonical arguments) is what the
    loop guard's streak compares."""
    link = [ref.trace_id, ref.span_id] if ref else None  # the chat span that made the call
    found = []
    for tc in outcome.tool_calls:
        args = (delivered or {}).get(tc.id, tc.arguments)
        found.append({"id": tc.id, "name": tc.name, "arguments": args, "delivered_ns": delivered_ns, "link": link,
                      "sig": f"{tc.name}:{canonical_sha256(args)}"})
    return found


def _missing(pending: list[dict[str, Any]]) -> dict[str, int]:
    """What a run's tool calls never answered add to its totals when it ends: failed."""
    return {"tool_failures": len(pending), "tool_results_missing": len(pending)}


def results_ok(results: tuple[ToolResult, ...]) -> tuple[tuple[str, bool], ...]:
    """(call id, not a failure) for each of a request's tool results."""
    return tuple((r.call_id, tool_result_digest(r.content, is_error=r.is_error).ok) for r in results)


def _run_caller(tenant: str, run_id: str, stored: dict[str, Any] | None,
                source: RunIdSource = "header") -> Caller:
    """The run's caller as its first call recorded it in run state (see `Runs.candidate`)."""
    stored = stored or {}
    source = stored.get("source") or source
    agent, conversation = stored.get("agent"), stored.get("conversation")
    return Caller(tenant, run_id, source if source in ("header", "traceparent", "generated") else "header",
                  agent_name=agent if isinstance(agent, str) else None,
                  conversation_id=conversation if isinstance(conversation, str) else None)


def _link(pending: dict[str, Any]) -> spans.SpanRef | None:
    link = pending.get("link")
    return spans.SpanRef(int(link[0]), int(link[1])) if link else None
