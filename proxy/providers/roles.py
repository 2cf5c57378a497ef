"""The roles an API module's object plays, each a small protocol: what the shared code of
proxy/providers/ may ask of a wire format, one reason at a time.

- `RequestReader`: a request's facts and shapes (the call, tool history, input parts and messages);
- `RequestEditor`: patches in the request's own shape, and the repair's retry;
- `PromptCache`: the prompt cache's breakpoint marker and where breakpoints or keys go;
- `AnswerReader` (an `Events`): the answer, whole or event by event, and where repair writes;
- `ErrorSpeaker`: spanmeter's errors in the API's own shape;
- `Api` (proxy/providers/translator.py): the route's identity, before a call is opened.

An API object implements the roles it has (proxy/providers/base.py `Roles`). Pure, no I/O.
The request-side roles are generic in the request they patch (`base.Exchange`), which is
built on them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

from proxy.model import NO_BYTE_FACTS, ByteFacts, Call, InputPart, Outcome, Rewrite, StreamEvent, Usage, frozen
from proxy.providers.splice import Path
from proxy.providers.sse import SseEvent

if TYPE_CHECKING:
    from proxy.errors import ProxyError
    from proxy.providers.answer import ArgumentSlot, EventRewrite, Slot, StreamEdits
    from proxy.providers.cache import CacheScope
    from proxy.providers.parts import Messages

__all__ = ["AnswerReader", "ErrorSpeaker", "Events", "HistoryCall", "PromptCache", "RequestEditor", "RequestReader",
           "TextShape"]

Ex = TypeVar("Ex", contravariant=True)  # the request a patch edits (base.Exchange)
Json = dict[str, Any]


@frozen
class TextShape:
    """How stream events that carry nothing but a piece of the answer's text are told by
    their bytes (proxy/providers/shortcut.py learns each stream's own shapes).

    `key`: the member whose string value is the text. `plain`: such an event, parsed, is one
    every stream rewriter forwards untouched while the text is not repaired. `ignored`:
    members that change per event and nothing reads. `usage`: a member of running usage
    every text event repeats (Gemini), read with `usage_of`.
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


@runtime_checkable
class RequestReader(Protocol):
    """A request's facts and shapes, read from its parsed body."""

    conversation: str | None  # the body's list of items an agent's next request appends to (cost anatomy)

    def parse_request(self, body: Json, path: str, facts: ByteFacts = NO_BYTE_FACTS) -> Call:
        """The call's facts, built whole with `facts` (what its bytes said); refuses
        (MalformedBody) a field that changes cost and is not a value the API accepts."""
        ...

    def tool_history(self, body: Json) -> list[HistoryCall]:
        """Every tool call of the conversation, in the order the model made them, each with
        the path of its result's value (what a loop-guard reminder is prefixed to)."""
        ...

    def input_parts(self, body: Json) -> list[InputPart]:
        """The input in prompt order: instructions, tools, tool results, earlier turns, this
        turn's new content (cost anatomy)."""
        ...

    def input_messages(self, body: Json) -> Messages:
        """System instructions and conversation in the gen_ai semconv shapes (content capture)."""
        ...


@runtime_checkable
class RequestEditor(Protocol[Ex]):
    """Patches in the request's own shape, through its splicer (`ex.splicer`): a request
    nobody patches goes byte for byte."""

    text_part: str  # the type of a text part in a tool result's content list

    def prepare(self, ex: Ex) -> list[Rewrite]:
        """Patch what the API needs to report the call (chat's include_usage); say what changed."""
        ...

    def set_max_tokens(self, ex: Ex, value: int) -> None:
        """Write a max-output-tokens value in the field this model family takes (the clamp)."""
        ...

    def append_note(self, ex: Ex, text: str) -> bool:
        """A note for the model after the last message, every earlier byte as it was; False
        when the request has no conversation to add it to."""
        ...

    def tool_result_slots(self, body: Json, call_id: str) -> list[tuple[Json, str]]:
        """(holder, key) of each tool result for `call_id` in the request, in order."""
        ...

    def retry_body(self, body: Json, answer: str, feedback: str) -> Json:
        """The request once more: `answer` as the model's turn, then `feedback` as the user's."""
        ...


@runtime_checkable
class PromptCache(Protocol[Ex]):
    """The provider's prompt cache: what marks a breakpoint, and where breakpoints or keys go."""

    # The member that marks an explicit breakpoint (Anthropic `cache_control`), whose writes
    # bill above plain input; None when the API bills no write premium.
    cache_marker: str | None

    def cache_points(self, ex: Ex, scope: CacheScope) -> list[Rewrite]:
        """Add what makes the cache pay (proxy/govern/caching.py says when); say what changed."""
        ...


@runtime_checkable
class Events(Protocol):
    """The reader of one answer's events. An API object is one for every answer; a module
    whose events depend on the ones before opens one per answer (Gemini numbers a stream's
    tool calls across its chunks)."""

    def parse_response(self, body: Any) -> list[StreamEvent]:
        """A whole answer's events."""
        ...

    def parse_event(self, event: SseEvent) -> list[StreamEvent]:
        """One SSE event's events, read after every earlier one of the same stream."""
        ...


@runtime_checkable
class AnswerReader(Events, Protocol):
    """An answer, whole or one event at a time, and where the repair driver may write."""

    text_shape: TextShape | None  # how a plain text delta looks; None: every event is parsed

    def text_slots(self, body: Json) -> list[Slot]:
        """Where a whole answer's text is, in order (the first choice or candidate only)."""
        ...

    def argument_slots(self, body: Json) -> list[ArgumentSlot]:
        """Each tool call's arguments in a whole answer, with its call id and tool name."""
        ...

    def stream_rewriter(self, edits: StreamEdits) -> EventRewrite | None:
        """A rewriter of stream events handing text and argument fragments to `edits` and
        writing back what it gets, in the API's framing; None when it does not stream."""
        ...

    def stored_sizes(self, call: Call, outcome: Outcome) -> dict[str, int]:
        """Stored context the answer revealed the size of, in tokens (Call.stored_context)."""
        ...


@runtime_checkable
class ErrorSpeaker(Protocol):
    """spanmeter's errors in the API's own shape, which its SDK raises with the message."""

    def render_error(self, error: ProxyError, request_id: str) -> bytes:
        """The JSON error body for `error`."""
        ...

    def render_stream_error(self, error: ProxyError) -> bytes:
        """A terminal SSE event carrying `error`, for failures after the stream began."""
        ...
