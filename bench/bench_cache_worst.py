"""Where automatic Anthropic prompt caching (proxy/govern/caching.py) can cost more than
`off`: the agent shapes issue 54 found, priced both ways.

    PYTHONPATH=$PWD .venv/bin/python bench/bench_cache_worst.py

Each run's requests are priced with Anthropic's cache as documented
(tests/fixtures/anthropic_cache.py: a write only at a breakpoint above the minimum, a read
at a breakpoint or up to 20 blocks before it, writes at 1.25x, reads at 0.1x, 5 minutes):
as the agent sent them (`off`: no breakpoint, plain input) and as spanmeter forwards them
with `prompt_cache: auto` (the proxy's own placement code, with its memory). Input cost
only (output is the same both ways), claude-sonnet-4-5, a ~2,400-token agent prompt,
calls 2 s apart; "then N more" runs the same agent again, 60 s after the previous run's
last call, each run counted.

Shapes: a tool agent of 2, 3, 4 and 12 calls; agents prefilling the assistant turn (`{`, as
agents that want JSON do); turns of 11 parallel tool calls and their results (more than the
API's 20-block lookback); and the same with a short system prompt (below the minimum, so
only the conversation's breakpoints can pay) and longer tool results.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import orjson

from proxy.model import Caller
from proxy.providers.anthropic import ANTHROPIC
from proxy.providers.anthropic_cache import anthropic_breakpoints
from proxy.providers.base import open_exchange
from proxy.providers.cache import PrefixMemory
from tests.fixtures.anthropic_cache import PromptCache, input_micros

MODEL = "claude-sonnet-4-5"
SYSTEM = "You are a careful research agent. " + "Follow the house rules on sources and citations. " * 190
TOOLS = [{"name": f"tool_{i}", "description": f"Tool {i}: " + "looks things up in the archive. " * 25,
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}} for i in range(3)]
GAP_S, BETWEEN_RUNS_S = 2.0, 60.0


@dataclass(frozen=True)
class Shape:
    name: str
    calls: int  # model calls in a run: every answer but the last asks for tools
    parallel: int = 1  # tool calls in each answer
    prefill: str | None = None  # the assistant turn the agent starts for the model
    small: bool = False  # a short system prompt (below the minimum) and long tool results


SHAPES = [Shape("2-call tool agent", 2), Shape("3-call tool agent", 3), Shape("4-call tool agent", 4),
          Shape("12-call tool agent", 12),
          Shape("3-call agent prefilling `{`", 3, prefill="{"), Shape("6-call agent prefilling `{`", 6, prefill="{"),
          Shape("3-call agent, 11 parallel tool calls a turn", 3, parallel=11),
          Shape("6-call agent, 11 parallel tool calls a turn", 6, parallel=11),
          Shape("6-call agent, short prompt", 6, small=True),
          Shape("6-call agent prefilling `{`, short prompt", 6, prefill="{", small=True),
          Shape("6-call agent, 11 parallel tool calls a turn, short prompt", 6, parallel=11, small=True)]


def run_bodies(shape: Shape, run: int = 0) -> list[bytes]:
    """The request bodies of one run of `shape`, as the agent sends them."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"Find the sources (task {run})."}]
    bodies = []
    for call in range(shape.calls):
        tail = [{"role": "assistant", "content": shape.prefill}] if shape.prefill else []
        prompt = {"system": "You are a research agent.", "tools": TOOLS[:1]} if shape.small else \
            {"system": SYSTEM, "tools": TOOLS}
        bodies.append(orjson.dumps({"model": MODEL, "max_tokens": 512, **prompt, "messages": messages + tail}))
        text = (shape.prefill or "") + f'"step": {call}' + ("}" if shape.prefill else "")
        if call == shape.calls - 1:
            messages.append({"role": "assistant", "content": [{"type": "text", "text": text}]})
            break
        uses = [{"type": "tool_use", "id": f"toolu_{run}_{call}_{i}", "name": TOOLS[i % 3]["name"],
                 "input": {"city": f"city {i}"}} for i in range(shape.parallel)]
        messages.append({"role": "assistant", "content": [{"type": "text", "text": text}, *uses]})
        result = "sunny, 21 C, light wind " * (60 if shape.small else 8)
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": u["id"], "content": result} for u in uses]})
    return bodies


def price(runs: list[list[bytes]], *, auto: bool) -> int:
    """Input micro-USD of `runs`, sent one after another by one tenant."""
    cache, memory, now, usages = PromptCache(), PrefixMemory(), 0.0, []
    for n, bodies in enumerate(runs):
        caller = Caller(tenant="bench", run_id=f"run-{n}", run_id_source="header")
        now += BETWEEN_RUNS_S if n else 0.0
        for raw in bodies:
            now += GAP_S
            if auto:
                ex = open_exchange(ANTHROPIC, raw, "/v1/messages")
                anthropic_breakpoints(ex, caller, memory, now)
                raw = ex.request_bytes()
            usage = cache.bill(orjson.loads(raw), now)
            assert usage is not None, "more than 4 breakpoints"
            usages.append(usage)
    return input_micros(MODEL, usages)


def change(shape: Shape, runs: int) -> tuple[int, int]:
    """(off, auto) input micro-USD of `runs` runs of `shape` in a row."""
    bodies = [run_bodies(shape, n) for n in range(runs)]
    return price(bodies, auto=False), price(bodies, auto=True)


def main() -> None:
    print("| agent | alone: auto vs off | then 1 more run | then 9 more runs |")
    print("|---|---|---|---|")
    for shape in SHAPES:
        cells = []
        for runs in (1, 2, 10):
            off, auto = change(shape, runs)
            cells.append(f"{(auto - off) / off:+.1%}")
        print(f"| {shape.name} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
