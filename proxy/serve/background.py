"""The tasks that do the bookkeeping after the answer, kept per run, off the caller's
critical path: a model call's settlement, spans and run totals (serve/bookkeeping.py), the
end of a refused call's run when it was made for that one call (govern/runs.py), and an
MCP request's settlement and totals (proxy/mcp/route.py).

The caller gets its answer before the ledger commit, and a keep-alive connection is free
for its next request at once. Two rules keep this safe:
- a run's next request waits for that run's bookkeeping still in flight in this process
  (`settled`), so tool calls recorded by call N are there when N+1 brings their results;
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
        self._by_run: dict[Key, set[asyncio.Task[None]]] = {}

    def spawn(self, key: Key, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        tasks = self._by_run.setdefault(key, set())
        tasks.add(task)
        task.add_done_callback(lambda t: self._done(key, t))

    def _done(self, key: Key, task: asyncio.Task[None]) -> None:
        tasks = self._by_run.get(key)
        if tasks is not None:
            tasks.discard(task)
            if not tasks:
                del self._by_run[key]

    async def settled(self, key: Key) -> None:
        """Wait for the run's bookkeeping in flight here (usually none: a dict lookup)."""
        tasks = self._by_run.get(key)
        if tasks:
            await asyncio.wait(list(tasks))

    async def drain(self) -> None:
        while self._by_run:
            await asyncio.wait([t for tasks in list(self._by_run.values()) for t in tasks])
