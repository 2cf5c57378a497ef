"""`gen_ai.tool.definitions` without content capture is made once per tool list
(tracing/spans.py `_TOOL_NAMES`) and reads as the list built for each call did."""

from __future__ import annotations

import json

from proxy.model import Call, ToolSpec
from tracing import attributes as A
from tracing import digests, spans


def _built(call: Call, cap: int) -> str:
    """What every call built before (c13488d): names only, capped."""
    return digests.capped_json([{"type": "function", "name": spans._name(t.name)}
                                for t in call.tools[: A.SPAN_LIST_LIMIT]], cap)


def test_the_kept_list_is_the_list_each_call_built() -> None:
    spans._TOOL_NAMES.clear()
    calls = [
        Call(api="chat", operation="chat", model="m", tools=(ToolSpec("get_weather", "Weather", {"type": "object"}),)),
        Call(api="chat", operation="chat", model="m", tools=tuple(ToolSpec(f"tool_{i}", "d" * 50) for i in range(200))),
        Call(api="chat", operation="chat", model="m", tools=(ToolSpec("x" * 5000),)),  # too long to keep, still right
        Call(api="chat", operation="chat", model="m", tools=(ToolSpec('quo"te\u2028'), ToolSpec("ünï"))),
    ]
    for cap in (16_384, 100):
        for _ in range(2):  # made, then found
            for call in calls:
                assert spans._tool_definitions(call, cap, full=False) == _built(call, cap)
    assert all(sum(map(len, names)) <= spans._TOOL_NAMES_KEPT for names, _ in spans._TOOL_NAMES)


def test_content_capture_still_lists_descriptions_and_schemas() -> None:
    tool = ToolSpec("get_weather", "Weather", {"type": "object"})
    call = Call(api="chat", operation="chat", model="m", tools=(tool,))
    assert json.loads(spans._tool_definitions(call, 16_384, full=True)) == [
        {"type": "function", "name": "get_weather", "description": "Weather", "parameters": {"type": "object"}}]
