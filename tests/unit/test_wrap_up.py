"""The wrap-up note: its words for what is left (pure), and its place in each dialect,
byte for byte, from the tables in tests/data/wrapup/."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from proxy.govern.ceilings import NOTE_BYTES
from proxy.govern.wrapup import MARK, Remaining, notice, remaining
from proxy.ledger.store import Admission, Limits
from proxy.providers.anthropic import ANTHROPIC
from proxy.providers.base import open_exchange
from proxy.providers.chat import CHAT
from proxy.providers.embeddings import EMBEDDINGS
from proxy.providers.gemini import GEMINI
from proxy.providers.responses import RESPONSES
from proxy.simulator.script import WRAP_UP_MARK
from tracing import spans

DATA = Path(__file__).parent.parent / "data" / "wrapup"
PLACEMENTS = json.loads((DATA / "placement.json").read_text())
NOTICES = yaml.safe_load((DATA / "notices.yaml").read_text())
_OPEN = {"chat": (CHAT, "/v1/chat/completions"), "responses": (RESPONSES, "/v1/responses"),
         "messages": (ANTHROPIC, "/v1/messages"), "embeddings": (EMBEDDINGS, "/v1/embeddings"),
         "gemini": (GEMINI, "/v1beta/models/gemini-2.5-flash:generateContent")}


def _admission(calls: int = 1, reserved: int = 0, remaining: dict[str, int] | None = None, run_tokens: int = 0,
               started_at: float | None = None) -> Admission:
    return Admission("a", "acme", "r", reserved, calls, dict(remaining or {}), "2026-05-14", "2026-05",
                     run_tokens=run_tokens, started_at=started_at)


@pytest.mark.parametrize("case", PLACEMENTS, ids=[c["name"] for c in PLACEMENTS])
def test_the_note_goes_after_the_last_message_and_nothing_else_changes(case: dict[str, Any]) -> None:
    adapter, path = _OPEN[case["api"]]
    raw = case["request"].encode()
    ex = open_exchange(adapter, raw, path)
    placed = adapter.append_note(ex, "NOTE")
    if case["forwarded"] is None:
        assert placed is False and ex.request_bytes() == raw
        return
    assert placed is True
    forwarded = ex.request_bytes()
    assert forwarded == case["forwarded"].encode()
    assert orjson.loads(forwarded) == ex.body, "the body the proxy observes is the one it forwards"


def test_the_note_follows_a_spliced_top_level_field_and_an_edited_body() -> None:
    raw = b'{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}'
    ex = open_exchange(CHAT, raw, "/v1/chat/completions")
    assert CHAT.append_note(ex, "NOTE")
    CHAT.prepare(ex)  # stream_options.include_usage, spliced at the end
    assert ex.request_bytes() == (b'{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"},'
                                  b'{"role":"user","content":"NOTE"}],"stream_options":{"include_usage":true}}')
    edited = open_exchange(CHAT, b'{"messages":[{"role":"tool","tool_call_id":"c","content":"x"}]}',
                           "/v1/chat/completions")
    assert edited.prefix_tool_result("c", "R:")  # the loop guard re-serialises the body
    assert CHAT.append_note(edited, "NOTE")
    assert orjson.loads(edited.request_bytes())["messages"] == [
        {"role": "tool", "tool_call_id": "c", "content": "R:x"}, {"role": "user", "content": "NOTE"}]


@pytest.mark.parametrize("case", NOTICES, ids=[c["name"] for c in NOTICES])
def test_the_note_says_what_is_left(case: dict[str, Any]) -> None:
    got = notice(Limits(**case["limits"]), _admission(**case["admission"]), case["share"], case.get("now", 0))
    if case["text"] is None:
        assert got is None
        return
    assert got is not None and (got.text, got.reason) == (case["text"], case["reason"])
    assert got.text.startswith(MARK) and MARK == WRAP_UP_MARK, "the simulator answers on this mark"
    assert len(got.text.encode()) + 100 < NOTE_BYTES, "the input bound counts the note and its wrapping"


def test_remaining_headers_show_each_ceiling_that_is_set_and_the_tighter_budget() -> None:
    limits = Limits(run_max_calls=6, run_max_cost=500_000, run_max_tokens=10_000, run_max_seconds=60,
                    day_budget=5_000_000, key_day_budget=1_000_000)
    adm = _admission(calls=4, reserved=20_000, run_tokens=2_500, started_at=100.0,
                     remaining={"run_cost": 110_000, "tenant_day": 4_000_000, "tenant_month": None,
                                "key_day": 250_500, "key_month": None})
    left = remaining(limits, adm, now_s=112.25)
    assert left.headers() == {
        "x-spanmeter-run-calls-remaining": "2",
        "x-spanmeter-run-cost-remaining-usd": "0.11",
        "x-spanmeter-run-tokens-remaining": "7500",
        "x-spanmeter-run-seconds-remaining": "47.750",
        "x-spanmeter-budget-day-remaining-usd": "0.2505",
    }
    assert remaining(Limits(), _admission(remaining={"run_cost": None}), 0) == Remaining()
    assert Remaining().headers() == {}


@pytest.mark.parametrize(("totals", "outcome"), [
    ({"wrap_up_notices": 2, "answers_after_notice": 1}, "answered_after_notice"),
    ({"wrap_up_notices": 2, "answers_after_notice": 1, "ceilings_hit": 1}, "ceiling_after_notice"),
    ({"ceilings_hit": 1}, "ceiling"),
    ({"wrap_up_notices": 1, "answers_after_notice": 0}, "other"),  # left before answering (idle timeout)
    ({"model_calls": 3}, "other"),
])
def test_a_runs_outcome_tells_an_answer_after_a_note_from_a_ceiling(totals, outcome):
    assert spans.run_outcome(totals) == outcome


def test_a_conversation_nested_a_thousand_deep_gets_its_note_and_keeps_its_bytes() -> None:
    deep = "[" * 1000 + "]" * 1000  # orjson takes it (1024 levels); the stdlib's own scanner would not
    raw = ('{"model":"m","messages":[{"role":"user","content":"hi","extra":' + deep + "}]}").encode()
    ex = open_exchange(CHAT, raw, "/v1/chat/completions")
    assert CHAT.append_note(ex, "NOTE") is True
    assert ex.request_bytes() == raw[:-2] + b',{"role":"user","content":"NOTE"}]}'


def test_a_reminder_inside_the_conversation_and_the_note_after_it_are_both_spliced() -> None:
    raw = (b'{"model": "m", "messages": [{"role": "user", "content": "go"},\n'
           b' {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", '
           b'"function": {"name": "f", "arguments": "{}"}}]},\n {"role": "tool", "tool_call_id": "c1", '
           b'"content": "1.10"}], "temperature": 1E2}')
    ex = open_exchange(CHAT, raw, "/v1/chat/completions")
    assert ex.prefix_tool_result("c1", "R: ")  # the loop guard's reminder, inside the last message
    assert CHAT.append_note(ex, "NOTE")  # the note, around it in the messages array
    assert ex.request_bytes() == raw.replace(b'"content": "1.10"}]', b'"content": "R: 1.10"},'
                                             b'{"role":"user","content":"NOTE"}]')
