"""Moves the upstream response to the client through the call's answer reader: the I/O
and the timings live here, everything about the wire format's bytes in the reader
(`Relayed`: a model call's proxy/providers/translator.py `Answer`, an MCP request's
proxy/mcp/wire.py `Reader`).

Bytes go to the client before they are observed only in the sense that observation never
delays or fails the write. Streams are forwarded event by event, as soon as each event is
complete; everything read in one upstream chunk goes out in one write.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from typing import Protocol

from aiohttp import web
from multidict import CIMultiDict

from proxy.errors import ProxyError
from proxy.model import Rewrite
from proxy.serve.upstream import UpstreamResponse, response_headers

__all__ = ["Relayed", "relay"]


class Stamped(Protocol):
    rewrites: list[Rewrite]  # announced in x-spanmeter-rewrites


class Feed(Protocol):
    """An answer's stream reader: the bytes to send for each chunk, at the end, and on a cut."""

    def feed(self, chunk: bytes) -> bytes: ...
    def flush(self) -> bytes: ...
    def release(self) -> bytes: ...


class Relayed(Protocol):
    """What the relay needs of an answer's reader, whatever its wire format: it reads the
    answer whole (`body`) or chunk by chunk (`stream`), ends a cut stream in its own words
    (`cut`), and keeps what the relay learnt."""

    status: int
    complete: bool
    first_chunk_s: float | None
    chunk_gaps_s: list[float]

    @property
    def hooks(self) -> Stamped: ...
    def read_headers(self, headers: Mapping[str, str]) -> None: ...
    def body(self, raw: bytes) -> bytes: ...
    def stream(self) -> Feed: ...
    def cut(self, exc: ProxyError) -> bytes: ...


async def relay(
    request: web.Request, upstream: UpstreamResponse, answer: Relayed, extra_headers: dict[str, str], started: float,
    *, errors_inside: bool = False,
) -> web.StreamResponse:
    """`errors_inside`: the wire format answers failures in the body whatever the status
    (JSON-RPC), so the reader reads an error status's body too; a model API's error body
    passes untouched."""
    headers = response_headers(upstream.headers)
    headers.update(extra_headers)
    answer.status = upstream.status
    answer.read_headers(upstream.headers)
    read = errors_inside or upstream.status < 300
    if upstream.is_stream and read:
        return await _stream(request, upstream, answer, headers, started)
    return await _whole(upstream, answer, headers, read)


async def _whole(upstream: UpstreamResponse, answer: Relayed, headers: CIMultiDict[str],
                 read: bool) -> web.StreamResponse:
    raw = await upstream.read()
    if read:
        raw = answer.body(raw)
    _stamp(headers, answer.hooks)
    answer.complete = True
    return web.Response(body=raw, status=upstream.status, headers=headers)


async def _stream(
    request: web.Request, upstream: UpstreamResponse, answer: Relayed, headers: CIMultiDict[str], started: float,
) -> web.StreamResponse:
    # Headers leave before the body, so rewrites decided up front are all that can be
    # listed here; stream repairs are recorded on the span.
    _stamp(headers, answer.hooks)
    resp = web.StreamResponse(status=upstream.status, headers=headers)
    await resp.prepare(request)
    stream = answer.stream()
    gaps = answer.chunk_gaps_s
    last = 0.0
    try:
        async for chunk in upstream.chunks():
            now = time.perf_counter()
            if answer.first_chunk_s is None:
                answer.first_chunk_s = now - started
            else:
                gaps.append(now - last)
            last = now
            out = stream.feed(chunk)
            if out:
                await resp.write(out)
        out = stream.flush()
        if out:
            await resp.write(out)
        answer.complete = True
    except ProxyError as exc:
        # The status line is gone already: end the stream with the dialect's error event,
        # after what was held back of the answer.
        await _try_write(resp, stream.release() + answer.cut(exc))
    await _try_eof(resp)
    return resp


def _stamp(headers: CIMultiDict[str], hooks: Stamped) -> None:
    if hooks.rewrites:
        headers["x-spanmeter-rewrites"] = ", ".join(r.header_value() for r in hooks.rewrites)


async def _try_write(resp: web.StreamResponse, data: bytes) -> None:
    with contextlib.suppress(ConnectionError, RuntimeError):  # the client may be gone already
        await resp.write(data)


async def _try_eof(resp: web.StreamResponse) -> None:
    with contextlib.suppress(ConnectionError, RuntimeError):
        await resp.write_eof()
