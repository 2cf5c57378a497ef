"""Human-readable digests of tool arguments and results, and canonical hashes.

Pure: no I/O, no clock, no OpenTelemetry. Digests are always recorded because they
are not content: a handful of identifying words and counts, never a whole payload.
The preview of a result *is* content; spans record it only when capture allows.

All cutting counts runes (Unicode code points, which is what a Python `str` indexes),
never bytes, so a cut never splits a character. A cut is marked with `…`.

    arguments_digest('{"city": "Paris", "days": 3}')       -> 'city: Paris, days: 3'
    tool_arguments_digest('{"path": "a.py", "mode": "r"}')  -> 'a.py'
    tool_result_digest('{"ok": false, "error": "denied"}') -> ResultDigest(False, 'denied', ...)
    tool_result_digest('a\\nb\\nc')                         -> ResultDigest(True, '3 lines', ...)
    tool_result_digest('{"temp_c": 14, "sky": "rain"}')   -> ResultDigest(True, '{temp_c, sky}', ...)

A digest is never empty: what has nothing to show says so (`(no arguments)`, `(empty)`),
so a UI that shows it as a span's summary never shows a blank.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any, Final

import orjson

from proxy.model import frozen

__all__ = [
    "ARGUMENTS_LIMIT",
    "PREVIEW_LIMIT",
    "VALUE_LIMIT",
    "ResultDigest",
    "arguments_digest",
    "canonical_json",
    "canonical_sha256",
    "capped_json",
    "cut",
    "shape_digest",
    "tool_arguments_digest",
    "tool_result_digest",
    "value_digest",
]

ARGUMENTS_LIMIT: Final = 120
VALUE_LIMIT: Final = 40
PREVIEW_LIMIT: Final = 400
KEYS_LIMIT: Final = 6  # object keys a result's shape names
ELLIPSIS: Final = "…"
NO_ARGUMENTS: Final = "(no arguments)"
EMPTY: Final = "(empty)"
FAILED: Final = "failed"

# Keys that name the thing a tool call is about, in order of preference.
IDENTIFYING_KEYS: Final = (
    "id", "name", "title", "path", "file", "file_path", "filename", "query", "q",
    "url", "uri", "command", "cmd", "key", "location", "city",
)  # fmt: skip
# Where a successful result usually keeps its list of things.
LIST_KEYS: Final = ("results", "items", "data", "hits", "documents", "files", "entries", "matches")
# Where a successful result usually keeps its text.
TEXT_KEYS: Final = ("output", "stdout", "content", "text", "result")
EXIT_KEYS: Final = ("exit_code", "exitCode", "returncode", "exit_status")

_MISSING: Final = object()
_IDENTIFIER: Final = re.compile(r"[A-Za-z_$][A-Za-z0-9_.$-]{0,39}")
# What a JSON text can start with after its whitespace (the standard library's fallback also
# reads NaN and Infinity). Most model answers are prose: turned away here, before each of
# two parsers builds an error for them (15 us an answer, two thirds of its digest).
_JSON_START: Final = re.compile(r'[ \t\n\r]*[-{\["0-9tfnNI]')
# Where orjson may write a float as json does not (_canonical_bytes).
_EXPONENT: Final = re.compile(rb"e[-+0-9]")


@frozen
class ResultDigest:
    ok: bool
    digest: str
    preview: str  # first PREVIEW_LIMIT runes of the result; content, record only if allowed


def cut(text: str, limit: int) -> str:
    """`text` cut to `limit` runes, with `…` appended when something was cut."""
    return text if len(text) <= limit else text[:limit] + ELLIPSIS


def canonical_json(value: Any) -> str:
    """Sorted keys, no whitespace, UTF-8 characters kept as they are."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def canonical_sha256(text: str) -> str:
    """sha256 hex of the canonical form of a JSON text; of the text itself if not JSON.

    Two argument strings that differ only in key order or whitespace hash the same,
    which is what matching a call to its repeat (loop detection) needs.
    """
    value, by_orjson = _read(text)
    if value is _MISSING:
        return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
    data = _canonical_bytes(value) if by_orjson else None  # json read NaN or Infinity: orjson writes null
    return hashlib.sha256(data or canonical_json(value).encode("utf-8", "surrogatepass")).hexdigest()


def _canonical_bytes(value: Any) -> bytes | None:
    """canonical_json(value) in UTF-8, written by orjson (1.6 us for a 1 KB tool result,
    json.dumps 19.6); None where orjson would write it differently.

    For a value orjson read (never NaN or infinity), orjson with sorted keys writes what
    json.dumps writes but for floats written with an exponent or under 1e-4: json writes
    1e-05, 1.5e-07 and 1e+16; orjson 0.00001 and 1.5e-7, and orjson 3.10 1e16 (3.13: 1e+16).
    Bytes with neither an `e` before a sign or digit nor `0.0000` hold none of those;
    where either is (a string's "e-mail" or "base64" too), json writes the form. The
    pattern starts with a literal, so it is searched at C speed (0.8 us a KB); one that
    starts with a digit class took 14 us, as long as json.dumps itself."""
    try:
        data = orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    except orjson.JSONEncodeError:  # nested deeper than orjson writes (it reads deeper)
        return None
    return None if _EXPONENT.search(data) or b"0.0000" in data else data


def value_digest(value: Any) -> str:
    """A scalar as it is (cut at 40), an array as first title/name + count, an object elided."""
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, str):
        return cut(value, VALUE_LIMIT)
    if isinstance(value, int | float):
        return cut(json.dumps(value), VALUE_LIMIT)
    if isinstance(value, list):
        return _array_digest(value)
    return "{}" if not value else "{…}"


def arguments_digest(text: str) -> str:
    """`k: v, ...` for a JSON object; non-JSON text cut at 120 runes; nothing: `(no arguments)`."""
    value = _parse(text)
    if value is _MISSING:
        return cut(text.strip(), ARGUMENTS_LIMIT) or NO_ARGUMENTS
    if isinstance(value, dict):
        return cut(_pairs(value), ARGUMENTS_LIMIT) or NO_ARGUMENTS
    return cut(value_digest(value), ARGUMENTS_LIMIT)


def tool_arguments_digest(text: str) -> str:
    """One field: its value; several: the identifying one, else the `k: v` form; none:
    `(no arguments)`."""
    value = _parse(text)
    if value is _MISSING or not isinstance(value, dict):
        return arguments_digest(text)
    if len(value) == 1:
        return cut(value_digest(next(iter(value.values()))), ARGUMENTS_LIMIT)
    for key in IDENTIFYING_KEYS:
        if _is_scalar(value.get(key)):
            return value_digest(value[key])
    return cut(_pairs(value), ARGUMENTS_LIMIT) or NO_ARGUMENTS


def tool_result_digest(text: str, *, is_error: bool = False) -> ResultDigest:
    """(ok, digest, preview) of a tool result as the client sent it back.

    Failure: the dialect's error flag, an envelope such as `{"ok": false, "error": ...}`,
    `{"error": ...}` or `{"isError": true}`, or a non-zero exit code; the digest is then
    the error message (`failed` when there is none). Success: a count (`"first title" and
    4 more`), a line count, or the shape of what came back (`{temp_c, sky}`, `number`).

    A request's results are judged up to three times (the loop guard's verdict, the call
    span's input summary, each result's `execute_tool` span): recent verdicts are kept,
    bounded by their texts' total size, so each result is parsed once.
    """
    global _kept_chars
    key = (text, is_error)
    found = _VERDICTS.get(key)
    if found is None:
        found = _judge(text, is_error)
        if len(text) <= _VERDICT_CHARS:  # a larger one is not kept, nor does it push others out
            if _kept_chars + len(text) > _VERDICT_CHARS or len(_VERDICTS) >= _VERDICTS_MAX:
                _VERDICTS.clear()  # the texts are the callers': never more than this kept alive
                _kept_chars = 0
            _VERDICTS[key] = found
            _kept_chars += len(text)
    return found


_VERDICTS: dict[tuple[str, bool], ResultDigest] = {}
_VERDICTS_MAX: Final = 2048
_VERDICT_CHARS: Final = 1 << 20  # characters: at most 4 MB kept alive, under the memory target
_kept_chars = 0


def _judge(text: str, is_error: bool) -> ResultDigest:
    preview = text[:PREVIEW_LIMIT]
    value = _unwrap_blocks(_parse(text))
    failure = _failure(value)
    if is_error or failure is not None:
        message = failure if failure else _error_text(value, text)
        return ResultDigest(False, cut(message, ARGUMENTS_LIMIT) or FAILED, preview)
    return ResultDigest(True, _success_digest(value, text), preview)


def shape_digest(text: str) -> str:
    """What a text holds, without its content: a JSON value's shape or count, else a line count.

    `{"name": "Ada", "born": 1815}` -> `{name, born}`; `[1, 2]` -> `"1" and 1 more`; prose ->
    `3 lines`; nothing -> `(empty)`. For model answers and results alike.
    """
    return _success_digest(_parse(text), text)


def capped_json(value: Any, cap: int) -> str:
    """JSON of `value` no longer than `cap` bytes, with its structure kept valid.

    The longest strings are halved (and marked `…`) until it fits; if even that is not
    enough, trailing list items are dropped. Used for the tools a call offers and opt-in
    content attributes.
    """
    data = _json(value)
    if len(data) <= cap:  # the common case: no copy to cut
        return data.decode()
    value = json.loads(data)  # a private copy: we cut it in place
    while len(data := _json(value)) > cap:
        if not _halve_longest_string(value) and not _drop_last_item(value):
            return "[]" if isinstance(value, list) else "{}"
    return data.decode()


def _json(value: Any) -> bytes:
    """Compact UTF-8 JSON; what orjson refuses (an integer past 64 bits, a lone surrogate)
    the standard library writes, escaped to ASCII."""
    try:
        return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS)
    except (orjson.JSONEncodeError, TypeError):
        return json.dumps(value).encode()


# --- helpers -------------------------------------------------------------------------


def _parse(text: str) -> Any:
    return _read(text)[0]


def _read(text: str) -> tuple[Any, bool]:
    """(the JSON value of `text` or _MISSING, whether orjson read it)."""
    if not _JSON_START.match(text):
        return _MISSING, False
    try:
        return orjson.loads(text), True
    except orjson.JSONDecodeError:
        pass  # NaN, Infinity, numbers past a double's range, lone surrogates: json reads those
    try:
        return json.loads(text), False
    except (ValueError, TypeError):
        return _MISSING, False


def _is_scalar(value: Any) -> bool:
    return isinstance(value, str | int | float | bool) and value != ""


def _pairs(obj: dict[str, Any]) -> str:
    return ", ".join(f"{k}: {value_digest(v)}" for k, v in obj.items())


def _label(item: Any) -> str | None:
    """What to call an array by: its first item's title or name, or the item if scalar."""
    if isinstance(item, dict):
        for key in ("title", "name"):
            if _is_scalar(item.get(key)):
                return str(item[key])
        return None
    if _is_scalar(item):
        return value_digest(item)
    return None


def _array_digest(items: list[Any]) -> str:
    if not items:
        return "[]"
    label = _label(items[0])
    if label is None:
        return f"[{len(items)} item{'s' if len(items) != 1 else ''}]"
    first = f'"{cut(label, VALUE_LIMIT)}"'
    return first if len(items) == 1 else f"{first} and {len(items) - 1} more"


def _unwrap_blocks(value: Any) -> Any:
    """Content-block lists (Anthropic, MCP) hold text; judge the text they carry."""
    blocks = value.get("content") if isinstance(value, dict) and "isError" in value else value
    if isinstance(blocks, list) and blocks and all(_is_text_block(b) for b in blocks):
        inner = "\n".join(b["text"] for b in blocks)
        parsed = _parse(inner)
        unwrapped = inner if parsed is _MISSING else parsed
        if isinstance(value, dict) and value.get("isError") is True:
            return {"isError": True, "error": inner}
        return unwrapped
    return value


def _is_text_block(block: Any) -> bool:
    if not isinstance(block, dict):
        return False
    return block.get("type") == "text" and isinstance(block.get("text"), str)


def _failure(value: Any) -> str | None:
    """The error message when `value` is a failure envelope, else None ('' = no message)."""
    if not isinstance(value, dict):
        return None
    if value.get("ok") is False or value.get("success") is False or value.get("isError") is True:
        return _message(value)
    if value.get("error") not in (None, False, "", {}, []) and value.get("ok") is not True:
        return _message(value)
    for key in EXIT_KEYS:
        code = value.get(key)
        if isinstance(code, int) and not isinstance(code, bool) and code != 0:
            return _message(value) or f"exit code {code}"
    return None


def _message(envelope: dict[str, Any]) -> str:
    error = envelope.get("error")
    if isinstance(error, dict):
        for key in ("message", "msg", "detail", "type", "code"):
            if _is_scalar(error.get(key)):
                return str(error[key])
    elif _is_scalar(error) and error is not True:
        return str(error)
    for key in ("message", "msg", "detail", "stderr", "reason"):
        if _is_scalar(envelope.get(key)):
            return _first_line(str(envelope[key]))
    return ""


def _error_text(value: Any, text: str) -> str:
    """Message of a result the dialect flagged as an error (no envelope to read)."""
    if isinstance(value, dict):
        return _message(value)
    if isinstance(value, str):
        return _first_line(value)
    return _first_line(text) if value is _MISSING else ""


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


def _success_digest(value: Any, text: str) -> str:
    if value is _MISSING:
        return _lines(text)
    if isinstance(value, list):
        return _array_digest(value)
    if isinstance(value, str):
        return _lines(value)
    if isinstance(value, dict):
        for key in LIST_KEYS:
            if isinstance(value.get(key), list):
                return _array_digest(value[key])
        for key in TEXT_KEYS:
            if isinstance(value.get(key), str):
                return _lines(value[key])
        return _keys(value)
    if isinstance(value, bool):
        return "boolean"
    return "number" if isinstance(value, int | float) else "null"


def _keys(obj: dict[str, Any]) -> str:
    """An object's shape: its first keys when they read as names (`{temp_c, sky}`), else a
    count: keys that are data (e-mail addresses, user names with spaces) are not shown."""
    if not obj:
        return "{}"
    keys = list(obj)
    shown = keys[:KEYS_LIMIT]
    if not all(_IDENTIFIER.fullmatch(k) for k in shown):
        return f"{{{len(keys)} key{'s' if len(keys) != 1 else ''}}}"
    more = f", … +{len(keys) - len(shown)}" if len(keys) > len(shown) else ""
    return "{" + ", ".join(shown) + more + "}"


def _lines(text: str) -> str:
    n = len(text.rstrip("\n").splitlines()) if text.strip() else 0
    return EMPTY if n == 0 else f"{n} line{'s' if n != 1 else ''}"


def _strings(node: Any, path: tuple[Any, ...] = ()) -> list[tuple[tuple[Any, ...], str]]:
    if isinstance(node, str):
        return [(path, node)]
    if isinstance(node, dict):
        items: Any = node.items()
    elif isinstance(node, list):
        items = enumerate(node)
    else:
        return []
    return [found for k, v in items for found in _strings(v, (*path, k))]


def _halve_longest_string(value: Any) -> bool:
    strings = _strings(value)
    if not strings:
        return False
    path, longest = max(strings, key=lambda p: len(p[1]))
    if len(longest) <= 16 or not path:
        return False
    parent = value
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = longest[: len(longest) // 2] + ELLIPSIS
    return True


def _drop_last_item(value: Any) -> bool:
    if isinstance(value, list) and value:
        value.pop()
        return True
    return False
