"""CPU of metric points, and of a /metrics scrape: the OTel SDK against tracing/aggregate.py.

    .venv/bin/python bench/bench_metrics.py [--calls N] [--repeats R]

Both sides in one process, on the same label sets (tracing/metrics.py's CallLabels, as
spans.end_call uses them) and the same sampled span context:
- `sdk`: SDK instruments on a MeterProvider with the Prometheus reader (what /metrics used
  before), and `sdk+otlp` with the periodic OTLP reader too (interval never reached);
- `ours`: spanmeter's instruments (what Telemetry.instruments holds now).

Per call: a JSON call's 5 points (duration, input and output tokens, cost, cache-read
tokens) and a streamed call's 9 (plus time to first chunk, time per chunk, a rewrite and a
repair). Then one collection for 20 tenants x 5 models: the Prometheus text, and the OTLP
`MetricsData`. Times are the thread's CPU, best of R repeats, the sides interleaved.

Measured (2 shared cores, best of 5, 20,000 calls):

    µs per call (metric points only)   sdk    sdk+otlp   ours
    json   (5 points)                  61.2     79.5      4.1
    stream (9 points)                  98.8    140.2      7.0
    collection, 20 tenants x 5 models (3.4 MB of text)
    /metrics text                      98.8 ms            15.3 ms
    OTLP MetricsData                    2.3 ms             1.4 ms
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader, MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from prometheus_client import CollectorRegistry, generate_latest

from tracing import aggregate
from tracing import attributes as A
from tracing.aggregate import Counter, Histogram
from tracing.metrics import CallLabels, Instruments, build_kind_labels

SAMPLED = trace.set_span_in_context(trace.NonRecordingSpan(trace.SpanContext(
    0x1234, 0x5678, is_remote=False, trace_flags=trace.TraceFlags(trace.TraceFlags.SAMPLED))))  # fmt: skip
RESOURCE = Resource.create({"service.name": "bench", "service.instance.id": "i-1"})
SCOPE = aggregate.Scope("spanmeter", None, A.SCHEMA_URL)
FIELDS = ("operation_duration", "token_usage", "time_to_first_chunk", "time_per_output_chunk", "cost",
          "cache_tokens", "rewrites", "repairs")  # fmt: skip


def labels(tenants: int, models: int) -> list[CallLabels]:
    return [CallLabels.build((f"tenant-{t}", "chat", "openai", f"model-{m}", f"model-{m}", "api.openai.com", 443, None))
            for t in range(tenants) for m in range(models)]  # fmt: skip


def sdk_side(otlp: bool) -> tuple[dict[str, Any], MeterProvider, CollectorRegistry, InMemoryMetricReader]:
    registry = CollectorRegistry(auto_describe=True)
    memory = InMemoryMetricReader()
    readers: list[MetricReader] = [PrometheusMetricReader(registry=registry), memory]
    if otlp:
        readers.append(PeriodicExportingMetricReader(
            OTLPMetricExporter(endpoint="http://127.0.0.1:9/v1/metrics", timeout=0.1),
            export_interval_millis=3_600_000, export_timeout_millis=100))  # fmt: skip
    provider = MeterProvider(resource=RESOURCE, metric_readers=readers)
    meter = provider.get_meter("spanmeter", schema_url=A.SCHEMA_URL)
    ours = Instruments.create()
    made: dict[str, Any] = {}
    for name in FIELDS:
        inst = getattr(ours, name)
        if isinstance(inst, Histogram):
            made[name] = meter.create_histogram(inst.name, unit=inst.unit, description=inst.description,
                                                explicit_bucket_boundaries_advisory=list(inst.boundaries))
        elif isinstance(inst, Counter):
            made[name] = meter.create_counter(inst.name, unit=inst.unit, description=inst.description)
    return made, provider, registry, memory


def ours_side() -> dict[str, Any]:
    ours = Instruments.create()
    return {name: getattr(ours, name) for name in FIELDS}


KIND = build_kind_labels(("include_usage", "tenant-0"))
REPAIR = build_kind_labels(("fence", "tenant-0"))


def one_call(m: dict[str, Any], cl: CallLabels, stream: bool) -> None:
    """The points spans.end_call records for one call (its _record_call_metrics and
    _record_cache_metrics)."""
    ctx = SAMPLED
    m["operation_duration"].record(0.8, cl.timed, context=ctx)
    m["token_usage"].record(120, cl.input_tokens, context=ctx)
    m["token_usage"].record(48, cl.output_tokens, context=ctx)
    if stream:
        m["time_to_first_chunk"].record(0.2, cl.base, context=ctx)
        m["time_per_output_chunk"].record(0.013, cl.base)
    m["cost"].add(0.001234, cl.money, context=ctx)
    if stream:
        m["rewrites"].add(1, KIND, context=ctx)
        m["repairs"].add(1, REPAIR, context=ctx)
    m["cache_tokens"].add(0, cl.cache_read, context=ctx)


def best_us(fn: Callable[[int], None], calls: int) -> float:
    gc.collect()
    t0 = time.thread_time_ns()
    for i in range(calls):
        fn(i)
    return (time.thread_time_ns() - t0) / calls / 1e3


def timed_ms(fn: Callable[[], object]) -> float:
    t0 = time.thread_time_ns()
    fn()
    return (time.thread_time_ns() - t0) / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=20_000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    cls = labels(4, 2)
    sdk, sdk_provider, _, _ = sdk_side(False)
    sdk_otlp, otlp_provider, _, _ = sdk_side(True)
    ours = ours_side()
    sides = {"sdk": sdk, "sdk+otlp": sdk_otlp, "ours": ours}
    best: dict[tuple[str, bool], float] = {}
    for m in sides.values():
        for i in range(200):
            one_call(m, cls[i % len(cls)], i % 2 == 1)
    for _ in range(args.repeats):
        for stream in (False, True):
            for name, m in sides.items():
                us = best_us(lambda i, m=m, stream=stream: one_call(m, cls[i % len(cls)], stream), args.calls)
                best[(name, stream)] = min(best.get((name, stream), float("inf")), us)
    print("µs per call (metric points only)    " + "".join(f"{n:>10}" for n in sides))
    for stream, label in ((False, "json   (5 points)"), (True, "stream (9 points)")):
        print(f"  {label:34s}" + "".join(f"{best[(n, stream)]:10.2f}" for n in sides))
    sdk_provider.shutdown()
    otlp_provider.shutdown()

    # One collection after 20 tenants x 5 models, each with a JSON and a streamed call.
    many = labels(20, 5)
    sdk, provider, registry, memory = sdk_side(False)
    ours = ours_side()
    for m in (sdk, ours):
        for cl in many:
            one_call(m, cl, False)
            one_call(m, cl, True)
    instruments = list(ours.values())
    prom_sdk = min(timed_ms(lambda: generate_latest(registry)) for _ in range(args.repeats))
    prom_ours = min(timed_ms(lambda: aggregate.render_prometheus(RESOURCE, SCOPE, instruments))
                    for _ in range(args.repeats))  # fmt: skip
    otlp_sdk = min(timed_ms(memory.get_metrics_data) for _ in range(args.repeats))
    otlp_ours = min(timed_ms(lambda: aggregate.metrics_data(RESOURCE, SCOPE, instruments, 0))
                    for _ in range(args.repeats))  # fmt: skip
    size = len(aggregate.render_prometheus(RESOURCE, SCOPE, instruments))
    print(f"collection, 20 tenants x 5 models ({size:,} bytes of text)   sdk      ours")
    print(f"  /metrics text            {prom_sdk:8.2f} ms {prom_ours:8.2f} ms")
    print(f"  OTLP MetricsData         {otlp_sdk:8.2f} ms {otlp_ours:8.2f} ms")
    provider.shutdown()


if __name__ == "__main__":
    main()
