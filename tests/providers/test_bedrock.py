"""Bedrock's pure parts: the routes and the model a path names, the families of InvokeModel
bodies, Converse's request facts and patches, Bedrock's own counts, and the event-stream
relay on frames cut at every byte."""

from __future__ import annotations

import base64
import json
import struct
import zlib
from typing import Any

import orjson
import pytest

from proxy.errors import Refusal, UnknownRoute
from proxy.model import Usage
from proxy.providers.bedrock import CONVERSE_API, INVOKE_API, family_of, header_usage
from proxy.providers.bedrock_wire import bedrock_error_headers, model_of_path
from proxy.providers.eventstream import EventStreamRelay, exception_frame
from proxy.providers.hooks import Hooks
from proxy.providers.observer import Observer
from proxy.serve.routes import match

pytest.importorskip("botocore.eventstream")

ARN = ("arn%3Aaws%3Abedrock%3Aus-east-1%3A012345678901%3Ainference-profile%2F"
       "us.anthropic.claude-3-7-sonnet-20250219-v1%3A0")


@pytest.mark.parametrize(("path", "api", "model"), [
    ("/model/anthropic.claude-3-5-sonnet-20240620-v1%3A0/converse", "converse",
     "anthropic.claude-3-5-sonnet-20240620-v1:0"),
    ("/model/anthropic.claude-3-5-sonnet-20240620-v1:0/converse-stream", "converse",
     "anthropic.claude-3-5-sonnet-20240620-v1:0"),
    ("/model/us.amazon.nova-lite-v1%3A0/invoke", "invoke", "us.amazon.nova-lite-v1:0"),
    ("/model/global.anthropic.claude-sonnet-4-20250514-v1%3A0/invoke-with-response-stream", "invoke",
     "global.anthropic.claude-sonnet-4-20250514-v1:0"),
    (f"/model/{ARN}/converse", "converse", "us.anthropic.claude-3-7-sonnet-20250219-v1:0"),
])
def test_bedrock_paths_route_as_sent_and_name_the_model_they_run(path: str, api: str, model: str) -> None:
    route = match(path)
    assert route.api is not None and route.api.api == api
    assert route.path == path  # forwarded as the client encoded it
    assert model_of_path(path) == model


@pytest.mark.parametrize("path", [
    "/model/a.b%2F..%2Fc/converse",  # an encoded slash outside an ARN
    "/model/arn%3Aaws%2F..%2Fx/converse",  # beside a dot segment
    "/model/a.b/../converse",
    "/model/a%2Eb/converse",
    "/model/a.b/converse%2F",
    "/v1%2Fchat/completions",  # every other route still refuses %2F
])
def test_an_encoded_slash_is_allowed_in_an_arn_s_model_id_and_nowhere_else(path: str) -> None:
    with pytest.raises(UnknownRoute):
        match(path)


def test_other_bedrock_operations_are_not_metered_routes() -> None:
    assert match("/model/anthropic.claude-v2/count-tokens").api is None


@pytest.mark.parametrize(("model", "body", "family"), [
    ("anthropic.claude-3-haiku-20240307-v1:0", {"messages": []}, "anthropic"),
    ("us.anthropic.claude-3-haiku-20240307-v1:0", {"messages": []}, "anthropic"),
    ("anthropic.claude-v2:1", {"prompt": "Human: hi"}, "anthropic"),
    ("amazon.nova-lite-v1:0", {"messages": []}, "nova"),
    ("amazon.titan-text-express-v1", {"inputText": "hi"}, "titan"),
    ("amazon.titan-embed-text-v2:0", {"inputText": "hi"}, "embeddings"),
    ("meta.llama3-70b-instruct-v1:0", {"prompt": "hi"}, "meta"),
    ("cohere.command-text-v14", {"prompt": "hi"}, "cohere"),
    ("cohere.embed-english-v3", {"texts": ["hi"]}, "embeddings"),
    ("mistral.mistral-large-2402-v1:0", {"prompt": "hi"}, "mistral"),
    ("ai21.j2-mid-v1", {"prompt": "hi"}, "ai21"),
    ("endpoint-quick-start-idr7y", {"inputs": "hi"}, "other"),
])
def test_invoke_bodies_are_read_by_their_model_family(model: str, body: dict[str, Any], family: str) -> None:
    found = family_of(model, body)
    assert (found if isinstance(found, str) else found.name) == family


def _open(api: Any, path: str, body: dict[str, Any]) -> Any:
    return api.open(orjson.dumps(body), path)


def test_converse_facts_and_the_clamp_in_inference_config() -> None:
    body = {"messages": [{"role": "user", "content": [{"text": "hi"}]}],
            "inferenceConfig": {"maxTokens": 900, "temperature": 0.2},
            "toolConfig": {"tools": [{"toolSpec": {"name": "f", "inputSchema": {"json": {"type": "object"}}}}],
                           "toolChoice": {"tool": {"name": "f"}}}}
    tr = _open(CONVERSE_API, "/model/amazon.nova-lite-v1%3A0/converse", body)
    call = tr.call
    assert (call.api, call.operation, call.model, call.stream) == ("converse", "chat", "amazon.nova-lite-v1:0", False)
    assert (call.max_output_tokens, call.temperature, call.output.kind, call.output.name) == (900, 0.2, "tool", "f")
    tr.request.clamp(128)
    sent = json.loads(tr.request.request_bytes())
    assert sent["inferenceConfig"] == {"maxTokens": 128, "temperature": 0.2}
    assert sent["messages"] == body["messages"]


def test_converse_tool_results_close_calls_and_take_reminders_as_text() -> None:
    body = {"messages": [
        {"role": "user", "content": [{"text": "weather?"}]},
        {"role": "assistant", "content": [{"toolUse": {"toolUseId": "t1", "name": "w", "input": {"c": "x"}}}]},
        {"role": "user", "content": [{"toolResult": {"toolUseId": "t1", "content": [{"text": "18C"}],
                                                     "status": "error"}}]}]}
    tr = _open(CONVERSE_API, "/model/m.n/converse-stream", body)
    (result,) = tr.call.tool_results
    assert (result.call_id, result.name, result.content, result.is_error) == ("t1", "w", "18C", True)
    (history,) = tr.request.tool_history()
    assert history.arguments == '{"c":"x"}' and history.latest
    assert tr.request.prefix_tool_result("t1", "[reminder] ")
    sent = json.loads(tr.request.request_bytes())
    assert sent["messages"][2]["content"][0]["toolResult"]["content"] == [{"text": "[reminder] 18C"}]
    assert tr.request.note("wrap up")
    sent = json.loads(tr.request.request_bytes())
    assert sent["messages"][2]["content"][-1] == {"text": "wrap up"}  # no `type`: Bedrock refuses it


def test_a_cache_point_reserves_the_write_premium() -> None:
    body = {"system": [{"text": "long"}, {"cachePoint": {"type": "default"}}], "messages": []}
    assert _open(CONVERSE_API, "/model/m.n/converse", body).call.cache_write == "5m"


@pytest.mark.parametrize(("path", "body", "field", "operation", "bound"), [
    ("/model/amazon.titan-text-express-v1/invoke", {"inputText": "hi", "textGenerationConfig": {"maxTokenCount": 50}},
     "textGenerationConfig.maxTokenCount", "text_completion", 50),
    ("/model/meta.llama3-70b-instruct-v1%3A0/invoke", {"prompt": "hi", "max_gen_len": 60}, "max_gen_len",
     "text_completion", 60),
    ("/model/amazon.nova-micro-v1%3A0/invoke", {"messages": [], "inferenceConfig": {"max_new_tokens": 70}},
     "inferenceConfig.max_new_tokens", "chat", 70),
    ("/model/anthropic.claude-3-haiku-20240307-v1%3A0/invoke-with-response-stream",
     {"anthropic_version": "bedrock-2023-05-31", "max_tokens": 80, "messages": []}, "max_tokens", "chat", 80),
    ("/model/amazon.titan-embed-text-v2%3A0/invoke", {"inputText": "hi"}, "", "embeddings", None),
])
def test_invoke_reads_each_family_s_output_bound(path: str, body: dict[str, Any], field: str, operation: str,
                                                 bound: int | None) -> None:
    call = _open(INVOKE_API, path, body).call
    assert (call.max_tokens_field, call.operation, call.max_output_tokens) == (field, operation, bound)
    assert call.stream == path.endswith("-stream")
    assert call.generates_output == (operation != "embeddings")


def test_the_token_count_headers_count_cache_reads_and_writes_as_input() -> None:
    got = header_usage({"x-amzn-bedrock-input-token-count": "4", "x-amzn-bedrock-output-token-count": "50",
                        "x-amzn-bedrock-cache-read-input-token-count": "0",
                        "x-amzn-bedrock-cache-write-input-token-count": "18131"})
    assert got == Usage(input_tokens=18135, output_tokens=50, cache_read_tokens=0, cache_write_tokens=18131)
    assert header_usage({}) is None


def test_errors_name_bedrock_s_exception_in_its_header() -> None:
    header = bedrock_error_headers(Refusal("over"))["x-amzn-errortype"]
    assert header.split(":")[0] == "ServiceQuotaExceededException"


def _frame(kind: str, data: dict[str, Any]) -> bytes:
    head = b""
    for k, v in {":event-type": kind, ":content-type": "application/json", ":message-type": "event"}.items():
        head += bytes([len(k)]) + k.encode() + b"\x07" + struct.pack(">H", len(v)) + v.encode()
    payload = json.dumps(data).encode()
    prelude = struct.pack(">II", 16 + len(head) + len(payload), len(head))
    msg = prelude + struct.pack(">I", zlib.crc32(prelude)) + head + payload
    return msg + struct.pack(">I", zlib.crc32(msg))


STREAM = b"".join([
    _frame("messageStart", {"role": "assistant"}),
    _frame("contentBlockDelta", {"contentBlockIndex": 0, "delta": {"text": "héllo"}}),
    _frame("messageStop", {"stopReason": "end_turn"}),
    _frame("metadata", {"usage": {"inputTokens": 5, "outputTokens": 2, "cacheReadInputTokens": 3}}),
])


@pytest.mark.parametrize("size", [1, 2, 3, 7, 13, 64, len(STREAM)])
def test_the_event_stream_relay_forwards_whole_frames_byte_for_byte_and_reads_them(size: int) -> None:
    observer = Observer()
    relay = EventStreamRelay(CONVERSE_API, observer, Hooks())
    out = b"".join(relay.feed(STREAM[i:i + size]) for i in range(0, len(STREAM), size)) + relay.flush()
    assert out == STREAM
    outcome = observer.finish(200)
    assert (outcome.text, outcome.finish_reasons) == ("héllo", ("end_turn",))
    assert (outcome.usage.input_tokens, outcome.usage.output_tokens) == (8, 2)


def test_a_cut_drops_the_half_frame_so_the_exception_frame_starts_on_a_boundary() -> None:
    relay = EventStreamRelay(CONVERSE_API, Observer(), Hooks())
    first = len(_frame("messageStart", {"role": "assistant"}))
    sent = relay.feed(STREAM[: first + 10])
    assert sent == STREAM[:first]
    assert relay.release() == b""
    from botocore.eventstream import EventStreamBuffer

    buf = EventStreamBuffer()
    buf.add_data(sent + exception_frame("modelStreamErrorException", "cut"))
    (_, exc) = list(buf)
    assert exc.headers[":exception-type"] == "modelStreamErrorException"
    assert json.loads(exc.payload) == {"message": "cut"}


def test_a_frame_that_fails_its_crc_goes_on_as_it_came_and_is_noted() -> None:
    observer = Observer()
    relay = EventStreamRelay(CONVERSE_API, observer, Hooks())
    broken = bytearray(STREAM)
    broken[-1] ^= 0xFF
    assert relay.feed(bytes(broken)) + relay.flush() == bytes(broken)
    assert "unparsed_event" in observer.finish(200).notes


def test_an_invoke_stream_is_billed_by_its_invocation_metrics() -> None:
    tr = _open(INVOKE_API, "/model/anthropic.claude-3-haiku-20240307-v1%3A0/invoke-with-response-stream",
               {"anthropic_version": "bedrock-2023-05-31", "max_tokens": 10, "messages": []})
    answer = tr.answer(Hooks())

    def chunk(data: dict[str, Any]) -> bytes:
        return _frame("chunk", {"bytes": base64.b64encode(json.dumps(data).encode()).decode()})

    raw = (chunk({"type": "message_start", "message": {"id": "m", "model": "claude-3-haiku-20240307",
                                                       "usage": {"input_tokens": 9, "output_tokens": 1}}})
           + chunk({"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 7}})
           + chunk({"type": "message_stop", "amazon-bedrock-invocationMetrics": {"inputTokenCount": 9,
                                                                                 "outputTokenCount": 5}}))
    stream = answer.stream()
    assert stream.feed(raw) + stream.flush() == raw
    answer.complete = True
    outcome = answer.outcome()
    assert (outcome.usage.input_tokens, outcome.usage.output_tokens) == (9, 5)
    assert outcome.response_model is None  # charged as the model the path names
    assert "usage_disagrees:billed_invocation_metrics" in outcome.notes
