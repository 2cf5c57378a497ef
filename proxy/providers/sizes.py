"""How many bytes a part of a request is, cheaply: what the API modules' `input_parts` use.

Text is counted by its length (code points, not UTF-8 bytes, and without its JSON
quotes and escapes): reading `len` of a string costs nothing, and an agent turn is mostly
text. Structured values (a tool's definition, an image part, a JSON tool result) are
counted by their compact JSON text. Both are approximations of the bytes the request
carries, which proxy/anatomy/shares.py documents.
"""

from __future__ import annotations

from typing import Any

import orjson

__all__ = ["json_size", "size_of"]


def size_of(value: Any) -> int:
    """The size of a content value: a string, a list of parts, or a JSON value."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list):
        return sum(_part_size(v) for v in value)
    if value is None:
        return 0
    return json_size(value)


def _part_size(part: Any) -> int:
    if isinstance(part, dict):
        text = part.get("text")
        if isinstance(text, str):
            return len(text)  # a text part; its type and cache marker are a few template tokens
    return size_of(part)


def json_size(value: Any) -> int:
    """Bytes of `value` as compact JSON (0 for what JSON cannot hold)."""
    try:
        return len(orjson.dumps(value))
    except TypeError:
        return 0
