"""OpenAI Chat Completions: `POST /v1/chat/completions`, streaming and not."""

from __future__ import annotations

import hashlib
import math
import re
from decimal import Decimal
from typing import Any, Final

import orjson

from proxy.errors import CeilingReached, LoopRefused, ProxyError, RateLimited, Refusal, RequestError
from proxy.model import (
    NO_BYTE_FACTS,
    ByteFacts,
    Call,
    Finish,
    InputPart,
    MetaEvent,
    Outcome,
    OutputSpec,
    Rewrite,
    StreamError,
    StreamEvent,
    TextDelta,
    ToolCallDelta,
    ToolResult,
    ToolSpec,
    Usage,
    UsageEvent,
)
from proxy.providers.answer import (
    ArgumentSlot,
    EventRewrite,
    Json,
    Slot,
    StreamEdits,
    answer_and_feedback,
    append_turns,
    dicts,
    first,
)
from proxy.providers.base import (
    MAX_OUTPUT_MULTIPLIER,
    MAX_TOKENS_LIMIT,
    Exchange,
    History,
    HistoryCall,
    TextShape,
    count_field,
    joined_results,
    number,
    open_exchange,
    text_of,
    vocabulary,
)
from proxy.providers.base import array as _list
from proxy.providers.base import integer as _int
from proxy.providers.cache import CacheScope
from proxy.providers.chat_stream import USAGE_DROPPED, ChatStreamRepair, drop_usage_chunk
from proxy.providers.hooks import Hooks, recorded_when_done
from proxy.providers.parts import Messages, arguments, call_part, response_part, text_part
from proxy.providers.sizes import json_size, size_of
from proxy.providers.sse import SseEvent
from proxy.providers.translator import Answer, CallTranslator, Opens, Translator

__all__ = ["CHAT", "OPENAI_HOSTS", "ChatAdapter", "OpenAIFamily", "openai_cache_key", "openai_error_body",
           "openai_error_type", "openai_stream_error", "openai_usage"]


def _tools(raw: Any) -> tuple[ToolSpec, ...]:
    out = []
    for t in raw if isinstance(raw, list) else ():
        fn = t.get("function") if isinstance(t, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            params = fn.get("parameters")
            out.append(ToolSpec(fn["name"], fn.get("description"),
                                params if isinstance(params, dict) else None))
    return tuple(out)


def _output(body: dict[str, Any], tools: tuple[ToolSpec, ...]) -> OutputSpec | None:
    fmt = body.get("response_format")
    if isinstance(fmt, dict):
        if fmt.get("type") == "json_schema" and isinstance(fmt.get("json_schema"), dict):
            js = fmt["json_schema"]
            schema = js.get("schema")
            return OutputSpec("json_schema", schema if isinstance(schema, dict) else None,
                              js.get("name"), bool(js.get("strict")))
        if fmt.get("type") == "json_object":
            return OutputSpec("json_object")
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        spec = next((t for t in tools if t.name == name), None)
        if spec is not None:
            return OutputSpec("tool", spec.parameters, spec.name)
    return None


def _call_names(message: dict[str, Any]) -> dict[str, str]:
    names = {}
    for tc in _list(message.get("tool_calls")):
        fn = tc.get("function") if isinstance(tc, dict) else None
        if isinstance(fn, dict) and isinstance(tc.get("id"), str):
            names[tc["id"]] = str(fn.get("name") or "")
    return names


def _tool_results(messages: list[Any]) -> tuple[ToolResult, ...]:
    # Every tool message, joined by id (joined_results): an agent framework may add turns
    # of its own after the model's (an assistant note, its own tool call and result when it
    # loads tools on demand), so a call may be answered before the last turn with calls.
    # Those after that turn are the new ones. Tool messages rarely carry a name: it comes
    # from the assistant's tool call of that id.
    results: list[ToolResult] = []
    names: dict[str, str] = {}
    new_from = 0
    for m in messages:
        if not isinstance(m, dict):
            continue
        if m.get("role") == "assistant":
            called = _call_names(m)
            if called:
                names |= called
                new_from = len(results)
        elif m.get("role") == "tool" and isinstance(m.get("tool_call_id"), str):
            content = m.get("content")
            text = content if isinstance(content, str) else text_of(content)
            call_id = m["tool_call_id"]
            name = m.get("name") if isinstance(m.get("name"), str) else None
            results.append(ToolResult(call_id, text, name or names.get(call_id)))
    return joined_results(results, new_from)


def _history(messages: list[Any]) -> list[HistoryCall]:
    h = History()
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            continue
        if m.get("role") == "assistant":
            h.turn()
            for tc in _list(m.get("tool_calls")):
                fn = tc.get("function") if isinstance(tc, dict) else None
                if isinstance(fn, dict) and isinstance(tc.get("id"), str):
                    args = fn.get("arguments")
                    h.call(tc["id"], str(fn.get("name") or ""),
                           args if isinstance(args, str) else orjson.dumps(args).decode())
        elif m.get("role") == "tool" and isinstance(m.get("tool_call_id"), str):
            h.result(m["tool_call_id"], ("messages", i, "content"))
    return h.calls()


def _input_parts(body: dict[str, Any]) -> list[InputPart]:
    """Tool definitions first (the provider renders them ahead of the conversation, in its
    cached prefix), then the messages in order: system and developer messages as
    instructions, tool messages as results, the rest as earlier conversation up to the
    model's last turn and as this turn's new content after it."""
    parts = [("tools", json_size(t), _tool_name(t), "") for t in _list(body.get("tools"))]
    names: dict[str, str] = {}
    latest = len(parts)  # where the parts after the model's last turn begin
    for m in _list(body.get("messages")):
        if not isinstance(m, dict):
            continue
        role = m.get("role")
        if role == "tool":
            cid = m.get("tool_call_id")
            cid = cid if isinstance(cid, str) else ""
            parts.append(("tool_result", size_of(m.get("content")), names.get(cid, ""), cid))
        elif role == "assistant":
            size = size_of(m.get("content"))
            for tc in _list(m.get("tool_calls")):
                fn = tc.get("function") if isinstance(tc, dict) else None
                if isinstance(fn, dict):
                    name = str(fn.get("name") or "")
                    names[str(tc.get("id"))] = name
                    size += len(name) + size_of(fn.get("arguments"))
            parts.append(("history", size, "", ""))
            latest = len(parts)
        elif role in ("system", "developer"):
            parts.append(("system", size_of(m.get("content")), "", ""))
        else:
            parts.append(("new", size_of(m.get("content")), "", ""))
    # Messages the model has answered are earlier conversation, not this turn's.
    for i in range(latest):
        if parts[i][0] == "new":
            parts[i] = ("history", *parts[i][1:])
    return parts


def _tool_name(tool: Any) -> str:
    fn = tool.get("function") if isinstance(tool, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else tool.get("type") if isinstance(tool, dict) else None
    return name if isinstance(name, str) else ""


def _stops(stop: Any) -> tuple[str, ...]:
    if isinstance(stop, str):
        return (stop,)
    return tuple(s for s in stop if isinstance(s, str)) if isinstance(stop, list) else ()


# OpenAI's reasoning and newer chat models refuse `max_tokens` and take
# `max_completion_tokens`; OpenAI-compatible servers (vLLM, llama.cpp, Ollama) know only
# `max_tokens`. A field the request already uses is kept whatever the model.
_COMPLETION_TOKENS_MODELS = re.compile(r"^(?:o\d|gpt-4\.1|gpt-4o|gpt-5|chatgpt-|codex-|computer-use-)")


def _max_tokens(body: dict[str, Any], model: str | None) -> tuple[int | None, str]:
    """(the bound on each answer's output, the field a clamp writes)."""
    what = "the most tokens each answer may have"
    new = count_field("max_completion_tokens", body.get("max_completion_tokens"), upper=MAX_TOKENS_LIMIT, what=what)
    old = count_field("max_tokens", body.get("max_tokens"), upper=MAX_TOKENS_LIMIT, what=what)
    # Both set: which one a server honours differs, so the larger bounds the call.
    bound = max(new or 0, old or 0) or None
    if "max_completion_tokens" in body:
        return bound, "max_completion_tokens"
    if "max_tokens" in body:
        return bound, "max_tokens"
    family = model is not None and _COMPLETION_TOKENS_MODELS.match(model) is not None
    return bound, "max_completion_tokens" if family else "max_tokens"


def _error(err: dict[str, Any]) -> StreamError:
    return StreamError(str(err.get("type") or err.get("code") or "error"),
                       str(err.get("message") or ""))


def openai_usage(u: Any, service_tier: Any = None) -> Usage:
    """`usage`, and the `service_tier` the response (not the usage object) says it ran at."""
    if not isinstance(u, dict):
        return Usage()
    pd = u.get("prompt_tokens_details") or u.get("input_tokens_details") or {}
    cd = u.get("completion_tokens_details") or u.get("output_tokens_details") or {}
    read = _int(pd.get("cached_tokens")) if isinstance(pd, dict) else None
    if read is None:
        # OpenAI-compatible hosts' own spellings: DeepSeek's prompt_cache_hit_tokens,
        # Together's top-level cached_tokens.
        read = _int(u.get("prompt_cache_hit_tokens", u.get("cached_tokens")))
    return Usage(
        input_tokens=_int(u.get("prompt_tokens", u.get("input_tokens"))),
        output_tokens=_int(u.get("completion_tokens", u.get("output_tokens"))),
        cache_read_tokens=read,
        reasoning_tokens=_int(cd.get("reasoning_tokens")) if isinstance(cd, dict) else None,
        service_tier=service_tier if isinstance(service_tier, str) else None,
        billed_micros=_billed(u.get("cost")),
    )


def _billed(cost: Any) -> int | None:
    """OpenRouter's `usage.cost`, USD as a JSON number, in micro-USD rounded up (as every
    charge is); anything else (absent, text, negative) is not a bill."""
    if isinstance(cost, bool) or not isinstance(cost, int | float) or not 0 <= cost < 1e6:
        return None
    return math.ceil(Decimal(repr(cost)) * 1_000_000)


def _usage_of(chunk: dict[str, Any]) -> Any:
    """A chunk's usage: `usage`, or Groq's `x_groq.usage` on its last chunk."""
    u = chunk.get("usage")
    if u:
        return u
    xg = chunk.get("x_groq")
    return xg.get("usage") if isinstance(xg, dict) else None


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _choice_events(choice: dict[str, Any], message: Any, *, complete: bool) -> list[StreamEvent]:
    """Text, tool calls and finish of one choice: a whole `message` or a stream `delta`.

    Only choice 0's text and tool calls are kept (n > 1 is rare and would mix answers);
    every choice's finish reason is.
    """
    idx = _int(choice.get("index")) or 0
    msg = message if isinstance(message, dict) else {}
    events: list[StreamEvent] = []
    content = msg.get("content")
    if idx == 0 and isinstance(content, str) and content:
        events.append(TextDelta(content, idx))
    calls = msg.get("tool_calls") if idx == 0 else None
    for i, tc in enumerate(calls if isinstance(calls, list) else ()):
        if not isinstance(tc, dict):
            continue
        fn: dict[str, Any] = tc["function"] if isinstance(tc.get("function"), dict) else {}
        # Stream fragments name their slot by `index`; a whole message by position.
        slot = i if complete else (_int(tc.get("index")) or 0)
        events.append(ToolCallDelta(slot, _text(tc.get("id")), _text(fn.get("name")),
                                    str(fn.get("arguments") or ""), complete))
    if isinstance(choice.get("finish_reason"), str):
        events.append(Finish(choice["finish_reason"], idx))
    return events


def _input_messages(body: Json) -> Messages:
    out = []
    for m in body.get("messages") or ():
        if not isinstance(m, dict):
            continue
        parts = [text_part(text_of(m.get("content")))] if m.get("content") else []
        for tc in m.get("tool_calls") or ():
            fn = tc.get("function") or {}
            parts.append(call_part(tc.get("id"), fn.get("name"), arguments(fn.get("arguments"))))
        if m.get("role") == "tool":
            parts = [response_part(m.get("tool_call_id"), text_of(m.get("content")))]
        out.append({"role": m.get("role"), "parts": parts})
    return "", out


def _answer(body: Json) -> Any:
    """The message of choice 0 of a whole answer."""
    return first(body.get("choices"), "message")


# spanmeter's errors in OpenAI's `error.type` words (the SDKs raise by status; the type is shown).
_OPENAI_TYPES: Final[dict[type[ProxyError], str]] = {
    ProxyError: "server_error",
    RequestError: "invalid_request_error",
    Refusal: "spanmeter_refusal",
    CeilingReached: "budget_exceeded",
    LoopRefused: "loop_detected",
    RateLimited: "rate_limit_exceeded",
}


def openai_error_type(error: ProxyError) -> str:
    return vocabulary(error, _OPENAI_TYPES)


def openai_error_body(error: ProxyError) -> bytes:
    return orjson.dumps({"error": {"message": error.message, "type": openai_error_type(error),
                                   "code": error.code, "param": error.param}})


def openai_stream_error(error: ProxyError) -> bytes:
    # A data line with a top-level "error" makes the openai SDK raise APIError(message).
    return b"data: " + openai_error_body(error) + b"\n\n"


# OpenAI's own API only: an OpenAI-compatible server may refuse a field it does not know.
OPENAI_HOSTS: Final = frozenset({"api.openai.com"})


def openai_cache_key(ex: Exchange, tenant: str, run_id: str, agent: str | None) -> list[Rewrite]:
    """A `prompt_cache_key` stable for the run (or the agent, when it names itself), so the
    run's calls land on the same cache; a client's own key is kept. Hashed: neither the
    tenant nor the run id leaves as itself."""
    if "prompt_cache_key" in ex.body:
        return []
    scope = f"agent:{agent}" if agent else f"run:{run_id}"
    key = "sm-" + hashlib.sha256(f"{tenant}\0{scope}".encode()).hexdigest()[:32]
    ex.splicer.set_top("prompt_cache_key", key)
    return [Rewrite("prompt_cache_key", "agent" if agent else "run")]


class OpenAIFamily(Opens):
    """What OpenAI's APIs share: their upstream and key, their error shapes, the prompt cache key."""

    cache_key = False  # the API takes `prompt_cache_key` (chat and responses)

    family = "openai"
    provider = "openai"
    upstream_setting = "openai_base_url"
    names_deployment = False
    cache_marker: str | None = None  # automatic prompt caching bills no write premium
    text_shape: TextShape | None = None

    def render_error(self, error: ProxyError, request_id: str) -> bytes:
        return openai_error_body(error)

    def render_stream_error(self, error: ProxyError) -> bytes:
        return openai_stream_error(error)

    def auth_headers(self, key: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"}

    def cache_points(self, ex: Exchange, scope: CacheScope) -> list[Rewrite]:
        if not self.cache_key or scope.server_address not in OPENAI_HOSTS:
            return []
        caller = scope.caller
        return openai_cache_key(ex, caller.tenant, caller.run_id, caller.agent_name)


def _plain_chunk(event: SseEvent) -> bool:
    """One choice whose delta is its text alone, unfinished: what ChatStreamRepair passes."""
    chunk = event.json()
    choices = chunk.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return False
    delta = choices[0].get("delta")
    return isinstance(delta, dict) and "tool_calls" not in delta and choices[0].get("finish_reason") is None


class ChatAdapter(OpenAIFamily):
    api = "chat"
    conversation: str | None = "messages"
    cache_key = True
    text_part = "text"
    # `obfuscation` pads each chunk to a random length (include_obfuscation, on by default).
    text_shape: TextShape | None = TextShape(b'"content":', _plain_chunk, ignored=(b'"obfuscation":',))

    def parse_request(self, body: dict[str, Any], path: str, facts: ByteFacts = NO_BYTE_FACTS) -> Call:
        messages = body.get("messages")
        messages = messages if isinstance(messages, list) else []
        tools = _tools(body.get("tools"))
        stop = body.get("stop")
        model = body.get("model") if isinstance(body.get("model"), str) else None
        max_out, field = _max_tokens(body, model)
        n = count_field("n", body.get("n"), upper=MAX_OUTPUT_MULTIPLIER, what="how many answers to generate")
        return Call(
            api="chat",
            body_bytes=facts.body_bytes,
            cache_write=facts.cache_write,
            operation="chat",
            openai_api_type="chat_completions",
            model=model,
            stream=body.get("stream") is True,
            max_output_tokens=max_out,
            service_tier=_text(body.get("service_tier")),
            max_tokens_field=field,
            output_multiplier=n or 1,
            tools=tools,
            tool_results=_tool_results(messages),
            output=_output(body, tools),
            temperature=number(body.get("temperature")),
            top_p=number(body.get("top_p")),
            seed=_int(body.get("seed")),
            choice_count=n,
            stop_sequences=_stops(stop),
            frequency_penalty=number(body.get("frequency_penalty")),
            presence_penalty=number(body.get("presence_penalty")),
        )

    def open(self, raw: bytes, path: str) -> Translator:
        request = open_exchange(self, raw, path)
        return _ChatCall(self, request, asked_usage=_asks_usage(request.body))

    def prepare(self, ex: Exchange) -> list[Rewrite]:
        so = ex.body.get("stream_options")
        if not ex.call.stream or _asks_usage(ex.body):
            return []
        # Without it a chat stream never reports usage, and unknown usage can only be
        # settled at the reservation. The usage-only chunk is dropped on the way back.
        ex.splicer.set_top("stream_options", {**(so if isinstance(so, dict) else {}), "include_usage": True})
        return [Rewrite("include_usage", "injected")]

    def set_max_tokens(self, ex: Exchange, value: int) -> None:
        # A request with both fields: which one a server honours differs, so both get it.
        both = [f for f in ("max_completion_tokens", "max_tokens") if f in ex.body]
        for field in both if len(both) == 2 else [ex.call.max_tokens_field]:
            ex.splicer.set_top(field, value)

    def tool_result_slots(self, body: dict[str, Any], call_id: str) -> list[tuple[dict[str, Any], str]]:
        return [(m, "content") for m in _list(body.get("messages"))
                if isinstance(m, dict) and m.get("role") == "tool" and m.get("tool_call_id") == call_id]

    def append_note(self, ex: Exchange, text: str) -> bool:
        """A new final user message (a system message would move up front and break the cache)."""
        return ex.splicer.append_item(("messages",), {"role": "user", "content": text})

    def tool_history(self, body: dict[str, Any]) -> list[HistoryCall]:
        return _history(_list(body.get("messages")))

    def stored_sizes(self, call: Call, outcome: Outcome) -> dict[str, int]:
        return {}  # no context is stored by this API

    def input_parts(self, body: dict[str, Any]) -> list[InputPart]:
        return _input_parts(body)

    def parse_response(self, body: Any) -> list[StreamEvent]:
        if not isinstance(body, dict):
            return []
        events: list[StreamEvent] = [MetaEvent(_text(body.get("id")), _text(body.get("model")))]
        for ch in _list(body.get("choices")):
            if isinstance(ch, dict):
                events += _choice_events(ch, ch.get("message"), complete=True)
        if "usage" in body:
            events.append(UsageEvent(openai_usage(body["usage"], body.get("service_tier"))))
        if isinstance(body.get("error"), dict):
            events.append(_error(body["error"]))
        return events

    def parse_event(self, event: SseEvent) -> list[StreamEvent]:
        data = event.data
        if not data or data == "[DONE]":
            return []
        chunk = event.json()
        if not isinstance(chunk, dict):
            return []
        events: list[StreamEvent] = []
        if "id" in chunk or "model" in chunk:
            events.append(MetaEvent(_text(chunk.get("id")), _text(chunk.get("model"))))
        for ch in _list(chunk.get("choices")):
            if isinstance(ch, dict):
                events += _choice_events(ch, ch.get("delta"), complete=False)
        u = _usage_of(chunk)
        if u:
            events.append(UsageEvent(openai_usage(u, chunk.get("service_tier"))))
        if isinstance(chunk.get("error"), dict):
            events.append(_error(chunk["error"]))
        return events

    def text_slots(self, body: Json) -> list[Slot]:
        msg = _answer(body)
        return [Slot(msg, "content")] if isinstance(msg, dict) and isinstance(msg.get("content"), str) else []

    def argument_slots(self, body: Json) -> list[ArgumentSlot]:
        msg = _answer(body)
        return [ArgumentSlot(tc["function"], "arguments", str(tc.get("id")), tc["function"].get("name"))
                for tc in dicts(msg.get("tool_calls") if isinstance(msg, dict) else None)
                if isinstance(tc.get("function"), dict)]

    def stream_rewriter(self, edits: StreamEdits) -> EventRewrite | None:
        return ChatStreamRepair(edits)

    def retry_body(self, body: Json, answer: str, feedback: str) -> Json:
        return append_turns(body, "messages", *answer_and_feedback(answer, feedback))

    def input_messages(self, body: Json) -> Messages:
        return _input_messages(body)


def _asks_usage(body: Json) -> bool:
    """Whether the request asks for the stream's usage (`stream_options.include_usage`)."""
    so = body.get("stream_options")
    return isinstance(so, dict) and so.get("include_usage") is True


class _ChatCall(CallTranslator):
    """A chat call, and whether its client asked for the stream's usage itself: read when the
    call is opened, before `prepare` asks for it on the client's behalf."""

    __slots__ = ("_asked_usage",)

    def __init__(self, api: ChatAdapter, request: Exchange, *, asked_usage: bool) -> None:
        super().__init__(api, request)
        self._asked_usage = asked_usage

    def answer(self, hooks: Hooks) -> Answer:
        answer = super().answer(hooks)
        if self.call.stream and not self._asked_usage:
            # The usage chunk `prepare` asked for, which this client did not: it must not see it.
            hooks.on_event.append(recorded_when_done(drop_usage_chunk, USAGE_DROPPED, hooks))
        return answer


CHAT = ChatAdapter()
