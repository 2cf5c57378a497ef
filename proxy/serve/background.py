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
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

__all__ = ["Background"]

Key = tuple[str, str]  # (tenant, run id)


class Background:
    def __init__(self) -> None:
        # run -> its tasks in flight, each with a future done once the task is ordered or done
        self._by_run: dict[Key, dict[asyncio.Task[None], asyncio.Future[None]]] = {}

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
        in flight: a dict lookup)."""
        tasks = self._by_run.get(key)
        if tasks:
            waiting = [f for f in tasks.values() if not f.done()]
            if waiting:
                await asyncio.wait(waiting)

    async def drain(self) -> None:
        while self._by_run:
            await asyncio.wait([t for tasks in list(self._by_run.values()) for t in tasks])
