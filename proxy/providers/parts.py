"""Message parts in the gen_ai semconv shapes, for opt-in content capture. Pure.

Each API module reads its own conversation into these (`input_messages`); the answer
is put in the same shapes from the outcome, whatever the API (proxy/serve/content.py).
"""

from __future__ import annotations

from typing import Any

import orjson

__all__ = ["Messages", "arguments", "call_part", "response_part", "text_part"]

Messages = tuple[str, list[dict[str, Any]]]
"""(system instructions, the conversation's messages)."""


def text_part(text: str) -> dict[str, Any]:
    return {"type": "text", "content": text}


def call_part(call_id: Any, name: Any, args: Any) -> dict[str, Any]:
    return {"type": "tool_call", "id": call_id, "name": name, "arguments": args}


def response_part(call_id: Any, response: Any) -> dict[str, Any]:
    return {"type": "tool_call_response", "id": call_id, "response": response}


def arguments(value: Any) -> Any:
    """Tool-call arguments as a value: JSON text parsed, anything else as it is."""
    if isinstance(value, str):
        try:
            return orjson.loads(value)
        except orjson.JSONDecodeError:
            return value
    return value
