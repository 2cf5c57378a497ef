"""Each API's exchange over a table: the facts that decide a call's cost, the values
refused at the edge, and which paths route where (tests/data/exchange/)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson
import pytest

from proxy.errors import ProxyError, UnknownRoute
from proxy.providers.anthropic import ANTHROPIC
from proxy.providers.base import open_exchange
from proxy.providers.chat import CHAT
from proxy.providers.embeddings import EMBEDDINGS
from proxy.providers.gemini import GEMINI
from proxy.providers.responses import RESPONSES
from proxy.serve.routes import match

DATA = Path(__file__).resolve().parent.parent / "data" / "exchange"
ADAPTERS = {"chat": CHAT, "responses": RESPONSES, "messages": ANTHROPIC, "gemini": GEMINI, "embeddings": EMBEDDINGS}


def _cases(name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (DATA / name).read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("case", _cases("requests.jsonl"), ids=lambda c: c["name"])
def test_the_exchange_reads_what_changes_cost_and_refuses_what_cannot_be_bounded(case: dict[str, Any]) -> None:
    raw = orjson.dumps(case["body"])
    adapter = ADAPTERS[case["api"]]
    if "error" in case:
        with pytest.raises(ProxyError) as ei:
            open_exchange(adapter, raw, case["path"])
        assert ei.value.status == case["error"]["status"]
        assert ei.value.param == case["error"]["param"]
        assert f"`{case['error']['param']}`" in ei.value.message, "the message names the field"
        return
    ex = open_exchange(adapter, raw, case["path"])
    call = ex.call
    for field, want in case["facts"].items():
        got = getattr(call, field)
        assert (list(got) if isinstance(got, tuple) else got) == want, field
    assert call.body_bytes == len(raw)
    assert ex.request_bytes() == raw, "nothing patched: the bytes as they came"


@pytest.mark.parametrize("case", _cases("paths.jsonl"), ids=lambda c: c["name"])
def test_routes_match_the_path_exactly_as_it_is_sent(case: dict[str, Any]) -> None:
    query = case.get("query", "")
    if case.get("refused"):
        with pytest.raises(UnknownRoute):
            match(case["path"], query)
        return
    route = match(case["path"], query)
    assert (route.api.api if route.api else None) == case["api"]
    assert route.upstream_name == case.get("upstream")
    if "dialect" in case:
        assert route.api is not None and route.api.family == case["dialect"]
    if "stream_usage" in case:  # whether the api-version takes stream_options (Azure)
        assert getattr(route.api, "stream_usage", None) is case["stream_usage"]
