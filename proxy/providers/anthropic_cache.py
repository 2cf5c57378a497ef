"""Anthropic prompt-cache breakpoints, placed in a Messages request's own bytes. Pure.

When they are added (a shared stable prefix, a looping run) is proxy/govern/caching.py's
docstring; this module is where and how: `cache_control` on the last system block (else
the last tool definition), and a rolling one on the last block of the last message, each
message given as a string sent as the one text block the API reads it as.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Final

import orjson

from proxy.model import Caller, Rewrite
from proxy.providers.base import Exchange, Path
from proxy.providers.cache import PrefixMemory
from proxy.providers.members import has_member

__all__ = ["BYTES_PER_TOKEN", "MARKER", "Placement", "Prompt", "anthropic_breakpoints", "min_cacheable_tokens",
           "placement", "turns_of"]

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
# Blocks the API looks back from a breakpoint for a prefix it wrote before (the breakpoint's
# own block included).
LOOKBACK: Final = 20
_NO_MARKER_BLOCKS: Final = frozenset({"thinking", "redacted_thinking"})


def min_cacheable_tokens(model: str) -> int:
    return next((n for prefix, n in _MIN_TOKENS if model.startswith(prefix)), 1024)


@dataclass(frozen=True, slots=True)
class Prompt:
    """What the rules read of a request that marks its own breakpoints, in any wire format
    that follows Anthropic's (Anthropic's Messages, Bedrock's Converse on Claude): its stable
    prefix, its conversation, where that prefix ends (None: nowhere a marker may go), whether
    a message's content may end in a marker, and the model's minimum, in bytes."""

    tools: Any
    system: Any
    messages: list[Any]
    stable_at: Path | None
    markable: Callable[[Any], bool]
    floor: int


@dataclass(frozen=True, slots=True)
class Placement:
    """Where breakpoints go: at the end of the stable prefix (`stable_at`), and on the last
    block of the messages in `rolling` (indexes into the request's messages)."""

    stable_at: Path | None
    rolling: tuple[int, ...]


def anthropic_breakpoints(ex: Exchange, caller: Caller, memory: PrefixMemory, now: float) -> list[Rewrite]:
    """Add the breakpoints expected to pay to an Anthropic request (module docstring), in
    its bytes, and the call's cache-write premium so that the reservation covers their writes."""
    body = ex.body
    messages = body.get("messages")
    # The client's own breakpoints, however it spelled them (proxy/providers/members.py):
    # adding ours would pass the API's four, or send a second `cache_control` in a block.
    if has_member(ex.raw, body, "cache_control") or not isinstance(messages, list) or not messages:
        return []
    tools, system = body.get("tools"), body.get("system")
    stable_at: Path | None = None
    if isinstance(system, str | list) and system:
        stable_at = ("system",)
    elif isinstance(tools, list) and tools and isinstance(tools[-1], dict):
        stable_at = ("tools", len(tools) - 1)
    floor = min_cacheable_tokens(ex.call.model or "") * BYTES_PER_TOKEN
    plan = placement(ex, Prompt(tools, system, messages, stable_at, _markable, floor), caller, memory, now)
    if plan is None:
        return []
    rewrites: list[Rewrite] = []
    if plan.stable_at is not None:
        _mark(ex, plan.stable_at)
        rewrites.append(Rewrite("cache_breakpoint", str(plan.stable_at[0])))
    if plan.rolling:
        for i, message in enumerate(turns_of(messages)):  # the same bytes in every turn: see the docstring
            if i not in plan.rolling and isinstance(message, dict) and isinstance(message.get("content"), str):
                _as_block(ex, ("messages", i, "content"), marked=False)
        for i in plan.rolling:
            _mark(ex, ("messages", i, "content"))
        rewrites.append(Rewrite("cache_breakpoint", "messages"))
    ex.call = replace(ex.call, cache_write="5m")  # the writes they cause are reserved for
    return rewrites


def turns_of(messages: list[Any]) -> list[Any]:
    """The messages but a trailing assistant one: that is a prefill the model continues, and
    the next turn replaces it with the whole answer, so a breakpoint on it would write what is
    never read again."""
    return messages[:-1] if _role(messages[-1]) == "assistant" else messages


def placement(ex: Exchange, prompt: Prompt, caller: Caller, memory: PrefixMemory, now: float) -> Placement | None:
    """Where the breakpoints expected to pay go (module docstring, proxy/govern/caching.py),
    whatever the wire format; None: nowhere. Records the call in `memory`."""
    turns = turns_of(prompt.messages)
    answered = sum(1 for m in turns if _role(m) == "assistant")
    agent = hashlib.sha256(orjson.dumps([caller.tenant, ex.call.model, prompt.tools, prompt.system])).digest()
    going_on = memory.goes_on(agent, caller.run_id, answered + 1, now)
    # Without runs of this agent to learn from, a run is taken to go on once it loops (the
    # model answered twice); a write on a run's last call is what `auto` pays over `off`.
    next_call = answered >= 2 if going_on is None else going_on
    stable_at: Path | None = None
    if prompt.stable_at is not None and _size(prompt.tools) + _size(prompt.system) >= prompt.floor \
            and (memory.shared(agent, caller.run_id, now) or next_call):
        stable_at = prompt.stable_at
    markable = prompt.markable
    rolling = _rolling(turns, markable) if next_call and answered >= 1 and len(ex.raw) >= prompt.floor else []
    wrote_before = memory.wrote(agent, caller.run_id, bool(rolling))
    if wrote_before and not rolling and (before := _previous_end(turns, markable)) is not None:
        # No next call expected, but the call before wrote the conversation up to here: a
        # breakpoint where it wrote reads that, and writes nothing.
        rolling = [before]
    if stable_at is None and not rolling:
        return None
    return Placement(stable_at, tuple(rolling))


def _rolling(turns: list[Any], markable: Callable[[Any], bool]) -> list[int]:
    """The messages whose last block gets a rolling breakpoint: the last one, and when this
    turn added more blocks than the API looks back over, also the end of the previous
    request (where its rolling breakpoint wrote), so that its write is still read."""
    if not markable(_content(turns[-1])):
        return []
    before = _previous_end(turns, markable)
    if before is not None and sum(len(_as_blocks(_content(m))) for m in turns[before + 1:]) >= LOOKBACK:
        return [before, len(turns) - 1]
    return [len(turns) - 1]


def _previous_end(turns: list[Any], markable: Callable[[Any], bool]) -> int | None:
    """The last message of the previous request, where its rolling breakpoint was: the one
    before the model's last answer; None when it cannot carry a breakpoint."""
    last_answer = max((i for i, m in enumerate(turns) if _role(m) == "assistant"), default=-1)
    before = last_answer - 1
    return before if before >= 0 and markable(_content(turns[before])) else None


def _role(message: Any) -> Any:
    return message.get("role") if isinstance(message, dict) else None


def _content(message: Any) -> Any:
    return message.get("content") if isinstance(message, dict) else None


def _as_blocks(content: Any) -> list[Any]:
    return [content] if isinstance(content, str) else content if isinstance(content, list) else []


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
        ex.splicer.replace_value(at, {**value, "cache_control": MARKER},
                                 lambda old: old.rstrip()[:-1] + _MARKER_TEXT + "}")


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
    ex.splicer.replace_value(at, [block], lambda old: '[{"type":"text","text":' + old + tail + "}]")
