"""The simulator in the Anthropic Messages dialect (`POST /v1/messages`).

Streams keep the `event:` lines the SDK requires. Usage follows the real API:
`input_tokens` excludes cached tokens, which are reported as `cache_read_input_tokens`.
"""

from __future__ import annotations

import re
from typing import Any

import json5
import orjson

from proxy.simulator.script import Request, Script, said

STOP = {"stop": "end_turn", "length": "max_tokens", "tool": "tool_use"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 402: "billing_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 504: "timeout_error", 529: "overloaded_error"}


def _blocks(content: Any) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return [b for b in content if isinstance(b, dict)] if isinstance(content, list) else []


def _text(content: Any) -> str:
    return "".join(str(b.get("text", "")) for b in _blocks(content) if b.get("type") == "text")


def _result_text(block: dict[str, Any]) -> str:
    content = block.get("content")
    return content if isinstance(content, str) else _text(content)


# Anthropic on Vertex AI names the model in the path (`.../models/{model}:rawPredict`), not the body.
_VERTEX_MODEL = re.compile(r"/publishers/anthropic/models/([^/:]+):")


def parse(body: dict[str, Any], path: str) -> Request:
    messages = [m for m in body.get("messages") or [] if isinstance(m, dict)]
    # A user turn carrying only tool_result blocks is not what the user said.
    last_user, notice = said([_text(m.get("content")) for m in messages if m.get("role") == "user"])
    tail = messages[-1] if messages else {}
    results = [b for b in _blocks(tail.get("content")) if b.get("type") == "tool_result"]
    result = _result_text(results[-1]) if tail.get("role") == "user" and results else None
    tools = tuple(str(t["name"]) for t in body.get("tools") or []
                  if isinstance(t, dict) and "name" in t)
    system = body.get("system")
    chars = len(system) if isinstance(system, str) else len(_text(system))
    chars += sum(len(_text(m.get("content"))) for m in messages)
    on_vertex = _VERTEX_MODEL.search(path)
    model = on_vertex.group(1) if on_vertex else str(body.get("model", "sim-small"))
    return Request(model, body.get("stream") is True, last_user,
                   result, tools, chars, notice, len(messages))


def _usage(s: Script, output_tokens: int) -> dict[str, Any]:
    return {"input_tokens": max(0, s.input_tokens - s.cached_tokens),
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": s.cached_tokens,
            "output_tokens": output_tokens, "service_tier": "standard"}


def _tool_input(args: str) -> Any:
    # The real API always sends an object; a malformed scripted argument string is
    # read leniently, as the model's intent.
    try:
        value = json5.loads(args)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _content(s: Script, rid: str) -> list[dict[str, Any]]:
    if s.tool:
        return [{"type": "tool_use", "id": f"toolu_{rid}", "name": s.tool[0],
                 "input": _tool_input(s.tool[1])}]
    return [{"type": "text", "text": "".join(s.chunks)}]


def body(s: Script, req: Request, rid: str) -> dict[str, Any]:
    return {"id": f"msg_{rid}", "type": "message", "role": "assistant", "model": req.model,
            "content": _content(s, rid), "stop_reason": STOP[s.finish], "stop_sequence": None,
            "usage": _usage(s, s.output_tokens)}


def _block_events(s: Script, rid: str) -> list[dict[str, Any]]:
    if s.tool:
        args = s.tool[1]
        start = {"type": "tool_use", "id": f"toolu_{rid}", "name": s.tool[0], "input": {}}
        deltas = [{"type": "input_json_delta", "partial_json": args[i : i + 7]}
                  for i in range(0, len(args), 7)]
    else:
        start = {"type": "text", "text": ""}
        deltas = [{"type": "text_delta", "text": c} for c in s.chunks]
    return [
        {"type": "content_block_start", "index": 0, "content_block": start},
        {"type": "ping"},
        *({"type": "content_block_delta", "index": 0, "delta": d} for d in deltas),
        {"type": "content_block_stop", "index": 0},
    ]


def events(s: Script, req: Request, rid: str, body_in: dict[str, Any]) -> list[bytes]:
    message = {**body(s, req, rid), "content": [], "stop_reason": None, "usage": _usage(s, 1)}
    sequence = [
        {"type": "message_start", "message": message},
        *_block_events(s, rid),
        {"type": "message_delta", "delta": {"stop_reason": STOP[s.finish], "stop_sequence": None},
         "usage": {"output_tokens": s.output_tokens}},
        {"type": "message_stop"},
    ]
    return [b"event: " + e["type"].encode() + b"\ndata: " + orjson.dumps(e) + b"\n\n"
            for e in sequence]


def error(status: int, message: str) -> dict[str, Any]:
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message},
            "request_id": "req_sim"}
