"""CPU per span of an OTLP span batch's encoding: the exporter's encoder against tracing/otlp_wire.py.

    .venv/bin/python bench/bench_otlp_wire.py [--spans 512] [--repeats 5] [--rounds 3]

The spans are bench/bench_spans.py's call spans (JSON and streamed calls alternating), made
through the real tracing API and collected in memory. Each round times both encoders on the
same batch (best of `repeats`, process CPU clock) and checks the bytes are the same.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_spans import one_call
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tracing import otlp_wire
from tracing.setup import TelemetryConfig, setup_telemetry


def _best_us(fn: Callable[[], object], n: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.process_time()
        fn()
        best = min(best, time.process_time() - t0)
    return best / n * 1e6


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--spans", type=int, default=512)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    memory = InMemorySpanExporter()
    tel = setup_telemetry(TelemetryConfig(capture_content="SPAN_ONLY"), span_exporters=[], environ={},
                          extra_exporters=(memory,))
    try:
        for i in range(args.spans):
            one_call(tel, i, i % 2 == 1)
        tel.force_flush()
        spans = list(memory.get_finished_spans())
    finally:
        tel.shutdown()
    assert otlp_wire.encode_spans(spans) == encode_spans(spans).SerializePartialToString()
    for _ in range(args.rounds):
        shipped = _best_us(lambda: encode_spans(spans).SerializePartialToString(), len(spans), args.repeats)
        wire = _best_us(lambda: otlp_wire.encode_spans(spans), len(spans), args.repeats)
        print(f"{len(spans)} spans: exporter's encoder {shipped:.1f} us/span, otlp_wire {wire:.1f} us/span "
              f"({shipped / wire:.1f}x)")


if __name__ == "__main__":
    main()
