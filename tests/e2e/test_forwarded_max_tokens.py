"""Under a cost ceiling, what is forwarded never allows more output than was reserved
(issue 26.4).

A request's max-token value above the model's cap is reserved at the cap; forwarded as
asked, a compatible server or a provider whose cap grew past the price table would write
(and bill) up to the value asked. The greedy provider here has no cap of its own: each
answer is as long as the forwarded request allows. In every dialect's own field, the
value must arrive as the cap, recorded as a rewrite, and spend must equal what was billed.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson
import pytest

from proxy.appkeys import STORE
from proxy.config import hash_key
from proxy.demo import serve_on_free_port
from tests.fixtures.greedy import GREEDY, create_greedy
from tests.reliability.dialects import settled_span

KEY = "sm-max-tokens-key"
CEILING = 50_000  # micro-USD per run
ASKED = 1_000_000_000
HI = [{"role": "user", "content": "hi"}]
CHAT, RESPONSES, MESSAGES = "/v1/chat/completions", "/v1/responses", "/v1/messages"


def _gemini(stream: bool) -> str:
    return ("/v1beta/models/sim-small:streamGenerateContent?alt=sse" if stream
            else "/v1beta/models/sim-small:generateContent")


# name -> (path(stream), body(stream), the forwarded fields that must hold the cap, the cap)
SHAPES: dict[str, tuple[Any, Any, list[tuple[str, ...]], int]] = {
    "chat max_tokens": (lambda s: CHAT, lambda s: {"model": "gpt-4o-mini", "messages": HI, "max_tokens": ASKED,
                                                   "stream": s}, [("max_tokens",)], 16384),
    "chat max_completion_tokens": (
        lambda s: CHAT, lambda s: {"model": "gpt-4o-mini", "messages": HI, "max_completion_tokens": ASKED,
                                   "stream": s}, [("max_completion_tokens",)], 16384),
    "chat both fields": (
        lambda s: CHAT, lambda s: {"model": "gpt-4o-mini", "messages": HI, "max_tokens": ASKED,
                                   "max_completion_tokens": 20_000, "stream": s},
        [("max_tokens",), ("max_completion_tokens",)], 16384),
    "responses max_output_tokens": (
        lambda s: RESPONSES, lambda s: {"model": "gpt-4o-mini", "input": "hi", "max_output_tokens": ASKED,
                                        "stream": s}, [("max_output_tokens",)], 16384),
    "anthropic max_tokens": (lambda s: MESSAGES, lambda s: {"model": "sim-small", "messages": HI,
                                                            "max_tokens": ASKED, "stream": s},
                             [("max_tokens",)], 4096),
    "gemini generationConfig.maxOutputTokens": (
        _gemini, lambda s: {"contents": [{"role": "user", "parts": [{"text": "hi"}]}],
                            "generationConfig": {"maxOutputTokens": ASKED, "temperature": 0.5}},
        [("generationConfig", "maxOutputTokens")], 4096),
    "gemini generation_config.max_output_tokens": (
        _gemini, lambda s: {"contents": [{"role": "user", "parts": [{"text": "hi"}]}],
                            "generation_config": {"max_output_tokens": ASKED}},
        [("generation_config", "maxOutputTokens")], 4096),
}


@pytest.fixture
async def greedy():
    app = create_greedy()
    app[GREEDY].uncapped = True
    runner, url = await serve_on_free_port(app)
    yield url, app[GREEDY]
    await runner.cleanup()


async def _proxy(make_proxy, monkeypatch_env, url: str, *, ceiling: bool):
    for var in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "GEMINI_API_KEY"):
        monkeypatch_env(var, "sk-upstream")
    policy = {"runs": {"max_cost_usd": CEILING / 1e6}} if ceiling else {}
    return await make_proxy(openai_base_url=url, anthropic_base_url=url, gemini_base_url=url,
                            tenants={"t": {"keys": [hash_key(KEY)], "policy": policy}})


async def _post(url: str, body: dict[str, Any], run: str) -> tuple[int, str, bytes]:
    headers = {"Authorization": f"Bearer {KEY}", "X-Run-Id": run, "anthropic-version": "2023-06-01"}
    async with aiohttp.ClientSession() as s, s.post(url, data=orjson.dumps(body),
                                                    headers={**headers, "Content-Type": "application/json"}) as r:
        return r.status, r.headers.get("x-spanmeter-rewrites", ""), await r.read()


def _at(body: dict[str, Any], path: tuple[str, ...]) -> Any:
    for step in path:
        body = body[step]
    return body


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("shape", list(SHAPES))
async def test_a_max_token_value_above_the_cap_is_forwarded_as_the_cap(shape, stream, make_proxy, monkeypatch_env,
                                                                        greedy):
    url, provider = greedy
    proxy = await _proxy(make_proxy, monkeypatch_env, url, ceiling=True)
    path, body, fields, cap = SHAPES[shape]
    status, rewrites, answer = await _post(proxy.url + path(stream), body(stream), "capped")
    assert status == 200, answer[:300]
    sent = provider.bodies[-1]
    assert [_at(sent, f) for f in fields] == [cap] * len(fields), sent
    assert f"max_tokens_capped={ASKED}->{cap}" in rewrites.split(", ")
    await proxy.settled()
    spend = await proxy.app[STORE].spend("t", run_id="capped")
    assert 0 < spend == provider.billed_micros <= CEILING
    span = await settled_span(proxy, "capped")
    assert f"max_tokens_capped={ASKED}->{cap}" in span["attributes"]["spanmeter.rewrites"]
    # Everything but the max-token value went as it came (chat streams: usage asked for).
    sent.pop("stream_options", None)
    for f in fields:
        holder = _at(sent, f[:-1])
        holder.pop(f[-1])
    given = body(stream)
    for f in fields:
        holder = _at(given, f[:-1])
        holder.pop(f[-1], None)
        holder.pop("max_output_tokens", None)
    assert sent == given


async def test_a_value_within_the_cap_goes_as_sent(make_proxy, monkeypatch_env, greedy):
    url, provider = greedy
    capped = await _proxy(make_proxy, monkeypatch_env, url, ceiling=True)
    body = {"model": "gpt-4o-mini", "messages": HI, "max_tokens": 300}
    status, rewrites, _ = await _post(capped.url + CHAT, body, "within")
    assert (status, rewrites, provider.bodies[-1]) == (200, "", body)


async def test_any_value_without_a_cost_ceiling_goes_as_sent(make_proxy, monkeypatch_env, greedy):
    url, provider = greedy
    free = await _proxy(make_proxy, monkeypatch_env, url, ceiling=False)
    body = {"model": "sim-small", "messages": HI, "max_tokens": ASKED}
    status, rewrites, _ = await _post(free.url + MESSAGES, body, "free")
    assert status == 200 and "max_tokens_capped" not in rewrites
    assert provider.bodies[-1] == body
