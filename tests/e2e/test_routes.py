"""Routes beyond the basics: embeddings, named upstreams, Gemini ?key=, Anthropic betas."""

from __future__ import annotations

import aiohttp
import anthropic
import openai
import pytest

from proxy.config import hash_key
from proxy.ops.demo import serve_on_free_port
from proxy.serve.appkeys import STORE
from proxy.simulator import RECEIVED, create_simulator

KEY = "sm-routes-key-01"


async def test_embeddings_are_metered(make_proxy, sim, monkeypatch_env):
    monkeypatch_env("OPENAI_API_KEY", "sk-up")
    proxy = await make_proxy(tenants={"acme": {"keys": [hash_key(KEY)], "policy": {"budgets": {"daily_usd": 1}}}})
    async with openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key=KEY,
                                  default_headers={"X-Run-Id": "emb"}) as c:
        out = await c.embeddings.create(model="text-embedding-3-small", input=["hello world", "second text"])
    assert len(out.data) == 2 and out.usage.prompt_tokens > 0
    await proxy.settled()
    assert await proxy.app[STORE].spend("acme", run_id="emb") > 0


async def test_named_upstream_by_path_prefix_and_by_tenant(make_proxy, sim, monkeypatch_env):
    other = create_simulator()
    runner, other_url = await serve_on_free_port(other)
    monkeypatch_env("LOCAL_KEY", "sk-local")
    monkeypatch_env("OPENAI_API_KEY", "sk-up")
    proxy = await make_proxy(
        upstreams={"local": {"dialect": "openai", "base_url": other_url, "key_env": "LOCAL_KEY"}},
        tenants={"acme": {"keys": [hash_key(KEY)]}, "lab": {"keys": [hash_key("sm-lab-key-01")], "upstream": "local"}})
    msgs = [{"role": "user", "content": "hi"}]
    async with openai.AsyncOpenAI(base_url=f"{proxy.url}/upstreams/local/v1", api_key=KEY) as c:
        await c.chat.completions.create(model="sim-small", messages=msgs)
    async with openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="sm-lab-key-01") as c:
        await c.chat.completions.create(model="sim-small", messages=msgs)
    async with openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key=KEY) as c:
        await c.chat.completions.create(model="sim-small", messages=msgs)
    local = list(other[RECEIVED])
    assert [r.path for r in local] == ["/v1/chat/completions"] * 2
    assert all(r.headers["Authorization"] == "Bearer sk-local" for r in local)
    assert len(sim.received) == 1 and sim.last.headers["Authorization"] == "Bearer sk-up"
    await runner.cleanup()


async def test_gemini_key_in_query_is_accepted_and_not_forwarded(make_proxy, sim, monkeypatch_env):
    monkeypatch_env("GEMINI_API_KEY", "AIza-upstream")
    proxy = await make_proxy(tenants={"acme": {"keys": [hash_key(KEY)]}})
    body = {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]}
    async with aiohttp.ClientSession() as s, s.post(
            f"{proxy.url}/v1beta/models/gemini-2.5-flash:streamGenerateContent?alt=sse&key={KEY}", json=body) as r:
        assert r.status == 200
        text = await r.text()
    assert text.startswith("data: ") and "[DONE]" not in text
    assert sim.last.query == "alt=sse"
    assert sim.last.headers["x-goog-api-key"] == "AIza-upstream"


async def test_anthropic_beta_query_and_headers_pass_through(proxy, sim):
    client = anthropic.AsyncAnthropic(base_url=proxy.url, api_key="k")
    await client.beta.messages.create(model="claude-sonnet-5-5", max_tokens=50, betas=["files-api-2025-04-14"],
                                      messages=[{"role": "user", "content": "hi"}])
    assert sim.last.headers["anthropic-beta"] == "files-api-2025-04-14"
    assert "anthropic-version" in {k.lower() for k in sim.last.headers}
    await client.close()
    # Older SDKs mark beta calls with ?beta=true: the query reaches the upstream as sent.
    body = {"model": "claude-sonnet-5-5", "max_tokens": 20, "messages": [{"role": "user", "content": "hi"}]}
    headers = {"x-api-key": "k", "anthropic-version": "2023-06-01"}
    async with aiohttp.ClientSession() as s, s.post(f"{proxy.url}/v1/messages?beta=true", headers=headers,
                                                    json=body) as r:
        assert r.status == 200
    assert sim.last.query == "beta=true" and sim.last.headers["x-api-key"] == "k"


@pytest.mark.parametrize(("path", "says"), [
    ("/chat/completions", "Add /v1: the SDK's base URL must end in /v1"),
    ("/responses", "so that it calls /v1/responses"),
    ("/v1/v1/messages", "The path starts with /v1 twice"),
])  # fmt: skip
async def test_a_base_url_without_v1_gets_a_404_that_says_add_v1(proxy, path: str, says: str) -> None:
    import aiohttp

    async with aiohttp.ClientSession() as s, s.post(proxy.url + path, json={"model": "m"},
                                                    headers={"Authorization": "Bearer sk-x"}) as r:
        body = await r.json()
    assert r.status == 404 and says in body["error"]["message"]


async def test_an_unreachable_upstream_points_at_the_offline_demo(make_proxy) -> None:
    from tests.fixtures.otlp import closed_endpoint

    proxy = await make_proxy(openai_base_url=closed_endpoint())
    client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="sk-none", max_retries=0)
    with pytest.raises(openai.APIStatusError) as caught:
        await client.chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}])
    assert caught.value.status_code == 502
    assert "`spanmeter demo` runs an agent through spanmeter offline" in str(caught.value.message)
