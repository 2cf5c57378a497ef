"""Prompt caching for agents that never ask for it (issue 30).

An agent re-sends its whole prefix every turn: tool definitions, system prompt, the
growing conversation. Anthropic bills a cached prefix at a tenth of the input rate, but
only up to a `cache_control` breakpoint the request marks, and a write at 1.25x: most agent
code marks none. OpenAI caches by itself, and keeps one conversation's calls on the same
cache when they share a `prompt_cache_key`. Gemini 2.5 models cache implicitly by prefix,
and their explicit cache is a stored resource (`cachedContents`) that a proxy would have
to create, pay storage for and delete: nothing is added there.

Anthropic, for a request with no `cache_control` of its own (one that has any is its
owner's choice and goes untouched), breakpoints where they are expected to be read:

- at the end of the stable prefix (the last system block, else the last tool definition),
  when that prefix alone is above the model's minimum cacheable length and it is shared:
  another run of the tenant sent the same prefix within the cache's 5 minutes (an agent
  sends the same tools and system prompt in every call of every run: from then on each
  call reads it at a tenth of the input rate, and it is written once per 5 minutes at
  1.25x), or this run is expected to go on (below);
- a rolling one on the last block of the conversation when a next call is expected to
  read it: when at least 30% of the agent's recent runs (the same tenant, model, tools
  and system) that reached this call made another, or, with no runs to learn from, from
  the run's third call on (the model has answered twice: the agent is looping), when the
  whole prompt is above the minimum, so the next turn reads everything before it (the API
  looks back up to 20 blocks from a breakpoint for the longest prefix it wrote). A
  trailing assistant message is a prefill the next turn replaces: the block before it
  gets the marker. A turn that added 20 blocks or more also gets one where the previous
  turn's was, so that write stays within the lookback. A call that expects no next one
  but follows a write gets a marker where that write was: it reads and writes nothing.

A run alone waits for its third call, and a prefix for a second run: a one- or two-call
run, or a prefix sent by one run only, would pay the write premium and read nothing.
The first run of an unknown agent that ends on its third call still pays one write
(bench/bench_cache_worst.py, README "Prompt caching"). At most three of the API's four.
So that a message's bytes are the same in every turn (the provider
caches a prefix by its exact content), a message given as a string is sent as the one
text block the API reads it as, in every turn that gets the rolling breakpoint: between
turn N and N+1 only the rolling marker moves. bench/bench_caching.py prices both choices
over the simulator's scenarios and the recorded Anthropic runs.

Bedrock's Converse (and Nova's `messages-v1` bodies) on the models Bedrock caches for get
the same breakpoints by the same rules, as `cachePoint` blocks after what they mark
(proxy/providers/converse_cache.py).

This module is the policy's switch; where a breakpoint or key goes is the API module's
(`Exchange.cache`: proxy/providers/anthropic_cache.py, converse_cache.py, and the OpenAI
family in chat.py).
"""

from __future__ import annotations

from proxy.model import Caller, Rewrite
from proxy.providers.base import Exchange
from proxy.providers.cache import CacheScope, PrefixMemory

__all__ = ["PrefixMemory", "add"]


def add(ex: Exchange, setting: str | None, caller: Caller, server_address: str, memory: PrefixMemory,
        now: float) -> list[Rewrite]:
    """What the request gets for the provider's prompt cache under the tenant's `prompt_cache`
    setting ("auto" or "off"), each change a rewrite. `now`: a monotonic clock, in seconds."""
    if setting == "off":
        return []
    return ex.cache(CacheScope(caller, server_address, memory, now))
