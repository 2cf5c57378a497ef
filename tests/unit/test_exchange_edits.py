"""The exchange edits a request in its bytes: only what it changes changes.

Table: tests/data/exchange/edit_cases.json. Each case is a body exactly as a client sent
it (spacing, escapes, numbers orjson would rewrite: `1E0`, `1.10`, `-0`, integers past
64 bits, repeated keys), the patches the proxy applies, and the exact bytes that must go
upstream. Re-serialising (the exchange's former behaviour) fails every case.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.providers.anthropic import ANTHROPIC
from proxy.providers.base import open_exchange
from proxy.providers.chat import CHAT
from proxy.providers.gemini import GEMINI
from proxy.providers.responses import RESPONSES
from proxy.providers.splice import locate, splice

_OPEN = {"chat": (CHAT, "/v1/chat/completions"), "responses": (RESPONSES, "/v1/responses"),
         "messages": (ANTHROPIC, "/v1/messages"),
         "gemini": (GEMINI, "/v1beta/models/gemini-2.5-flash:generateContent")}
REMINDER = 'R: "é"\n\n'
CASES = json.loads((Path(__file__).parent.parent / "data" / "exchange" / "edit_cases.json").read_text())


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_only_the_edited_values_change_in_the_bytes(case: dict[str, Any]) -> None:
    adapter, path = _OPEN[case["api"]]
    raw = case["raw"].encode()
    ex = open_exchange(adapter, raw, path)
    for step in case["do"]:
        if step[0] == "remind":
            assert ex.prefix_tool_result(step[1], REMINDER) is True
        elif step[0] == "max_tokens":
            adapter.set_max_tokens(ex, step[1])
        elif step[0] == "prepare":
            assert adapter.prepare(ex)
    sent = ex.request_bytes()
    assert sent.decode() == case["expected"]
    assert orjson.loads(sent) == ex.body, "the body the proxy records is the body it sent"
    assert orjson.dumps(orjson.loads(raw)) != raw, "the case is one re-serialising would change"


def test_the_same_reminder_twice_changes_nothing_the_second_time() -> None:
    """A second spanmeter in a chain, or a client that kept the note: no double reminder."""
    raw = b'{"messages":[{"role":"tool","tool_call_id":"c","content":"x"}]}'
    ex = open_exchange(CHAT, raw, "/v1/chat/completions")
    assert ex.prefix_tool_result("c", REMINDER) is True
    again = open_exchange(CHAT, ex.request_bytes(), "/v1/chat/completions")
    assert again.prefix_tool_result("c", REMINDER) is False
    assert again.request_bytes() == ex.request_bytes()


def test_overlapping_edits_fall_back_to_one_consistent_body() -> None:
    raw = b'{"messages": [{"role": "tool", "tool_call_id": "c", "content": "x"}]}'
    ex = open_exchange(CHAT, raw, "/v1/chat/completions")
    ex.prefix_tool_result("c", REMINDER)
    ex.splicer.set_top("messages", [{"role": "user", "content": "replaced"}])  # holds the edited value
    assert orjson.loads(ex.request_bytes()) == {"messages": [{"role": "user", "content": "replaced"}]}


@pytest.mark.parametrize(("text", "paths", "found"), [
    ('{"a": [1, {"b": "x"}], "c": 2}', [("a", 1, "b"), ("c",)], {("a", 1, "b"): (16, 19), ("c",): (28, 29)}),
    ('{"a": 1}', [("z",), ("a", 0)], {}),
    ('  [ {"k" : "\\"}"} ]', [(0, "k")], {(0, "k"): (11, 16)}),
])
def test_locate_finds_each_value_by_path(text: str, paths: list[Any], found: dict[Any, Any]) -> None:
    assert locate(text, paths) == found
    for p, (s, e) in found.items():
        value: Any = json.loads(text)
        for step in p:
            value = value[step]
        assert json.loads(text[s:e]) == value


def test_splice_refuses_a_path_that_is_not_there() -> None:
    with pytest.raises(ValueError, match="not in the document"):
        splice(b'{"a": 1}', {("b",): lambda old: old})


# --- property: any conversation, any formatting, only the reminders are added ---------------

_SCALARS = (st.none() | st.booleans() | st.integers(-(2**70), 2**70)
            | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8))
_JUNK = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=6)
_ARGS = st.dictionaries(st.sampled_from(["path", "n", "q"]), _SCALARS, max_size=2)
_TEXT = st.text(max_size=12)


@st.composite
def conversations(draw: st.DrawFn, api: str) -> dict[str, Any]:
    turns = draw(st.lists(st.tuples(st.sampled_from(["read", "list"]), _ARGS,
                                    st.sampled_from(["str", "parts", "object"]), _TEXT), max_size=6))
    extra = draw(st.dictionaries(st.sampled_from(["x_meta", "cache_control", "signature"]), _JUNK, max_size=2))
    items: list[Any] = []
    for i, (name, args, shape, text) in enumerate(turns):
        cid = f"id_{i}"
        content: Any = ([{"type": "text", "text": text, **extra}] if shape == "parts" else text)
        if api == "chat":
            items += [{"role": "assistant", "tool_calls": [{"id": cid, "type": "function", "function": {
                "name": name, "arguments": json.dumps(args)}}], **extra},
                {"role": "tool", "tool_call_id": cid, "content": content}]
        elif api == "responses":
            items += [{"type": "function_call", "call_id": cid, "name": name, "arguments": json.dumps(args)},
                      {"type": "function_call_output", "call_id": cid, "output": content, **extra}]
        elif api == "messages":
            items += [{"role": "assistant", "content": [{"type": "tool_use", "id": cid, "name": name, "input": args}]},
                      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": cid, "content": content,
                                                    **extra}]}]
        else:
            response = {"result": text, **extra} if shape == "object" else {"result": content}
            items += [{"role": "model", "parts": [{"functionCall": {"name": name, "args": args}}]},
                      {"role": "user", "parts": [{"functionResponse": {"name": name, "response": response}}]}]
    key = {"chat": "messages", "responses": "input", "messages": "messages", "gemini": "contents"}[api]
    return {**draw(st.dictionaries(st.sampled_from(["x_top", "metadata"]), _JUNK, max_size=2)), key: items}


_NOTE = "N\u2028\"é\"\n\n"


def _without_notes(sent: bytes) -> bytes:
    escaped = orjson.dumps(_NOTE).decode()[1:-1]
    text = sent.decode()
    for piece in (orjson.dumps({"type": t, "text": _NOTE}).decode() + "," for t in ("text", "input_text")):
        text = text.replace(piece, "").replace(piece[:-1], "")
    text = text.replace('"spanmeter_reminder":' + orjson.dumps(_NOTE.strip()).decode() + ",", "")
    text = text.replace('"spanmeter_reminder":' + orjson.dumps(_NOTE.strip()).decode(), "")
    return text.replace(escaped, "").encode()


@pytest.mark.parametrize("api", list(_OPEN))
@settings(max_examples=40, deadline=None)
@given(data=st.data(), separators=st.sampled_from([(",", ":"), (", ", ": "), (" ,", " : ")]),
       ascii_only=st.booleans())
def test_any_conversation_keeps_its_bytes_but_the_notes(api: str, data: st.DataObject,
                                                        separators: tuple[str, str], ascii_only: bool) -> None:
    body = data.draw(conversations(api))
    raw = json.dumps(body, separators=separators, ensure_ascii=ascii_only).encode()
    adapter, path = _OPEN[api]
    ex = open_exchange(adapter, raw, path)
    history = adapter.tool_history(ex.body)
    assert [h.result is not None for h in history] == [True] * len(history), "every result is found"
    for h in history:
        assert h.result is not None and ex.prefix_at(h.result, _NOTE)
    sent = ex.request_bytes()
    assert orjson.loads(sent) == ex.body, "what is sent is the body the proxy records"
    assert _without_notes(sent) == raw, "nothing but the notes was added, every other byte kept"


def test_a_sibling_nested_as_deep_as_orjson_allows_is_skipped_not_recursed() -> None:
    deep = "[" * 1000 + "]" * 1000
    raw = ('{"x": ' + deep + ', "messages": [{"role": "tool", "tool_call_id": "c", "content": "a"}]}').encode()
    ex = open_exchange(CHAT, raw, "/v1/chat/completions")
    assert ex.prefix_tool_result("c", REMINDER)
    sent = ex.request_bytes()
    assert sent.startswith(raw[: raw.index(b"\"a\"")]) and orjson.loads(sent)["messages"] == ex.body["messages"]
