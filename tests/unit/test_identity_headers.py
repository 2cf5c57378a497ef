"""X-Agent-Name and X-Conversation-Id: what `identify` keeps and what it refuses (table in
tests/data/tracing/identity_headers.jsonl), and a refusal as the SDK sees it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
import pytest
from multidict import CIMultiDict

from proxy.config import Settings
from proxy.errors import RequestError
from proxy.serve.tenants import KeyIndex, identify

ROWS = [json.loads(line) for line in
        (Path(__file__).parent.parent / "data" / "tracing" / "identity_headers.jsonl").read_text().splitlines()]
SETTINGS = Settings()


@pytest.mark.parametrize("case", [pytest.param(r, id=r["name"]) for r in ROWS])
def test_identity_headers(case: dict[str, Any]) -> None:
    headers = CIMultiDict(case["headers"])
    if "error" in case:
        with pytest.raises(RequestError) as ei:
            identify(headers, {}, SETTINGS, KeyIndex(SETTINGS))
        assert ei.value.message.startswith(case["error"]) and ei.value.status == 400
        return
    caller = identify(headers, {}, SETTINGS, KeyIndex(SETTINGS))
    assert (caller.agent_name, caller.conversation_id) == (case["agent"], case["conversation"])


async def test_a_bad_agent_name_is_a_400_that_says_what_to_send(proxy, sim):
    async with openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="k", max_retries=0,
                                  default_headers={"X-Agent-Name": "x" * 200}) as client:
        with pytest.raises(openai.BadRequestError) as ei:
            await client.chat.completions.create(model="sim-small", messages=[{"role": "user", "content": "hi"}])
    assert "X-Agent-Name" in ei.value.message and "128" in ei.value.message
    assert sim.received == []  # refused before anything was forwarded
