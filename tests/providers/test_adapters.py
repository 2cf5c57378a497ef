"""Every adapter against its recorded fixtures: requests, whole responses, streams."""

from __future__ import annotations

import pytest

from proxy.providers.observer import Observer
from proxy.providers.sse import Framer
from tests.providers.cases import (
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
    framer, observer = Framer(), Observer()
    for chunk in chunks:
        for event in framer.feed(chunk):
            observer.feed(case.adapter.parse_event(event))
    last = framer.flush()
    if last is not None:
        observer.feed(case.adapter.parse_event(last))
    return normalised(observer.finish(200))


@pytest.mark.parametrize("case", stream_cases(), ids=str)
def test_a_stream_folds_into_the_expected_outcome(case: Case) -> None:
    assert _fold(case, [case.input]) == expected_outcome(case.expected)


@pytest.mark.parametrize("case", stream_cases(), ids=str)
@pytest.mark.parametrize("size", [1, 7, 64])
def test_a_stream_cut_into_small_chunks_folds_the_same(case: Case, size: int) -> None:
    data = case.input
    chunks = [data[i : i + size] for i in range(0, len(data), size)]
    assert _fold(case, chunks) == expected_outcome(case.expected)
