"""Bedrock Converse prompt-cache breakpoints: `{"cachePoint": {"type": "default"}}` blocks
placed in a Converse request's own bytes. Pure.

When they are added is proxy/govern/caching.py's docstring, by Anthropic's rules
(proxy/providers/anthropic_cache.py's `placement`): the same positions, and the same
memory of runs. Where: a cache point is a block of its own, after what it marks, so each
is appended to an array: to `system` at the end of the stable prefix (else to
`toolConfig.tools`), and to the content of the message the rolling breakpoint is on.

Only models Bedrock caches for get them (a cache point elsewhere is refused, or ignored):
Claude 3.5 Haiku, 3.5 Sonnet v2, 3.7 Sonnet and the 4.x families, and Nova, which caches
`system` and `messages` but not tools
(https://docs.aws.amazon.com/bedrock/latest/userguide/prompt-caching.html).
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any, Final

from proxy.model import Caller, Rewrite
from proxy.providers.anthropic_cache import BYTES_PER_TOKEN, Prompt, min_cacheable_tokens, placement
from proxy.providers.base import Exchange, Path
from proxy.providers.bedrock_wire import priced_id
from proxy.providers.cache import PrefixMemory
from proxy.providers.members import has_member

__all__ = ["CACHE_POINT", "caches", "converse_breakpoints"]

CACHE_POINT: Final = {"cachePoint": {"type": "default"}}
_CLAUDE: Final = re.compile(
    r"anthropic\.(claude-(?:3-5-haiku|3-5-sonnet-20241022|3-7-sonnet|(?:opus|sonnet|haiku)-[4-9]).*)")
_NOVA: Final = re.compile(r"amazon\.nova-(?:micro|lite|pro|premier|2-lite)")
# Blocks a cache point may not follow: the model's reasoning, and another cache point.
_NO_MARKER_BLOCKS: Final = frozenset({"reasoningContent", "cachePoint"})


def caches(model: str) -> tuple[bool, bool]:
    """Whether Bedrock caches prompts for `model` (a profile's geography prefix off), and
    whether it caches tool definitions too."""
    bare = priced_id(model)
    if _CLAUDE.match(bare):
        return True, True
    return bool(_NOVA.match(bare)), False


def converse_breakpoints(ex: Exchange, caller: Caller, memory: PrefixMemory, now: float) -> list[Rewrite]:
    """Add the cache points expected to pay to a Converse request (module docstring), in its
    bytes, and the call's cache-write premium so that the reservation covers their writes."""
    body = ex.body
    messages = body.get("messages")
    model = ex.call.model or ""
    cached, tools_cached = caches(model)
    # The client's own cache points, however it spelled them (proxy/providers/members.py).
    if not cached or has_member(ex.raw, body, "cachePoint") or not isinstance(messages, list) or not messages:
        return []
    config = body.get("toolConfig")
    tools = config.get("tools") if isinstance(config, dict) else None
    system = body.get("system")
    stable_at: Path | None = None
    if isinstance(system, list) and system:
        stable_at = ("system",)
    elif tools_cached and isinstance(tools, list) and tools:
        stable_at = ("toolConfig", "tools")
    bare = _CLAUDE.match(priced_id(model))
    floor = min_cacheable_tokens(bare[1] if bare else "") * BYTES_PER_TOKEN
    plan = placement(ex, Prompt(tools, system, messages, stable_at, _markable, floor), caller, memory, now)
    if plan is None:
        return []
    rewrites: list[Rewrite] = []
    if plan.stable_at is not None and ex.splicer.append_item(plan.stable_at, CACHE_POINT):
        rewrites.append(Rewrite("cache_breakpoint", "system" if plan.stable_at == ("system",) else "tools"))
    if [i for i in plan.rolling if ex.splicer.append_item(("messages", i, "content"), CACHE_POINT)]:
        rewrites.append(Rewrite("cache_breakpoint", "messages"))
    if rewrites:
        ex.call = replace(ex.call, cache_write="5m")  # the writes they cause are reserved for
    return rewrites


def _markable(content: Any) -> bool:
    """Whether a message's content may end in a cache point: a list of blocks whose last one
    is neither reasoning nor a cache point."""
    if not isinstance(content, list) or not content or not isinstance(content[-1], dict):
        return False
    return not _NO_MARKER_BLOCKS.intersection(content[-1])
