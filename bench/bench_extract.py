"""Extractor throughput, as a ratio to orjson.loads on the same clean bytes.

    python bench/bench_extract.py

Inputs: a ~1.2 MB array of records (unicode, escapes, brackets inside strings), then the
same records fenced in prose, rewritten as JSON5, and cut off. Streaming: the clean
records fed in 64-byte pieces through StreamExtractor (items) and StreamRepairer,
against one feed of the whole text into the same class, and against orjson. Targets
from issue 6: fenced within 3x of orjson; streaming within 3x of one parse of the whole.
Prints a table; takes well under a minute.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from proxy.model import OutputSpec
from proxy.repair import StreamExtractor, StreamRepairer, extract_json

CHUNK = 64


def records(n: int) -> list[dict[str, Any]]:
    return [
        {
            "id": i,
            "name": f'Zoë {i} "quoted" {{braces}} [brackets]',
            "city": "東京" if i % 3 else "Zürich",
            "score": i * 1.25,
            "tags": ["alpha", "beta", f"t{i % 7}"],
            "active": i % 2 == 0,
            "note": None if i % 5 else "line\nbreak\ttab \\ back",
        }
        for i in range(n)
    ]


def clean_text() -> str:
    return orjson.dumps(records(6_000), option=orjson.OPT_INDENT_2).decode()


def json5_text(clean: str) -> str:
    """Unquoted keys, single-quoted strings, trailing commas, a comment per record."""
    out = clean.replace('"id": ', "// record\n    id: ").replace('"active": ', "active: ")
    out = out.replace('"alpha"', "'alpha'").replace("}\n", "},\n", 1)
    return out.replace("\n  }", ",\n  }")


def best_ms(fn: Callable[[], object], runs: int) -> float:
    times = []
    for _ in range(runs):
        gc.disable()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        gc.enable()
    return statistics.median(times) * 1000


def stream_through(make: Callable[[], Any], text: str, size: int) -> Callable[[], object]:
    def run() -> object:
        s = make()
        feed = s.feed
        for i in range(0, len(text), size):
            feed(text[i : i + size])
        return s.finish()

    return run


def main() -> None:
    clean = clean_text()
    fenced = "Here is the data you asked for:\n```json\n" + clean + "\n```\nAnything else?"
    five = json5_text(clean)
    cut = clean[: len(clean) * 2 // 3]
    prose = "Sure! The result is " + clean + " as requested."
    assert extract_json(fenced) == extract_json(clean) == extract_json(prose)
    assert extract_json(five) == orjson.loads(clean)
    mb = len(clean.encode()) / 1e6
    base = best_ms(lambda: orjson.loads(clean), 15)
    spec = OutputSpec("json_schema", schema={"type": "array"})

    rows: list[tuple[str, int, float]] = [("orjson.loads (reference)", len(clean), base)]
    rows.append(("extract_json clean", len(clean), best_ms(lambda: extract_json(clean), 15)))
    rows.append(("extract_json fenced + prose", len(fenced), best_ms(lambda: extract_json(fenced), 15)))
    rows.append(("extract_json prose, no fence", len(prose), best_ms(lambda: extract_json(prose), 15)))
    rows.append(("extract_json JSON5", len(five), best_ms(lambda: extract_json(five), 3)))
    rows.append(("extract_json truncated (partial)", len(cut), best_ms(lambda: extract_json(cut, True), 3)))

    whole_x = best_ms(stream_through(lambda: StreamExtractor("items"), clean, len(clean)), 3)
    chunk_x = best_ms(stream_through(lambda: StreamExtractor("items"), clean, CHUNK), 3)
    whole_r = best_ms(stream_through(lambda: StreamRepairer(spec), clean, len(clean)), 3)
    chunk_r = best_ms(stream_through(lambda: StreamRepairer(spec), clean, CHUNK), 3)
    chunk_r5 = best_ms(stream_through(lambda: StreamRepairer(spec), five, CHUNK), 3)
    rows += [
        ("StreamExtractor items, whole text", len(clean), whole_x),
        (f"StreamExtractor items, {CHUNK} B chunks", len(clean), chunk_x),
        ("StreamRepairer, whole text", len(clean), whole_r),
        (f"StreamRepairer, {CHUNK} B chunks", len(clean), chunk_r),
        (f"StreamRepairer JSON5, {CHUNK} B chunks", len(five), chunk_r5),
    ]

    print(f"clean input: {mb:.2f} MB; orjson.loads: {base:.2f} ms ({mb / base * 1000:.0f} MB/s)")
    print(f"{'input':40} {'bytes':>10} {'ms':>9} {'MB/s':>8} {'x orjson':>9}")
    for name, size, ms in rows:
        per_byte = (ms / size) / (base / len(clean))
        print(f"{name:40} {size:>10} {ms:>9.2f} {size / 1e6 / ms * 1000:>8.1f} {per_byte:>8.2f}x")
    print()
    print("streaming ratio (64 B chunks vs one feed of the whole, same class):")
    print(f"  StreamExtractor items: {chunk_x / whole_x:.2f}x   StreamRepairer: {chunk_r / whole_r:.2f}x")
    print("streaming ratio (64 B chunks vs orjson.loads of the whole):")
    print(f"  StreamExtractor items: {chunk_x / base:.2f}x   StreamRepairer: {chunk_r / base:.2f}x")


if __name__ == "__main__":
    main()
