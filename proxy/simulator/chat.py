"""The simulator in the OpenAI Chat Completions dialect."""

from __future__ import annotations

from typing import Any

import orjson

from proxy.simulator.script import Request, Script, said

FINISH = {"stop": "stop", "length": "length", "tool": "tool_calls"}


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def parse(body: dict[str, Any], path: str) -> Request:
    messages = [m for m in body.get("messages") or [] if isinstance(m, dict)]
    last_user, notice = said([_text(m.get("content")) for m in messages if m.get("role") == "user"])
    # A wrap-up note is a message of its own: the turn before it is what the client sent.
    tails = messages[:-1] if notice and messages[-1].get("role") == "user" else messages
    tail = tails[-1] if tails else {}
    result = _text(tail.get("content")) if tail.get("role") == "tool" else None
    tools = tuple(t["function"]["name"] for t in body.get("tools") or [] if isinstance(t, dict) and "function" in t)
    chars = sum(len(_text(m.get("content"))) for m in messages)
    return Request(str(body.get("model", "sim-small")), body.get("stream") is True, last_user, result, tools, chars,
                   notice, len(messages))


def _usage(s: Script) -> dict[str, Any]:
    return {"prompt_tokens": s.input_tokens, "completion_tokens": s.output_tokens,
            "total_tokens": s.input_tokens + s.output_tokens,
            "prompt_tokens_details": {"cached_tokens": s.cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": 0}}


def body(s: Script, req: Request, rid: str) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": "".join(s.chunks) if not s.tool else None,
                               "refusal": None}
    if s.tool:
        message["tool_calls"] = [{"id": f"call_{rid}", "type": "function",
                                  "function": {"name": s.tool[0], "arguments": s.tool[1]}}]
    return {"id": f"chatcmpl-{rid}", "object": "chat.completion", "created": 1764460800,
            "model": req.model, "choices": [{"index": 0, "message": message, "logprobs": None,
                                             "finish_reason": FINISH[s.finish]}],
            "usage": _usage(s), "system_fingerprint": "fp_sim"}


def events(s: Script, req: Request, rid: str, body_in: dict[str, Any]) -> list[bytes]:
    so = body_in.get("stream_options")
    with_usage = isinstance(so, dict) and so.get("include_usage") is True
    base = {"id": f"chatcmpl-{rid}", "object": "chat.completion.chunk", "created": 1764460800,
            "model": req.model, "system_fingerprint": "fp_sim"}

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        c = {**base, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
        if with_usage:
            c["usage"] = None
        return b"data: " + orjson.dumps(c) + b"\n\n"

    out = [chunk({"role": "assistant", "content": ""})]
    if s.tool:
        name, args = s.tool
        out.append(chunk({"tool_calls": [{"index": 0, "id": f"call_{rid}", "type": "function",
                                          "function": {"name": name, "arguments": ""}}]}))
        for i in range(0, len(args), 7):
            out.append(chunk({"tool_calls": [{"index": 0, "function": {"arguments": args[i:i + 7]}}]}))
    else:
        out.extend(chunk({"content": c}) for c in s.chunks)
    out.append(chunk({}, FINISH[s.finish]))
    if with_usage:
        out.append(b"data: " + orjson.dumps({**base, "choices": [], "usage": _usage(s)}) + b"\n\n")
    out.append(b"data: [DONE]\n\n")
    return out


def error(status: int, message: str) -> dict[str, Any]:
    kind = "rate_limit_error" if status == 429 else "server_error" if status >= 500 else "invalid_request_error"
    return {"error": {"message": message, "type": kind, "code": None, "param": None}}
