"""CPU of relaying one streamed answer, per dialect: the proxy's per-event path, no network.

    PYTHONPATH=$PWD .venv/bin/python bench/bench_stream.py [--streams N] [--repeats R]

Each stream is a 50-event answer as its API sends it (chat: the benchmark's own stream,
bench/payloads.py; Anthropic, Responses, Gemini: their recorded fixtures in tests/data,
the text deltas repeated to 50 events). The request goes through `open_exchange` and
`prepare` and the response hooks are chosen by `outputs.response_hooks`, as the proxy does
(chat without stream_options: include_usage injected, the usage chunk dropped); then the
upstream's bytes go through the relay's per-chunk code and the observer's outcome, as
`relay._stream` runs them. Two deliveries: the whole stream in one chunk (what the load
benchmark's upstream sends) and one chunk per event (a model streaming).

Reported: µs per stream, the calling thread's CPU, best of R repeats. Runs against the
relay of this checkout and of an older one (it finds which entry points exist), so the
same script measures before and after: copy it into the older checkout and run it there.

Measured (2 shared cores, --streams 400 --repeats 5, three alternating runs each, their
middle value; before = main at 0bc4a8e, after = the text-delta shortcut, issue 16):

    µs per 50-event stream     one chunk            one chunk per event
                               before  after        before  after
    chat (include_usage)        185     106 (1.75x)   211     116 (1.8x)
    anthropic                   127      97 (1.3x)    155     106 (1.5x)
    responses                   139     132 (1.05x)   165     142 (1.15x)
    gemini (CRLF, usage/chunk)  557     333 (1.7x)    579     389 (1.5x)

What is left per stream: the events that are not plain text (role, finish, usage,
[DONE]; Responses' created/in_progress/completed carry the whole response) are parsed as
before, and the first text delta of each stream is parsed and its template proven
(~10 µs; Anthropic and Responses templates are proven once per process).
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

import orjson

from bench.payloads import REQUEST_SSE, SSE_EVENTS
from proxy.config import DEFAULT_POLICY
from proxy.govern.outputs import response_hooks
from proxy.model import Outcome
from proxy.providers.anthropic import ANTHROPIC
from proxy.providers.chat import CHAT
from proxy.providers.gemini import GEMINI
from proxy.providers.hooks import Hooks
from proxy.providers.responses import RESPONSES
from proxy.providers.translator import Answer, Api, open_call

DATA = Path(__file__).resolve().parent.parent / "tests" / "data"
EVENTS = 50
WORDS = ["Connection ", "pooling ", "keeps ", "sockets ", "warm, ", "so ", "each ", "request ", "skips ",
         "the ", "TCP ", "and ", "TLS ", "handshakes; ", "the ", "proxy ", "\"answers\" ", "faster.\\n"]


def _split(path: Path) -> list[bytes]:
    raw = path.read_bytes()
    sep = b"\r\n\r\n" if b"\r\n\r\n" in raw else b"\n\n"
    return [e + sep for e in raw.split(sep) if e.strip()]


def _grow(events: list[bytes], is_delta: Callable[[bytes], bool], word: Callable[[bytes, int], bytes]) -> list[bytes]:
    """The fixture with its text deltas repeated (new words) until the stream has EVENTS events."""
    deltas = [i for i, e in enumerate(events) if is_delta(e)]
    first, last = deltas[0], deltas[-1]
    n = EVENTS - (len(events) - (last - first + 1))
    middle = [word(events[first], i) for i in range(n)]
    return events[:first] + middle + events[last + 1:]


def _anthropic() -> list[bytes]:
    def word(e: bytes, i: int) -> bytes:
        return e.replace(b'"text":"Paris is "', b'"text":"' + WORDS[i % len(WORDS)].encode() + b'"')
    return _grow(_split(DATA / "anthropic" / "text_stream.sse"), lambda e: b"text_delta" in e, word)


def _responses() -> list[bytes]:
    def word(e: bytes, i: int) -> bytes:
        e = e.replace(b'"delta":"Paris is "', b'"delta":"' + WORDS[i % len(WORDS)].encode() + b'"')
        return e.replace(b'"sequence_number":4', b'"sequence_number":%d' % (4 + i)).replace(
            b'"obfuscation":"x1"', b'"obfuscation":"%s"' % hex(i * 7919).encode())
    return _grow(_split(DATA / "responses" / "text_stream.sse"), lambda e: b"output_text.delta" in e, word)


def _gemini() -> list[bytes]:
    def word(e: bytes, i: int) -> bytes:
        e = e.replace(b'"text":"Paris is"', b'"text":"' + WORDS[i % len(WORDS)].encode() + b'"')
        return e.replace(b'"totalTokenCount":2400', b'"candidatesTokenCount":%d,"totalTokenCount":%d' % (i, 2400 + i))
    events = _split(DATA / "gemini" / "text_stream.sse")
    return [word(events[0], i) for i in range(EVENTS - 1)] + events[-1:]


def _request(dialect: str) -> tuple[bytes, str]:
    """The recorded streaming request of `dialect` (chat: the load benchmark's own)."""
    if dialect == "chat":
        return REQUEST_SSE, "/v1/chat/completions"
    req = orjson.loads((DATA / dialect / "stream.request.json").read_bytes())
    return orjson.dumps(req["body"]), req["path"]


STREAMS: list[tuple[str, Api, list[bytes]]] = [
    ("chat", CHAT, SSE_EVENTS),
    ("anthropic", ANTHROPIC, _anthropic()),
    ("responses", RESPONSES, _responses()),
    ("gemini", GEMINI, _gemini()),
]


def _answer(adapter: Api, dialect: str) -> Answer:
    """A streaming call's answer, opened as the handler opens it: prepared, repair hooks on."""
    tr = open_call(adapter, *_request(dialect))
    hooks = Hooks()
    hooks.rewrites += tr.request.prepare()
    answer = tr.answer(hooks)
    response_hooks(answer, DEFAULT_POLICY)
    return answer


def _relay_once(answer: Answer, chunks: list[bytes]) -> tuple[bytes, Outcome]:
    """What `relay._stream` does between the upstream's chunks and the client's writes."""
    relay = answer.stream()
    out = [relay.feed(chunk) for chunk in chunks]
    out.append(relay.flush())
    answer.status, answer.complete = 200, True
    return b"".join(out), answer.outcome()


def _measure(adapter: Api, dialect: str, chunks: list[bytes], n: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        answers = [_answer(adapter, dialect) for _ in range(n)]
        gc.collect()
        t0 = time.thread_time_ns()
        for answer in answers:
            _relay_once(answer, chunks)
        best = min(best, (time.thread_time_ns() - t0) / n / 1e3)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    print(f"{'µs per 50-event stream':<24}{'one chunk':>12}{'per event':>12}   outcome")
    for dialect, adapter, events in STREAMS:
        assert len(events) == EVENTS, (dialect, len(events))
        whole = _measure(adapter, dialect, [b"".join(events)], args.streams, args.repeats)
        each = _measure(adapter, dialect, events, args.streams, args.repeats)
        body, outcome = _relay_once(_answer(adapter, dialect), events)
        summary: dict[str, Any] = {"chars": len(outcome.text), "finish": outcome.finish_reasons,
                                   "out_tokens": outcome.usage.output_tokens, "bytes": len(body)}
        print(f"{dialect:<24}{whole:>12.1f}{each:>12.1f}   {summary}")


if __name__ == "__main__":
    main()
