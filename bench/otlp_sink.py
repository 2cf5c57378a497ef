"""A local OTLP/HTTP receiver that accepts and discards: the collector stand-in.

It answers POST /v1/traces, /v1/metrics and /v1/logs with an empty protobuf
Export*ServiceResponse (zero bytes is a valid empty message) and counts what came.
GET /stats returns the counts, so the bench can show that spans really left.

    python bench/otlp_sink.py --port N
"""

from __future__ import annotations

import argparse

from aiohttp import web

__all__ = ["create_sink"]

COUNTS = web.AppKey("counts", dict)


def create_sink() -> web.Application:
    async def accept(request: web.Request) -> web.Response:
        body = await request.read()
        counts = request.app[COUNTS]
        signal = request.path.rsplit("/", 1)[-1]
        counts[signal + "_posts"] = counts.get(signal + "_posts", 0) + 1
        counts[signal + "_bytes"] = counts.get(signal + "_bytes", 0) + len(body)
        # As sent (compressed): aiohttp's read() gives the body inflated.
        counts[signal + "_wire_bytes"] = counts.get(signal + "_wire_bytes", 0) + (request.content_length or 0)
        return web.Response(body=b"", content_type="application/x-protobuf")

    async def stats(request: web.Request) -> web.Response:
        return web.json_response(request.app[COUNTS])

    app = web.Application(client_max_size=256 * 1024 * 1024)
    app[COUNTS] = {}
    for signal in ("traces", "metrics", "logs"):
        app.router.add_post(f"/v1/{signal}", accept)
    app.router.add_get("/stats", stats)
    return app


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args()
    web.run_app(create_sink(), host="127.0.0.1", port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
