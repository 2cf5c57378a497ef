"""Azure OpenAI through spanmeter with the real openai SDK (`AzureOpenAI`, and `OpenAI` on the
v1 API) against a fake that answers as Azure does (tests/fakes/compatible.py): the route as
the SDK sends it, the api-version passed on, the key in `api-key`, the deployment priced as
the model it runs and charged as the model the answer names."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest

from proxy.config import hash_key
from proxy.ops.demo import serve_on_free_port
from proxy.pricing import PriceTable
from proxy.serve.appkeys import DEPLOYMENTS, TEL
from tests.fakes.compatible import FakeHost, create_host
from tests.fixtures.otlp import otlp_receiver  # noqa: F401

MSG = [{"role": "user", "content": "Weather in Oslo?"}]
TENANT_KEY = "sm-azure-tenant-key-0001"


@pytest.fixture
async def azure() -> AsyncIterator[tuple[FakeHost, str]]:
    host = FakeHost(azure=True)
    runner, url = await serve_on_free_port(create_host(host))
    yield host, url
    await runner.cleanup()


@pytest.fixture
async def traced(otlp_receiver, make_proxy, azure):  # noqa: F811
    host, url = azure

    async def make(**settings: Any) -> tuple[Any, Any]:
        proxy = await make_proxy(azure_openai_base_url=url, otlp_endpoint=otlp_receiver.endpoint, **settings)

        async def spans(n: int) -> list[dict[str, Any]]:
            await proxy.settled()
            await asyncio.to_thread(proxy.app[TEL].force_flush)
            return [s for s in await asyncio.to_thread(otlp_receiver.wait_for_spans, n)
                    if s["name"].startswith("chat")]

        return proxy, spans

    return host, make


def _azure(url: str, version: str = "2024-10-21", **kw: Any) -> openai.AsyncAzureOpenAI:
    return openai.AsyncAzureOpenAI(azure_endpoint=url, api_version=version, max_retries=0,
                                   **{"api_key": "azure-caller-key", **kw})


def _usd(price_model: str, tokens_in: int, tokens_out: int) -> float:
    p = PriceTable.load().price(price_model)
    assert p is not None
    return -(-(tokens_in * p.input + tokens_out * p.output) // 1_000_000) / 1e6


async def test_azure_openai_sdk_reaches_its_deployment_and_is_charged_as_the_model_that_ran(traced):
    host, make = traced
    proxy, spans = await make()
    async with _azure(proxy.url) as c:
        got = await c.chat.completions.create(model="prod-chat", messages=MSG)
    assert got.choices[0].message.content == "It is sunny."
    seen = host.seen[-1]
    assert seen.path == "/openai/deployments/prod-chat/chat/completions"
    assert seen.query == "api-version=2024-10-21"
    assert seen.headers.get("api-key") == "azure-caller-key"
    (span,) = await spans(1)
    a = span["attributes"]
    assert a["gen_ai.provider.name"] == "azure.ai.openai"
    assert a["gen_ai.request.model"] == "prod-chat"
    assert a["gen_ai.response.model"] == "gpt-4.1-mini-2025-04-14"
    assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"]) == (120, 30)
    assert a["spanmeter.cost.usd"] == pytest.approx(_usd("gpt-4.1-mini-2025-04-14", 120, 30))


async def test_a_stream_gets_its_usage_where_the_api_version_takes_stream_options(traced):
    host, make = traced
    proxy, spans = await make()
    for version, injected in (("2024-10-21", True), ("2024-02-01", False)):
        async with _azure(proxy.url, version) as c:
            stream = await c.chat.completions.create(model="prod-chat", messages=MSG, stream=True)
            chunks = [ch async for ch in stream]
        assert ("stream_options" in host.seen[-1].body) is injected, version
        # The client did not ask for usage: it never sees the usage chunk (every chunk it gets
        # is one it would get from Azure directly; the first has no choices, as Azure sends).
        assert all(ch.usage is None for ch in chunks)
        assert chunks[0].model == ""
    new, old = await spans(2)
    assert (new["attributes"]["gen_ai.usage.output_tokens"], new["attributes"]["spanmeter.usage.source"]) == (
        30, "reported")
    # An old api-version cannot report a stream's usage: without a price for the deployment's
    # model yet... it was learned from the first call, so the cut-off usage settles at the reservation.
    assert old["attributes"]["spanmeter.usage.source"] == "estimate"
    assert old["attributes"]["spanmeter.cost.usd"] > 0


async def test_the_v1_api_and_an_entra_token_reach_azure_as_sent(traced):
    host, make = traced
    proxy, spans = await make()
    token = "eyJhbGciOiJSUzI1NiJ9.eyJhdWQiOiJjb2duaXRpdmVzZXJ2aWNlcyJ9.c2lnbmF0dXJl"
    async with openai.AsyncOpenAI(base_url=f"{proxy.url}/openai/v1", api_key=token, max_retries=0) as c:
        await c.chat.completions.create(model="prod-chat", messages=MSG)
    seen = host.seen[-1]
    assert seen.path == "/openai/v1/chat/completions"
    assert seen.headers.get("Authorization") == f"Bearer {token}"
    assert "api-key" not in seen.headers
    (span,) = await spans(1)
    assert span["attributes"]["gen_ai.request.model"] == "prod-chat"


async def test_embeddings_on_a_deployment(traced):
    host, make = traced
    proxy, _ = await make()
    async with _azure(proxy.url) as c:
        got = await c.embeddings.create(model="embed-prod", input="hello")
    assert got.usage.prompt_tokens == 8
    assert host.seen[-1].path == "/openai/deployments/embed-prod/embeddings"


async def test_tenant_mode_sends_the_tenants_azure_key_and_never_the_spanmeter_key(traced, monkeypatch_env):
    host, make = traced
    monkeypatch_env("AZURE_OPENAI_API_KEY", "azure-upstream-key")
    proxy, _ = await make(tenants={"acme": {"keys": [hash_key(TENANT_KEY)]}})
    async with _azure(proxy.url, api_key=TENANT_KEY) as c:
        await c.chat.completions.create(model="prod-chat", messages=MSG)
    headers = host.seen[-1].headers
    assert headers.get("api-key") == "azure-upstream-key"
    assert TENANT_KEY not in str(headers)


async def test_under_a_cost_ceiling_an_unknown_deployment_is_refused_naming_the_setting(traced):
    host, make = traced
    policy = {"runs": {"max_cost_usd": 1.0}}
    proxy, _ = await make(policy=policy)
    async with _azure(proxy.url) as c:
        with pytest.raises(openai.APIStatusError) as refused:
            await c.chat.completions.create(model="fresh-deployment", messages=MSG)
    assert refused.value.status_code == 402
    assert "azure_deployments" in refused.value.message
    assert not host.seen
    # Mapped, the same call is reserved at the model the deployment runs, and goes.
    proxy, _ = await make(policy=policy, azure_deployments={"fresh-deployment": "gpt-4.1-mini"})
    async with _azure(proxy.url) as c:
        await c.chat.completions.create(model="fresh-deployment", messages=MSG)
    assert host.seen[-1].path == "/openai/deployments/fresh-deployment/chat/completions"


async def test_a_deployment_is_learned_from_its_answer_without_a_ceiling(traced):
    _, make = traced
    proxy, _ = await make()
    async with _azure(proxy.url) as c:
        await c.chat.completions.create(model="learnt", messages=MSG)
    await proxy.settled()
    assert proxy.app[DEPLOYMENTS].model("learnt") == "gpt-4.1-mini-2025-04-14"


async def test_the_path_deployment_is_what_is_metered_whatever_the_body_says(traced):
    host, make = traced
    proxy, spans = await make()
    async with _azure(proxy.url, azure_deployment="path-deployment") as c:
        await c.chat.completions.create(model="body-model", messages=MSG)
    assert host.seen[-1].path == "/openai/deployments/path-deployment/chat/completions"
    (span,) = await spans(1)
    assert span["attributes"]["gen_ai.request.model"] == "path-deployment"


async def test_without_an_azure_endpoint_the_caller_is_told_what_to_set(make_proxy):
    proxy = await make_proxy()
    async with _azure(proxy.url) as c:
        with pytest.raises(openai.APIStatusError) as failed:
            await c.chat.completions.create(model="prod-chat", messages=MSG)
    assert "SPANMETER_AZURE_OPENAI_BASE_URL" in failed.value.message
