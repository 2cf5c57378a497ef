"""Each API's response side over tables: repair of whole answers and streams in the
dialect's own framing, the request asked once more, and the content captured."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from proxy.config import Policy, RepairPolicy
from proxy.errors import ProxyError
from proxy.govern.outputs import Retry, Verdict, response_hooks
from proxy.model import Outcome
from proxy.providers.hooks import Hooks
from proxy.providers.sse import Framer
from proxy.providers.translator import open_call
from proxy.serve import content
from tests.providers.cases import Case, input_message_cases, normalised, repair_cases, retry_cases


def _hooks(case: Case) -> tuple[Hooks, Any, Verdict]:
    req = case.input["request"]
    tr = open_call(case.adapter, orjson.dumps(req["body"]), req["path"])
    hooks = Hooks()
    verdict = response_hooks(tr.answer(hooks), Policy(repair=RepairPolicy(**case.input["policy"])))
    return hooks, tr.request, verdict


def _stream(case: Case, hooks: Hooks, sse: str) -> str:
    """The stream as the relay forwards it: the first hook that claims an event decides its bytes."""
    framer = Framer()
    events = framer.feed(sse.encode())
    if (tail := framer.flush()) is not None:
        events.append(tail)
    out = []
    for event in events:
        parsed = case.adapter.parse_event(event)
        got = next((b for hook in hooks.on_event if (b := hook(event, parsed)) is not None), None)
        out.append(event.raw if got is None else got)
    out += [h.release() for h in hooks.holds]  # what the hooks held to the end
    return b"".join(out).decode()


def _body(hooks: Hooks, body: Any) -> Any:
    parsed = orjson.loads(orjson.dumps(body))
    replaced = None
    for hook in hooks.on_body:
        replaced = hook(parsed) or replaced
    return orjson.loads(replaced) if replaced is not None else None


@pytest.mark.parametrize("case", repair_cases(), ids=str)
def test_an_answer_is_repaired_in_its_dialects_own_framing(case: Case) -> None:
    hooks, _, verdict = _hooks(case)
    response, want = case.input["response"], case.expected
    got: dict[str, Any] = {}
    try:
        if isinstance(response, str):
            got["sse"] = _stream(case, hooks, response)
        else:
            got["body"] = _body(hooks, response)
    except ProxyError as exc:
        got["raises"] = exc.code
    assert got == {k: want[k] for k in ("sse", "body", "raises") if k in want}
    assert [r.header_value() for r in hooks.rewrites] == want["rewrites"]
    assert normalised(hooks.repairs) == want["repairs"]
    assert hooks.delivered_text == want.get("delivered_text")
    assert hooks.delivered_arguments == want.get("delivered_arguments", {})
    # The repair driver's verdict, returned to the handler: ask again, with the answer and the problems.
    asked = Retry(want["retry_output"], want["retry_feedback"]) if "retry_feedback" in want else None
    assert verdict.retry() == asked


@pytest.mark.parametrize("case", retry_cases(), ids=str)
def test_a_retry_asks_again_with_the_answer_and_the_problems_as_the_last_turns(case: Case) -> None:
    c = case.input
    assert case.adapter.retry_body(c["body"], c["answer"], c["feedback"]) == case.expected


@pytest.mark.parametrize("case", input_message_cases(), ids=str)
def test_captured_input_is_in_the_semconv_shapes(case: Case) -> None:
    got = content.capture(case.adapter.input_messages(case.input), Outcome())
    got.pop("output_messages")
    assert got == case.expected
