"""What a run's next request waits for (proxy/serve/background.py): each of the run's tasks in
flight until it is done or says its ledger writes are ordered; nothing of other runs."""

from __future__ import annotations

import asyncio

import pytest

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


async def test_a_hold_is_waited_for_until_released_and_made_no_future_until_then() -> None:
    bg = Background()
    bg.hold(RUN)
    bg.hold(RUN)  # two calls of the run answered, neither settle queued yet
    assert not bg._waiters  # nothing waits: nothing made
    assert await _waits(bg, RUN)
    assert not await _waits(bg, OTHER)
    bg.release(RUN)
    assert await _waits(bg, RUN)
    bg.release(RUN)
    assert not await _waits(bg, RUN)
    await bg.drain()


async def test_drain_waits_for_a_watched_settle_and_its_callback() -> None:
    bg, seen = Background(), []
    settle: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    bg.watch(settle)
    settle.add_done_callback(lambda f: seen.append(f.result()))
    draining = asyncio.ensure_future(bg.drain())
    await asyncio.sleep(0)
    assert not draining.done()
    settle.set_result(7)
    await draining
    assert seen == [7]


async def test_a_coroutine_started_in_place_goes_on_in_a_task_where_it_stopped() -> None:
    from proxy.serve.background import start

    release, steps = asyncio.Event(), []

    async def now() -> int:
        steps.append("now")
        return 1

    async def later() -> int:
        steps.append("before")
        await release.wait()
        steps.append("after")
        return 2

    assert start(now()) == (True, 1)
    done, rest = start(later())
    assert not done and steps == ["now", "before"]
    task = asyncio.ensure_future(_await(rest))
    await asyncio.sleep(0)
    release.set()
    assert await task == 2
    assert steps == ["now", "before", "after"]
    release.clear()
    done, rest = start(later())  # a cancelled task cancels the coroutine where it waits
    assert not done
    task = asyncio.ensure_future(_await(rest))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert steps[-1] == "before"


async def _await(aw: object) -> object:
    return await aw  # type: ignore[misc]
