"""The upstream's cookies stay with the answer they came with.

Providers set cookies (OpenAI's Cloudflare front sets `__cf_bm` and `_cfuvid` on API
answers). One pooled client session serves every tenant, so a cookie it kept from one
caller's answer would go upstream on every other caller's calls: one tenant's visitor id
(what Cloudflare rate-limits by) on another's traffic. The session keeps none, and the
caller's own Cookie header does not go upstream either (proxy/serve/upstream.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import openai
import pytest
from aiohttp import web

from proxy.ops.demo import serve_on_free_port


@pytest.fixture
async def cookie_setting_model() -> AsyncIterator[tuple[str, list[dict[str, str]]]]:
    seen: list[dict[str, str]] = []

    async def answer(request: web.Request) -> web.Response:
        seen.append({k.lower(): v for k, v in request.headers.items()})
        resp = web.json_response({
            "id": f"chatcmpl-{len(seen)}", "object": "chat.completion", "created": 1, "model": "gpt-4o-mini",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}})
        resp.headers.add("Set-Cookie", f"_cfuvid=visitor-{len(seen)}; path=/; HttpOnly")
        resp.headers.add("Set-Cookie", "__cf_bm=bm-token; path=/; Max-Age=1800")
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    runner, url = await serve_on_free_port(app)
    # By name, not by address: a cookie jar keeps no cookies of a bare IP address.
    yield url.replace("127.0.0.1", "localhost"), seen
    await runner.cleanup()


async def test_no_cookie_of_one_answer_goes_upstream_with_another_call(make_proxy, cookie_setting_model):
    url, seen = cookie_setting_model
    proxy = await make_proxy(openai_base_url=url)
    for caller in ("tenant-a", "tenant-b", "tenant-b"):
        client = openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key=f"sk-{caller}", max_retries=0,
                                    default_headers={"Cookie": f"mine={caller}"})
        raw = await client.chat.completions.with_raw_response.create(
            model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}])
        assert raw.parse().choices[0].message.content == "ok"
        assert "set-cookie" not in {k.lower() for k in raw.headers}  # nor back to the caller
        await client.close()
    assert len(seen) == 3
    assert [h.get("cookie") for h in seen] == [None, None, None]
