"""An agent resends its whole history each call: the ledger sees each earlier tool result of a
run once per process (`Runs.unsent`), every new one always, and a run's memory ends with it."""

from __future__ import annotations

from pathlib import Path

from proxy.govern.runs import Runs
from proxy.ledger.backends import open_store
from proxy.model import Caller, ToolResult

CALLER = Caller("acme", "run-1", "header")


def _results(*ids: str, new: tuple[str, ...] = ()) -> tuple[ToolResult, ...]:
    return tuple(ToolResult(i, "{}", "t", new=i in new) for i in ids)


async def test_earlier_results_are_sent_once_and_new_ones_always(tmp_path: Path) -> None:
    store = open_store(f"sqlite:///{tmp_path / 'l.db'}")
    runs = Runs(store, None, 600.0)
    first = _results("a", "b", new=("a", "b"))
    assert runs.unsent(CALLER, first) == first
    runs.admitted(CALLER, (("a", True), ("b", True)))
    # Call 2 carries a and b again (history) and c (new), and a framework's own result f
    # that stands before its last turn: f was never sent, so it goes.
    second = _results("a", "b", "f", "c", new=("c",))
    assert [r.call_id for r in runs.unsent(CALLER, second)] == ["f", "c"]
    # A result marked new goes even when its id was sent (Gemini reuses a name as the id).
    assert [r.call_id for r in runs.unsent(CALLER, _results("a", new=("a",)))] == ["a"]
    # Another run, and the same run after it ended, have sent nothing.
    other = Caller("acme", "run-2", "header")
    assert runs.unsent(other, second) == second
    await runs.end("acme", "run-1")
    assert runs.unsent(CALLER, second) == second
    await store.aclose()
