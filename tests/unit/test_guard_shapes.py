"""The loop reminder lands in each dialect's own tool-result shape, and only there."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import orjson
import pytest

from proxy.govern.guard import reminder
from proxy.providers.anthropic import ANTHROPIC
from proxy.providers.base import open_exchange
from proxy.providers.chat import CHAT
from proxy.providers.gemini import GEMINI
from proxy.providers.responses import RESPONSES

_OPEN = {"chat": (CHAT, "/v1/chat/completions"), "responses": (RESPONSES, "/v1/responses"),
         "messages": (ANTHROPIC, "/v1/messages"),
         "gemini": (GEMINI, "/v1beta/models/gemini-2.5-flash:generateContent")}


def prefix_tool_result(api: str, body: dict[str, Any], call_id: str, text: str) -> bool:
    """Through the exchange, as the proxy does; the forwarded bytes carry the same body."""
    adapter, path = _OPEN[api]
    ex = open_exchange(adapter, orjson.dumps(body), path)
    done = ex.prefix_tool_result(call_id, text)
    body.clear()
    body.update(orjson.loads(ex.request_bytes()))
    return done

CASES = json.loads((Path(__file__).parent.parent / "data" / "guard" / "prefix_cases.json").read_text())


def _at(body: Any, path: list[Any]) -> Any:
    for step in path:
        body = body[step]
    return body


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_reminder_is_prefixed_in_the_dialects_shape(case):
    body = copy.deepcopy(case["body"])
    assert prefix_tool_result(case["api"], body, case["call_id"], "R:") is True
    assert _at(body, case["path"]) == case["expected"]
    if "unchanged" in case:
        path, value = case["unchanged"]
        assert _at(body, path) == value


def test_unknown_call_id_changes_nothing():
    body = {"messages": [{"role": "tool", "tool_call_id": "call_1", "content": "x"}]}
    before = copy.deepcopy(body)
    assert prefix_tool_result("chat", body, "call_other", "R:") is False
    assert body == before


def test_reminder_text_names_the_tool_the_count_and_what_to_do():
    text = reminder("read_file", 4)
    assert "`read_file` 4 times in a row with identical arguments" in text
    assert "will not change" in text and "Change the arguments" in text
