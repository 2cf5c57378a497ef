"""The fast static upstream: nginx (preferred) or a tiny aiohttp + uvloop app.

Both answer POST /v1/chat/completions with precomputed bytes, chosen by the query
string, which every proxy forwards unchanged:

  (none)     the JSON completion (Content-Length)
  ?s=sse     the 50-event SSE stream in one write (the cheapest stream to relay; what a
             fast upstream at full load looks like, and what the issue's reference used)
  ?s=sse50   the same 50 events, one write (flush) per event, as a model streams them
  ?s=slow    the JSON completion after 50 ms (in-flight capacity at 256 connections)
  ?s=tool    a JSON completion that asks for one tool call, with a fresh call id per answer
  ?s=toolsse the same as a 50-event stream (the id in the first event, the arguments in 46)

nginx is preferred because it is not the bottleneck: one nginx worker answers these
at several times the rate the Python floor (bare aiohttp pass-through) can forward,
while sharing its core with wrk. The aiohttp fallback is used when nginx or its echo
module is missing; it makes the upstream Python-bound, which the report says.

    python bench/upstream.py --port N     # the aiohttp fallback
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from payloads import CALL_ID, JSON_BODY, SSE_EVENTS, TOOL_JSON_BODY, TOOL_SSE_EVENTS

__all__ = ["ECHO_MODULE", "NGINX", "nginx_available", "nginx_conf"]

NGINX = "/usr/sbin/nginx"
ECHO_MODULE = "/usr/lib/nginx/modules/ngx_http_echo_module.so"
SLOW_S = 0.05
NGINX_TOKEN = 3500  # nginx reads a config string into a 4 KB buffer: longer ones are split


def nginx_available() -> bool:
    return Path(NGINX).exists() and Path(ECHO_MODULE).exists()


def _quote(data: bytes) -> str:
    # nginx quoted strings may span lines; only the quote, backslash and `$` need care.
    text = data.decode()
    assert "$" not in text, "nginx would read $ as a variable"
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _with_call_id(quoted: str) -> str:
    return quoted.replace(CALL_ID, "call_${request_id}")  # nginx's 32 random hex digits per request


def _echo_parts(events: list[bytes]) -> str:
    """`echo -n` commands of whole events, each string short enough for nginx's parser."""
    parts: list[bytes] = [b""]
    for e in events:
        if parts[-1] and len(parts[-1]) + len(e) > NGINX_TOKEN:
            parts.append(b"")
        parts[-1] += e
    return "\n".join(f"        echo -n {_with_call_id(_quote(p))};" for p in parts)


def nginx_conf(tmp: Path, port: int) -> str:
    (tmp / "sse.txt").write_bytes(b"".join(SSE_EVENTS))
    sse = "\n".join(f"        echo -n {_quote(e)};\n        echo_flush;" for e in SSE_EVENTS)
    tool_sse = _echo_parts(TOOL_SSE_EVENTS)
    temps = "\n".join(f"  {k}_temp_path {tmp}/{k};" for k in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    return f"""
daemon off;
master_process off;
worker_processes 1;
pid {tmp}/nginx.pid;
error_log stderr warn;
load_module {ECHO_MODULE};
events {{ worker_connections 8192; multi_accept on; }}
http {{
  access_log off;
{temps}
  keepalive_requests 100000000;
  keepalive_timeout 600s;
  client_body_buffer_size 64k;
  server {{
    listen 127.0.0.1:{port} backlog=4096;
    location = /v1/chat/completions {{
      if ($arg_s = sse) {{ rewrite ^ /sse last; }}
      if ($arg_s = sse50) {{ rewrite ^ /sse50 last; }}
      if ($arg_s = slow) {{ rewrite ^ /slow last; }}
      if ($arg_s = tool) {{ rewrite ^ /tool last; }}
      if ($arg_s = toolsse) {{ rewrite ^ /toolsse last; }}
      default_type application/json;
      return 200 {_quote(JSON_BODY)};
    }}
    location = /sse {{
        # Too long for a config string: a file, which the static module serves only to
        # GET, so the 405 it gives a POST is turned into the file (method becomes GET).
        internal;
        default_type text/event-stream;
        alias {tmp}/sse.txt;
        error_page 405 =200 /sse;
    }}
    location = /sse50 {{
        internal;
        default_type text/event-stream;
{sse}
    }}
    location = /slow {{
        internal;
        default_type application/json;
        echo_sleep {SLOW_S};
        echo -n {_quote(JSON_BODY)};
    }}
    location = /tool {{
        internal;
        default_type application/json;
        return 200 {_with_call_id(_quote(TOOL_JSON_BODY))};
    }}
    location = /toolsse {{
        internal;
        default_type text/event-stream;
{tool_sse}
    }}
  }}
}}
"""


def create_static_app() -> object:
    from aiohttp import web

    async def chat(request: web.Request) -> web.StreamResponse:
        await request.read()
        s = request.query.get("s")
        if s in ("tool", "toolsse"):
            call_id = ("call_" + uuid.uuid4().hex).encode()
            if s == "tool":
                return web.Response(body=TOOL_JSON_BODY.replace(CALL_ID.encode(), call_id),
                                    content_type="application/json")
            events = b"".join(TOOL_SSE_EVENTS).replace(CALL_ID.encode(), call_id)
            return web.Response(body=events, content_type="text/event-stream")
        if s == "sse":
            return web.Response(body=b"".join(SSE_EVENTS), content_type="text/event-stream")
        if s == "sse50":
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for event in SSE_EVENTS:
                await resp.write(event)
            await resp.write_eof()
            return resp
        if s == "slow":
            await asyncio.sleep(SLOW_S)
        return web.Response(body=JSON_BODY, content_type="application/json")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    return app


def main() -> None:
    import uvloop
    from aiohttp import web

    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args()
    uvloop.install()
    web.run_app(create_static_app(), host="127.0.0.1", port=args.port, print=None,  # type: ignore[arg-type]
                access_log=None, backlog=4096)


if __name__ == "__main__":
    main()
