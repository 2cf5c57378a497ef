"""The bytes every benchmark run sends and answers, computed once.

A realistic but small OpenAI chat call: a system prompt, a user turn, max_tokens set
(so admission reserves a bounded worst case). The answers are what the real API sends
for such a call: one JSON completion, or a 50-event SSE stream that ends with the usage
chunk (`choices: []`) and `[DONE]`.
"""

from __future__ import annotations

import itertools

import orjson

__all__ = ["CALL_ID", "CHAIN_FIRST_JSON", "CHAIN_FIRST_SSE", "CHAIN_NEXT_JSON", "CHAIN_NEXT_SSE", "JSON_BODY", "MODEL",
           "REQUEST_AGENT", "REQUEST_JSON", "REQUEST_SSE", "SSE_EVENTS", "STREAM_EVENTS", "TOOL_JSON_BODY",
           "TOOL_SSE_EVENTS"]

MODEL = "gpt-4o-mini"
STREAM_EVENTS = 50

_MESSAGES = [
    {"role": "system", "content": "You are a careful assistant that answers in one short paragraph."},
    {"role": "user", "content": "Summarise why connection pooling matters for a reverse proxy "
                                "that forwards many short HTTP requests to the same upstream."},
]


def _request(stream: bool) -> bytes:
    body: dict[str, object] = {"model": MODEL, "messages": _MESSAGES, "max_tokens": 256, "temperature": 0.2}
    if stream:
        # No stream_options: most SDK users never set it, so spanmeter injects include_usage
        # and drops the usage chunk again on the way back - the common, costlier path.
        body["stream"] = True
    return orjson.dumps(body)


REQUEST_JSON = _request(stream=False)
REQUEST_SSE = _request(stream=True)


def _tool(i: int) -> dict[str, object]:
    what = f"what parameter {{}} of tool {i} selects, and in which form"
    props = {f"field_{j}": {"type": "string", "description": what.format(j)} for j in range(8)}
    return {"type": "function", "function": {
        "name": f"tool_{i:02d}", "description": f"Tool number {i}: reads or changes one part of the workspace.",
        "parameters": {"type": "object", "properties": props, "required": ["field_0"]}}}


def _round(i: int, calls: int) -> list[dict[str, object]]:
    """One agent round: the model's tool calls, then each tool's result (a JSON envelope)."""
    ids = [f"call_{i:02d}_{k}" for k in range(calls)]
    assistant = {"role": "assistant", "content": None, "tool_calls": [
        {"id": cid, "type": "function",
         "function": {"name": f"tool_{(i + k) % 20:02d}", "arguments": orjson.dumps({"field_0": f"item {i}"}).decode()}}
        for k, cid in enumerate(ids)]}
    results = [{"role": "tool", "tool_call_id": cid, "content": orjson.dumps(
        {"ok": True, "rows": [{"id": r, "name": f"row {r} of round {i}", "value": r * 3.5} for r in range(22)]}
    ).decode()} for cid in ids]
    return [assistant, *results]


def _agent_turn() -> bytes:
    """An agent's 17th request: 20 tool definitions, 15 earlier rounds, 2 new tool results (~45 KB)."""
    messages: list[dict[str, object]] = [*_MESSAGES]
    for i in range(15):
        messages += _round(i, 1)
    messages += _round(15, 2)
    return orjson.dumps({"model": MODEL, "messages": messages, "tools": [_tool(i) for i in range(20)],
                         "max_tokens": 256, "temperature": 0.2})


REQUEST_AGENT = _agent_turn()

_WORDS = ("Pooling ", "keeps ", "TCP ", "connections ", "open ", "so ", "each ", "request ", "skips ",
          "the ", "handshake.")
_ANSWER = "".join(_WORDS[i % len(_WORDS)] for i in range(STREAM_EVENTS - 2))
_ID = "chatcmpl-bench0000000000000000000001"
_CREATED = 1764460800
_USAGE = {"prompt_tokens": 42, "completion_tokens": STREAM_EVENTS - 2, "total_tokens": 40 + STREAM_EVENTS}

_USAGE_DETAILS = {"prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
                  "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0,
                                                "accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0}}


def _completion(message: dict[str, object], finish: str, usage: dict[str, int]) -> bytes:
    """A non-streamed answer as OpenAI sends it (recorded in ../shared/cassettes): indented
    two spaces, the usage details, service_tier and system_fingerprint last."""
    return orjson.dumps({
        "id": _ID, "object": "chat.completion", "created": _CREATED, "model": MODEL + "-2024-07-18",
        "choices": [{"index": 0, "message": {"role": "assistant", **message, "refusal": None, "annotations": []},
                     "logprobs": None, "finish_reason": finish}],
        "usage": {**usage, **_USAGE_DETAILS}, "service_tier": "default", "system_fingerprint": "fp_bench",
    }, option=orjson.OPT_INDENT_2)


JSON_BODY = _completion({"content": _ANSWER}, "stop", _USAGE)


_PADS = itertools.count()


def _chunk(delta: dict[str, object], finish: str | None = None, usage: object = None, empty: bool = False) -> bytes:
    """One chunk as OpenAI streams it today (recorded in ../shared/cassettes: service_tier,
    `usage` null until the last, and an `obfuscation` pad whose length changes with each
    chunk), not the older shape without them: the relay reads what real traffic sends."""
    choices = [] if empty else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
    obj: dict[str, object] = {"id": _ID, "object": "chat.completion.chunk", "created": _CREATED,
                              "model": MODEL + "-2024-07-18", "service_tier": "default",
                              "system_fingerprint": "fp_bench", "choices": choices, "usage": usage}
    if not empty:
        obj["obfuscation"] = "pAd0b5Xq9K"[: 2 + next(_PADS) % 9]
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _events() -> list[bytes]:
    # 50 events: role, 46 content deltas, finish, usage chunk, [DONE].
    out = [_chunk({"role": "assistant", "content": ""})]
    out += [_chunk({"content": _WORDS[i % len(_WORDS)]}) for i in range(STREAM_EVENTS - 4)]
    out.append(_chunk({}, finish="stop"))
    out.append(_chunk({}, usage=_USAGE, empty=True))
    out.append(b"data: [DONE]\n\n")
    return out


SSE_EVENTS = _events()
assert len(SSE_EVENTS) == STREAM_EVENTS


# ---------------------------------------------------------------- a run of chained calls
#
# Back-to-back calls of one run, as an agent loop makes them: each answer asks for one tool
# call, and the next request carries that call and its result. The upstream gives every
# answer a fresh tool call id (nginx's $request_id) and wrk's script puts the id it read
# into the next request, so spanmeter matches a real pending tool call on every call.

CALL_ID = "@CALL_ID@"  # where the id goes: the upstream's answers and wrk's next request
_LOOKUP = {"type": "function", "function": {
    "name": "lookup", "description": "Look a topic up in the team's notes.",
    "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}
_ARGS = orjson.dumps({"q": "connection pooling for many short requests to one upstream"}).decode()


def _chain_request(stream: bool, carries_result: bool) -> bytes:
    messages: list[dict[str, object]] = [*_MESSAGES]
    if carries_result:
        messages += [
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": CALL_ID, "type": "function", "function": {"name": "lookup", "arguments": _ARGS}}]},
            {"role": "tool", "tool_call_id": CALL_ID,
             "content": orjson.dumps({"ok": True, "notes": ["pools skip the TCP handshake",
                                                            "keep-alive needs a bounded idle time"]}).decode()}]
    body: dict[str, object] = {"model": MODEL, "messages": messages, "tools": [_LOOKUP], "max_tokens": 256,
                               "temperature": 0.2}
    if stream:
        body["stream"] = True
    return orjson.dumps(body)


CHAIN_FIRST_JSON = _chain_request(stream=False, carries_result=False)
CHAIN_NEXT_JSON = _chain_request(stream=False, carries_result=True)
CHAIN_FIRST_SSE = _chain_request(stream=True, carries_result=False)
CHAIN_NEXT_SSE = _chain_request(stream=True, carries_result=True)
_TOOL_USAGE = {"prompt_tokens": 96, "completion_tokens": 24, "total_tokens": 120}

_TOOL_CALL = {"id": CALL_ID, "type": "function", "function": {"name": "lookup", "arguments": _ARGS}}
TOOL_JSON_BODY = _completion({"content": None, "tool_calls": [_TOOL_CALL]}, "tool_calls", _TOOL_USAGE)


def _tool_events() -> list[bytes]:
    # 50 events: the call's id and name, its arguments in 46 pieces, finish, usage, [DONE].
    out = [_chunk({"role": "assistant", "content": None, "tool_calls": [
        {"index": 0, "id": CALL_ID, "type": "function", "function": {"name": "lookup", "arguments": ""}}]})]
    n = STREAM_EVENTS - 4
    cuts = [len(_ARGS) * i // n for i in range(n + 1)]
    out += [_chunk({"tool_calls": [{"index": 0, "function": {"arguments": _ARGS[a:b]}}]})
            for a, b in itertools.pairwise(cuts)]
    out.append(_chunk({}, finish="tool_calls"))
    out.append(_chunk({}, usage=_TOOL_USAGE, empty=True))
    out.append(b"data: [DONE]\n\n")
    return out


TOOL_SSE_EVENTS = _tool_events()
assert len(TOOL_SSE_EVENTS) == STREAM_EVENTS
