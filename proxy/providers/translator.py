"""One model call as its API module translates it, both directions. Pure: no I/O, no clock.

The shared code (serve/handler, serve/relay, govern/outputs, serve/bookkeeping) knows a route
through `Api` and a call through the `Translator` `Api.open` returns: its facts (`call`),
the request going upstream with its patches (`request`, a base.Exchange), the answer's
reader (`answer(hooks)`: `Answer`), its errors and the repair's retry. Most calls are
`CallTranslator`s over the API object's roles (proxy/providers/roles.py); a module whose
calls carry state of their own subclasses it from its `open` (chat, Gemini).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from functools import cached_property
from typing import Protocol, runtime_checkable

import orjson

from proxy.errors import ProxyError
from proxy.model import Call, Outcome, StreamError
from proxy.providers.answer import ArgumentSlot, EventRewrite, Json, Slot, StreamEdits
from proxy.providers.base import Exchange, HasRoles, Roles, open_exchange, roles_of
from proxy.providers.hooks import Hooks
from proxy.providers.observer import Observer
from proxy.providers.roles import Events
from proxy.providers.stream import ChunkRelay, StreamRelay, safely_parsed

__all__ = ["Answer", "Api", "CallTranslator", "ErrorHeaders", "Opens", "Translator", "error_headers", "open_call"]

log = logging.getLogger("spanmeter.relay")


class Translator(Protocol):
    """One model call of an API, both directions: all the shared code may ask of it."""

    @property
    def call(self) -> Call:
        """The request's facts, as the upstream will run them."""
        ...

    @property
    def request(self) -> Exchange:
        """The request as it goes upstream: its bytes and their patches."""
        ...

    def answer(self, hooks: Hooks) -> Answer:
        """The reader of this call's answer, rewriting through `hooks` (opened once per send)."""
        ...

    def error(self, exc: ProxyError, request_id: str, *, streaming: bool) -> bytes:
        """`exc` as this API's error body, or as its terminal stream event once a stream began."""
        ...

    def retry(self, answer: str, feedback: str) -> Translator:
        """The call once more: `answer` as the model's turn, `feedback` as the user's."""
        ...


@runtime_checkable
class Api(Protocol):
    """The route's identity, as routing sees an API before a call is opened (a role: see
    proxy/providers/roles.py)."""

    api: str  # one of proxy.model.Api
    family: str  # the upstream family serving it (openai | anthropic | gemini | azure | vertex): upstreams, keys
    provider: str  # gen_ai.provider.name when the upstream's host does not say
    upstream_setting: str  # which settings field holds this family's base URL
    names_deployment: bool  # the call's model is an operator's deployment name (Azure), not a model

    def auth_headers(self, key: str) -> dict[str, str]:
        """Headers carrying an upstream key in this family's own scheme."""
        ...

    def render_error(self, error: ProxyError, request_id: str) -> bytes:
        """The API's JSON error body for `error`, for a call refused before it was opened."""
        ...

    def open(self, raw: bytes, path: str) -> Translator:
        """The translator of one call: the body parsed once, the facts read, bad values
        refused (MalformedBody)."""
        ...


@runtime_checkable
class ErrorHeaders(Protocol):
    """An API whose errors carry a header of its own (Bedrock's `x-amzn-errortype`, which
    botocore reads the exception's name from)."""

    def error_headers(self, error: ProxyError) -> dict[str, str]: ...


def error_headers(api: Api, error: ProxyError) -> dict[str, str]:
    """The headers `api` answers `error` with besides its body (most APIs: none)."""
    return api.error_headers(error) if isinstance(api, ErrorHeaders) else {}


def open_call(api: Api, raw: bytes, path: str) -> Translator:
    """The translator of one call of `api` (see `Api.open`)."""
    return api.open(raw, path)


class Opens:
    """What makes an API module's object an `Api`: its roles, checked once, and one
    translator per call."""

    @cached_property
    def roles(self) -> Roles:
        return roles_of(self)

    def open(self, raw: bytes, path: str) -> Translator:
        return CallTranslator(self, open_exchange(self, raw, path))


class CallTranslator:
    """The translator of one call, over its API object's roles. A module whose calls carry
    state of their own subclasses it (see the module docstring)."""

    __slots__ = ("_roles", "request")

    def __init__(self, api: HasRoles, request: Exchange) -> None:
        self._roles = api.roles
        self.request = request

    @property
    def call(self) -> Call:
        return self.request.call

    def answer(self, hooks: Hooks) -> Answer:
        roles = self._roles
        return Answer(roles, self.request.call, hooks, roles.answers)

    def error(self, exc: ProxyError, request_id: str, *, streaming: bool) -> bytes:
        if streaming:
            return self._roles.errors.render_stream_error(exc)
        return self._roles.errors.render_error(exc, request_id)

    def retry(self, answer: str, feedback: str) -> Translator:
        again = copy.copy(self)  # the same call once more: a subclass's own state goes with it
        again.request = self.request.retried(answer, feedback)
        return again


class Answer:
    """The answer of one call as it is read: observed, rewritten through the call's hooks,
    and what the relay learnt on the way (the handler holds it, so a cancelled relay loses
    nothing). `events` reads the answer's events: the API object itself, or a reader of
    this answer alone when the module's events depend on the ones before. The repair driver
    adds its hooks at `text_slots`, `argument_slots` and `rewriter`."""

    __slots__ = ("_errors", "_observer", "_reader", "call", "chunk_gaps_s", "complete", "delivered_ns", "events",
                 "first_chunk_s", "hooks", "status")

    def __init__(self, roles: Roles, call: Call, hooks: Hooks, events: Events) -> None:
        self._reader = roles.answers
        self._errors = roles.errors
        self.events = events
        self._observer = Observer()
        self.call = call
        self.hooks = hooks
        self.status = 0
        self.complete = False
        self.first_chunk_s: float | None = None
        self.delivered_ns = 0
        self.chunk_gaps_s: list[float] = []  # time_per_output_chunk samples

    # The relay's side.

    def stream(self) -> ChunkRelay:
        """The reader of this answer's stream, bound once: the relay feeds it each chunk. SSE
        here; an API whose streams are framed otherwise returns its own (Bedrock's
        event-stream frames: proxy/providers/eventstream.py)."""
        return StreamRelay(self._reader, self.events, self._observer, self.hooks)

    def read_headers(self, headers: Mapping[str, str]) -> None:
        """The upstream's answer headers, before its body: what most APIs read nothing from
        (Bedrock's token counts are read there)."""

    def body(self, raw: bytes) -> bytes:
        """A whole successful answer, observed and rewritten by the body hooks: what to send."""
        observer = self._observer
        try:
            parsed = orjson.loads(raw)
        except orjson.JSONDecodeError:
            observer.note("unparsed_body")
            return raw
        observer.feed(safely_parsed(self.events.parse_response, parsed, observer))
        for hook in self.hooks.on_body:
            try:
                replaced = hook(parsed)
            except ProxyError:
                raise  # a decision (repair.on_invalid=error), not a failure
            except Exception:  # a rewrite that fails leaves the answer as it came
                log.exception("response rewrite failed; forwarding the body unchanged")
                observer.note("rewrite_failed")
                continue
            if replaced is not None:
                raw = replaced
        return raw

    def cut(self, exc: ProxyError) -> bytes:
        """The stream ends with `exc` after its status line went: noted, and the API's
        terminal error event."""
        self._observer.feed([StreamError(exc.error_type, exc.message)])
        return self._errors.render_stream_error(exc)

    def failed(self, exc: ProxyError) -> None:
        """The call failed with `exc` (upstream unreachable, timed out, broke the protocol)."""
        self._observer.feed([StreamError(exc.error_type, exc.message)])
        self.status = self.status or exc.status

    def outcome(self) -> Outcome:
        return self._observer.finish(self.status, complete=self.complete, first_chunk_s=self.first_chunk_s)

    def stored_sizes(self, outcome: Outcome) -> dict[str, int]:
        """Stored context this answer revealed the size of, in tokens (see Call.stored_context)."""
        return self._reader.stored_sizes(self.call, outcome)

    # The repair driver's side (proxy/govern/outputs.py).

    def text_slots(self, body: Json) -> list[Slot]:
        """Where a whole answer's text is, in order (the first choice or candidate only)."""
        return self._reader.text_slots(body)

    def argument_slots(self, body: Json) -> list[ArgumentSlot]:
        """Each tool call's arguments in a whole answer, with its call id and tool name."""
        return self._reader.argument_slots(body)

    def rewriter(self, edits: StreamEdits) -> EventRewrite | None:
        """A rewriter of this API's stream events that hands the answer's text and each tool
        call's arguments to `edits` as they stream, in the API's own framing."""
        return self._reader.stream_rewriter(edits)
