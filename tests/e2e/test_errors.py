"""One test per error spanmeter itself raises: status, the dialect's shape, the message."""

from __future__ import annotations

import socket

import aiohttp
import openai
import pytest

from proxy.config import hash_key, load_settings
from proxy.errors import ConfigError

KEY = "sm-test-key-acme"


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


async def _post(url: str, path: str, data: bytes, headers: dict | None = None) -> tuple[int, dict, dict]:
    async with aiohttp.ClientSession() as s, s.post(
        url + path, data=data, headers={"Authorization": "Bearer k", "Content-Type": "application/json",
                                        **(headers or {})}) as r:
        return r.status, r.headers.copy(), await r.json(content_type=None)


async def test_unknown_key_is_401_in_openai_shape(make_proxy):
    proxy = await make_proxy(tenants={"acme": {"keys": [hash_key(KEY)]}})
    client = openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as ei:
        await client.chat.completions.create(model="sim-small", messages=[{"role": "user", "content": "hi"}])
    assert ei.value.status_code == 401
    assert ei.value.code == "invalid_api_key"
    assert "not a spanmeter key" in ei.value.message
    await client.close()


async def test_tenant_key_is_accepted_and_never_sent_upstream(make_proxy, sim, monkeypatch_env):
    monkeypatch_env("OPENAI_API_KEY", "sk-upstream-secret")
    proxy = await make_proxy(tenants={"acme": {"keys": [hash_key(KEY)]}})
    async with openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key=KEY, max_retries=0) as c:
        await c.chat.completions.create(model="sim-small", messages=[{"role": "user", "content": "hi"}])
    sent = {k.lower(): v for k, v in sim.last.headers.items()}
    assert sent["authorization"] == "Bearer sk-upstream-secret"
    assert KEY not in str(sim.last.headers)


async def test_malformed_json_is_400_with_position(proxy):
    status, headers, body = await _post(proxy.url, "/v1/chat/completions", b'{"model": "x", "messages": [}')
    assert status == 400
    assert headers["x-should-retry"] == "false"
    assert body["error"]["code"] == "malformed_body"
    assert "column 29" in body["error"]["message"]


async def test_body_that_is_not_an_object_is_400(proxy):
    status, _, body = await _post(proxy.url, "/v1/chat/completions", b"[1, 2]")
    assert status == 400
    assert "must be a JSON object" in body["error"]["message"]


async def test_unknown_route_is_404_listing_supported_routes(proxy):
    status, _, body = await _post(proxy.url, "/v1/completions", b"{}")
    assert status == 404
    msg = body["error"]["message"]
    assert "POST /v1/chat/completions" in msg and "SPANMETER_ALLOW_PASSTHROUGH" in msg


async def test_body_over_the_limit_is_413(make_proxy):
    proxy = await make_proxy(max_body_bytes=2048)
    status, _, body = await _post(proxy.url, "/v1/chat/completions", b'{"model": "' + b"x" * 4096 + b'"}')
    assert status == 413
    assert "SPANMETER_MAX_BODY_BYTES" in body["error"]["message"]


async def test_unreachable_upstream_is_502(make_proxy):
    proxy = await make_proxy(openai_base_url=f"http://127.0.0.1:{_closed_port()}")
    client = openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="k", max_retries=0)
    with pytest.raises(openai.InternalServerError) as ei:
        await client.chat.completions.create(model="sim-small", messages=[{"role": "user", "content": "hi"}])
    assert ei.value.status_code == 502
    assert "could not connect" in ei.value.message and "SPANMETER_OPENAI_BASE_URL" in ei.value.message
    await client.close()


async def test_upstream_that_stalls_is_504(make_proxy):
    proxy = await make_proxy(read_timeout_s=0.3)
    body = b'{"model": "sim-small", "messages": [{"role": "user", "content": "SCENARIO:stall:3"}]}'
    status, _, body = await _post(proxy.url, "/v1/chat/completions", body)
    assert status == 504
    assert body["error"]["code"] == "upstream_timeout"


async def test_stream_cut_by_upstream_ends_with_the_dialect_error_event(proxy):
    client = openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="k", max_retries=0)
    stream = await client.chat.completions.create(
        model="sim-small", stream=True, messages=[{"role": "user", "content": "SCENARIO:reset:3"}])
    with pytest.raises(openai.APIError) as ei:
        async for _ in stream:
            pass
    assert "closed the connection" in ei.value.message
    await client.close()


def test_open_mode_refuses_a_non_loopback_address():
    with pytest.raises(ConfigError) as ei:
        load_settings(host="0.0.0.0")
    assert "open mode" in ei.value.message and "spanmeter keys create" in ei.value.message


def test_invalid_setting_names_field_source_and_fix(monkeypatch_env):
    monkeypatch_env("SPANMETER_PORT", "eighty")
    with pytest.raises(ConfigError) as ei:
        load_settings()
    assert "port (from environment variable SPANMETER_PORT)" in ei.value.message


def test_unknown_key_in_config_file_is_named(tmp_path, monkeypatch_env):
    cfg = tmp_path / "spanmeter.yaml"
    cfg.write_text("prot: 9000\n")
    monkeypatch_env("SPANMETER_CONFIG", str(cfg))
    with pytest.raises(ConfigError) as ei:
        load_settings()
    assert f"prot (from config file {cfg})" in ei.value.message
