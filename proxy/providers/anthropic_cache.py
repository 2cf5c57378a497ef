"""Anthropic prompt-cache breakpoints, placed in a Messages request's own bytes. Pure.

When they are added (a shared stable prefix, a looping run) is proxy/govern/caching.py's
docstring; this module is where and how: `cache_control` on the last system block (else
the last tool definition), and a rolling one on the last block of the last message, each
message given as a string sent as the one text block the API reads it as.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace
from typing import Any, Final

import orjson

from proxy.model import Caller, Rewrite
from proxy.providers.base import Exchange, Path
from proxy.providers.cache import PrefixMemory
from proxy.providers.members import has_member

__all__ = ["BYTES_PER_TOKEN", "MARKER", "anthropic_breakpoints", "min_cacheable_tokens"]

MARKER: Final = {"type": "ephemeral"}
_MARKER_TEXT: Final = ',"cache_control":' + orjson.dumps(MARKER).decode()
# Anthropic's minimum cacheable prompt length, in tokens, by model family
# (https://docs.claude.com/en/docs/build-with-claude/prompt-caching); 1024 for the rest.
_MIN_TOKENS: Final = (("claude-opus-4-5", 4096), ("claude-opus-4-6", 4096), ("claude-haiku-4-5", 4096),
                      ("claude-3-5-haiku", 2048), ("claude-3-haiku", 2048))
# Bytes of request JSON per token, for the length check only: JSON and English run at 3-4
# bytes per token, so 4 under-counts tokens; a miss only forgoes a saving (a prefix below the
# minimum is not cached, and not billed a write).
BYTES_PER_TOKEN: Final = 4
_NO_MARKER_BLOCKS: Final = frozenset({"thinking", "redacted_thinking"})


def min_cacheable_tokens(model: str) -> int:
    return next((n for prefix, n in _MIN_TOKENS if model.startswith(prefix)), 1024)


def anthropic_breakpoints(ex: Exchange, caller: Caller, memory: PrefixMemory, now: float) -> list[Rewrite]:
    """Add the breakpoints expected to pay to an Anthropic request (module docstring), in
    its bytes, and the call's cache-write premium so that the reservation covers their writes."""
    body = ex.body
    messages = body.get("messages")
    # The client's own breakpoints, however it spelled them (proxy/providers/members.py):
    # adding ours would pass the API's four, or send a second `cache_control` in a block.
    if has_member(ex.raw, body, "cache_control") or not isinstance(messages, list) or not messages:
        return []
    floor = min_cacheable_tokens(ex.call.model or "") * BYTES_PER_TOKEN
    tools, system = body.get("tools"), body.get("system")
    answered = sum(1 for m in messages if isinstance(m, dict) and m.get("role") == "assistant")
    looping = answered >= 2
    stable_at: Path | None = None
    if _size(tools) + _size(system) >= floor:
        digest = hashlib.sha256(orjson.dumps([caller.tenant, ex.call.model, tools, system])).digest()
        if memory.shared(digest, caller.run_id, now) or looping:
            if isinstance(system, str | list) and system:
                stable_at = ("system",)
            elif isinstance(tools, list) and tools and isinstance(tools[-1], dict):
                stable_at = ("tools", len(tools) - 1)
    last = messages[-1]
    rolling = looping and len(ex.raw) >= floor and isinstance(last, dict) and _markable(last.get("content"))
    if stable_at is None and not rolling:
        return []
    rewrites: list[Rewrite] = []
    if stable_at is not None:
        _mark(ex, stable_at)
        rewrites.append(Rewrite("cache_breakpoint", str(stable_at[0])))
    if rolling:
        for i, message in enumerate(messages[:-1]):  # the same bytes in every turn: see the docstring
            if isinstance(message, dict) and isinstance(message.get("content"), str):
                _as_block(ex, ("messages", i, "content"), marked=False)
        _mark(ex, ("messages", len(messages) - 1, "content"))
        rewrites.append(Rewrite("cache_breakpoint", "messages"))
    ex.call = replace(ex.call, cache_write="5m")  # the writes they cause are reserved for
    return rewrites


def _markable(content: Any) -> bool:
    if isinstance(content, str):
        return bool(content)
    return isinstance(content, list) and bool(content) and isinstance(content[-1], dict) \
        and content[-1].get("type") not in _NO_MARKER_BLOCKS


def _size(value: Any) -> int:
    return len(orjson.dumps(value)) if value else 0


def _mark(ex: Exchange, at: Path) -> None:
    """The breakpoint on the value at `at`: a block (an object) gets the member last; a
    string becomes its one text block, marked; a list of blocks marks its last block."""
    holder: Any = ex.body
    for step in at[:-1]:
        holder = holder[step]
    value = holder[at[-1]]
    if isinstance(value, str):
        _as_block(ex, at, marked=True)
    elif isinstance(value, list):
        _mark(ex, (*at, len(value) - 1))
    elif isinstance(value, dict):
        ex.replace_value(at, {**value, "cache_control": MARKER}, lambda old: old.rstrip()[:-1] + _MARKER_TEXT + "}")


def _as_block(ex: Exchange, at: Path, *, marked: bool) -> None:
    holder: Any = ex.body
    for step in at[:-1]:
        holder = holder[step]
    text = holder[at[-1]]
    block: dict[str, Any] = {"type": "text", "text": text}
    if marked:
        block["cache_control"] = MARKER
    tail = _MARKER_TEXT if marked else ""
    # The string's own bytes are kept inside the block.
    ex.replace_value(at, [block], lambda old: '[{"type":"text","text":' + old + tail + "}]")
