"""Hostile input: every malformed request gets a clean 4xx in its dialect's shape, or
passes through to the upstream untouched. Never a 500 of ours, never a hang.

Property tests of the extractor live in tests/repair/test_properties.py and of the
adapters' parse_* on arbitrary JSON shapes in tests/providers/test_adapter_edges.py;
here the properties run through the proxy's own request reader (serve/body.py open_call).
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from proxy.config import Settings
from proxy.errors import RequestError
from proxy.model import Call
from proxy.serve.appkeys import SETTINGS
from proxy.serve.body import open_call
from proxy.serve.routes import api_for
from tests.reliability.dialects import DIALECTS, Dialect, post

BAD_BODIES = {
    "malformed": b'{"model": "x", "messages": [',
    "invalid_utf8": b'{"model": "\xff\xfe", "messages": []}',
    "deep_object": b'{"a":' * 5000 + b"1" + b"}" * 5000,
    "deep_array": b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "not_an_object": b'"just a string"',
    "empty": b"",
    "nul_bytes": b"\x00" * 64,
}


@pytest.mark.parametrize("d", DIALECTS, ids=lambda d: d.name)
@pytest.mark.parametrize("case", list(BAD_BODIES))
async def test_unreadable_bodies_are_a_400_in_the_dialects_shape(proxy, sim, d: Dialect, case: str):
    r = await post(proxy.url, d.path(False), data=BAD_BODIES[case])
    assert r.status == 400, r.body[:300]
    assert r.headers["x-should-retry"] == "false"
    assert d.error_message(orjson.loads(r.body))
    assert sim.received == []


@pytest.mark.parametrize("d", DIALECTS, ids=lambda d: d.name)
async def test_a_body_over_the_limit_is_a_413_in_every_dialect(make_proxy, sim, d: Dialect):
    proxy = await make_proxy(max_body_bytes=4096)
    body = d.body("x" * 10_000, False)
    r = await post(proxy.url, d.path(False), body)
    assert r.status == 413 and "SPANMETER_MAX_BODY_BYTES" in d.error_message(orjson.loads(r.body))
    chunked = await _chunked(proxy.url + d.path(False), orjson.dumps(body))  # no Content-Length to trust
    assert chunked == 413
    assert sim.received == []


async def _chunked(url: str, data: bytes) -> int:
    async def gen():
        for i in range(0, len(data), 1000):
            yield data[i:i + 1000]

    async with aiohttp.ClientSession() as s, s.post(url, data=gen(), headers={"Authorization": "Bearer k"}) as r:
        await r.read()
        return r.status


async def test_huge_headers_get_a_clean_4xx_not_a_hang(proxy, sim):
    for name, value in (("X-Big", "v" * 100_000), ("Authorization", "Bearer " + "k" * 100_000)):
        async with aiohttp.ClientSession() as s, s.post(proxy.url + "/v1/chat/completions", data=b"{}",
                                                        headers={name: value}) as r:
            assert r.status in (400, 431)
    many = {f"X-H-{i}": "v" for i in range(500)}
    async with aiohttp.ClientSession() as s, s.post(proxy.url + "/v1/chat/completions", data=b"{}",
                                                    headers=many) as r:
        assert r.status < 500
    assert sim.received == []


async def test_unknown_fields_pass_through_byte_for_byte(proxy, sim):
    for d in DIALECTS:
        body = d.body("hi", False) | {"x_vendor_flag": {"nested": [1, 2, {"deep": True}]}, "zzz": None}
        raw = orjson.dumps(body)
        r = await post(proxy.url, d.path(False), data=raw)
        assert r.status == 200
        assert sim.last.body == raw


WRONG_TYPES: dict[str, list[dict[str, Any]]] = {
    "chat": [{"messages": 5}, {"messages": [5, "x", None]}, {"max_tokens": "x"}, {"max_tokens": -1},
             {"stream": "yes"}, {"stream_options": 3}, {"stream": True, "stream_options": "x"},
             {"model": 7}, {"tools": "x"}, {"tools": [{"type": "function", "function": 3}]},
             {"response_format": "json"}, {"response_format": {"type": "json_schema", "json_schema": 1}},
             {"messages": [{"role": "tool", "tool_call_id": 5, "content": {"a": 1}}]},
             {"max_completion_tokens": 1e300}],
    "responses": [{"input": 5}, {"input": [5, None]}, {"max_output_tokens": "x"}, {"stream": "yes"},
                  {"model": None}, {"tools": {"a": 1}}, {"text": {"format": 3}},
                  {"input": [{"type": "function_call_output", "call_id": 1, "output": [1]}]}],
    "anthropic": [{"messages": 5}, {"messages": [{"role": "user", "content": 5}]}, {"max_tokens": "x"},
                  {"stream": "yes"}, {"system": 5}, {"tools": [1]}, {"model": []},
                  {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": 1,
                                                              "content": 3}]}]}],
    "gemini": [{"contents": 5}, {"contents": [{"parts": 5}]}, {"generationConfig": "x"},
               {"generationConfig": {"maxOutputTokens": "x"}}, {"tools": "x"},
               {"generationConfig": {"responseSchema": 5, "responseMimeType": "application/json"}},
               {"contents": [{"role": "user", "parts": [{"functionResponse": 5}]}]}],
}


@pytest.mark.parametrize("d", DIALECTS, ids=lambda d: d.name)
async def test_wrong_types_in_known_fields_are_a_clean_4xx_or_pass_through(proxy, sim, d: Dialect):
    for stream in (False, True):
        for patch in WRONG_TYPES[d.name]:
            body = d.body("hi", stream) | patch
            r = await asyncio.wait_for(post(proxy.url, d.path(stream), body), 10)
            text = r.body.decode(errors="replace")
            assert "failed unexpectedly" not in text, (patch, text)
            if r.status >= 400 and "x-spanmeter-run-id" not in r.headers:
                # Ours: a client error in the dialect's shape.
                assert 400 <= r.status < 500, (patch, r.status, text)
                assert d.error_message(orjson.loads(r.body))


class _Body:
    """The aiohttp StreamReader surface read_call uses, delivering `data` in pieces."""

    def __init__(self, data: bytes, piece: int) -> None:
        self._data, self._piece = data, max(1, piece)

    async def read(self, n: int) -> bytes:
        return self.read_nowait(n)

    def read_nowait(self, n: int) -> bytes:
        out, self._data = self._data[:min(n, self._piece)], self._data[min(n, self._piece):]
        return out

    def at_eof(self) -> bool:
        return not self._data


class _Request:
    def __init__(self, data: bytes, path: str, piece: int) -> None:
        self.content = _Body(data, piece)
        self.content_length = len(data)
        self.path = path
        self.match_info = {"tail": path.split("?")[0].removeprefix("/")}
        self.app = {SETTINGS: Settings(max_body_bytes=64 * 1024)}


def _read(data: bytes, d: Dialect, piece: int) -> Any:
    adapter = api_for(d.path(False).split("?")[0])
    assert adapter is not None
    request = _Request(data, d.path(False), piece)
    # The call's request side: what the reader read, and what goes upstream.
    return _LOOP.run_until_complete(open_call(request, adapter, 64 * 1024)).request  # type: ignore[arg-type]


_LOOP = asyncio.new_event_loop()  # one loop for all examples: a loop per example is most of the cost


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=16,
)
FIELDS = ["model", "messages", "input", "contents", "max_tokens", "max_output_tokens", "max_completion_tokens",
          "stream", "stream_options", "tools", "tool_choice", "response_format", "text", "system",
          "generationConfig", "systemInstruction", "instructions", "metadata"]
requests = st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=6)


@pytest.mark.parametrize("d", DIALECTS, ids=lambda d: d.name)
@settings(max_examples=100, deadline=None)
@given(data=st.binary(max_size=300), piece=st.integers(1, 64))
@example(data=b"{}", piece=1)  # random bytes seldom parse; this one reads as a call in every dialect
def test_any_bytes_read_as_a_call_or_a_request_error(d: Dialect, data: bytes, piece: int) -> None:
    try:
        ex = _read(data, d, piece)
    except RequestError:
        return
    assert ex.raw == data, "the reader hands on what it read, whole"
    assert isinstance(ex.body, dict) and isinstance(ex.call, Call)


@pytest.mark.parametrize("d", DIALECTS, ids=lambda d: d.name)
@settings(max_examples=100, deadline=None)
@given(body=requests, piece=st.integers(1, 4096))
def test_any_json_object_reads_as_a_call_or_a_request_error(d: Dialect, body: dict[str, Any], piece: int) -> None:
    raw = orjson.dumps(body, option=orjson.OPT_NON_STR_KEYS) if body else b"{}"
    try:
        ex = _read(raw, d, piece)
    except RequestError:
        return
    assert ex.raw == raw and ex.body == orjson.loads(raw), "the reader hands on what it read, whole"
    assert ex.request_bytes() == raw, "a request nobody patches goes upstream byte for byte"
