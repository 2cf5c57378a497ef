"""Record the request bodies the real SDKs send, into tests/data/<dialect>/*.request.json.

Not a test: run `.venv/bin/python -m tests.providers.record_requests` to refresh the
recordings after an SDK upgrade. A tiny aiohttp app on 127.0.0.1 (port 0) answers
every call with the smallest body each SDK accepts and keeps what it received.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anthropic
import openai
import pydantic
from aiohttp import web
from google import genai
from google.genai import types

DATA = Path(__file__).resolve().parent.parent / "data"

_CHAT = {"id": "c", "object": "chat.completion", "created": 0, "model": "m",
         "choices": [{"index": 0, "message": {"role": "assistant",
                                               "content": '{"name": "a", "age": 1}'},
                      "finish_reason": "stop"}]}
_RESP = {"id": "r", "object": "response", "model": "m", "status": "completed", "output": [
    {"type": "message", "id": "m", "role": "assistant", "status": "completed",
     "content": [{"type": "output_text", "text": '{"name": "a", "age": 1}', "annotations": []}]}]}
_MSG = {"id": "msg", "type": "message", "role": "assistant", "model": "m",
        "content": [{"type": "text", "text": '{"name": "a", "age": 1}'}],
        "stop_reason": "end_turn", "usage": {"input_tokens": 1, "output_tokens": 1}}
_GEM = {"candidates": [{"content": {"role": "model", "parts": [{"text": "{}"}]},
                        "finishReason": "STOP"}]}


class Person(pydantic.BaseModel):
    name: str
    age: int


WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


class Recorder:
    def __init__(self) -> None:
        self.seen: list[tuple[str, dict[str, Any]]] = []

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json() if request.can_read_body else {}
        self.seen.append((request.path_qs, body))
        path = request.path
        if body.get("stream") or "stream" in path:
            return await self._sse(request)
        if path.endswith("/chat/completions"):
            return web.json_response(_CHAT)
        if path.endswith("/responses"):
            return web.json_response(_RESP)
        if path.endswith("/messages"):
            return web.json_response(_MSG)
        if path.endswith("/embeddings"):
            return web.json_response({"object": "list", "model": "m", "data": [],
                                      "usage": {"prompt_tokens": 1, "total_tokens": 1}})
        return web.json_response(_GEM)

    async def _sse(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        path = request.path
        if path.endswith("/messages"):
            start = {**_MSG, "content": [], "stop_reason": None}
            for name, data in (("message_start", {"type": "message_start", "message": start}),
                               ("message_delta", {"type": "message_delta",
                                                  "delta": {"stop_reason": "end_turn"},
                                                  "usage": {"output_tokens": 1}}),
                               ("message_stop", {"type": "message_stop"})):
                await resp.write(f"event: {name}\ndata: {json.dumps(data)}\n\n".encode())
        elif path.endswith("/responses"):
            for seq, kind in enumerate(("response.created", "response.completed")):
                data = {"type": kind, "sequence_number": seq, "response": _RESP}
                await resp.write(f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode())
        elif path.endswith("/chat/completions"):
            await resp.write(b'data: {"choices":[{"index":0,"delta":{"content":"x"}}]}\n\n')
            await resp.write(b"data: [DONE]\n\n")
        else:
            await resp.write(b"data: " + json.dumps(_GEM).encode() + b"\r\n\r\n")
        return resp


Scenario = Callable[[str], Awaitable[None]]


async def chat_cases(base: str) -> dict[str, Any]:
    c = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="k", max_retries=0)
    msgs: list[Any] = [{"role": "system", "content": "Be brief."},
                       {"role": "user", "content": "Weather in Paris?"}]
    tools: Any = [{"type": "function", "function": {"name": "get_weather",
                                                    "description": "Weather of a city",
                                                    "parameters": WEATHER}}]
    out: dict[str, Any] = {}
    await c.chat.completions.create(model="gpt-4o", messages=msgs, temperature=0.2,
                                    max_completion_tokens=200, seed=7, stop=["END"])
    out["plain"] = None
    async for _ in await c.chat.completions.create(model="gpt-4o", messages=msgs, stream=True):
        pass
    out["stream"] = None
    async for _ in await c.chat.completions.create(model="gpt-4o", messages=msgs, stream=True,
                                                   stream_options={"include_usage": True}):
        pass
    out["stream_usage"] = None
    await c.chat.completions.create(model="gpt-4o", messages=msgs, tools=tools)
    out["tools"] = None
    round_trip = [*msgs, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 18}'}]
    await c.chat.completions.create(model="gpt-4o", messages=round_trip, tools=tools)
    out["tool_result"] = None
    await c.chat.completions.parse(model="gpt-4o", messages=msgs, response_format=Person)
    out["parse"] = None
    await c.chat.completions.create(model="gpt-4o", messages=msgs,
                                    response_format={"type": "json_object"})
    out["json_object"] = None
    await c.chat.completions.create(model="gpt-4o", messages=msgs, tools=tools,
                                    tool_choice={"type": "function",
                                                 "function": {"name": "get_weather"}})
    out["tool_choice"] = None
    return out


async def responses_cases(base: str) -> dict[str, Any]:
    c = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="k", max_retries=0)
    tools: Any = [{"type": "function", "name": "get_weather", "description": "Weather of a city",
                   "parameters": WEATHER, "strict": False}]
    out: dict[str, Any] = {}
    await c.responses.create(model="gpt-4.1", instructions="Be brief.", input="Weather in Paris?",
                             max_output_tokens=300, temperature=0.5, top_p=0.9)
    out["plain"] = None
    async with c.responses.stream(model="gpt-4.1", input="Weather in Paris?") as s:
        await s.get_final_response()
    out["stream"] = None
    await c.responses.create(model="gpt-4.1", input="Weather in Paris?", tools=tools)
    out["tools"] = None
    items: Any = [{"role": "user", "content": "Weather in Paris and Rome?"},
                  {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                   "arguments": '{"city":"Paris"}'},
                  {"type": "function_call", "call_id": "call_2", "name": "get_weather",
                   "arguments": '{"city":"Rome"}'},
                  {"type": "function_call_output", "call_id": "call_1", "output": '{"temp_c": 18}'},
                  {"type": "function_call_output", "call_id": "call_2", "output": '{"temp_c": 24}'}]
    await c.responses.create(model="gpt-4.1", input=items, tools=tools)
    out["tool_result"] = None
    await c.responses.parse(model="gpt-4.1", input="Invent a person.", text_format=Person)
    out["parse"] = None
    await c.responses.create(model="gpt-4.1", input="Weather in Paris?", tools=tools,
                             tool_choice={"type": "function", "name": "get_weather"})
    out["tool_choice"] = None
    return out


async def anthropic_cases(base: str) -> dict[str, Any]:
    c = anthropic.AsyncAnthropic(base_url=base, api_key="k", max_retries=0)
    msgs: Any = [{"role": "user", "content": "Weather in Paris?"}]
    tools: Any = [{"name": "get_weather", "description": "Weather of a city",
                   "input_schema": WEATHER}]
    out: dict[str, Any] = {}
    await c.messages.create(model="claude-sonnet-5-5", max_tokens=512, system="Be brief.",
                            messages=msgs, stop_sequences=["END"],
                            extra_body={"temperature": 0.3, "top_k": 40})
    out["plain"] = None
    async with c.messages.stream(model="claude-sonnet-5-5", max_tokens=512, messages=msgs) as s:
        await s.get_final_message()
    out["stream"] = None
    await c.messages.create(model="claude-sonnet-5-5", max_tokens=512, messages=msgs, tools=tools)
    out["tools"] = None
    round_trip: Any = [*msgs, {"role": "assistant", "content": [
        {"type": "text", "text": "Checking."},
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
        {"type": "tool_use", "id": "toolu_2", "name": "get_weather",
         "input": {"city": "Nowhere"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": '{"temp_c": 18}'},
            {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
             "content": [{"type": "text", "text": "unknown city"}]}]}]
    await c.messages.create(model="claude-sonnet-5-5", max_tokens=512, messages=round_trip,
                            tools=tools)
    out["tool_result"] = None
    await c.messages.parse(model="claude-sonnet-5-5", max_tokens=512, messages=msgs,
                           output_format=Person)
    out["parse"] = None
    await c.beta.messages.create(
        model="claude-sonnet-5-5", max_tokens=512, messages=msgs,
        betas=["structured-outputs-2025-11-13"],
        extra_body={"output_format": {"type": "json_schema", "schema": WEATHER}})
    out["beta_output_format"] = None
    await c.messages.create(model="claude-sonnet-5-5", max_tokens=512, messages=msgs, tools=tools,
                            tool_choice={"type": "tool", "name": "get_weather"})
    out["tool_choice"] = None
    return out


def get_weather(city: str) -> dict[str, Any]:
    """Weather of a city."""
    return {"temp_c": 18}


async def gemini_cases(base: str) -> dict[str, Any]:
    c = genai.Client(api_key="k", http_options=types.HttpOptions(base_url=base))
    m = "gemini-2.5-flash"
    out: dict[str, Any] = {}
    no_afc = types.AutomaticFunctionCallingConfig(disable=True)
    await c.aio.models.generate_content(model=m, contents="Weather in Paris?",
                                        config=types.GenerateContentConfig(
                                            system_instruction="Be brief.", temperature=0.4,
                                            max_output_tokens=256, top_k=20, seed=3,
                                            stop_sequences=["END"]))
    out["plain"] = None
    async for _ in await c.aio.models.generate_content_stream(model=m, contents="Hi"):
        pass
    out["stream"] = None
    await c.aio.models.generate_content(model=m, contents="Weather in Paris?",
                                        config=types.GenerateContentConfig(
                                            tools=[get_weather], automatic_function_calling=no_afc))
    out["tools"] = None
    decl = types.FunctionDeclaration(name="get_weather", description="Weather of a city",
                                     parameters=types.Schema(
                                         type=types.Type.OBJECT,
                                         properties={"city": types.Schema(type=types.Type.STRING)},
                                         required=["city"]))
    def call(city: str) -> types.Part:
        return types.Part(function_call=types.FunctionCall(name="get_weather", args={"city": city}))

    def result(temp: int) -> types.Part:
        return types.Part(function_response=types.FunctionResponse(
            name="get_weather", response={"result": {"temp_c": temp}}))

    contents = [
        types.Content(role="user", parts=[types.Part(text="Weather in Paris and Rome?")]),
        types.Content(role="model", parts=[call("Paris"), call("Rome")]),
        types.Content(role="user", parts=[result(18), result(24)]),
    ]
    config = types.GenerateContentConfig(tools=[types.Tool(function_declarations=[decl])])
    await c.aio.models.generate_content(model=m, contents=contents, config=config)
    out["tool_result"] = None
    await c.aio.models.generate_content(model=m, contents="Invent a person.",
                                        config=types.GenerateContentConfig(
                                            response_mime_type="application/json",
                                            response_schema=Person))
    out["response_schema"] = None
    await c.aio.models.generate_content(model=m, contents="Invent a person.",
                                        config=types.GenerateContentConfig(
                                            response_mime_type="application/json",
                                            response_json_schema=Person.model_json_schema()))
    out["response_json_schema"] = None
    await c.aio.models.generate_content(
        model=m, contents="Weather in Paris?", config=types.GenerateContentConfig(
            tools=[types.Tool(function_declarations=[decl])],
            tool_config=types.ToolConfig(function_calling_config=types.FunctionCallingConfig(
                mode=types.FunctionCallingConfigMode.ANY, allowed_function_names=["get_weather"]))))
    out["tool_choice"] = None
    return out


async def embeddings_cases(base: str) -> dict[str, Any]:
    c = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="k", max_retries=0)
    await c.embeddings.create(model="text-embedding-3-small", input="hello world",
                              encoding_format="float")
    await c.embeddings.create(model="text-embedding-3-small", input=["hello", "world!"],
                              encoding_format="float")
    return {"plain": None, "batch": None}


async def main() -> None:
    rec = Recorder()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", rec.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]  # the port the OS gave: aiohttp's public view of it
    base = f"http://127.0.0.1:{port}"
    dialects: dict[str, Callable[[str], Awaitable[dict[str, Any]]]] = {
        "chat": chat_cases, "responses": responses_cases, "anthropic": anthropic_cases,
        "gemini": gemini_cases, "embeddings": embeddings_cases}
    try:
        for dialect, run in dialects.items():
            rec.seen.clear()
            names = list(await run(base))
            assert len(names) == len(rec.seen), (dialect, names, [p for p, _ in rec.seen])
            for name, (path, body) in zip(names, rec.seen, strict=True):
                target = DATA / dialect / f"{name}.request.json"
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(json.dumps({"path": path, "body": body}, indent=2) + "\n")
    finally:
        await runner.cleanup()


if __name__ == "__main__":
    asyncio.run(main())
