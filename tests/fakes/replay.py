"""A replay upstream: answers each request with the bytes a real provider sent for it.

The pair is named by the `x-replay-pair` request header (spanmeter forwards it). A
stream goes out cut at awkward byte offsets (inside a line, a CRLF, a UTF-8 character; for
AWS event-stream frames, inside a prelude, a header or a CRC), a different cut per pair, so
the proxy's framing is tried on real bytes. Bedrock's recorded `x-amzn-bedrock-*` headers
(its token counts) go out with the answer, as the real host sent them.
"""

from __future__ import annotations

import asyncio
import base64
import json
import zlib
from collections import defaultdict
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from proxy.serve.appkeys import TEL

PAIRS = web.AppKey("pairs", dict)
CUTS = (1, 7, 2, 64, 3, 13, 5, 300, 11)
# The real exchanges recorded against OpenAI, Anthropic and Gemini, beside the clone.
RECORDED = Path(__file__).resolve().parents[2].parent / "shared" / "cassettes" / "pairs.jsonl"
MISSING = f"{RECORDED} is missing: the recorded traffic lives beside the clone, in ../shared/cassettes"


def recorded_pairs() -> list[dict[str, Any]]:
    """Every recorded pair, in file order; none when the cassettes are not there (a test of
    them skips with `MISSING`)."""
    if not RECORDED.exists():
        return []
    return [json.loads(line) for line in RECORDED.read_text().splitlines() if line.strip()]


def create_replay(pairs: dict[str, dict[str, Any]]) -> web.Application:
    app = web.Application()
    app[PAIRS] = pairs
    app.router.add_route("POST", "/{tail:.*}", _answer)
    return app


def decoded(pair: dict[str, Any]) -> bytes:
    """The response's bytes as the client reads them: `decoded_b64` is set only where the
    recorded bytes were compressed."""
    r = pair["response"]
    return base64.b64decode(r["decoded_b64"] if r.get("decoded_b64") is not None else r["body_b64"] or "")


def _recorded_headers(pair: dict[str, Any]) -> list[tuple[str, str]]:
    raw = pair["response"].get("headers") or []
    return [(str(k), str(v)) for k, v in (raw.items() if isinstance(raw, dict) else raw)]  # [[name, value], ...]


def _content_type(pair: dict[str, Any]) -> str:
    return next((v for k, v in _recorded_headers(pair) if k.lower() == "content-type"), "application/json")


def _kept_headers(pair: dict[str, Any]) -> dict[str, str]:
    """The content type, and Bedrock's own headers (its token counts) as recorded."""
    kept = {k: v for k, v in _recorded_headers(pair) if k.lower().startswith("x-amzn-bedrock-")}
    return {"Content-Type": _content_type(pair), **kept}


async def _answer(request: web.Request) -> web.StreamResponse:
    pair = request.app[PAIRS].get(request.headers.get("x-replay-pair", ""))
    if pair is None:
        return web.json_response({"error": {"message": "replay: no recorded pair for this request"}}, status=599)
    await request.read()
    body, status = decoded(pair), int(pair["response"]["status"])
    ctype, headers = _content_type(pair), _kept_headers(pair)
    if not (pair["stream"] and status < 300 and ("event-stream" in ctype or "eventstream" in ctype)):
        return web.Response(body=body, status=status, headers=headers)
    resp = web.StreamResponse(status=status, headers=headers)
    await resp.prepare(request)
    i, at = zlib.crc32(pair["id"].encode()) % len(CUTS), 0
    while at < len(body):
        size = CUTS[i % len(CUTS)]
        await resp.write(body[at : at + size])
        at, i = at + size, i + 1
    await resp.write_eof()
    return resp


Sender = Callable[[aiohttp.ClientSession, str, dict[str, Any], str], Awaitable[dict[str, Any]]]


async def replay_runs(proxy: Any, pairs: list[dict[str, Any]], send: Sender, tag: str, receiver: Any,
                      *, at_once: int = 64) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """Each recorded run through the running `proxy`, its pairs in order (`send` makes one
    call, run id `{tag}-{run}`), the runs side by side, `at_once` at most; then every span the
    receiver got once the proxy's bookkeeping settled: (what each pair's call got, spans)."""
    runs: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for p in pairs:
        runs[p["run"]].append(p)
    got: dict[str, dict[str, Any]] = {}
    gate = asyncio.Semaphore(at_once)

    async def one_run(run: str, ps: list[dict[str, Any]]) -> None:
        async with gate, aiohttp.ClientSession(auto_decompress=True) as s:
            for p in sorted(ps, key=lambda p: p["seq"]):
                got[p["id"]] = await send(s, proxy.url, p, f"{tag}-{run}")

    await asyncio.gather(*(one_run(r, ps) for r, ps in runs.items()))
    await proxy.settled()
    await asyncio.to_thread(proxy.app[TEL].force_flush)
    spans = await asyncio.to_thread(receiver.wait_for_spans, len(pairs), 30.0)
    return got, spans
