"""SSE line ends through the proxy (issue 26.6): an upstream that ends its lines and events
with any mix the SSE spec allows (here LF lines and a CRLF blank line, `\\n\\r\\n`) gets
each event to the client as soon as it is complete, and the span reads the answer."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from proxy.demo import serve_on_free_port
from tests.reliability.dialects import DIALECTS, Dialect, settled_span

DATA = Path(__file__).resolve().parent.parent / "data"
pytestmark = pytest.mark.parametrize("d", DIALECTS, ids=lambda d: d.name)


def _reframed(dialect: str, line: bytes, blank: bytes) -> list[bytes]:
    raw = (DATA / dialect / "text_stream.sse").read_bytes()
    events = [e for e in re.split(rb"\r\n\r\n|\n\n", raw) if e.strip()]
    return [line.join(re.split(rb"\r\n|\r|\n", e)) + line + blank for e in events]


async def test_events_ended_by_lf_then_crlf_reach_the_client_one_by_one_and_the_span_reads_them(
        make_proxy, d: Dialect) -> None:
    events = _reframed(d.name, b"\n", b"\r\n")
    seen = asyncio.Event()
    late: list[int] = []

    async def upstream(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i, event in enumerate(events):
            seen.clear()
            await resp.write(event)
            # The next event waits until the client has this one: a proxy that holds an
            # event back until more bytes come would stall here.
            try:
                await asyncio.wait_for(seen.wait(), 5)
            except TimeoutError:
                late.append(i)
        await resp.write_eof()
        return resp

    body = d.body("hi", True)
    if d.name == "chat":  # asked by the client, the usage chunk is not taken out: every event arrives
        body["stream_options"] = {"include_usage": True}
    app = web.Application()
    app.router.add_post("/{tail:.*}", upstream)
    runner, url = await serve_on_free_port(app)
    try:
        proxy = await make_proxy(openai_base_url=url, anthropic_base_url=url, gemini_base_url=url)
        got = b""
        async with aiohttp.ClientSession() as s, s.post(
                proxy.url + d.path(True), json=body,
                headers={"Authorization": "Bearer sk-caller-key", "X-Run-Id": "crlf"}) as r:
            assert r.status == 200
            async for chunk in r.content.iter_any():
                got += chunk
                if got.endswith(b"\r\n"):
                    seen.set()
        assert late == []
        span = await settled_span(proxy, "crlf")
        attrs = span["attributes"]
        assert attrs["gen_ai.usage.output_tokens"] > 0, attrs
        assert attrs.get("gen_ai.response.finish_reasons"), attrs
    finally:
        await runner.cleanup()
    assert got == b"".join(events)  # every byte the upstream wrote, as it wrote it
