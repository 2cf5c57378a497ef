"""Prompt caching for agents that never ask for it (issue 30).

The policy's switch: for a request with no cache marker of its own, whether and where a
prompt-cache breakpoint (Anthropic) or key (the OpenAI family) goes, from the tenant's
setting and what the tenant's recent runs did (Bedrock's Converse takes the same rules as
`cachePoint` blocks); nothing for Gemini. Where a breakpoint or
key goes in the bytes is the API module's (`Exchange.cache`:
proxy/providers/anthropic_cache.py, converse_cache.py, the OpenAI family in chat.py).
Where the breakpoints go, when, and why: docs/internals.md, "Prompt caching".
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
