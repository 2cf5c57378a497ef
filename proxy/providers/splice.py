"""Edit a JSON document in its bytes: only the edited values change, nothing else moves.

Re-serialising a parsed request (orjson.dumps(orjson.loads(raw))) keeps the values of
most JSON but not its bytes, and not all of its values: whitespace and escapes change
(google-genai writes `", "` and `\\u00e9`), numbers are rewritten (`1.10` -> `1.1`,
`1E2` -> `100.0`, `-0` -> `0`) and an integer past 64 bits comes back as a float
(`18446744073709551616` -> `1.8446744073709552e+19`). A provider's prompt cache matches
a prompt by its exact prefix, and a cached prefix that no longer matches is paid in
full. So the exchange never re-serialises a request to edit it: `splice` finds the
byte range of each edited value with one scan and replaces only those ranges.

Pure functions, no I/O. The document was validated by orjson before it gets here; any
surprise raises ValueError and the caller falls back to re-serialising.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from json.decoder import scanstring  # type: ignore[attr-defined]

__all__ = ["Path", "locate", "splice"]

Path = tuple[str | int, ...]
# An edit of one value: the value's JSON text as it came -> its new JSON text.
Edit = Callable[[str], str]

_WS = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder()
# A whole string, or one bracket: what skipping a container has to look at. Iterative, so a
# sibling nested a thousand deep (orjson accepts 1024) does not hit Python's recursion limit.
_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')


class _Node:
    __slots__ = ("children", "target")

    def __init__(self) -> None:
        self.children: dict[str | int, _Node] = {}
        self.target = False


def _trie(paths: list[Path]) -> _Node:
    root = _Node()
    for path in paths:
        node = root
        for step in path:
            node = node.children.setdefault(step, _Node())
        node.target = True
    return root


def _skip_ws(text: str, i: int) -> int:
    m = _WS.match(text, i)
    assert m is not None  # `[...]*` always matches
    return m.end()


def _value(text: str, i: int, node: _Node | None, path: Path, found: dict[Path, tuple[int, int]]) -> int:
    """The end of the JSON value starting at `i`; records the ranges of targets inside it."""
    if node is None or not node.children:
        end = _skip(text, i)
    elif text[i] == "{":
        end = _object(text, i, node, path, found)
    elif text[i] == "[":
        end = _array(text, i, node, path, found)
    else:
        end = _DECODER.raw_decode(text, i)[1]
    if node is not None and node.target:
        found[path] = (i, end)  # a repeated key: the last one wins, as in the parsed body
    return end


def _skip(text: str, i: int) -> int:
    """The end of the value at `i`, not looked into."""
    if text[i] not in "[{":
        end: int = _DECODER.raw_decode(text, i)[1]  # a scalar: the C scanner
        return end
    depth = 0
    for m in _TOKEN.finditer(text, i):
        c = text[m.start()]
        if c in "[{":
            depth += 1
        elif c in "]}":
            depth -= 1
            if depth == 0:
                return m.end()
    raise ValueError(f"unterminated value at {i}")


def _object(text: str, i: int, node: _Node, path: Path, found: dict[Path, tuple[int, int]]) -> int:
    i = _skip_ws(text, i + 1)
    if text[i] == "}":
        return i + 1
    while True:
        if text[i] != '"':
            raise ValueError(f"expected a key at {i}")
        key, i = scanstring(text, i + 1)
        i = _skip_ws(text, i)
        if text[i] != ":":
            raise ValueError(f"expected ':' at {i}")
        i = _skip_ws(text, i + 1)
        i = _skip_ws(text, _value(text, i, node.children.get(key), (*path, key), found))
        if text[i] == "}":
            return i + 1
        if text[i] != ",":
            raise ValueError(f"expected ',' or '}}' at {i}")
        i = _skip_ws(text, i + 1)


def _array(text: str, i: int, node: _Node, path: Path, found: dict[Path, tuple[int, int]]) -> int:
    i = _skip_ws(text, i + 1)
    if text[i] == "]":
        return i + 1
    index = 0
    while True:
        i = _skip_ws(text, _value(text, i, node.children.get(index), (*path, index), found))
        if text[i] == "]":
            return i + 1
        if text[i] != ",":
            raise ValueError(f"expected ',' or ']' at {i}")
        i = _skip_ws(text, i + 1)
        index += 1


def locate(text: str, paths: list[Path]) -> dict[Path, tuple[int, int]]:
    """The [start, end) character range of the value at each path that exists in `text`."""
    found: dict[Path, tuple[int, int]] = {}
    if paths:
        _value(text, _skip_ws(text, 0), _trie(paths), (), found)
    return found


def splice(raw: bytes, edits: Mapping[Path, Edit]) -> bytes:
    """`raw` with each located value replaced by its edit of it, every other byte kept.

    Edits nest: when an edited value holds another (a reminder inside a tool result, and a
    wrap-up note appended to the messages around it), the inner edit applies first and the
    outer one gets the value's text with it. Raises ValueError when a path is missing.
    """
    text = raw.decode("utf-8")
    found = locate(text, list(edits))
    if len(found) != len(edits):
        raise ValueError(f"not in the document: {sorted(map(str, set(edits) - set(found)))}")
    # Outer values first where two start at one place; JSON values either nest or are apart.
    spans = sorted(((start, end, edits[path]) for path, (start, end) in found.items()), key=lambda s: (s[0], -s[1]))
    return _edited(text, 0, len(text), spans).encode("utf-8")


def _edited(text: str, lo: int, hi: int, spans: list[tuple[int, int, Edit]]) -> str:
    """text[lo:hi] with the edits of `spans` (sorted, all inside it) applied, innermost first."""
    out: list[str] = []
    at, i = lo, 0
    while i < len(spans):
        start, end, edit = spans[i]
        j = i + 1
        while j < len(spans) and spans[j][0] < end:
            if spans[j][1] > end:
                raise ValueError("edited values overlap")  # not JSON values of one document
            j += 1
        out += [text[at:start], edit(_edited(text, start, end, spans[i + 1:j]))]
        at, i = end, j
    out.append(text[at:hi])
    return "".join(out)
