"""Vertex AI's routes with the real SDKs: google-genai with `vertexai=True` and
anthropic.AnthropicVertex, through the proxy, against the simulator speaking Vertex's paths
(Gemini bodies, and Anthropic bodies with the model in the path). Spans at a real OTLP
receiver; tenant mode's token from google-auth against a fake of Google's token endpoint."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import google.oauth2.credentials
import pytest
from google import genai
from google.genai import types

from proxy.config import hash_key
from proxy.serve.appkeys import STORE, TEL
from tests.conftest import Proxy, ProxyFactory, Sim
from tests.fixtures.google_token import TokenEndpoint, service_account_key, token_endpoint  # noqa: F401
from tests.fixtures.otlp import OtlpReceiver, otlp_receiver  # noqa: F401

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
PROJECT, GEMINI_LOCATION, CLAUDE_REGION = "test-project", "us-central1", "us-east5"
CLAUDE = "claude-sonnet-4-5@20250929"
GEMINI_PATH = (f"/v1beta1/projects/{PROJECT}/locations/{GEMINI_LOCATION}/publishers/google/models/"
               "gemini-2.5-flash:generateContent")
CLAUDE_PATH = f"/v1/projects/{PROJECT}/locations/{CLAUDE_REGION}/publishers/anthropic/models/{CLAUDE}:rawPredict"
KEY = "sm-vertex-tenant-key"


def gemini_client(proxy: Proxy, token: str = "ya29.caller", run: str = "v-run") -> genai.Client:
    # A token given as credentials: google-genai sends it as a bearer and needs no network.
    creds = google.oauth2.credentials.Credentials(token=token)
    return genai.Client(vertexai=True, project=PROJECT, location=GEMINI_LOCATION, credentials=creds,
                        http_options=types.HttpOptions(base_url=proxy.url, headers={"X-Run-Id": run}))


def claude_client(proxy: Proxy, token: str = "ya29.caller", run: str = "c-run") -> anthropic.AsyncAnthropicVertex:
    # AnthropicVertex's base URL ends in /v1: it appends /projects/{p}/locations/{region}/...
    return anthropic.AsyncAnthropicVertex(region=CLAUDE_REGION, project_id=PROJECT, access_token=token,
                                          base_url=f"{proxy.url}/v1", max_retries=0,
                                          default_headers={"X-Run-Id": run})


async def _spans(proxy: Proxy, receiver: OtlpReceiver, n: int) -> list[dict[str, Any]]:
    await proxy.settled()
    await asyncio.to_thread(proxy.app[TEL].force_flush)
    return await asyncio.to_thread(receiver.wait_for_spans, n)


def _named(spans: list[dict[str, Any]], prefix: str) -> list[dict[str, Any]]:
    return [s for s in spans if s["name"].startswith(prefix)]


async def test_gemini_on_vertex_tool_round_trip_and_stream(make_proxy: ProxyFactory, sim: Sim,
                                                           otlp_receiver: OtlpReceiver) -> None:  # noqa: F811
    proxy = await make_proxy(vertex_base_url=sim.url, otlp_endpoint=otlp_receiver.endpoint)
    client = gemini_client(proxy)
    decl = types.FunctionDeclaration(name="get_weather", description="Weather", parameters_json_schema=WEATHER)
    cfg = types.GenerateContentConfig(tools=[types.Tool(function_declarations=[decl])],
                                      automatic_function_calling=types.AutomaticFunctionCallingConfig(disable=True))
    first = await client.aio.models.generate_content(model="gemini-2.5-flash", contents="SCENARIO:tool weather?",
                                                     config=cfg)
    assert first.function_calls and first.function_calls[0].name == "get_weather"
    fc = first.function_calls[0]
    contents = [types.Content(role="user", parts=[types.Part(text="SCENARIO:tool weather?")]),
                first.candidates[0].content,
                types.Content(role="user", parts=[types.Part(function_response=types.FunctionResponse(
                    name=fc.name, id=fc.id, response={"result": {"ok": True, "temp": 14}}))])]
    text = ""
    async for chunk in await client.aio.models.generate_content_stream(
            model="gemini-2.5-flash", contents=contents, config=cfg):
        text += chunk.text or ""
    assert "temp" in text
    # The full path went upstream as the SDK sent it, with the caller's own token (open mode).
    assert [r.path for r in sim.received] == [GEMINI_PATH, GEMINI_PATH.replace(":generate", ":streamGenerate")]
    assert sim.last.query == "alt=sse"
    assert {r.headers["Authorization"] for r in sim.received} == {"Bearer ya29.caller"}
    got = await _spans(proxy, otlp_receiver, 3)
    gen = _named(got, "generate_content gemini-2.5-flash")
    assert len(gen) == 2 and gen[1]["attributes"]["gen_ai.request.stream"] is True
    for span in gen:
        a = span["attributes"]
        assert a["gen_ai.provider.name"] == "gcp.vertex_ai"
        assert a["gen_ai.request.model"] == "gemini-2.5-flash"
        assert a["gen_ai.usage.input_tokens"] > 0 and a["gen_ai.usage.output_tokens"] > 0
        assert a["spanmeter.cost.usd"] > 0
    tool = _named(got, "execute_tool get_weather")[0]
    assert tool["trace_id"] == gen[0]["trace_id"]


async def test_anthropic_on_vertex_tool_round_trip_and_stream(make_proxy: ProxyFactory, sim: Sim,
                                                              otlp_receiver: OtlpReceiver) -> None:  # noqa: F811
    proxy = await make_proxy(vertex_base_url=sim.url, otlp_endpoint=otlp_receiver.endpoint)
    client = claude_client(proxy)
    tools: Any = [{"name": "get_weather", "description": "Weather", "input_schema": WEATHER}]
    msgs: Any = [{"role": "user", "content": "SCENARIO:tool weather in Paris?"}]
    first = await client.messages.create(model=CLAUDE, max_tokens=200, tools=tools, messages=msgs)
    use = next(b for b in first.content if b.type == "tool_use")
    msgs += [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                           "content": '{"ok": true, "temp": 14}'}]}]
    async with client.messages.stream(model=CLAUDE, max_tokens=200, tools=tools, messages=msgs) as stream:
        text = "".join([t async for t in stream.text_stream])
    assert "temp" in text
    assert [r.path for r in sim.received] == [CLAUDE_PATH, CLAUDE_PATH.replace(":raw", ":streamRaw")]
    assert {r.headers["Authorization"] for r in sim.received} == {"Bearer ya29.caller"}
    assert all("model" not in r.json() and "anthropic_version" in r.json() for r in sim.received)
    got = await _spans(proxy, otlp_receiver, 3)
    chats = _named(got, f"chat {CLAUDE}")
    assert len(chats) == 2 and chats[1]["attributes"]["gen_ai.request.stream"] is True
    for span in chats:
        a = span["attributes"]
        assert a["gen_ai.provider.name"] == "gcp.vertex_ai"
        assert a["gen_ai.request.model"] == CLAUDE
        assert a["gen_ai.usage.input_tokens"] > 0 and a["gen_ai.usage.output_tokens"] > 0
        assert a["spanmeter.cost.usd"] > 0
    tool = _named(got, "execute_tool get_weather")[0]
    assert tool["attributes"]["gen_ai.tool.call.id"] == use.id
    assert chats[0]["end_ns"] <= tool["start_ns"] <= tool["end_ns"] <= chats[1]["start_ns"]
    await client.close()


@pytest.mark.parametrize(("path", "body"), [
    (GEMINI_PATH, {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]}),
    (GEMINI_PATH.replace(":generate", ":streamGenerate") + "?alt=sse",
     {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]}),
    (CLAUDE_PATH, {"anthropic_version": "vertex-2023-10-16", "max_tokens": 50,
                   "messages": [{"role": "user", "content": "hi"}]}),
    (CLAUDE_PATH.replace(":raw", ":streamRaw"), {"anthropic_version": "vertex-2023-10-16", "max_tokens": 50,
                                                 "stream": True, "messages": [{"role": "user", "content": "hi"}]}),
], ids=["gemini", "gemini-stream", "anthropic", "anthropic-stream"])
async def test_the_upstreams_status_and_bytes_reach_the_client(make_proxy: ProxyFactory, sim: Sim, path: str,
                                                               body: dict[str, Any]) -> None:
    proxy = await make_proxy(vertex_base_url=sim.url)
    headers = {"Authorization": "Bearer ya29.caller"}
    async with aiohttp.ClientSession() as s:
        async with s.post(sim.url + path, json=body, headers=headers) as r:
            direct = (r.status, r.content_type, await r.read())
        async with s.post(proxy.url + path, json=body, headers=headers) as r:
            proxied = (r.status, r.content_type, await r.read())
    assert proxied == direct and direct[0] == 200


@pytest.mark.parametrize("route", ["gemini", "anthropic"])
async def test_a_cost_ceiling_refuses_in_the_routes_own_error_shape(make_proxy: ProxyFactory, sim: Sim,
                                                                    route: str) -> None:
    proxy = await make_proxy(vertex_base_url=sim.url, policy={"runs": {"max_cost_usd": 0.000001}})
    if route == "gemini":
        with pytest.raises(genai.errors.ClientError) as gi:
            client = gemini_client(proxy)
            await client.aio.models.generate_content(model="gemini-2.5-flash", contents="hi")
        assert gi.value.code == 402 and gi.value.status == "RESOURCE_EXHAUSTED"
        assert "max_cost_usd" in str(gi.value)
    else:
        client = claude_client(proxy)
        with pytest.raises(anthropic.PaymentRequiredError) as ai:
            await client.messages.create(model=CLAUDE, max_tokens=100, messages=[{"role": "user", "content": "hi"}])
        assert "billing_error" in str(ai.value) and "max_cost_usd" in str(ai.value)
        await client.close()
    assert sim.received == [], "nothing was forwarded"


async def test_structured_output_is_repaired_on_both_routes(make_proxy: ProxyFactory, sim: Sim) -> None:
    proxy = await make_proxy(vertex_base_url=sim.url)
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "born": {"type": "integer"}},
              "required": ["name", "born"]}
    client = gemini_client(proxy)
    out = await client.aio.models.generate_content(
        model="gemini-2.5-flash", contents="SCENARIO:json_fenced",
        config=types.GenerateContentConfig(response_mime_type="application/json", response_json_schema=schema))
    assert json.loads(out.text or "")["born"] == 1815
    client = claude_client(proxy)
    raw = await client.messages.with_raw_response.create(
        model=CLAUDE, max_tokens=300, messages=[{"role": "user", "content": "SCENARIO:json_fenced"}],
        extra_body={"output_config": {"format": {"type": "json_schema", "schema": schema}}})
    message = await raw.parse()
    assert json.loads(message.content[0].text)["born"] == 1815
    assert "repair" in raw.headers.get("x-spanmeter-rewrites", "")
    await client.close()


async def test_anthropic_on_vertex_gets_automatic_prompt_caching(make_proxy: ProxyFactory, sim: Sim) -> None:
    proxy = await make_proxy(vertex_base_url=sim.url)
    client = claude_client(proxy, run="cache-run")
    msgs: Any = [{"role": "user", "content": "background " * 2000}]
    for _ in range(3):  # from a run's third call on, the whole prompt gets a rolling breakpoint
        answer = await client.messages.create(model=CLAUDE, max_tokens=50, messages=msgs)
        msgs += [{"role": "assistant", "content": answer.content[0].text}, {"role": "user", "content": "more"}]
    assert "cache_control" not in sim.received[0].body.decode()
    assert "cache_control" in sim.received[2].body.decode()
    await client.close()


async def test_tenant_mode_sends_an_adc_token_and_never_the_spanmeter_key(
        make_proxy: ProxyFactory, sim: Sim, token_endpoint: TokenEndpoint, tmp_path: Path,  # noqa: F811
        monkeypatch_env: Any) -> None:
    monkeypatch_env("GOOGLE_APPLICATION_CREDENTIALS", str(service_account_key(tmp_path / "sa.json",
                                                                               token_endpoint.url)))
    proxy = await make_proxy(vertex_base_url=sim.url, tenants={"acme": {"keys": [hash_key(KEY)]}})
    # The SDKs send the spanmeter key where they send a Google token: Authorization: Bearer.
    for _ in range(2):
        client = gemini_client(proxy, token=KEY, run="t-run")
        await client.aio.models.generate_content(
            model="gemini-2.5-flash", contents="hi")
    client = claude_client(proxy, token=KEY, run="t-run")
    await client.messages.create(model=CLAUDE, max_tokens=50, messages=[{"role": "user", "content": "hi"}])
    await client.close()
    assert [r.headers["Authorization"] for r in sim.received] == ["Bearer ya29.fake-1"] * 3
    assert KEY not in json.dumps([r.headers for r in sim.received])
    assert len(token_endpoint.issued) == 1, "one token, kept while it is fresh"
    await proxy.settled()
    assert await proxy.app[STORE].spend("acme", run_id="t-run") > 0


async def test_tenant_mode_without_adc_is_a_401_in_each_routes_shape(
        make_proxy: ProxyFactory, sim: Sim, tmp_path: Path, monkeypatch_env: Any) -> None:
    monkeypatch_env("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "no-such-key.json"))
    proxy = await make_proxy(vertex_base_url=sim.url, tenants={"acme": {"keys": [hash_key(KEY)]}})
    with pytest.raises(genai.errors.ClientError) as gi:
        client = gemini_client(proxy, token=KEY)
        await client.aio.models.generate_content(model="gemini-2.5-flash", contents="hi")
    assert gi.value.code == 401 and gi.value.status == "UNAUTHENTICATED"
    assert "GOOGLE_APPLICATION_CREDENTIALS" in str(gi.value)
    client = claude_client(proxy, token=KEY)
    with pytest.raises(anthropic.AuthenticationError) as ai:
        await client.messages.create(model=CLAUDE, max_tokens=50, messages=[{"role": "user", "content": "hi"}])
    assert "GOOGLE_APPLICATION_CREDENTIALS" in str(ai.value) and "authentication_error" in str(ai.value)
    await client.close()
    assert sim.received == []


async def test_a_vertex_upstream_per_tenant(make_proxy: ProxyFactory, sim: Sim, monkeypatch_env: Any) -> None:
    monkeypatch_env("VERTEX_GATEWAY_TOKEN", "gw-token")
    proxy = await make_proxy(
        upstreams={"vx": {"dialect": "vertex", "base_url": sim.url, "key_env": "VERTEX_GATEWAY_TOKEN"}},
        tenants={"acme": {"keys": [hash_key(KEY)], "upstream": "vx"}})
    client = gemini_client(proxy, token=KEY)
    await client.aio.models.generate_content(model="gemini-2.5-flash", contents="hi")
    assert sim.last.path == GEMINI_PATH and sim.last.headers["Authorization"] == "Bearer gw-token"


async def test_an_unknown_vertex_path_is_a_404_naming_the_vertex_routes(make_proxy: ProxyFactory, sim: Sim) -> None:
    proxy = await make_proxy(vertex_base_url=sim.url)
    path = GEMINI_PATH.replace(":generateContent", ":countTokens")
    async with aiohttp.ClientSession() as s, s.post(proxy.url + path, json={"contents": []}) as r:
        body = await r.json()
    assert r.status == 404 and body["error"]["status"] == "NOT_FOUND"
    assert "publishers/anthropic/models/{model}:rawPredict" in body["error"]["message"]
