"""spanmeter's error bodies, served over real HTTP, raise each SDK's usual exception
carrying spanmeter's message (clients.md section 6)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import anthropic
import openai
import pytest
from aiohttp import web
from google import genai
from google.genai import errors as genai_errors
from google.genai import types

from proxy.errors import (
    BodyTooLarge,
    CeilingReached,
    ProxyError,
    Unauthorized,
    UnknownRoute,
    UpstreamTimeout,
)
from proxy.providers.anthropic import ANTHROPIC, anthropic_error_type
from proxy.providers.chat import CHAT
from proxy.providers.gemini import GEMINI, google_status
from proxy.providers.responses import RESPONSES
from tests.providers.cases import ApiObject

BUDGET = CeilingReached("Run R has spent $5.02 of its $5.00 limit. Raise the run budget "
                        "(PROXY_LIMITS__RUN_COST_USD) or start a new run.", limit="run_cost")
ERRORS: list[ProxyError] = [
    Unauthorized("Unknown spanmeter key sk-sm-...abcd. Create one with `spanmeter keys add`."),
    BUDGET,
    UnknownRoute("No route for POST /v1/nothing. Supported: /v1/chat/completions, ..."),
    BodyTooLarge("The body is 12 MB; the limit is 10 MB (PROXY_MAX_BODY_MB)."),
    UpstreamTimeout("The upstream did not answer within 60 s (PROXY_UPSTREAM__TIMEOUT_S)."),
]


@dataclass
class Reply:
    """What the fake serves next: a status and a body, or a 200 stream ending in `body`."""

    status: int = 200
    body: bytes = b""
    headers: dict[str, str] | None = None
    stream: bool = False


class ErrorServer:
    def __init__(self) -> None:
        self.reply = Reply()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        r = self.reply
        if not r.stream:
            return web.Response(status=r.status, body=r.body, headers=r.headers,
                                content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(r.body)
        await resp.write_eof()
        return resp


@pytest.fixture
async def server() -> AsyncIterator[tuple[ErrorServer, str]]:
    fake = ErrorServer()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", fake.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]  # the port the OS gave: aiohttp's public view of it
    yield fake, f"http://127.0.0.1:{port}"
    await runner.cleanup()


def _serve(fake: ErrorServer, adapter: ApiObject, error: ProxyError) -> None:
    fake.reply = Reply(error.status, adapter.render_error(error, "req_spanmeter_1"),
                       error.headers())


OPENAI_CLASSES = {401: openai.AuthenticationError, 402: openai.APIStatusError,
                  404: openai.NotFoundError, 413: openai.APIStatusError,
                  504: openai.InternalServerError}
ANTHROPIC_CLASSES = {401: anthropic.AuthenticationError, 402: anthropic.PaymentRequiredError,
                     404: anthropic.NotFoundError, 413: anthropic.RequestTooLargeError,
                     504: anthropic.GatewayTimeoutError}


def _ids(e: ProxyError) -> str:
    return f"{e.status} {type(e).__name__}"


@pytest.mark.parametrize("error", ERRORS, ids=_ids)
async def test_openai_chat_raises_its_usual_class_with_our_message(server, error) -> None:
    fake, base = server
    _serve(fake, CHAT, error)
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="k", max_retries=0)
    with pytest.raises(openai.APIStatusError) as info:
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert type(info.value) is OPENAI_CLASSES[error.status]
    assert error.message in str(info.value)
    assert info.value.code == error.code


@pytest.mark.parametrize("error", ERRORS, ids=_ids)
async def test_openai_responses_raises_its_usual_class_with_our_message(server, error) -> None:
    fake, base = server
    _serve(fake, RESPONSES, error)
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="k", max_retries=0)
    with pytest.raises(openai.APIStatusError) as info:
        await client.responses.create(model="m", input="x")
    assert type(info.value) is OPENAI_CLASSES[error.status]
    assert error.message in str(info.value)


@pytest.mark.parametrize("error", ERRORS, ids=_ids)
async def test_anthropic_raises_its_usual_class_with_our_message(server, error) -> None:
    fake, base = server
    _serve(fake, ANTHROPIC, error)
    client = anthropic.AsyncAnthropic(base_url=base, api_key="k", max_retries=0)
    with pytest.raises(anthropic.APIStatusError) as info:
        await client.messages.create(model="claude-sonnet-5-5", max_tokens=10,
                                     messages=[{"role": "user", "content": "x"}])
    assert type(info.value) is ANTHROPIC_CLASSES[error.status]
    assert error.message in str(info.value)
    body: Any = info.value.body
    assert body["error"]["type"] == anthropic_error_type(error)
    assert body["request_id"] == "req_spanmeter_1"


@pytest.mark.parametrize("error", ERRORS, ids=_ids)
async def test_google_genai_raises_client_or_server_error_with_our_message(server, error) -> None:
    fake, base = server
    _serve(fake, GEMINI, error)
    client = genai.Client(api_key="k", http_options=types.HttpOptions(base_url=base))
    expected = genai_errors.ClientError if error.status < 500 else genai_errors.ServerError
    with pytest.raises(expected) as info:
        await client.aio.models.generate_content(model="gemini-2.5-flash", contents="x")
    assert info.value.code == error.status
    assert info.value.message == error.message
    assert info.value.status == google_status(error)


async def test_a_chat_stream_error_raises_api_error_with_our_message(server) -> None:
    fake, base = server
    fake.reply = Reply(body=CHAT.render_stream_error(BUDGET), stream=True)
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="k", max_retries=0)
    with pytest.raises(openai.APIError, match="Run R has spent"):
        async for _ in await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}], stream=True
        ):
            pass


async def test_a_responses_stream_error_is_yielded_as_an_error_event(server) -> None:
    # The bare openai SDK yields ResponseErrorEvent rather than raising (clients.md 6).
    fake, base = server
    fake.reply = Reply(body=RESPONSES.render_stream_error(BUDGET), stream=True)
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="k", max_retries=0)
    events = [e async for e in await client.responses.create(model="m", input="x", stream=True)]
    assert [(e.type, e.code, e.message) for e in events] == [
        ("error", "budget_exceeded", BUDGET.message)]


async def test_an_anthropic_stream_error_raises_with_our_message(server) -> None:
    fake, base = server
    fake.reply = Reply(body=ANTHROPIC.render_stream_error(BUDGET), stream=True)
    client = anthropic.AsyncAnthropic(base_url=base, api_key="k", max_retries=0)
    with pytest.raises(anthropic.APIStatusError, match="Run R has spent"):
        async with client.messages.stream(model="claude-sonnet-5-5", max_tokens=10,
                                          messages=[{"role": "user", "content": "x"}]) as s:
            await s.get_final_message()


async def test_a_gemini_stream_error_raises_client_error_with_our_message(server) -> None:
    fake, base = server
    fake.reply = Reply(body=GEMINI.render_stream_error(BUDGET), stream=True)
    client = genai.Client(api_key="k", http_options=types.HttpOptions(base_url=base))
    with pytest.raises(genai_errors.ClientError) as info:
        async for _ in await client.aio.models.generate_content_stream(
            model="gemini-2.5-flash", contents="x"
        ):
            pass
    assert info.value.code == 402
    assert info.value.message == BUDGET.message
