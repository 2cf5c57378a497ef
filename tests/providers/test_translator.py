"""The one contract the shared code has with an API (proxy/providers/translator.py): small
enough to read on one screen, and each member the API module's own answer."""

from __future__ import annotations

import orjson
import pytest

from proxy.errors import CeilingReached, MalformedBody, UpstreamTimeout
from proxy.providers import translator
from proxy.providers.apis import FIXED_PATHS, answering, for_path
from proxy.providers.base import open_exchange
from proxy.providers.hooks import Hooks
from tests.providers.cases import ADAPTERS, DATA


def _members(protocol: type) -> set[str]:
    return {name for name in vars(protocol) if not name.startswith("_")}


def test_the_translator_is_a_handful_of_members() -> None:
    assert _members(translator.Translator) == {"call", "request", "answer", "error", "retry"}
    assert len(_members(translator.Api)) <= 8


@pytest.mark.parametrize("dialect", ["chat", "anthropic", "responses", "gemini"])
def test_a_call_opened_by_its_api_answers_in_that_apis_own_words(dialect: str) -> None:
    req = orjson.loads((DATA / dialect / "stream.request.json").read_bytes())
    raw, path = orjson.dumps(req["body"]), req["path"]
    api = for_path(path.partition("?")[0])
    assert api is ADAPTERS[dialect]
    tr = translator.open_call(api, raw, path)
    assert tr.call == open_exchange(ADAPTERS[dialect], raw, path).call
    for exc in (CeilingReached("over the run's cost", limit="run_cost"), UpstreamTimeout("slow"), MalformedBody("x")):
        assert tr.error(exc, "req_1", streaming=False) == api.render_error(exc, "req_1")
        assert tr.error(exc, "req_1", streaming=True) == ADAPTERS[dialect].render_stream_error(exc)
    again = tr.retry('{"a": 1', "close the object")
    assert again.request.body == ADAPTERS[dialect].retry_body(tr.request.body, '{"a": 1', "close the object")
    assert again.call.body_bytes == len(again.request.request_bytes())  # its own size bounds its input
    answer = tr.answer(Hooks())
    assert answer.call is tr.call and answer.outcome().status == 0 and not answer.complete


def test_a_request_off_the_metered_routes_is_answered_in_the_api_its_sdk_speaks() -> None:
    assert answering("/v1/models", {"anthropic-version": "2023-06-01"}) is ADAPTERS["anthropic"]
    assert answering("/v1beta/models", {}) is ADAPTERS["gemini"]
    assert answering("/v1/nothing", {}) is ADAPTERS["chat"]
    assert {*FIXED_PATHS.values(), ADAPTERS["gemini"]} == set(ADAPTERS.values())
