"""Rewrites keep the provider's prompt cache: a real SDK agent loop per dialect.

The model is stuck on one tool call (simulator scenario `loop`), so from the 3rd identical
call on the guard prefixes a reminder to the tool result. A provider caches a prompt by
its exact prefix, so every forwarded turn N+1 must start with forwarded turn N "up to the
end of its last message", which for each dialect's JSON means:

    the bytes of the request body from its first byte up to and including the last byte
    of the last element of the conversation array (`messages` for chat and Anthropic,
    `input` for Responses, `contents` for Gemini); the array itself is located in the
    bytes by Python's own JSON decoder, independently of the proxy's code.

Element by element: the bytes before the array are identical, each element of turn N's
array is byte-identical to the element at the same index in turn N+1 (so is what
separates them), and the rest of the body after the array (tools, model, config) is
identical too, since providers put tools and system before the messages in the prompt.

The test can fail: forwarding a reminded result without its reminder in the next turn,
or re-serialising the body (google-genai writes `", "`; orjson does not), breaks it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable
from typing import Any

import anthropic
import openai
import pytest

from proxy.simulator import Received

READ_FILE = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}
ROUNDS = 6  # 6 tool calls: results 3-6 carry reminders
ARRAY = {"chat": "messages", "responses": "input", "anthropic": "messages", "gemini": "contents"}
_DECODER = json.JSONDecoder()
_WS = re.compile(r"[ \t\n\r]*")
# The reminder as it sits in the forwarded bytes: inside a JSON string (chat, Responses,
# Anthropic), or as the first member of Gemini's functionResponse.response.
_IN_STRING = re.compile(rb"\[spanmeter\] Note: you have called the tool `[^`]+` \d+ times in a row "
                        rb"[^\"]*?answer with what you already have\.\\n\\n")
_MEMBER = re.compile(rb'"spanmeter_reminder":"\[spanmeter\] Note: [^"]*?answer with what you already have\.",?')


def array_layout(raw: bytes, key: str) -> tuple[int, list[tuple[int, int]], int]:
    """(byte offset of the array's `[`, (start, end) of each element, offset after its `]`)
    of the top-level array `key` of a JSON object, found with the stdlib decoder."""
    text = raw.decode("utf-8")
    obj, _ = _DECODER.raw_decode(text)
    assert isinstance(obj.get(key), list), f"no array {key!r}"

    def b(i: int) -> int:
        return len(text[:i].encode("utf-8"))

    i = _WS.match(text, 1).end()  # type: ignore[union-attr]
    while True:  # walk the top-level members to the one named `key` (the last one, as parsed)
        name, i = json.decoder.scanstring(text, i + 1)  # type: ignore[attr-defined]
        i = _WS.match(text, _WS.match(text, i).end() + 1).end()  # type: ignore[union-attr]
        if name == key:
            start = i
        end = _DECODER.raw_decode(text, i)[1]
        if name == key:
            found = (start, end)
        i = _WS.match(text, end).end()  # type: ignore[union-attr]
        if text[i] == "}":
            break
        i = _WS.match(text, i + 1).end()  # type: ignore[union-attr]
    start, end = found
    elements = []
    j = _WS.match(text, start + 1).end()  # type: ignore[union-attr]
    while text[j] != "]":
        e = _DECODER.raw_decode(text, j)[1]
        elements.append((b(j), b(e)))
        j = _WS.match(text, e).end()  # type: ignore[union-attr]
        if text[j] == ",":
            j = _WS.match(text, j + 1).end()  # type: ignore[union-attr]
    return b(start), elements, b(end)


def assert_prefix_kept(turns: list[bytes], key: str) -> None:
    for n in range(len(turns) - 1):
        a, b = turns[n], turns[n + 1]
        a_open, a_elems, a_close = array_layout(a, key)
        b_open, b_elems, b_close = array_layout(b, key)
        assert a[:a_open] == b[:b_open], f"turn {n + 2}: the bytes before `{key}` changed"
        assert len(b_elems) > len(a_elems), f"turn {n + 2} does not extend turn {n + 1}"
        for k, ((s1, e1), (s2, e2)) in enumerate(zip(a_elems, b_elems, strict=False)):
            assert a[s1:e1] == b[s2:e2], (
                f"{key}[{k}] of turn {n + 1} came back changed in turn {n + 2}:\n{a[s1:e1]!r}\n{b[s2:e2]!r}")
        last_end = a_elems[-1][1]
        assert b.startswith(a[:last_end]), f"turn {n + 2} does not start with turn {n + 1} up to its last message"
        assert a[a_close:] == b[b_close:], f"turn {n + 2}: the body after `{key}` changed"


def reminders(raw: bytes) -> int:
    return len(_IN_STRING.findall(raw)) + len(_MEMBER.findall(raw))


def without_reminders(raw: bytes) -> bytes:
    return _IN_STRING.sub(b"", _MEMBER.sub(b"", raw))


def bodies(received: list[Received]) -> list[bytes]:
    return [r.body for r in received]


# --- one agent loop per dialect, with the real SDK; returns the last request it sent --------

async def chat_loop(url: str, stream: bool = False) -> Callable[[str], Awaitable[None]]:
    tools: Any = [{"type": "function", "function": {"name": "read_file", "parameters": READ_FILE}}]
    msgs: list[Any] = [{"role": "system", "content": "You read files. Ünïcödé stays as it is."},
                       {"role": "user", "content": "SCENARIO:loop read the config"}]
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", default_headers={"X-Run-Id": "pc-chat"})
    for _ in range(ROUNDS):
        if stream:
            s = await client.chat.completions.create(model="sim-small", messages=msgs, tools=tools, stream=True)
            calls: dict[int, Any] = {}
            async for chunk in s:
                for tc in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
                    c = calls.setdefault(tc.index, {"id": "", "type": "function",
                                                    "function": {"name": "", "arguments": ""}})
                    c["id"] += tc.id or ""
                    c["function"]["name"] += (tc.function.name or "") if tc.function else ""
                    c["function"]["arguments"] += (tc.function.arguments or "") if tc.function else ""
            call = calls[0]
            msgs += [{"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": call["id"], "content": '{"ok": true, "text": "x: 1.0"}'}]
        else:
            resp = await client.chat.completions.create(model="sim-small", messages=msgs, tools=tools)
            message = resp.choices[0].message
            msgs += [message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": message.tool_calls[0].id,
                      "content": '{"ok": true, "text": "x: 1.0"}'}]
    extra: Any = {"stream": True} if stream else {}
    await client.chat.completions.create(model="sim-small", messages=msgs, tools=tools, **extra)
    await client.close()

    async def resend(to: str) -> None:
        direct = openai.AsyncOpenAI(base_url=f"{to}/v1", api_key="k")
        await direct.chat.completions.create(model="sim-small", messages=msgs, tools=tools, **extra)
        await direct.close()
    return resend


async def responses_loop(url: str) -> Callable[[str], Awaitable[None]]:
    tools: Any = [{"type": "function", "name": "read_file", "parameters": READ_FILE, "strict": False}]
    inputs: list[Any] = [{"role": "user", "content": "SCENARIO:loop"}]
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", default_headers={"X-Run-Id": "pc-resp"})
    kw: Any = {"model": "gpt-5", "tools": tools, "instructions": "Read files."}
    for _ in range(ROUNDS):
        resp = await client.responses.create(input=inputs, **kw)
        call = next(o for o in resp.output if o.type == "function_call")
        inputs += [call.model_dump(exclude_none=True),
                   {"type": "function_call_output", "call_id": call.call_id, "output": "same \u00e9"}]
    await client.responses.create(input=inputs, **kw)
    await client.close()

    async def resend(to: str) -> None:
        direct = openai.AsyncOpenAI(base_url=f"{to}/v1", api_key="k")
        await direct.responses.create(input=inputs, **kw)
        await direct.close()
    return resend


THINKING = {"type": "thinking", "thinking": "The user wants the config; read it.",
            "signature": "EqQBCkgIARABGAIiQL3d+/Zb7Q==\u2028sig"}


async def anthropic_loop(url: str, *, thinking: bool = False) -> Callable[[str], Awaitable[None]]:
    tools: Any = [{"name": "read_file", "input_schema": READ_FILE}]
    system: Any = [{"type": "text", "text": "You read files.", "cache_control": {"type": "ephemeral"}}]
    msgs: list[Any] = [{"role": "user", "content": [{"type": "text", "text": "SCENARIO:loop",
                                                     "cache_control": {"type": "ephemeral", "ttl": "1h"}}]}]
    client = anthropic.AsyncAnthropic(base_url=url, api_key="k", default_headers={"X-Run-Id": "pc-anth"})
    kw: Any = {"model": "claude-sonnet-5-5", "max_tokens": 1000, "tools": tools, "system": system}
    for round_ in range(ROUNDS):
        resp = await client.messages.create(messages=msgs, **kw)
        use = next(b for b in resp.content if b.type == "tool_use")
        content = [b.model_dump() for b in resp.content]
        if thinking:  # as a thinking model's turn comes back: its signed thinking block first
            content = [THINKING, *content]
        result: dict[str, Any] = {"type": "tool_result", "tool_use_id": use.id, "content": "same"}
        if round_ == 2:  # a breakpoint on the 3rd result, the first one the guard reminds
            result["cache_control"] = {"type": "ephemeral"}
        msgs += [{"role": "assistant", "content": content}, {"role": "user", "content": [result]}]
    await client.messages.create(messages=msgs, **kw)
    await client.close()

    async def resend(to: str) -> None:
        direct = anthropic.AsyncAnthropic(base_url=to, api_key="k")
        await direct.messages.create(messages=msgs, **kw)
        await direct.close()
    return resend


async def gemini_loop(url: str) -> Callable[[str], Awaitable[None]]:
    from google import genai
    from google.genai import types

    def config() -> Any:
        decl = types.FunctionDeclaration(name="read_file", parameters_json_schema=READ_FILE)
        return types.GenerateContentConfig(
            tools=[types.Tool(function_declarations=[decl])], cached_content="cachedContents/agent-prefix-1",
            automatic_function_calling=types.AutomaticFunctionCallingConfig(disable=True))

    client = genai.Client(api_key="k", http_options=types.HttpOptions(base_url=url, headers={"X-Run-Id": "pc-gem"}))
    contents: list[Any] = [types.Content(role="user", parts=[types.Part(text="SCENARIO:loop")])]
    for _ in range(ROUNDS):
        resp = await client.aio.models.generate_content(model="gemini-2.5-flash", contents=contents, config=config())
        fc = resp.function_calls[0]
        contents += [resp.candidates[0].content, types.Content(role="user", parts=[types.Part(
            function_response=types.FunctionResponse(name=fc.name, id=fc.id, response={"result": "same", "n": 1.0}))])]
    await client.aio.models.generate_content(model="gemini-2.5-flash", contents=contents, config=config())

    async def resend(to: str) -> None:
        direct = genai.Client(api_key="k", http_options=types.HttpOptions(base_url=to))
        await direct.aio.models.generate_content(model="gemini-2.5-flash", contents=contents, config=config())
    return resend


LOOPS: dict[str, Callable[[str], Awaitable[Callable[[str], Awaitable[None]]]]] = {
    "chat": chat_loop,
    "chat-stream": lambda url: chat_loop(url, stream=True),
    "responses": responses_loop,
    "anthropic": anthropic_loop,
    "gemini": gemini_loop,
}


@pytest.mark.parametrize("dialect", list(LOOPS))
async def test_every_forwarded_turn_starts_with_the_previous_one(make_proxy, sim, dialect):
    proxy = await make_proxy()
    resend = await LOOPS[dialect](proxy.url)
    turns = bodies(sim.received)
    assert len(turns) == ROUNDS + 1
    # Request k carries the results of calls 1..k-1; results 3.. carry a reminder.
    assert [reminders(t) for t in turns] == [0, 0, 0, 1, 2, 3, 4], "the reminders are where they must be"
    assert_prefix_kept(turns, ARRAY[dialect.removesuffix("-stream")])
    # And nothing but the reminders changed: the same last request sent straight to the
    # simulator (no proxy) is the forwarded one without them, to the byte.
    await resend(sim.url)
    direct = sim.last.body
    assert reminders(direct) == 0
    forwarded = turns[-1]
    if dialect == "chat-stream":  # include_usage is injected upstream: a top-level field, after the rest
        injected = b',"stream_options":{"include_usage":true}}'
        assert forwarded.endswith(injected)
        forwarded = forwarded[: -len(injected)] + b"}"
    assert without_reminders(forwarded) == direct


async def test_signed_thinking_and_cache_breakpoints_pass_untouched_beside_a_reminder(make_proxy, sim):
    proxy = await make_proxy()
    resend = await anthropic_loop(proxy.url, thinking=True)
    forwarded = sim.received[-1].body
    await resend(sim.url)
    direct = sim.last.body
    # The reminders are in this request...
    assert reminders(forwarded) == ROUNDS - 2
    sent = json.loads(forwarded)
    results = [b for m in sent["messages"] for b in m["content"] if isinstance(m["content"], list)
               if b.get("type") == "tool_result"]
    assert results[-1]["content"].startswith("[spanmeter] Note: you have called the tool `read_file` 6 times")
    assert results[2]["content"].startswith("[spanmeter] Note: you have called the tool `read_file` 3 times")
    assert results[2]["cache_control"] == {"type": "ephemeral"}, "the breakpoint stays on the reminded result"
    assert sent["system"][0]["cache_control"] == {"type": "ephemeral"}
    assert sent["messages"][0]["content"][0]["cache_control"] == {"type": "ephemeral", "ttl": "1h"}
    # ...and every thinking block, its signature, and each cache_control arrive as the client sent them.
    thinking = [b for m in sent["messages"] if m["role"] == "assistant"
                for b in m["content"] if b["type"] == "thinking"]
    assert thinking == [THINKING] * ROUNDS
    for needle in (b'"signature":', b'"cache_control":'):
        found_fwd = [forwarded[i:i + 80] for i in _all(forwarded, needle)]
        found_direct = [direct[i:i + 80] for i in _all(direct, needle)]
        assert found_fwd and found_fwd == found_direct
    assert without_reminders(forwarded) == direct, "only the reminded results changed"


def _all(data: bytes, needle: bytes) -> list[int]:
    out, i = [], data.find(needle)
    while i != -1:
        out.append(i)
        i = data.find(needle, i + 1)
    return out


async def test_a_reminder_survives_the_store_forgetting_the_run(make_proxy, sim):
    """Replica-proof: a second proxy with its own empty ledger (a replica that never saw the
    run, or a restart) forwards the next turn with the same reminders, byte for byte."""
    first = await make_proxy()
    await chat_loop(first.url)
    turns = bodies(sim.received)
    second = await make_proxy()  # its own data dir: an empty ledger
    last = json.loads(turns[-1])
    client = openai.AsyncOpenAI(base_url=f"{second.url}/v1", api_key="k", default_headers={"X-Run-Id": "pc-chat"})
    msgs = [_undo(m) for m in last["messages"]]
    await client.chat.completions.create(model="sim-small", messages=msgs, tools=last["tools"])
    await client.close()
    again = sim.last.body
    assert again == turns[-1], "the same conversation through another replica forwards the same bytes"


def _undo(message: dict[str, Any]) -> dict[str, Any]:
    """A forwarded message as the client had it: without the reminder."""
    if message.get("role") == "tool" and isinstance(message.get("content"), str):
        return {**message, "content": re.sub(r"^\[spanmeter\] Note: .*?already have\.\n\n", "", message["content"],
                                             flags=re.S)}
    return message


async def test_kept_reminders_are_recorded_but_counted_once(make_proxy, sim):
    """Nothing is rewritten silently: the reminders kept on older results are one record
    saying how many; only the new result's reminder is a new loop_reminder (and guard action)."""
    proxy = await make_proxy()
    tools: Any = [{"type": "function", "function": {"name": "read_file", "parameters": READ_FILE}}]
    msgs: list[Any] = [{"role": "user", "content": "SCENARIO:loop"}]
    headers = []
    async with openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="k",
                                  default_headers={"X-Run-Id": "pc-kept"}) as client:
        for _ in range(5):
            raw = await client.chat.completions.with_raw_response.create(model="sim-small", messages=msgs,
                                                                         tools=tools)
            headers.append(raw.headers.get("x-spanmeter-rewrites"))
            message = raw.parse().choices[0].message
            msgs += [message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "same"}]
    assert headers == [None, None, None, "loop_reminder=read_filex3",
                       "loop_reminder=read_filex4, loop_reminder_kept=1"]
