"""Gemini: `POST /v1beta/models/{model}:generateContent` and `:streamGenerateContent`.

The model and the stream flag live in the path, not the body; every key is looked up in
both spellings (google-genai writes some in snake_case). A function call arrives whole
and becomes one complete `ToolCallDelta`; a call without an `id` gets a name-based one
(`name`, `name#2`, ... in part order), the same rule for a model turn's calls and the
next turn's responses, so a call and its result match.
The rest of its wire format and why: docs/internals.md, "Gemini".
"""

from __future__ import annotations

import functools
import re
from typing import Any, Final

import orjson

from proxy.errors import (
    BodyTimeout,
    LoopRefused,
    ProxyError,
    Refusal,
    RequestError,
    StoreUnavailable,
    Unauthorized,
    UnknownRoute,
    UpstreamConnectError,
    UpstreamTimeout,
)
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
from proxy.providers.answer import ArgumentSlot, EventRewrite, Json, Slot, StreamEdits, append_turns, dicts, first
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
from proxy.providers.base import string as _str
from proxy.providers.cache import CacheScope
from proxy.providers.gemini_stream import GeminiStreamRepair
from proxy.providers.hooks import Hooks
from proxy.providers.parts import Messages, call_part, response_part, text_part
from proxy.providers.sizes import json_size, size_of
from proxy.providers.sse import SseEvent
from proxy.providers.translator import Answer, CallTranslator, Opens, Translator

__all__ = ["GEMINI", "GeminiAdapter", "gemini_error_body", "gemini_usage", "json_schema_of"]

_PATH = re.compile(r"/models/(?P<model>[^/:]+):(?P<action>[A-Za-z]+)")
_SNAKE = re.compile(r"(?<!^)(?=[A-Z])")


def _get(d: Any, camel: str) -> Any:
    """d[camel], or d[snake_case of camel]: google-genai sends either."""
    if not isinstance(d, dict):
        return None
    if camel in d:
        return d[camel]
    return d.get(_snake(camel))


@functools.cache  # the callers name a few dozen fields, all literals of this module
def _snake(camel: str) -> str:
    return _SNAKE.sub("_", camel).lower()


def gemini_usage(u: Any) -> Usage:
    if not isinstance(u, dict):
        return Usage()
    prompt = _int(_get(u, "promptTokenCount"))
    tool_prompt = _int(_get(u, "toolUsePromptTokenCount"))
    candidates = _int(_get(u, "candidatesTokenCount"))
    thoughts = _int(_get(u, "thoughtsTokenCount"))
    return Usage(
        input_tokens=None if prompt is None else prompt + (tool_prompt or 0),
        output_tokens=None if candidates is None and thoughts is None
        else (candidates or 0) + (thoughts or 0),
        cache_read_tokens=_int(_get(u, "cachedContentTokenCount")),
        reasoning_tokens=thoughts,
    )


# OpenAPI-subset schema (responseSchema, `parameters`) -> JSON Schema, so that repair
# can validate against it: upper-case types, `nullable`, `propertyOrdering`.
def json_schema_of(schema: Any) -> Any:
    if isinstance(schema, list):
        return [json_schema_of(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in ("propertyOrdering", "property_ordering", "nullable"):
            continue
        if key == "type" and isinstance(value, str):
            out["type"] = value.lower()
        elif key in ("properties", "$defs", "definitions") and isinstance(value, dict):
            out[key] = {k: json_schema_of(v) for k, v in value.items()}
        elif key in ("items", "anyOf", "oneOf", "allOf", "not", "additionalProperties"):
            out[key] = json_schema_of(value)
        elif key == "any_of":
            out["anyOf"] = json_schema_of(value)
        else:
            out[key] = value
    if schema.get("nullable") is True and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    return out


def _declarations(tools: Any) -> list[dict[str, Any]]:
    return [d for t in _list(tools) for d in _list(_get(t, "functionDeclarations"))
            if isinstance(d, dict) and isinstance(d.get("name"), str)]


def _tool_spec(decl: dict[str, Any]) -> ToolSpec:
    schema = _get(decl, "parametersJsonSchema")
    if not isinstance(schema, dict):
        params = decl.get("parameters")
        schema = json_schema_of(params) if isinstance(params, dict) else None
    return ToolSpec(decl["name"], _str(decl.get("description")), schema)


def _output(body: dict[str, Any], tools: tuple[ToolSpec, ...]) -> OutputSpec | None:
    config = _get(body, "generationConfig")
    if _get(config, "responseMimeType") == "application/json":
        plain = _get(config, "responseJsonSchema")
        if isinstance(plain, dict):
            return OutputSpec("json_schema", plain)
        openapi = _get(config, "responseSchema")
        if isinstance(openapi, dict):
            return OutputSpec("json_schema", json_schema_of(openapi))
        return OutputSpec("json_object")
    fcc = _get(_get(body, "toolConfig"), "functionCallingConfig")
    if _get(fcc, "mode") == "ANY":
        allowed = [n for n in _list(_get(fcc, "allowedFunctionNames")) if isinstance(n, str)]
        names = allowed or [t.name for t in tools]
        if len(names) == 1:
            tool = next((t for t in tools if t.name == names[0]), None)
            if tool is not None:
                return OutputSpec("tool", tool.parameters, tool.name)
    return None


def _name_ids(parts: list[Any], key: str, seen: dict[str, int] | None = None) -> list[tuple[dict[str, Any], str]]:
    """(call-or-response, id) for each `key` part, ids per the module docstring; `seen` counts
    the names of the turn's earlier parts (a stream's earlier chunks)."""
    seen = {} if seen is None else seen
    out = []
    for part in parts:
        item = _get(part, key)
        if not isinstance(item, dict):
            continue
        name = str(item.get("name") or "")
        seen[name] = seen.get(name, 0) + 1
        given = item.get("id")
        out.append((item, given if isinstance(given, str) and given else
                    name if seen[name] == 1 else f"{name}#{seen[name]}"))
    return out


def _tool_results(contents: list[Any]) -> tuple[ToolResult, ...]:
    # Every result, joined by id wherever it stands (joined_results): an agent framework
    # may write its own model turn with a call and its result after the model's (tools
    # loaded on demand). Only a turn that calls functions makes the results before it old.
    # An id made from the function's name is reused when a later turn calls that function
    # again: the older result then answers the older call only, and is dropped.
    results: list[ToolResult] = []
    given: set[str] = set()  # ids the model gave, not made from a name
    new_from = 0
    for content in contents:
        if not isinstance(content, dict):
            continue
        if content.get("role") == "model":
            called = {cid for _, cid in _name_ids(_list(content.get("parts")), "functionCall")}
            if called:
                results = [r for r in results if r.call_id in given or r.call_id not in called]
                new_from = len(results)
            continue
        for resp, call_id in _name_ids(_list(content.get("parts")), "functionResponse"):
            payload = resp.get("response")
            text = orjson.dumps(payload).decode() if payload is not None else ""
            if _str(resp.get("id")):
                given.add(call_id)
            results.append(ToolResult(call_id, text, _str(resp.get("name"))))
    return joined_results(results, new_from)


def _input_parts(body: dict[str, Any]) -> list[InputPart]:
    """Tool declarations, the system instruction, then each content's parts:
    functionResponse parts as results, the rest as earlier conversation up to the model's
    last turn and as this turn's new content after it."""
    parts = []
    for tool in _list(body.get("tools")):
        decls = _get(tool, "functionDeclarations")
        if isinstance(decls, list):
            parts += [("tools", json_size(d), str(_get(d, "name") or ""), "") for d in decls]
        elif isinstance(tool, dict):  # a built-in tool (googleSearch, codeExecution): by its key
            parts += [("tools", json_size(v), k, "") for k, v in tool.items()]
    si = _get(body, "systemInstruction")
    if si is not None:
        parts.append(("system", size_of(_get(si, "parts") if isinstance(si, dict) else si), "", ""))
    contents = _list(body.get("contents"))
    last = max((i for i, c in enumerate(contents) if isinstance(c, dict) and c.get("role") == "model"), default=-1)
    for i, content in enumerate(contents):
        if not isinstance(content, dict):
            continue
        items = _list(content.get("parts"))
        results = {id(r): cid for r, cid in _name_ids(items, "functionResponse")}
        size = 0
        for p in items:
            resp = _get(p, "functionResponse")
            if isinstance(resp, dict) and id(resp) in results:
                parts.append(("tool_result", json_size(resp.get("response")), str(resp.get("name") or ""),
                              results[id(resp)]))
            elif isinstance(call := _get(p, "functionCall"), dict):
                size += len(str(call.get("name") or "")) + json_size(call.get("args"))
            else:
                size += size_of([p])
        if size or not items:
            parts.append(("history" if i <= last else "new", size, "", ""))
    return parts


def _part_key(part: Any, camel: str) -> str | None:
    """The key `part` spells `camel` with (camelCase or snake_case), if it has it."""
    if not isinstance(part, dict):
        return None
    snake = _SNAKE.sub("_", camel).lower()
    return camel if isinstance(part.get(camel), dict) else snake if isinstance(part.get(snake), dict) else None


def _history(contents: list[Any]) -> list[HistoryCall]:
    # Ids per the module docstring: given, or name-based within one turn, so results are
    # matched only to the calls of the model turn before them.
    h = History()
    for i, content in enumerate(contents):
        if not isinstance(content, dict):
            continue
        parts = _list(content.get("parts"))
        if content.get("role") == "model":
            h.turn(scoped_ids=True)
            for call, call_id in _name_ids(parts, "functionCall"):
                h.call(call_id, str(call.get("name") or ""), orjson.dumps(call.get("args") or {}).decode())
            continue
        seen: dict[str, int] = {}
        for j, part in enumerate(parts):
            key = _part_key(part, "functionResponse")
            if key is None:
                continue
            resp = part[key]
            name = str(resp.get("name") or "")
            seen[name] = seen.get(name, 0) + 1
            given = resp.get("id")
            call_id = given if isinstance(given, str) and given else name if seen[name] == 1 else f"{name}#{seen[name]}"
            h.result(call_id, ("contents", i, "parts", j, key, "response"))
    return h.calls()


def _stops(config: Any) -> tuple[str, ...]:
    return tuple(s for s in _list(_get(config, "stopSequences")) if isinstance(s, str))


def _is_answer_text(part: Any) -> bool:
    return isinstance(part, dict) and isinstance(part.get("text"), str) and not part.get("thought")


class _Turn:
    """The tool calls of one answer's model turn read so far: how many, and each name's count."""

    __slots__ = ("calls", "names")

    def __init__(self) -> None:
        self.calls = 0
        self.names: dict[str, int] = {}


def _candidate_events(index: int, candidate: dict[str, Any], turn: _Turn) -> list[StreamEvent]:
    events: list[StreamEvent] = []
    parts = _list(_get(candidate.get("content"), "parts"))
    # Thought summaries are not the answer; only candidate 0's text and calls are kept,
    # as in chat.
    if index == 0:
        events += [TextDelta(p["text"]) for p in parts if _is_answer_text(p)]
        for call, call_id in _name_ids(parts, "functionCall", turn.names):
            args = orjson.dumps(call.get("args") or {}).decode()
            events.append(ToolCallDelta(turn.calls, call_id, _str(call.get("name")), args, complete=True))
            turn.calls += 1
    reason = _get(candidate, "finishReason")
    if isinstance(reason, str):
        events.append(Finish(reason, index))
    return events


def _chunk_events(chunk: Any, turn: _Turn) -> list[StreamEvent]:
    if not isinstance(chunk, dict):
        return []
    if isinstance(chunk.get("error"), dict):
        err = chunk["error"]
        return [StreamError(str(err.get("status") or err.get("code") or "error"),
                            str(err.get("message") or ""))]
    events: list[StreamEvent] = []
    rid, version = _str(_get(chunk, "responseId")), _str(_get(chunk, "modelVersion"))
    if rid or version:
        events.append(MetaEvent(rid, version))
    for i, cand in enumerate(_list(chunk.get("candidates"))):
        if isinstance(cand, dict):
            events += _candidate_events(_int(cand.get("index")) or i, cand, turn)
    usage = _get(chunk, "usageMetadata")
    if isinstance(usage, dict):
        events.append(UsageEvent(gemini_usage(usage)))
    return events


def _part(p: Json) -> Json | None:
    if isinstance(p.get("text"), str):
        return text_part(p["text"])
    if isinstance(fc := p.get("functionCall"), dict):
        return call_part(fc.get("id"), fc.get("name"), fc.get("args"))
    if isinstance(fr := p.get("functionResponse"), dict):
        return response_part(fr.get("id") or fr.get("name"), fr.get("response"))
    return None


def _input_messages(body: Json) -> Messages:
    out = []
    for c in dicts(body.get("contents")):
        parts = [part for p in dicts(c.get("parts")) if (part := _part(p)) is not None]
        out.append({"role": "assistant" if c.get("role") == "model" else c.get("role", "user"), "parts": parts})
    si = body.get("systemInstruction") or body.get("system_instruction")
    return text_of(si.get("parts")) if isinstance(si, dict) else "", out


def _answer_parts(body: Json) -> list[Json]:
    """The parts of candidate 0 of a whole answer."""
    content = first(body.get("candidates"), "content")
    return dicts(content.get("parts") if isinstance(content, dict) else None)


# spanmeter's errors in Google's canonical `status` words (google-genai raises by status code).
_GOOGLE_STATUSES: Final[dict[type[ProxyError], str]] = {
    ProxyError: "INTERNAL",
    RequestError: "INVALID_ARGUMENT",
    Unauthorized: "UNAUTHENTICATED",
    BodyTimeout: "DEADLINE_EXCEEDED",
    UnknownRoute: "NOT_FOUND",
    Refusal: "RESOURCE_EXHAUSTED",
    LoopRefused: "ABORTED",
    StoreUnavailable: "UNAVAILABLE",
    UpstreamConnectError: "UNAVAILABLE",
    UpstreamTimeout: "DEADLINE_EXCEEDED",
}


def google_status(error: ProxyError) -> str:
    return vocabulary(error, _GOOGLE_STATUSES)


def gemini_error_body(error: ProxyError, request_id: str) -> bytes:
    info = {"@type": "type.googleapis.com/google.rpc.ErrorInfo", "reason": error.code.upper(),
            "domain": "spanmeter", "metadata": {"request_id": request_id}}
    return orjson.dumps({"error": {"code": error.status, "message": error.message,
                                   "status": google_status(error), "details": [info]}})


def _plain_chunk(event: SseEvent) -> bool:
    return True  # GeminiStreamRepair reads no chunk while the text is not repaired


class GeminiAdapter(Opens):
    api = "gemini"
    conversation: str | None = "contents"
    family = "gemini"
    provider = "gcp.gemini"
    upstream_setting = "gemini_base_url"
    names_deployment = False
    text_part = "text"
    cache_marker: str | None = None
    # Every chunk repeats the running usage: a hole of its own, read per chunk.
    text_shape: TextShape | None = TextShape(b'"text":', _plain_chunk, usage=b'"usageMetadata":', usage_of=gemini_usage)

    def parse_request(self, body: dict[str, Any], path: str, facts: ByteFacts = NO_BYTE_FACTS) -> Call:
        m = _PATH.search(path)
        tools = tuple(_tool_spec(d) for d in _declarations(body.get("tools")))
        config = _get(body, "generationConfig")
        candidates = count_field("generationConfig.candidateCount", _get(config, "candidateCount"),
                                 upper=MAX_OUTPUT_MULTIPLIER, what="how many answers to generate")
        cached = _get(body, "cachedContent")
        return Call(
            api="gemini",
            body_bytes=facts.body_bytes,
            cache_write=facts.cache_write,
            operation="generate_content",
            model=m["model"] if m else None,
            stream=m is not None and m["action"] == "streamGenerateContent",
            max_output_tokens=count_field("generationConfig.maxOutputTokens", _get(config, "maxOutputTokens"),
                                          upper=MAX_TOKENS_LIMIT, what="the most tokens each answer may have"),
            max_tokens_field="generationConfig.maxOutputTokens",
            output_multiplier=candidates or 1,
            stored_context=(f"cached_content:{cached}",) if isinstance(cached, str) and cached else (),
            tools=tools,
            tool_results=_tool_results(_list(body.get("contents"))),
            output=_output(body, tools),
            temperature=number(_get(config, "temperature")),
            top_p=number(_get(config, "topP")),
            top_k=number(_get(config, "topK")),
            seed=_int(_get(config, "seed")),
            choice_count=candidates,
            stop_sequences=_stops(config),
            frequency_penalty=number(_get(config, "frequencyPenalty")),
            presence_penalty=number(_get(config, "presencePenalty")),
        )

    def open(self, raw: bytes, path: str) -> Translator:
        return _GeminiCall(self, open_exchange(self, raw, path))

    def prepare(self, ex: Exchange) -> list[Rewrite]:
        return []  # usageMetadata is always sent

    def set_max_tokens(self, ex: Exchange, value: int) -> None:
        body = ex.body
        key = "generation_config" if "generation_config" in body else "generationConfig"
        config = body.get(key)
        if not isinstance(config, dict):
            ex.splicer.set_top(key, {"maxOutputTokens": value})
            return
        config = {k: v for k, v in config.items() if k != "max_output_tokens"}
        config["maxOutputTokens"] = value
        ex.splicer.set_top(key, config)  # only the config's bytes change, never the conversation's

    def tool_result_slots(self, body: dict[str, Any], call_id: str) -> list[tuple[dict[str, Any], str]]:
        # Matched by id, or by the name-based id of the module docstring.
        return [(fr, "response") for c in _list(body.get("contents")) if isinstance(c, dict)
                for fr, rid in _name_ids(_list(c.get("parts")), "functionResponse") if call_id in (rid, fr.get("id"))]

    def append_note(self, ex: Exchange, text: str) -> bool:
        """A new final user content."""
        return ex.splicer.append_item(("contents",), {"role": "user", "parts": [{"text": text}]})

    def tool_history(self, body: dict[str, Any]) -> list[HistoryCall]:
        return _history(_list(body.get("contents")))

    def input_parts(self, body: dict[str, Any]) -> list[InputPart]:
        return _input_parts(body)

    def stored_sizes(self, call: Call, outcome: Outcome) -> dict[str, int]:
        """A cached content's size is the cached tokens the call reported reading."""
        cached = outcome.usage.cache_read_tokens
        if cached is None:
            return {}
        return {ref: cached for ref in call.stored_context if ref.startswith("cached_content:")}

    def parse_response(self, body: Any) -> list[StreamEvent]:
        # Without ?alt=sse, streamGenerateContent answers with a JSON array of chunks.
        chunks = body if isinstance(body, list) else [body]
        turn = _Turn()
        return [e for chunk in chunks for e in _chunk_events(chunk, turn)]

    def parse_event(self, event: SseEvent) -> list[StreamEvent]:
        """One chunk alone: its calls numbered from 0 (an answer's stream is read by `_AnswerEvents`)."""
        return _chunk_events(event.json(), _Turn()) if event.data else []

    def text_slots(self, body: Json) -> list[Slot]:
        return [Slot(p, "text") for p in _answer_parts(body) if isinstance(p.get("text"), str) and not p.get("thought")]

    def argument_slots(self, body: Json) -> list[ArgumentSlot]:
        return [ArgumentSlot(fc, "args", str(fc.get("id") or fc.get("name")), fc.get("name"))
                for p in _answer_parts(body) if isinstance(fc := p.get("functionCall"), dict)]

    def stream_rewriter(self, edits: StreamEdits) -> EventRewrite | None:
        return GeminiStreamRepair(edits)

    def retry_body(self, body: Json, answer: str, feedback: str) -> Json:
        return append_turns(body, "contents", {"role": "model", "parts": [{"text": answer}]},
                            {"role": "user", "parts": [{"text": feedback}]})

    def input_messages(self, body: Json) -> Messages:
        return _input_messages(body)

    def render_error(self, error: ProxyError, request_id: str) -> bytes:
        return gemini_error_body(error, request_id)

    def render_stream_error(self, error: ProxyError) -> bytes:
        # google-genai's stream parser wants exactly `data: `; CRLF framing as the real API.
        payload = {"error": {"code": error.status, "message": error.message,
                             "status": google_status(error)}}
        return b"data: " + orjson.dumps(payload) + b"\r\n\r\n"

    def cache_points(self, ex: Exchange, scope: CacheScope) -> list[Rewrite]:
        return []  # implicit caching by prefix; the explicit cache is a stored resource (govern/caching.py)

    def auth_headers(self, key: str) -> dict[str, str]:
        return {"x-goog-api-key": key}


class _AnswerEvents:
    """The reader of one answer: a stream's chunks read as one turn (the module docstring)."""

    __slots__ = ("_turn",)

    def __init__(self) -> None:
        self._turn = _Turn()

    def parse_response(self, body: Any) -> list[StreamEvent]:
        return GEMINI.parse_response(body)

    def parse_event(self, event: SseEvent) -> list[StreamEvent]:
        if not event.data:
            return []
        return _chunk_events(event.json(), self._turn)


class _GeminiCall(CallTranslator):
    """A Gemini call: each answer is read by a reader of its own (`_AnswerEvents`)."""

    __slots__ = ()

    def answer(self, hooks: Hooks) -> Answer:
        return Answer(self._roles, self.call, hooks, _AnswerEvents())


GEMINI = GeminiAdapter()
