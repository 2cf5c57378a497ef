"""The request's body: read whole within its limit and its time, opened as a call of its API."""

from __future__ import annotations

import asyncio

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from proxy.errors import BodyTimeout, BodyTooLarge
from proxy.providers.translator import Api, Translator
from proxy.serve.appkeys import SETTINGS
from proxy.serve.upstream import unreadable_body

__all__ = ["open_call", "read_body"]


async def open_call(request: web.Request, api: Api, limit: int) -> Translator:
    """The request's body, read whole (within `limit`), opened as one call of its API."""
    raw = await read_body(request, limit)
    # The path as routed: exactly what goes upstream (see routes.match).
    return api.open(raw, "/" + request.match_info.get("tail", ""))


async def read_body(request: web.Request, limit: int) -> bytes:
    """The request's body, read whole, or BodyTooLarge past `limit` bytes."""
    if request.content_length is not None and request.content_length > limit:
        raise _too_large(request.content_length, limit)
    raw = await _read_body(request, limit + 1)
    if len(raw) > limit:
        raise _too_large(None, limit)
    return raw


async def _read_body(request: web.Request, n: int) -> bytes:
    """Up to `n` bytes of body, to its end. StreamReader.read(n) returns what has arrived
    so far, which for a body split over several TCP segments is only its first part."""
    # A sender that trickles its body would otherwise hold a connection and a task forever.
    timeout = request.app[SETTINGS].body_timeout_s
    try:
        first = request.content.read_nowait(n)  # usually the whole body, with no timer to arm
        if len(first) >= n or request.content.at_eof():
            return first
        parts: list[bytes] = [first]
        size = len(first)
        async with asyncio.timeout(timeout):
            while size < n and (part := await request.content.read(n - size)):
                parts.append(part)
                size += len(part)
    except TimeoutError:
        raise BodyTimeout(
            f"The request body did not arrive within {timeout:g} s. Send it at once, or raise "
            "SPANMETER_BODY_TIMEOUT_S for very slow links.") from None
    except RequestPayloadError as exc:  # e.g. labelled gzip but not gzip: aiohttp decodes as it reads
        raise unreadable_body(exc, request.headers.get("Content-Encoding")) from None
    return b"".join(parts)


def _too_large(size: int | None, limit: int) -> BodyTooLarge:
    got = f"{size} bytes" if size is not None else "more than that"
    return BodyTooLarge(
        f"The request body is {got}, over spanmeter's limit of {limit} bytes. Send less context, "
        "or raise SPANMETER_MAX_BODY_BYTES.")
