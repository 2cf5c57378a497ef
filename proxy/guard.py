"""Loop guard: the same tool with the same arguments, again and again.

The admission that closes a run's tool calls counts, in the same store operation, the
run's streak of identical calls (tool name + sha256 of canonical arguments) and its
consecutive failed results, and refuses there when the tenant's guard says so. What is
left here: from the `threshold`-th identical call on, the result is forwarded with a
reminder prefixed for the model (`remind`).
"""

from __future__ import annotations

from typing import Any

from proxy.config import GuardPolicy
from proxy.model import Caller, Rewrite
from proxy.policy.store import GuardRule
from proxy.providers.base import Exchange
from tracing import spans
from tracing.setup import Telemetry

__all__ = ["DEFAULT_THRESHOLD", "patch_bytes", "remind", "reminder", "rule"]

DEFAULT_THRESHOLD = 3


TOOL_NAME_CHARS = 128  # a tool name in a reminder is cut here: reminders have a bounded size


def reminder(tool: str, count: int) -> str:
    tool = tool[:TOOL_NAME_CHARS]
    return (
        f"[spanmeter] Note: you have called the tool `{tool}` {count} times in a row with identical "
        "arguments, and the result below will not change if you call it again. Change the arguments, "
        "use a different tool, or answer with what you already have.\n\n"
    )


def patch_bytes(policy: GuardPolicy, results: int) -> int:
    """The most bytes reminders may add to a request carrying `results` tool results."""
    if policy.action != "remind" or not results:
        return 0
    # JSON-escaped, the reminder grows at most 6x (\uXXXX); a part wrapper adds < 64 bytes.
    return results * (6 * len(reminder("x" * TOOL_NAME_CHARS, 10**6)) + 64)


def rule(policy: GuardPolicy) -> GuardRule | None:
    """What the admission must refuse on, or None when the guard is off altogether."""
    if policy.action == "off" and policy.max_consecutive_failures is None:
        return None
    return GuardRule(threshold=policy.threshold or DEFAULT_THRESHOLD, refuse=policy.action == "refuse",
                     max_failures=policy.max_consecutive_failures)


def remind(ex: Exchange, closed: tuple[dict[str, Any], ...], policy: GuardPolicy, tel: Telemetry,
           caller: Caller, cs: spans.CallSpan) -> list[Rewrite]:
    """Prefix the reminder to each result that extends a streak past the threshold."""
    if policy.action != "remind":
        return []
    threshold = policy.threshold or DEFAULT_THRESHOLD
    rewrites = []
    for c in closed:
        name, streak = c["name"], c["streak"]
        if streak >= threshold and ex.prefix_tool_result(c["id"], reminder(name, streak)):
            spans.record_guard_action(tel, caller, "remind", tool_name=name, repeats=streak, cs=cs)
            rewrites.append(Rewrite("loop_reminder", f"{name}x{streak}"))
    return rewrites
