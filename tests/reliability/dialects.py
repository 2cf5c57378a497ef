"""The four dialects as raw HTTP: request bodies, paths and their stream error markers.

Reliability tests speak raw HTTP (aiohttp) rather than SDKs so they can see exactly
what bytes a client gets when something breaks, in every dialect alike.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from proxy.serve.appkeys import TEL
from tracing.local import read_spans

__all__ = ["DIALECTS", "Dialect", "Reply", "call_spans", "local_spans", "post", "settled_span"]


@dataclass(frozen=True)
class Dialect:
    name: str
    model: str
    error_event: bytes  # how this dialect's terminal stream error event starts

    def path(self, stream: bool) -> str:
        if self.name == "gemini":
            return f"/v1beta/models/{self.model}:" + ("streamGenerateContent?alt=sse" if stream else "generateContent")
        return {"chat": "/v1/chat/completions", "responses": "/v1/responses", "anthropic": "/v1/messages"}[self.name]

    def body(self, text: str, stream: bool, max_tokens: int = 100) -> dict[str, Any]:
        user = [{"role": "user", "content": text}]
        if self.name == "chat":
            return {"model": self.model, "messages": user, "stream": stream, "max_tokens": max_tokens}
        if self.name == "responses":
            return {"model": self.model, "input": text, "stream": stream, "max_output_tokens": max_tokens}
        if self.name == "anthropic":
            return {"model": self.model, "messages": user, "stream": stream, "max_tokens": max_tokens}
        return {"contents": [{"role": "user", "parts": [{"text": text}]}],
                "generationConfig": {"maxOutputTokens": max_tokens}}

    def error_message(self, body: Any) -> str:
        """The message of this dialect's error body."""
        return str(body["error"]["message"])  # the same place in all four shapes


DIALECTS = [
    Dialect("chat", "sim-small", b'data: {"error":'),
    Dialect("responses", "gpt-5", b"event: error\ndata: "),
    Dialect("anthropic", "claude-sonnet-4-5", b"event: error\ndata: "),
    Dialect("gemini", "gemini-2.5-flash", b'data: {"error":'),
]


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes


async def post(url: str, path: str, body: Any = None, *, data: bytes | None = None,
               headers: dict[str, str] | None = None, key: str = "sk-caller-key") -> Reply:
    hdrs = {"Authorization": f"Bearer {key}", "Content-Type": "application/json", **(headers or {})}
    async with aiohttp.ClientSession() as s, s.post(url + path, json=body if data is None else None,
                                                    data=data, headers=hdrs) as r:
        return Reply(r.status, {k.lower(): v for k, v in r.headers.items()}, await r.read())


async def local_spans(proxy: Any, *, flush: bool = True) -> list[dict[str, Any]]:
    """Spans the proxy wrote to its local JSONL files, after flushing its queues (which
    waits for every exporter: pass flush=False when the collector hangs on purpose)."""
    if flush:
        await asyncio.to_thread(proxy.app[TEL].force_flush)
    return list(read_spans(Path(proxy.data_dir) / "traces"))


def call_spans(spans: list[dict[str, Any]], run_id: str) -> list[dict[str, Any]]:
    return [s for s in spans if s["attributes"].get("spanmeter.run.id") == run_id and s["kind"] == "CLIENT"]


async def settled_span(proxy: Any, run_id: str, n: int = 1, *, flush: bool = True) -> dict[str, Any]:
    """The last call span of `run_id`, once `n` exist.

    The client has its last byte before the proxy's bookkeeping (settle, then span end)
    finishes, so wait for the span: it ends only after the ledger was settled.
    """
    for _ in range(400):
        found = call_spans(await local_spans(proxy, flush=flush), run_id)
        if len(found) >= n:
            assert len(found) == n, f"expected {n} call spans for run {run_id}, got {len(found)}"
            return found[-1]
        await asyncio.sleep(0.02)
    raise AssertionError(f"no call span for run {run_id} was ever written")
