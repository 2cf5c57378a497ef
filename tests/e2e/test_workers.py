"""`spanmeter serve --workers 2`, as an operator runs it: real processes (the supervisor
and its workers), the openai SDK, the simulator, a real SQLite file or redis-server, and a
real Prometheus scraping the port.

Each test starts one `serve` (about a second) and checks as much as it can with it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from proxy.config import hash_key
from proxy.ledger.backends import open_store
from proxy.ledger.leases import LEASE_CALLS
from proxy.pricing import PROVIDER_OVERHEAD_TOKENS
from proxy.serve.siblings import WORKER_ATTRIBUTE
from tests.fixtures.otlp import OtlpReceiver, otlp_receiver  # noqa: F401
from tests.tracing.test_export_process import export_children
from tests.tracing.test_prometheus_scrape import PROMETHEUS, listening_port, poll, query
from tracing.viewer import load_runs

ROOT = Path(__file__).resolve().parents[2]
KEY = "sm-acme-workers-key-0001"
ADMIN = "admin-token-workers"
COUNT = "gen_ai_client_operation_duration_seconds_count"
REJECTED = "spanmeter_limit_rejections_total"


@dataclass
class Served:
    proc: subprocess.Popen[str]
    port: int
    data: Path
    err: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def status(self) -> dict[str, Any]:
        return dict(json.loads((self.data / "workers" / str(self.port) / "status.json").read_text()))

    def log(self) -> str:
        return self.err.read_text(errors="replace")

    def access_by_worker(self) -> Counter[str]:
        return Counter(m.group(1) for m in re.finditer(r" spanmeter\.access .* worker=(\d+)$", self.log(), re.M))


@pytest.fixture
async def serve(tmp_path: Path) -> AsyncIterator[Any]:
    started: list[Served] = []

    async def start(sim_url: str, *, policy: str, ledger: str | None = None, new_session: bool = False,
                    workers: int = 2, extra_env: dict[str, str] | None = None) -> Served:
        name = f"serve{len(started)}"
        cfg = tmp_path / f"{name}.yaml"
        cfg.write_text(f"upstream_keys: {{openai: OPENAI_API_KEY}}\nadmin_token: {ADMIN}\n"
                       f"tenants:\n  acme:\n    keys: ['{hash_key(KEY)}']\n    policy: {policy}\n")
        data = tmp_path / name
        env = {**_clean_env(), "SPANMETER_CONFIG": str(cfg), "SPANMETER_OPENAI_BASE_URL": sim_url,
               "SPANMETER_DATA_DIR": str(data), "OPENAI_API_KEY": "sk-upstream"}
        if ledger:
            env["SPANMETER_LEDGER_URL"] = ledger
        env.update(extra_env or {})
        err = tmp_path / f"{name}.err"
        with err.open("w") as sink:
            proc = subprocess.Popen([sys.executable, "-m", "proxy", "serve", "--port", "0", "--workers", str(workers)],
                                    cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=sink,
                                    start_new_session=new_session)
        assert proc.stdout is not None
        line = await asyncio.to_thread(proc.stdout.readline)
        found = re.search(r"spanmeter listening on http://127\.0\.0\.1:(\d+) .*; (\d+) workers$", line)
        assert found, (line, err.read_text())
        srv = Served(proc, int(found.group(1)), data, err)
        started.append(srv)
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(OSError, ValueError):
                if all(w["ready"] for w in srv.status()["workers"]):
                    return srv
            assert time.monotonic() < deadline and proc.poll() is None, srv.log()
            await asyncio.sleep(0.05)

    yield start
    for srv in started:
        if srv.proc.poll() is None:
            srv.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.to_thread(srv.proc.wait, 30)
            except subprocess.TimeoutExpired:
                srv.proc.kill()
                srv.proc.wait()


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[Any]:
    if not os.path.exists(PROMETHEUS):
        pytest.skip("no prometheus binary")
    procs: list[subprocess.Popen[bytes]] = []

    def start(target: str) -> str:
        config = tmp_path / "prometheus.yml"
        config.write_text("global: {scrape_interval: 1s, evaluation_interval: 1s}\nscrape_configs:\n"
                          f"  - job_name: spanmeter\n    static_configs: [{{targets: ['{target}']}}]\n")
        proc = subprocess.Popen([PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'prom'}",
                                 "--web.listen-address=127.0.0.1:0"], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        procs.append(proc)
        return f"http://127.0.0.1:{listening_port(proc.pid, time.monotonic() + 30)}"

    yield start
    for proc in procs:
        proc.terminate()
        proc.wait(10)


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("SPANMETER_", "OPENAI_", "OTEL_"))}


def _client(srv: Served, **kw: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{srv.url}/v1", api_key=KEY, **kw)


async def _ask(client: openai.AsyncOpenAI, run: str, text: str = "hi", **kw: Any) -> Any:
    headers = {"X-Run-Id": run, **kw.pop("headers", {})}
    return await client.chat.completions.create(model="sim-small", messages=[{"role": "user", "content": text}],
                                                extra_headers=headers, **kw)


def _ok(results: list[Any]) -> tuple[list[Any], list[openai.APIStatusError]]:
    ok = [r for r in results if not isinstance(r, BaseException)]
    refused = [r for r in results if isinstance(r, openai.APIStatusError) and r.status_code == 402]
    assert len(ok) + len(refused) == len(results), [r for r in results if isinstance(r, BaseException)]
    return ok, refused


async def _run_usd(srv: Served, run: str) -> float:
    async with aiohttp.ClientSession() as s, s.get(f"{srv.url}/admin/spend", params={"tenant": "acme", "run": run},
                                                   headers={"Authorization": f"Bearer {ADMIN}"}) as r:
        assert r.status == 200, await r.text()
        return float((await r.json())["run_usd"])


async def _scrape(srv: Served) -> tuple[str, str]:
    """(the worker that answered, the exposition), on a new connection each time."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s, \
            s.get(f"{srv.url}/metrics") as r:
        assert r.status == 200
        return r.headers["x-spanmeter-worker"], await r.text()


async def _scrape_answered(srv: Served) -> tuple[str, str, float]:
    """A scrape that landed on a worker that answers, and how long that one took: one on the
    stopped worker's socket waits (the kernel picks the socket), so each try gives up after
    3 s and opens a new connection."""
    for _ in range(20):
        started = time.monotonic()
        try:
            worker, text = await asyncio.wait_for(_scrape(srv), 3)
        except TimeoutError:
            continue
        return worker, text, time.monotonic() - started
    raise AssertionError("no worker answered /metrics")


def _series(text: str) -> list[tuple[str, dict[str, str], float]]:
    return [(s.name, s.labels, s.value) for fam in text_string_to_metric_families(text) for s in fam.samples]


def _sum(text: str, name: str, *, ok: bool = False) -> float:
    """The sum of every series of `name`; `ok`: only calls that did not fail or get refused."""
    return sum(v for n, labels, v in _series(text) if n == name and not (ok and labels.get("error_type")))


async def _until(check: Any, what: str, seconds: float = 15.0) -> Any:
    deadline = time.monotonic() + seconds
    while True:
        got = await check()
        if got:
            return got
        assert time.monotonic() < deadline, (what, _LAST)
        await asyncio.sleep(0.1)


async def _ceilings(srv: Served, sim: Any) -> tuple[int, int]:
    """40 parallel calls against a run ceiling of 7 calls, then 40 against a $0.02 run cost
    ceiling. Returns (calls admitted, calls refused)."""
    async with _client(srv, max_retries=0) as client:
        before = len(sim.received)
        ok, refused = _ok(await asyncio.gather(*(_ask(client, "r-calls") for _ in range(40)),
                                               return_exceptions=True))
        assert (len(ok), len(refused)) == (7, 33), "exactly the ceiling, across two workers"
        assert len(sim.received) - before == 7, "a refused call never reaches the upstream"
        assert all("ceiling of 7 model calls" in r.message for r in refused)
        before = len(sim.received)
        cost_ok, cost_refused = _ok(await asyncio.gather(
            *(_ask(client, "r-cost", max_tokens=200, headers={"X-Run-Max-Cost-Usd": "0.02"}) for _ in range(40)),
            return_exceptions=True))
        assert cost_ok and cost_refused
        assert len(sim.received) - before == len(cost_ok)
    spent = await _run_usd(srv, "r-cost")
    assert 0 < spent <= 0.02
    return 7 + len(cost_ok), 33 + len(cost_refused)


async def test_two_workers_share_the_ledger_one_metrics_replace_a_dead_worker_and_drain(sim, serve, prometheus,
                                                                                       tmp_path):
    srv = await serve(sim.url, policy="{runs: {max_llm_calls: 7, max_cost_usd: 1.0}}")
    prom = prometheus(f"127.0.0.1:{srv.port}")
    # The port is taken by this spanmeter's workers: a second one is refused before it says it listens.
    second = subprocess.Popen([sys.executable, "-m", "proxy", "serve", "--port", str(srv.port), "--workers", "2"],
                              cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env={**_clean_env(), "SPANMETER_DATA_DIR": str(tmp_path / "second")})
    try:
        second_out, second_err = await asyncio.to_thread(second.communicate, timeout=30)
    finally:
        if second.poll() is None:  # it started after all: end it, by its PID
            second.kill()
            second.wait()
    assert second.returncode == 2 and "listening" not in second_out, (second_out, second_err)
    assert f"Cannot listen on port {srv.port} on 127.0.0.1: the port is already in use" in second_err

    admitted, refused = await _ceilings(srv, sim)

    # Both workers served (each access line says which).
    await _until(lambda: _async(sum(srv.access_by_worker().values()) == 80), "80 access lines")
    by_worker = srv.access_by_worker()
    assert set(by_worker) == {"1", "2"}, by_worker

    # /metrics is whole whichever worker answers: the 80 calls, of which `admitted` succeeded.
    await _until(lambda: _count_is(srv, 80), "/metrics counting 80 calls")
    answered: set[str] = set()
    for _ in range(40):
        worker, text = await _scrape(srv)
        answered.add(worker)
        assert _sum(text, COUNT) == 80 and _sum(text, COUNT, ok=True) == admitted, worker
        assert _sum(text, REJECTED) == refused, worker
        info = [labels for name, labels, _ in _series(text) if name == "target_info"]
        assert sorted(i["spanmeter_worker"] for i in info) == ["1", "2"]
        assert len({i["service_instance_id"] for i in info}) == 2
        assert _sum(text, "spanmeter_metrics_workers") == 2 and _sum(text, "spanmeter_metrics_workers_missing") == 0
        assert text.count(f"# TYPE {COUNT.removesuffix('_count')} histogram") == 1
        if len(answered) == 2 and _ >= 10:
            break
    assert answered == {"1", "2"}
    # A real Prometheus reads the merged text, whichever worker it lands on.
    found = poll(prom, f"sum({COUNT})", time.monotonic() + 30)
    assert float(found[0]["value"][1]) == 80

    # A worker that does not answer (stopped): a scrape that lands on the other one answers
    # within about a second, counts it missing, and its last scraped counts stand in.
    stopped = srv.status()["workers"][1]["pid"]
    os.kill(stopped, signal.SIGSTOP)
    try:
        worker, text, took = await _scrape_answered(srv)  # the answering scrape alone: not the misses
    finally:
        os.kill(stopped, signal.SIGCONT)
    assert worker == "1" and _sum(text, "spanmeter_metrics_workers_missing") == 1
    assert _sum(text, COUNT) == 80 and took < 5

    # kill -9 one worker: calls keep succeeding, a new worker takes its slot, and no count goes down.
    dead = srv.status()["workers"][0]["pid"]
    os.kill(dead, signal.SIGKILL)
    async with _client(srv) as client:  # the SDK's default retries, as agents run it
        runs = [f"r-after-{i}" for i in range(4)]

        async def five(run: str) -> None:
            for _ in range(5):
                await _ask(client, run)

        await asyncio.gather(*(five(run) for run in runs))
    replaced = await _until(lambda: _async(_replaced(srv, dead)), "a replacement for the killed worker")
    assert replaced["restarts"] == 1
    assert re.search(rf"ERROR spanmeter\.workers worker 1 \(pid {dead}\) was killed by signal 9 \(SIGKILL\)",
                     srv.log())
    await _until(lambda: _count_is(srv, 100), "the dead worker's counts kept")
    worker, text = await _scrape(srv)
    assert _sum(text, COUNT, ok=True) == admitted + 20
    # (The replacement has a target_info series once it has recorded a call: it may have served none yet.)
    assert str(dead) not in {i["process_pid"] for n, i, _ in _series(text) if n == "target_info"}
    poll(prom, f"sum({COUNT}) == 100", time.monotonic() + 30)
    resets = query(prom, f"max(resets({COUNT}[5m]))")
    assert float(resets[0]["value"][1]) == 0, "Prometheus never saw a counter go down"

    # SIGTERM with calls in flight: they complete, their cost is settled, exit code 0.
    async with _client(srv, max_retries=0) as client:
        before = len(sim.received)
        flying = [asyncio.create_task(_ask(client, f"r-drain-{i}", "SCENARIO:stall:1.5")) for i in range(6)]
        await _until(lambda: _async(len(sim.received) - before == 6), "six calls upstream")
        srv.proc.send_signal(signal.SIGTERM)
        answers = await asyncio.gather(*flying)
    assert all(a.choices[0].message.content for a in answers)
    assert await asyncio.to_thread(srv.proc.wait, 60) == 0, srv.log()
    assert "supervisor (pid" in srv.log() and "every worker stopped; exiting" in srv.log()
    ledger = open_store(f"sqlite:///{srv.data / 'ledger.db'}")
    try:
        for i in range(6):
            spend = await ledger.spend_detail("acme", run_id=f"r-drain-{i}")
            assert spend.reserved == 0 and spend.settled > 0, (i, spend)
    finally:
        await ledger.aclose()
    # `spanmeter runs` reads every worker's span files.
    assert {p.name for p in (srv.data / "traces").iterdir()} == {"worker-1", "worker-2"}
    runs_seen = {r.run_id: r for r in load_runs(srv.data / "traces", limit=1000)}
    r_calls = runs_seen["r-calls"]
    assert (r_calls.calls, r_calls.refused, r_calls.failures) == (7, 33, 0)  # the refused apart (issue 24.9)
    assert {f"r-drain-{i}" for i in range(6)} <= set(runs_seen)
    # Lines of two workers sharing stderr never cut into each other.
    assert all(re.match(r"\d{4}-\d\d-\d\dT", line) or line.startswith(" ") for line in srv.log().splitlines())


@pytest.mark.redis
async def test_two_workers_on_redis_keep_ceilings_exact(sim, serve, redis_server):
    with redis.Redis.from_url(redis_server.url) as r:
        r.flushdb()
    srv = await serve(sim.url, policy="{runs: {max_llm_calls: 7, max_cost_usd: 1.0}}", ledger=redis_server.url)
    await _ceilings(srv, sim)
    await _until(lambda: _async(sum(srv.access_by_worker().values()) == 80), "80 access lines")
    assert set(srv.access_by_worker()) == {"1", "2"}
    srv.proc.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(srv.proc.wait, 60) == 0, srv.log()


@pytest.mark.parametrize("leases", [False, True], ids=["exact", "leases"])
async def test_kill_9_of_the_whole_process_group_under_load_keeps_the_ledger(sim, serve, leases):
    srv = await serve(sim.url, policy="{runs: {max_llm_calls: 1000000}}", new_session=True,
                      extra_env={"SPANMETER_LEDGER_LEASES": str(leases).lower()})
    db = srv.data / "ledger.db"
    async with _client(srv, max_retries=0) as client:
        await _ask(client, "r-warm")

        def one_call_cost() -> int:
            row = _read(db, "SELECT settled, reserved FROM ledger WHERE tenant='acme' AND scope='run' AND key='r-warm'")
            return int(row[0]) if row and row[0] and not row[1] else 0

        cost = await _until(lambda: _async(one_call_cost()), "the warm-up call settled")
        answered = Counter[str]()
        stop = asyncio.Event()

        async def quick(i: int) -> None:
            while not stop.is_set():
                await _ask(client, f"r-quick-{i}")
                answered["quick"] += 1

        stalls = [asyncio.create_task(_ask(client, "r-stall", "SCENARIO:stall:60")) for _ in range(12)]
        loops = [asyncio.create_task(quick(i)) for i in range(24)]

        def stalled_upstream() -> int:
            return sum(b"SCENARIO:stall" in r.body for r in sim.received)

        await _until(lambda: _async(stalled_upstream() == 12 and answered["quick"] >= 150), "load")
        settled_before = int(_read(db, "SELECT SUM(settled) FROM ledger WHERE tenant='acme' AND scope='day'")[0])
        quick_before = answered["quick"]
        os.killpg(srv.proc.pid, signal.SIGKILL)  # the supervisor and every worker, at once
        await asyncio.to_thread(srv.proc.wait, 10)
        stop.set()
        for task in [*stalls, *loops]:
            task.cancel()
        await asyncio.gather(*stalls, *loops, return_exceptions=True)

    ledger = open_store(f"sqlite:///{db}")
    try:
        day = await ledger.spend_detail("acme", day=time.strftime("%Y-%m-%d", time.gmtime()))
        assert day.settled >= settled_before, "a settled cost is never lost"
        quick = [await ledger.spend_detail("acme", run_id=f"r-quick-{i}") for i in range(24)]
        assert sum(s.total for s in quick) >= quick_before * cost, "every answered call is charged at least its cost"
        stall = await ledger.spend_detail("acme", run_id="r-stall")
        # Each call that reached the upstream was counted and reserved before it was forwarded,
        # and nothing settled it: its reservation stands, to be charged in full when it expires.
        # A budget lease counts and reserves its calls up front: a crash over-counts by its
        # unused part (one lease a worker at most, here), never under.
        calls = await ledger.run_calls("acme", "r-stall")
        held = _read(db, "SELECT COUNT(*) FROM reservations WHERE run_id='r-stall' AND expired=0")[0]
        assert stall.settled == 0 and stall.reserved >= 12 * cost
        if leases:
            assert 12 <= calls <= 12 + 2 * LEASE_CALLS and 1 <= held <= 12
        else:
            assert (calls, held) == (12, 12)
    finally:
        await ledger.aclose()


async def test_replacements_that_keep_dying_back_off_and_workers_stop_with_their_supervisor(sim, serve):
    srv = await serve(sim.url, policy="{runs: {max_llm_calls: 100}}")
    for round_ in range(2):  # the second replacement dies within 10 s of its start: back-off
        dead = srv.status()["workers"][1]["pid"]
        os.kill(dead, signal.SIGKILL)
        slot = await _until(lambda d=dead: _async(_replaced(srv, d, index=1)), f"replacement {round_ + 1}")
    assert "worker 2 (pid" in srv.log() and re.search(r"after \d+\.\d s; starting a replacement now\n", srv.log())
    assert re.search(r"after \d+\.\d s; starting a replacement in 0\.5 s", srv.log()), srv.log()
    assert slot["restarts"] == 2
    # The supervisor killed alone: its workers get SIGTERM (PR_SET_PDEATHSIG), drain and exit,
    # and the port is free again.
    workers = [w["pid"] for w in srv.status()["workers"]]
    srv.proc.kill()
    await asyncio.to_thread(srv.proc.wait, 10)
    await _until(lambda: _async(not any(_alive(pid) for pid in workers)), "workers gone with their supervisor")
    with socket.socket() as s:
        s.bind(("127.0.0.1", srv.port))


async def test_each_worker_exports_spans_through_its_own_child_process(sim, serve, otlp_receiver):  # noqa: F811
    srv = await serve(sim.url, policy="{runs: {max_llm_calls: 1000}}",
                      extra_env={"SPANMETER_OTLP_ENDPOINT": otlp_receiver.endpoint})
    workers = [w["pid"] for w in srv.status()["workers"]]
    # SPANMETER_EXPORT_PROCESS=auto and spans go over OTLP: one export child per worker.
    children = {pid: export_children(pid) for pid in workers}
    assert all(len(c) == 1 for c in children.values()), children
    async with _client(srv, max_retries=0) as client:
        await asyncio.gather(*(_ask(client, f"r-before-{i}") for i in range(10)))
        # kill -9 of a worker: its export child exits by itself (EOF on its pipe).
        (dead_child,) = children[workers[1]]
        os.kill(workers[1], signal.SIGKILL)
        await _until(lambda: _async(not _alive(dead_child)), "the dead worker's export child exits")
        await _until(lambda: _async(_replaced(srv, workers[1], index=1)), "a replacement worker")
        new = srv.status()["workers"][1]["pid"]
        await _until(lambda: _async(len(export_children(new)) == 1), "the replacement's export child")
        await asyncio.gather(*(_ask(client, f"r-after-{i}") for i in range(20)))
    # A graceful stop flushes every worker's spans through its child before it exits.
    srv.proc.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(srv.proc.wait, 60) == 0
    runs = {s["attributes"].get("spanmeter.run.id") for s in otlp_receiver.spans() if s["kind"] == "SPAN_KIND_CLIENT"}
    assert {f"r-after-{i}" for i in range(20)} <= runs
    assert len({s["resource"][WORKER_ATTRIBUTE] for s in otlp_receiver.spans()}) >= 2  # each worker's own
    assert not any(_alive(pid) for c in children.values() for pid in c)


async def test_a_worker_that_cannot_start_stops_the_supervisor_with_exit_1(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    env = {**_clean_env(), "SPANMETER_DATA_DIR": str(tmp_path / "data"),
           "SPANMETER_LEDGER_URL": f"sqlite:///{blocker}/ledger.db"}
    proc = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "proxy", "serve", "--port", "0",
                                                    "--workers", "2"], cwd=ROOT, env=env, text=True,
                                   capture_output=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert "spanmeter listening on" in proc.stdout
    assert re.search(r"ERROR spanmeter\.workers worker \d \(pid \d+\) exited with code 1 before it was serving; "
                     r"stopping", proc.stderr), proc.stderr


# --- helpers ------------------------------------------------------------------------------------


async def _async(value: Any) -> Any:
    return value


async def _count_is(srv: Served, n: int) -> bool:
    worker, text = await _scrape(srv)
    _LAST[:] = [worker, _sum(text, COUNT)]
    return _sum(text, COUNT) == n


_LAST: list[Any] = []


def _replaced(srv: Served, dead: int, index: int = 0) -> dict[str, Any] | None:
    slot = srv.status()["workers"][index]
    return slot if slot["pid"] not in (None, dead) and slot["ready"] else None


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for init to reap it is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _read(db: Path, sql: str) -> tuple[Any, ...]:
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)) as conn:
        row = conn.execute(sql).fetchone()
    return tuple(row) if row else ()


@pytest.mark.parametrize("ledger", ["sqlite", "redis"])
async def test_two_workers_never_cross_a_token_ceiling_with_calls_in_flight(sim, serve, redis_server, ledger):
    """40 slow streams at once against runs.max_tokens 5,000, spread over two workers: what
    was forwarded (each request's input bound + the max tokens it was allowed) fits in the
    ceiling, since every admitted call was still in flight when the last one was admitted."""
    url = None
    if ledger == "redis":
        with redis.Redis.from_url(redis_server.url) as r:
            r.flushdb()
        url = redis_server.url
    srv = await serve(sim.url, policy="{runs: {max_tokens: 5000}}", ledger=url)
    async with _client(srv, max_retries=0) as client:
        before = len(sim.received)

        async def slow() -> Any:
            stream = await _ask(client, "r-tokens", "SCENARIO:slow:0.4", stream=True, max_tokens=1000)
            return [chunk async for chunk in stream]

        ok, refused = _ok(await asyncio.gather(*(slow() for _ in range(40)), return_exceptions=True))
    forwarded = sim.received[before:]
    assert ok and refused and len(forwarded) == len(ok)
    held = sum(len(r.body) + PROVIDER_OVERHEAD_TOKENS + r.json()["max_tokens"] for r in forwarded)
    assert held <= 5000, [r.json()["max_tokens"] for r in forwarded]
    assert all("tokens" in r.message for r in refused)
    assert set(srv.access_by_worker()) <= {"1", "2"}
