"""AWS Bedrock: the routes, InvokeModel by model family, and what a Bedrock answer is metered by.
Pure: no I/O.

`/model/{id}/converse` and `/converse-stream` are Converse (proxy/providers/converse.py);
`/invoke` and `/invoke-with-response-stream` are InvokeModel, read by the model family's own
body (a `Family` each); a family spanmeter cannot read is forwarded and metered from
Bedrock's own counts. Those counts (the token-count headers, a stream's
`amazon-bedrock-invocationMetrics`) are what Bedrock bills, so they win over the model's own
`usage`, and a disagreement is noted on the span. The families, their fields and the billing
rules: docs/providers.md, "AWS Bedrock" (InvokeModel families).
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any, Final

import orjson

from proxy.errors import ProxyError
from proxy.model import (
    NO_BYTE_FACTS,
    ByteFacts,
    Call,
    Finish,
    InputPart,
    MetaEvent,
    Outcome,
    Rewrite,
    StreamEvent,
    TextDelta,
    Usage,
    UsageEvent,
    frozen,
)
from proxy.providers.answer import ArgumentSlot, EventRewrite, Json, Slot, StreamEdits, dicts
from proxy.providers.anthropic import AnthropicAdapter
from proxy.providers.base import (
    MAX_TOKENS_LIMIT,
    Exchange,
    HasRoles,
    Roles,
    count_field,
    number,
    open_exchange,
)
from proxy.providers.base import integer as _int
from proxy.providers.bedrock_wire import (
    PATH,
    arn_or_plain,
    bedrock_auth,
    bedrock_error_body,
    bedrock_error_headers,
    bedrock_stream_error,
    model_of_path,
    priced_id,
)
from proxy.providers.cache import CacheScope
from proxy.providers.converse import ConverseFormat, converse_stream_event
from proxy.providers.eventstream import EventStreamRelay
from proxy.providers.hooks import Hooks
from proxy.providers.parts import Messages, text_part
from proxy.providers.roles import Events, HistoryCall, TextShape
from proxy.providers.sse import SseEvent
from proxy.providers.translator import Answer, CallTranslator, Opens, Translator

__all__ = ["CONVERSE_API", "INVOKE_API", "BedrockAnswer", "bedrock_route", "family_of", "header_usage",
           "metrics_usage", "regional_base_url"]


def regional_base_url(region: str) -> str:
    """Bedrock's runtime endpoint in a region."""
    return f"https://bedrock-runtime.{region}.amazonaws.com"


# -- what Bedrock says it billed ------------------------------------------------------------

_HEADER: Final = "x-amzn-bedrock-"


def header_usage(headers: Mapping[str, str]) -> Usage | None:
    """The counts of a non-streamed InvokeModel answer's headers (uncached input, output,
    cache reads and writes), or None when Bedrock sent none."""
    def count(name: str) -> int | None:
        value = headers.get(_HEADER + name)
        return int(value) if value is not None and value.strip().isdigit() else None

    raw, out = count("input-token-count"), count("output-token-count")
    if raw is None and out is None:
        return None
    read, written = count("cache-read-input-token-count"), count("cache-write-input-token-count")
    return Usage(input_tokens=None if raw is None else raw + (read or 0) + (written or 0), output_tokens=out,
                 cache_read_tokens=read, cache_write_tokens=written)


def metrics_usage(metrics: Any) -> Usage | None:
    """`amazon-bedrock-invocationMetrics` of a stream's last chunk, in gen_ai terms."""
    if not isinstance(metrics, dict):
        return None
    raw, out = _int(metrics.get("inputTokenCount")), _int(metrics.get("outputTokenCount"))
    if raw is None and out is None:
        return None
    read, written = _int(metrics.get("cacheReadInputTokenCount")), _int(metrics.get("cacheWriteInputTokenCount"))
    return Usage(input_tokens=None if raw is None else raw + (read or 0) + (written or 0), output_tokens=out,
                 cache_read_tokens=read, cache_write_tokens=written)


def _disagree(reported: Usage, billed: Usage) -> bool:
    pairs = ((reported.input_tokens, billed.input_tokens), (reported.output_tokens, billed.output_tokens))
    return any(a is not None and b is not None and a != b for a, b in pairs)


# -- the families of InvokeModel bodies -----------------------------------------------------

ChunkReader = Callable[[Any], list[StreamEvent]]
"""The events of one decoded answer object: a whole body, or one stream chunk's JSON."""


def _f(value: Any) -> int | None:
    """A count some families send as a float (Titan's `28.0`)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return _int(value)


def _finish(value: Any) -> list[StreamEvent]:
    return [Finish(value)] if isinstance(value, str) and value else []


def _text(value: Any) -> list[StreamEvent]:
    return [TextDelta(value)] if isinstance(value, str) and value else []


def _usage(input_tokens: int | None, output_tokens: int | None) -> list[StreamEvent]:
    if input_tokens is None and output_tokens is None:
        return []
    return [UsageEvent(Usage(input_tokens=input_tokens, output_tokens=output_tokens))]


def _titan(o: Any) -> list[StreamEvent]:
    if not isinstance(o, dict):
        return []
    events: list[StreamEvent] = []
    out = None
    for r in dicts(o.get("results")):  # a whole answer
        events += _text(r.get("outputText")) + _finish(r.get("completionReason"))
        out = _f(r.get("tokenCount"))
    events += _text(o.get("outputText")) + _finish(o.get("completionReason"))  # a stream chunk
    return events + _usage(_f(o.get("inputTextTokenCount")), _f(o.get("totalOutputTextTokenCount")) or out)


def _llama(o: Any) -> list[StreamEvent]:
    if not isinstance(o, dict):
        return []
    return (_text(o.get("generation")) + _finish(o.get("stop_reason"))
            + _usage(_f(o.get("prompt_token_count")), _f(o.get("generation_token_count"))))


def _cohere(o: Any) -> list[StreamEvent]:
    if not isinstance(o, dict):
        return []
    events: list[StreamEvent] = []
    for g in dicts(o.get("generations")):
        events += _text(g.get("text")) + _finish(g.get("finish_reason"))
    if not o.get("generations"):  # Command R, and stream chunks
        events += _text(o.get("text")) + _finish(o.get("finish_reason"))
    return events


def _choices(o: Json) -> list[StreamEvent]:
    """OpenAI-shaped answers (Mistral's and AI21 Jamba's chat bodies)."""
    events: list[StreamEvent] = []
    for c in dicts(o.get("choices")):
        message = c.get("message") or c.get("delta") or {}
        events += _text(message.get("content") if isinstance(message, dict) else None)
        events += _finish(c.get("finish_reason") or c.get("stop_reason"))
    u = o.get("usage")
    if isinstance(u, dict):
        events += _usage(_f(u.get("prompt_tokens")), _f(u.get("completion_tokens")))
    return events


def _mistral(o: Any) -> list[StreamEvent]:
    if not isinstance(o, dict):
        return []
    events: list[StreamEvent] = []
    for out in dicts(o.get("outputs")):
        events += _text(out.get("text")) + _finish(out.get("stop_reason"))
    return events + _choices(o)


def _ai21(o: Any) -> list[StreamEvent]:
    if not isinstance(o, dict):
        return []
    events: list[StreamEvent] = []
    for c in dicts(o.get("completions")):
        data, reason = c.get("data"), c.get("finishReason")
        events += _text(data.get("text") if isinstance(data, dict) else None)
        events += _finish(reason.get("reason") if isinstance(reason, dict) else None)
    return events + _choices(o)


def _anthropic_text(o: Any) -> list[StreamEvent]:
    if not isinstance(o, dict):
        return []
    return _text(o.get("completion")) + _finish(o.get("stop_reason"))


def _embedding(o: Any) -> list[StreamEvent]:
    if not isinstance(o, dict):
        return []
    return _usage(_f(o.get("inputTextTokenCount")), None)


def _nothing(o: Any) -> list[StreamEvent]:
    return []


@frozen
class Family:
    """How spanmeter reads one model family's InvokeModel bodies."""

    name: str
    operation: str  # gen_ai.operation.name: text_completion | chat | embeddings
    max_tokens: tuple[str, ...]  # the member holding the output bound (one or two levels); () none
    read: ChunkReader  # a whole answer's events, and a stream chunk's
    prompt: str = "prompt"  # the member holding the prompt text (content capture, cost anatomy)


_TITAN = Family("titan", "text_completion", ("textGenerationConfig", "maxTokenCount"), _titan, "inputText")
_LLAMA = Family("meta", "text_completion", ("max_gen_len",), _llama)
_COHERE = Family("cohere", "text_completion", ("max_tokens",), _cohere)
_COHERE_R = Family("cohere", "chat", ("max_tokens",), _cohere, "message")
_MISTRAL = Family("mistral", "text_completion", ("max_tokens",), _mistral)
_MISTRAL_CHAT = Family("mistral", "chat", ("max_tokens",), _mistral, "messages")
_AI21 = Family("ai21", "text_completion", ("maxTokens",), _ai21)
_JAMBA = Family("ai21", "chat", ("max_tokens",), _ai21, "messages")
_CLAUDE_TEXT = Family("anthropic", "text_completion", ("max_tokens_to_sample",), _anthropic_text)
_TITAN_EMBED = Family("embeddings", "embeddings", (), _embedding, "inputText")
_COHERE_EMBED = Family("embeddings", "embeddings", (), _embedding, "texts")
_OTHER = Family("other", "chat", (), _nothing, "")


def family_of(model: str, body: Json) -> str | Family:
    """The family of an InvokeModel call: "anthropic" and "nova" (read by the Anthropic and
    Converse modules), else the `Family` that reads it. The model id decides, as Bedrock's
    own routing does; the body tells apart the shapes one vendor has had."""
    vendor, _, name = priced_id(model).partition(".")
    if vendor == "anthropic":
        return "anthropic" if "messages" in body else _CLAUDE_TEXT
    if vendor == "amazon":
        if name.startswith("nova-") and "messages" in body:
            return "nova"
        if name.startswith("titan-embed"):
            return _TITAN_EMBED
        return _TITAN if name.startswith(("titan-text", "titan-tg1")) else _OTHER
    if vendor == "meta":
        return _LLAMA
    if vendor == "cohere":
        if name.startswith("embed"):
            return _COHERE_EMBED
        return _COHERE_R if "message" in body else _COHERE
    if vendor == "mistral":
        return _MISTRAL_CHAT if "messages" in body else _MISTRAL
    if vendor == "ai21":
        return _JAMBA if "messages" in body else _AI21
    return _OTHER


# -- the dialects behind InvokeModel ------------------------------------------------------

def _stream_of(path: str) -> bool:
    return path.endswith("/invoke-with-response-stream") or path.endswith("/converse-stream")


class _Bedrock(Opens):
    """What every Bedrock API object says the same way: upstream, provider, errors, credential."""

    family = "bedrock"
    provider = "aws.bedrock"
    upstream_setting = "bedrock_base_url"
    names_deployment = False

    def render_error(self, error: ProxyError, request_id: str) -> bytes:
        return bedrock_error_body(error)

    def render_stream_error(self, error: ProxyError) -> bytes:
        return bedrock_stream_error(error)

    def error_headers(self, error: ProxyError) -> dict[str, str]:
        return bedrock_error_headers(error)

    def auth_headers(self, key: str) -> dict[str, str]:
        return bedrock_auth(key)


class InvokeAnthropic(_Bedrock, AnthropicAdapter):
    """Anthropic Messages on InvokeModel, as on Vertex AI: no `model` (the path names it),
    `anthropic_version`, and streamed by the route, not a `stream` member. Stream chunks
    carry Messages' own events, base64 in `bytes`."""

    api = "invoke"
    text_shape: TextShape | None = None

    def parse_request(self, body: dict[str, Any], path: str, facts: ByteFacts = NO_BYTE_FACTS) -> Call:
        return replace(super().parse_request(body, path, facts), api="invoke", stream=_stream_of(path))

    def model_of(self, body: dict[str, Any], path: str) -> str | None:
        return model_of_path(path)

    def parse_response(self, body: Any) -> list[StreamEvent]:
        return _unnamed(super().parse_response(body))

    def chunk(self, data: Any) -> list[StreamEvent]:
        # The event already parsed (InvokeChunks decoded its `bytes`): handed over as its JSON.
        return _unnamed(AnthropicAdapter.parse_event(self, SseEvent(b"", None, "{}", data)))

    def stream_rewriter(self, edits: StreamEdits) -> EventRewrite | None:
        return None  # event-stream frames are relayed as they come


def _unnamed(events: list[StreamEvent]) -> list[StreamEvent]:
    """The answer's events without the model it names (`claude-3-5-sonnet-20240620`): the call
    is charged as the model the path names, the profile or region it ran in with it."""
    return [MetaEvent(e.response_id) if isinstance(e, MetaEvent) else e for e in events]


class InvokeNova(_Bedrock, ConverseFormat):
    """Amazon Nova on InvokeModel (`schemaVersion: messages-v1`): Converse's blocks, the
    output bound in `inferenceConfig.max_new_tokens`, stream chunks keyed by Converse's
    event names (`{"contentBlockDelta": {...}}`)."""

    api = "invoke"
    max_tokens_path: tuple[str, str] = ("inferenceConfig", "max_new_tokens")

    def parse_request(self, body: dict[str, Any], path: str, facts: ByteFacts = NO_BYTE_FACTS) -> Call:
        call = super().parse_request(body, path, facts)
        inference = body.get("inferenceConfig")
        asked = inference.get("max_new_tokens") if isinstance(inference, dict) else None
        bound = count_field("inferenceConfig.max_new_tokens", asked, upper=MAX_TOKENS_LIMIT,
                            what="the most tokens the answer may have")
        return replace(call, api="invoke", stream=_stream_of(path), max_output_tokens=bound,
                       max_tokens_field="inferenceConfig.max_new_tokens")

    def chunk(self, data: Any) -> list[StreamEvent]:
        if not isinstance(data, dict):
            return []
        return [e for kind, value in data.items() for e in converse_stream_event(kind, value)]


class InvokeText(_Bedrock):
    """Every other family's InvokeModel body, read through its `Family`: the output bound, the
    answer's text and finish, whatever usage the family reports (Bedrock's counts win)."""

    api = "invoke"
    conversation: str | None = None
    text_part = "text"
    cache_marker: str | None = None
    text_shape: TextShape | None = None

    def __init__(self, family: Family) -> None:
        self.kind = family

    def parse_request(self, body: dict[str, Any], path: str, facts: ByteFacts = NO_BYTE_FACTS) -> Call:
        fam = self.kind
        asked = _member(body, fam.max_tokens)
        bound = (count_field(".".join(fam.max_tokens), asked, upper=MAX_TOKENS_LIMIT,
                             what="the most tokens the answer may have") if fam.max_tokens else None)
        config = body.get("textGenerationConfig")
        knobs = config if isinstance(config, dict) else body
        return Call(api="invoke", operation=fam.operation, model=model_of_path(path), stream=_stream_of(path),
                    body_bytes=facts.body_bytes, cache_write=facts.cache_write,
                    max_output_tokens=bound, max_tokens_field=".".join(fam.max_tokens),
                    temperature=number(knobs.get("temperature")),
                    top_p=number(knobs.get("topP", knobs.get("top_p"))),
                    generates_output=fam.operation != "embeddings")

    def prepare(self, ex: Exchange) -> list[Rewrite]:
        return []

    def set_max_tokens(self, ex: Exchange, value: int) -> None:
        path = self.kind.max_tokens
        if len(path) == 1:
            ex.splicer.set_top(path[0], value)
        elif len(path) == 2:
            holder = ex.body.get(path[0])
            ex.splicer.set_top(path[0], {**(holder if isinstance(holder, dict) else {}), path[1]: value})
        # A family with no known field (one spanmeter cannot read) is forwarded unclamped.

    def tool_result_slots(self, body: dict[str, Any], call_id: str) -> list[tuple[dict[str, Any], str]]:
        return []

    def append_note(self, ex: Exchange, text: str) -> bool:
        return False  # a prompt string has no turn to add a note to

    def tool_history(self, body: dict[str, Any]) -> list[HistoryCall]:
        return []

    def stored_sizes(self, call: Call, outcome: Outcome) -> dict[str, int]:
        return {}

    def input_parts(self, body: dict[str, Any]) -> list[InputPart]:
        return [("new", len(orjson.dumps(body)), "", "")]

    def parse_response(self, body: Any) -> list[StreamEvent]:
        return self.kind.read(body)

    def parse_event(self, event: SseEvent) -> list[StreamEvent]:
        return []  # streams are read chunk by chunk (`chunk`), by the answer's reader

    def chunk(self, data: Any) -> list[StreamEvent]:
        return self.kind.read(data)

    def text_slots(self, body: Json) -> list[Slot]:
        return []

    def argument_slots(self, body: Json) -> list[ArgumentSlot]:
        return []

    def stream_rewriter(self, edits: StreamEdits) -> EventRewrite | None:
        return None

    def retry_body(self, body: Json, answer: str, feedback: str) -> Json:
        return body  # no structured output is declared in these bodies, so none is retried

    def input_messages(self, body: Json) -> Messages:
        prompt = body.get(self.kind.prompt) if self.kind.prompt else None
        if isinstance(prompt, list):
            prompt = "\n".join(p for p in prompt if isinstance(p, str))
        return "", ([{"role": "user", "parts": [text_part(prompt)]}] if isinstance(prompt, str) else [])

    def cache_points(self, ex: Exchange, scope: CacheScope) -> list[Rewrite]:
        return []


def _member(body: Json, path: tuple[str, ...]) -> Any:
    node: Any = body
    for step in path:
        node = node.get(step) if isinstance(node, dict) else None
    return node


_ANTHROPIC: Final = InvokeAnthropic()
_NOVA: Final = InvokeNova()
_TEXT: Final = {f: InvokeText(f) for f in (_TITAN, _LLAMA, _COHERE, _COHERE_R, _MISTRAL, _MISTRAL_CHAT, _AI21,
                                           _JAMBA, _CLAUDE_TEXT, _TITAN_EMBED, _COHERE_EMBED, _OTHER)}


# -- one call: its answer is read in Bedrock's framing, metered by Bedrock's counts -----------

class InvokeChunks:
    """The reader of one InvokeModel stream: each `chunk` frame's `bytes` (base64 JSON of the
    family's own event) handed to the family, and the last chunk's invocation metrics, which
    are what Bedrock bills (module docstring), laid over the family's usage."""

    __slots__ = ("_notes", "_read", "_reported")

    def __init__(self, read: ChunkReader) -> None:
        self._read = read
        self._reported = Usage()
        self._notes: list[str] = []

    def parse_response(self, body: Any) -> list[StreamEvent]:
        return []  # not a reader of whole answers

    def parse_event(self, event: SseEvent) -> list[StreamEvent]:
        kind = event.event or ""
        if kind.startswith("exception:"):
            from proxy.model import StreamError

            data = orjson.loads(event.data) if event.data else {}
            return [StreamError(kind.removeprefix("exception:"),
                                str(data.get("message") or "") if isinstance(data, dict) else "")]
        if kind != "chunk":
            return []
        wrapped = orjson.loads(event.data)
        if not isinstance(wrapped, dict) or not isinstance(wrapped.get("bytes"), str):
            return []
        data = orjson.loads(base64.b64decode(wrapped["bytes"]))
        events = self._read(data)
        for e in events:
            if isinstance(e, UsageEvent):
                self._reported = self._reported.merge(e.usage)
        billed = metrics_usage(data.get("amazon-bedrock-invocationMetrics") if isinstance(data, dict) else None)
        if billed is not None:
            if _disagree(self._reported, billed):
                self._notes.append("usage_disagrees:billed_invocation_metrics")
            events.append(UsageEvent(billed))
        return events

    def notes(self) -> list[str]:
        out, self._notes = self._notes, []
        return out


class BedrockAnswer(Answer):
    """A Bedrock call's answer: streams in event-stream frames, a whole InvokeModel answer
    metered by its token-count headers."""

    __slots__ = ("_chunks", "_meter")

    def __init__(self, roles: Roles, call: Call, hooks: Hooks, events: Events,
                 chunks: InvokeChunks | None) -> None:
        super().__init__(roles, call, hooks, events)
        self._chunks = chunks
        self._meter: Usage | None = None

    def stream(self) -> EventStreamRelay:
        chunks = self._chunks
        at_end = self._check_output if self.hooks.check_unrewritten is not None else None
        return EventStreamRelay(self.events, self._observer, self.hooks, chunks.notes if chunks else None, at_end)

    def _check_output(self) -> None:
        """A streamed answer is relayed as it came (its frames are not re-encoded): when its
        declared output would have needed a repair, or fails its schema, the span says so."""
        check, observer = self.hooks.check_unrewritten, self._observer
        if check is not None:
            note = check(observer.text(), observer.tool_calls())
            if note is not None:
                observer.note(note)

    def read_headers(self, headers: Mapping[str, str]) -> None:
        self._meter = header_usage(headers)

    def body(self, raw: bytes) -> bytes:
        out = super().body(raw)
        meter = self._meter
        if meter is not None:
            if _disagree(self._observer.usage, meter):
                self._observer.note("usage_disagrees:billed_token_count_headers")
            self._observer.feed([UsageEvent(meter)])
        return out


class BedrockTranslator(CallTranslator):
    """One Bedrock call: the API object of its route and model family; its answer a
    `BedrockAnswer`, which reads an InvokeModel stream's chunks with the family's reader."""

    __slots__ = ("_chunk",)

    def __init__(self, api: HasRoles, request: Exchange, chunk: ChunkReader | None) -> None:
        super().__init__(api, request)
        self._chunk = chunk

    def answer(self, hooks: Hooks) -> Answer:
        roles = self._roles
        chunks = InvokeChunks(self._chunk) if self._chunk is not None else None
        return BedrockAnswer(roles, self.request.call, hooks, chunks or roles.answers, chunks)


def _open(api: HasRoles, raw: bytes, path: str) -> Translator:
    chunk = getattr(api, "chunk", None) if api.roles.api == "invoke" else None
    return BedrockTranslator(api, open_exchange(api, raw, path), chunk)


class ConverseApi(_Bedrock, ConverseFormat):
    """The Converse routes."""

    def open(self, raw: bytes, path: str) -> Translator:
        return _open(self, raw, path)


class InvokeApi(_Bedrock):
    """The InvokeModel routes: each call opened with the dialect of its model's family."""

    api = "invoke"

    def open(self, raw: bytes, path: str) -> Translator:
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            body = None
        model = model_of_path(path) or ""
        family = family_of(model, body) if isinstance(body, dict) else _OTHER
        if family == "anthropic":
            return _open(_ANTHROPIC, raw, path)
        if family == "nova":
            return _open(_NOVA, raw, path)
        assert isinstance(family, Family)
        return _open(_TEXT[family], raw, path)


CONVERSE_API: Final = ConverseApi()
INVOKE_API: Final = InvokeApi()


def bedrock_route(path: str) -> ConverseApi | InvokeApi | None:
    """The API of a Bedrock model-call path, or None when the path is not exactly one."""
    m = PATH.fullmatch(path)
    if m is None or not arn_or_plain(m["model"]):
        return None
    return CONVERSE_API if m["action"].startswith("converse") else INVOKE_API
