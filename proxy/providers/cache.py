"""Prompt caching as the API modules place it: what each module's placement is given. Pure.

When spanmeter adds a breakpoint or a key, and why, is proxy/govern/caching.py's docstring;
where it goes in the request's bytes is each API module's own (`Exchange.cache`).
"""

from __future__ import annotations

from proxy.model import Caller, frozen

__all__ = ["BREAK_EVEN", "CacheScope", "PrefixMemory"]

# A breakpoint's write costs 0.25x of what it writes, and the next call's read saves 0.9x of
# it: a write pays when the next call comes with at least this chance.
BREAK_EVEN = 0.3
# A run that made no call for this long is taken to have ended at its last one.
STOPPED_S = 30.0
RUNS_KEPT = 16  # the most recent runs of one agent its lengths are learned from


@frozen
class CacheScope:
    """What a placement may read besides the request: who calls, which host serves it, the
    prefixes other runs sent lately, and a monotonic clock's `now`, in seconds."""

    caller: Caller
    server_address: str
    memory: PrefixMemory
    now: float


class PrefixMemory:
    """The stable prefixes (model, tools, system) each tenant sent lately, by digest: whether
    one is shared by runs, so that a breakpoint on it is likely read; and how far each
    agent's (the same digest's) recent runs went, so that a write is placed where a next
    call is likely to read it. Bounded; per process (a second worker or replica learns from
    its own sightings)."""

    __slots__ = ("_runs", "_seen", "capacity", "stopped_s", "ttl_s")

    def __init__(self, ttl_s: float = 300.0, capacity: int = 10_000, stopped_s: float = STOPPED_S) -> None:
        self.ttl_s = ttl_s
        self.capacity = capacity
        self.stopped_s = stopped_s
        self._seen: dict[bytes, tuple[float, str, bool]] = {}  # digest -> (last seen, by run, shared)
        # agent digest -> run -> (the furthest call it reached, when last seen, whether its
        # last call placed a breakpoint that writes), most recent last
        self._runs: dict[bytes, dict[str, tuple[int, float, bool]]] = {}

    def goes_on(self, agent: bytes, run_id: str, call: int, now: float) -> bool | None:
        """Record that `run_id` of `agent` makes its `call`-th call at `now`; whether the
        agent's other recent runs say a next call is likely enough for a write to pay
        (BREAK_EVEN): of those that reached this call, the share that made another, counting
        a run as ended at its last call once it has been quiet for `stopped_s` (a run still
        going is not evidence that runs stop). None when no run says either way."""
        runs = self._runs.pop(agent, {})
        went_on = stopped = 0
        for other, (reached, seen, _) in runs.items():
            if other == run_id or reached < call:
                continue
            if reached > call:
                went_on += 1
            elif now - seen >= self.stopped_s:
                stopped += 1
        before = runs.pop(run_id, None)
        runs[run_id] = (max(call, before[0]) if before else call, now, before[2] if before else False)
        while len(runs) > RUNS_KEPT:
            del runs[next(iter(runs))]
        self._runs[agent] = runs  # most recent last: the oldest agent goes first when full
        if len(self._runs) > self.capacity:
            del self._runs[next(iter(self._runs))]
        if went_on + stopped == 0:
            return None
        return went_on >= BREAK_EVEN * (went_on + stopped)

    def wrote(self, agent: bytes, run_id: str, writes: bool) -> bool:
        """Record whether this call of `run_id` (just told to `goes_on`) placed a breakpoint
        that writes; whether its call before did."""
        runs = self._runs.get(agent, {})
        found = runs.get(run_id)
        if found is None:
            return False
        runs[run_id] = (found[0], found[1], writes)
        return found[2]

    def shared(self, digest: bytes, run_id: str, now: float) -> bool:
        """Record that `run_id` sent the prefix at `now`; whether two runs sent it with no
        gap longer than the TTL (the provider's cache keeps it between them)."""
        seen = self._seen.pop(digest, None)
        shared = seen is not None and now - seen[0] <= self.ttl_s and (seen[2] or seen[1] != run_id)
        self._seen[digest] = (now, run_id, shared)  # most recent last: the oldest go first when full
        if len(self._seen) > self.capacity:
            del self._seen[next(iter(self._seen))]
        return shared
