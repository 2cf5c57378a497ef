"""Prompt caching as the API modules place it: what each module's placement is given. Pure.

When spanmeter adds a breakpoint or a key, and why, is proxy/govern/caching.py's docstring;
where it goes in the request's bytes is each API module's own (`Exchange.cache`).
"""

from __future__ import annotations

from proxy.model import Caller, frozen

__all__ = ["CacheScope", "PrefixMemory"]


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
    one is shared by runs, so that a breakpoint on it is likely read. Bounded; per process
    (a second worker or replica learns a prefix from its own sightings)."""

    __slots__ = ("_seen", "capacity", "ttl_s")

    def __init__(self, ttl_s: float = 300.0, capacity: int = 10_000) -> None:
        self.ttl_s = ttl_s
        self.capacity = capacity
        self._seen: dict[bytes, tuple[float, str, bool]] = {}  # digest -> (last seen, by run, shared)

    def shared(self, digest: bytes, run_id: str, now: float) -> bool:
        """Record that `run_id` sent the prefix at `now`; whether two runs sent it with no
        gap longer than the TTL (the provider's cache keeps it between them)."""
        seen = self._seen.pop(digest, None)
        shared = seen is not None and now - seen[0] <= self.ttl_s and (seen[2] or seen[1] != run_id)
        self._seen[digest] = (now, run_id, shared)  # most recent last: the oldest go first when full
        if len(self._seen) > self.capacity:
            del self._seen[next(iter(self._seen))]
        return shared
