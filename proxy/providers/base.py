"""What every API module is built from: its dialect object's shape (`Dialect`), the
request side of a call (`Exchange`: facts and byte-exact patches) and the readers they share.

A dialect object is the stateless part of an API module: pure functions over parsed bodies
and events that never do I/O, never read a clock and never touch globals, so they are
tested from recorded fixtures alone (tests/data/<dialect>/). The shared code never sees it:
it opens a call (proxy/providers/translator.py) and talks to the `Translator`, whose
request side is the `Exchange` below and whose answer side folds the dialect's
`StreamEvent`s (from a whole body, `parse_response`, or one SSE event at a time,
`parse_event`) into an `Outcome`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

import orjson

from proxy.errors import MalformedBody, ProxyError
from proxy.model import Call, InputPart, Outcome, Rewrite, StreamEvent, ToolResult, Usage, frozen
from proxy.providers.members import has_member, member_values, spelled_plainly
from proxy.providers.splice import Edit, Path, splice
from proxy.providers.sse import SseEvent

if TYPE_CHECKING:  # the answer's side builds on SseEvent, below
    from proxy.providers.answer import ArgumentSlot, EventRewrite, Slot, StreamEdits
    from proxy.providers.cache import CacheScope
    from proxy.providers.parts import Messages

__all__ = [
    "MAX_OUTPUT_MULTIPLIER",
    "MAX_TOKENS_LIMIT",
    "Dialect",
    "Events",
    "Exchange",
    "History",
    "HistoryCall",
    "Path",
    "TextShape",
    "array",
    "count_field",
    "integer",
    "joined_results",
    "number",
    "open_exchange",
    "string",
    "text_of",
    "vocabulary",
]

# The largest max-token value any API accepts is far below this; larger values are refused
# at the edge rather than overflowing a 64-bit ledger column later.
MAX_TOKENS_LIMIT = 2**31 - 1
# OpenAI accepts n <= 128; Gemini candidateCount <= 8. A multiplier is bounded by the
# larger, so a new provider limit still reserves exactly what the request asks for.
MAX_OUTPUT_MULTIPLIER = 128


@frozen
class TextShape:
    """How a dialect's stream events that carry nothing but a piece of the answer's text
    are told by their bytes (proxy/providers/shortcut.py learns each stream's own shapes).

    `key` is the member whose string value is the text. `plain` says of such an event,
    parsed, that it is one every stream rewriter forwards untouched while the answer's
    text is not repaired. `ignored` members change from event to event and are read by
    nothing (a sequence number, an obfuscation pad). `usage` is a member holding running
    usage that every text event repeats (Gemini), read with `usage_of`.
    """

    key: bytes
    plain: Callable[[SseEvent], bool]
    ignored: tuple[bytes, ...] = ()
    usage: bytes | None = None
    usage_of: Callable[[Any], Usage] | None = None


@frozen
class HistoryCall:
    """One tool call of the conversation a request carries, and where its result is."""

    call_id: str
    name: str
    arguments: str  # JSON text of the arguments as the model gave them
    result: Path | None  # path of the result's value in the body; None: no result in this request
    latest: bool = False  # the result is new in this request: it follows the model's last turn
    turn: int = 0  # the model turn (answer) that made the call, counted from 1: parallel calls share one


class Events(Protocol):
    """The reader of one answer's events. A dialect object is one for every answer; a module
    whose events depend on the ones before opens one per answer (Gemini numbers a stream's
    tool calls across its chunks)."""

    def parse_response(self, body: Any) -> list[StreamEvent]:
        """A whole answer's events."""
        ...

    def parse_event(self, event: SseEvent) -> list[StreamEvent]:
        """One SSE event's events, read after every earlier one of the same stream."""
        ...


class Dialect(Protocol):
    """The per-format work behind a translator: one object per API module, stateless.
    Only proxy/providers/ calls it; the shared code goes through `Translator` and `Api`.

    Example (chat)::

        ex = open_exchange(CHAT, raw, "/v1/chat/completions")   # the request's facts in ex.call
        events = CHAT.parse_response(orjson.loads(upstream_body))
    """

    api: str  # one of proxy.model.Api
    dialect: str  # the upstream family serving it (openai | anthropic | gemini): its upstreams and keys
    provider: str  # gen_ai.provider.name when the upstream's host does not say (semconv well-known value)
    upstream_setting: str  # which settings field holds this dialect's base URL
    text_part: str  # the type of a text part in a tool result's content list
    # The body's list of conversation items, which an agent's next request appends to (cost anatomy).
    conversation: str | None
    # The member that marks an explicit prompt-cache breakpoint (Anthropic `cache_control`),
    # whose writes bill above plain input; None when the API bills no write premium.
    cache_marker: str | None
    # How a plain text delta of this API's streams looks; None: every event is parsed.
    text_shape: TextShape | None

    def parse_request(self, body: dict[str, Any], path: str) -> Call:
        """The call's facts; refuses (MalformedBody) a field that changes cost and is not
        a value the API accepts."""
        ...

    def prepare(self, ex: Exchange) -> list[Rewrite]:
        """Patch the upstream request (e.g. inject include_usage); say what changed."""
        ...

    def set_max_tokens(self, ex: Exchange, value: int) -> None:
        """Write a max-output-tokens value in the field this model family takes (the clamp)."""
        ...

    def tool_result_slots(self, body: dict[str, Any], call_id: str) -> list[tuple[dict[str, Any], str]]:
        """(holder, key) of each tool result for `call_id` in the request, in order."""
        ...

    def append_note(self, ex: Exchange, text: str) -> bool:
        """Place a note for the model after the request's last message, in the dialect's own
        shape, leaving every earlier byte as it was (the provider's prompt cache keeps
        matching); False when the request has no conversation to add it to."""
        ...

    def tool_history(self, body: dict[str, Any]) -> list[HistoryCall]:
        """Every tool call of the conversation in the request, in the order the model made
        them, each with the path of its result's value (what a reminder is prefixed to)."""
        ...

    def stored_sizes(self, call: Call, outcome: Outcome) -> dict[str, int]:
        """Stored context this answer revealed the size of, in tokens (see Call.stored_context)."""
        ...

    def input_parts(self, body: dict[str, Any]) -> list[InputPart]:
        """The request's input split into parts in prompt order: instructions, tool
        definitions, tool results, earlier turns, this turn's new content (cost anatomy)."""
        ...

    def parse_response(self, body: Any) -> list[StreamEvent]: ...

    def parse_event(self, event: SseEvent) -> list[StreamEvent]: ...

    def text_slots(self, body: dict[str, Any]) -> list[Slot]:
        """Where a whole answer's text is, in order (the first choice or candidate only)."""
        ...

    def argument_slots(self, body: dict[str, Any]) -> list[ArgumentSlot]:
        """Each tool call's arguments in a whole answer, with its call id and tool name."""
        ...

    def stream_rewriter(self, edits: StreamEdits) -> EventRewrite | None:
        """A rewriter of this API's stream events that hands the answer's text and each tool
        call's arguments to `edits` as they stream and writes back what it gets, in the
        dialect's own framing; None when the API does not stream answers."""
        ...

    def retry_body(self, body: dict[str, Any], answer: str, feedback: str) -> dict[str, Any]:
        """The request once more: `answer` as the model's turn, then `feedback` as the user's."""
        ...

    def input_messages(self, body: dict[str, Any]) -> Messages:
        """The request's system instructions and conversation in the gen_ai semconv shapes
        (proxy/providers/parts.py), for opt-in content capture."""
        ...

    def render_error(self, error: ProxyError, request_id: str) -> bytes:
        """The dialect's JSON error body for `error`, which the SDK raises with its message."""
        ...

    def render_stream_error(self, error: ProxyError) -> bytes:
        """A terminal SSE event carrying `error`, for failures after the stream began."""
        ...

    def auth_headers(self, key: str) -> dict[str, str]:
        """Headers carrying an upstream key in this dialect's own scheme."""
        ...

    def cache_points(self, ex: Exchange, scope: CacheScope) -> list[Rewrite]:
        """Add what makes the provider's prompt cache pay (proxy/govern/caching.py says when),
        in this API's own shape; say what changed."""
        ...


def open_exchange(adapter: Dialect, raw: bytes, path: str) -> Exchange:
    """The exchange of one call: the body parsed once, the facts read, bad values refused."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise MalformedBody(
            f"The request body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno} "
            f"(byte {exc.pos}). Send a JSON object as the {adapter.api} API expects.") from None
    if not isinstance(body, dict):
        raise MalformedBody(f"The request body must be a JSON object, not {type(body).__name__}.")
    try:
        call = adapter.parse_request(body, path)
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        raise MalformedBody(f"The request body has a field of the wrong type ({exc}).") from None
    # The two facts read from the bytes rather than the body, set on the Call that
    # parse_request has just built and nobody else holds. `dataclasses.replace` would build
    # the 25-field Call a second time (~2% of the event loop's CPU per call).
    object.__setattr__(call, "body_bytes", len(raw))
    object.__setattr__(call, "cache_write", _cache_write(adapter, raw, body))
    return Exchange(adapter, call, raw, body)


def _cache_write(adapter: Dialect, raw: bytes, body: dict[str, Any]) -> str:
    """The dearest cache write the request may cause, as the provider's parser reads its
    breakpoints (proxy/providers/members.py): a body spelled plainly is read by its bytes
    (a `"1h"` anywhere reserves the dearer write: a false positive only reserves more);
    one with escapes from its parsed markers, a lifetime other than 5 minutes at 1 hour."""
    key = adapter.cache_marker
    if key is None or not has_member(raw, body, key):
        return ""
    if spelled_plainly(raw):
        return "1h" if b'"1h"' in raw else "5m"
    lifetimes = {m.get("ttl", "5m") if isinstance(m, dict) else "5m" for m in member_values(body, key)}
    return "5m" if lifetimes == {"5m"} else "1h"


class Exchange:
    """One model call's request as it will go upstream: its facts and its patches.

    Opened from the bytes exactly as received. A request nobody patches goes upstream byte
    for byte. A patch never re-serialises the request (see proxy/providers/splice.py): a
    new top-level field (a max-token clamp, stream_options) is spliced in before the final
    `}`, and an edited value (a loop-guard reminder in a tool result, a changed top-level
    field) replaces only that value's bytes, so the rest of the conversation, and with it
    the provider's cached prefix, is kept to the byte. `body` is kept equal to what is sent.
    """

    __slots__ = ("_added", "_dialect", "_edited", "_edits", "_sent", "body", "call", "raw")

    def __init__(self, adapter: Dialect, call: Call, raw: bytes, body: dict[str, Any]) -> None:
        self._dialect = adapter
        self.call = call
        self.raw = raw
        self.body = body
        self._added: dict[str, Any] = {}
        self._edits: dict[Path, Edit] = {}
        self._edited = False
        self._sent: bytes | None = None  # request_bytes, until the next patch

    # The patches the shared code asks for, each in this API's own shape.

    def prepare(self) -> list[Rewrite]:
        """Patch what this API needs to report the call (e.g. chat's include_usage); say what changed."""
        return self._dialect.prepare(self)

    def clamp(self, value: int) -> None:
        """Write a max-output-tokens value in the field this model family takes."""
        self._dialect.set_max_tokens(self, value)

    def note(self, text: str) -> bool:
        """Place a note for the model after the request's last message, leaving every earlier
        byte as it was; False when the request has no conversation to add it to."""
        return self._dialect.append_note(self, text)

    def cache(self, scope: CacheScope) -> list[Rewrite]:
        """Prompt-cache breakpoints or keys where this API reads them (govern/caching.py's
        policy); what changed. A breakpoint also raises `call.cache_write`."""
        return self._dialect.cache_points(self, scope)

    def history(self) -> list[HistoryCall]:
        """Every tool call of the conversation, in the order the model made them."""
        return self._dialect.tool_history(self.body)

    # Readers of this API's request shapes (content capture, cost anatomy).

    @property
    def api(self) -> str:
        return self._dialect.api

    @property
    def conversation(self) -> str | None:
        """The body's list of conversation items (an agent's next request appends to it)."""
        return self._dialect.conversation

    def input_messages(self) -> Messages:
        """The instructions and conversation in the gen_ai semconv shapes (content capture)."""
        return self._dialect.input_messages(self.body)

    def input_parts(self, body: dict[str, Any]) -> list[InputPart]:
        """`body` (this request's, or a part of one) split into parts in prompt order."""
        return self._dialect.input_parts(body)

    def tool_history(self, body: dict[str, Any]) -> list[HistoryCall]:
        """The tool calls of `body` (this request's, or a part of one)."""
        return self._dialect.tool_history(body)

    # Byte-exact edits, for the API module's patches and the shared ones above.

    def set_top(self, key: str, value: Any) -> None:
        """Set a top-level field of the request."""
        if key in self.body and key not in self._added:
            text = orjson.dumps(value).decode()
            self._edits[(key,)] = lambda _old: text
        else:
            self._added[key] = value
        self.body[key] = value
        self._sent = None

    def edited(self) -> None:
        """Say that `body` was changed in place below the top level, somewhere not told:
        the request is then re-serialised whole (prefer `set_top` or `prefix_at`)."""
        self._edited = True
        self._sent = None

    def prefix_tool_result(self, call_id: str, text: str) -> bool:
        """Prefix `text` to the last tool result for `call_id`, in the dialect's own shape."""
        slots = self._dialect.tool_result_slots(self.body, call_id)
        if not slots:
            return False
        holder, key = slots[-1]
        path = _path_of(self.body, holder)
        if path is None:
            return False
        return self.prefix_at((*path, key), text)

    def prefix_at(self, path: Path, text: str) -> bool:
        """Prefix `text` to the tool result whose value is at `path`, in the dialect's own
        shape: a string gets it in front, a list of parts a text part first, an object
        (Gemini functionResponse.response) a `spanmeter_reminder` member first. False when
        the value already starts with it (a second spanmeter in the chain) or is not there."""
        holder: Any = self.body
        for step in path[:-1]:
            if not _has(holder, step):
                return False
            holder = holder[step]
        key = path[-1]
        if not isinstance(holder, dict) or not isinstance(key, str):
            return False
        if key not in holder:  # a result with no content: the member is added, last
            member = ("," if holder else "") + orjson.dumps(key).decode() + ":" + orjson.dumps(text).decode()
            holder[key] = text
            self._add_edit(path[:-1], lambda old: old[:-1] + member + old[-1])
            return True
        value = holder[key]
        part = {"type": self._dialect.text_part, "text": text}
        if isinstance(value, str):
            if value.startswith(text):
                return False
            holder[key] = text + value
            inner = orjson.dumps(text).decode()[1:-1]
            edit: Edit = lambda old: old[0] + inner + old[1:]  # noqa: E731
        elif isinstance(value, list):
            if value and value[0] == part:
                return False
            value.insert(0, part)
            first = orjson.dumps(part).decode() + ("," if len(value) > 1 else "")
            edit = lambda old: old[0] + first + old[1:]  # noqa: E731
        elif isinstance(value, dict):
            if _REMINDER_KEY in value:
                return False
            holder[key] = {_REMINDER_KEY: text.strip(), **value}
            member = f'"{_REMINDER_KEY}":' + orjson.dumps(text.strip()).decode() + ("," if value else "")
            edit = lambda old: old[0] + member + old[1:]  # noqa: E731
        else:
            holder[key] = text
            whole = orjson.dumps(text).decode()
            edit = lambda _old: whole  # noqa: E731
        self._add_edit(path, edit)
        return True

    def append_item(self, path: Path, item: Any) -> bool:
        """Append `item` to the array at `path` (-1 for the last element on the way): in
        `body`, and in the bytes before the array's closing bracket, so every byte before
        it goes as it came."""
        at = _absolute(self.body, path)
        array = _follow(self.body, at) if at is not None else None
        if at is None or not isinstance(array, list):
            return False
        encoded = orjson.dumps(item).decode()
        array.append(item)
        self._add_edit(at, lambda old: old[:-1] + ("," if old[1:-1].strip() else "") + encoded + old[-1])
        return True

    def replace_value(self, path: Path, value: Any, edit: Edit) -> bool:
        """Put `value` at `path` (-1 for the last element on the way) in `body`, and in the
        bytes `edit` of the old value's JSON text (which may keep it, byte for byte)."""
        at = _absolute(self.body, path)
        if not at:
            return False
        holder: Any = _follow(self.body, at[:-1])  # `_absolute` found every step: it holds the key
        holder[at[-1]] = value
        self._add_edit(at, edit)
        return True

    def _add_edit(self, path: Path, edit: Edit) -> None:
        before = self._edits.get(path)
        self._edits[path] = edit if before is None else lambda old: edit(before(old))
        self._sent = None

    def request_bytes(self) -> bytes:
        """The request as it goes upstream: spliced once per set of patches (the handler
        measures it for admission, then sends it)."""
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


_REMINDER_KEY = "spanmeter_reminder"


def _absolute(body: Any, path: Path) -> Path | None:
    """`path` with negative indexes counted from the end, or None when it is not in `body`."""
    out: list[str | int] = []
    node = body
    for step in path:
        if isinstance(step, int) and isinstance(node, list) and -len(node) <= step < len(node):
            step %= len(node)
        if not _has(node, step):
            return None
        out.append(step)
        node = node[step]
    return tuple(out)


def _follow(body: Any, path: Path) -> Any:
    """The value at `path` in parsed JSON (a path `_absolute` returned)."""
    for step in path:
        body = body[step]
    return body


def _has(container: Any, step: str | int) -> bool:
    if isinstance(container, dict):
        return isinstance(step, str) and step in container
    return isinstance(container, list) and isinstance(step, int) and 0 <= step < len(container)


_SLOT_DEPTH = 8  # a tool result's holder sits at most this deep (Gemini: contents/i/parts/j/functionResponse)


def _path_of(body: Any, target: Any) -> Path | None:
    """Where the object `target` (by identity) sits in `body`, searched no deeper than a
    tool result can be (a hostile body may nest a thousand deep)."""
    stack: list[tuple[Any, Path]] = [(body, ())]
    while stack:
        node, path = stack.pop()
        if node is target:
            return path
        if len(path) >= _SLOT_DEPTH:
            continue
        items: Any = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        stack += [(child, (*path, step)) for step, child in items if isinstance(child, dict | list)]
    return None


class History:
    """Builds a request's `HistoryCall`s: calls in order, each result matched by call id."""

    __slots__ = ("_calls", "_open", "_turns")

    def __init__(self) -> None:
        # [call id, name, arguments, result path, the model turn its result follows, the turn that made it]
        self._calls: list[list[Any]] = []
        self._open: dict[str, int] = {}
        self._turns = 0

    def turn(self, *, scoped_ids: bool = False) -> None:
        """The model speaks again. `scoped_ids`: call ids repeat from turn to turn (Gemini's
        name-based ids), so later results match only this turn's calls."""
        self._turns += 1
        if scoped_ids:
            self._open = {}

    def call(self, call_id: str, name: str, arguments: str) -> None:
        self._open[call_id] = len(self._calls)
        self._calls.append([call_id, name, arguments, None, -1, self._turns])

    def result(self, call_id: str, path: Path) -> None:
        """The result of `call_id` is at `path`; a result with no call seen is ignored."""
        at = self._open.get(call_id)
        if at is not None:
            self._calls[at][3:5] = [path, self._turns]

    def calls(self) -> list[HistoryCall]:
        last = self._turns
        return [HistoryCall(cid, name, args, path, answered == last > 0, made)
                for cid, name, args, path, answered, made in self._calls]


def joined_results(results: list[ToolResult], new_from: int) -> tuple[ToolResult, ...]:
    """Every tool result of a request, one per call id (the last: a result sent again
    replaces the one before), those from index `new_from` on marked new. All of them are
    joined by id to the calls still open in the run, wherever they stand: a call is closed
    by its result even when an agent framework's own call and result came after it."""
    last: dict[str, ToolResult] = {}
    for i, r in enumerate(results):
        last.pop(r.call_id, None)  # re-inserted: the dict keeps the order of last occurrence
        last[r.call_id] = r if i >= new_from else replace(r, new=False)
    return tuple(last.values())


def vocabulary(error: ProxyError, words: Mapping[type[ProxyError], str]) -> str:
    """`error` in a dialect's error vocabulary: the word of its nearest class in `words`
    (which lists ProxyError itself, so every error has one)."""
    for cls in type(error).__mro__:
        word = words.get(cls)
        if word is not None:
            return word
    raise KeyError(f"{type(error).__name__} has no word in this vocabulary: list ProxyError")


def integer(value: Any) -> int | None:
    """A JSON integer, or None (booleans are not integers here)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def string(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def array(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def number(value: Any) -> float | None:
    """A JSON number as float; anything else (bool, str, None) as None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def count_field(name: str, value: Any, *, upper: int, what: str) -> int | None:
    """A positive whole-number request field (a max-token value, a choice count), or None
    when absent; anything else is refused, since it changes what the call may cost."""
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer() and value >= 1:
        value = int(value)  # 512.0 is a whole number, as the APIs read it
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= upper:
        shown = orjson.dumps(value).decode()[:40]  # parsed by orjson, so it serialises
        raise MalformedBody(
            f"`{name}` must be a whole number from 1 to {upper:,} ({what}), got {shown}. "
            f"Send a positive integer, or leave `{name}` out.", param=name)
    return value


def text_of(content: Any) -> str:
    """Text of a message content: a string, or the text parts of a list of parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if isinstance(part, dict):
                t = part.get("text")
                if isinstance(t, str):
                    out.append(t)
            elif isinstance(part, str):
                out.append(part)
        return "".join(out)
    return ""
