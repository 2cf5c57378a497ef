"""Bounded telemetry through the running proxy: hostile model and tool names, refused and
accepted, never grow /metrics; spans keep the names, cut.

Two tenants: `capped` has a tiny daily budget, so every call it makes is refused with 402
(unpriced models as `unknown_price`, priced ones as `tenant_day`); `free` has no ceiling,
so its calls with unpriced models reach the simulator, which answers with the same model
name and calls the tool it was offered. Unknown keys (401), unknown routes (404) and
malformed bodies (400) carry long model names too.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from proxy.config import hash_key
from proxy.serve.appkeys import TEL
from tests.fixtures.otlp import otlp_receiver  # noqa: F401
from tracing import attributes as A
from tracing.labels import KNOWN_ERROR_TYPES, LABEL_VALUE_LIMIT

CAPPED, FREE = "sm-capped-tenant-key", "sm-free-tenant-key"
CONFIG_MODEL = "acme-finetune-7"  # priced in the config only
NAME = A.SPAN_NAME_LIMIT


def long_name(kind: str, i: int, size: int = 8000) -> str:
    """A distinct, valid-looking, very long name: `kind-i-aaaa...`."""
    head = f"{kind}-{i}-"
    return head + "a" * (size - len(head))


def cut(name: str) -> str:
    return name[:NAME] + "…"


Series = frozenset[tuple[str, tuple[tuple[str, str], ...]]]


def series(text: str) -> Series:
    return frozenset(
        (s.name, tuple(sorted(s.labels.items())))
        for family in text_string_to_metric_families(text)
        for s in family.samples
    )


def label_values(found: Series, label: str) -> set[str]:
    """The values a label takes; the exporter writes "" where a series has no such label."""
    return {v for _, labels in found for k, v in labels if k == label and v}


class Driver:
    def __init__(self, url: str, session: aiohttp.ClientSession) -> None:
        self.url, self.session = url, session
        self.gate = asyncio.Semaphore(8)
        self.statuses: list[int] = []

    async def post(self, path: str, key: str, body: Any, run: str | None = None) -> dict[str, Any]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        if run:
            headers["X-Run-Id"] = run
        async with self.gate, self.session.post(self.url + path, data=data, headers=headers) as r:
            self.statuses.append(r.status)
            return dict(await r.json(content_type=None))

    async def chat(self, key: str, model: str) -> dict[str, Any]:
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
        return await self.post("/v1/chat/completions", key, body)

    async def tool_round_trip(self, tool: str, run: str) -> None:
        tools = [{"type": "function", "function": {"name": tool, "parameters": {"type": "object"}}}]
        msgs: list[dict[str, Any]] = [{"role": "user", "content": "SCENARIO:tool weather?"}]
        body = {"model": "gpt-4o", "messages": msgs, "tools": tools}
        first = await self.post("/v1/chat/completions", FREE, body, run)
        message = first["choices"][0]["message"]
        call_id = message["tool_calls"][0]["id"]
        msgs += [message, {"role": "tool", "tool_call_id": call_id, "content": '{"ok": true, "temp": 14}'}]
        await self.post("/v1/chat/completions", FREE, {**body, "messages": msgs}, run)

    async def batch(self, tag: str, n: int) -> None:
        """Refused and accepted calls, each with names nobody used before."""
        jobs: list[Any] = []
        for i in range(n):
            name = long_name(f"{tag}-model", i)
            jobs += [
                self.chat("sm-not-a-key", name),  # 401
                self.post(f"/v1/{name[:2000]}", FREE, {"model": name}),  # 404
                self.post("/v1/chat/completions", FREE, b'{"model": "' + name.encode() + b'", "messages": ['),  # 400
                self.chat(CAPPED, name),  # 402 unknown_price
                self.chat(CAPPED, f"gpt-4o-{i:03d}-{ord(tag[0]):03d}-latest"),  # 402 tenant_day, priced variant
                self.chat(FREE, name),  # 200, the simulator answers as `name`
            ]
            if i % 5 == 0:
                jobs.append(self.tool_round_trip(long_name(f"{tag}-tool", i, 300), f"{tag}-run-{i}"))
        await asyncio.gather(*jobs)


# The receiver comes first so that it outlives the proxy, which flushes to it on shutdown.
async def test_hostile_names_never_grow_metrics_and_spans_keep_them_cut(otlp_receiver, make_proxy, monkeypatch_env):  # noqa: F811
    monkeypatch_env("OPENAI_API_KEY", "sk-upstream")
    proxy = await make_proxy(
        otlp_endpoint=otlp_receiver.endpoint,
        prices={CONFIG_MODEL: {"input": 1.0, "output": 2.0}},
        tenants={
            "capped": {"keys": [hash_key(CAPPED)], "policy": {"budgets": {"daily_usd": 0.000001}}},
            "free": {"keys": [hash_key(FREE)]},
        },
    )
    async with aiohttp.ClientSession() as session:
        d = Driver(proxy.url, session)
        # Known models first: they keep their own label values.
        for model in ("gpt-4o", "gpt-4o-2024-08-06", CONFIG_MODEL):
            await d.chat(FREE, model)
        await d.batch("a", 60)
        await proxy.settled()
        first = (await (await session.get(proxy.url + "/metrics")).read()).decode()
        await d.batch("b", 60)
        await proxy.settled()
        second = (await (await session.get(proxy.url + "/metrics")).read()).decode()

    assert sorted(set(d.statuses)) == [200, 400, 401, 402, 404]
    assert len(d.statuses) == 3 + 2 * (60 * 6 + 12 * 2)

    # Bounded: the second batch, all new names, added no series at all.
    before, after = series(first), series(second)
    assert after == before
    assert len(after) < 400 and len(second) < 160_000, (len(after), len(second))  # measured: 262, 102 kB
    longest = max(len(v) for _, labels in after for _, v in labels)
    assert longest <= LABEL_VALUE_LIMIT
    assert label_values(after, "gen_ai_request_model") == {"gpt-4o", "gpt-4o-2024-08-06", CONFIG_MODEL, "_OTHER"}
    assert label_values(after, "gen_ai_response_model") == {"gpt-4o", "gpt-4o-2024-08-06", CONFIG_MODEL, "_OTHER"}
    assert label_values(after, "gen_ai_tool_name") == {"_OTHER"}
    assert label_values(after, "error_type") <= KNOWN_ERROR_TYPES
    refusals = {
        (labels["spanmeter_reason"], labels.get("gen_ai_request_model"))
        for family in text_string_to_metric_families(second)
        for s in family.samples
        if s.name == "spanmeter_limit_rejections_total"
        for labels in [s.labels]
    }
    # A refused priced variant counts under the model it belongs to, never as itself.
    assert refusals == {("unknown_price", "_OTHER"), ("tenant_day", "gpt-4o")}

    # Spans keep the real names, cut at SPAN_NAME_LIMIT runes.
    await asyncio.to_thread(proxy.app[TEL].force_flush)
    chats, tools = 3 + 2 * (60 * 3 + 12 * 2), 2 * 12
    got = await asyncio.to_thread(otlp_receiver.wait_for_spans, chats + tools)
    by_name = {s["name"]: s for s in got}
    served = long_name("a-model", 7)
    span = by_name[f"chat {cut(served)}"]
    assert span["attributes"]["gen_ai.request.model"] == cut(served)
    assert span["attributes"]["gen_ai.response.model"] == cut(served)
    same = [s for s in got if s["attributes"].get("gen_ai.request.model") == cut(long_name("b-model", 3))]
    assert {s["attributes"].get("error.type") for s in same} == {None, "spanmeter.budget_exceeded"}  # 200, 402
    for s in same:
        assert len(s["attributes"].get(A.SPANMETER_REFUSAL_REASON, "")) <= A.SPAN_TEXT_LIMIT + 1
    tool = long_name("a-tool", 10, 300)
    tool_span = by_name[f"execute_tool {cut(tool)}"]
    assert tool_span["attributes"]["gen_ai.tool.name"] == cut(tool)
    for s in got:
        assert all(len(v) <= A.SPAN_TEXT_LIMIT + 1 for v in s["attributes"].values() if isinstance(v, str)), s["name"]
