"""What a call adds to its run's totals (proxy/serve/bookkeeping.py `_totals`) and how a run
reads them back (proxy/govern/runs.py `read_whole`): counters a call leaves at zero are not
written, every other total is, and a run with calls reads every counter."""

from __future__ import annotations

from proxy.govern.runs import CALL_COUNTERS, read_whole
from proxy.model import Call, Caller, CallRecord, Outcome, Repair, Rewrite, ToolCall, Usage
from proxy.serve.bookkeeping import _totals

CALLER = Caller("acme", "r-1", "header")
CALL = Call(api="chat", operation="chat", model="gpt-4o")


def _record(**kw: object) -> CallRecord:
    outcome = kw.pop("outcome", Outcome(status=200, usage=Usage(input_tokens=12, output_tokens=3)))
    return CallRecord(CALLER, CALL, outcome, 0, cost_micros=kw.pop("cost_micros", 40), **kw)  # type: ignore[arg-type]


def test_a_quiet_call_writes_only_what_it_adds() -> None:
    assert _totals(_record(), ()) == {"model_calls": 1, "input_tokens": 12, "output_tokens": 3, "cost_micros": 40}
    assert read_whole(_totals(_record(), ())) == {name: 0 for name in CALL_COUNTERS} | {
        "model_calls": 1, "input_tokens": 12, "output_tokens": 3, "cost_micros": 40}


def test_every_counter_a_busy_call_adds_is_one_a_run_reads_back_whole() -> None:
    busy = _record(outcome=Outcome(status=500, error_type="500", tool_calls=(ToolCall("c1", "f", "{}"),),
                                   usage=Usage(input_tokens=12, output_tokens=3, cache_read_tokens=4)),
                   saved_micros=2, premium_micros=1, repairs=[Repair("text", ("fence",))])
    added = _totals(busy, ({"ok": False},))
    assert set(added) == set(CALL_COUNTERS), "a counter outside CALL_COUNTERS would read as missing, not zero"
    assert all(added.values())


def test_totals_beside_the_counters_are_written_even_at_zero() -> None:
    noticed = _record(outcome=Outcome(status=200, tool_calls=(ToolCall("c1", "f", "{}"),), usage=Usage()),
                      rewrites=[Rewrite("wrap_up", "calls")])
    added = _totals(noticed, ())
    assert added["wrap_up_notices"] == 1 and added["answers_after_notice"] == 0


def test_a_run_that_made_no_model_call_reads_as_it_counted() -> None:
    assert read_whole({"ceilings_hit": 1}) == {"ceilings_hit": 1}
