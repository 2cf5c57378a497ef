"""The tasks that do the bookkeeping after the answer, kept per run, off the caller's
critical path: a model call's settlement, spans and run totals (serve/bookkeeping.py), the
end of a refused call's run when it was made for that one call (govern/runs.py), and an
MCP request's settlement and totals (proxy/mcp/route.py).

The caller gets its answer before the ledger commit, and a keep-alive connection is free
for its next request at once. Two rules keep this safe:
- a run's next request waits for that run's bookkeeping still in flight in this process
  (`wait_ordered`), so tool calls recorded by call N are there when N+1 brings their results,
  and N's spend is what N+1's admission counts. It waits until each task is done, or until
  the task said its ledger writes are ordered ahead of anything submitted after
  (`mark_ordered`, after `Ledger.settle_in_order`): with SQLite that is as soon as the
  settle is queued to the writer thread, not committed;
- shutdown drains every task (`drain`), so no settlement is lost on a clean stop. A crash
  loses none either: the reservation made before forwarding stays and counts.

A model call's bookkeeping is no task of its own when it need not be (serve/bookkeeping.py
`answered`): it `hold`s its run from the answer until its settle is submitted (`release`),
and its settle's result is `watch`ed for `drain`. A run's next request waits for a hold as
for a task; a future to wait on is made only when a request does wait.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Generator
from typing import Any

__all__ = ["Background", "Started", "start"]

Key = tuple[str, str]  # (tenant, run id)


class Background:
    def __init__(self) -> None:
        # run -> its tasks in flight, each with a future done once the task is ordered or done
        self._by_run: dict[Key, dict[asyncio.Task[None], asyncio.Future[None]]] = {}
        self._held: dict[Key, int] = {}  # run -> bookkeeping not yet ordered that is no task
        self._waiters: dict[Key, list[asyncio.Future[None]]] = {}  # made only when a request waits on a hold
        self._watched: set[asyncio.Future[Any]] = set()  # what `drain` waits for besides the tasks

    def hold(self, key: Key) -> None:
        """The run's next request waits (`wait_ordered`) until `release`."""
        self._held[key] = self._held.get(key, 0) + 1

    def release(self, key: Key) -> None:
        """What `hold` held is ordered in the ledger, or done."""
        left = self._held.get(key, 0) - 1
        if left > 0:
            self._held[key] = left
            return
        self._held.pop(key, None)
        for waiter in self._waiters.pop(key, ()):
            if not waiter.done():
                waiter.set_result(None)

    def watch(self, fut: asyncio.Future[Any]) -> None:
        """`drain` waits for `fut` (a settle whose result a callback reads)."""
        self._watched.add(fut)
        fut.add_done_callback(self._watched.discard)

    def spawn(self, key: Key, work: Coroutine[Any, Any, None]) -> None:
        loop = asyncio.get_running_loop()
        task = loop.create_task(work)
        self._by_run.setdefault(key, {})[task] = loop.create_future()
        task.add_done_callback(lambda t: self._done(key, t))

    def mark_ordered(self, key: Key) -> None:
        """From the running task of run `key`: what the run's next request must see is
        ordered ahead of it in the ledger, so that request need not wait for the rest."""
        task = asyncio.current_task()
        ordered = self._by_run.get(key, {}).get(task) if task is not None else None
        if ordered is not None and not ordered.done():
            ordered.set_result(None)

    def _done(self, key: Key, task: asyncio.Task[None]) -> None:
        tasks = self._by_run.get(key)
        if tasks is None:
            return
        ordered = tasks.pop(task, None)
        if ordered is not None and not ordered.done():
            ordered.set_result(None)
        if not tasks:
            del self._by_run[key]

    async def wait_ordered(self, key: Key) -> None:
        """Wait for the run's bookkeeping in flight here to be ordered or done (usually none
        in flight: a dict lookup or two)."""
        tasks = self._by_run.get(key)
        if tasks:
            waiting = [f for f in tasks.values() if not f.done()]
            if waiting:
                await asyncio.wait(waiting)
        if key in self._held:
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.setdefault(key, []).append(waiter)
            await waiter

    async def drain(self) -> None:
        while self._by_run or self._watched or self._held:
            pending: list[asyncio.Future[Any]] = [t for tasks in list(self._by_run.values()) for t in tasks]
            pending += self._watched
            if pending:
                await asyncio.wait(pending)
            else:  # held between an answer and its bookkeeping's callback: one turn of the loop
                await asyncio.sleep(0)


class Started:
    """A coroutine run by `start` up to where it first waits: awaiting this resumes it there
    (what `yield from` would do), so a task made now carries on what has begun."""

    __slots__ = ("_coro", "_first")

    def __init__(self, coro: Coroutine[Any, Any, Any], first: Any) -> None:
        self._coro, self._first = coro, first

    def __await__(self) -> Generator[Any, Any, Any]:
        coro, out = self._coro, self._first
        while True:
            try:
                sent = yield out
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:  # thrown into the task (a cancellation): into the coroutine
                try:
                    out = coro.throw(exc)
                except StopIteration as stop:
                    return stop.value
            else:
                try:
                    out = coro.send(sent)
                except StopIteration as stop:
                    return stop.value


def start(coro: Coroutine[Any, Any, Any]) -> tuple[bool, Any]:
    """Run `coro` now, on the caller's stack, until it finishes or first waits: (True, its
    result), or (False, a `Started` to await for the rest). What it raises before it waits
    is raised here. An `async def` that need not wait (a settle queued to SQLite's writer,
    a run that does not end) then costs no task."""
    try:
        first = coro.send(None)
    except StopIteration as stop:
        return True, stop.value
    return False, Started(coro, first)
