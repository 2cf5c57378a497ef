"""Every adapter against its recorded fixtures: requests, whole responses, streams."""

from __future__ import annotations

import json

import pytest

from proxy.providers.hooks import Hooks
from proxy.providers.observer import Observer
from proxy.providers.translator import open_call
from tests.providers.cases import (
    DATA,
    Case,
    expected_call,
    expected_outcome,
    normalised,
    request_cases,
    response_cases,
    stream_cases,
)


@pytest.mark.parametrize("case", request_cases(), ids=str)
def test_parse_request_reads_the_call_the_sdk_sent(case: Case) -> None:
    call = case.adapter.parse_request(case.input["body"], case.input["path"])
    assert normalised(call) == expected_call(case.expected)


@pytest.mark.parametrize("case", response_cases(), ids=str)
def test_a_whole_response_folds_into_the_expected_outcome(case: Case) -> None:
    observer = Observer()
    observer.feed(case.adapter.parse_response(case.input))
    assert normalised(observer.finish(200)) == expected_outcome(case.expected)


def _fold(case: Case, chunks: list[bytes]) -> dict[str, object]:
    """The stream read as a call's answer reads it (each answer has its own reader: a
    Gemini stream numbers its tool calls across its chunks), every event parsed in full."""
    req = json.loads((DATA / case.dialect / "stream.request.json").read_text())
    answer = open_call(case.adapter, json.dumps(req["body"]).encode(), req["path"]).answer(Hooks(reads_text=True))
    relay = answer.stream()
    for chunk in chunks:
        relay.feed(chunk)
    relay.flush()
    answer.status, answer.complete = 200, True  # as the relay leaves a whole stream
    return normalised(answer.outcome())


@pytest.mark.parametrize("case", stream_cases(), ids=str)
def test_a_stream_folds_into_the_expected_outcome(case: Case) -> None:
    assert _fold(case, [case.input]) == expected_outcome(case.expected)


@pytest.mark.parametrize("case", stream_cases(), ids=str)
@pytest.mark.parametrize("size", [1, 7, 64])
def test_a_stream_cut_into_small_chunks_folds_the_same(case: Case, size: int) -> None:
    data = case.input
    chunks = [data[i : i + size] for i in range(0, len(data), size)]
    assert _fold(case, chunks) == expected_outcome(case.expected)
