"""The simulator in the OpenAI Responses dialect (`POST /v1/responses`).

Streams carry the full typed event sequence the `responses.stream()` helper and the
Agents SDK need: created, in_progress, output_item.added, content_part.added, deltas,
the .done events, then response.completed (or response.incomplete) with usage.
"""

from __future__ import annotations

from typing import Any

import orjson

from proxy.simulator.script import Request, Script, said

CREATED_AT = 1764460800


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


def parse(body: dict[str, Any], path: str) -> Request:
    raw = body.get("input")
    items: list[Any] = [{"role": "user", "content": raw}] if isinstance(raw, str) else (
        [i for i in raw if isinstance(i, dict)] if isinstance(raw, list) else [])
    last_user, notice = said([_text(i.get("content")) for i in items if i.get("role") == "user"])
    tails = items[:-1] if notice and items[-1].get("role") == "user" else items
    tail = tails[-1] if tails else {}
    result = None
    if tail.get("type") == "function_call_output":
        out = tail.get("output")
        result = out if isinstance(out, str) else _text(out)
    tools = tuple(str(t["name"]) for t in body.get("tools") or []
                  if isinstance(t, dict) and t.get("type") == "function" and "name" in t)
    instructions = body.get("instructions")
    chars = len(instructions) if isinstance(instructions, str) else 0
    chars += sum(len(_text(i.get("content"))) + len(str(i.get("output") or "")) for i in items)
    return Request(str(body.get("model", "sim-small")), body.get("stream") is True, last_user,
                   result, tools, chars, notice, len(items))


def _usage(s: Script) -> dict[str, Any]:
    return {"input_tokens": s.input_tokens,
            "input_tokens_details": {"cached_tokens": s.cached_tokens},
            "output_tokens": s.output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": s.input_tokens + s.output_tokens}


def _message(rid: str, text: str, status: str) -> dict[str, Any]:
    return {"id": f"msg_{rid}", "type": "message", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _function_call(rid: str, s: Script, status: str, arguments: str) -> dict[str, Any]:
    assert s.tool is not None
    return {"id": f"fc_{rid}", "type": "function_call", "status": status,
            "call_id": f"call_{rid}", "name": s.tool[0], "arguments": arguments}


def _response(
    s: Script, req: Request, rid: str, output: list[Any], *, final: bool
) -> dict[str, Any]:
    truncated = s.finish == "length"
    status = ("incomplete" if truncated else "completed") if final else "in_progress"
    return {
        "id": f"resp_{rid}", "object": "response", "created_at": CREATED_AT, "status": status,
        "background": False, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if final and truncated else None,
        "instructions": None, "max_output_tokens": None, "model": req.model, "output": output,
        "parallel_tool_calls": True, "previous_response_id": None,
        "reasoning": {"effort": None, "summary": None}, "store": False, "temperature": 1.0,
        "text": {"format": {"type": "text"}}, "tool_choice": "auto", "tools": [], "top_p": 1.0,
        "truncation": "disabled", "usage": _usage(s) if final else None, "metadata": {},
    }


def _final_output(s: Script, rid: str) -> list[Any]:
    if s.tool:
        return [_function_call(rid, s, "completed", s.tool[1])]
    status = "incomplete" if s.finish == "length" else "completed"
    return [_message(rid, "".join(s.chunks), status)]


def body(s: Script, req: Request, rid: str) -> dict[str, Any]:
    return _response(s, req, rid, _final_output(s, rid), final=True)


def _item_events(s: Script, rid: str) -> list[dict[str, Any]]:
    """The output item's events between response.in_progress and response.completed."""
    base = {"output_index": 0}
    if s.tool:
        args = s.tool[1]
        done = _function_call(rid, s, "completed", args)
        return [
            {"type": "response.output_item.added", **base,
             "item": _function_call(rid, s, "in_progress", "")},
            *({"type": "response.function_call_arguments.delta", **base, "item_id": f"fc_{rid}",
               "delta": args[i : i + 7]} for i in range(0, len(args), 7)),
            {"type": "response.function_call_arguments.done", **base, "item_id": f"fc_{rid}",
             "arguments": args},
            {"type": "response.output_item.done", **base, "item": done},
        ]
    text = "".join(s.chunks)
    part = {"item_id": f"msg_{rid}", **base, "content_index": 0}
    empty = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
    return [
        {"type": "response.output_item.added", **base, "item": {
            **_message(rid, "", "in_progress"), "content": []}},
        {"type": "response.content_part.added", **part, "part": empty},
        *({"type": "response.output_text.delta", **part, "delta": c, "logprobs": []}
          for c in s.chunks),
        {"type": "response.output_text.done", **part, "text": text, "logprobs": []},
        {"type": "response.content_part.done", **part, "part": {**empty, "text": text}},
        {"type": "response.output_item.done", **base, "item": _final_output(s, rid)[0]},
    ]


def events(s: Script, req: Request, rid: str, body_in: dict[str, Any]) -> list[bytes]:
    start = _response(s, req, rid, [], final=False)
    final = _response(s, req, rid, _final_output(s, rid), final=True)
    last = "response.incomplete" if s.finish == "length" else "response.completed"
    sequence = [
        {"type": "response.created", "response": start},
        {"type": "response.in_progress", "response": start},
        *_item_events(s, rid),
        {"type": last, "response": final},
    ]
    return [b"event: " + e["type"].encode() + b"\ndata: "
            + orjson.dumps({**e, "sequence_number": n}) + b"\n\n"
            for n, e in enumerate(sequence)]


def error(status: int, message: str) -> dict[str, Any]:
    kind = ("rate_limit_error" if status == 429 else "server_error" if status >= 500
            else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "code": None, "param": None}}
