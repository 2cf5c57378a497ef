"""Upstream faults through the proxy, in all four dialects: what the agent sees, what
the ledger records, what the span says. See docs/reliability.md for the table."""

from __future__ import annotations

import gzip
import socket

import aiohttp
import orjson
import pytest

from proxy.serve.appkeys import STORE
from tests.reliability.dialects import DIALECTS, Dialect, post, settled_span

pytestmark = pytest.mark.parametrize("d", DIALECTS, ids=lambda d: d.name)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _spend(proxy, run: str) -> int:
    return await proxy.app[STORE].spend("default", run_id=run)


async def _reserved(proxy, run: str) -> int:
    return (await proxy.app[STORE].spend_detail("default", run_id=run)).reserved


def _last_event(body: bytes) -> bytes:
    events = [e for e in body.replace(b"\r\n", b"\n").split(b"\n\n") if e.strip()]
    return events[-1]


async def test_connection_refused_is_502_and_charges_nothing(make_proxy, d: Dialect):
    closed = f"http://127.0.0.1:{_closed_port()}"
    proxy = await make_proxy(openai_base_url=closed, anthropic_base_url=closed, gemini_base_url=closed)
    r = await post(proxy.url, d.path(False), d.body("hi", False), headers={"X-Run-Id": "refused"})
    assert r.status == 502
    assert "could not connect" in d.error_message(orjson.loads(r.body))
    span = await settled_span(proxy, "refused")
    assert await _spend(proxy, "refused") == 0
    assert span["attributes"]["error.type"] == "spanmeter.upstream_unreachable"
    assert span["status"] == "ERROR"


async def test_reset_mid_stream_ends_with_the_dialects_error_event(proxy, d: Dialect):
    r = await post(proxy.url, d.path(True), d.body("SCENARIO:reset:3", True), headers={"X-Run-Id": "reset"})
    assert r.status == 200
    assert _last_event(r.body).startswith(d.error_event), r.body[-300:]
    assert b"closed the connection" in _last_event(r.body)
    span = await settled_span(proxy, "reset")
    assert await _reserved(proxy, "reset") == 0, "the call is settled, not left in flight"
    assert await _spend(proxy, "reset") > 0, "a cut stream is charged: unknown is not zero"
    assert span["attributes"]["error.type"] == "spanmeter.upstream_protocol_error"


async def test_slow_headers_are_a_504_charged_at_the_reservation(make_proxy, d: Dialect):
    proxy = await make_proxy(read_timeout_s=0.3)
    for stream in (False, True):
        run = f"stall-{stream}"
        r = await post(proxy.url, d.path(stream), d.body("SCENARIO:stall:3", stream), headers={"X-Run-Id": run})
        assert r.status == 504
        assert "did not answer in time" in d.error_message(orjson.loads(r.body))
        span = await settled_span(proxy, run)
        assert span["attributes"]["error.type"] == "spanmeter.upstream_timeout"
        assert span["attributes"]["spanmeter.usage.source"] == "estimate"
        # The request reached the provider, which may bill it: unknown is not zero.
        assert await _reserved(proxy, run) == 0
        assert await _spend(proxy, run) > 0


async def test_body_that_stalls_mid_stream_ends_with_a_timeout_error_event(make_proxy, sim, d: Dialect):
    proxy = await make_proxy(read_timeout_s=0.3)
    r = await post(proxy.url, d.path(True), d.body("SCENARIO:hang:2", True), headers={"X-Run-Id": "hang"})
    assert r.status == 200
    assert _last_event(r.body).startswith(d.error_event)
    assert b"did not answer in time" in _last_event(r.body)
    span = await settled_span(proxy, "hang")
    assert await _reserved(proxy, "hang") == 0 and await _spend(proxy, "hang") > 0
    assert span["attributes"]["error.type"] == "spanmeter.upstream_timeout"


async def test_5xx_passes_through_unchanged_and_charges_nothing(proxy, sim, d: Dialect):
    body = d.body("SCENARIO:error:503", False)
    direct = await post(sim.url, d.path(False), body)
    via = await post(proxy.url, d.path(False), body, headers={"X-Run-Id": "5xx"})
    assert (via.status, via.body) == (direct.status, direct.body) == (503, direct.body)
    span = await settled_span(proxy, "5xx")
    assert await _spend(proxy, "5xx") == 0
    assert span["attributes"]["error.type"] == "503"


async def test_invalid_json_body_is_forwarded_unchanged_and_charged_at_the_reservation(proxy, sim, d: Dialect):
    body = d.body("SCENARIO:garbage", False)
    direct = await post(sim.url, d.path(False), body)
    via = await post(proxy.url, d.path(False), body, headers={"X-Run-Id": "garbage"})
    assert (via.status, via.body) == (200, direct.body)
    span = await settled_span(proxy, "garbage")
    assert await _reserved(proxy, "garbage") == 0
    assert await _spend(proxy, "garbage") > 0
    assert span["attributes"]["spanmeter.usage.source"] == "estimate"
    assert span["attributes"]["spanmeter.observer.notes"] == ["unparsed_body"]


async def test_invalid_sse_events_are_forwarded_unchanged_and_usage_still_counts(proxy, sim, d: Dialect):
    body = d.body("SCENARIO:garbage", True)
    if d.name == "chat":
        body["stream_options"] = {"include_usage": True}  # so no rewrite: bytes compare directly
    direct = await post(sim.url, d.path(True), body)
    via = await post(proxy.url, d.path(True), body, headers={"X-Run-Id": "junk"})
    assert (via.status, via.body) == (200, direct.body)
    assert b"\xff\xfe" in via.body
    span = await settled_span(proxy, "junk")
    assert span["attributes"]["spanmeter.usage.source"] == "reported"
    assert span["attributes"]["gen_ai.usage.output_tokens"] > 0
    assert "error.type" not in span["attributes"]
    assert span["attributes"]["spanmeter.observer.notes"] == ["unparsed_event"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_gzip_response_reaches_the_client_decoded_without_a_stale_encoding(proxy, sim, d: Dialect, stream):
    plain = await post(sim.url, d.path(stream), d.body("hi", stream) | _usage_opt(d, stream))
    async with aiohttp.ClientSession(auto_decompress=False) as s, s.post(
            proxy.url + d.path(stream), json=d.body("SCENARIO:gzip", stream) | _usage_opt(d, stream),
            headers={"Authorization": "Bearer k", "X-Run-Id": "gz"}) as r:
        raw, headers = await r.read(), r.headers
    assert r.status == 200
    assert "Content-Encoding" not in headers
    assert not raw.startswith(b"\x1f\x8b")
    if not stream:
        assert int(headers["Content-Length"]) == len(raw)
        orjson.loads(raw)
    # Same answer as the uncompressed scenario, apart from the ids derived from the request.
    assert len(raw) == len(plain.body) or raw.count(b"\n\n") == plain.body.count(b"\n\n")
    span = await settled_span(proxy, "gz")
    assert span["attributes"]["spanmeter.usage.source"] == "reported"
    assert "error.type" not in span["attributes"]
    assert gzip.decompress(gzip.compress(raw)) == raw


async def test_an_encoding_the_proxy_cannot_decode_is_a_clean_502(proxy, sim, d: Dialect):
    r = await post(proxy.url, d.path(False), d.body("SCENARIO:br", False), headers={"X-Run-Id": "br"})
    assert r.status == 502
    assert "broke the protocol" in d.error_message(orjson.loads(r.body))
    # aiohttp checks the encoding with the headers, so a stream fails before it starts: a 502 too.
    s = await post(proxy.url, d.path(True), d.body("SCENARIO:br", True), headers={"X-Run-Id": "br-s"})
    assert s.status == 502 and orjson.loads(s.body)
    span = await settled_span(proxy, "br-s")
    assert span["attributes"]["error.type"] == "spanmeter.upstream_protocol_error"
    assert await _spend(proxy, "br-s") > 0, "the upstream did answer: it may bill the call"
    # spanmeter only advertises encodings it can decode.
    advertised = {k.lower(): v for k, v in sim.last.headers.items()}.get("accept-encoding", "")
    assert "br" not in advertised


def _usage_opt(d: Dialect, stream: bool) -> dict:
    return {"stream_options": {"include_usage": True}} if d.name == "chat" and stream else {}


async def test_a_cut_stream_is_charged_its_reservation_even_after_partial_usage(proxy, d: Dialect):
    # Anthropic's message_start says output_tokens=1 and Gemini sends running counts:
    # neither is the final count, so a cut stream must not be charged as if it were.
    r = await post(proxy.url, d.path(True), d.body("SCENARIO:reset:3", True), headers={"X-Run-Id": "partial"})
    assert r.status == 200
    span = await settled_span(proxy, "partial")
    assert span["attributes"]["spanmeter.usage.source"] == "estimate"
    detail = await proxy.app[STORE].spend_detail("default", run_id="partial")
    assert detail.reserved == 0 and detail.settled > 0
