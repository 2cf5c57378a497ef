"""The simulator in the Gemini dialect (`/v1beta/models/{model}:generateContent`,
`:streamGenerateContent?alt=sse`, also under `/v1/`).

The model and the stream flag come from the path. Streams are framed exactly as the
real API frames them: `data: ` + JSON + CRLF CRLF, no comments, no `[DONE]` (the
google-genai parser rejects both).
"""

from __future__ import annotations

import re
from typing import Any

import json5
import orjson

from proxy.simulator.script import Request, Script, said

FINISH = {"stop": "STOP", "length": "MAX_TOKENS", "tool": "STOP"}
STATUS = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 402: "RESOURCE_EXHAUSTED",
          403: "PERMISSION_DENIED", 404: "NOT_FOUND", 429: "RESOURCE_EXHAUSTED",
          500: "INTERNAL", 503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED"}
_PATH = re.compile(r"/models/([^/:]+):(\w+)")


def _get(d: Any, camel: str, snake: str) -> Any:
    return (d.get(camel, d.get(snake)) if isinstance(d, dict) else None)


def _parts(content: Any) -> list[dict[str, Any]]:
    parts = content.get("parts") if isinstance(content, dict) else None
    return [p for p in parts if isinstance(p, dict)] if isinstance(parts, list) else []


def _text(content: Any) -> str:
    return "".join(p["text"] for p in _parts(content) if isinstance(p.get("text"), str))


def parse(body: dict[str, Any], path: str) -> Request:
    m = _PATH.search(path)
    contents = [c for c in body.get("contents") or [] if isinstance(c, dict)]
    # A user turn carrying only functionResponse parts is not what the user said.
    last_user, notice = said([_text(c) for c in contents if c.get("role", "user") == "user"])
    tails = contents[:-1] if notice and contents[-1].get("role", "user") == "user" else contents
    tail = tails[-1] if tails else {}
    responses = [r for p in _parts(tail)
                 if isinstance(r := _get(p, "functionResponse", "function_response"), dict)]
    result = orjson.dumps(responses[-1].get("response")).decode() if responses else None
    tools = tuple(str(d["name"]) for t in body.get("tools") or []
                  for d in _get(t, "functionDeclarations", "function_declarations") or []
                  if isinstance(d, dict) and "name" in d)
    system = _get(body, "systemInstruction", "system_instruction")
    chars = len(_text(system)) + sum(len(_text(c)) for c in contents)
    return Request(m.group(1) if m else "sim-small",
                   m is not None and m.group(2) == "streamGenerateContent",
                   last_user, result, tools, chars, notice, len(contents))


def _usage(s: Script, *, final: bool) -> dict[str, Any]:
    u: dict[str, Any] = {"promptTokenCount": s.input_tokens}
    if final:
        u["candidatesTokenCount"] = s.output_tokens
    u["totalTokenCount"] = s.input_tokens + (s.output_tokens if final else 0)
    if s.cached_tokens:
        u["cachedContentTokenCount"] = s.cached_tokens
    u["promptTokensDetails"] = [{"modality": "TEXT", "tokenCount": s.input_tokens}]
    return u


def _args(text: str) -> Any:
    # functionCall.args is always an object on the wire; a malformed scripted argument
    # string is read leniently, as the model's intent.
    try:
        value = json5.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _chunk(req: Request, rid: str, parts: list[Any], usage: dict[str, Any],
           finish: str | None = None) -> dict[str, Any]:
    candidate: dict[str, Any] = {"content": {"parts": parts, "role": "model"}, "index": 0}
    if finish:
        candidate["finishReason"] = finish
    return {"candidates": [candidate], "usageMetadata": usage, "modelVersion": req.model,
            "responseId": rid}


def _final_parts(s: Script) -> list[Any]:
    if s.tool:
        return [{"functionCall": {"name": s.tool[0], "args": _args(s.tool[1])}}]
    return [{"text": "".join(s.chunks)}]


def body(s: Script, req: Request, rid: str) -> dict[str, Any]:
    return _chunk(req, rid, _final_parts(s), _usage(s, final=True), FINISH[s.finish])


def events(s: Script, req: Request, rid: str, body_in: dict[str, Any]) -> list[bytes]:
    if s.tool:
        chunks = [_chunk(req, rid, _final_parts(s), _usage(s, final=True), FINISH[s.finish])]
    else:
        # As the real API: running usage on every chunk, the finish reason on the last.
        *head, last = s.chunks or ("",)
        chunks = [_chunk(req, rid, [{"text": c}], _usage(s, final=False)) for c in head]
        chunks.append(_chunk(req, rid, [{"text": last}], _usage(s, final=True), FINISH[s.finish]))
    return [b"data: " + orjson.dumps(c) + b"\r\n\r\n" for c in chunks]


def error(status: int, message: str) -> dict[str, Any]:
    return {"error": {"code": status, "message": message,
                      "status": STATUS.get(status, "INTERNAL" if status >= 500 else "UNKNOWN")}}
