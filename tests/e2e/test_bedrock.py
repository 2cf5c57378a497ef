"""The real AWS SDKs through spanmeter to a fake Bedrock that speaks the exact wire format
(tests/fakes/bedrock.py: JSON, event-stream frames with CRCs, token-count headers) and checks
every credential as Bedrock would, a SigV4 signature recomputed with botocore.

boto3's `bedrock-runtime` client signs with SigV4 (fake static keys from the environment) or
sends a Bedrock API key (AWS_BEARER_TOKEN_BEDROCK); `anthropic.AnthropicBedrock` signs with
keys it is given. Each changes only its endpoint. spanmeter passes an API key through, and
re-signs a SigV4 call with the credentials of AWS's chain (here the same environment)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
import pytest

boto3 = pytest.importorskip("boto3")
import botocore.config  # noqa: E402
import botocore.exceptions  # noqa: E402

from proxy.ops.demo import serve_on_free_port  # noqa: E402
from proxy.serve.appkeys import TEL  # noqa: E402
from tests.fakes.bedrock import SEEN, SLIPPED, create_bedrock  # noqa: E402
from tests.fixtures.otlp import otlp_receiver  # noqa: E402, F401

ACCESS, SECRET, API_KEY = "AKIDFAKEBEDROCK01", "fake-secret-key-for-tests", "ABSKfakebedrockapikey01"
MODEL = "anthropic.claude-3-5-sonnet-20240620-v1:0"
TOOLS = {"tools": [{"toolSpec": {"name": "get_weather", "description": "The weather in a city",
                                 "inputSchema": {"json": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}}]}
ASK = {"role": "user", "content": [{"text": "What is the weather in Paris?"}]}


@pytest.fixture
def aws_env(monkeypatch_env: Callable[[str, str], None], tmp_path: Any) -> None:
    """Fake static keys in the environment, and nothing else of AWS's chain to find."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                 "AWS_BEARER_TOKEN_BEDROCK", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
                 "AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_ROLE_ARN"):
        os.environ.pop(name, None)
    for name, value in {"AWS_ACCESS_KEY_ID": ACCESS, "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_REGION": "us-east-1",
                        "AWS_CONFIG_FILE": str(tmp_path / "no-config"),
                        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "no-credentials"),
                        "AWS_EC2_METADATA_DISABLED": "true"}.items():
        monkeypatch_env(name, value)


@dataclass
class Fake:
    app: Any
    url: str

    def __getitem__(self, key: Any) -> Any:
        return self.app[key]


@pytest.fixture
async def bedrock(aws_env: None) -> AsyncIterator[Fake]:
    app = create_bedrock(access_key=ACCESS, secret_key=SECRET, api_key=API_KEY)
    runner, url = await serve_on_free_port(app)
    yield Fake(app, url)
    await runner.cleanup()


def _client(proxy_url: str, run: str, **headers: str) -> Any:
    client = boto3.client("bedrock-runtime", endpoint_url=proxy_url, region_name="us-east-1",
                          config=botocore.config.Config(retries={"max_attempts": 1}))

    def add(request: Any, **_: Any) -> None:  # the run's headers, as an agent adds them
        request.headers["X-Run-Id"] = run
        for k, v in headers.items():
            request.headers[k] = v

    client.meta.events.register("before-sign.bedrock-runtime.*", add)
    return client


def _model_spans(spans: list[dict[str, Any]], run: str) -> list[dict[str, Any]]:
    return sorted((s for s in spans if s["attributes"].get("spanmeter.run.id") == run
                   and "gen_ai.request.model" in s["attributes"]), key=lambda s: s["start_ns"])


async def _spans(proxy: Any, receiver: Any, n: int) -> list[dict[str, Any]]:
    await proxy.settled()
    await asyncio.to_thread(proxy.app[TEL].force_flush)
    return await asyncio.to_thread(receiver.wait_for_spans, n, 30.0)


async def test_boto3_signed_converse_tool_round_trip_is_re_signed_metered_and_becomes_a_tool_span(
        make_proxy, bedrock, otlp_receiver):  # noqa: F811
    proxy = await make_proxy(bedrock_base_url=bedrock.url, otlp_endpoint=otlp_receiver.endpoint)
    client = _client(proxy.url, "bedrock-tools")
    first = await asyncio.to_thread(client.converse, modelId=MODEL, messages=[ASK], toolConfig=TOOLS,
                                    inferenceConfig={"maxTokens": 300})
    assert first["stopReason"] == "tool_use"
    use = first["output"]["message"]["content"][1]["toolUse"]
    result = {"role": "user", "content": [{"toolResult": {"toolUseId": use["toolUseId"],
                                                          "content": [{"text": "18 degrees, clear"}]}}]}
    second = await asyncio.to_thread(client.converse, modelId=MODEL, toolConfig=TOOLS,
                                     messages=[ASK, first["output"]["message"], result])
    assert second["output"]["message"]["content"] == [{"text": "It is sunny."}]
    seen = bedrock[SEEN]
    assert [s["problem"] for s in seen] == [None, None]  # spanmeter's signatures verify
    assert seen[0]["path"] == "/model/anthropic.claude-3-5-sonnet-20240620-v1%3A0/converse"  # as boto3 encoded it
    assert seen[0]["headers"]["Authorization"].startswith(f"AWS4-HMAC-SHA256 Credential={ACCESS}/")
    spans = await _spans(proxy, otlp_receiver, 3)
    tools = [s for s in spans if s["name"].startswith("execute_tool")]
    assert [s["attributes"]["gen_ai.tool.call.id"] for s in tools] == [use["toolUseId"]]
    assert tools[0]["attributes"]["gen_ai.tool.name"] == "get_weather"
    model = _model_spans(spans, "bedrock-tools")[0]["attributes"]
    assert model["gen_ai.provider.name"] == "aws.bedrock"
    assert model["gen_ai.operation.name"] == "chat"
    assert model["gen_ai.request.model"] == MODEL
    assert (model["gen_ai.usage.input_tokens"], model["gen_ai.usage.output_tokens"]) == (70, 12)  # 40 + 30 read
    assert model["gen_ai.request.max_tokens"] == 300
    assert float(model["spanmeter.cost.usd"]) > 0


async def test_boto3_signed_stream_reads_the_metadata_usage_and_the_streamed_tool_call(
        make_proxy, bedrock, otlp_receiver):  # noqa: F811
    proxy = await make_proxy(bedrock_base_url=bedrock.url, otlp_endpoint=otlp_receiver.endpoint)
    client = _client(proxy.url, "bedrock-stream")

    def read() -> tuple[str, dict[str, Any], str]:
        out = client.converse_stream(modelId=MODEL, messages=[ASK], toolConfig=TOOLS)
        text, usage, args = "", {}, ""
        for ev in out["stream"]:
            delta = ev.get("contentBlockDelta", {}).get("delta", {})
            text += delta.get("text", "")
            args += delta.get("toolUse", {}).get("input", "")
            usage = ev.get("metadata", {}).get("usage", usage)
        return text, usage, args

    text, usage, args = await asyncio.to_thread(read)
    assert (text, args) == ("It is sunny.", '{"city": "Oslo"}')
    assert usage["inputTokens"] == 40
    assert bedrock[SEEN][0]["problem"] is None
    assert bedrock[SEEN][0]["path"].endswith("%3A0/converse-stream")
    spans = await _spans(proxy, otlp_receiver, 1)
    model = _model_spans(spans, "bedrock-stream")[0]["attributes"]
    assert (model["gen_ai.usage.input_tokens"], model["gen_ai.usage.output_tokens"]) == (70, 12)
    assert model["gen_ai.response.finish_reasons"] == ["tool_use"]


async def test_a_bedrock_api_key_passes_through_in_open_mode(make_proxy, bedrock, otlp_receiver):  # noqa: F811
    """What AWS_BEARER_TOKEN_BEDROCK makes boto3 send (`Authorization: Bearer <key>`, no SigV4
    headers). boto3 sends a bearer token only over HTTPS, so the request is made as it makes it."""
    proxy = await make_proxy(bedrock_base_url=bedrock.url, otlp_endpoint=otlp_receiver.endpoint)
    async with aiohttp.ClientSession() as s, s.post(
            aiohttp.client.URL(proxy.url + "/model/us.amazon.nova-lite-v1%3A0/converse", encoded=True),
            json={"messages": [ASK]}, headers={"Authorization": f"Bearer {API_KEY}", "X-Run-Id": "bedrock-key"}) as r:
        assert r.status == 200
        assert (await r.json())["output"]["message"]["content"] == [{"text": "It is sunny."}]
    seen = bedrock[SEEN][0]
    assert (seen["headers"]["Authorization"], seen["problem"]) == (f"Bearer {API_KEY}", None)
    assert seen["path"] == "/model/us.amazon.nova-lite-v1%3A0/converse"
    spans = await _spans(proxy, otlp_receiver, 1)
    model = _model_spans(spans, "bedrock-key")[0]["attributes"]
    assert model["gen_ai.request.model"] == "us.amazon.nova-lite-v1:0"
    assert float(model["spanmeter.cost.usd"]) > 0


async def test_a_stream_cut_inside_a_frame_ends_with_an_exception_frame_and_settles_at_the_reservation(
        make_proxy, bedrock, otlp_receiver):  # noqa: F811
    proxy = await make_proxy(bedrock_base_url=bedrock.url, otlp_endpoint=otlp_receiver.endpoint)
    client = _client(proxy.url, "bedrock-cut", **{"x-fake-cut": "1"})
    body = b'{"anthropic_version": "bedrock-2023-05-31", "max_tokens": 200, ' \
           b'"messages": [{"role": "user", "content": "Hi"}]}'

    def read() -> list[str]:
        out = client.invoke_model_with_response_stream(modelId=MODEL, body=body)
        got = []
        for ev in out["body"]:
            got.append(ev["chunk"]["bytes"].decode())
        return got

    with pytest.raises(botocore.exceptions.EventStreamError) as caught:
        await asyncio.to_thread(read)
    assert caught.value.response["Error"]["Code"] == "modelStreamErrorException"
    spans = await _spans(proxy, otlp_receiver, 1)
    model = _model_spans(spans, "bedrock-cut")[0]["attributes"]
    assert model["error.type"]
    # Unknown is not zero: no usage came, so the call is charged what was reserved for it.
    assert float(model["spanmeter.cost.usd"]) > 0


async def test_anthropic_bedrock_sdk_whole_and_streamed_billed_by_bedrock_s_own_counts(
        make_proxy, bedrock, otlp_receiver):  # noqa: F811
    anthropic = pytest.importorskip("anthropic")
    proxy = await make_proxy(bedrock_base_url=bedrock.url, otlp_endpoint=otlp_receiver.endpoint)
    client = anthropic.AnthropicBedrock(aws_access_key=ACCESS, aws_secret_key=SECRET, aws_region="us-east-1",
                                        base_url=proxy.url, max_retries=0,
                                        default_headers={"X-Run-Id": "bedrock-anthropic"})
    message = await asyncio.to_thread(client.messages.create, model=MODEL, max_tokens=100,
                                      messages=[{"role": "user", "content": "Hello"}])
    assert message.content[0].text == "Hello from Bedrock."

    def stream() -> tuple[str, int]:
        with client.messages.stream(model=MODEL, max_tokens=100, messages=[{"role": "user", "content": "Hi"}]) as s:
            final = s.get_final_message()
        return final.content[0].text, final.usage.output_tokens

    text, reported = await asyncio.to_thread(stream)
    assert text == "Hi there."
    assert reported == 9  # the model's own message_delta count, as the client reads it
    assert [s["problem"] for s in bedrock[SEEN]] == [None, None]
    assert bedrock[SEEN][0]["path"] == "/model/anthropic.claude-3-5-sonnet-20240620-v1:0/invoke"
    spans = await _spans(proxy, otlp_receiver, 2)
    whole, streamed = (s["attributes"] for s in _model_spans(spans, "bedrock-anthropic"))
    assert (whole["gen_ai.usage.input_tokens"], whole["gen_ai.usage.output_tokens"]) == (14, 6)
    # What Bedrock billed (invocation metrics: 8) wins over the model's report (9), and the span says so.
    assert (streamed["gen_ai.usage.input_tokens"], streamed["gen_ai.usage.output_tokens"]) == (20, 8)
    assert "usage_disagrees:billed_invocation_metrics" in str(streamed.get("spanmeter.observer.notes", ""))


async def test_a_cost_ceiling_refuses_in_bedrock_s_error_shape_before_anything_is_sent(
        make_proxy, bedrock, otlp_receiver):  # noqa: F811
    proxy = await make_proxy(bedrock_base_url=bedrock.url, otlp_endpoint=otlp_receiver.endpoint)
    client = _client(proxy.url, "bedrock-ceiling", **{"X-Run-Max-Cost-Usd": "0.000001"})
    with pytest.raises(botocore.exceptions.ClientError) as caught:
        await asyncio.to_thread(client.converse, modelId=MODEL, messages=[ASK], inferenceConfig={"maxTokens": 4000})
    err = caught.value.response
    assert err["ResponseMetadata"]["HTTPStatusCode"] == 402
    assert err["Error"]["Code"] == "ServiceQuotaExceededException"
    assert "ceiling" in err["Error"]["Message"].lower() or "cost" in err["Error"]["Message"].lower()
    assert bedrock[SEEN] == []


async def test_without_aws_credentials_a_signed_call_is_refused_401_naming_what_to_set(
        make_proxy, bedrock, otlp_receiver):  # noqa: F811
    proxy = await make_proxy(bedrock_base_url=bedrock.url, otlp_endpoint=otlp_receiver.endpoint)
    os.environ.pop("AWS_ACCESS_KEY_ID")
    os.environ.pop("AWS_SECRET_ACCESS_KEY")
    client = boto3.client("bedrock-runtime", endpoint_url=proxy.url, region_name="us-east-1",
                          aws_access_key_id=ACCESS, aws_secret_access_key=SECRET,
                          config=botocore.config.Config(retries={"max_attempts": 1}))
    with pytest.raises(botocore.exceptions.ClientError) as caught:
        await asyncio.to_thread(client.converse, modelId=MODEL, messages=[ASK])
    err = caught.value.response
    assert err["ResponseMetadata"]["HTTPStatusCode"] == 401
    assert err["Error"]["Code"] == "UnrecognizedClientException"
    assert "AWS_ACCESS_KEY_ID" in err["Error"]["Message"]
    assert bedrock[SEEN] == []


CACHED_MODEL = "us.anthropic.claude-3-7-sonnet-20250219-v1:0"  # a model Bedrock caches prompts for
SYSTEM = [{"text": "You are a careful weather agent. " + "Check every city twice and cite the station. " * 150}]


def _agent_run(client: Any) -> list[dict[str, Any]]:
    """A tool agent: call, answer the tool it asks for, until it answers in text."""
    messages: list[dict[str, Any]] = [ASK]
    answers = []
    while True:
        answer = client.converse(modelId=CACHED_MODEL, system=SYSTEM, messages=messages, toolConfig=TOOLS,
                                 inferenceConfig={"maxTokens": 300})
        answers.append(answer)
        messages.append(answer["output"]["message"])
        uses = [b["toolUse"] for b in answer["output"]["message"]["content"] if "toolUse" in b]
        if not uses:
            return answers
        messages.append({"role": "user", "content": [
            {"toolResult": {"toolUseId": u["toolUseId"], "content": [{"text": "18 degrees, clear. " * 30}]}}
            for u in uses]})


async def _two_runs(make_proxy: Any, bedrock: Fake, receiver: Any, prompt_cache: str) -> tuple[list[Any], float]:
    proxy = await make_proxy(bedrock_base_url=bedrock.url, otlp_endpoint=receiver.endpoint,
                             policy={"prompt_cache": prompt_cache})
    runs = []
    for run in (f"cache-{prompt_cache}-1", f"cache-{prompt_cache}-2"):
        client = _client(proxy.url, run, **{"x-fake-turns": "3", "x-fake-cache": "on"})
        runs.append(await asyncio.to_thread(_agent_run, client))
    spans = await _spans(proxy, receiver, 2 * 4)
    model_spans = [s for run in (f"cache-{prompt_cache}-1", f"cache-{prompt_cache}-2")
                   for s in _model_spans(spans, run)]
    assert len(model_spans) == 8 and all(s["attributes"]["gen_ai.request.model"] == CACHED_MODEL for s in model_spans)
    return runs, sum(float(s["attributes"]["spanmeter.cost.usd"]) for s in model_spans)


async def test_automatic_prompt_caching_adds_cache_points_a_runs_second_call_reads_and_costs_less_than_off(
        make_proxy, bedrock, otlp_receiver):  # noqa: F811
    runs, auto_cost = await _two_runs(make_proxy, bedrock, otlp_receiver, "auto")
    usage = [[a["usage"] for a in run] for run in runs]
    assert [len(run) for run in runs] == [4, 4]  # three tool turns, then the answer
    # The first run writes once it loops (its third call); the second run's prefix is shared by then.
    assert usage[0][2]["cacheWriteInputTokens"] > 0 and usage[0][3]["cacheReadInputTokens"] > 0
    assert usage[1][1]["cacheReadInputTokens"] > 0  # the second call of a run reads the cache
    sent = [orjson.loads(s["body"]) for s in bedrock[SEEN]]
    assert sent[0]["system"] == SYSTEM  # a first call of a first run waits
    assert sent[2]["system"] == [*SYSTEM, {"cachePoint": {"type": "default"}}]
    assert sent[2]["messages"][-1]["content"][-1] == {"cachePoint": {"type": "default"}}
    assert all(orjson.dumps(body).count(b'"cachePoint"') <= 4 for body in sent)
    rewrites = runs[0][2]["ResponseMetadata"]["HTTPHeaders"]["x-spanmeter-rewrites"]
    assert "cache_breakpoint" in rewrites  # each addition is a recorded rewrite
    bedrock[SEEN].clear()
    _, off_cost = await _two_runs(make_proxy, bedrock, otlp_receiver, "off")
    assert all(b"cachePoint" not in s["body"] for s in bedrock[SEEN])  # off: as the agent sent them
    assert 0 < auto_cost < off_cost


FORECAST = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city", "days"]}
# Converse's structured output naming FORECAST (outputConfig.textFormat), as boto3 sends it.
FORECAST_OUTPUT = {"textFormat": {"type": "json_schema", "structure": {"jsonSchema": {
    "name": "forecast", "schema": orjson.dumps(FORECAST).decode()}}}}


async def test_a_forced_tools_malformed_input_is_repaired_to_the_declared_schema_and_recorded(
        make_proxy, bedrock, otlp_receiver):  # noqa: F811
    proxy = await make_proxy(bedrock_base_url=bedrock.url, otlp_endpoint=otlp_receiver.endpoint)
    client = _client(proxy.url, "bedrock-repair-tool", **{"x-fake-malformed": "tool"})
    tools = {"tools": [{"toolSpec": {"name": "forecast", "description": "A forecast",
                                     "inputSchema": {"json": FORECAST}}}],
             "toolChoice": {"tool": {"name": "forecast"}}}
    answer = await asyncio.to_thread(client.converse, modelId=MODEL, messages=[ASK], toolConfig=tools)
    use = answer["output"]["message"]["content"][0]["toolUse"]
    assert use["input"] == {"city": "Paris", "days": 3}  # a document again, as Converse's clients read it
    rewrites = answer["ResponseMetadata"]["HTTPHeaders"]["x-spanmeter-rewrites"]
    assert "repair=tool:tooluse_fake_slip:" in rewrites
    spans = _model_spans(await _spans(proxy, otlp_receiver, 1), "bedrock-repair-tool")
    assert spans[0]["attributes"]["spanmeter.rewrites"] == [
        "repair=tool:tooluse_fake_slip:fence+trailing_comma+single_quotes+unquoted_key"]


async def test_an_output_config_json_schema_answer_is_repaired_in_the_text(
        make_proxy, bedrock, otlp_receiver):  # noqa: F811
    proxy = await make_proxy(bedrock_base_url=bedrock.url, otlp_endpoint=otlp_receiver.endpoint)
    client = _client(proxy.url, "bedrock-repair-text", **{"x-fake-malformed": "text"})
    output = FORECAST_OUTPUT
    answer = await asyncio.to_thread(client.converse, modelId=MODEL, messages=[ASK], outputConfig=output)
    text = answer["output"]["message"]["content"][0]["text"]
    assert orjson.loads(text) == {"city": "Paris", "days": 3}
    assert "repair=output:" in answer["ResponseMetadata"]["HTTPHeaders"]["x-spanmeter-rewrites"]
    assert orjson.loads(bedrock[SEEN][0]["body"])["outputConfig"] == output  # sent as the client wrote it


async def test_a_streamed_malformed_output_goes_through_untouched_and_the_span_says_it_was_not_repaired(
        make_proxy, bedrock, otlp_receiver):  # noqa: F811
    proxy = await make_proxy(bedrock_base_url=bedrock.url, otlp_endpoint=otlp_receiver.endpoint)
    client = _client(proxy.url, "bedrock-stream-slip", **{"x-fake-malformed": "text"})
    output = FORECAST_OUTPUT
    stream = await asyncio.to_thread(client.converse_stream, modelId=MODEL, messages=[ASK], outputConfig=output)
    events = await asyncio.to_thread(lambda: list(stream["stream"]))
    text = "".join(e["contentBlockDelta"]["delta"]["text"] for e in events if "contentBlockDelta" in e)
    assert text == SLIPPED  # the frames as they came
    span = _model_spans(await _spans(proxy, otlp_receiver, 1), "bedrock-stream-slip")[0]["attributes"]
    assert "output_not_repaired:fence+trailing_comma+single_quotes+unquoted_key" in span["spanmeter.observer.notes"]
    assert "spanmeter.rewrites" not in span
