"""Loop guard: the same tool with the same arguments, again and again.

Each tool result a request carries closes a call; the call's signature (tool name +
sha256 of canonical arguments) extends or resets the run's streak in the shared store.
From the `threshold`-th identical call on, the result is forwarded with a reminder
prefixed for the model (`remind`), or the request is refused (`refuse`).
"""

from __future__ import annotations

from typing import Any

from proxy.config import GuardPolicy
from proxy.errors import LoopRefused
from proxy.model import Call, Caller, Rewrite
from proxy.policy.store import Store
from proxy.relay import Hooks
from tracing import spans
from tracing.digests import canonical_sha256
from tracing.setup import Telemetry

__all__ = ["guard", "prefix_tool_result", "reminder"]


def reminder(tool: str, count: int) -> str:
    return (
        f"[spanmeter] Note: you have called the tool `{tool}` {count} times in a row with identical "
        "arguments, and the result below will not change if you call it again. Change the arguments, "
        "use a different tool, or answer with what you already have.\n\n"
    )


async def guard(
    store: Store, tel: Telemetry, caller: Caller, call: Call, policy: GuardPolicy,
    closed: list[tuple[dict[str, Any], bool]], body: dict[str, Any], hooks: Hooks, cs: spans.CallSpan,
) -> None:
    if not closed or (policy.action == "off" and policy.max_consecutive_failures is None):
        return
    threshold = policy.threshold or 3
    for pending, ok in closed:
        name = pending["name"]
        streak = await store.streak(caller.tenant, caller.run_id, f"{name}:{canonical_sha256(pending['arguments'])}")
        failures = await store.failures(caller.tenant, caller.run_id, not ok)
        limit = policy.max_consecutive_failures
        if limit is not None and failures >= limit:
            spans.record_guard_action(tel, caller, "refuse", tool_name=name, repeats=failures, cs=cs)
            raise LoopRefused(
                f"Run {caller.run_id} of tenant {caller.tenant} had {failures} tool failures in a row "
                f"(last: `{name}`), reaching the ceiling of {limit} (setting guard.max_consecutive_failures). "
                "The call was not forwarded. Fix the tool, or raise or remove the ceiling for this tenant.")
        if streak < threshold or policy.action == "off":
            continue
        if policy.action == "refuse":
            spans.record_guard_action(tel, caller, "refuse", tool_name=name, repeats=streak, cs=cs)
            raise LoopRefused(
                f"Run {caller.run_id} of tenant {caller.tenant} called the tool `{name}` {streak} times in a row "
                f"with identical arguments (threshold {threshold}, setting guard.threshold). The call was not "
                "forwarded: the model is looping. Change the arguments, or set guard.action to `remind` or "
                "`off` for this tenant.")
        if prefix_tool_result(call.api, body, pending["id"], reminder(name, streak)):
            spans.record_guard_action(tel, caller, "remind", tool_name=name, repeats=streak, cs=cs)
            hooks.rewrites.append(Rewrite("loop_reminder", f"{name}x{streak}"))


def prefix_tool_result(api: str, body: dict[str, Any], call_id: str, text: str) -> bool:
    """Prefix `text` to the last tool result for `call_id`, in the dialect's own shape."""
    for holder, key in reversed(list(_results(api, body, call_id))):
        value = holder.get(key)
        if isinstance(value, str):
            holder[key] = text + value
        elif isinstance(value, list):
            value.insert(0, {"type": _TEXT_PART[api], "text": text})
        elif isinstance(value, dict):  # Gemini functionResponse.response
            holder[key] = {"spanmeter_reminder": text.strip(), **value}
        else:
            holder[key] = text
        return True
    return False


_TEXT_PART = {"chat": "text", "responses": "input_text", "messages": "text", "gemini": "text"}


def _results(api: str, body: dict[str, Any], call_id: str) -> list[tuple[dict[str, Any], str]]:
    found: list[tuple[dict[str, Any], str]] = []
    if api == "chat":
        for m in body.get("messages") or ():
            if isinstance(m, dict) and m.get("role") == "tool" and m.get("tool_call_id") == call_id:
                found.append((m, "content"))
    elif api == "responses":
        items = body.get("input")
        for it in items if isinstance(items, list) else ():
            if isinstance(it, dict) and it.get("type") == "function_call_output" and it.get("call_id") == call_id:
                found.append((it, "output"))
    elif api == "messages":
        for m in body.get("messages") or ():
            blocks = m.get("content") if isinstance(m, dict) else None
            for block in blocks if isinstance(blocks, list) else ():
                if isinstance(block, dict) and block.get("type") == "tool_result" \
                        and block.get("tool_use_id") == call_id:
                    found.append((block, "content"))
    elif api == "gemini":
        for c in body.get("contents") or ():
            for part in c.get("parts") or () if isinstance(c, dict) else ():
                fr = part.get("functionResponse") if isinstance(part, dict) else None
                if isinstance(fr, dict) and call_id in (fr.get("id"), fr.get("name")):
                    found.append((fr, "response"))
    return found
