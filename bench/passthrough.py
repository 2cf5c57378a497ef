"""A bare aiohttp + uvloop reverse proxy: the Python floor spanmeter is compared with.

It does what any pass-through must and nothing more: one pooled ClientSession,
hop-by-hop headers dropped, the body read once, and the answer relayed - whole for a
JSON body, chunk by chunk (as the upstream writes them) for a stream.

    python bench/passthrough.py --port N --upstream http://127.0.0.1:M
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

__all__ = ["create_passthrough"]

HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                 "transfer-encoding", "upgrade", "host", "content-length"})
SESSION = web.AppKey("session", aiohttp.ClientSession)


def _headers(h: CIMultiDict[str] | object) -> CIMultiDict[str]:
    return CIMultiDict((k, v) for k, v in h.items() if k.lower() not in HOP)  # type: ignore[attr-defined]


def create_passthrough(upstream: str, max_connections: int = 1024) -> web.Application:
    upstream = upstream.rstrip("/")

    async def session_ctx(app: web.Application) -> AsyncIterator[None]:
        connector = aiohttp.TCPConnector(limit=max_connections, limit_per_host=max_connections)
        app[SESSION] = session = aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                                       timeout=aiohttp.ClientTimeout(total=None, sock_read=600))
        yield
        await session.close()

    async def forward(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        async with request.app[SESSION].request(request.method, upstream + request.path_qs, data=body,
                                                headers=_headers(request.headers)) as up:
            headers = _headers(up.headers)
            if up.content_type != "text/event-stream":
                return web.Response(body=await up.read(), status=up.status, headers=headers)
            resp = web.StreamResponse(status=up.status, headers=headers)
            await resp.prepare(request)
            async for chunk in up.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            return resp

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.cleanup_ctx.append(session_ctx)
    app.router.add_route("*", "/{tail:.*}", forward)
    return app


def main() -> None:
    import uvloop

    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--upstream", required=True)
    args = p.parse_args()
    uvloop.install()
    web.run_app(create_passthrough(args.upstream), host="127.0.0.1", port=args.port, print=None,
                access_log=None, backlog=4096)


if __name__ == "__main__":
    main()
