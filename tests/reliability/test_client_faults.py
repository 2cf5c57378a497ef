"""Client faults: an agent that goes away mid-stream, sends its body slowly, or
pipelines requests on one connection."""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

import aiohttp
import orjson
import pytest

from proxy.serve.appkeys import STORE, UPSTREAM
from tests.reliability.dialects import DIALECTS, Dialect, settled_span


def _host_port(url: str) -> tuple[str, int]:
    u = urlsplit(url)
    return u.hostname or "", u.port or 80


def _request(path: str, body: bytes, run: str, *, length: int | None = None) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: proxy\r\nAuthorization: Bearer k\r\n"
            f"Content-Type: application/json\r\nX-Run-Id: {run}\r\n"
            f"Content-Length: {len(body) if length is None else length}\r\n\r\n").encode() + body


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    status_line = await reader.readline()
    headers: dict[str, str] = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        k, _, v = line.decode().partition(":")
        headers[k.strip().lower()] = v.strip()
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return int(status_line.split()[1]), headers, body


async def _until(predicate, what: str) -> None:
    for _ in range(300):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never happened: {what}")


def _in_use(proxy) -> int:
    # aiohttp's connector keeps the connections handed out in `_acquired`.
    return len(proxy.app[UPSTREAM]._session.connector._acquired)


@pytest.mark.parametrize("d", DIALECTS, ids=lambda d: d.name)
async def test_disconnect_mid_stream_cancels_upstream_settles_and_leaks_nothing(proxy, sim, d: Dialect):
    baseline_tasks = len(asyncio.all_tasks())
    async with aiohttp.ClientSession() as s:
        r = await s.post(proxy.url + d.path(True), json=d.body("SCENARIO:slow:0.05", True),
                         headers={"Authorization": "Bearer k", "X-Run-Id": "gone"})
        await r.content.readany()
        r.close()  # the agent goes away mid-stream
    await _until(lambda: "client_gone" in sim.streams.values(), "the upstream saw the cancel")
    span = await settled_span(proxy, "gone")
    detail = await proxy.app[STORE].spend_detail("default", run_id="gone")
    assert detail.reserved == 0, "settled, not left in flight"
    assert detail.settled > 0, "what the provider generated before the cancel is unknown, not zero"
    assert span["attributes"]["spanmeter.usage.source"] == "estimate"
    await _until(lambda: _in_use(proxy) == 0, "the upstream connection was given back")
    await _until(lambda: len(asyncio.all_tasks()) <= baseline_tasks, "no task outlives the call")


async def test_a_body_sent_in_pieces_is_read_whole(proxy):
    body = orjson.dumps(DIALECTS[0].body("hi", False))
    reader, writer = await asyncio.open_connection(*_host_port(proxy.url))
    writer.write(_request("/v1/chat/completions", body[:10], "pieces", length=len(body)))
    await writer.drain()
    await asyncio.sleep(0.05)
    writer.write(body[10:])
    status, _, answer = await _read_response(reader)
    writer.close()
    assert status == 200, answer
    assert orjson.loads(answer)["choices"][0]["message"]["content"].startswith("Hello!")


@pytest.mark.parametrize("d", DIALECTS, ids=lambda d: d.name)
async def test_a_body_that_trickles_in_is_a_408_in_the_dialect_and_nothing_is_forwarded(make_proxy, sim, d: Dialect):
    proxy = await make_proxy(body_timeout_s=0.2)
    body = orjson.dumps(d.body("hi", False))
    reader, writer = await asyncio.open_connection(*_host_port(proxy.url))
    writer.write(_request(d.path(False), body[:5], "slow-body", length=len(body)))
    for b in body[5:12]:  # a byte every 50 ms: far slower than the timeout allows in total
        await asyncio.sleep(0.05)
        if reader.at_eof():
            break
        writer.write(bytes([b]))
    status, headers, answer = await _read_response(reader)
    writer.close()
    assert status == 408
    assert headers["x-should-retry"] == "false"
    assert "SPANMETER_BODY_TIMEOUT_S" in d.error_message(orjson.loads(answer))
    assert sim.received == []


async def test_pipelined_requests_on_one_connection_are_answered_in_order(proxy, sim):
    d = DIALECTS[0]
    reader, writer = await asyncio.open_connection(*_host_port(proxy.url))
    writer.write(b"".join(_request(d.path(False), orjson.dumps(d.body(f"hi {i}", False)), f"pipe-{i}")
                          for i in range(5)))
    answers = [await _read_response(reader) for _ in range(5)]
    writer.close()
    assert [(s, h["x-spanmeter-run-id"]) for s, h, _ in answers] == [(200, f"pipe-{i}") for i in range(5)]
    assert len(sim.received) == 5


async def test_concurrent_requests_share_one_keep_alive_connection(proxy, sim):
    opened = 0

    async def on_create(*_: object) -> None:
        nonlocal opened
        opened += 1

    trace = aiohttp.TraceConfig()
    trace.on_connection_create_end.append(on_create)
    d = DIALECTS[1]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1), trace_configs=[trace]) as s:

        async def one(i: int) -> int:
            async with s.post(proxy.url + d.path(i % 2 == 0), json=d.body("hi", i % 2 == 0),
                              headers={"Authorization": "Bearer k", "X-Run-Id": f"ka-{i}"}) as r:
                await r.read()
                return r.status

        statuses = await asyncio.gather(*(one(i) for i in range(20)))
    assert statuses == [200] * 20
    assert opened == 1
