"""What automatic Anthropic prompt caching (proxy/govern/caching.py, issue 30) does to a run's input
cost, over the simulator's scenarios and the recorded Anthropic runs.

    PYTHONPATH=$PWD .venv/bin/python bench/bench_caching.py [--pairs ../shared/cassettes/pairs.jsonl]

Each run's requests are priced twice with Anthropic's cache as documented
(tests/fixtures/anthropic_cache.py: a prefix up to a breakpoint, the minimum length, written
once at 1.25x, read at 0.1x for 5 minutes, 20-block lookback): as the agent sent them
(`off`), and as spanmeter forwards them with `prompt_cache: auto` (`auto`, the same
decision code the proxy runs, with its memory of stable prefixes). Output is the same in
both and left out. Calls are 2 s apart.

Simulator: an agent (a ~2,400-token system prompt and three tools, or a small one below the
minimum) runs each scenario against the simulator, answering every tool call, up to 12
calls; alone, and 2 and 10 runs of the same agent in a row (all their calls counted).
Recorded: every Anthropic run in the pairs file, each alone (a fresh memory and cache:
the worst case), then all in file order as one tenant.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import aiohttp
import orjson

from proxy.model import Caller
from proxy.ops.demo import serve_on_free_port
from proxy.providers.anthropic import ANTHROPIC
from proxy.providers.anthropic_cache import anthropic_breakpoints
from proxy.providers.base import open_exchange
from proxy.providers.cache import PrefixMemory
from proxy.simulator import create_simulator
from tests.fixtures.anthropic_cache import PRICES, PromptCache, input_micros

MODEL = "claude-sonnet-4-5"
SYSTEM = "You are a careful research agent. " + "Follow the house rules on sources and citations. " * 190
TOOLS = [{"name": f"tool_{i}", "description": f"Tool {i}: " + "looks things up in the archive. " * 25,
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}} for i in range(3)]
SCENARIOS = ["text", "tool", "loop", "bad_args", "wrap_up", "json", "braces", "long", "cached"]
GAP_S = 2.0


async def _run(url: str, scenario: str, big: bool) -> list[bytes]:
    """One agent run against the simulator: the request bodies it sends, in order."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"SCENARIO:{scenario} Find the sources."}]
    extra: dict[str, Any] = {"system": SYSTEM, "tools": TOOLS} if big else {"tools": TOOLS[:1]}
    bodies = []
    async with aiohttp.ClientSession() as s:
        for _ in range(12):
            raw = orjson.dumps({"model": MODEL, "max_tokens": 512, **extra, "messages": messages})
            bodies.append(raw)
            async with s.post(url + "/v1/messages", data=raw, headers={"content-type": "application/json"}) as r:
                answer = orjson.loads(await r.read())
            content = answer["content"]
            messages.append({"role": "assistant", "content": content})
            uses = [b for b in content if b.get("type") == "tool_use"]
            if not uses:
                break
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": u["id"], "content": "sunny, 21 C, light wind " * 8}
                for u in uses]})
    return bodies


def _price(runs: list[list[bytes]], *, auto: bool) -> list[int]:
    """Input micro-USD of each run, the runs sent one after another by one tenant."""
    cache, memory, now, out = PromptCache(), PrefixMemory(), 0.0, []
    for n, bodies in enumerate(runs):
        caller = Caller(tenant="bench", run_id=f"run-{n}", run_id_source="header")
        usages = []
        for raw in bodies:
            now += GAP_S
            if auto:
                ex = open_exchange(ANTHROPIC, raw, "/v1/messages")
                anthropic_breakpoints(ex, caller, memory, now)
                raw = ex.request_bytes()
            body = orjson.loads(raw)
            usage = cache.bill(body, now)
            assert usage is not None, "more than 4 breakpoints"
            usages.append(usage)
        model = str(orjson.loads(bodies[0]).get("model"))
        out.append(input_micros(model if PRICES.price(model) else MODEL, usages))
    return out


def _row(name: str, calls: int, off: int, auto: int) -> str:
    change = f"{(auto - off) / off:+.1%}" if off else "n/a"
    return f"| {name} | {calls} | {off / 1e6:.6f} | {auto / 1e6:.6f} | {change} |"


async def _simulator() -> list[str]:
    runner, url = await serve_on_free_port(create_simulator())
    rows = ["| scenario (agent prompt) | calls | input $ off | input $ auto | change |", "|---|---|---|---|---|"]
    try:
        for big in (True, False):
            for scenario in SCENARIOS:
                bodies = await _run(url, scenario, big)
                size = "~2,400-token prompt" if big else "small prompt"
                alone = (_price([bodies], auto=False)[0], _price([bodies], auto=True)[0])
                rows.append(_row(f"{scenario} ({size}), alone", len(bodies), *alone))
                for runs in (2, 10):
                    both = (sum(_price([bodies] * runs, auto=False)), sum(_price([bodies] * runs, auto=True)))
                    rows.append(_row(f"{scenario} ({size}), {runs} runs in a row", len(bodies) * runs, *both))
    finally:
        await runner.cleanup()
    return rows


def _pairs(path: Path) -> list[str]:
    runs: dict[str, list[tuple[int, bytes]]] = defaultdict(list)
    for line in path.read_bytes().splitlines():
        pair = orjson.loads(line)
        if pair["dialect"] == "messages":
            runs[pair["run"]].append((pair["seq"], base64.b64decode(pair["request"]["body_b64"])))
    ordered = [[raw for _, raw in sorted(calls)] for calls in runs.values()]
    off_each = [_price([r], auto=False)[0] for r in ordered]
    auto_each = [_price([r], auto=True)[0] for r in ordered]
    changed = sum(1 for a, b in zip(off_each, auto_each, strict=True) if a != b)
    dearer = sum(1 for a, b in zip(off_each, auto_each, strict=True) if b > a)
    off_all, auto_all = sum(_price(ordered, auto=False)), sum(_price(ordered, auto=True))
    return [
        f"recorded Anthropic runs: {len(ordered)} ({sum(map(len, ordered))} calls)",
        f"  each alone: input ${sum(off_each) / 1e6:.6f} off, ${sum(auto_each) / 1e6:.6f} auto; "
        f"{changed} runs changed, {dearer} dearer",
        f"  all in order as one tenant: ${off_all / 1e6:.6f} off, ${auto_all / 1e6:.6f} auto",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=Path,
                        default=Path(__file__).resolve().parent.parent.parent / "shared" / "cassettes" / "pairs.jsonl")
    args = parser.parse_args()
    print("\n".join(asyncio.run(_simulator())))
    if args.pairs.exists():
        print("\n".join(_pairs(args.pairs)))
    else:
        print(f"no pairs file at {args.pairs}")


if __name__ == "__main__":
    main()
