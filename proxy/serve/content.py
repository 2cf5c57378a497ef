"""Message content in the semconv shapes, for opt-in capture (SPAN_ONLY). Pure.

`gen_ai.input.messages` / `gen_ai.output.messages` are lists of
`{"role", "parts": [{"type": "text", "content"} | {"type": "tool_call", "id", "name", "arguments"}
| {"type": "tool_call_response", "id", "response"}]}`; system text goes to
`gen_ai.system_instructions` when the API carries it separately. The call's translator
reads its request into these shapes (`input_messages`); the answer comes from the outcome.

Repair changes what the agent receives, never what the model said: `output_messages` is
the model's answer as it came (semconv: "messages returned by the model"), and, when a
repair changed it, `output_messages_repaired` is the answer as the agent received it,
in the same shape (`spanmeter.output.messages.repaired`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from proxy.model import Outcome
from proxy.providers.answer import Json
from proxy.providers.parts import Messages, arguments, call_part, text_part

__all__ = ["capture"]


def capture(given: Messages, outcome: Outcome, *, delivered_text: str | None = None,
            delivered_arguments: Mapping[str, str] | None = None) -> Json:
    """`given`: the request's instructions and messages, as its translator reads them
    (`Exchange.input_messages`). `delivered_*`: the answer's text and tool-call arguments
    (by call id) as the agent received them, where a repair changed them."""
    system, messages = given
    out: Json = {"input_messages": messages, "output_messages": [_output(outcome)]}
    if system:
        out["system_instructions"] = [{"type": "text", "content": system}]
    delivered = _delivered(outcome, delivered_text, delivered_arguments or {})
    if delivered is not None:
        out["output_messages_repaired"] = [_output(delivered)]
    return out


def _delivered(o: Outcome, text: str | None, args: Mapping[str, str]) -> Outcome | None:
    """The outcome as the agent received it, or None when no repair changed it."""
    changed_text = text is not None and text != o.text
    calls = tuple(replace(tc, arguments=args[tc.id]) if args.get(tc.id, tc.arguments) != tc.arguments
                  else tc for tc in o.tool_calls)
    if not changed_text and calls == o.tool_calls:
        return None
    return replace(o, text=text if changed_text and text is not None else o.text, tool_calls=calls)


def _output(o: Outcome) -> Json:
    parts: list[Json] = [text_part(o.text)] if o.text else []
    parts += [call_part(tc.id, tc.name, arguments(tc.arguments)) for tc in o.tool_calls]
    reason = o.finish_reasons[0] if o.finish_reasons else ("error" if o.error_type else "stop")
    return {"role": "assistant", "parts": parts, "finish_reason": reason}
