"""Edit a JSON document in its bytes: only the edited values change, nothing else moves.
`Splicer` keeps one request's parsed body and its edits; `splice` applies edits to bytes.

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
from typing import Any

import orjson

__all__ = ["Edit", "Path", "Splicer", "holds", "locate", "splice"]

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


class Splicer:
    """One request's body and the edits of its bytes. A request nobody edits goes as it came;
    a new top-level field is spliced in before the final `}`; an edited value replaces only
    that value's bytes, so the rest (and the provider's cached prefix) is kept to the byte.
    `body` is kept equal to what is sent."""

    __slots__ = ("_added", "_edited", "_edits", "_sent", "body", "raw")

    def __init__(self, raw: bytes, body: dict[str, Any]) -> None:
        self.raw = raw
        self.body = body
        self._added: dict[str, Any] = {}
        self._edits: dict[Path, Edit] = {}
        self._edited = False
        self._sent: bytes | None = None  # request_bytes, until the next edit

    def set_top(self, key: str, value: Any) -> None:
        """Set a top-level field of the request."""
        if key in self.body and key not in self._added:
            text = orjson.dumps(value).decode()
            self._edits[(key,)] = lambda _old: text
        else:
            self._added[key] = value
        self.body[key] = value
        self._sent = None

    def append_item(self, path: Path, item: Any) -> bool:
        """Append `item` to the array at `path` (-1 for the last element on the way): in
        `body`, and in the bytes before the array's closing bracket."""
        at = _absolute(self.body, path)
        array = _follow(self.body, at) if at is not None else None
        if at is None or not isinstance(array, list):
            return False
        encoded = orjson.dumps(item).decode()
        array.append(item)
        self.edit(at, lambda old: old[:-1] + ("," if old[1:-1].strip() else "") + encoded + old[-1])
        return True

    def replace_value(self, path: Path, value: Any, edit: Edit) -> bool:
        """Put `value` at `path` (-1 for the last element on the way) in `body`, and in the
        bytes `edit` of the old value's JSON text (which may keep it, byte for byte)."""
        at = _absolute(self.body, path)
        if not at:
            return False
        holder: Any = _follow(self.body, at[:-1])  # `_absolute` found every step: it holds the key
        holder[at[-1]] = value
        self.edit(at, edit)
        return True

    def edit(self, path: Path, edit: Edit) -> None:
        """Edit the bytes of the value at `path` (absolute), after any edit of it so far; the
        caller has made the same change in `body`."""
        before = self._edits.get(path)
        self._edits[path] = edit if before is None else lambda old: edit(before(old))
        self._sent = None

    def edited(self) -> None:
        """`body` was changed in place where no edit says: the request is re-serialised whole."""
        self._edited = True
        self._sent = None

    def request_bytes(self) -> bytes:
        """The request as it goes upstream: spliced once per set of edits."""
        if self._sent is None:
            self._sent = self._request_bytes()
        return self._sent

    def _request_bytes(self) -> bytes:
        if self._edited:
            return orjson.dumps(self.body)
        out = self.raw
        if self._edits:
            try:
                out = splice(out, self._edits)
            except (ValueError, IndexError, UnicodeDecodeError, RecursionError):
                return orjson.dumps(self.body)  # cannot happen for a body orjson parsed; never fail a call
        if not self._added:
            return out
        end = out.rindex(b"}")  # the body parsed as a JSON object: its last byte is `}`
        fields = b",".join(orjson.dumps(k) + b":" + orjson.dumps(v) for k, v in self._added.items())
        sep = b"," if len(self.body) > len(self._added) else b""
        return out[:end] + sep + fields + out[end:]


def _absolute(body: Any, path: Path) -> Path | None:
    """`path` with negative indexes counted from the end, or None when it is not in `body`."""
    out: list[str | int] = []
    node = body
    for step in path:
        if isinstance(step, int) and isinstance(node, list) and -len(node) <= step < len(node):
            step %= len(node)
        if not holds(node, step):
            return None
        out.append(step)
        node = node[step]
    return tuple(out)


def _follow(body: Any, path: Path) -> Any:
    """The value at `path` in parsed JSON (a path `_absolute` returned)."""
    for step in path:
        body = body[step]
    return body


def holds(container: Any, step: str | int) -> bool:
    """Whether `container[step]` is a member or an element of parsed JSON."""
    if isinstance(container, dict):
        return isinstance(step, str) and step in container
    return isinstance(container, list) and isinstance(step, int) and 0 <= step < len(container)
