"""One model call as its API module translates it, both directions. Pure: no I/O, no clock.

An API module (chat, responses, anthropic, gemini, embeddings) is opened once per call
(`open_call`, or `Api.open`). The `Translator` it returns owns that call:

- the request: its facts (`call`) and the bytes going upstream with their byte-exact
  patches (`request`, an `Exchange`: prepare, clamp, note, reminders, cache breakpoints);
- the answer (`answer(hooks)`): the observation of a whole body or of a stream (its framing,
  the text fast path, the dialect's own stream filters), usage, tool calls, stored sizes,
  and where the repair driver may rewrite the answer's text and arguments;
- its errors, in the API's own words (`error`), and the repair's retry (`retry`).

Most modules' calls are `CallTranslator`s. A module whose calls carry state of their own
subclasses it from its `open`: chat keeps whether the client itself asked for the stream's
usage (and drops the usage chunk it did not ask for), Gemini reads each answer's stream with
a reader of its own that numbers tool calls across chunks.

The shared code (serve/handler, serve/relay, govern/outputs, serve/bookkeeping) knows a call
through `Translator` and `Answer` alone, and a route through `Api`: what a wire format is
(its dialect object, with the pure per-format functions the table tests drive) stays in its
module.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from dataclasses import replace
from typing import Protocol, runtime_checkable

import orjson

from proxy.errors import ProxyError
from proxy.model import Call, Outcome, StreamError
from proxy.providers.answer import ArgumentSlot, EventRewrite, Json, Slot, StreamEdits
from proxy.providers.base import Dialect, Events, Exchange, open_exchange
from proxy.providers.hooks import Hooks
from proxy.providers.observer import Observer
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


class Api(Protocol):
    """A wire format as routing sees it, before a call is opened."""

    api: str  # one of proxy.model.Api
    dialect: str  # the upstream family serving it (openai | anthropic | gemini): its upstreams and keys
    provider: str  # gen_ai.provider.name when the upstream's host does not say
    upstream_setting: str  # which settings field holds this dialect's base URL
    names_deployment: bool  # the call's model is an operator's deployment name (Azure), not a model

    def auth_headers(self, key: str) -> dict[str, str]:
        """Headers carrying an upstream key in this dialect's own scheme."""
        ...

    def render_error(self, error: ProxyError, request_id: str) -> bytes:
        """The dialect's JSON error body for `error`, for a call refused before it was opened."""
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
    """What makes an API module's dialect object an `Api`: it opens one translator per call."""

    __slots__ = ()

    def open(self: Dialect, raw: bytes, path: str) -> Translator:
        return CallTranslator(self, open_exchange(self, raw, path))


class CallTranslator:
    """The translator of one call: its module's dialect object does the per-format work.
    A module whose calls carry state of their own subclasses it (see the module docstring)."""

    __slots__ = ("_dialect", "request")

    def __init__(self, dialect: Dialect, request: Exchange) -> None:
        self._dialect = dialect
        self.request = request

    @property
    def call(self) -> Call:
        return self.request.call

    def answer(self, hooks: Hooks) -> Answer:
        return Answer(self._dialect, self.request.call, hooks, self._dialect)

    def error(self, exc: ProxyError, request_id: str, *, streaming: bool) -> bytes:
        if streaming:
            return self._dialect.render_stream_error(exc)
        return self._dialect.render_error(exc, request_id)

    def retry(self, answer: str, feedback: str) -> Translator:
        ex = self.request
        body = self._dialect.retry_body(ex.body, answer, feedback)
        raw = orjson.dumps(body)
        again = copy.copy(self)  # the same call once more: a subclass's own state goes with it
        # Its own size bounds its input.
        again.request = Exchange(self._dialect, replace(ex.call, body_bytes=len(raw)), raw, body)
        return again


class Answer:
    """The answer of one call as it is read: observed, rewritten through the call's hooks,
    and what the relay learnt on the way (the handler holds it, so a cancelled relay loses
    nothing). `events` reads the answer's events: the dialect object itself, or a reader of
    this answer alone when the module's events depend on the ones before. The repair driver
    adds its hooks at `text_slots`, `argument_slots` and `rewriter`."""

    __slots__ = ("_dialect", "_observer", "call", "chunk_gaps_s", "complete", "delivered_ns", "events",
                 "first_chunk_s", "hooks", "status")

    def __init__(self, dialect: Dialect, call: Call, hooks: Hooks, events: Events) -> None:
        self._dialect = dialect
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
        return StreamRelay(self._dialect, self.events, self._observer, self.hooks)

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
        return self._dialect.render_stream_error(exc)

    def failed(self, exc: ProxyError) -> None:
        """The call failed with `exc` (upstream unreachable, timed out, broke the protocol)."""
        self._observer.feed([StreamError(exc.error_type, exc.message)])
        self.status = self.status or exc.status

    def outcome(self) -> Outcome:
        return self._observer.finish(self.status, complete=self.complete, first_chunk_s=self.first_chunk_s)

    def stored_sizes(self, outcome: Outcome) -> dict[str, int]:
        """Stored context this answer revealed the size of, in tokens (see Call.stored_context)."""
        return self._dialect.stored_sizes(self.call, outcome)

    # The repair driver's side (proxy/govern/outputs.py).

    def text_slots(self, body: Json) -> list[Slot]:
        """Where a whole answer's text is, in order (the first choice or candidate only)."""
        return self._dialect.text_slots(body)

    def argument_slots(self, body: Json) -> list[ArgumentSlot]:
        """Each tool call's arguments in a whole answer, with its call id and tool name."""
        return self._dialect.argument_slots(body)

    def rewriter(self, edits: StreamEdits) -> EventRewrite | None:
        """A rewriter of this API's stream events that hands the answer's text and each tool
        call's arguments to `edits` as they stream, in the dialect's own framing."""
        return self._dialect.stream_rewriter(edits)
