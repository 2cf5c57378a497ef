"""Bookkeeping after the answer, off the caller's path: from the call's one `CallState`, its
one `CallRecord`, then the one settle, the span, the metrics, the access line and the run's
end; and the same for a refused or abandoned call (its call and span). It never raises into
the answer."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Coroutine, Iterator, Mapping
from dataclasses import dataclass, replace
from functools import partial

from aiohttp import web

from proxy.anatomy import FLUSH_EVERY, Chain, Splits, shares, split_of
from proxy.errors import (
    ProxyError,
    Refusal,
    UpstreamProtocolError,
    UpstreamTimeout,
)
from proxy.govern.ceilings import Admitted, settle_amount
from proxy.govern.runs import CALL_COUNTERS, pending_tools
from proxy.model import Anatomy, Call, Caller, CallRecord, Flushed, Outcome, Usage
from proxy.pricing import Price, cache_savings, cache_write_premium
from proxy.providers.hooks import Hooks
from proxy.providers.translator import Translator
from proxy.serve import accesslog, content
from proxy.serve.appkeys import BACKGROUND, DEPLOYMENTS, PRICES, RUNS, SETTINGS, SPLITS, STORE, TEL
from proxy.serve.background import Background, Started, start
from proxy.serve.pipeline import add_run_totals, after_answer, refusal_reason, refusal_totals
from proxy.serve.state import CallState
from tracing import anatomy as anatomy_attrs
from tracing import spans

__all__ = ["abandoned", "answered", "flush_anatomy", "refused"]

log = logging.getLogger("spanmeter.handler")


def refused(app: web.Application, call: Call, cs: spans.CallSpan, exc: ProxyError) -> None:
    """End a refused call: its record, span and access line now; then, off the answer's path
    and in its run's order (serve/pipeline.py, as for a refused MCP call), its run's totals
    and the end of a run made for this one call."""
    caller = cs.caller
    record = CallRecord(caller, call, _refusal_outcome(exc), cs.start_ns, time.time_ns(), forwarded=False,
                        cost_micros=0, refusal=refusal_reason(exc))
    spans.end_call(app[TEL], cs, record)
    accesslog.access(record)
    # The tool results it carried arrived, whatever became of the call: a failed one counts.
    failed = _failed_tools(exc.closed) if isinstance(exc, Refusal) else 0
    after_answer(app, caller, _after_refusal(app, caller, refusal_totals(exc, failed)))


async def _after_refusal(app: web.Application, caller: Caller, totals: dict[str, int]) -> None:
    await add_run_totals(app[STORE], caller, totals)  # before the run can end
    await app[RUNS].after_call(caller, end=False)


def abandoned(app: web.Application, call: Call, cs: spans.CallSpan) -> None:
    """End the span of a call whose client went away before it was forwarded."""
    outcome = Outcome(status=499, error_type="client_disconnected", complete=False,
                      error_message="the client closed the connection before the call was forwarded")
    record = CallRecord(cs.caller, call, outcome, cs.start_ns, time.time_ns(), forwarded=False, cost_micros=0)
    spans.end_call(app[TEL], cs, record)
    accesslog.access(record)


def _refusal_outcome(exc: ProxyError) -> Outcome:
    return Outcome(status=exc.status, error_type=exc.error_type, error_message=exc.message, complete=False)


def answered(state: CallState) -> None:
    """The call's bookkeeping, off the answer's path. With a store whose settle is queued
    without waiting (`Store.queues_settle`: SQLite's one writer, a leased call), a plain callback on the loop's
    next turn (after the answer is written), not a task: its run's next call is held
    (serve/background.py) until the settle is queued, which orders it there and then, and
    what reads its result (the overshoot, the budget gauges, the span, the access line) is
    a callback on that result; only a run that ends here is a task. With any other store
    (a settle over the network), a task of its own, as before: its
    `settle_in_order` may need one (a timeout, `current_task`) before it first waits."""
    app, caller = state.request.app, state.span.caller
    key = (caller.tenant, caller.run_id)
    if app[STORE].queues_settle(state.admitted.admission):
        app[BACKGROUND].hold(key)
        asyncio.get_running_loop().call_soon(_finish_now, state)
    else:
        after_answer(app, caller, _finish_task(state))




@dataclass(slots=True)
class _Books:
    """What is left of a call once its settle is submitted: what reads the settle's result."""

    app: web.Application
    cs: spans.CallSpan
    record: CallRecord
    admitted: Admitted
    amount: int
    flushed: list[Flushed]
    end: bool
    # The settle's run totals, open tool calls and context sizes (let go once it is submitted).
    totals: dict[str, int]
    tools: list[dict[str, object]] | None
    contexts: dict[str, int] | None

    def settle(self) -> Coroutine[object, object, Awaitable[int]]:
        """The call's one store operation: the charge, the run's totals, its open tool calls."""
        settle = self.app[STORE].settle_in_order(self.admitted.admission, self.amount, run_totals=self.totals,
                                                 tools=self.tools, contexts=self.contexts)
        self.totals, self.tools, self.contexts = {}, None, None
        return settle


def _finish_now(state: CallState) -> None:
    app, caller = state.request.app, state.span.caller
    key = (caller.tenant, caller.run_id)
    background = app[BACKGROUND]
    try:
        books = _books(state)
    except Exception:
        background.release(key)
        log.exception("bookkeeping after a call failed; the caller already has its answer")
        return
    del state  # the request and its answer are not held while the ledger works
    try:
        done, settling = start(books.settle())
    except ProxyError:
        if not books.end:
            background.release(key)
        _settled(books, None)
        _end_run(books, background, key)
        return
    except Exception:
        background.release(key)
        log.exception("bookkeeping after a call failed; the caller already has its answer")
        return
    if not done:  # it waited after all: the rest in a task, from where it stopped
        background.spawn(key, _finish_task(None, books, settling))
        background.release(key)  # the task holds the run now
        return
    if not books.end:  # a run that ends here is waited for to its end (govern/runs.py)
        background.release(key)  # ordered: its next call may be admitted now
    if isinstance(settling, asyncio.Future):
        background.watch(settling)
        settling.add_done_callback(partial(_on_settled, books, background, key))
    else:  # an awaitable of another kind: awaited by a task
        background.spawn(key, _after_settle(books, settling))
        if books.end:
            background.release(key)  # the task holds the run now


def _on_settled(books: _Books, background: Background, key: tuple[str, str], settling: asyncio.Future[int]) -> None:
    if settling.cancelled():
        if books.end:
            background.release(key)
        return
    try:
        exc = settling.exception()
        if exc is not None and not isinstance(exc, ProxyError):
            raise exc
        _settled(books, None if exc is not None else settling.result())
    except Exception:
        if books.end:
            background.release(key)
        log.exception("bookkeeping after a call failed; the caller already has its answer")
        return
    _end_run(books, background, key)


def _end_run(books: _Books, background: Background, key: tuple[str, str]) -> None:
    """After the span: the run's end, when it ends here (X-Run-End, or a run made for this
    one call), in a task, or at once for a run of one call the store holds in memory
    (`Runs.end_held`); otherwise `Runs.after_call` has nothing to wait for and is run in
    place. The run's next call was held until here when it ends here."""
    caller = books.cs.caller
    if caller.run_id_source == "generated" and _end_held(books):
        pass  # a run of one call held in memory: ended here and now (Runs.end_held)
    elif books.end or caller.run_id_source == "generated":
        background.spawn(key, _after_call(books))
    else:
        try:
            done, rest = start(books.app[RUNS].after_call(caller, end=False))
            if not done:
                background.spawn(key, _after_call(books, rest))
        except Exception:
            log.exception("bookkeeping after a call failed; the caller already has its answer")
    if books.end:
        background.release(key)


def _end_held(books: _Books) -> bool:
    try:
        return books.app[RUNS].end_held(books.cs.caller)
    except Exception:
        log.exception("bookkeeping after a call failed; the caller already has its answer")
        return True  # not ended twice: the sweeper ends what this could not


async def _after_call(books: _Books, rest: Started | None = None) -> None:
    try:
        await (rest if rest is not None else books.app[RUNS].after_call(books.cs.caller, end=books.end))
    except Exception:
        log.exception("bookkeeping after a call failed; the caller already has its answer")


async def _finish_task(state: CallState | None, books: _Books | None = None,
                       started: Started | None = None) -> None:
    """The bookkeeping as a task of its own (`answered`), or the rest of `_finish_now`'s
    once its settle waited (`books`, `started`)."""
    try:
        if books is None:
            assert state is not None
            books = _books(state)
            del state  # the request and its answer are not held while the ledger works
        try:
            settling = await (started if started is not None else books.settle())
        except ProxyError:
            _settled(books, None)
        else:
            if not books.end:
                books.app[BACKGROUND].mark_ordered((books.cs.caller.tenant, books.cs.caller.run_id))
            await _after_settle(books, settling)
            return
        await books.app[RUNS].after_call(books.cs.caller, end=books.end)
    except Exception:
        log.exception("bookkeeping after a call failed; the caller already has its answer")


async def _after_settle(books: _Books, settling: Awaitable[int]) -> None:
    try:
        try:
            overshoot = await settling
        except ProxyError:
            _settled(books, None)
        else:
            _settled(books, overshoot)
        await books.app[RUNS].after_call(books.cs.caller, end=books.end)
    except Exception:
        log.exception("bookkeeping after a call failed; the caller already has its answer")


def _books(state: CallState) -> _Books:
    """The call's one record, its settle's arguments (the charge, the run's totals, its open
    tool calls and context sizes: one store operation) and what reads its result."""
    request, tr, admitted, answer, cs, deployment = (state.request, state.tr, state.admitted, state.answer, state.span,
                                                     state.deployment)
    app, call, hooks, capture = request.app, tr.call, answer.hooks, state.capture
    end = request.headers.get("x-run-end", "").lower() == "true"
    outcome = answer.outcome()
    if deployment is not None:
        app[DEPLOYMENTS].learn(deployment, outcome.response_model)
    admitted = _priced_as_run(app, admitted, outcome.response_model, cs.provider)
    failed = (outcome.status >= 400 or outcome.status == 0) and outcome.error_type not in _MAYBE_BILLED
    amount, source = settle_amount(admitted, _final_usage(outcome),
                                   failed_before_output=failed and not outcome.text
                                   and not outcome.tool_calls, input_only=not call.generates_output)
    reported = source in ("reported", "unpriced") and outcome.usage.input_tokens is not None
    an, flushed = _anatomy(app, cs, tr, admitted.price, outcome.usage if reported else None, end)
    # The call's one record: the settle's totals, the span, the metrics and the access line read it.
    record = CallRecord(
        cs.caller, call, outcome, cs.start_ns, answer.delivered_ns, cost_micros=amount, usage_source=source,
        budget_remaining_micros=_remaining(admitted, amount), saved_micros=_saved(admitted, outcome.usage, source),
        premium_micros=_premium(admitted, outcome.usage, source), rewrites=hooks.rewrites, repairs=hooks.repairs,
        chunk_gaps_s=answer.chunk_gaps_s, delivered_text=hooks.delivered_text,
        delivered_arguments=hooks.delivered_arguments,
        capture=_capture(tr, outcome, hooks) if capture else None,
        anatomy=an)
    totals = _totals(record, admitted.admission.closed)
    if source == "estimate":  # the tokens it held stand for those never reported: unknown is not zero
        used = (outcome.usage.input_tokens or 0) + (outcome.usage.output_tokens or 0)
        totals["estimated_tokens"] = max(0, admitted.admission.tokens - used)
    if an is not None:
        totals |= anatomy_attrs.call_totals(an, outcome.tool_calls)
    for f in flushed:
        _add_totals(totals, anatomy_attrs.flush_totals(f))
    tools = pending_tools(outcome, answer.delivered_ns, cs.ref, hooks.delivered_arguments) or None
    contexts = answer.stored_sizes(outcome) or None
    return _Books(app, cs, record, admitted, amount, flushed, end, totals, tools, contexts)


def _settled(books: _Books, overshoot: int | None) -> None:
    """After the settle: its overshoot and the budget gauges (None: it failed), then the
    span, the flushed anatomy's metrics and the access line."""
    app, cs, record = books.app, books.cs, books.record
    caller = cs.caller
    if overshoot is None:
        # The reservation stays and expires at its full amount: unknown is not zero.
        log.error("could not settle call of run %s; its reservation stands", caller.run_id)
        record = replace(record, budget_remaining_micros=None)  # nothing was settled: no headroom to report
    else:
        spans.record_ledger_overshoot(app[TEL], caller, overshoot)
        _report_budgets(app, caller, books.admitted, books.amount)
    # The span ends when the last byte was delivered, not after our bookkeeping.
    spans.end_call(app[TEL], cs, record)
    for f in books.flushed:
        spans.record_flushed(app[TEL], caller.tenant, f)
    accesslog.access(record, parts=app[SETTINGS].access_log_anatomy)


def _anatomy(app: web.Application, cs: spans.CallSpan, tr: Translator, price: Price | None, usage: Usage | None,
             end: bool) -> tuple[Anatomy | None, list[Flushed]]:
    """Where the call's input went, when the provider said how much it was (SPANMETER_ANATOMY);
    and what the run's parts and tool results cost since its chain's last flush, when it is
    time to say (proxy/anatomy/shares.py: every FLUSH_EVERY calls of the run, the run's
    end). The sums are counted in metrics under the call's provider and model (`labels`)."""
    splits: Splits = app[SPLITS]
    caller: Caller = cs.caller
    labels = (cs.provider, tr.call.model or "")
    flushed: list[Flushed] = []
    an = None
    try:
        if app[SETTINGS].anatomy and usage is not None:
            # A run's next request resends this one: its chain is kept for it (proxy/anatomy/shares.py).
            ex = tr.request  # it reads the request's parts in its API's shapes
            key = (caller.tenant, caller.run_id) if caller.run_id_source != "generated" else None
            chain = splits.get(key) if key else None
            sp = split_of(ex, ex.raw, ex.body, chain.split if chain else None)
            an = shares(sp, usage, price)
            if an is not None and key is None:  # a run of one call: its results are priced now
                chain = Chain(sp)
                chain.add(sp, an, time.monotonic(), labels)
                flushed.append(chain.flush())
            elif an is not None and key is not None:
                chain = splits.advance(key, sp, an, time.monotonic(), labels)
                if chain.unflushed >= FLUSH_EVERY and not end:
                    flushed.append(chain.flush())
        if end:  # no next request: every chain of the run is flushed with its last call
            flushed += [f for _, f in splits.of_run(caller.tenant, caller.run_id)]
    except Exception:  # a body of a shape no API module foresaw: no anatomy, never a failed call
        log.warning("could not split the input of a call of run %s", caller.run_id, exc_info=True)
        return None, flushed
    return an, flushed


def _add_totals(totals: dict[str, int], more: dict[str, int]) -> None:
    for name, value in more.items():
        totals[name] = totals.get(name, 0) + value


async def flush_anatomy(app: web.Application, flushed: list[tuple[tuple[str, ...], Flushed]]) -> None:
    """Add what chains' results cost since their last flush to their runs' totals, apart
    from any call (a chain idle a moment, one pushed out of the cache, a run ended by the
    sweeper or at shutdown). Every run's at once: one ledger batch, not a round trip each,
    so the flusher keeps up with the runs a busy process drops. A ledger that fails loses
    this flush's sums only, logged."""
    by_run: dict[tuple[str, str], dict[str, int]] = {}
    for key, f in flushed:
        if f.tools or f.results or f.kinds:
            _add_totals(by_run.setdefault((key[0], key[1]), {}), anatomy_attrs.flush_totals(f))
            spans.record_flushed(app[TEL], key[0], f)
    store = app[STORE]
    # analytics: no fsync to wait for (soon)
    done = await asyncio.gather(*(store.run_add(tenant, run_id, totals, soon=True)
                                  for (tenant, run_id), totals in by_run.items()), return_exceptions=True)
    for (_, run_id), outcome in zip(by_run, done, strict=True):
        if isinstance(outcome, ProxyError):
            log.warning("could not add the tool results' cost to run %s; its anatomy under-counts them", run_id)
        elif isinstance(outcome, BaseException):
            raise outcome


def _priced_as_run(app: web.Application, admitted: Admitted, response_model: str | None,
                   provider: str | None) -> Admitted:
    """The call charged at the price of the model the answer says ran, when the table knows
    it: an alias (claude-sonnet-4-0, gpt-4o) was reserved at the dearest model it may
    resolve to, and a dated snapshot may bill differently from its undated name."""
    ran = app[PRICES].price(response_model, provider) if response_model else None
    return admitted if ran is None or ran is admitted.price else replace(admitted, price=ran)


def _final_usage(outcome: Outcome) -> Usage:
    """Usage counts only once the answer finished: Anthropic's message_start and Gemini's
    running counts are partial, and what a cut stream really cost is unknown (not zero)."""
    if outcome.finish_reasons or (outcome.complete and not outcome.error_type):
        return outcome.usage
    return replace(outcome.usage, output_tokens=None)


# A timeout or a broken answer after the request went out may still be billed by the
# provider (it was generating): charge the reservation. Only an error status from the
# upstream, or a connection never made, proves that nothing was generated.
_MAYBE_BILLED = frozenset({UpstreamTimeout("").error_type, UpstreamProtocolError("").error_type})


def _capture(tr: Translator, outcome: Outcome, hooks: Hooks) -> Mapping[str, object]:
    """Message content for the span of a call whose content is captured (state.captures): the
    model's answer and, if a repair changed it, the answer the agent received."""
    return content.capture(tr.request.input_messages(), outcome, delivered_text=hooks.delivered_text,
                           delivered_arguments=hooks.delivered_arguments)


def _budgets(admitted: Admitted, amount: int) -> Iterator[tuple[str | None, int, int]]:
    """(tenant window or None for the run, limit, headroom after this call) per budget that is set."""
    adm, limits = admitted.admission, admitted.limits
    for scope, window, limit in (("run_cost", None, limits.run_max_cost),
                                 ("tenant_day", "day", limits.day_budget),
                                 ("tenant_month", "month", limits.month_budget)):
        rem = adm.remaining.get(scope)
        if rem is None or limit is None:
            continue
        yield window, limit, rem + adm.reserved - amount  # the reservation was replaced by the real cost


def _remaining(admitted: Admitted, amount: int) -> int | None:
    """The smallest budget headroom left after this call."""
    return min((left for _, _, left in _budgets(admitted, amount)), default=None)


def _report_budgets(app: web.Application, caller: Caller, admitted: Admitted, amount: int) -> None:
    """Budget gauges per tenant window, once the call is settled."""
    for window, limit, left in _budgets(admitted, amount):
        if window is not None:
            app[TEL].set_budget(caller.tenant, window, limit - left, limit)


def _failed_tools(closed: tuple[dict[str, object], ...]) -> int:
    """Tool results that came back failed: the run's totals count what its tool spans say.
    A call executed on the MCP route was counted there, from the server's own verdict."""
    return sum(1 for c in closed if not c.get("ok", True) and not c.get("mcp"))


def _saved(admitted: Admitted, usage: Usage, source: str) -> int:
    """What the call's cache reads saved, when it was charged from reported usage."""
    if admitted.price is None or source != "reported":
        return 0
    return cache_savings(admitted.price, usage)


def _premium(admitted: Admitted, usage: Usage, source: str) -> int:
    """What the call's cache writes cost above plain input, when charged from reported usage."""
    if admitted.price is None or source != "reported":
        return 0
    return cache_write_premium(admitted.price, usage)


def _totals(record: CallRecord, closed: tuple[dict[str, object], ...]) -> dict[str, int]:
    """The call's additions to its run's totals: the counters it adds to (CALL_COUNTERS:
    those it leaves at zero are not written; a run reads as having them all)."""
    outcome = record.outcome
    u = outcome.usage
    noticed = {}
    if any(r.kind == "wrap_up" for r in record.rewrites):
        # The run's outcome (spanmeter.runs.ended) tells a run that answered after its note
        # from one cut off by a ceiling.
        answered = not outcome.tool_calls and not outcome.error_type and 0 < outcome.status < 400
        noticed = {"wrap_up_notices": 1, "answers_after_notice": 1 if answered else 0}
    counters = {
        "model_calls": 1,
        "tool_failures": _failed_tools(closed),
        "tool_calls": len(outcome.tool_calls),
        "failures": 1 if outcome.error_type else 0,
        "input_tokens": u.input_tokens or 0,
        "output_tokens": u.output_tokens or 0,
        "cost_micros": record.cost_micros or 0,
        "repairs": len(record.repairs),
        # The prompt cache: the run span's cached share is cache_read_tokens / input_tokens.
        "cache_read_tokens": u.cache_read_tokens or 0,
        "cost_saved_micros": record.saved_micros,
        "cache_write_premium_micros": record.premium_micros,
    }
    # A counter not in CALL_COUNTERS is written at zero too: no reader would fill it in.
    return noticed | {name: n for name, n in counters.items() if n or name not in CALL_COUNTERS}
