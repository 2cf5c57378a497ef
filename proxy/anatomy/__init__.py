"""Cost anatomy: where a call's billed input went (instructions, tool definitions, tool
results, earlier turns, new content) and what each tool's results cost over a run. Pure
arithmetic, no I/O (shares.py has the method and why).

- `split_of(request, raw, body, previous) -> Split`: the request's parts, read through its
  `Conversation` (the call's request side), extending the run's last split when it can.
- `shares(split, usage, price) -> Anatomy | None`: the usage and its cost shared out.
- `Splits` / `Chain`: per run, the last split and what its tool results cost since the last
  flush (`Chain.flush() -> Flushed`), bounded in memory.
"""

from __future__ import annotations

from proxy.anatomy.shares import (
    FLUSH_EVERY,
    NANO,
    OTHER,
    TOP_RESULTS,
    Chain,
    Conversation,
    Split,
    Splits,
    anatomy,
    apportion,
    shares,
    shares_general,
    split_of,
    split_parts,
)

__all__ = ["FLUSH_EVERY", "NANO", "OTHER", "TOP_RESULTS", "Chain", "Conversation", "Split", "Splits", "anatomy",
           "apportion", "shares", "shares_general", "split_of", "split_parts"]
