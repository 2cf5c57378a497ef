"""What every API module is built from: the request side of a call (`Exchange`: its facts,
and patches placed by the module's roles through its `Splicer`), the roles an API object
plays (`Roles`, of proxy/providers/roles.py) and the readers the modules share. Pure."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

import orjson

from proxy.errors import MalformedBody, ProxyError
from proxy.model import ByteFacts, Call, InputPart, Rewrite, ToolResult, frozen
from proxy.providers.members import has_member, member_values, spelled_plainly
from proxy.providers.roles import (
    AnswerReader,
    ErrorSpeaker,
    Events,
    HistoryCall,
    PromptCache,
    RequestEditor,
    RequestReader,
    TextShape,
)
from proxy.providers.splice import Edit, Path, Splicer, holds

if TYPE_CHECKING:
    from proxy.providers.cache import CacheScope
    from proxy.providers.parts import Messages

__all__ = [
    "MAX_OUTPUT_MULTIPLIER",
    "MAX_TOKENS_LIMIT",
    "Events",
    "Exchange",
    "HasRoles",
    "History",
    "HistoryCall",
    "Path",
    "Roles",
    "TextShape",
    "array",
    "count_field",
    "integer",
    "joined_results",
    "number",
    "open_exchange",
    "roles_of",
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
class Roles:
    """The roles one API object plays, each typed as its role: what a call's exchange,
    translator and answer hold of it. `cache` is None for an API without a prompt cache."""

    api: str  # one of proxy.model.Api
    reader: RequestReader
    editor: RequestEditor[Exchange]
    answers: AnswerReader
    errors: ErrorSpeaker
    cache: PromptCache[Exchange] | None


def roles_of(obj: object) -> Roles:
    """`obj`'s roles, checked once (when the object is first opened): a missing member is
    named, not met mid-call. A `PromptCache` is optional."""
    name = getattr(obj, "api", None)
    if not (isinstance(obj, RequestReader) and isinstance(obj, RequestEditor) and isinstance(obj, AnswerReader)
            and isinstance(obj, ErrorSpeaker) and isinstance(name, str)):
        missing = [r.__name__ for r in (RequestReader, RequestEditor, AnswerReader, ErrorSpeaker)
                   if not isinstance(obj, r)]
        raise TypeError(f"{type(obj).__name__} does not play {missing or ['an `api` name']}: "
                        f"proxy/providers/roles.py lists each role's members")
    return Roles(name, obj, obj, obj, obj, obj if isinstance(obj, PromptCache) else None)


class HasRoles(Protocol):
    """An API object, as a call is opened from it (`translator.Opens` gives its roles)."""

    @property
    def roles(self) -> Roles: ...


def open_exchange(api: HasRoles, raw: bytes, path: str) -> Exchange:
    """The exchange of one call: the body parsed once, the facts read, bad values refused."""
    roles = api.roles
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise MalformedBody(
            f"The request body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno} "
            f"(byte {exc.pos}). Send a JSON object as the {roles.api} API expects.") from None
    if not isinstance(body, dict):
        raise MalformedBody(f"The request body must be a JSON object, not {type(body).__name__}.")
    # The two facts read from the bytes rather than the body go in with it, so the module
    # builds its Call whole, once (a second build would cost ~2% of the loop's CPU per call).
    facts = ByteFacts(len(raw), _cache_write(roles.cache, raw, body))
    try:
        call = roles.reader.parse_request(body, path, facts)
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        raise MalformedBody(f"The request body has a field of the wrong type ({exc}).") from None
    return Exchange(roles, call, raw, body)


def _cache_write(cache: PromptCache[Exchange] | None, raw: bytes, body: dict[str, Any]) -> str:
    """The dearest cache write the request may cause, as the provider's parser reads its
    breakpoints (proxy/providers/members.py): a body spelled plainly is read by its bytes
    (a `"1h"` anywhere reserves the dearer write: a false positive only reserves more);
    one with escapes from its parsed markers, a lifetime other than 5 minutes at 1 hour."""
    key = cache.cache_marker if cache is not None else None
    if key is None or not has_member(raw, body, key):
        return ""
    if spelled_plainly(raw):
        return "1h" if b'"1h"' in raw else "5m"
    lifetimes = {m.get("ttl", "5m") if isinstance(m, dict) else "5m" for m in member_values(body, key)}
    return "5m" if lifetimes == {"5m"} else "1h"


class Exchange:
    """One model call's request as it will go upstream: its facts (`call`) and its patches,
    each placed by the API's roles in the bytes through `splicer` (proxy/providers/splice.py).
    `body` is the splicer's, kept equal to what is sent; `raw` the bytes as received."""

    __slots__ = ("_roles", "body", "call", "raw", "splicer")

    def __init__(self, roles: Roles, call: Call, raw: bytes, body: dict[str, Any]) -> None:
        self._roles = roles
        self.call = call
        self.raw = raw
        self.body = body
        self.splicer = Splicer(raw, body)

    # The patches the shared code asks for, each in this API's own shape.

    def prepare(self) -> list[Rewrite]:
        """Patch what this API needs to report the call (e.g. chat's include_usage); say what changed."""
        return self._roles.editor.prepare(self)

    def clamp(self, value: int) -> None:
        """Write a max-output-tokens value in the field this model family takes."""
        self._roles.editor.set_max_tokens(self, value)

    def note(self, text: str) -> bool:
        """Place a note for the model after the request's last message, leaving every earlier
        byte as it was; False when the request has no conversation to add it to."""
        return self._roles.editor.append_note(self, text)

    def cache(self, scope: CacheScope) -> list[Rewrite]:
        """Prompt-cache breakpoints or keys where this API reads them (govern/caching.py's
        policy); what changed. A breakpoint also raises `call.cache_write`."""
        cache = self._roles.cache
        return cache.cache_points(self, scope) if cache is not None else []

    def retried(self, answer: str, feedback: str) -> Exchange:
        """The request once more (repair.on_invalid: retry): `answer` as the model's turn,
        `feedback` as the user's; its own size bounds its input."""
        body = self._roles.editor.retry_body(self.body, answer, feedback)
        raw = orjson.dumps(body)
        return Exchange(self._roles, replace(self.call, body_bytes=len(raw)), raw, body)

    # Readers of this API's request shapes (the loop guard, content capture, cost anatomy).

    @property
    def conversation(self) -> str | None:
        """The body's list of conversation items (an agent's next request appends to it)."""
        return self._roles.reader.conversation

    def tool_history(self, body: dict[str, Any] | None = None) -> list[HistoryCall]:
        """Every tool call of the conversation in `body` (this request's when not given, or
        a part of one), in the order the model made them."""
        return self._roles.reader.tool_history(self.body if body is None else body)

    def input_messages(self) -> Messages:
        """The instructions and conversation in the gen_ai semconv shapes (content capture)."""
        return self._roles.reader.input_messages(self.body)

    def input_parts(self, body: dict[str, Any]) -> list[InputPart]:
        """`body` (this request's, or a part of one) split into parts in prompt order."""
        return self._roles.reader.input_parts(body)

    # The loop guard's reminder, in a tool result's own shape.

    def prefix_tool_result(self, call_id: str, text: str) -> bool:
        """Prefix `text` to the last tool result for `call_id`, in the API's own shape."""
        slots = self._roles.editor.tool_result_slots(self.body, call_id)
        if not slots:
            return False
        holder, key = slots[-1]
        path = _path_of(self.body, holder)
        if path is None:
            return False
        return self.prefix_at((*path, key), text)

    def prefix_at(self, path: Path, text: str) -> bool:
        """Prefix `text` to the tool result whose value is at `path`, in the API's own
        shape: a string gets it in front, a list of parts a text part first, an object
        (Gemini functionResponse.response) a `spanmeter_reminder` member first. False when
        the value already starts with it (a second spanmeter in the chain) or is not there."""
        holder: Any = self.body
        for step in path[:-1]:
            if not holds(holder, step):
                return False
            holder = holder[step]
        key = path[-1]
        if not isinstance(holder, dict) or not isinstance(key, str):
            return False
        if key not in holder:  # a result with no content: the member is added, last
            member = ("," if holder else "") + orjson.dumps(key).decode() + ":" + orjson.dumps(text).decode()
            holder[key] = text
            self.splicer.edit(path[:-1], lambda old: old[:-1] + member + old[-1])
            return True
        value = holder[key]
        part = {"type": self._roles.editor.text_part, "text": text}
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
        self.splicer.edit(path, edit)
        return True

    def request_bytes(self) -> bytes:
        """The request as it goes upstream: spliced once per set of patches (the handler
        measures it for admission, then sends it)."""
        return self.splicer.request_bytes()


_REMINDER_KEY = "spanmeter_reminder"

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
        # Built directly: `dataclasses.replace` costs ~2 us a result, and an agent's history
        # carries every earlier result on every call.
        last[r.call_id] = r if i >= new_from else ToolResult(r.call_id, r.content, r.name, r.is_error, False)
    return tuple(last.values())


def vocabulary(error: ProxyError, words: Mapping[type[ProxyError], str]) -> str:
    """`error` in an API's error vocabulary: the word of its nearest class in `words`
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
