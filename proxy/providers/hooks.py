"""Per-call response rewriting: the hooks a call's answer passes through on its way to the
client (its `Answer` runs them; the repair driver and the API's stream filters add them),
and what they did to it. Every change a hook makes is recorded; what the call does next
(ask again) is not left here: the repair driver returns it (proxy/govern/outputs.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from proxy.model import Repair, Rewrite, StreamEvent, ToolCall
from proxy.providers.sse import SseEvent

__all__ = ["BodyHook", "EventHook", "Holder", "Hooks", "recorded_when_done"]

EventHook = Callable[[SseEvent, list[StreamEvent]], bytes | None]
"""Returns replacement bytes for an event (b"" drops it) or None to forward it unchanged.
Unless `Hooks.reads_text`, it must forward a plain text delta (one the dialect's
`TextShape.plain` accepts) unchanged and learn nothing from it: such events may not be
shown to it at all."""



class Holder(Protocol):
    """An event hook that may hold events back (it answers b"" for them) and send them
    later, in order, with a later event's bytes or `release()`d at the stream's end. While
    it holds any, every event is offered to the hooks: none may overtake the held ones."""

    @property
    def held(self) -> bool: ...

    def release(self) -> bytes: ...


BodyHook = Callable[[object], bytes | None]
"""Given the parsed JSON body, returns a replacement body or None."""


@dataclass
class Hooks:
    """Per-call response rewriting, chosen by the handler: the hooks (inputs) and what they
    changed (outputs: rewrites, repairs, what the agent received)."""

    on_event: list[EventHook] = field(default_factory=list)
    on_body: list[BodyHook] = field(default_factory=list)
    reads_text: bool = False  # an event hook must see every text delta (the answer's text is repaired)
    holds: list[Holder] = field(default_factory=list)  # the event hooks that may hold events back
    rewrites: list[Rewrite] = field(default_factory=list)
    repairs: list[Repair] = field(default_factory=list)
    # What the agent received where a repair changed the model's answer (the observer keeps
    # what the model sent): the answer's text, and tool-call arguments by call id.
    delivered_text: str | None = None
    delivered_arguments: dict[str, str] = field(default_factory=dict)
    # For an answer whose stream cannot be rewritten (Bedrock's event-stream frames): what a
    # repair would have done to its declared output, as a span note, or None.
    check_unrewritten: Callable[[str, tuple[ToolCall, ...]], str | None] | None = None

    def let_go(self) -> None:
        """The answer is delivered: drop its rewriting hooks. They hold these hooks and the
        answer, which hold them: a cycle only the cyclic collector frees, and serving runs
        that rarely (SPANMETER_GC_TUNING), so each call's objects would outlive it."""
        self.on_event.clear()
        self.on_body.clear()
        self.holds.clear()


def recorded_when_done(rewrite: EventHook, record: Rewrite, hooks: Hooks) -> EventHook:
    """`rewrite`, recording `record` once it first changes an event. A stream's headers
    leave before its body, so a stream rewrite is never announced there: it is on the
    span, and only if it happened (a usage chunk is dropped only if one came)."""
    done = False

    def hook(event: SseEvent, parsed: list[StreamEvent]) -> bytes | None:
        nonlocal done
        out = rewrite(event, parsed)
        if out is not None and not done:
            done = True
            hooks.rewrites.append(record)
        return out

    return hook
