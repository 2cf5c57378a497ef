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
  1.25x), or this run is looping (below);
- a rolling one on the last block of the last message, from a run's third call on (the
  model has answered twice: the agent is looping), when the whole prompt is above the
  minimum, so the next turn reads everything before it (the API looks back up to 20
  blocks from a breakpoint for the longest prefix it wrote).

A run alone waits for its third call, and a prefix for a second run: a one- or two-call
run, or a prefix sent by one run only, would pay the write premium and read nothing.
Two of the API's four. So that a message's bytes are the same in every turn (the provider
caches a prefix by its exact content), a message given as a string is sent as the one
text block the API reads it as, in every turn that gets the rolling breakpoint: between
turn N and N+1 only the rolling marker moves. bench/bench_caching.py prices both choices
over the simulator's scenarios and the recorded Anthropic runs.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace
from typing import Any, Final

import orjson

from proxy.model import Caller, Rewrite
from proxy.providers.base import Exchange, Path

__all__ = ["MARKER", "PrefixMemory", "add", "anthropic_breakpoints", "min_cacheable_tokens", "openai_cache_key"]

# OpenAI's own API only: an OpenAI-compatible server may refuse a field it does not know.
OPENAI_HOSTS: Final = frozenset({"api.openai.com"})

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


def add(ex: Exchange, setting: str | None, caller: Caller, server_address: str, memory: PrefixMemory,
        now: float) -> list[Rewrite]:
    """What the request gets for the provider's prompt cache under the tenant's `prompt_cache`
    setting ("auto" or "off"), each change a rewrite. `now`: a monotonic clock, in seconds."""
    if setting == "off":
        return []
    if ex.adapter.api == "messages":
        return anthropic_breakpoints(ex, caller, memory, now)
    if ex.adapter.api in ("chat", "responses") and server_address in OPENAI_HOSTS:
        return openai_cache_key(ex, caller.tenant, caller.run_id, caller.agent_name)
    return []


def min_cacheable_tokens(model: str) -> int:
    return next((n for prefix, n in _MIN_TOKENS if model.startswith(prefix)), 1024)


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


def anthropic_breakpoints(ex: Exchange, caller: Caller, memory: PrefixMemory, now: float) -> list[Rewrite]:
    """Add the breakpoints expected to pay to an Anthropic request (module docstring), in
    its bytes, and the call's cache-write premium so that the reservation covers their writes."""
    body = ex.body
    messages = body.get("messages")
    if b'"cache_control"' in ex.raw or not isinstance(messages, list) or not messages:
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


def openai_cache_key(ex: Exchange, tenant: str, run_id: str, agent: str | None) -> list[Rewrite]:
    """A `prompt_cache_key` stable for the run (or the agent, when it names itself), so the
    run's calls land on the same cache; a client's own key is kept. Hashed: neither the
    tenant nor the run id leaves as itself."""
    if "prompt_cache_key" in ex.body:
        return []
    scope = f"agent:{agent}" if agent else f"run:{run_id}"
    key = "sm-" + hashlib.sha256(f"{tenant}\0{scope}".encode()).hexdigest()[:32]
    ex.set_top("prompt_cache_key", key)
    return [Rewrite("prompt_cache_key", "agent" if agent else "run")]
