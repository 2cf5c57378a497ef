"""Record real MCP Streamable HTTP exchanges into tests/data/mcp/recorded/*.json.

Not a test: run it by hand when the SDK changes (`python -m tests.providers.record_mcp`).
The official SDK's client talks to the official SDK's server (tests/fixtures/mcp_server.py)
through a recording relay that keeps each HTTP exchange exactly as it crossed the wire:
method, the headers that matter, the request body, the status, and the response body in
the chunks it arrived in. tests/data/mcp/cases.yaml names the exchanges the table tests
replay and says what each must produce.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path
from typing import Any

import aiohttp
import httpx2
from aiohttp import web
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp_types import ElicitResult

from proxy.ops.demo import serve_on_free_port
from tests.fixtures.mcp_server import serve_mcp

OUT = Path(__file__).resolve().parents[1] / "data" / "mcp" / "recorded"
KEPT = ("accept", "content-type", "mcp-session-id", "mcp-protocol-version", "mcp-method", "mcp-name",
        "last-event-id", "cache-control")


def _kept(headers: Any) -> dict[str, str]:
    return {k.lower(): v for k, v in headers.items() if k.lower() in KEPT}


async def _record(era: str) -> list[dict[str, Any]]:
    server, task, running = await serve_mcp()
    log: list[dict[str, Any]] = []
    http = aiohttp.ClientSession(auto_decompress=False)

    async def relay(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        entry: dict[str, Any] = {"request": {"method": request.method, "headers": _kept(request.headers),
                                             "body": body.decode()}}
        async with http.request(request.method, running.url, data=body or None,
                                headers=_kept(request.headers)) as up:
            resp = web.StreamResponse(status=up.status, headers=_kept(up.headers))
            await resp.prepare(request)
            chunks = []
            async for chunk in up.content.iter_any():
                chunks.append(chunk.decode())
                await resp.write(chunk)
            await resp.write_eof()
        entry["response"] = {"status": up.status, "headers": _kept(up.headers), "chunks": chunks}
        log.append(entry)
        return resp

    app = web.Application()
    app.router.add_route("*", "/mcp", relay)
    runner, url = await serve_on_free_port(app)

    async def confirm(_ctx: Any, _params: Any) -> ElicitResult:
        return ElicitResult(action="accept", content={"ok": True})

    client = httpx2.AsyncClient()
    async with Client(streamable_http_client(f"{url}/mcp", http_client=client), mode=era,
                      elicitation_callback=confirm) as c:
        await c.list_tools()
        await c.call_tool("get_weather", {"city": "Paris"})
        await c.call_tool("progress", {"steps": 2}, progress_callback=_ignore)
        await c.call_tool("flaky", {"city": "Oslo"})
        if era == "legacy":
            await c.call_tool("announce", {})
            await asyncio.sleep(0.2)  # the notification reaches the GET stream
            await c.call_tool("confirm", {"question": "Proceed?"})
        await c.call_tool("no_such_tool", {})
        with contextlib.suppress(MCPError):
            await c.get_prompt("no_such_prompt")
    await asyncio.sleep(0.3)  # the GET stream ends after the DELETE
    await runner.cleanup()
    await http.close()
    server.should_exit = True
    await task
    return log


async def _ignore(*_: Any) -> None:
    return None


def _name(entry: dict[str, Any], era: str, seen: dict[str, int]) -> str:
    req = entry["request"]
    body = json.loads(req["body"]) if req["body"] else {}
    what = body.get("method") or ("response" if "result" in body else req["method"].lower())
    if body.get("method") == "tools/call":
        what += "-" + body["params"]["name"]
    key = f"{era}-{what}".replace("/", "-")
    seen[key] = seen.get(key, 0) + 1
    return key if seen[key] == 1 else f"{key}-{seen[key]}"


async def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for era in ("legacy", "auto"):
        seen: dict[str, int] = {}
        for entry in await _record(era):
            name = _name(entry, "modern" if era == "auto" else era, seen)
            (OUT / f"{name}.json").write_text(json.dumps(entry, indent=1) + "\n")
            print(name, entry["response"]["status"], len(entry["response"]["chunks"]), "chunks")


if __name__ == "__main__":
    asyncio.run(main())
