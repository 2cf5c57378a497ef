"""A scripted model API in the providers' exact wire formats, for the demo, tests and load.

It fakes the outside world only: nothing here imports spanmeter's proxy code. The
last user message picks the scenario (see `script.SCENARIOS`), so any SDK pointed at
it gets deterministic answers. Requests it received are kept (bounded) under
`RECEIVED` so tests can check what reached the "provider" byte for byte.
"""

from __future__ import annotations

import asyncio
import hashlib
import zlib
from collections import deque
from collections.abc import Callable
from types import ModuleType
from typing import Any

import orjson
from aiohttp import web

from proxy.simulator import anthropic, chat, gemini, responses
from proxy.simulator.script import script_for

__all__ = ["RECEIVED", "STREAMS", "Received", "create_simulator"]


class Received:
    __slots__ = ("body", "headers", "path", "query")

    def __init__(self, path: str, query: str, headers: dict[str, str], body: bytes) -> None:
        self.path, self.query, self.headers, self.body = path, query, headers, body

    def json(self) -> Any:
        return orjson.loads(self.body)


RECEIVED = web.AppKey("received", deque)
STREAMS = web.AppKey("streams", dict)  # response id -> "done" | "client_gone", for cancellation tests

# (path, dialect module). Gemini paths carry the model: `{model}` is matched by aiohttp.
ROUTES: list[tuple[str, ModuleType]] = [
    ("/v1/chat/completions", chat),
    ("/v1/responses", responses),
    ("/v1/messages", anthropic),
    ("/{version:v1beta|v1}/models/{model}:{action:generateContent|streamGenerateContent}", gemini),
    # Vertex AI: the same bodies on Google Cloud's paths (Anthropic's without `model`).
    ("/{version:v1beta1|v1}/projects/{project}/locations/{location}/publishers/google/models/"
     "{model}:{action:generateContent|streamGenerateContent}", gemini),
    ("/{version:v1beta1|v1}/projects/{project}/locations/{location}/publishers/anthropic/models/"
     "{model}:{action:rawPredict|streamRawPredict}", anthropic),
]


def _handler(dialect: ModuleType) -> Any:
    async def handle(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        request.app[RECEIVED].append(Received(request.path, request.query_string, dict(request.headers), raw))
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return web.json_response(dialect.error(400, "simulator: body is not JSON"), status=400)
        req = dialect.parse(body, request.path)
        script = script_for(req)
        # Ids derive from the request, so the same request gets the same bytes back
        # directly and through the proxy.
        rid = hashlib.sha256(raw).hexdigest()[:20]
        if script.stall_s:
            await asyncio.sleep(script.stall_s)
        if script.error_status:
            return web.Response(body=orjson.dumps(dialect.error(script.error_status, "simulated upstream failure")),
                                status=script.error_status, content_type="application/json",
                                headers={"retry-after": "0"} if script.error_status == 429 else None)
        encode = _encoder(script.encoding)
        enc_headers = {"Content-Encoding": script.encoding} if script.encoding else {}
        if not req.stream:
            payload = _BROKEN if script.garbage else orjson.dumps(dialect.body(script, req, rid))
            return web.Response(body=encode(payload) + encode(None), content_type="application/json",
                                headers=enc_headers)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           **enc_headers})
        await resp.prepare(request)
        streams = request.app[STREAMS]
        streams[rid] = "streaming"
        try:
            for i, event in enumerate(_with_garbage(dialect.events(script, req, rid, body), script.garbage)):
                if script.reset_after is not None and i >= script.reset_after:
                    assert request.transport is not None
                    request.transport.abort()  # a connection reset mid-stream, as providers do under load
                    streams[rid] = "reset"
                    return resp
                if script.hang_after is not None and i >= script.hang_after:
                    streams[rid] = "hung"
                    await asyncio.sleep(3600)  # a body that stalls mid-way; ends when the reader goes
                if script.delay_s and i:
                    await asyncio.sleep(script.delay_s)
                    if request.transport is None or request.transport.is_closing():
                        raise ConnectionResetError
                await resp.write(encode(event))
            await resp.write(encode(None))
            await resp.write_eof()
            streams[rid] = "done"
        except (ConnectionResetError, asyncio.CancelledError):
            streams[rid] = "client_gone"
            raise
        return resp

    return handle


# Junk a broken upstream might interleave: a cut JSON object, a line with no field, bytes
# that are not UTF-8, an event with no data. Real SDKs may choke on them; the proxy must not.
_BROKEN = b'{"id": "broken", "choices": ['  # a body cut mid-object, served as JSON
_JUNK = (b"data: {\"choices\": [\n\n", b"no field here\n\n", b"data: \xff\xfe\n\n", b"event: ping\n\n")


def _with_garbage(events: list[bytes], garbage: bool) -> list[bytes]:
    return [events[0], *_JUNK, *events[1:]] if garbage else events


def _encoder(encoding: str | None) -> Callable[[bytes | None], bytes]:
    """bytes -> encoded bytes, flushed per event so a compressed stream still streams;
    None ends the encoding. `br` sends bytes no brotli decoder accepts."""
    if encoding == "gzip":
        z = zlib.compressobj(wbits=31)
        return lambda b: z.compress(b) + z.flush(zlib.Z_SYNC_FLUSH) if b is not None else z.flush()
    if encoding == "br":
        return lambda b: b"\x8b\x00not-brotli" + b if b is not None else b""
    return lambda b: b if b is not None else b""


async def _embeddings(request: web.Request) -> web.Response:
    raw = await request.read()
    request.app[RECEIVED].append(Received(request.path, request.query_string, dict(request.headers), raw))
    body = orjson.loads(raw)
    inputs = body.get("input")
    texts = [inputs] if isinstance(inputs, str) else [str(i) for i in inputs or []]
    # A deterministic vector per text: the first bytes of its sha256, scaled to [0, 1).
    data = [{"object": "embedding", "index": i,
             "embedding": [b / 256 for b in hashlib.sha256(t.encode()).digest()[:8]]} for i, t in enumerate(texts)]
    tokens = sum(max(1, len(t) // 4) for t in texts)
    return web.json_response({"object": "list", "data": data, "model": body.get("model", "sim-embed"),
                              "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


async def _models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [
        {"id": m, "object": "model", "created": 1764460800, "owned_by": "spanmeter-sim"}
        for m in ("sim-small", "sim-large")]})


def create_simulator(max_received: int = 1000) -> web.Application:
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[RECEIVED] = deque(maxlen=max_received)
    app[STREAMS] = {}
    for path, dialect in ROUTES:
        app.router.add_post(path, _handler(dialect))
    app.router.add_post("/v1/embeddings", _embeddings)
    app.router.add_get("/v1/models", _models)
    return app
