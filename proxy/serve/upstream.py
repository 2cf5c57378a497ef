"""The only module that talks to model APIs. Maps aiohttp's errors to ours, once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from urllib.parse import unquote_plus, urljoin, urlsplit

import aiohttp
from aiohttp.http_exceptions import ContentEncodingError
from multidict import CIMultiDict
from yarl import URL

from proxy.errors import (
    MalformedBody,
    RequestError,
    UndecodableBody,
    UpstreamConnectError,
    UpstreamProtocolError,
    UpstreamRedirect,
    UpstreamTimeout,
)

__all__ = ["HOP_BY_HOP", "Upstream", "UpstreamResponse", "forward_url", "host_port", "request_headers",
           "response_headers", "unreadable_body"]

# RFC 9110 7.6.1 hop-by-hop headers, plus what spanmeter recomputes or must not leak.
HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
     "te", "trailer", "transfer-encoding", "upgrade", "host", "content-length"}
)
# Never forwarded upstream: the caller's credentials (spanmeter injects the upstream's),
# the agent's trace context (semconv 6.1: no agent traceparent at the provider) and ours
# (x-run-*, x-spanmeter-*, and the run's agent name and conversation id).
_STRIP_UP = HOP_BY_HOP | {"authorization", "x-api-key", "x-goog-api-key", "api-key", "traceparent",
                          "tracestate", "baggage", "accept-encoding", "cookie",
                          "x-agent-name", "x-conversation-id"}
_STRIP_DOWN = HOP_BY_HOP | {"content-encoding", "set-cookie"}
# The request encodings aiohttp's server decodes before anyone reads the body
# (http_parser.HttpRequestParser): a body sent with one of these is forwarded decoded,
# so its label must go too. Any other encoding reaches us, and goes on, as sent.
_DECODED_BY_SERVER = frozenset({"gzip", "deflate", "br", "zstd"})
_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_STREAM_TYPES = frozenset({"text/event-stream", "application/vnd.amazon.eventstream"})


# What becomes of a header, by its name exactly as sent, remembered: clients and upstreams
# send the same few names on every call, and lower-casing and testing each name against
# the strip lists cost ~1 µs per request each way. Bounded: names come from the network.
_DROP, _KEEP, _CHECK_ENCODING = 0, 1, 2
_VERDICTS_MAX = 512
_up_verdicts: dict[str, int] = {}
_down_kept: dict[str, bool] = {}


def _up_verdict(name: str) -> int:
    lk = name.lower()
    if lk in _STRIP_UP or lk.startswith(("x-run-", "x-spanmeter-")):
        verdict = _DROP
    else:
        verdict = _CHECK_ENCODING if lk == "content-encoding" else _KEEP
    if len(_up_verdicts) < _VERDICTS_MAX:
        _up_verdicts[name] = verdict
    return verdict


def request_headers(incoming: Mapping[str, str], auth: Mapping[str, str]) -> CIMultiDict[str]:
    kept = []
    for k, v in incoming.items():
        verdict = _up_verdicts.get(k)
        if verdict is None:
            verdict = _up_verdict(k)
        if verdict == _DROP or (verdict == _CHECK_ENCODING and v.strip().lower() in _DECODED_BY_SERVER):
            continue
        kept.append((k, v))
    out = CIMultiDict(kept)
    out.update(auth)
    return out


def response_headers(upstream: Mapping[str, str]) -> CIMultiDict[str]:
    # aiohttp has already decompressed the body, so Content-Encoding no longer applies.
    kept = []
    for k, v in upstream.items():
        keep = _down_kept.get(k)
        if keep is None:
            keep = k.lower() not in _STRIP_DOWN
            if len(_down_kept) < _VERDICTS_MAX:
                _down_kept[k] = keep
        if keep:
            kept.append((k, v))
    return CIMultiDict(kept)


def forward_url(base_url: str, path: str, query_string: str, presented_key: str | None = None) -> str:
    """Where a request goes upstream, on every route: its query without spanmeter credentials.

    `key=` is how curl users send their spanmeter key (and how Gemini takes an API key),
    so it never goes upstream, whatever its case or percent-encoding: the upstream key
    travels in a header. Nor does any parameter whose value is the key the caller presented.
    """
    kept = [pair for pair in query_string.split("&")
            if pair and not any(_is_credential(part, presented_key) for part in pair.split(";"))]
    return base_url + path + ("?" + "&".join(kept) if kept else "")


def _is_credential(param: str, presented_key: str | None) -> bool:
    # Some servers split a query on ';' as well as '&': a `;key=` inside a pair counts.
    name, _, value = param.partition("=")
    return unquote_plus(name).strip().casefold() == "key" or (
        bool(presented_key) and unquote_plus(value) == presented_key)


def unreadable_body(exc: Exception, content_encoding: str | None) -> RequestError:
    """What a request body aiohttp's server could not deliver (its RequestPayloadError) is:
    bytes that are not the encoding they are labelled with, or a body cut short."""
    if isinstance(exc.__cause__, ContentEncodingError):
        return UndecodableBody(content_encoding or "")
    return MalformedBody("The request body ended before its declared length, or its chunked framing is "
                         "broken. Send the whole body again.")


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

    @property
    def is_stream(self) -> bool:
        """An answer read as it comes: SSE, or AWS event-stream frames (Bedrock)."""
        return self._resp.content_type in _STREAM_TYPES

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


def _as_sent(url: str) -> URL | str:
    """The URL with its percent-encoding as the client sent it. yarl would requote a str,
    decoding what it deems safe (`%24alt=json` goes out as `$alt=json`, which some servers
    read as another parameter). A URL with characters no request line may carry (never a
    metered path: routes refuse them) is still left to yarl to encode."""
    return URL(url, encoded=True) if url.isascii() and url.isprintable() and " " not in url else url


class Sending:
    """One request upstream, as an async context manager. A class rather than an
    @asynccontextmanager: the generator machinery of that cost ~2 µs on every call."""

    __slots__ = ("_body", "_headers", "_method", "_resp", "_session", "_url")

    def __init__(self, session: aiohttp.ClientSession, url: str, body: bytes, headers: CIMultiDict[str],
                 method: str) -> None:
        self._session, self._url, self._body, self._headers, self._method = session, url, body, headers, method
        self._resp: aiohttp.ClientResponse | None = None

    async def __aenter__(self) -> UpstreamResponse:
        url = self._url
        try:
            # Redirects are never followed: aiohttp would resend x-api-key / x-goog-api-key
            # (it drops only Authorization) to whatever origin the upstream names.
            resp = await self._session.request(self._method, _as_sent(url), data=self._body or None,
                                               headers=self._headers, allow_redirects=False)
        except Exception as exc:
            raise _translate(exc, url) from exc
        if resp.status in _REDIRECTS:
            resp.release()
            raise _redirect(url, resp.status, resp.headers.get("Location"))
        self._resp = resp
        return UpstreamResponse(resp)

    async def __aexit__(self, *exc_info: object) -> None:
        # A body read to its end returns the connection to the pool; one cut short (an
        # error, or a client that went away) closes it, which cancels the generation.
        if self._resp is not None:
            self._resp.release()


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
        # No cookie jar: this one session serves every tenant, and a jar would send the
        # cookies of one caller's answer (a provider's `_cfuvid`, `__cf_bm`) with everyone's
        # calls after it. Set-Cookie goes back to no one either (_STRIP_DOWN).
        self._session = aiohttp.ClientSession(
            connector=connector, timeout=self._timeout, auto_decompress=True,
            skip_auto_headers=("User-Agent",), cookie_jar=aiohttp.DummyCookieJar())

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()

    def send(self, url: str, body: bytes, headers: CIMultiDict[str], method: str = "POST") -> Sending:
        """`async with upstream.send(...) as response`: the response, released on the way out."""
        assert self._session is not None, "Upstream.start() was not awaited"
        return Sending(self._session, url, body, headers, method)

    async def get(self, url: str, headers: CIMultiDict[str]) -> tuple[int, Mapping[str, str], bytes]:
        assert self._session is not None
        try:
            async with self._session.get(url, headers=headers, allow_redirects=False) as resp:
                if resp.status in _REDIRECTS:
                    raise _redirect(url, resp.status, resp.headers.get("Location"))
                return resp.status, resp.headers, await resp.read()
        except UpstreamRedirect:
            raise
        except Exception as exc:
            raise _translate(exc, url) from exc


def _redirect(url: str, status: int, location: str | None) -> UpstreamRedirect:
    """A 3xx is not passed back either: the agent's SDK would follow it with the caller's
    spanmeter key (httpx keeps x-api-key across origins), straight past every ceiling."""
    where = f"a redirect to {_shown(url, location)}" if location else "a redirect with no Location"
    return UpstreamRedirect(
        f"The upstream ({_origin(url)}) answered {status}, {where}. spanmeter does not follow "
        "redirects, so upstream keys never reach another address. Point the base URL setting for "
        "this API (e.g. SPANMETER_OPENAI_BASE_URL, or the upstream's base_url) at the final address.")


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
            "the upstream is reachable from the proxy. No network or no provider key? `spanmeter demo` runs "
            "an agent through spanmeter offline, and `spanmeter simulate --port 8788` serves a simulated model "
            "API to point SPANMETER_OPENAI_BASE_URL (or the Anthropic/Gemini one) at.")
    if isinstance(exc, aiohttp.ClientError | ConnectionError):
        return UpstreamProtocolError(
            f"The upstream{where} closed the connection or broke the protocol "
            f"({type(exc).__name__}). The call may be retried.")
    return UpstreamProtocolError(f"Unexpected upstream failure{where}: {type(exc).__name__}.")


def _origin(url: str) -> str:
    p = urlsplit(url)
    return f"{p.scheme}://{p.netloc}"


def _shown(url: str, location: str) -> str:
    """Scheme, host, port and path: a query or user info in a Location may carry a token."""
    try:
        p = urlsplit(urljoin(url, location))
    except ValueError:
        return "an address that is not a valid URL"
    host = p.netloc.rpartition("@")[2]
    return f"{p.scheme}://{host}{p.path}"[:200]
