"""What a run's next request waits for (proxy/serve/background.py): each of the run's tasks in
flight until it is done or says its ledger writes are ordered; nothing of other runs."""

from __future__ import annotations

import asyncio

from proxy.serve.background import Background

RUN, OTHER = ("acme", "r-1"), ("acme", "r-2")


async def _waits(bg: Background, key: tuple[str, str]) -> bool:
    """Whether wait_ordered(key) is still waiting after the loop has run everything it can."""
    waiting = asyncio.ensure_future(bg.wait_ordered(key))
    for _ in range(5):
        await asyncio.sleep(0)
    still = not waiting.done()
    waiting.cancel()
    return still


async def test_a_task_that_marks_itself_ordered_is_waited_for_only_until_then() -> None:
    bg, release, steps = Background(), asyncio.Event(), []

    async def settle(mark: bool) -> None:
        steps.append("submitted")
        if mark:
            bg.mark_ordered(RUN)
        await release.wait()  # the commit, the spans, the metrics
        steps.append("done")

    bg.spawn(RUN, settle(mark=True))
    await asyncio.sleep(0)
    assert not await _waits(bg, RUN)
    assert steps == ["submitted"]
    bg.spawn(RUN, settle(mark=False))  # e.g. a run's end: waited for to its end
    assert await _waits(bg, RUN)
    assert not await _waits(bg, OTHER)
    release.set()
    await bg.wait_ordered(RUN)
    assert steps == ["submitted", "submitted", "done", "done"]
    await bg.drain()


async def test_marking_from_outside_the_runs_tasks_changes_nothing() -> None:
    bg, release = Background(), asyncio.Event()

    async def work() -> None:
        await release.wait()

    bg.spawn(RUN, work())
    bg.mark_ordered(RUN)  # not from the task: no task of the run is the current one
    assert await _waits(bg, RUN)
    release.set()
    await bg.drain()
    assert not await _waits(bg, RUN)
