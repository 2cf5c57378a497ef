"""Tests of the bench's pure parts: `.venv/bin/pytest bench/test_bench.py`."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from payloads import CALL_ID, CHAIN_NEXT_JSON, JSON_BODY, SSE_EVENTS, STREAM_EVENTS, TOOL_JSON_BODY, TOOL_SSE_EVENTS
from procs import Proc, Procs
from profile_hot import fold
from run import (
    Target,
    _contention,
    paired_ratios,
    ratios,
    render_before,
    render_workers,
    schedule,
    summarise,
    verdicts,
    workers_vs_one,
)
from upstream import NGINX_TOKEN, nginx_conf

STACKS = (
    "thread (1): MainThread;run_app (/v/site-packages/aiohttp/web.py:502);"
    "handle_call (/w/proxy/handler.py:40);policy_for (/w/proxy/config.py:183) 3\n"
    "thread (1): MainThread;run_app (/v/site-packages/aiohttp/web.py:502) 5\n"
    "thread (2): spanmeter-ledger;_run_batch (/w/proxy/policy/sqlite.py:453) 2\n"
)

FOLD_CASES = [
    ("self time goes to the innermost frame", "self", ("policy_for (proxy/config.py)", 30.0)),
    ("inclusive time counts every frame once", "inclusive", ("run_app (aiohttp/web.py)", 80.0)),
    ("threads come from the --threads prefix", "threads", ("MainThread", 80.0)),
    ("areas come from file paths", "areas", ("aiohttp", 50.0)),
    ("the event-loop thread has its own breakdown", "main_areas", ("aiohttp", 62.5)),
]


@pytest.mark.parametrize(("name", "key", "expected"), FOLD_CASES, ids=[c[0] for c in FOLD_CASES])
def test_fold(name: str, key: str, expected: tuple[str, float]) -> None:
    folded = fold(STACKS)
    assert folded["samples"] == 10
    assert expected in folded[key]


def test_contention_separates_the_proxy_from_other_work() -> None:
    before = {0: (100, 1000), 1: (0, 1000)}
    after = {0: (700, 2000), 1: (500, 2000)}
    out = _contention(before, after, proxy_ticks=400)
    assert out == {"cpu0_busy_pct": 60.0, "foreign_cpu0_pct": 20.0, "cpu1_busy_pct": 50.0}


def _run(rps: float, p50_us: int, cpu: float | None = None) -> dict[str, object]:
    r: dict[str, object] = {"rps": rps, "latency_us": {"p50": p50_us, "p99": p50_us * 2}, "error_count": 0}
    if cpu is not None:
        r["cpu_ms_per_req"] = r["loop_cpu_ms_per_req"] = cpu
    return r


def test_summary_takes_medians_and_ratios_to_bare() -> None:
    direct = Target("direct", 1, "k", "")
    direct.runs = {"json_c1": [_run(9000, 100), _run(9000, 100), _run(9000, 100)]}
    bare, sm = Target("bare", 2, "k", ""), Target("sm", 3, "k", "")
    bare.proc = sm.proc = object()  # type: ignore[assignment]
    bare.runs = {"json_c1": [_run(2000, 400, 0.2), _run(2000, 500, 0.2), _run(2000, 9000, 0.2)]}
    sm.runs = {"json_c1": [_run(500, 1100, 1.0), _run(500, 1300, 0.8), _run(500, 1200, 0.6)]}
    summary = summarise([direct, bare, sm])
    assert summary["sm"]["added.json_c1.p50_ms"] == pytest.approx(1.1)
    assert summary["bare"]["added.json_c1.p50_ms"] == pytest.approx(0.4)
    assert ratios(summary)["sm"]["json_c1.cpu_ms"] == pytest.approx(4.0)


def test_payloads_and_nginx_config(tmp_path: Path) -> None:
    assert len(SSE_EVENTS) == STREAM_EVENTS and SSE_EVENTS[-1] == b"data: [DONE]\n\n"
    conf = nginx_conf(tmp_path, 12345)
    assert "listen 127.0.0.1:12345" in conf and JSON_BODY.decode() in conf
    assert (tmp_path / "sse.txt").read_bytes() == b"".join(SSE_EVENTS)


def test_chained_calls_carry_the_call_id_the_upstream_made(tmp_path: Path) -> None:
    """Every tool call id the upstream answers with is nginx's fresh $request_id, and the
    next request has two places for it: the assistant's call and the tool's result."""
    assert CHAIN_NEXT_JSON.count(CALL_ID.encode()) == 2
    assert TOOL_JSON_BODY.count(CALL_ID.encode()) == 1 and b"".join(TOOL_SSE_EVENTS).count(CALL_ID.encode()) == 1
    conf = nginx_conf(tmp_path, 12345)
    assert CALL_ID not in conf and conf.count("call_${request_id}") == 2
    # nginx reads a quoted string into a 4 KB buffer: every echo of the stream fits
    echoes = [ln for ln in conf.splitlines() if "echo -n" in ln]
    assert echoes and max(len(ln) for ln in echoes) < NGINX_TOKEN + 200


def test_verdicts_say_met_or_not_with_bare_beside() -> None:
    summary = {"bare": {"json_c64.cpu_ms": 0.2, "sse_c64.cpu_ms": 0.2, "slow_c256.rps": 1000.0,
                        "added.json_c1.p50_ms": 0.2, "peak_rss_mb": 50.0},
               "sm-full": {"json_c64.cpu_ms": 0.4, "sse_c64.cpu_ms": 0.8, "slow_c256.rps": 400.0,
                           "added.json_c1.p50_ms": 0.7, "peak_rss_mb": 140.0, "json_c1.peak_rss_mb": 100.0,
                           "agent_c64.peak_rss_mb": 140.0},
               "sm-local": {"peak_rss_mb": 200.0}}
    out = verdicts(summary, ratios(summary))
    full = "\n".join(out["sm-full"])
    assert "NOT MET added p50, 1 connection, JSON <= 0.5 ms: 0.700 ms (bare +0.200 ms)" in full
    assert "met     CPU per request JSON, 64 connections <= 2.5x bare: 2.000x bare (0.400 vs bare 0.200)" in full
    assert "NOT MET CPU per request 50-event stream" in full
    assert "NOT MET throughput, 256 connections, 50 ms upstream >= 50% of bare: 0.400x" in full
    assert "met     peak RSS <= 150 MB in every scenario (OTLP export on): 140.000 MB (highest in agent_c64" in full
    assert out["sm-local"] == []  # without OTLP export the memory target does not apply


def test_each_scenario_visits_every_target_before_the_next() -> None:
    order = schedule(2, ["bare", "sm-full", "sm-local"], ["json_c1", "json_c64"])
    assert order[:3] == [(0, "json_c1", "bare"), (0, "json_c1", "sm-full"), (0, "json_c1", "sm-local")]
    assert order[3] == (0, "json_c64", "bare")
    assert sorted(order) == sorted({(r, sc, t) for r in range(2) for sc in ("json_c1", "json_c64")
                                    for t in ("bare", "sm-full", "sm-local")})


def test_paired_ratios_cancel_a_drift_between_repetitions() -> None:
    direct, bare, sm = Target("direct", 1, "k", ""), Target("bare", 2, "k", ""), Target("sm-full", 3, "k", "")
    bare.proc = sm.proc = object()  # type: ignore[assignment]
    # The machine ran 3x slower in the second repetition and 2x in the third.
    bare.runs = {"json_c64": [_run(4000, 100, 0.1), _run(1300, 100, 0.3), _run(2000, 100, 0.2)]}
    sm.runs = {"json_c64": [_run(1000, 100, 0.4), _run(260, 100, 1.5), _run(1000, 100, 0.6)]}
    direct.runs = {"json_c64": [_run(9000, 10)] * 3}
    paired = paired_ratios([direct, bare, sm])
    assert set(paired) == {"sm-full"}  # direct has no process to measure; bare is the reference
    assert paired["sm-full"]["json_c64.cpu_ms"] == pytest.approx(4.0)  # 4, 5, 3: the ratio of medians says 3
    assert ratios(summarise([direct, bare, sm]))["sm-full"]["json_c64.cpu_ms"] == pytest.approx(3.0)
    assert paired["sm-full"]["json_c64.rps"] == pytest.approx(0.25)  # 0.25, 0.2, 0.5
    assert paired_ratios([direct, sm]) == {}  # no bare in the run: nothing to pair with
    summary = {"bare": {"json_c64.cpu_ms": 0.2}, "sm-full": {"json_c64.cpu_ms": 0.6}}
    line = "\n".join(verdicts(summary, ratios(summary), paired)["sm-full"])
    assert "3.000x bare (0.600 vs bare 0.200; paired by repetition 4.000x)" in line


def test_a_proxy_on_both_cores_has_no_foreign_share_of_cpu0() -> None:
    out = _contention({0: (100, 1000), 1: (0, 1000)}, {0: (700, 2000), 1: (500, 2000)}, proxy_ticks=None)
    assert out == {"cpu0_busy_pct": 60.0, "cpu1_busy_pct": 50.0}


def test_two_workers_against_one_are_ratios_of_the_same_run() -> None:
    summary = {"sm-full": {"json_c64.rps": 1000.0, "json_c64.cpu_ms": 1.0, "sse_c64.rps": 800.0},
               "sm-workers2": {"json_c64.rps": 1500.0, "json_c64.cpu_ms": 1.2, "sse_c64.rps": 1000.0}}
    assert workers_vs_one(summary) == pytest.approx({"json_c64.rps": 1.5, "json_c64.cpu_ms": 1.2,
                                                     "sse_c64.rps": 1.25})
    table = render_workers(summary)
    assert "| 2 workers / 1 | 1.50x | 1.25x | - |" in table
    assert workers_vs_one({"sm-full": summary["sm-full"]}) == {} and render_workers({}) == ""


def test_a_change_is_ratios_to_its_baseline_in_the_same_run() -> None:
    summary = {"sm-before": {"json_c64.cpu_ms": 1.0, "sse_c64.cpu_ms": 2.0},
               "sm-full": {"json_c64.cpu_ms": 0.8, "sse_c64.cpu_ms": 1.0}}
    table = render_before(summary)
    assert "| after / before | 0.80x | 0.50x | - |" in table
    assert render_before({"sm-full": summary["sm-full"]}) == ""


@contextlib.contextmanager
def _busy_tree(tmp_path: Path, script: str) -> Iterator[tuple[Proc, int]]:
    """A real process tree of three (the script forks), and its CPU ticks over 0.5 s."""
    procs = Procs(tmp_path)
    try:
        proc = procs.start("tree", [sys.executable, "-c", script], cpu=None, port=None)
        deadline = time.monotonic() + 10
        while len(proc.pids()) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(proc.pids()) == 3
        before = proc.cpu_ticks()
        time.sleep(0.5)
        yield proc, proc.cpu_ticks() - before
    finally:
        procs.close()


def test_grandchildren_count_too(tmp_path: Path) -> None:
    """A worker's own child (the span-export process) is part of the proxy's cost: here
    only the grandchild is busy."""
    script = ("import os, time\n"
              "end = time.time() + 30\n"
              "if os.fork() == 0 and os.fork() == 0:\n"
              "    while time.time() < end:\n"
              "        sum(range(10000))\n"
              "time.sleep(30)\n")
    with _busy_tree(tmp_path, script) as (_, ticks):
        assert ticks >= 20  # ~50 ticks in 0.5 s at HZ=100, all of them the grandchild's


def test_a_supervisors_cpu_and_memory_include_its_workers(tmp_path: Path) -> None:
    """A real parent with two busy children: the figures are of the three processes."""
    script = ("import os, time\n"
              "end = time.time() + 30\n"
              "if os.fork() and os.fork():\n"
              "    time.sleep(30)\n"
              "while time.time() < end:\n"
              "    sum(range(10000))\n")
    with _busy_tree(tmp_path, script) as (proc, ticks):
        assert ticks >= 20  # two busy children, ~50 ticks in 0.5 s at HZ=100
        assert proc.main_thread_ticks() > 0 and proc.status()["Threads"] == 3 and proc.fds() >= 3


def test_the_stream_benchmark_relays_each_dialects_answer_whole() -> None:
    import bench_stream

    for dialect, adapter, events in bench_stream.STREAMS:
        body, outcome = bench_stream._relay_once(bench_stream._answer(adapter, dialect), events)
        assert len(events) == bench_stream.EVENTS
        assert outcome.finish_reasons and outcome.usage.output_tokens, dialect
        assert len(outcome.text) > 200, dialect  # every delta's text
        # What the client gets is what came, but for the usage chunk chat drops (not asked for).
        assert (body == b"".join(events)) == (dialect != "chat"), dialect


def test_each_scenario_has_its_own_peak_rss(tmp_path: Path) -> None:
    """A real process that held 80 MB and let it go: after the reset its peak is what it
    holds now, not the 80 MB of before."""
    script = ("import time\n"
              "block = bytearray(80 << 20)\n"
              "del block\n"
              "time.sleep(30)\n")
    procs = Procs(tmp_path)
    try:
        proc = procs.start("peak", [sys.executable, "-c", script], cpu=None, port=None)
        deadline = time.monotonic() + 10
        while proc.status().get("VmHWM", 0) < 80 << 10 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.status()["VmHWM"] >= 80 << 10  # kB
        proc.reset_peak_rss()
        assert proc.status()["VmHWM"] < 40 << 10
        assert list(proc.peaks_by_process().values()) == [proc.status()["VmHWM"]]
    finally:
        procs.close()


def test_the_memory_verdict_says_which_process_held_the_peak() -> None:
    sm = Target("sm-full", 3, "k", "")
    sm.proc = object()  # type: ignore[assignment]
    low, high = _run(500, 1000, 1.0), _run(500, 1000, 1.0)
    low |= {"peak_rss_kb": 100 << 10, "peak_rss_kb_by_process": {"serving 7": 70 << 10, "export child 9": 30 << 10}}
    high |= {"peak_rss_kb": 140 << 10, "peak_rss_kb_by_process": {"serving 7": 100 << 10, "export child 9": 40 << 10}}
    sm.runs = {"json_c64": [low], "agent_c64": [high]}
    sm.start_rss_kb_by_process = {"serving 7": 78 << 10, "export child 9": 15 << 10}
    sm.peak_rss_kb_by_scenario = {"json_c64": 100 << 10, "agent_c64": 140 << 10}
    sm.peak_rss_kb = 140 << 10
    summary = summarise([Target("direct", 1, "k", ""), sm])
    assert summary["sm-full"]["peak_rss_child_mb"] == 40 and summary["sm-full"]["start_rss_serving_mb"] == 78
    line = "\n".join(verdicts(summary, ratios(summary))["sm-full"])
    assert ("met     peak RSS <= 150 MB in every scenario (OTLP export on): 140.000 MB (highest in agent_c64: "
            "serving 100 + export child 40 MB, at start-up 78 + 15; bare 0 MB)") in line


def test_the_fast_target_runs_the_ledger_without_the_fsync_in_its_own_data_dir(tmp_path: Path) -> None:
    from run import spanmeter_env

    from proxy.ledger.backends import open_store

    env = spanmeter_env("sm-fast", tmp_path, 1, tmp_path / "config.yaml", 2, None)
    assert env["SPANMETER_ANATOMY"] == "false"
    assert env["OTEL_EXPORTER_OTLP_COMPRESSION"] == "none"
    assert env["SPANMETER_OTLP_ENDPOINT"] == "http://127.0.0.1:2"  # spans still go over OTLP

    async def durability() -> str:
        store = open_store(env["SPANMETER_LEDGER_URL"])
        try:
            assert store.path == str(tmp_path / "sm-fast" / "ledger.db")  # type: ignore[attr-defined]
            return str(store._synchronous)  # type: ignore[attr-defined]
        finally:
            await store.aclose()

    assert asyncio.run(durability()) == "NORMAL"


@pytest.mark.parametrize(("body", "count"), [
    (b"data: {\"a\":1}\n\ndata: {\"a\":2}\n\ndata: [DONE]\n\n", 3),
    (b"event: message_start\r\ndata: {}\r\n\r\nevent: ping\r\ndata: {}\r\n\r\n", 2),
    (b"data: {\"cut\": true}", 1),  # no blank line at the end
    (b"", 0),
])
def test_the_replay_upstream_writes_a_stream_event_by_event_and_every_byte(body: bytes, count: int) -> None:
    from bench_replay import _EVENT

    events = [e for e in _EVENT.findall(body) if e]
    assert b"".join(events) == body
    assert len(events) == count
