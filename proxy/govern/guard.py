"""Loop guard: the same tool with the same arguments, again and again.

Two counts of the same thing, kept apart on purpose: the store's, counted by the
admission that closes a run's tool calls and the authority for a refusal
(`guard.action=refuse`, `max_consecutive_failures`); and the reminder's
(`guard.action=remind`), a pure function of the request's own history (`tool_history`),
so a reminded result is forwarded with the same reminder, byte for byte, in every turn.
Why two, and what each decides: docs/internals.md, "The loop guard".
"""

from __future__ import annotations

import logging
from typing import Any

import orjson

from proxy.config import GuardPolicy
from proxy.ledger.store import GuardRule
from proxy.model import Caller, Rewrite
from proxy.providers.base import Exchange, HistoryCall
from tracing import spans
from tracing.setup import Telemetry

__all__ = ["DEFAULT_THRESHOLD", "Reminded", "record", "remind", "reminder", "rule", "streaks"]

DEFAULT_THRESHOLD = 3

log = logging.getLogger("spanmeter.guard")


TOOL_NAME_CHARS = 128  # a tool name in a reminder is cut here: reminders have a bounded size


def reminder(tool: str, count: int) -> str:
    tool = tool[:TOOL_NAME_CHARS]
    return (
        f"[spanmeter] Note: you have called the tool `{tool}` {count} times in a row with identical "
        "arguments, and the result below will not change if you call it again. Change the arguments, "
        "use a different tool, or answer with what you already have.\n\n"
    )


def rule(policy: GuardPolicy) -> GuardRule | None:
    """What the admission must refuse on, or None when the guard is off altogether."""
    if policy.action == "off" and policy.max_consecutive_failures is None:
        return None
    return GuardRule(threshold=policy.threshold or DEFAULT_THRESHOLD, refuse=policy.action == "refuse",
                     max_failures=policy.max_consecutive_failures)


def streaks(history: list[HistoryCall]) -> list[tuple[HistoryCall, int]]:
    """Each answered call with the streak of identical calls (name and canonical arguments)
    it ends, counted in model turns: a model that asks for the same call several times in
    one answer (parallel calls) took one step, not several. A call the request carries no
    result for is not counted, as the store counts only the calls a result closed."""
    out: list[tuple[HistoryCall, int]] = []
    prev: HistoryCall | None = None
    streak = 0
    for call in history:
        if call.result is None:
            continue
        if prev is not None and call.name == prev.name and _same_arguments(prev.arguments, call.arguments):
            streak += 1 if call.turn != prev.turn else 0
        else:
            streak = 1
        prev = call
        out.append((call, streak))
    return out


def _same_arguments(a: str, b: str) -> bool:
    """Whether two argument texts are the same JSON, whatever the key order and spacing
    (the store's `sig` compares sha256 of canonical JSON; this is the same test, without
    hashing every call of a long history on every request)."""
    return a == b or _canonical(a) == _canonical(b)


def _canonical(text: str) -> bytes:
    try:
        return orjson.dumps(orjson.loads(text), option=orjson.OPT_SORT_KEYS)
    except orjson.JSONDecodeError:
        return b"\x00" + text.encode("utf-8", "surrogatepass")  # not JSON: the text itself


Reminded = list[tuple[HistoryCall, int]]
"""The reminders applied to a request: each reminded call with its streak."""


def remind(ex: Exchange, policy: GuardPolicy) -> Reminded:
    """Prefix the reminder to every result of the request's history whose streak reaches
    the threshold. Pure (the history is the request's own), so it runs before admission:
    the bytes reminders add are input, and the reservation covers what is sent."""
    if policy.action != "remind":
        return []
    threshold = policy.threshold or DEFAULT_THRESHOLD
    try:
        history = ex.tool_history()
    except Exception:
        log.exception("reading the request's tool history failed; no reminder")
        return []
    if sum(1 for c in history if c.result is not None) < threshold:
        return []
    applied: Reminded = []
    try:
        for call, streak in streaks(history):
            # A result already carrying a reminder came through the MCP route, which put
            # it there itself: one reminder per result.
            if streak >= threshold and call.result is not None and not _reminded(ex, call) \
                    and ex.prefix_at(call.result, reminder(call.name, streak)):
                applied.append((call, streak))
    except Exception:  # a reminder is never worth failing the call; what was applied is recorded
        log.exception("loop reminder failed; the request goes on with the reminders applied so far")
    return applied


_MARK = "[spanmeter] Note: you have called the tool"


def _reminded(ex: Exchange, call: HistoryCall) -> bool:
    value: Any = ex.body
    for step in call.result or ():
        try:
            value = value[step]
        except (KeyError, IndexError, TypeError):
            return False
    return _MARK in (value if isinstance(value, str) else orjson.dumps(value).decode(errors="replace"))


def record(applied: Reminded, tel: Telemetry, caller: Caller, cs: spans.CallSpan) -> list[Rewrite]:
    """The rewrites and guard actions of the reminders applied: new ones (on results the
    model's last turn asked for) each, the ones kept on older results as one count."""
    rewrites: list[Rewrite] = []
    kept = 0
    for call, streak in applied:
        if call.latest:
            spans.record_guard_action(tel, caller, "remind", tool_name=call.name, repeats=streak, cs=cs)
            rewrites.append(Rewrite("loop_reminder", f"{call.name[:TOOL_NAME_CHARS]}x{streak}"))
        else:
            kept += 1
    if kept:
        rewrites.append(Rewrite("loop_reminder_kept", str(kept)))
    return rewrites
