"""Cost anatomy: the shares add up, exactly, whatever the request and the usage.

Table cases (tests/data/anatomy/shares.jsonl) pin the arithmetic; each API module's split
is pinned by tests/data/anatomy/parts.jsonl; a property test over generated requests of
every dialect and the real recorded pairs (../shared/cassettes/pairs.jsonl) checks that
the parts' tokens sum to the billed input tokens and their costs to the call's input cost.
"""

from __future__ import annotations

import base64
import gc
import json
from dataclasses import replace
from fractions import Fraction
from itertools import accumulate
from pathlib import Path
from typing import Any
from zlib import crc32

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.anatomy import (
    Chain,
    Split,
    Splits,
    anatomy,
    apportion,
    shares,
    shares_general,
    split_of,
    split_parts,
)
from proxy.model import Anatomy, Flushed, ToolCall, Usage, UsageEvent
from proxy.pricing import Price, PriceTable, cost
from proxy.providers.anthropic import ANTHROPIC
from proxy.providers.base import open_exchange
from proxy.providers.chat import CHAT
from proxy.providers.gemini import GEMINI
from proxy.providers.responses import RESPONSES
from proxy.providers.sse import Framer
from tests.fakes.replay import MISSING, RECORDED, decoded, recorded_pairs
from tests.providers.cases import ApiObject
from tracing.anatomy import call_totals, flush_totals, run_anatomy

DATA = Path(__file__).resolve().parents[1] / "data" / "anatomy"
ADAPTERS: dict[str, ApiObject] = {"chat": CHAT, "responses": RESPONSES, "messages": ANTHROPIC, "gemini": GEMINI}
PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages",
         "gemini": "/v1beta/models/m:generateContent"}


def _lines(name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (DATA / name).read_text().splitlines() if line.strip()]


def _price(p: dict[str, Any] | None) -> Price | None:
    if p is None:
        return None
    tiers = tuple((k, Fraction(str(v))) for k, v in (p.get("service_tiers") or {}).items())
    return Price("m", p["input"], p["cached_input"], p["cache_write"], 4 * p["input"], "test", "2026-01-01",
                 cache_write_1h=p.get("cache_write_1h"), service_tiers=tiers)


def _assert_adds_up(an: Anatomy | None, usage: Usage, price: Price | None) -> None:
    assert an is not None
    assert len(an.kinds_of_units) == len(an.tokens) == len(an.cached) == len(an.costs)
    assert sum(an.tokens) == usage.input_tokens == an.input_tokens
    whole = cost(price, replace(usage, output_tokens=0)) if price is not None else 0
    assert sum(an.costs) == whole == an.input_cost_micros
    assert all(0 <= c <= t for t, c in zip(an.tokens, an.cached, strict=True)) and min(an.costs, default=0) >= 0
    assert sum(an.cached) == min(usage.cache_read_tokens or 0, usage.input_tokens or 0)
    # The cache holds a prefix: once a part has a token past the cached ones, no later part is cached.
    seen_uncached = False
    for t, c in zip(an.tokens, an.cached, strict=True):
        assert not (seen_uncached and c), "cached tokens are the earliest"
        seen_uncached = seen_uncached or t > c


@pytest.mark.parametrize("case", _lines("shares.jsonl"), ids=lambda c: c["name"])
def test_shares(case: dict[str, Any]) -> None:
    parts = [("history", size, "", "") for size in case["sizes"]]
    usage = Usage(**case["usage"])
    an = anatomy(parts, usage, _price(case["price"]))
    assert an is not None
    assert an.tokens == case["tokens"]
    assert an.cached == case["cached"]
    assert an.costs == case["costs"]
    assert an.input_cost_micros == case["whole"]
    _assert_adds_up(an, usage, _price(case["price"]))


def test_no_anatomy_without_reported_input() -> None:
    assert anatomy([("new", 5, "", "")], Usage(output_tokens=3), None) is None


@pytest.mark.parametrize("case", _lines("parts.jsonl"), ids=lambda c: c["name"])
def test_each_api_splits_its_request(case: dict[str, Any]) -> None:
    adapter = ADAPTERS[case["dialect"]]
    parts = adapter.input_parts(case["body"])
    assert [[kind, name, cid] for kind, _, name, cid in parts] == case["parts"]
    if "sizes" in case:
        assert [size for _, size, _, _ in parts] == case["sizes"]


@given(total=st.integers(0, 10**7), weights=st.lists(st.integers(0, 10**6), max_size=60))
def test_apportion_sums_exactly(total: int, weights: list[int]) -> None:
    shares = apportion(total, weights)
    assert len(shares) == len(weights)
    assert sum(shares) == (total if weights else 0)
    whole = sum(weights)
    if whole:  # each share is within one of its exact value
        assert all(abs(s * whole - total * w) < whole for s, w in zip(shares, weights, strict=True))


# --- generated requests of every dialect ----------------------------------------------

_text = st.text(max_size=40)
_names = st.sampled_from(["read_file", "search", "run", "weird.name", ""])


@st.composite
def _turns(draw: st.DrawFn) -> list[tuple[str, Any]]:
    """A conversation in neutral form: ("user", text) | ("call", (id, name, args)) | ("result", (id, text))."""
    out: list[tuple[str, Any]] = []
    for i in range(draw(st.integers(0, 6))):
        kind = draw(st.sampled_from(["user", "call", "result"]))
        if kind == "user":
            out.append(("user", draw(_text)))
        elif kind == "call":
            out.append(("call", (f"c{i}", draw(_names), {"q": draw(_text)})))
        else:
            out.append(("result", (f"c{i - 1}", draw(_text))))
    out.append(("user", draw(_text)))
    return out


def _chat(system: str, tools: list[str], turns: list[tuple[str, Any]]) -> dict[str, Any]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": system}]
    for kind, v in turns:
        if kind == "user":
            msgs.append({"role": "user", "content": v})
        elif kind == "call":
            msgs.append({"role": "assistant", "content": None, "tool_calls": [
                {"id": v[0], "type": "function", "function": {"name": v[1], "arguments": json.dumps(v[2])}}]})
        else:
            msgs.append({"role": "tool", "tool_call_id": v[0], "content": v[1]})
    fns = [{"type": "function", "function": {"name": t, "parameters": {"type": "object"}}} for t in tools]
    return {"model": "m", "messages": msgs, "tools": fns}


def _responses(system: str, tools: list[str], turns: list[tuple[str, Any]]) -> dict[str, Any]:
    items: list[dict[str, Any]] = []
    for kind, v in turns:
        if kind == "user":
            items.append({"role": "user", "content": v})
        elif kind == "call":
            items.append({"type": "function_call", "call_id": v[0], "name": v[1], "arguments": json.dumps(v[2])})
        else:
            items.append({"type": "function_call_output", "call_id": v[0], "output": v[1]})
    return {"model": "m", "instructions": system, "input": items,
            "tools": [{"type": "function", "name": t, "parameters": {}} for t in tools]}


def _anthropic(system: str, tools: list[str], turns: list[tuple[str, Any]]) -> dict[str, Any]:
    msgs: list[dict[str, Any]] = []
    for kind, v in turns:
        if kind == "user":
            msgs.append({"role": "user", "content": v})
        elif kind == "call":
            msgs.append({"role": "assistant", "content": [{"type": "tool_use", "id": v[0], "name": v[1],
                                                           "input": v[2]}]})
        else:
            msgs.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": v[0], "content": v[1]}]})
    return {"model": "m", "max_tokens": 10, "system": system, "messages": msgs,
            "tools": [{"name": t, "input_schema": {"type": "object"}} for t in tools]}


def _gemini(system: str, tools: list[str], turns: list[tuple[str, Any]]) -> dict[str, Any]:
    contents: list[dict[str, Any]] = []
    for kind, v in turns:
        if kind == "user":
            contents.append({"role": "user", "parts": [{"text": v}]})
        elif kind == "call":
            contents.append({"role": "model", "parts": [{"functionCall": {"name": v[1], "args": v[2]}}]})
        else:
            contents.append({"role": "user", "parts": [{"functionResponse": {"name": "x", "response": {"r": v[1]}}}]})
    return {"systemInstruction": {"parts": [{"text": system}]}, "contents": contents,
            "tools": [{"functionDeclarations": [{"name": t} for t in tools]}]}


BUILDERS = {"chat": _chat, "responses": _responses, "messages": _anthropic, "gemini": _gemini}


@st.composite
def _usage(draw: st.DrawFn) -> Usage:
    total = draw(st.integers(0, 200_000))
    read = draw(st.integers(0, total))
    written = draw(st.integers(0, total - read))
    return Usage(input_tokens=total, output_tokens=draw(st.integers(0, 5000)), cache_read_tokens=read,
                 cache_write_tokens=written, cache_write_1h_tokens=draw(st.integers(0, written)),
                 service_tier=draw(st.sampled_from([None, "flex", "priority"])))


_TIERS = (("flex", Fraction(1, 2)), ("priority", Fraction(17, 10)))
_PRICES = [None, Price("p", 2_500_000, 1_250_000, 3_125_000, 10_000_000, "t", "2026-01-01",
                       cache_write_1h=5_000_000, service_tiers=_TIERS),
           Price("q", 1_000_003, 7, 1_250_011, 3, "t", "2026-01-01")]


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(dialect=st.sampled_from(list(BUILDERS)), system=_text, tools=st.lists(_names, max_size=5),
       turns=_turns(), usage=_usage(), price=st.sampled_from(_PRICES))
def test_parts_add_up_in_every_dialect(dialect: str, system: str, tools: list[str], turns: list[tuple[str, Any]],
                                       usage: Usage, price: Price | None) -> None:
    body = BUILDERS[dialect](system, tools, turns)
    ex = open_exchange(ADAPTERS[dialect], orjson.dumps(body), PATHS[dialect])
    parts = ex.input_parts(ex.body)
    assert sum(1 for kind, *_ in parts if kind == "tools") == len(tools)
    assert sum(1 for kind, *_ in parts if kind == "tool_result") == sum(1 for k, _ in turns if k == "result")
    _assert_adds_up(anatomy(parts, usage, price), usage, price)


# --- the real recorded pairs ---------------------------------------------------------------


def _usage_of(adapter: ApiObject, pair: dict[str, Any]) -> Usage:
    raw = decoded(pair)
    if pair["stream"]:
        events = [e for ev in Framer().feed(raw) for e in adapter.parse_event(ev)]
    else:
        events = adapter.parse_response(orjson.loads(raw))
    usage = Usage()
    for e in events:
        if isinstance(e, UsageEvent):
            usage = usage.merge(e.usage)
    return usage


@pytest.mark.skipif(not RECORDED.exists(), reason=MISSING)
def test_parts_add_up_on_every_recorded_pair() -> None:
    prices = PriceTable.load()
    checked = 0
    for pair in recorded_pairs():
        adapter = ADAPTERS[pair["dialect"]]
        if pair["response"]["status"] != 200:
            continue
        ex = open_exchange(adapter, base64.b64decode(pair["request"]["body_b64"]), pair["request"]["path"])
        usage = _usage_of(adapter, pair)
        if usage.input_tokens is None:
            continue
        parts = ex.input_parts(ex.body)
        price = prices.price(ex.call.model)
        _assert_adds_up(anatomy(parts, usage, price), usage, price)
        tool_results = [cid for kind, _, _, cid in parts if kind == "tool_result"]
        assert set(tool_results) >= {r.call_id for r in ex.call.tool_results}
        checked += 1
    assert checked > 400, f"only {checked} pairs had usage"


# --- a run's next request: the last split and the new items only ---------------------------


def _summary(sp: Split) -> tuple[Any, ...]:
    """What the arithmetic reads of a split."""
    return (sp.sizes, sp.ends, sp.units, sp.unit_bytes, sp.result_at, sp.result_size,
            [sp.names[i] for i in sp.result_name], sp.top, sp.definitions, sp.new_parts)


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(dialect=st.sampled_from(list(BUILDERS)), system=_text, tools=st.lists(_names, max_size=4),
       turns=_turns(), cut=st.integers(1, 6), usages=st.lists(_usage(), min_size=2, max_size=2),
       price=st.sampled_from(_PRICES))
def test_next_request_split_from_the_last_equals_the_whole_split(dialect: str, system: str, tools: list[str],
                                                                 turns: list[tuple[str, Any]], cut: int,
                                                                 usages: list[Usage], price: Price | None) -> None:
    """Turn N+1 is turn N with items appended: split from turn N's split (extended in place,
    after turn N's shares were taken from it), it is the same as split whole, and its shares
    are the same."""
    adapter = ADAPTERS[dialect]
    early = BUILDERS[dialect](system, tools, turns[:max(1, len(turns) - cut)])
    late = BUILDERS[dialect](system, tools, turns)
    raw_early, raw_late = orjson.dumps(early), orjson.dumps(late)
    key = adapter.conversation
    first = split_of(adapter, raw_early, orjson.loads(raw_early), None)
    shares(first, usages[0], price)  # what it remembers of this call must not change the next one's
    second = split_of(adapter, raw_late, orjson.loads(raw_late), first)
    whole = split_parts(adapter.input_parts(orjson.loads(raw_late)))
    if len(late[key]) > len(early[key]):
        assert second.end is not None, "appended items are found on the raw bytes"
    assert _summary(second) == _summary(whole)
    extended, fresh = shares(second, usages[1], price), shares(whole, usages[1], price)
    assert extended is not None and fresh is not None
    if len(late[key]) > len(early[key]):
        assert not extended.definitions_new, "the run's tool list was counted with its last request"
    assert replace(extended, definitions_new=True) == fresh
    third = split_of(adapter, raw_late, orjson.loads(raw_late), second)  # a retry: the same request
    assert _summary(third) == _summary(whole)


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(dialect=st.sampled_from(list(BUILDERS)), system=_text, tools=st.lists(_names, max_size=4),
       turns=st.lists(_turns(), min_size=3, max_size=5), edit=st.sampled_from([None, "head", "tail"]))
def test_a_run_of_requests_kept_as_crcs_extends_only_what_its_bytes_extend(
        dialect: str, system: str, tools: list[str], turns: list[list[tuple[str, Any]]], edit: str | None) -> None:
    """A run's requests, each the last with turns appended: from its second request on a
    split keeps CRCs, not the request, and each next request still splits as it would
    whole. A last request whose bytes before the conversation or after it changed (the same
    size, the same items) is split whole, never taken for the last one extended."""
    adapter = ADAPTERS[dialect]
    bodies, conversation = [], []
    for more in turns:
        conversation += more
        bodies.append({"a": "0000", **BUILDERS[dialect](system, tools, conversation), "z": "0000"})
    if edit:
        bodies[-1]["a" if edit == "head" else "z"] = "1111"
    sp = previous = None
    for i, body in enumerate(bodies):
        raw = orjson.dumps(body)
        sp = split_of(adapter, raw, orjson.loads(raw), previous)
        assert _summary(sp) == _summary(split_parts(adapter.input_parts(body)))
        if previous is not None and previous.raw == b"" and i == len(bodies) - 1:
            assert (sp is previous) == (edit is None), "only unchanged bytes extend a split kept as CRCs"
        grew = i > 0 and len(body[adapter.conversation]) > len(bodies[i - 1][adapter.conversation])
        if previous is not None and previous.end is not None and grew and not (edit and i == len(bodies) - 1):
            assert sp is previous and sp.raw == b"" and (sp.head, sp.tail) == (crc32(raw[:sp.end]), crc32(raw[sp.end:]))
            assert sp.last_item is None, "no parsed item kept either: the CRC covers it"
        previous = sp
    assert sp is not None
    raw = orjson.dumps(bodies[-1])
    assert split_of(adapter, raw, orjson.loads(raw), sp) is sp, "a retry of the last request"
    assert sp.raw == b"", "its bytes let go"


def test_a_request_sent_again_and_again_keeps_a_crc_then_extends_after_one_whole_split() -> None:
    """An agent that sends one request in a loop: its chain keeps the request's CRC, not
    its bytes; when the run moves on, where its conversation grew is not known from a CRC,
    so that request is split whole (its bytes kept once more), and the next extends."""
    body = _chat("s" * 100, ["t"], [("user", "a" * 50)])
    raw = orjson.dumps(body)
    first = split_of(CHAT, raw, orjson.loads(raw), None)
    assert first.raw == raw
    assert split_of(CHAT, raw, orjson.loads(raw), first) is first and first.raw == b"" and first.end is None
    assert split_of(CHAT, raw, orjson.loads(raw), first) is first
    edited = raw.replace(b"a" * 50, b"b" * 50)  # the same size: only the CRC tells
    assert split_of(CHAT, edited, orjson.loads(edited), first) is not first
    grown = _chat("s" * 100, ["t"], [("user", "a" * 50), ("call", ("c1", "t", {})), ("result", ("c1", "r" * 70))])
    raw2 = orjson.dumps(grown)
    second = split_of(CHAT, raw2, orjson.loads(raw2), first)
    assert second is not first and second.raw == raw2 and second.inherited, "split whole, its tool list the run's"
    more = _chat("s" * 100, ["t"], [("user", "a" * 50), ("call", ("c1", "t", {})), ("result", ("c1", "r" * 70)),
                                    ("user", "b" * 9)])
    raw3 = orjson.dumps(more)
    third = split_of(CHAT, raw3, orjson.loads(raw3), second)
    assert third is second and third.end is not None and third.raw == b""
    assert _summary(third) == _summary(split_parts(CHAT.input_parts(more)))
    # The same size, a byte changed before the conversation's end, or after it: not the same request.
    for edit in (raw3.replace(b'"model":"m"', b'"model":"n"'), raw3.replace(b'"name":"t","parameters"',
                                                                          b'"name":"u","parameters"')):
        assert edit != raw3 and split_of(CHAT, edit, orjson.loads(edit), third) is not third


@pytest.mark.skipif(not RECORDED.exists(), reason=MISSING)
def test_every_recorded_run_splits_its_requests_in_turn_as_each_would_split_whole() -> None:
    """The real runs of ../shared/cassettes, each run's requests in the order sent, through
    one chain: every split, whether extended (from the bytes of the run's first request, or
    from CRCs after that), taken for the same request again, or made whole, is what that
    request splits into alone. Real runs do extend: of the recordings' runs, 41 requests
    extend from the first request's bytes and 6 (runs of three or more) from CRCs."""
    runs: dict[str, list[dict[str, Any]]] = {}
    for pair in recorded_pairs():
        runs.setdefault(pair["run"], []).append(pair)
    how: dict[str, int] = {}
    for pairs in runs.values():
        sp = None
        for pair in sorted(pairs, key=lambda p: p["seq"]):
            adapter = ADAPTERS[pair["dialect"]]
            raw = base64.b64decode(pair["request"]["body_b64"])
            # What the split is checked against, before the call changes it in place.
            previous, size, crcs = sp, sp.size if sp else 0, sp is not None and sp.raw == b"" and sp.end is not None
            sp = split_of(adapter, raw, orjson.loads(raw), previous)
            assert _summary(sp) == _summary(split_parts(adapter.input_parts(orjson.loads(raw)))), pair["id"]
            if previous is not None:
                kind = "whole" if sp is not previous else "again" if len(raw) == size \
                    else "from CRCs" if crcs else "from bytes"
                how[kind] = how.get(kind, 0) + 1
    assert how.get("from bytes", 0) >= 30 and how.get("from CRCs", 0) >= 5, how


def test_a_turn_answered_after_a_cache_ending_past_it_shares_as_split_whole() -> None:
    """A split remembers the units' bytes before the last call's cache end; when the model
    answers, the new turn before that end becomes earlier conversation there too."""
    early = _chat("s" * 100, [], [("user", "a" * 300), ("user", "b" * 300)])
    late = _chat("s" * 100, [], [("user", "a" * 300), ("user", "b" * 300), ("call", ("c1", "t", {})),
                                 ("result", ("c1", "r" * 300))])
    first = split_of(CHAT, orjson.dumps(early), early, None)
    shares(first, Usage(input_tokens=700, cache_read_tokens=600), _PRICES[1])  # the cache ends in "b"
    second = split_of(CHAT, orjson.dumps(late), late, first)
    assert second.end is not None, "extended, not split whole"
    usage = Usage(input_tokens=1_000, cache_read_tokens=600)
    extended, whole = shares(second, usage, _PRICES[1]), shares(split_parts(CHAT.input_parts(late)), usage, _PRICES[1])
    assert extended is not None and whole is not None
    assert extended.kinds == whole.kinds and "new" not in whole.kinds


def test_an_edited_history_is_split_whole() -> None:
    """An agent that compacts or edits its history is not mistaken for one that appended."""
    body = {"model": "m", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "a" * 50}]}
    raw = orjson.dumps(body)
    first = split_of(CHAT, raw, orjson.loads(raw), None)
    edited = {"model": "m", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "b" * 10},
                                         {"role": "assistant", "content": "ok"}, {"role": "user", "content": "c"}]}
    raw2 = orjson.dumps(edited)
    second = split_of(CHAT, raw2, orjson.loads(raw2), first)
    assert second.end is None and second.sizes == [1, 10, 2, 1]
    inserted = {"model": "m", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "x"},
                                           {"role": "user", "content": "a" * 50}]}
    raw3 = orjson.dumps(inserted)
    assert split_of(CHAT, raw3, orjson.loads(raw3), first).sizes == [1, 1, 50]


def _advance(splits: Splits, key: tuple[str, ...], body: dict[str, Any], usage: Usage) -> Chain:
    raw = orjson.dumps(body)
    found = splits.get(key)
    sp = split_of(CHAT, raw, orjson.loads(raw), found.split if found else None)
    an = shares(sp, usage, _PRICES[1])
    assert an is not None
    chain = splits.advance(key, sp, an, 0.0)
    return chain


def test_the_same_request_again_continues_the_runs_chain() -> None:
    """A retry, or an agent that sends one request in a loop, is not a broken chain: no
    flush per call, and its results keep being priced on every send."""
    splits, key = Splits(), ("t", "r")
    body = _chat("s" * 100, ["t"], [("user", "a"), ("call", ("c1", "t", {})), ("result", ("c1", "r" * 500))])
    first = _advance(splits, key, body, Usage(input_tokens=300))
    raw = orjson.dumps(body)
    sp = split_of(CHAT, raw, orjson.loads(raw), first.split)
    assert sp is first.split
    an = shares(sp, Usage(input_tokens=300), _PRICES[1])
    assert an is not None
    assert not an.definitions_new, "the tool list was counted with the run's first call"
    chain = splits.advance(key, sp, an, 0.0)
    assert chain is first and chain.calls == 2
    [(tool, micros)] = chain.flush().tools
    assert tool == "t" and micros > 0


def test_a_chains_parts_are_summed_per_labels_its_calls_came_with() -> None:
    """A run that changes model mid-chain: its parts' sums are reported under each model's
    labels (the metrics by part are labelled by provider and model), adding up to its calls'."""
    splits, key = Splits(), ("t", "r")
    body = _chat("s" * 100, ["t"], [("user", "a" * 200)])
    raw = orjson.dumps(body)
    calls = [(("openai", "gpt-4o"), Usage(input_tokens=300)), (("openai", "gpt-4o-mini"), Usage(input_tokens=200)),
             (("openai", "gpt-4o"), Usage(input_tokens=100))]
    chain = None
    for labels, usage in calls:
        sp = split_of(CHAT, raw, orjson.loads(raw), chain.split if chain else None)
        an = shares(sp, usage, _PRICES[1])
        assert an is not None
        chain = splits.advance(key, sp, an, 0.0, labels)
    assert chain is not None
    tokens: dict[tuple[str, ...], int] = {}
    for labels, _, t, _, _ in chain.flush().kinds:
        tokens[labels] = tokens.get(labels, 0) + t
    assert tokens == {("openai", "gpt-4o"): 400, ("openai", "gpt-4o-mini"): 200}


def test_splits_are_bounded_by_runs_and_bytes_and_lose_no_unflushed_sums() -> None:
    """Pushed out of the cache, a chain whose calls were not flushed yet waits in `idle()`,
    to be added to its run's totals; a flushed one is simply dropped."""
    splits = Splits(max_runs=2, max_bytes=6_000)
    usage = Usage(input_tokens=100)
    for i in range(3):
        _advance(splits, ("t", str(i)), _chat("s" * 100, [], [("result", ("c", "r" * 100))]), usage)
    assert splits.get(("t", "0")) is None and splits.get(("t", "2")) is not None
    dropped = splits.idle(before=-1.0)
    assert [k for k, _ in dropped] == [("t", "0")] and dropped[0][1].tools
    assert splits.get(("t", "2")) is not None
    _advance(splits, ("t", "3"), _chat("s" * 6_000, [], [("user", "big")]), usage)  # over max_bytes: not kept
    assert splits.get(("t", "3")) is None and [k for k, _ in splits.idle(before=-1.0)] == [("t", "3")]
    assert splits.idle(before=-1.0) == [], "handed over once"


def test_a_chain_kept_as_crcs_counts_its_split_not_its_request() -> None:
    """The cache's bound counts what a chain holds: a run's first request whole, then only
    its split once the request is kept as CRCs. Three runs of 5 KB requests, each sent
    twice, fit in 13 KB; counted whole they would need 22."""
    splits, usage = Splits(max_runs=10, max_bytes=13_000), Usage(input_tokens=100)
    body = _chat("s" * 5_000, [], [("user", "a")])
    for run in ("0", "1", "2"):
        _advance(splits, ("t", run), body, usage)
        _advance(splits, ("t", run), body, usage)
    assert all(splits.get(("t", run)) is not None for run in ("0", "1", "2"))
    assert splits.idle(before=-1.0) == [], "none pushed out"


def _reachable(root: object, kind: type) -> list[object]:
    """The objects of `kind` that `root` holds, however deep (what it keeps alive)."""
    seen, todo, found = {id(root)}, [root], []
    while todo:
        for ref in gc.get_referents(todo.pop()):
            if id(ref) not in seen and not isinstance(ref, type):
                seen.add(id(ref))
                todo.append(ref)
                if isinstance(ref, kind):
                    found.append(ref)
    return found


def test_a_chain_pushed_out_leaves_its_sums_waiting_not_its_request() -> None:
    """However far the idle flusher falls behind, what waits for it is sums: a chain pushed
    out of the cache is flushed as it goes, and its split (the whole request it holds: a
    45 KB agent turn) is let go. Waiting chains once held every such request until the
    flusher caught up, and a busy process grew without bound."""
    splits = Splits(max_runs=1_000, max_bytes=50_000)
    usage = Usage(input_tokens=100)
    for i in range(40):
        _advance(splits, ("t", str(i)), _chat("s" * 100, [], [("result", ("c", "r" * 20_000))]), usage)
    held = _reachable(splits, Split)
    assert len(held) <= 3, "only the chains kept (50 KB of requests) hold a split"
    assert len(splits.dropped) >= 37 and all(isinstance(f, Flushed) and f.tools for _, f in splits.dropped)
    flushed = splits.idle(before=-1.0)
    assert {k for k, _ in flushed} >= {("t", str(i)) for i in range(37)}, "every run's sums are still added"


def _exact_result_costs(body: dict[str, Any], usage: Usage, price: Price) -> dict[str, Fraction]:
    """Each result's cost in one call, from scratch: its bytes in each window (cache reads,
    1-hour writes, 5-minute writes, the rest) at that window's rate, scaled so that the
    prompt's bytes cost the call's input micro-USD (the module's definition, in fractions)."""
    parts = CHAT.input_parts(body)
    size = sum(p[1] for p in parts)
    total = usage.input_tokens or 0
    read = min(usage.cache_read_tokens or 0, total)
    written = min(usage.cache_write_tokens or 0, total - read)
    hour = min(usage.cache_write_1h_tokens or 0, written)
    amounts = (read, hour, written - hour, total - written - read)
    billed = max(total, (usage.cache_read_tokens or 0) + (usage.cache_write_tokens or 0))
    r_in, r_cached, r_write, _ = price.rates(billed)
    rates = (r_cached, price.cache_write_1h_rate(total), r_write, r_in)
    whole = cost(price, replace(usage, output_tokens=0))
    pre = sum(a * r for a, r in zip(amounts, rates, strict=True)) * size
    out: dict[str, Fraction] = {}
    at = 0
    for kind, part_size, _, call_id in parts:
        lo, hi = at * total, (at + part_size) * total
        at += part_size
        if kind != "tool_result" or not pre:
            continue
        width = sum(max(0, min(hi, start + a * size) - max(lo, start)) * r
                    for a, r, start in zip(amounts, rates, accumulate([0, *(a * size for a in amounts)]), strict=False))
        out[call_id] = Fraction(width * whole, pre)
    return out


def _sum_flushes(flushes: list[Flushed], tools: dict[str, int], results: dict[str, list[int]]) -> int:
    """Add what each flush reports per tool and per result (micro-USD, sends)."""
    for f in flushes:
        for name, micros in f.tools:
            tools[name] = tools.get(name, 0) + micros
        for _, c, _, micros, count in f.results:
            got = results.setdefault(c, [0, 0])
            got[0] += micros
            got[1] += count
    return len(flushes)


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(turns=st.lists(st.tuples(st.integers(1, 3_000), st.sampled_from(["read_file", "search", "run"]),
                                st.floats(0, 1), st.booleans(), st.booleans()), min_size=1, max_size=12),
       price=st.sampled_from(_PRICES[1:]), every=st.integers(1, 5))
def test_a_chain_prices_every_result_on_every_send(turns: list[tuple[int, str, float, bool, bool]], price: Price,
                                                   every: int) -> None:
    """A run's tool results, priced through its chain (one number per call, flushed now and
    then), cost what pricing each result on each call by the windows its bytes lie in
    costs: per tool and per tracked result, within a micro-USD per flush and per call."""
    splits, key = Splits(), ("t", "r")
    conversation: list[tuple[str, Any]] = [("user", "start " * 20)]
    exact: dict[str, Fraction] = {}
    tool_of: dict[str, str] = {}
    sends: dict[str, int] = {}
    flushed: dict[str, int] = {}
    results: dict[str, list[int]] = {}
    flushes = 0
    for n, (size, tool, cached_share, writes, edit) in enumerate(turns):
        cid = f"call{n}"
        tool_of[cid] = tool
        conversation += [("call", (cid, tool, {"n": n})), ("result", (cid, "x" * size))]
        if edit and n:  # an edited history: the chain breaks, a new one begins
            conversation[0] = ("user", f"edited {n} " * 20)
        body = _chat("sys " * 50, ["read_file", "search", "run"], conversation)
        prompt = sum(p[1] for p in CHAT.input_parts(body)) // 4 + 1
        read = int(prompt * cached_share)
        usage = Usage(input_tokens=prompt, cache_read_tokens=read,
                      cache_write_tokens=(prompt - read) // 2 if writes else 0)
        raw = orjson.dumps(body)
        found = splits.get(key)
        sp = split_of(CHAT, raw, orjson.loads(raw), found.split if found else None)
        an = shares(sp, usage, price)
        assert an is not None
        chain = splits.advance(key, sp, an, 0.0)
        for c, value in _exact_result_costs(body, usage, price).items():
            exact[c] = exact.get(c, Fraction(0)) + value
            sends[c] = sends.get(c, 0) + 1
        due = [chain.flush()] if (n + 1) % every == 0 else []  # a broken chain's sums go with its successor's
        flushes += _sum_flushes(due, flushed, results)
    flushes += _sum_flushes([f for _, f in splits.of_run("t", "r")], flushed, results)
    calls = len(turns)
    for tool in {t for _, t, *_ in turns}:
        want = sum(v for c, v in exact.items() if tool_of[c] == tool)
        assert abs(flushed.get(tool, 0) - want) <= flushes + calls, (tool, flushed, want)
    assert results, "the largest results are priced one by one"
    one_chain = not any(edit for *_, edit in turns[1:])
    for c, (micros, count) in results.items():
        # Each chain prices its own largest; after a break a result may not be among them.
        if one_chain:
            assert count == sends[c], "a result's sends are the calls that carried it"
            assert abs(micros - exact[c]) <= flushes + calls
        else:
            assert count <= sends[c] and micros <= exact[c] + flushes + calls


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(dialect=st.sampled_from(list(BUILDERS)), system=_text, tools=st.lists(_names, max_size=5),
       turns=_turns(), usage=_usage(), price=st.sampled_from(_PRICES))
def test_the_written_out_path_shares_as_the_general_one(dialect: str, system: str, tools: list[str],
                                                         turns: list[tuple[str, Any]], usage: Usage,
                                                         price: Price | None) -> None:
    """Calls without cache writes take a written-out path (proxy.anatomy._shares_read): it
    gives the same anatomy as the general arithmetic, and the kinds add up exactly."""
    usage = replace(usage, cache_write_tokens=0, cache_write_1h_tokens=0)
    body = BUILDERS[dialect](system, tools, turns)
    ex = open_exchange(ADAPTERS[dialect], orjson.dumps(body), PATHS[dialect])
    sp = split_parts(ex.input_parts(ex.body))
    fast = shares(sp, usage, price)
    general = shares_general(sp, usage, price)
    assert fast == general
    assert fast is not None and sum(t for t, _, _ in fast.kinds.values()) == usage.input_tokens
    whole = cost(price, replace(usage, output_tokens=0)) if price is not None else 0
    assert sum(m for _, _, m in fast.kinds.values()) == whole


def test_definitions_are_counted_once_per_tool_list_and_priced_over_the_run() -> None:
    """A run's next request resends the same tool list: its definitions' bytes go into the
    run totals once, and the run's tool-definition cost is shared by those bytes."""
    tools = ["read_file", "search"]
    early = _chat("sys", tools, [("user", "a" * 40)])
    late = _chat("sys", tools, [("user", "a" * 40), ("call", ("c1", "read_file", {"q": "x"})),
                                ("result", ("c1", "r" * 200)), ("user", "more")])
    price = _PRICES[1]
    totals: dict[str, int] = {}
    splits = Splits()
    for body in (early, late):
        raw = orjson.dumps(body)
        found = splits.get(("t", "r"))
        sp = split_of(CHAT, raw, orjson.loads(raw), found.split if found else None)
        an = shares(sp, Usage(input_tokens=900, cache_read_tokens=300), price)
        assert an is not None
        splits.advance(("t", "r"), sp, an, 0.0)
        call = call_totals(an, [ToolCall("c1", "read_file", "{}")] if body is early else [])
        assert any(k.startswith("anatomy|def|") for k in call) == (body is early)
        for k, v in call.items():
            totals[k] = totals.get(k, 0) + v
    [(_, last)] = splits.of_run("t", "r")
    for k, v in flush_totals(last).items():
        totals[k] = totals.get(k, 0) + v
    ra = run_anatomy(totals)
    assert ra is not None and ra["declared"] == tools and ra["unused"] == ["search"]
    defs = ra["parts"]["tools"]["cost_usd"]
    sizes = [len(orjson.dumps(t)) for t in early["tools"]]
    assert ra["tools"]["search"]["definitions_cost_usd"] == pytest.approx(defs * sizes[1] / sum(sizes), abs=2e-6)
