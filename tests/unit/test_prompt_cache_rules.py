"""Where spanmeter adds prompt-cache breakpoints and keys (proxy/govern/caching.py), from the
table in tests/data/caching/: the forwarded bytes parse to the request with exactly the
listed breakpoints added, and everything else as it came."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import quote

import orjson
import pytest
import yaml

from proxy.govern import caching
from proxy.model import Caller
from proxy.providers.anthropic import ANTHROPIC
from proxy.providers.base import open_exchange
from proxy.providers.bedrock import CONVERSE_API as CONVERSE
from proxy.providers.bedrock import INVOKE_API as INVOKE
from proxy.providers.chat import CHAT
from proxy.providers.responses import RESPONSES

DATA = Path(__file__).resolve().parent.parent / "data" / "caching"
CASES = yaml.safe_load((DATA / "breakpoints.yaml").read_text())
LONG = "Follow the house rules on sources and citations. " * 120


def _fill(value: Any) -> Any:
    if value == "LONG":
        return LONG
    if isinstance(value, dict):
        return {k: _fill(v) for k, v in value.items()}
    return [_fill(v) for v in value] if isinstance(value, list) else value


def _marked(body: Any, path: tuple[Any, ...] = ()) -> list[list[Any]]:
    out: list[list[Any]] = []
    if isinstance(body, dict):
        if "cache_control" in body:
            out.append(list(path))
        for k, v in body.items():
            out += _marked(v, (*path, k))
    elif isinstance(body, list):
        for i, v in enumerate(body):
            out += _marked(v, (*path, i))
    return out


def _caller(run: str = "r1", agent: str | None = None) -> Caller:
    return Caller(tenant="acme", run_id=run, run_id_source="header", agent_name=agent)


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_breakpoints(case: dict[str, Any]) -> None:
    body = _fill(case["body"])
    raw = orjson.dumps(body)
    memory = caching.PrefixMemory()
    if case["shared"]:  # another run sent the same tools and system a minute ago
        seen = open_exchange(ANTHROPIC, raw, "/v1/messages")
        caching.add(seen, "auto", _caller("other"), "api.anthropic.com", memory, 0.0)
    ex = open_exchange(ANTHROPIC, raw, "/v1/messages")
    rewrites = caching.add(ex, "auto", _caller(), "api.anthropic.com", memory, 60.0)
    sent = orjson.loads(ex.request_bytes())
    assert sent == ex.body  # the bytes say what the body says
    assert _marked(sent) == case["marked"]
    own = b"cache_control" in raw
    added = [] if own else case["marked"]
    assert len(rewrites) == len(added) and all(r.kind == "cache_breakpoint" for r in rewrites)
    assert ex.call.cache_write == ("5m" if own or added else "")  # the reservation covers the writes
    if not added:
        assert ex.request_bytes() == raw
    # Nothing but the markers (and strings made the text blocks the API reads them as) changed.
    assert _plain(sent) == _plain(body)
    off = open_exchange(ANTHROPIC, raw, "/v1/messages")
    assert caching.add(off, "off", _caller(), "api.anthropic.com", caching.PrefixMemory(), 0.0) == []
    assert off.request_bytes() == raw


def _plain(body: Any) -> Any:
    """The request as the API reads it: no cache_control, string content as one text block."""
    if isinstance(body, dict):
        out = {k: _plain(v) for k, v in body.items() if k != "cache_control"}
        if isinstance(out.get("content"), str) and "role" in out:
            out["content"] = [{"type": "text", "text": out["content"]}]
        if isinstance(out.get("system"), str):
            out["system"] = [{"type": "text", "text": out["system"]}]
        return out
    return [_plain(v) for v in body] if isinstance(body, list) else body


def test_a_stable_prefix_is_forgotten_after_the_caches_five_minutes() -> None:
    memory = caching.PrefixMemory()
    assert not memory.shared(b"p", "a", 0.0)
    assert memory.shared(b"p", "b", 299.0)  # another run within the TTL
    assert memory.shared(b"p", "b", 300.0)  # and stays shared while it keeps coming
    assert not memory.shared(b"p", "c", 700.0)  # after a gap longer than the TTL: cold again
    small = caching.PrefixMemory(capacity=2)
    for d in (b"1", b"2", b"3"):
        small.shared(d, "a", 0.0)
    assert not small.shared(b"1", "b", 1.0)  # the oldest went first


@pytest.mark.parametrize("adapter,path,body", [
    (CHAT, "/v1/chat/completions", {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}),
    (RESPONSES, "/v1/responses", {"model": "gpt-4o", "input": "hi"}),
], ids=["chat", "responses"])
def test_openai_gets_a_cache_key_stable_per_run_or_agent(adapter: Any, path: str, body: dict[str, Any]) -> None:
    def key(caller: Caller, host: str = "api.openai.com", given: dict[str, Any] | None = None) -> Any:
        raw = orjson.dumps({**body, **(given or {})})
        ex = open_exchange(adapter, raw, path)
        rewrites = caching.add(ex, "auto", caller, host, caching.PrefixMemory(), 0.0)
        sent = orjson.loads(ex.request_bytes())
        assert ex.request_bytes().startswith(raw[:-1])  # appended after every byte the client sent
        return sent.get("prompt_cache_key"), [r.header_value() for r in rewrites]

    first, rewrites = key(_caller("r1"))
    assert rewrites == ["prompt_cache_key=run"] and first.startswith("sm-") and "r1" not in first
    assert key(_caller("r1"))[0] == first  # stable for the run
    assert key(_caller("r2"))[0] != first
    agent = key(_caller("r1", agent="planner"))
    assert agent[1] == ["prompt_cache_key=agent"] and agent[0] == key(_caller("r2", agent="planner"))[0]
    assert key(_caller("r1"), given={"prompt_cache_key": "mine"}) == ("mine", [])  # the client's own is kept
    assert key(_caller("r1"), host="127.0.0.1") == (None, [])  # a compatible server gets no unknown field


CONVERSE_CASES = yaml.safe_load((DATA / "converse_breakpoints.yaml").read_text())


def _cache_points(body: Any, path: tuple[Any, ...] = ()) -> list[list[Any]]:
    out: list[list[Any]] = []
    if isinstance(body, dict):
        if "cachePoint" in body:
            out.append(list(path))
        for k, v in body.items():
            out += _cache_points(v, (*path, k))
    elif isinstance(body, list):
        for i, v in enumerate(body):
            out += _cache_points(v, (*path, i))
    return out


def _without_cache_points(body: Any) -> Any:
    if isinstance(body, dict):
        return {k: _without_cache_points(v) for k, v in body.items()}
    if isinstance(body, list):
        return [_without_cache_points(v) for v in body if not (isinstance(v, dict) and "cachePoint" in v)]
    return body


@pytest.mark.parametrize("case", CONVERSE_CASES, ids=[c["name"] for c in CONVERSE_CASES])
def test_converse_cache_points(case: dict[str, Any]) -> None:
    body = _fill(case["body"])
    raw = orjson.dumps(body)
    path = f"/model/{quote(case['model'], safe='')}/converse"
    memory = caching.PrefixMemory()
    host = "bedrock-runtime.us-east-1.amazonaws.com"
    if case["shared"]:  # another run sent the same tools and system a minute ago
        caching.add(open_exchange(CONVERSE, raw, path), "auto", _caller("other"), host, memory, 0.0)
    ex = open_exchange(CONVERSE, raw, path)
    rewrites = caching.add(ex, "auto", _caller(), host, memory, 60.0)
    sent = orjson.loads(ex.request_bytes())
    assert sent == ex.body
    assert _cache_points(sent) == case["marked"]
    own = b"cachePoint" in raw
    added = [] if own else case["marked"]
    assert len(rewrites) == len(added) and all(r.kind == "cache_breakpoint" for r in rewrites)
    assert ex.call.cache_write == ("5m" if own or added else "")  # the reservation covers the writes
    if not added:
        assert ex.request_bytes() == raw
    assert _without_cache_points(sent) == _without_cache_points(body)  # nothing else changed
    assert all(sent_point == {"cachePoint": {"type": "default"}}
               for sent_point in [_at(sent, p) for p in case["marked"]])
    off = open_exchange(CONVERSE, raw, path)
    assert caching.add(off, "off", _caller(), host, caching.PrefixMemory(), 0.0) == []
    assert off.request_bytes() == raw


def _at(body: Any, path: list[Any]) -> Any:
    for step in path:
        body = body[step]
    return body


def test_nova_on_invoke_model_gets_the_same_cache_points_in_its_messages_v1_body() -> None:
    body = {"schemaVersion": "messages-v1", "system": [{"text": LONG}],
            "messages": [{"role": "user", "content": [{"text": "hi"}]}], "inferenceConfig": {"max_new_tokens": 10}}
    raw, path = orjson.dumps(body), "/model/us.amazon.nova-pro-v1%3A0/invoke"
    memory, host = caching.PrefixMemory(), "bedrock-runtime.us-east-1.amazonaws.com"
    caching.add(INVOKE.open(raw, path).request, "auto", _caller("other"), host, memory, 0.0)
    ex = INVOKE.open(raw, path).request
    assert [r.header_value() for r in caching.add(ex, "auto", _caller(), host, memory, 60.0)] == \
        ["cache_breakpoint=system"]
    assert orjson.loads(ex.request_bytes())["system"] == [{"text": LONG}, {"cachePoint": {"type": "default"}}]
    assert ex.call.cache_write == "5m"
