"""The only module that talks to model APIs. Maps aiohttp's errors to ours, once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from urllib.parse import urlsplit

import aiohttp
from multidict import CIMultiDict

from proxy.errors import UpstreamConnectError, UpstreamProtocolError, UpstreamTimeout

__all__ = ["HOP_BY_HOP", "Upstream", "UpstreamResponse", "host_port", "request_headers", "response_headers"]

# RFC 9110 7.6.1 hop-by-hop headers, plus what spanmeter recomputes or must not leak.
HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
     "te", "trailer", "transfer-encoding", "upgrade", "host", "content-length"}
)
# Never forwarded upstream: the caller's credentials (spanmeter injects the upstream's),
# the agent's trace context (semconv 6.1: no agent traceparent at the provider) and ours.
_STRIP_UP = HOP_BY_HOP | {"authorization", "x-api-key", "x-goog-api-key", "traceparent",
                          "tracestate", "baggage", "accept-encoding", "cookie"}
_STRIP_DOWN = HOP_BY_HOP | {"content-encoding", "set-cookie"}


def request_headers(incoming: Mapping[str, str], auth: Mapping[str, str]) -> CIMultiDict[str]:
    out: CIMultiDict[str] = CIMultiDict()
    for k, v in incoming.items():
        lk = k.lower()
        if lk in _STRIP_UP or lk.startswith(("x-run-", "x-spanmeter-")):
            continue
        out.add(k, v)
    out.update(auth)
    return out


def response_headers(upstream: Mapping[str, str]) -> CIMultiDict[str]:
    # aiohttp has already decompressed the body, so Content-Encoding no longer applies.
    return CIMultiDict((k, v) for k, v in upstream.items() if k.lower() not in _STRIP_DOWN)


def host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)


class UpstreamResponse:
    """An upstream response whose body errors arrive as spanmeter errors."""

    __slots__ = ("_resp",)

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self._resp = resp

    @property
    def status(self) -> int:
        return self._resp.status

    @property
    def headers(self) -> Mapping[str, str]:
        return self._resp.headers

    @property
    def is_sse(self) -> bool:
        return self._resp.content_type == "text/event-stream"

    async def read(self) -> bytes:
        try:
            return await self._resp.read()
        except Exception as exc:
            raise _translate(exc) from exc

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._resp.content.iter_any():
                yield chunk
        except Exception as exc:
            raise _translate(exc) from exc


class Upstream:
    """One pooled ClientSession for the process (connector limits from settings)."""

    def __init__(self, *, connect_timeout_s: float, read_timeout_s: float, max_connections: int) -> None:
        self._timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=connect_timeout_s, connect=connect_timeout_s,
            sock_read=read_timeout_s)
        self._limit = max_connections
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=self._limit, limit_per_host=0, keepalive_timeout=30)
        self._session = aiohttp.ClientSession(
            connector=connector, timeout=self._timeout, auto_decompress=True,
            skip_auto_headers=("User-Agent",))

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()

    @asynccontextmanager
    async def send(self, url: str, body: bytes, headers: CIMultiDict[str]) -> AsyncIterator[UpstreamResponse]:
        assert self._session is not None, "Upstream.start() was not awaited"
        try:
            resp = await self._session.post(url, data=body, headers=headers)
        except Exception as exc:
            raise _translate(exc, url) from exc
        try:
            yield UpstreamResponse(resp)
        finally:
            # A body read to its end returns the connection to the pool; one cut short (an
            # error, or a client that went away) closes it, which cancels the generation.
            resp.release()

    async def get(self, url: str, headers: CIMultiDict[str]) -> tuple[int, Mapping[str, str], bytes]:
        assert self._session is not None
        try:
            async with self._session.get(url, headers=headers) as resp:
                return resp.status, resp.headers, await resp.read()
        except Exception as exc:
            raise _translate(exc, url) from exc


def _translate(exc: BaseException, url: str = "") -> Exception:
    where = f" ({_origin(url)})" if url else ""
    if isinstance(exc, asyncio.CancelledError):
        raise exc
    if isinstance(exc, asyncio.TimeoutError | aiohttp.ServerTimeoutError):
        return UpstreamTimeout(
            f"The upstream{where} did not answer in time. It may be overloaded; retry, or raise "
            "SPANMETER_CONNECT_TIMEOUT_S / SPANMETER_READ_TIMEOUT_S.")
    if isinstance(exc, aiohttp.ClientConnectorError):
        return UpstreamConnectError(
            f"spanmeter could not connect to the upstream{where}: {exc.os_error.strerror or exc}. "
            "Check the base URL setting for this API (e.g. SPANMETER_OPENAI_BASE_URL) and that "
            "the upstream is reachable from the proxy.")
    if isinstance(exc, aiohttp.ClientError | ConnectionError):
        return UpstreamProtocolError(
            f"The upstream{where} closed the connection or broke the protocol "
            f"({type(exc).__name__}). The call may be retried.")
    return UpstreamProtocolError(f"Unexpected upstream failure{where}: {type(exc).__name__}.")


def _origin(url: str) -> str:
    p = urlsplit(url)
    return f"{p.scheme}://{p.netloc}"
