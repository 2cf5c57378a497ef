"""One-line readable summaries of model calls, tool executions and runs, for the span
attributes UIs show as a span's input and output (`input.value` / `output.value`).

Pure: no I/O, no clock, no OpenTelemetry. Built from digests only, so they are not
content (tracing/digests.py) and are recorded whatever the capture setting; never empty.

    call_input(call)             -> '1,204 characters of prompt text; tools: get_weather;
                                     result get_weather: ✓ {temp_c, sky}'
    call_output(outcome, [])     -> 'tool call get_weather(Paris)'
    run_output(totals, 'ended')  -> 'ended: 2 model calls, 1 tool call, 1,530 tokens, $0.0031'
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Final

from proxy.model import Call, Caller, Outcome, Repair
from tracing import digests

__all__ = ["call_input", "call_output", "money", "run_input", "run_output"]

SHOWN: Final = 3  # tool results, tool calls and tool names named one by one; the rest are counted
NAMES: Final = 5


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def _name(text: str) -> str:
    return digests.cut(text, digests.VALUE_LIMIT)


def call_input(call: Call) -> str:
    """The size of the prompt, the tools offered, the tool results it brings back."""
    parts = [_plural(call.input_chars, "character") + " of prompt text"]
    if call.tools:
        names = ", ".join(_name(t.name) for t in call.tools[:NAMES])
        more = f" and {len(call.tools) - NAMES} more" if len(call.tools) > NAMES else ""
        parts.append(f"tools: {names}{more}")
    if call.output is not None and call.output.kind != "tool":
        parts.append(f"asks for json{f' ({_name(call.output.name)})' if call.output.name else ''}")
    new = [r for r in call.tool_results if r.new]  # the earlier ones were shown by earlier calls
    for result in new[:SHOWN]:
        verdict = digests.tool_result_digest(result.content, is_error=result.is_error)
        parts.append(f"result {_name(result.name or result.call_id)}: {'✓' if verdict.ok else '✗'} {verdict.digest}")
    if len(new) > SHOWN:
        parts.append(f"and {_plural(len(new) - SHOWN, 'more result')}")
    return "; ".join(parts)


def call_output(outcome: Outcome, repairs: Sequence[Repair], delivered_text: str | None = None,
                delivered_arguments: Mapping[str, str] | None = None) -> str:
    """What the model answered, as the agent received it (`delivered_*`: where a repair
    changed the text or a tool call's arguments): tool calls with their argument digests,
    the shape of its text, or the error; and the repairs made to it."""
    parts: list[str] = []
    text = outcome.text if delivered_text is None else delivered_text
    if text:
        parts.append(f"text {digests.shape_digest(text)}")
    calls = outcome.tool_calls
    if calls:
        args = delivered_arguments or {}
        shown = ", ".join(f"{_name(tc.name)}({digests.tool_arguments_digest(args.get(tc.id, tc.arguments))})"
                          for tc in calls[:SHOWN])
        more = f" and {len(calls) - SHOWN} more" if len(calls) > SHOWN else ""
        parts.append(f"tool call{'s' if len(calls) > 1 else ''} {shown}{more}")
    if outcome.error_type:
        parts.append(f"error {_name(outcome.error_type)}")
    actions = sorted({a for r in repairs for a in r.actions})
    if actions:
        parts.append("repaired: " + ", ".join(actions))
    return "; ".join(parts) or "(no output)"


def run_input(caller: Caller) -> str:
    """Which run this is: its id, agent and conversation."""
    extra = [f"agent {caller.agent_name}" if caller.agent_name else "",
             f"conversation {caller.conversation_id}" if caller.conversation_id else ""]
    more = ", ".join(e for e in extra if e)
    return f"run {caller.run_id}" + (f" ({more})" if more else "")


def run_output(totals: Mapping[str, int], status: str) -> str:
    """How the run went: calls, tools, failures, tokens and cost, from its totals."""
    parts = [_plural(totals.get("model_calls", 0), "model call"), _plural(totals.get("tool_calls", 0), "tool call")]
    if totals.get("failures"):
        parts.append(_plural(totals["failures"], "failed model call"))
    if totals.get("tool_failures"):
        parts.append(_plural(totals["tool_failures"], "failed tool call"))
    if totals.get("ceilings_hit"):
        parts.append(_plural(totals["ceilings_hit"], "ceiling hit"))
    tokens = totals.get("input_tokens", 0) + totals.get("output_tokens", 0)
    parts.append(_plural(tokens, "token"))
    if "cost_micros" in totals:
        parts.append(f"${totals['cost_micros'] / 1e6:.4f}")
    return f"{status}: " + ", ".join(parts)


def money(usd: float) -> str:
    """US dollars to the micro-dollar spanmeter accounts in, at least cents, no trailing
    zeros beyond them: $0.000045, $0.0123, $3.30. A non-zero amount never reads as zero."""
    micros = round(usd * 1_000_000)
    if micros == 0 and usd > 0:
        return "<$0.000001"
    sign = "-" if micros < 0 else ""
    whole, frac = divmod(abs(micros), 1_000_000)
    digits = f"{frac:06d}".rstrip("0").ljust(2, "0")
    return f"{sign}${whole:,}.{digits}"
