"""The OpenAI-compatible hosts spanmeter knows by name, with the real openai SDK pointed at
`/upstreams/{name}/{the host's own path}`, against a fake that answers with each host's own
usage spellings (tests/fakes/compatible.py). Only the host's base_url is moved to the fake
(`upstreams: {name: {base_url: ...}}`): everything else is the built-in entry."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest

from proxy.config import Settings, hash_key
from proxy.errors import ConfigError
from proxy.ops.demo import serve_on_free_port
from proxy.providers.hosts import HOSTS
from proxy.serve.appkeys import TEL
from proxy.serve.routes import check_upstreams, upstream
from tests.fakes.compatible import FakeHost, create_host
from tests.fixtures.otlp import otlp_receiver  # noqa: F401

MSG = [{"role": "user", "content": "Weather in Oslo?"}]


@pytest.fixture
async def fake() -> AsyncIterator[tuple[FakeHost, str]]:
    host = FakeHost(ran="llama-3.3-70b-versatile")
    runner, url = await serve_on_free_port(create_host(host))
    yield host, url
    await runner.cleanup()


@pytest.fixture
async def via(otlp_receiver, make_proxy, fake):  # noqa: F811
    host, url = fake
    proxy = await make_proxy(otlp_endpoint=otlp_receiver.endpoint,
                             upstreams={name: {"base_url": url} for name in HOSTS})

    async def spans(n: int) -> list[dict[str, Any]]:
        await proxy.settled()
        await asyncio.to_thread(proxy.app[TEL].force_flush)
        return [s for s in await asyncio.to_thread(otlp_receiver.wait_for_spans, n) if s["name"].startswith("chat")]

    return host, proxy, spans


@pytest.mark.parametrize("name", sorted(HOSTS))
async def test_each_built_in_host_on_its_own_path(via, name):
    host, proxy, spans = via
    path = HOSTS[name].example_path.removesuffix("/chat/completions")
    async with openai.AsyncOpenAI(base_url=f"{proxy.url}/upstreams/{name}{path}", api_key="host-key",
                                  max_retries=0) as c:
        await c.chat.completions.create(model="some-model", messages=MSG)
    assert host.seen[-1].path == HOSTS[name].example_path
    assert host.seen[-1].headers["Authorization"] == "Bearer host-key"
    (span,) = await spans(1)
    assert span["attributes"]["gen_ai.provider.name"] == HOSTS[name].provider
    assert (span["attributes"]["gen_ai.usage.input_tokens"], span["attributes"]["gen_ai.usage.output_tokens"]) == (
        120, 30)


async def test_deepseek_with_and_without_v1_and_its_cache_hit_tokens(via):
    host, proxy, spans = via
    host.usage_extra = {"prompt_cache_hit_tokens": 100, "prompt_cache_miss_tokens": 20}
    for base in ("/upstreams/deepseek", "/upstreams/deepseek/v1"):
        async with openai.AsyncOpenAI(base_url=proxy.url + base, api_key="k", max_retries=0) as c:
            await c.chat.completions.create(model="deepseek-chat", messages=MSG)
    assert [s.path for s in host.seen] == ["/chat/completions", "/v1/chat/completions"]
    for span in await spans(2):
        assert span["attributes"]["gen_ai.usage.cache_read.input_tokens"] == 100


async def test_openrouter_is_charged_what_it_billed_and_a_free_model_nothing(via):
    host, proxy, spans = via
    async with openai.AsyncOpenAI(base_url=f"{proxy.url}/upstreams/openrouter/api/v1", api_key="k",
                                  max_retries=0) as c:
        host.usage_extra = {"cost": 0.000123}
        await c.chat.completions.create(model="anthropic/claude-sonnet-4.5", messages=MSG)
        host.usage_extra = {"cost": 0}
        await c.chat.completions.create(model="meta-llama/llama-3.3-70b-instruct:free", messages=MSG)
    billed, free = await spans(2)
    assert billed["attributes"]["spanmeter.cost.usd"] == pytest.approx(0.000123)
    assert free["attributes"]["spanmeter.cost.usd"] == 0


async def test_groq_stream_usage_in_x_groq(via):
    host, proxy, spans = via
    host.groq_stream = True
    async with openai.AsyncOpenAI(base_url=f"{proxy.url}/upstreams/groq/openai/v1", api_key="k",
                                  max_retries=0) as c:
        stream = await c.chat.completions.create(model="llama-3.3-70b-versatile", messages=MSG, stream=True,
                                                 stream_options={"include_usage": False})
        [ch async for ch in stream]
    (span,) = await spans(1)
    assert span["attributes"]["gen_ai.usage.output_tokens"] == 30


async def test_a_tenant_uses_the_hosts_own_key_variable(make_proxy, fake, monkeypatch_env):
    host, url = fake
    monkeypatch_env("GROQ_API_KEY", "groq-upstream-key")
    proxy = await make_proxy(upstreams={"groq": {"base_url": url}},
                             tenants={"acme": {"keys": [hash_key("sm-groq-tenant-0001")]}})
    async with openai.AsyncOpenAI(base_url=f"{proxy.url}/upstreams/groq/openai/v1", api_key="sm-groq-tenant-0001",
                                  max_retries=0) as c:
        await c.chat.completions.create(model="llama-3.3-70b-versatile", messages=MSG)
    assert host.seen[-1].headers["Authorization"] == "Bearer groq-upstream-key"


def test_a_config_entry_overrides_only_the_fields_it_gives():
    s = Settings(upstreams={"groq": {"base_url": "http://127.0.0.1:9"}})
    up = upstream(s, "groq")
    assert up is not None
    assert (up.base_url, up.provider_name, up.key_env) == ("http://127.0.0.1:9", "groq", "GROQ_API_KEY")
    assert upstream(Settings(), "mistral").base_url == "https://api.mistral.ai"
    with pytest.raises(ConfigError, match="no base_url"):
        check_upstreams(Settings(upstreams={"mine": {"dialect": "openai"}}))
    check_upstreams(Settings(tenants={"t": {"keys": [hash_key("sm-x-0001")], "upstream": "groq"}}))
