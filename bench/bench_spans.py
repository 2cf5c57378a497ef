"""CPU of the tracing hot path: `spans.start_call` + `spans.end_call` per model call.

    .venv/bin/python bench/bench_spans.py [--calls N] [--repeats R] [--otlp-metrics]

A real TracerProvider and metric instruments from `setup_telemetry` (plus the OTLP push
thread with `--otlp-metrics`, whose interval is long enough never to fire here), with
the production span processor (bounded queue, drop counting, batch thread) in front of a
no-op exporter: what is measured is what the event loop pays, not what the export thread
pays. Times are the calling thread's CPU
(`time.thread_time_ns`), best of R repeats, so the batch thread's work is not counted.

Scenarios, rotating over 4 tenants x 2 models so label caches see realistic hits:
  json     non-streamed chat call, usage, cost
  stream   streamed chat call with 49 chunk gaps, one rewrite, one repair
  bare     `tracer.start_span(name).end()` alone: the SDK's floor for one span

Then, off the hot path: one Prometheus collection (`metrics_text()`, what a scrape of
/metrics costs, once per scrape and never per call) and the export thread's work per span
(OTLP protobuf encoding, gzip at the SDK's level 9 and at level 1, no compression).

Measured (2 shared cores, best of 5; before = spans.py at ac87ac9, after = 3fbd3b2):

    µs per call          prometheus reader     + otlp push reader
                         before   after        before   after
    json                   86.6    80.6         115.2   107.5
    stream (49 gaps)      711.4   137.5        1075.7   185.1
    bare start_span+end    ~13     ~13

Then (metric instruments of our own, tracing/aggregate.py, instead of the SDK's; before =
main at 0bc4a8e, after = this change, run alternately, best of 5, 2,000 calls):

    µs per call          prometheus            + otlp push
                         before   after        before   after
    json                   82.1    40.4         109.7    41.7
    stream (49 gaps)      127.8    52.8         170.6    52.8
    /metrics collection    9.0 ms  1.9 ms (this bench's 8 label sets)

Then (the call span built whole when it ends, tracing/lean.py, instead of the SDK's
start_span/set_attributes/end; before = main at 0a6300d, after = this change, run
alternately three times, best of 5, 3,000 calls; prometheus reader):

    µs per call          before               after
    json                 45.5 46.4 45.9       24.3 23.1 23.8
    stream (49 gaps)     59.3 59.7 59.9       35.6 35.6 35.3

Before that, what was left was the SDK's: ~10 µs per metric point (clean, copy and hash the labels,
offer an exemplar, aggregate) x 4 points for a JSON call, ~20 µs for the span itself;
spanmeter's own code is ~5 µs of a call. A /metrics scrape costs ~12 ms once per scrape.
The export thread's protobuf encoding (~72 µs/span) dwarfs gzip (~4 µs/span).
"""

from __future__ import annotations

import argparse
import gc
import gzip
import io
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from proxy.model import Call, Caller, CallRecord, Outcome, Repair, Rewrite, Usage
from tracing import spans
from tracing.setup import Telemetry, TelemetryConfig, setup_telemetry

CALLERS = [Caller(f"tenant-{i}", f"run-{i}", "header", key_id=f"k{i}") for i in range(4)]
JSON_CALLS = [Call(api="chat", operation="chat", openai_api_type="chat_completions", model=m, max_output_tokens=1024)
              for m in ("gpt-4o", "gpt-4o-mini")]
STREAM_CALLS = [
    Call(api="chat", operation="chat", openai_api_type="chat_completions", model=m, stream=True,
         max_output_tokens=1024, temperature=0.2)
    for m in ("gpt-4o", "gpt-4o-mini")
]
GAPS = [0.012 + (i % 5) * 0.001 for i in range(49)]
REWRITES = [Rewrite("include_usage")]
REPAIRS = [Repair("output", ("fence", "trailing_comma"))]


class NoopExporter(SpanExporter):
    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.SUCCESS


def make_tel(otlp_metrics: bool, *extra: SpanExporter) -> Telemetry:
    # The OTLP metric reader points at a closed port and never fires before shutdown; its
    # one export at shutdown fails fast (0.1 s timeout) and is not measured.
    env = {"OTEL_METRICS_EXPORTER": "otlp"} if otlp_metrics else {}
    cfg = TelemetryConfig(
        otlp_endpoint="http://127.0.0.1:9", export_timeout=0.1, metric_export_interval_ms=3_600_000,
        schedule_delay_ms=200,
    )  # fmt: skip
    return setup_telemetry(cfg, environ=env, span_exporters=[("noop", NoopExporter())], extra_exporters=extra)


def one_call(tel: Telemetry, i: int, stream: bool) -> None:
    caller = CALLERS[i % 4]
    call = (STREAM_CALLS if stream else JSON_CALLS)[(i >> 2) % 2]
    cs = spans.start_call(tel, caller, call, spans.Peer("openai", "api.openai.com", 443))
    outcome = Outcome(
        status=200,
        response_id=f"chatcmpl-{i}",
        response_model=call.model,
        usage=Usage(input_tokens=120, output_tokens=48),
        finish_reasons=("stop",),
        first_chunk_s=0.2 if stream else None,
    )
    spans.end_call(
        tel, cs, CallRecord(cs.caller, call, outcome, cs.start_ns, cost_micros=1234, usage_source="reported",
                            budget_remaining_micros=None,
        rewrites=REWRITES if stream else [], repairs=REPAIRS if stream else [],
        chunk_gaps_s=GAPS if stream else ()))  # fmt: skip


def best_us(fn: Callable[[int], None], calls: int, repeats: int) -> float:
    """Best per-call CPU µs of `repeats` runs of `calls` calls each."""
    best = float("inf")
    for _ in range(repeats):
        gc.collect()
        t0 = time.thread_time_ns()
        for i in range(calls):
            fn(i)
        best = min(best, (time.thread_time_ns() - t0) / calls / 1e3)
    return best


def hot_path(calls: int, repeats: int, otlp_metrics: bool) -> None:
    tel = make_tel(otlp_metrics)
    try:
        for i in range(200):  # warm caches and the SDK's per-series storage
            one_call(tel, i, False)
            one_call(tel, i, True)
        json_us = best_us(lambda i: one_call(tel, i, False), calls, repeats)
        stream_us = best_us(lambda i: one_call(tel, i, True), calls, repeats)
        bare_us = best_us(lambda i: tel.tracer.start_span("chat gpt-4o").end(), calls, repeats)
        readers = "prometheus + otlp push" if otlp_metrics else "prometheus"
        print(f"hot path, metric readers: {readers}")
        print(f"  json    start_call+end_call  {json_us:7.1f} µs/call  ({1e6 / json_us:9,.0f} spans/s)")
        print(f"  stream  start_call+end_call  {stream_us:7.1f} µs/call  ({1e6 / stream_us:9,.0f} spans/s)")
        print(f"  bare    start_span+end       {bare_us:7.1f} µs/span  ({1e6 / bare_us:9,.0f} spans/s)")
        t0 = time.thread_time_ns()
        text = tel.metrics_text()
        scrape_ms = (time.thread_time_ns() - t0) / 1e6
        print(f"  /metrics collection (per scrape, not per call): {scrape_ms:.2f} ms, {len(text):,} bytes")
    finally:
        tel.shutdown()


def export_cost(repeats: int) -> None:
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    memory = InMemorySpanExporter()
    tel = make_tel(False, memory)
    try:
        for i in range(512):
            one_call(tel, i, i % 2 == 1)
        batch = memory.get_finished_spans()
    finally:
        tel.shutdown()

    def encode() -> bytes:
        data: bytes = encode_spans(batch).SerializePartialToString()
        return data

    def gz(level: int) -> Callable[[], bytes]:
        def run() -> bytes:
            buf = io.BytesIO()  # as the SDK's OTLP/HTTP client does it, with GzipFile
            with gzip.GzipFile(fileobj=buf, mode="w", compresslevel=level) as f:
                f.write(data)
            return buf.getvalue()

        return run

    data = encode()
    n = len(batch)
    print(f"export thread, per span (batch of {n}, {len(data) / n:.0f} protobuf bytes/span):")
    for label, fn in (("protobuf encode", encode), ("gzip level 9 (SDK)", gz(9)), ("gzip level 1", gz(1))):
        best = min(_timed(fn) for _ in range(repeats))
        print(f"  {label:20s} {best / n / 1e3:6.1f} µs/span")


def _timed(fn: Callable[[], object]) -> int:
    t0 = time.thread_time_ns()
    fn()
    return time.thread_time_ns() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=5000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--otlp-metrics", action="store_true", help="also measure with the OTLP metric reader")
    args = ap.parse_args()
    hot_path(args.calls, args.repeats, False)
    if args.otlp_metrics:
        hot_path(args.calls, args.repeats, True)
    export_cost(args.repeats)


if __name__ == "__main__":
    main()
