"""What the local exporter writes for attribute values orjson refuses: the span is written
all the same (json's way), never dropped with the batch it came in."""

from __future__ import annotations

from pathlib import Path

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from tracing.local import JsonlSpanExporter, read_spans

CASES = [
    ("plain values", {"n": 3, "f": 0.5, "s": "é ok", "seq": ("a", "b")}, {"n": 3, "f": 0.5, "s": "é ok",
                                                                          "seq": ["a", "b"]}),
    ("an integer past 64 bits", {"big": 2**70}, {"big": 2**70}),
    ("a lone surrogate in a string", {"s": "ok \ud800 cut"}, {"s": "ok ? cut"}),
]


@pytest.mark.parametrize(("name", "attributes", "read_back"), CASES, ids=[c[0] for c in CASES])
def test_every_span_is_written_and_read_back(tmp_path: Path, name: str, attributes: dict[str, object],
                                             read_back: dict[str, object]) -> None:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(JsonlSpanExporter(tmp_path)))
    tracer = provider.get_tracer("t")
    tracer.start_span("before").end()
    tracer.start_span(name, attributes=attributes).end()  # type: ignore[arg-type]
    tracer.start_span("after").end()
    records = list(read_spans(tmp_path))
    assert [r["name"] for r in records] == ["before", name, "after"]
    assert records[1]["attributes"] == read_back
