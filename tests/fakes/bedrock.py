"""A fake AWS Bedrock runtime: Converse and InvokeModel (Anthropic bodies), whole and streamed
in AWS event-stream frames, with Bedrock's token-count headers, exactly as the real host
speaks them. It checks every request's credential as Bedrock would: a Bedrock API key
(`Authorization: Bearer`) against the one it was given, or a SigV4 signature recomputed with
botocore from the fake AWS keys it was given (what the proxy must have signed, over the exact
path and bytes it sent). A request that fails answers 403 in Bedrock's error shape.

The frames are encoded here by hand per the AWS event-stream spec (botocore has a decoder
and no public encoder): outside-world code, independent of spanmeter's own encoder.
"""

from __future__ import annotations

import base64
import json
import struct
import time
import zlib
from typing import Any

from aiohttp import web
from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

from tests.fixtures.anthropic_cache import PromptCache

SEEN = web.AppKey("seen", list)
CONFIG = web.AppKey("config", dict)
CACHE = web.AppKey("cache", PromptCache)
EVENTSTREAM = "application/vnd.amazon.eventstream"


def create_bedrock(*, access_key: str, secret_key: str, api_key: str, region: str = "us-east-1") -> web.Application:
    app = web.Application()
    app[SEEN] = []
    app[CONFIG] = {"access_key": access_key, "secret_key": secret_key, "api_key": api_key, "region": region}
    app[CACHE] = PromptCache()
    app.router.add_post("/model/{model}/{action}", _answer)
    return app


def frame(headers: dict[str, str], payload: bytes) -> bytes:
    """One frame: prelude (total length, headers length, CRC), string headers, payload, CRC."""
    head = b""
    for name, value in headers.items():
        key, text = name.encode(), value.encode()
        head += bytes([len(key)]) + key + b"\x07" + struct.pack(">H", len(text)) + text
    prelude = struct.pack(">II", 12 + len(head) + len(payload) + 4, len(head))
    message = prelude + struct.pack(">I", zlib.crc32(prelude)) + head + payload
    return message + struct.pack(">I", zlib.crc32(message))


def event(kind: str, data: dict[str, Any]) -> bytes:
    return frame({":event-type": kind, ":content-type": "application/json", ":message-type": "event"},
                 json.dumps({**data, "p": "abcdef"}).encode())


def _chunk(data: dict[str, Any]) -> bytes:
    return event("chunk", {"bytes": base64.b64encode(json.dumps(data).encode()).decode()})


def _credential(request: web.Request, body: bytes) -> str | None:
    """What is wrong with the request's credential, or None."""
    cfg = request.app[CONFIG]
    auth = request.headers.get("Authorization", "")
    if auth.startswith("Bearer "):
        return None if auth == f"Bearer {cfg['api_key']}" else "The security token included in the request is invalid."
    if not auth.startswith("AWS4-HMAC-SHA256 "):
        return "Missing Authentication Token"
    fields = dict(part.strip().split("=", 1) for part in auth.removeprefix("AWS4-HMAC-SHA256 ").split(","))
    access, _date, region, service, _ = fields["Credential"].split("/")
    if access != cfg["access_key"] or region != cfg["region"] or service != "bedrock":
        return f"The security token included in the request is invalid ({access}, {region}, {service})."
    signed = fields["SignedHeaders"].split(";")
    headers = {name: request.headers[name] for name in signed if name in request.headers}
    url = f"http://{request.host}{request.raw_path}"
    again = AWSRequest(method=request.method, url=url, data=body, headers=headers)
    again.context["timestamp"] = request.headers["X-Amz-Date"]
    auth_v4 = SigV4Auth(Credentials(cfg["access_key"], cfg["secret_key"]), "bedrock", region)
    want = auth_v4.signature(auth_v4.string_to_sign(again, auth_v4.canonical_request(again)), again)
    if want != fields["Signature"]:
        return "The request signature we calculated does not match the signature you provided."
    return None


def _usage(body: dict[str, Any], cache: PromptCache | None = None) -> dict[str, int]:
    """Fixed counts; with a `cache` (the `x-fake-cache: on` header), the request billed as
    Anthropic's cache bills it (tests/fixtures/anthropic_cache.py: a cache point marks the
    block before it), its `inputTokens` without what it read and wrote, as Converse reports it."""
    if cache is None:
        return {"inputTokens": 40, "outputTokens": 12, "totalTokens": 52 + 30,
                "cacheReadInputTokens": 30, "cacheWriteInputTokens": 0}
    billed = cache.bill(_as_anthropic(body), time.monotonic())
    assert billed is not None, "more than 4 cache points"
    read, written = billed.cache_read_tokens or 0, billed.cache_write_tokens or 0
    total = billed.input_tokens or 0
    return {"inputTokens": total - read - written, "outputTokens": 12, "totalTokens": total + 12,
            "cacheReadInputTokens": read, "cacheWriteInputTokens": written}


def _marked(blocks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Converse blocks as Anthropic's: a cache point becomes a `cache_control` on the block before it."""
    out: list[dict[str, Any]] = []
    for b in blocks:
        if "cachePoint" in b:
            out[-1] = {**out[-1], "cache_control": {"type": "ephemeral"}}
        else:
            out.append(b)
    return out


def _as_anthropic(body: dict[str, Any]) -> dict[str, Any]:
    return {"model": "bedrock", "tools": _marked((body.get("toolConfig") or {}).get("tools") or []),
            "system": _marked(body.get("system") or []),
            "messages": [{"role": m["role"], "content": _marked(m["content"])} for m in body["messages"]]}


def _results(body: dict[str, Any]) -> int:
    return sum(1 for m in body.get("messages") or [] if any("toolResult" in b for b in m.get("content") or []))


def _wants_tool(body: dict[str, Any], turns: int = 1) -> str | None:
    """The first tool's name until `turns` tool results came back (the `x-fake-turns` header)."""
    tools = (body.get("toolConfig") or {}).get("tools") or []
    return tools[0]["toolSpec"]["name"] if tools and _results(body) < turns else None


async def _answer(request: web.Request) -> web.StreamResponse:
    body = await request.read()
    problem = _credential(request, body)
    request.app[SEEN].append({"path": request.raw_path, "headers": dict(request.headers), "body": body,
                              "problem": problem})
    if problem is not None:
        return web.json_response({"message": problem}, status=403,
                                 headers={"x-amzn-errortype": "UnrecognizedClientException:http://internal.amazon.com/"})
    parsed = json.loads(body)
    action = request.match_info["action"]
    cut = request.headers.get("x-fake-cut") == "1"
    if action == "converse":
        turns = int(request.headers.get("x-fake-turns", "1"))
        cache = request.app[CACHE] if request.headers.get("x-fake-cache") == "on" else None
        malformed = request.headers.get("x-fake-malformed")
        if malformed is not None:
            return web.json_response(_malformed(parsed, malformed))
        return web.json_response(_converse(parsed, cache, turns))
    if action == "invoke":
        answer = {"id": "msg_bdrk_01", "type": "message", "role": "assistant", "model": "claude-3-5-sonnet-20240620",
                  "content": [{"type": "text", "text": "Hello from Bedrock."}], "stop_reason": "end_turn",
                  "usage": {"input_tokens": 14, "output_tokens": 6}}
        return web.json_response(answer, headers={"x-amzn-bedrock-input-token-count": "14",
                                                  "x-amzn-bedrock-output-token-count": "6"})
    frames = _converse_stream(parsed, request.headers.get("x-fake-malformed")) if action == "converse-stream" \
        else _invoke_stream()
    resp = web.StreamResponse(headers={"Content-Type": EVENTSTREAM})
    await resp.prepare(request)
    for i, f in enumerate(frames):
        if cut and i == 3:
            await resp.write(f[: len(f) // 2])  # half a frame, then the connection drops
            assert request.transport is not None
            request.transport.abort()
            return resp
        await resp.write(f)
    await resp.write_eof()
    return resp


def _converse(body: dict[str, Any], cache: PromptCache | None, turns: int) -> dict[str, Any]:
    tool = _wants_tool(body, turns)
    content: list[dict[str, Any]] = [{"text": "Let me look."}]
    if tool:
        content.append({"toolUse": {"toolUseId": f"tooluse_fake_{_results(body) + 1:02d}", "name": tool,
                                    "input": {"city": "Paris"}}})
    return {"output": {"message": {"role": "assistant", "content": content if tool else [{"text": "It is sunny."}]}},
            "stopReason": "tool_use" if tool else "end_turn", "usage": _usage(body, cache),
            "metrics": {"latencyMs": 5}}


# What a model's structured output may look like when it slips: fenced, with JSON5's
# unquoted keys, single quotes and a trailing comma.
SLIPPED = "```json\n{city: 'Paris', days: 3,}\n```"


def _malformed(body: dict[str, Any], kind: str) -> dict[str, Any]:
    """A forced tool's call whose `input` came as that text (`x-fake-malformed: tool`), or
    that text as the answer (`text`)."""
    if kind == "tool":
        name = body["toolConfig"]["toolChoice"]["tool"]["name"]
        content: list[dict[str, Any]] = [{"toolUse": {"toolUseId": "tooluse_fake_slip", "name": name,
                                                      "input": SLIPPED}}]
    else:
        content = [{"text": SLIPPED}]
    return {"output": {"message": {"role": "assistant", "content": content}},
            "stopReason": "tool_use" if kind == "tool" else "end_turn", "usage": _usage(body),
            "metrics": {"latencyMs": 5}}


def _converse_stream(body: dict[str, Any], malformed: str | None = None) -> list[bytes]:
    """Text, then a call of the first tool; with `x-fake-malformed: text`, SLIPPED as the text."""
    tool = _wants_tool(body)
    text = [SLIPPED[:9], SLIPPED[9:]] if malformed == "text" else ["It is ", "sunny."]
    out = [event("messageStart", {"role": "assistant"}),
           *[event("contentBlockDelta", {"contentBlockIndex": 0, "delta": {"text": t}}) for t in text],
           event("contentBlockStop", {"contentBlockIndex": 0})]
    if tool:
        out += [event("contentBlockStart", {"contentBlockIndex": 1,
                                            "start": {"toolUse": {"toolUseId": "tooluse_fake_02", "name": tool}}}),
                event("contentBlockDelta", {"contentBlockIndex": 1, "delta": {"toolUse": {"input": '{"city": '}}}),
                event("contentBlockDelta", {"contentBlockIndex": 1, "delta": {"toolUse": {"input": '"Oslo"}'}}}),
                event("contentBlockStop", {"contentBlockIndex": 1})]
    return [*out, event("messageStop", {"stopReason": "tool_use" if tool else "end_turn"}),
            event("metadata", {"usage": _usage(body), "metrics": {"latencyMs": 5}})]


def _invoke_stream() -> list[bytes]:
    return [
        _chunk({"type": "message_start", "message": {
            "id": "msg_bdrk_02", "type": "message", "role": "assistant", "model": "claude-3-5-sonnet-20240620",
            "content": [], "stop_reason": None, "usage": {"input_tokens": 20, "output_tokens": 1}}}),
        _chunk({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
        _chunk({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hi "}}),
        _chunk({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "there."}}),
        _chunk({"type": "content_block_stop", "index": 0}),
        _chunk({"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 9}}),
        _chunk({"type": "message_stop", "amazon-bedrock-invocationMetrics": {
            "inputTokenCount": 20, "outputTokenCount": 8, "invocationLatency": 300, "firstByteLatency": 100}}),
    ]
