"""CPU per recorded exchange through the proxy, by API (issue 29: real traffic is the yardstick).

Every pair of ../shared/cassettes/pairs.jsonl (the exchanges recorded against OpenAI,
Anthropic and Gemini) goes through the real app, which runs in this process with the
settings bench/bench_percall.py uses (a tenant key, run ceilings, budgets, the SQLite ledger,
repair on; no span export). A replay upstream in a child process answers each request with
the recorded bytes, a stream one event per write, as the providers send them; the client is
another child process. Each run's requests go in their recorded order, `--concurrency` runs
at a time, `--rounds` times over; the groups (API, streamed or not) one after the other.

Reported per group: the calls, the mean request and answer bytes, and this process's CPU per
call (`time.process_time()`: the event loop and the ledger's thread), with the bare
pass-through's share left out: no baseline to subtract, as in bench_percall.

    python bench/bench_replay.py [--rounds 3] [--concurrency 8] [--pin] [--profile out.prof]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import re
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from bench_percall import _free_port, _pin, _serve_app, _stop, _wait_port  # noqa: E402
from run import tenant_config  # noqa: E402

# Request headers the client does not resend: the proxy's own key goes in their place.
_DROP = {"host", "content-length", "authorization", "x-api-key", "x-goog-api-key", "accept-encoding", "connection"}
_AUTH = {"openai": "Authorization", "anthropic": "x-api-key", "gemini": "x-goog-api-key"}
# One SSE event, up to and including the blank line that ends it.
_EVENT = re.compile(rb".*?(?:\r\n\r\n|\n\n|\r\r|$)", re.S)


def _pairs() -> list[dict[str, Any]]:
    from tests.fakes.replay import MISSING, recorded_pairs

    pairs = recorded_pairs()
    if not pairs:
        raise SystemExit(MISSING)
    return pairs


def _group(pair: dict[str, Any]) -> str:
    return f"{pair['dialect']} {'stream' if pair['stream'] else 'json'}"


# --- the replay upstream (a child process) ----------------------------------------------


def _upstream(port: int) -> None:
    from aiohttp import web

    from tests.fakes.replay import decoded

    pairs = {p["id"]: p for p in _pairs()}

    async def answer(request: web.Request) -> web.StreamResponse:
        pair = pairs[request.headers["x-replay-pair"]]
        await request.read()
        body, status = decoded(pair), int(pair["response"]["status"])
        raw = pair["response"].get("headers") or []
        ctype = next((str(v) for k, v in (raw.items() if isinstance(raw, dict) else raw)
                      if k.lower() == "content-type"), "application/json")
        if not (pair["stream"] and status < 300 and "event-stream" in ctype):
            return web.Response(body=body, status=status, headers={"Content-Type": ctype})
        resp = web.StreamResponse(status=status, headers={"Content-Type": ctype})
        await resp.prepare(request)
        for event in _EVENT.findall(body):
            if event:
                await resp.write(event)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_route("POST", "/{tail:.*}", answer)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


# --- the client (a child process) -------------------------------------------------------


async def _drive(port: int, key: str, rounds: int, concurrency: int) -> None:
    import aiohttp

    by_group: dict[str, dict[str, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for p in _pairs():
        by_group[_group(p)][p["run"]].append(p)
    url = f"http://127.0.0.1:{port}"
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:

        async def send(pair: dict[str, Any], run: str) -> None:
            req = pair["request"]
            raw = req.get("headers") or {}
            headers = {k: v for k, v in (raw.items() if isinstance(raw, dict) else raw) if k.lower() not in _DROP}
            name = _AUTH[pair["provider"]]
            headers.update({name: f"Bearer {key}" if name == "Authorization" else key, "X-Run-Id": run,
                            "x-replay-pair": pair["id"]})
            query = req.get("query") or ""
            if isinstance(query, dict):
                query = "&".join(f"{k}={v}" for k, v in query.items() if k != "key")
            target = f"{url}{req['path']}" + (f"?{query}" if query else "")
            async with session.post(target, data=base64.b64decode(req["body_b64"]), headers=headers) as resp:
                await resp.read()
                if resp.status >= 500:
                    raise SystemExit(f"proxy answered {resp.status} for {pair['id']}: {await resp.text()}")

        async def phase(group: str, tag: str, n_rounds: int) -> None:
            gate = asyncio.Semaphore(concurrency)

            async def one_run(run: str, calls: list[dict[str, Any]]) -> None:
                async with gate:
                    for pair in sorted(calls, key=lambda p: p["seq"]):
                        await send(pair, f"{tag}-{run}")

            for r in range(n_rounds):
                await asyncio.gather(*(one_run(f"{r}-{run}", calls) for run, calls in by_group[group].items()))

        for group in by_group:  # warm up: every group once
            await phase(group, "warm", 1)
        print("warm " + ",".join(by_group), flush=True)
        while (line := (await loop.run_in_executor(None, sys.stdin.readline)).strip()) != "end":
            await phase(line, "go", rounds)
            print("done", flush=True)


# --- the proxy (this process) -----------------------------------------------------------


def _configure(tmp: Path, upstream_port: int) -> str:
    config, key = tenant_config(tmp, "{openai: OPENAI_API_KEY, anthropic: ANTHROPIC_API_KEY, gemini: GEMINI_API_KEY}")
    data = tmp / "data"
    data.mkdir()
    base = f"http://127.0.0.1:{upstream_port}"
    os.environ.update({
        "SPANMETER_CONFIG": str(config), "SPANMETER_DATA_DIR": str(data), "SPANMETER_LOCAL_TRACES": "false",
        "SPANMETER_OPENAI_BASE_URL": base, "SPANMETER_ANTHROPIC_BASE_URL": base, "SPANMETER_GEMINI_BASE_URL": base,
        "SPANMETER_MAX_CONNECTIONS": "1024",
        "OPENAI_API_KEY": "sk-bench-upstream", "ANTHROPIC_API_KEY": "sk-bench-upstream",
        "GEMINI_API_KEY": "bench-upstream",
    })
    return key


async def _serve_and_measure(args: argparse.Namespace, tmp: Path) -> list[tuple[str, int, float, float, float]]:
    from tests.fakes.replay import decoded

    pairs = _pairs()
    upstream_port = _free_port()
    key = _configure(tmp, upstream_port)
    upstream = await asyncio.create_subprocess_exec(sys.executable, __file__, "--upstream", str(upstream_port))
    runner = client = None
    try:
        await _wait_port(upstream_port)
        runner, port = await _serve_app()
        client = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--client", str(port), "--key", key,
            "--rounds", str(args.rounds), "--concurrency", str(args.concurrency),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        assert client.stdout is not None and client.stdin is not None
        warm = (await client.stdout.readline()).decode().strip()
        assert warm.startswith("warm "), warm
        if args.pin:
            _pin(upstream.pid, client.pid)
        profiler = None
        if args.profile:
            import cProfile

            profiler = cProfile.Profile(time.thread_time)
        rows = []
        for group in warm.removeprefix("warm ").split(","):
            mine = [p for p in pairs if _group(p) == group]
            p0 = time.process_time()
            if profiler:
                profiler.enable()
            client.stdin.write(f"{group}\n".encode())
            await client.stdin.drain()
            line = await client.stdout.readline()
            if profiler:
                profiler.disable()
            spent = time.process_time() - p0
            assert line.strip() == b"done", line
            n = len(mine) * args.rounds
            request_bytes = sum(len(base64.b64decode(p["request"]["body_b64"])) for p in mine) / len(mine)
            answer_bytes = sum(len(decoded(p)) for p in mine) / len(mine)
            rows.append((group, n, request_bytes, answer_bytes, spent / n * 1e6))
        client.stdin.write(b"end\n")
        await client.stdin.drain()
        await client.wait()
        if profiler:
            profiler.dump_stats(args.profile)
        return rows
    finally:
        await _stop(client, runner, upstream)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="times each group's pairs are sent")
    p.add_argument("--concurrency", type=int, default=8, help="runs in flight at once")
    p.add_argument("--pin", action="store_true", help="the proxy on CPU 0, the upstream and the client on CPU 1")
    p.add_argument("--profile", help="cProfile the event-loop thread over the measured calls into this file")
    p.add_argument("--upstream", type=int, help=argparse.SUPPRESS)
    p.add_argument("--client", type=int, help=argparse.SUPPRESS)
    p.add_argument("--key", help=argparse.SUPPRESS)
    args = p.parse_args()

    import uvloop

    if args.upstream:
        _upstream(args.upstream)
        return
    if args.client:
        uvloop.run(_drive(args.client, args.key, args.rounds, args.concurrency))
        return
    with tempfile.TemporaryDirectory() as tmp:
        rows = uvloop.run(_serve_and_measure(args, Path(tmp)))
    print(f"recorded exchanges through the proxy, {args.rounds} rounds, {args.concurrency} runs at a time")
    print(f"{'API':18} {'calls':>6} {'request B':>10} {'answer B':>9} {'CPU us/call':>12}")
    for group, n, req, ans, cpu in rows:
        print(f"{group:18} {n:>6} {req:>10,.0f} {ans:>9,.0f} {cpu:>12.0f}")
    total = sum(n for _, n, *_ in rows)
    print(f"{'all':18} {total:>6} {'':>10} {'':>9} {sum(n * cpu for _, n, _, _, cpu in rows) / total:>12.0f}")


if __name__ == "__main__":
    main()
