"""Adapter behaviour outside the recorded fixtures: odd shapes, clamps, auth, error events."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from proxy.errors import CeilingReached, UpstreamTimeout
from proxy.model import Call, Finish, MetaEvent, StreamError, TextDelta, ToolCallDelta, UsageEvent
from proxy.providers.base import open_exchange
from proxy.providers.hooks import Hooks
from proxy.providers.sse import Framer, SseEvent
from proxy.providers.translator import open_call
from tests.providers.cases import ADAPTERS

ALL = list(ADAPTERS.items())
EVENT_TYPES = (MetaEvent, TextDelta, ToolCallDelta, UsageEvent, Finish, StreamError)
IDS = list(ADAPTERS)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.sampled_from(
        ["type", "choices", "delta", "message", "content", "parts", "candidates", "usage",
         "usageMetadata", "response", "item", "output", "index", "error", "tool_calls",
         "function", "functionCall", "args", "content_block", "messages", "contents", "input",
         "tools", "text", "name", "id", "stream", "generationConfig", "output_index",
         "response.completed", "message_start", "stop_reason", "finishReason"]), inner,
        max_size=5),
    max_leaves=20,
)


@pytest.mark.parametrize(("dialect", "adapter"), ALL, ids=IDS)
@settings(max_examples=150, deadline=None)
@given(value=json_values)
@example(value={"input": [{"type": []}]})  # an item type that is not a string (found at the floors)
def test_any_json_shape_never_breaks_an_adapter(dialect: str, adapter: Any, value: Any) -> None:
    for events in (adapter.parse_event(SseEvent(b"", None, json.dumps(value))), adapter.parse_response(value)):
        assert isinstance(events, list) and all(isinstance(e, EVENT_TYPES) for e in events), events
    if isinstance(value, dict):
        call = adapter.parse_request(value, "/v1beta/models/m:generateContent")
        assert isinstance(call, Call) and call.api == adapter.api


@pytest.mark.parametrize(("dialect", "adapter"), ALL, ids=IDS)
def test_invalid_json_in_an_event_raises_a_value_error(dialect: str, adapter: Any) -> None:
    with pytest.raises(ValueError):
        adapter.parse_event(SseEvent(b"data: {oops\n\n", None, "{oops"))


@pytest.mark.parametrize(("dialect", "adapter"), ALL, ids=IDS)
def test_an_empty_event_means_nothing(dialect: str, adapter: Any) -> None:
    assert adapter.parse_event(SseEvent(b": keepalive\n\n", None, "")) == []


MAX_TOKENS = [
    ("chat", {"max_tokens": 5}, {"max_tokens": 9}),
    ("chat", {"max_completion_tokens": 5}, {"max_completion_tokens": 9}),
    ("chat", {"model": "gpt-5-mini"}, {"model": "gpt-5-mini", "max_completion_tokens": 9}),
    ("chat", {"model": "o3"}, {"model": "o3", "max_completion_tokens": 9}),
    ("chat", {"model": "llama-3.1-8b"}, {"model": "llama-3.1-8b", "max_tokens": 9}),
    ("responses", {}, {"max_output_tokens": 9}),
    ("anthropic", {"max_tokens": 5}, {"max_tokens": 9}),
    ("gemini", {}, {"generationConfig": {"maxOutputTokens": 9}}),
    ("gemini", {"generation_config": {"max_output_tokens": 5, "temperature": 1}},
     {"generation_config": {"maxOutputTokens": 9, "temperature": 1}}),
    ("embeddings", {"input": "x"}, {"input": "x"}),
]


@pytest.mark.parametrize(("dialect", "body", "expected"), MAX_TOKENS,
                         ids=[f"{d} {sorted(b)}" for d, b, _ in MAX_TOKENS])
def test_set_max_tokens_writes_the_field_the_model_family_takes(dialect, body, expected) -> None:
    adapter = ADAPTERS[dialect]
    ex = open_exchange(adapter, orjson.dumps(body), "/v1beta/models/m:generateContent")
    adapter.set_max_tokens(ex, 9)
    sent = orjson.loads(ex.request_bytes())
    assert sent == expected
    call = adapter.parse_request(sent, "/v1beta/models/m:generateContent")
    assert call.max_output_tokens == (None if dialect == "embeddings" else 9)


def test_a_new_top_level_field_is_spliced_into_the_bytes_as_they_came() -> None:
    raw = b'{"model": "gpt-4o",  "messages": [{"role": "user", "content": "{literal} braces"}]}  '
    ex = open_exchange(ADAPTERS["chat"], raw, "/v1/chat/completions")
    ADAPTERS["chat"].set_max_tokens(ex, 77)
    sent = ex.request_bytes()
    assert sent.startswith(raw[: raw.rindex(b"}")]), "the conversation's bytes are not re-serialised"
    assert orjson.loads(sent) == {**orjson.loads(raw), "max_completion_tokens": 77}


AUTH = {"chat": {"Authorization": "Bearer up-key"}, "responses": {"Authorization": "Bearer up-key"},
        "embeddings": {"Authorization": "Bearer up-key"}, "anthropic": {"x-api-key": "up-key"},
        "gemini": {"x-goog-api-key": "up-key"}}


@pytest.mark.parametrize(("dialect", "adapter"), ALL, ids=IDS)
def test_the_upstream_key_goes_in_the_dialects_own_header(dialect: str, adapter: Any) -> None:
    assert adapter.auth_headers("up-key") == AUTH[dialect]


@pytest.mark.parametrize(("dialect", "adapter"), ALL, ids=IDS)
def test_no_rewrites_are_needed_outside_chat_streams(dialect: str, adapter: Any) -> None:
    body: dict[str, Any] = {"model": "m", "stream": True, "messages": [], "input": "x"}
    ex = open_exchange(adapter, orjson.dumps(body), "/v1beta/models/m:streamGenerateContent")
    rewrites = adapter.prepare(ex)
    assert (dialect == "chat") == bool(rewrites)
    assert (ex.request_bytes() == orjson.dumps(body)) == (dialect != "chat")


BUDGET = CeilingReached("Run R is over its $5.00 limit.", limit="run_cost")


@pytest.mark.parametrize(("dialect", "adapter"), ALL, ids=IDS)
def test_our_stream_error_reads_back_as_a_stream_error(dialect: str, adapter: Any) -> None:
    events = Framer().feed(adapter.render_stream_error(BUDGET))
    assert len(events) == 1
    parsed = adapter.parse_event(events[0])
    assert [type(e) for e in parsed] == [StreamError]
    assert parsed[0].message == BUDGET.message


def test_stream_error_framing_follows_each_sdks_needs() -> None:
    anthropic = ADAPTERS["anthropic"].render_stream_error(BUDGET)
    gemini = ADAPTERS["gemini"].render_stream_error(BUDGET)
    responses = ADAPTERS["responses"].render_stream_error(BUDGET)
    assert anthropic.startswith(b"event: error\ndata: ")
    assert gemini.startswith(b"data: {") and gemini.endswith(b"}\r\n\r\n")
    assert responses.startswith(b"event: error\ndata: ")
    assert orjson.loads(responses.split(b"data: ")[1])["code"] == "budget_exceeded"


def test_error_bodies_are_each_dialects_native_shape() -> None:
    err = UpstreamTimeout("No answer in 60 s.")
    assert orjson.loads(ADAPTERS["anthropic"].render_error(err, "req_1")) == {
        "type": "error", "error": {"type": "timeout_error", "message": "No answer in 60 s."},
        "request_id": "req_1"}
    assert orjson.loads(ADAPTERS["gemini"].render_error(err, "req_1")) == {"error": {
        "code": 504, "message": "No answer in 60 s.", "status": "DEADLINE_EXCEEDED",
        "details": [{"@type": "type.googleapis.com/google.rpc.ErrorInfo",
                     "reason": "UPSTREAM_TIMEOUT", "domain": "spanmeter",
                     "metadata": {"request_id": "req_1"}}]}}
    assert orjson.loads(ADAPTERS["responses"].render_error(err, "req_1")) == {"error": {
        "message": "No answer in 60 s.", "type": "server_error", "code": "upstream_timeout",
        "param": None}}


def _chat_stream(body: dict[str, Any], stream: bytes) -> tuple[bytes, list[str]]:
    """What a chat call's answer sends its client of `stream`, and the rewrites it recorded."""
    tr = open_call(ADAPTERS["chat"], orjson.dumps(body), "/v1/chat/completions")
    hooks = Hooks()
    tr.request.prepare()
    relay = tr.answer(hooks).stream()
    sent = relay.feed(stream) + relay.flush()
    return sent, [r.header_value() for r in hooks.rewrites]


def test_the_usage_only_chat_chunk_is_dropped_when_the_client_did_not_ask_for_usage() -> None:
    usage_only = b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":1}}\n\n'
    normal = b'data: {"id":"c","choices":[{"index":0,"delta":{}}],"usage":null}\n\n'
    spaced = b'data: {"id": "c", "choices": [], "usage": {"prompt_tokens": 1}}\n\n'
    stream = usage_only + normal + spaced
    assert _chat_stream({"model": "m", "stream": True}, stream) == (normal, ["usage_chunk=dropped"])
    # The client's own wish is read when the call opens, before `prepare` asks for usage for it.
    asked = {"model": "m", "stream": True, "stream_options": {"include_usage": True}}
    assert _chat_stream(asked, stream) == (stream, []), "a client that asked for usage gets its chunk"
    assert _chat_stream({"model": "m", "stream": True, "stream_options": {"include_usage": False}},
                        stream) == (normal, ["usage_chunk=dropped"])
    assert _chat_stream({"model": "m"}, stream) == (stream, []), "a whole answer has no stream to filter"


def test_gemini_model_and_stream_come_from_the_path_in_both_versions() -> None:
    gemini = ADAPTERS["gemini"]
    a = gemini.parse_request({}, "/v1beta/models/gemini-3.8-flash:streamGenerateContent")
    b = gemini.parse_request({}, "/v1/models/gemini-3.8-flash:generateContent")
    assert (a.model, a.stream, b.model, b.stream) == (
        "gemini-3.8-flash", True, "gemini-3.8-flash", False)


def test_a_retried_call_keeps_its_modules_own_state() -> None:
    """A retry is the same call once more: chat still knows its client did not ask for usage
    (the retried body carries the usage request `prepare` added) and still drops the chunk."""
    tr = open_call(ADAPTERS["chat"], b'{"model":"m","stream":true}', "/v1/chat/completions")
    tr.request.prepare()
    again = tr.retry("{", "close the object")
    assert type(again) is type(tr) and again.request.body["stream_options"] == {"include_usage": True}
    hooks = Hooks()
    relay = again.answer(hooks).stream()
    assert relay.feed(b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":1}}\n\n') + relay.flush() == b""
    assert [r.header_value() for r in hooks.rewrites] == ["usage_chunk=dropped"]
