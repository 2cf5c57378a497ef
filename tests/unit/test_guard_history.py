"""The reminder is a pure function of the request's history: each dialect lists the
conversation's tool calls with where their results are, and the streak is counted there.

Table: tests/data/guard/history_cases.json.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from proxy.govern.guard import streaks
from proxy.providers.anthropic import ANTHROPIC
from proxy.providers.chat import CHAT
from proxy.providers.embeddings import EMBEDDINGS
from proxy.providers.gemini import GEMINI
from proxy.providers.responses import RESPONSES

ADAPTERS: dict[str, Any] = {"chat": CHAT, "responses": RESPONSES, "messages": ANTHROPIC, "gemini": GEMINI}
CASES = json.loads((Path(__file__).parent.parent / "data" / "guard" / "history_cases.json").read_text())


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_history_lists_calls_in_order_with_their_results(case: dict[str, Any]) -> None:
    history = ADAPTERS[case["api"]].tool_history(case["body"])
    got = [[h.call_id, h.name, list(h.result) if h.result is not None else None, h.latest] for h in history]
    assert got == case["history"]
    assert [[h.call_id, n] for h, n in streaks(history)] == case["streaks"]
    for h in history:  # each path leads to the result's value in the body
        if h.result is not None:
            value: Any = case["body"]
            for step in h.result:
                value = value[step]
            assert value is not None


def test_embeddings_have_no_tool_history() -> None:
    assert EMBEDDINGS.tool_history({"input": "x"}) == []
