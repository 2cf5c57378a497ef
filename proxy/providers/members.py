"""Members of a request's JSON read as the provider's JSON parser reads them. Pure.

A decision taken from a request (does it carry its own prompt-cache breakpoints, at which
lifetime) must see what the provider sees. Scanning the bytes for `"cache_control"` is
fast, but JSON lets a client spell a key or a value with escapes (`"cache\\u005fcontrol"`,
`"1\\u0068"`), which the scan misses and the provider's parser does not. Letters, digits
and `_` can only be escaped as `\\uXXXX` (the other escapes are for quotes, backslashes,
`/` and control characters), so a body without `\\u` anywhere is read exactly by its bytes;
a body with one is read from its parsed form instead. An unescaped `"` always delimits a
string in valid JSON, so `"key"` followed by `:` is always that key.
"""

from __future__ import annotations

import re
from functools import cache
from typing import Any, Final

__all__ = ["has_member", "member_values", "spelled_plainly"]

_UNICODE_ESCAPE: Final = b"\\u"


def spelled_plainly(raw: bytes) -> bool:
    """Whether every key and string of `raw` is spelled as its bytes read (no `\\u` escape):
    a byte scan of it then sees what a parser sees."""
    return _UNICODE_ESCAPE not in raw


@cache
def _key_pattern(key: str) -> re.Pattern[bytes]:
    # The key in quotes, then JSON whitespace and the colon: a member name, never a value.
    return re.compile(re.escape(f'"{key}"'.encode()) + rb"[ \t\n\r]*:")


def has_member(raw: bytes, body: Any, key: str) -> bool:
    """Whether any object in the request (`raw`, parsed as `body`) has a member `key`."""
    if spelled_plainly(raw):
        return f'"{key}"'.encode() in raw and _key_pattern(key).search(raw) is not None
    return bool(member_values(body, key))


def member_values(body: Any, key: str) -> list[Any]:
    """The value of every member `key` of every object in `body`, in document order."""
    found: list[Any] = []
    stack: list[Any] = [body]
    while stack:  # iterative: a hostile body may nest as deep as the parser allows
        node = stack.pop()
        if isinstance(node, dict):
            if key in node:
                found.append(node[key])
            stack += [v for v in reversed(node.values()) if isinstance(v, dict | list)]
        elif isinstance(node, list):
            stack += [v for v in reversed(node) if isinstance(v, dict | list)]
    return found
