"""A request's members as the provider's JSON parser reads them, however they are spelled
(issue 54, item 2), from the table in tests/data/caching/escaped_keys.yaml: the cache write
the reservation covers, and whether automatic caching leaves the client's own breakpoints
alone, are the same for a key or value spelled with escapes as for its plain spelling; and
what goes upstream never has more than four breakpoints nor a member twice in one object."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from proxy.govern import caching
from proxy.model import Caller
from proxy.providers.anthropic import ANTHROPIC
from proxy.providers.base import open_exchange
from proxy.providers.members import member_values

DATA = Path(__file__).resolve().parent.parent / "data" / "caching"
CASES: list[dict[str, Any]] = yaml.safe_load((DATA / "escaped_keys.yaml").read_text())
LONG = json.dumps("Follow the house rules on sources and citations. " * 120)


def _request(at: str, snippet: str) -> bytes:
    """A looping conversation (the model answered twice) above the minimum cacheable length,
    with `snippet` inside the object `at` names, as JSON text."""
    def put(where: str) -> str:
        return snippet if at == where else ""
    return (
        '{"model":"claude-sonnet-4-5","max_tokens":300,'
        f'"system":[{{"type":"text","text":{LONG}{put("system")}}}],'
        f'"tools":[{{"name":"get_weather","description":"weather","input_schema":{{"type":"object"}}{put("tool")}}}],'
        '"messages":[{"role":"user","content":"weather in Paris?"},'
        '{"role":"assistant","content":[{"type":"tool_use","id":"t1","name":"get_weather","input":{}}]},'
        '{"role":"user","content":[{"type":"tool_result","tool_use_id":"t1","content":'
        f'[{{"type":"text","text":"18C"{put("result")}}}]}}]}},'
        '{"role":"assistant","content":[{"type":"tool_use","id":"t2","name":"get_weather","input":{}}]},'
        '{"role":"user","content":[{"type":"tool_result","tool_use_id":"t2","content":"19C"},'
        f'{{"type":"text","text":"go on"{put("last")}}}]}}]}}'
    ).encode()


def _no_member_twice(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    assert len(keys) == len(set(keys)), f"a member twice in one object: {keys}"
    return dict(pairs)


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_an_escaped_member_decides_as_its_plain_spelling(case: dict[str, Any]) -> None:
    raw = _request(case["at"], case["snippet"])
    ex = open_exchange(ANTHROPIC, raw, "/v1/messages")
    assert ex.call.cache_write == case["write"]

    caller = Caller(tenant="acme", run_id="r1", run_id_source="header")
    rewrites = caching.add(ex, "auto", caller, "api.anthropic.com", caching.PrefixMemory(), 0.0)
    sent = ex.request_bytes()
    if case["client"]:
        assert rewrites == [] and sent == raw, "the client's own breakpoints are its choice"
    else:
        assert [r.kind for r in rewrites] == ["cache_breakpoint", "cache_breakpoint"]
    parsed = json.loads(sent, object_pairs_hook=_no_member_twice)  # the provider's reading
    assert len(member_values(parsed, "cache_control")) <= 4
    assert parsed == orjson.loads(sent)
