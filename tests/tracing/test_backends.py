"""The settings of the README's "Where to look at traces", tried through a running proxy
against a real OTLP receiver: where spans go, with which headers, under which project,
and that a traces-only backend never gets a metrics push."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Iterator

import openai
import pytest

from proxy.serve.appkeys import TEL
from tests.fixtures.otlp import OtlpReceiver


@pytest.fixture
def langfuse_like() -> Iterator[OtlpReceiver]:
    """Langfuse takes OTLP/HTTP under /api/public/otel, with Basic auth of its key pair."""
    receiver = OtlpReceiver(prefix="/api/public/otel").start()
    try:
        yield receiver
    finally:
        receiver.close()


async def one_call(proxy, receiver: OtlpReceiver) -> list[dict]:
    async with openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="k", max_retries=0,
                                  default_headers={"X-Conversation-Id": "conv-7"}) as client:
        await client.chat.completions.create(model="sim-small", messages=[{"role": "user", "content": "hi"}])
    await proxy.settled()
    await asyncio.to_thread(proxy.app[TEL].force_flush)
    # A call without a run id is a run of its own: its call span, then the run's span.
    spans = await asyncio.to_thread(receiver.wait_for_spans, 2)
    return [s for s in spans if s["kind"].endswith("CLIENT")]


async def test_langfuse_settings_reach_its_otel_path_with_basic_auth(langfuse_like, make_proxy, monkeypatch_env):
    auth = base64.b64encode(b"pk-lf-1234:sk-lf-5678").decode()
    monkeypatch_env("OTEL_EXPORTER_OTLP_ENDPOINT", f"{langfuse_like.endpoint}/api/public/otel")
    monkeypatch_env("OTEL_EXPORTER_OTLP_HEADERS", f"Authorization=Basic {auth}")
    proxy = await make_proxy()
    (span,) = await one_call(proxy, langfuse_like)
    assert span["attributes"]["session.id"] == span["attributes"]["gen_ai.conversation.id"] == "conv-7"
    assert langfuse_like.trace_headers[0]["authorization"] == f"Basic {auth}"
    await asyncio.to_thread(proxy.app[TEL].shutdown)  # a metrics reader would push at shutdown
    assert langfuse_like.metric_requests == 0


async def test_phoenix_settings_name_the_project_and_push_no_metrics(otlp_receiver, make_proxy, monkeypatch_env):
    monkeypatch_env("SPANMETER_OTLP_ENDPOINT", otlp_receiver.endpoint)
    monkeypatch_env("SPANMETER_PROJECT_NAME", "support-agents")
    proxy = await make_proxy()
    (span,) = await one_call(proxy, otlp_receiver)
    assert span["resource"]["openinference.project.name"] == "support-agents"
    await asyncio.to_thread(proxy.app[TEL].shutdown)
    assert otlp_receiver.metric_requests == 0


async def test_metrics_go_over_otlp_when_asked(otlp_receiver, make_proxy, monkeypatch_env):
    monkeypatch_env("OTEL_EXPORTER_OTLP_ENDPOINT", otlp_receiver.endpoint)
    monkeypatch_env("OTEL_METRICS_EXPORTER", "otlp")
    proxy = await make_proxy()
    await one_call(proxy, otlp_receiver)
    await asyncio.to_thread(proxy.app[TEL].shutdown)
    assert "gen_ai.client.operation.duration" in otlp_receiver.metric_names()
