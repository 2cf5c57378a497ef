"""The core path end to end: the real openai SDK -> spanmeter -> the simulated API."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
import pytest

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def _client(url: str, **kw):
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="sk-caller-own-key", max_retries=0, **kw)


async def _raw(url: str, body: dict, headers: dict | None = None) -> tuple[int, dict, bytes]:
    async with aiohttp.ClientSession() as s, s.post(
        f"{url}/v1/chat/completions", json=body, headers={"Authorization": "Bearer sk-x", **(headers or {})}
    ) as r:
        return r.status, r.headers.copy(), await r.read()


async def test_non_stream_body_reaches_the_client_byte_for_byte(sim, proxy):
    body = {"model": "sim-small", "messages": [{"role": "user", "content": "hi"}]}
    direct = await _raw(sim.url, body)
    via = await _raw(proxy.url, body)
    assert via[0] == direct[0] == 200
    assert via[2] == direct[2]
    assert via[1]["x-spanmeter-run-id"]


async def test_request_body_reaches_upstream_byte_for_byte_with_literal_braces(sim, proxy):
    raw = json.dumps({"model": "sim-small", "messages": [
        {"role": "system", "content": 'Output in this format: {"name": "value"} and {{double}} {0} %s ${x}'},
        {"role": "user", "content": "SCENARIO:braces"}]}, indent=3).encode()
    async with aiohttp.ClientSession() as s, s.post(
        f"{proxy.url}/v1/chat/completions", data=raw,
        headers={"Authorization": "Bearer sk-x", "Content-Type": "application/json"}) as r:
        assert r.status == 200
        assert "{\"name\": \"value\"}" in (await r.json())["choices"][0]["message"]["content"]
    assert sim.last.body == raw


async def test_caller_key_goes_upstream_in_open_mode_and_spanmeter_headers_do_not(sim, proxy):
    async with _client(proxy.url, default_headers={"X-Run-Id": "r-1", "traceparent":
                       "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}) as c:
        await c.chat.completions.create(model="sim-small", messages=[{"role": "user", "content": "hi"}])
    headers = {k.lower(): v for k, v in sim.last.headers.items()}
    assert headers["authorization"] == "Bearer sk-caller-own-key"
    assert "x-run-id" not in headers and "traceparent" not in headers


async def test_sync_client_tool_round_trip(sim, proxy):
    def agent() -> tuple[str, str]:
        c = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="sk-x", max_retries=0,
                          default_headers={"X-Run-Id": "sync-run"})
        msgs = [{"role": "user", "content": "SCENARIO:tool weather?"}]
        first = c.chat.completions.create(model="sim-small", messages=msgs, tools=TOOLS)
        call = first.choices[0].message.tool_calls[0]
        msgs += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": '{"ok": true, "temp": 14}'}]
        final = c.chat.completions.create(model="sim-small", messages=msgs, tools=TOOLS)
        c.close()
        return call.function.name, final.choices[0].message.content

    name, text = await asyncio.to_thread(agent)
    assert name == "get_weather"
    assert '"temp": 14' in text


async def test_stream_is_forwarded_event_by_event_and_usage_chunk_hidden(sim, proxy):
    async with _client(proxy.url) as c:
        raw = await c.chat.completions.with_raw_response.create(
            model="sim-small", messages=[{"role": "user", "content": "hi"}], stream=True)
        chunks = [ch async for ch in raw.parse()]
    assert all(ch.choices for ch in chunks), "the usage-only chunk must not reach a client that did not ask"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks).startswith("Hello!")
    assert sim.last.json()["stream_options"] == {"include_usage": True}
    assert "include_usage=injected" in raw.headers["x-spanmeter-rewrites"]
    # The headers leave before the stream: they never announce a drop that has not happened.
    assert "usage_chunk" not in raw.headers["x-spanmeter-rewrites"]


async def test_stream_with_client_usage_is_untouched(sim, proxy):
    body = {"model": "sim-small", "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "stream_options": {"include_usage": True}}
    direct = await _raw(sim.url, body)
    via = await _raw(proxy.url, body)
    assert via[2] == direct[2]
    assert "x-spanmeter-rewrites" not in via[1]


async def test_stream_arrives_before_it_ends(sim, proxy):
    # A slow stream: the first event must reach the client while the upstream is still writing.
    body = {"model": "sim-small", "messages": [{"role": "user", "content": "SCENARIO:slow:0.2"}], "stream": True}
    async with aiohttp.ClientSession() as s, s.post(
        f"{proxy.url}/v1/chat/completions", json=body, headers={"Authorization": "Bearer k"}) as r:
        first = await r.content.readuntil(b"\n\n")
        assert first.startswith(b"data: ")
        assert "streaming" in sim.streams.values()
        rest = await r.read()
    assert rest.endswith(b"data: [DONE]\n\n")


async def test_client_disconnect_closes_the_upstream_within_a_second(sim, proxy):
    body = {"model": "sim-small", "messages": [{"role": "user", "content": "SCENARIO:slow:0.1"}], "stream": True}
    async with aiohttp.ClientSession() as s:
        r = await s.post(f"{proxy.url}/v1/chat/completions", json=body, headers={"Authorization": "Bearer k"})
        await r.content.readuntil(b"\n\n")
        r.close()  # the agent goes away mid-stream
    for _ in range(100):
        if "client_gone" in sim.streams.values():
            break
        await asyncio.sleep(0.01)
    assert list(sim.streams.values()) == ["client_gone"]


async def test_run_id_from_header_traceparent_or_generated(proxy):
    body = {"model": "sim-small", "messages": [{"role": "user", "content": "hi"}]}
    _, h, _ = await _raw(proxy.url, body, {"x-run-id": "my-run"})
    assert h["x-spanmeter-run-id"] == "my-run"
    _, h, _ = await _raw(proxy.url, body, {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"})
    assert h["x-spanmeter-run-id"] == "4bf92f3577b34da6a3ce929d0e0e4736"
    _, h1, _ = await _raw(proxy.url, body)
    _, h2, _ = await _raw(proxy.url, body)
    assert h1["x-spanmeter-run-id"] != h2["x-spanmeter-run-id"]


async def test_upstream_errors_pass_through_unchanged(sim, proxy):
    body = {"model": "sim-small", "messages": [{"role": "user", "content": "SCENARIO:error:429"}]}
    direct = await _raw(sim.url, body)
    via = await _raw(proxy.url, body)
    assert via[0] == direct[0] == 429
    assert via[2] == direct[2]
    assert via[1]["retry-after"] == "0"


async def test_health_and_readiness(proxy):
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{proxy.url}/healthz") as r:
            assert r.status == 200
        async with s.get(f"{proxy.url}/readyz") as r:
            assert (r.status, (await r.json())["status"]) == (200, "ready")


async def test_models_list_passes_through(proxy):
    async with _client(proxy.url) as c:
        models = await c.models.list()
    assert [m.id for m in models.data] == ["sim-small", "sim-large"]


@pytest.mark.parametrize("scenario", ["json_fenced", "truncated"])
async def test_plain_text_requests_are_never_repaired(sim, proxy, scenario):
    body = {"model": "sim-small", "messages": [{"role": "user", "content": f"SCENARIO:{scenario}"}]}
    assert (await _raw(proxy.url, body))[2] == (await _raw(sim.url, body))[2]
