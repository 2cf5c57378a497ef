"""A fake of Azure OpenAI and of the OpenAI-compatible hosts: Chat Completions on any path
ending in /chat/completions (and /embeddings), answering in the host's own shape.

What it copies from the recordings (../shared/cassettes/reach-pairs.jsonl): Azure answers
name the model that ran, not the deployment, with `prompt_filter_results`; an Azure stream's
first chunk has `"model": ""` and no choices; an api-version older than 2024-09-01 refuses
`stream_options` with a 400 as Azure does; the usage spellings of DeepSeek
(`prompt_cache_hit_tokens`), OpenRouter (`usage.cost`) and Groq (`x_groq.usage` on the last
chunk of a stream) are set per test through `FakeHost.usage_extra` / `groq_stream`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

HOST = web.AppKey("host", object)


@dataclass
class Seen:
    path: str
    query: str
    headers: dict[str, str]
    body: dict[str, Any]


@dataclass
class FakeHost:
    ran: str = "gpt-4.1-mini-2025-04-14"  # the model the answers name
    azure: bool = False
    usage_extra: dict[str, Any] = field(default_factory=dict)
    groq_stream: bool = False  # a stream's usage in x_groq.usage, as Groq's older API sent it
    seen: list[Seen] = field(default_factory=list)
    tool_call: bool = False


def _usage(host: FakeHost) -> dict[str, Any]:
    return {"prompt_tokens": 120, "completion_tokens": 30, "total_tokens": 150, **host.usage_extra}


def _message(host: FakeHost) -> dict[str, Any]:
    if host.tool_call:
        return {"role": "assistant", "content": None, "tool_calls": [{"id": "call_fake_1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}
    return {"role": "assistant", "content": "It is sunny."}


def _chunk(host: FakeHost, model: str, choices: list[Any], **extra: Any) -> bytes:
    body = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 1764460800, "model": model,
            "choices": choices, **extra}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


async def _chat(request: web.Request) -> web.StreamResponse:
    host: FakeHost = request.app[HOST]  # type: ignore[assignment]
    body = await request.json()
    host.seen.append(Seen(request.path, request.query_string, dict(request.headers), body))
    version = request.query.get("api-version", "")
    if host.azure and "stream_options" in body and re.fullmatch(r"\d{4}-\d{2}-\d{2}(-preview)?", version) \
            and version < "2024-09-01":
        return web.json_response({"error": {"code": "BadRequest", "message": "Unrecognized request argument "
                                             "supplied: stream_options"}}, status=400)
    if not body.get("stream"):
        answer = {"id": "chatcmpl-fake", "object": "chat.completion", "created": 1764460800, "model": host.ran,
                  "choices": [{"index": 0, "finish_reason": "tool_calls" if host.tool_call else "stop",
                               "message": _message(host)}], "usage": _usage(host)}
        if host.azure:
            answer["prompt_filter_results"] = [{"prompt_index": 0, "content_filter_results": {}}]
        return web.json_response(answer)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    if host.azure:
        await resp.write(_chunk(host, "", [], prompt_filter_results=[{"prompt_index": 0}]))
    msg = _message(host)
    delta = {"role": "assistant", "content": msg["content"]} if msg["content"] else {
        "role": "assistant", "tool_calls": [{"index": 0, **msg["tool_calls"][0]}]}
    await resp.write(_chunk(host, host.ran, [{"index": 0, "delta": delta, "finish_reason": None}]))
    last: dict[str, Any] = {}
    if host.groq_stream:
        last = {"x_groq": {"id": "req_fake", "usage": _usage(host)}}
    await resp.write(_chunk(host, host.ran, [{"index": 0, "delta": {}, "finish_reason": "stop"}], **last))
    if (body.get("stream_options") or {}).get("include_usage"):
        await resp.write(_chunk(host, host.ran, [], usage=_usage(host)))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def _embeddings(request: web.Request) -> web.Response:
    host: FakeHost = request.app[HOST]  # type: ignore[assignment]
    body = await request.json()
    host.seen.append(Seen(request.path, request.query_string, dict(request.headers), body))
    return web.json_response({"object": "list", "model": host.ran, "data": [
        {"object": "embedding", "index": 0, "embedding": [0.1, 0.2]}],
        "usage": {"prompt_tokens": 8, "total_tokens": 8}})


def create_host(host: FakeHost) -> web.Application:
    app = web.Application()
    app[HOST] = host
    app.router.add_post(r"/{prefix:.*}chat/completions", _chat)
    app.router.add_post(r"/{prefix:.*}embeddings", _embeddings)
    return app
