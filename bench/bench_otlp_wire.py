"""CPU per span of an OTLP span batch's encoding and compression, as the export child does it.

    .venv/bin/python bench/bench_otlp_wire.py [--spans 512] [--repeats 5] [--rounds 3]

Two sets of spans, made through the real tracing API and collected in memory:
`bench` is bench/bench_spans.py's call spans (JSON and streamed calls alternating, the same
usage every call: they compress far better than traffic does); `varied` is call spans as
traffic varies them (8 tenants, 4 models, run ids, token counts, costs, durations, finish
reasons, tool calls, a seeded generator).

Encoders, each timed on the same batch (best of `repeats`, process CPU clock), and checked
to write the same bytes:
  exporter      the exporter's own encoder (`encode_spans(...).SerializePartialToString()`)
  otlp_wire     tracing/otlp_wire.py `encode_spans` over ReadableSpans
  child before  what the export child did before issue 51: the pipe's tuples decoded to
                ReadableSpans (`decode_span`), then otlp_wire's `encode_spans`
  records       otlp_wire's `RecordEncoder` over the same tuples (the child now)
Then gzip of the encoded batch at levels 1, 6 and 9 (zlib, as tracing/otel_compat.py's
`gzip_bytes` writes it) and as the exporter's client does it (GzipFile, level 9): CPU per
span and bytes per span.
"""

from __future__ import annotations

import argparse
import gzip
import io
import random
import sys
import time
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_spans import one_call
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from proxy.model import Call, Caller, CallRecord, Outcome, ToolCall, Usage
from tracing import otlp_wire, spans
from tracing.records import decode_span, encode_span
from tracing.setup import Telemetry, TelemetryConfig, setup_telemetry

MODELS = ("gpt-4o", "gpt-4o-mini", "claude-sonnet-4-5", "gemini-2.5-flash")
PROVIDERS = {"gpt-4o": "openai", "gpt-4o-mini": "openai", "claude-sonnet-4-5": "anthropic",
             "gemini-2.5-flash": "gcp.gemini"}


def varied_call(tel: Telemetry, i: int, rng: random.Random) -> None:
    model = MODELS[rng.randrange(4)]
    caller = Caller(f"tenant-{rng.randrange(8)}", f"run-{rng.getrandbits(40):x}", "header", key_id=f"k{i % 8}")
    stream = rng.random() < 0.5
    call = Call(api="chat", operation="chat", openai_api_type="chat_completions", model=model, stream=stream,
                max_output_tokens=rng.choice((256, 1024, 4096)))
    start = 1_765_000_000_000_000_000 + i * 37_000_000
    cs = spans.start_call(tel, caller, call, spans.Peer(PROVIDERS[model], "api.example.com", 443), start_ns=start)
    tools = (ToolCall(f"call_{rng.getrandbits(64):x}", "search", '{"q": "x"}'),) if rng.random() < 0.4 else ()
    usage = Usage(input_tokens=rng.randrange(200, 40_000), output_tokens=rng.randrange(5, 2_000),
                  cache_read_tokens=rng.randrange(0, 30_000))
    outcome = Outcome(status=200, response_id=f"chatcmpl-{rng.getrandbits(96):x}", response_model=model,
                      usage=usage, finish_reasons=("tool_calls",) if tools else ("stop",), tool_calls=tools,
                      first_chunk_s=rng.random() if stream else None)
    end = start + rng.randrange(200_000_000, 20_000_000_000)
    spans.end_call(tel, cs, CallRecord(cs.caller, call, outcome, cs.start_ns, cost_micros=rng.randrange(10, 90_000),
                                       usage_source="reported", budget_remaining_micros=None, rewrites=[], repairs=[],
                                       end_ns=end))


def collect(n: int, shape: str) -> list[ReadableSpan]:
    memory = InMemorySpanExporter()
    tel = setup_telemetry(TelemetryConfig(), span_exporters=[], environ={}, extra_exporters=(memory,))
    rng = random.Random(51)
    try:
        for i in range(n):
            if shape == "bench":
                one_call(tel, i, i % 2 == 1)
            else:
                varied_call(tel, i, rng)
        tel.force_flush()
        return list(memory.get_finished_spans())
    finally:
        tel.shutdown()


def _best_us(fn: Callable[[], object], n: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.process_time()
        fn()
        best = min(best, time.process_time() - t0)
    return best / n * 1e6


def _gzip_file(data: bytes) -> bytes:
    buf = io.BytesIO()  # as the exporter's HTTP client does it
    with gzip.GzipFile(fileobj=buf, mode="w") as f:
        f.write(data)
    return buf.getvalue()


def one_round(batch: Sequence[ReadableSpan], repeats: int) -> None:
    n = len(batch)
    resource = batch[0].resource
    records = [encode_span(s, {}) for s in batch]
    encoder = otlp_wire.RecordEncoder(resource)
    data = encode_spans(batch).SerializePartialToString()
    assert otlp_wire.encode_spans(batch) == data and encoder.encode(records) == data
    timed = {
        "exporter": lambda: encode_spans(batch).SerializePartialToString(),
        "otlp_wire": lambda: otlp_wire.encode_spans(batch),
        "child before": lambda: otlp_wire.encode_spans([decode_span(r, resource) for r in records]),
        "records": lambda: encoder.encode(records),
    }
    line = ", ".join(f"{name} {_best_us(fn, n, repeats):.1f}" for name, fn in timed.items())
    print(f"  encode, us/span: {line}")
    packs: dict[str, Callable[[], bytes]] = {f"gzip {lvl}": (lambda lvl=lvl: zlib.compress(data, lvl, wbits=31))
                                             for lvl in (1, 6, 9)}
    packs["GzipFile 9"] = lambda: _gzip_file(data)
    line = ", ".join(f"{name} {_best_us(fn, n, repeats):.2f} us {len(fn()) / n:.0f} B" for name, fn in packs.items())
    print(f"  compress ({len(data) / n:.0f} B/span encoded), per span: {line}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--spans", type=int, default=512)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, default=128, help="spans per batch, as the child sends them (128)")
    args = p.parse_args()
    for shape in ("bench", "varied"):
        made = collect(args.spans, shape)
        batches = [made[i:i + args.batch] for i in range(0, len(made), args.batch)]
        print(f"{shape}: {len(made)} spans in batches of {args.batch}")
        for _ in range(args.rounds):
            one_round(batches[-1], args.repeats)


if __name__ == "__main__":
    main()
