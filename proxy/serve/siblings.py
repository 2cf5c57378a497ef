"""One `/metrics` for N workers: the answering worker gathers its siblings' and merges.

Each worker of `spanmeter serve --workers N` knows only its share of the counts. The
worker a scrape lands on collects its own exposition and its siblings' (each on its slot's
loopback port, within `SIBLING_TIMEOUT_S`), composes the merge under a lock file, and
serves `tracing.exposition.merge` of it with `spanmeter_metrics_workers` and
`spanmeter_metrics_workers_missing`.
What goes into the merge and why: docs/scale.md, "One `/metrics` for N workers".
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import socket
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import aiohttp
from aiohttp import web

from proxy.serve.appkeys import TEL
from tracing.exposition import merge

__all__ = [
    "GENERATION_HEADER",
    "SIBLING_TIMEOUT_S",
    "WORKER",
    "WORKER_ATTRIBUTE",
    "WORKER_SERIES",
    "Slot",
    "Worker",
    "compose",
    "gather_metrics",
    "reset_state",
    "retire",
    "worker_ctx",
]

log = logging.getLogger("spanmeter.workers")

SIBLING_TIMEOUT_S: Final = 1.0
GENERATION_HEADER: Final = "x-spanmeter-worker-generation"
FETCHED_HEADER: Final = "x-spanmeter-collected-at"
WORKER_SERIES: Final = ("spanmeter_metrics_workers", "spanmeter_metrics_workers_missing")
# On each worker's OTel resource (spans, metrics; `target_info{spanmeter_worker="K"}`): its slot.
WORKER_ATTRIBUTE: Final = "spanmeter.worker"
CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True)
class Worker:
    """What a worker process knows of itself and its siblings."""

    index: int  # 1..count: the slot, the same for a replacement
    count: int
    generation: int  # this process: unique among every worker the supervisor started
    metrics_ports: tuple[int, ...]  # the private /metrics port of each slot (index - 1)
    state_dir: Path
    metrics_sock: socket.socket | None = None  # this slot's private listening socket

    def siblings(self) -> list[tuple[int, int]]:
        return [(i, port) for i, port in enumerate(self.metrics_ports, 1) if i != self.index]


WORKER = web.AppKey("worker", Worker)
_PRIVATE = web.AppKey("main_app", web.Application)
_SESSION = web.AppKey("sibling_session", aiohttp.ClientSession)


@dataclass(frozen=True)
class Slot:
    """One exposition and where it came from."""

    generation: int
    collected_at: float
    text: str


# --- inside a worker ------------------------------------------------------------------------


async def worker_ctx(app: web.Application) -> AsyncIterator[None]:
    """Serves this worker's own metrics on its private port; opens the client that asks
    the siblings for theirs."""
    worker = app[WORKER]
    private = web.Application()
    private[_PRIVATE] = app
    private.router.add_get("/metrics", _own_metrics)
    runner = web.AppRunner(private, access_log=None, handle_signals=False)
    await runner.setup()
    if worker.metrics_sock is not None:
        await web.SockSite(runner, worker.metrics_sock).start()
    app[_SESSION] = session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=SIBLING_TIMEOUT_S),
                                                    cookie_jar=aiohttp.DummyCookieJar())
    yield
    await session.close()
    await runner.cleanup()


async def _own_metrics(request: web.Request) -> web.Response:
    main = request.app[_PRIVATE]
    collected = time.time()
    body = await asyncio.get_running_loop().run_in_executor(None, main[TEL].metrics_text)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE,
                                            GENERATION_HEADER: str(main[WORKER].generation),
                                            FETCHED_HEADER: repr(collected)})


async def _fetch(session: aiohttp.ClientSession, port: int) -> Slot | None:
    try:
        async with session.get(f"http://127.0.0.1:{port}/metrics") as r:
            if r.status != 200:
                return None
            text = await r.text()
            return Slot(int(r.headers[GENERATION_HEADER]), float(r.headers[FETCHED_HEADER]), text)
    except (aiohttp.ClientError, TimeoutError, KeyError, ValueError):
        return None


async def gather_metrics(app: web.Application) -> bytes:
    """The whole exposition: this worker's, its siblings', the retired workers'."""
    worker = app[WORKER]
    loop = asyncio.get_running_loop()
    collected = time.time()
    own = loop.run_in_executor(None, app[TEL].metrics_text)
    siblings = worker.siblings()
    fetched = await asyncio.gather(*(_fetch(app[_SESSION], port) for _, port in siblings))
    mine = Slot(worker.generation, collected, (await own).decode())
    by_slot = {worker.index: mine} | {i: got for (i, _), got in zip(siblings, fetched, strict=True)}
    try:
        text = await loop.run_in_executor(None, compose, worker.state_dir, worker.count, by_slot)
    except OSError as exc:  # the state directory: the scrape still answers, without the kept counts
        log.warning("metrics of stopped or slow workers unavailable (%s): serving the live ones", exc)
        text = merge(s.text for s in by_slot.values() if s) + _own_gauges(
            worker.count, sum(s is None for s in by_slot.values()))
    return text.encode()


# --- the state directory ----------------------------------------------------------------


def _dir(state_dir: Path) -> Path:
    return state_dir / "metrics"


@contextlib.contextmanager
def _locked(state_dir: Path) -> Iterator[Path]:
    d = _dir(state_dir)
    d.mkdir(parents=True, exist_ok=True)
    fd = os.open(d / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield d
    finally:
        os.close(fd)  # releases the lock


def _read_slot(path: Path) -> Slot | None:
    try:
        head, _, text = path.read_text(encoding="utf-8").partition("\n")
    except OSError:
        return None
    fields = dict(part.split("=", 1) for part in head.split()[2:] if "=" in part)
    try:
        return Slot(int(fields["generation"]), float(fields["collected"]), text)
    except (KeyError, ValueError):
        return None


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def _read_retired(d: Path) -> tuple[set[int], str]:
    try:
        head, _, text = (d / "retired.prom").read_text(encoding="utf-8").partition("\n")
    except OSError:
        return set(), ""
    listed = head.partition("generations=")[2].strip()
    return {int(g) for g in listed.split(",") if g.strip().isdigit()}, text


def compose(state_dir: Path, count: int, by_slot: dict[int, Slot | None]) -> str:
    """The merged exposition from what the scrape fetched (None: no answer in time), the
    slot files and the retired counters; updates the slot files. Runs in a thread."""
    texts: list[str] = []
    missing = 0
    with _locked(state_dir) as d:
        retired, retired_text = _read_retired(d)
        for index, live in sorted(by_slot.items()):
            path = d / f"slot-{index}.prom"
            kept = _read_slot(path)
            if kept is not None and kept.generation in retired:
                kept = None
            newer = live is not None and live.generation not in retired and (
                kept is None or kept.generation != live.generation or kept.collected_at <= live.collected_at)
            if live is None:
                missing += 1
            elif newer:
                _write(path, f"# spanmeter-worker slot={index} generation={live.generation} "
                             f"collected={live.collected_at!r}\n{live.text}")
                kept = live
            if kept is not None:
                texts.append(kept.text)
    texts.append(retired_text)
    return merge(texts) + _own_gauges(count, missing)


def _own_gauges(count: int, missing: int) -> str:
    workers, absent = WORKER_SERIES
    return (f"# HELP {workers} Worker processes of this spanmeter (spanmeter serve --workers).\n"
            f"# TYPE {workers} gauge\n{workers} {float(count)}\n"
            f"# HELP {absent} Workers that did not answer this scrape within {SIBLING_TIMEOUT_S:g} s: their "
            f"series are their last scraped values, or absent.\n"
            f"# TYPE {absent} gauge\n{absent} {float(missing)}\n")


# --- in the supervisor --------------------------------------------------------------------


def reset_state(state_dir: Path) -> None:
    """A new supervisor: no slot files, nothing retired."""
    d = _dir(state_dir)
    if d.exists():
        for path in d.iterdir():
            path.unlink(missing_ok=True)
    d.mkdir(parents=True, exist_ok=True)


def retire(state_dir: Path, index: int, generation: int) -> None:
    """Worker `generation` of slot `index` is dead: keep the counters Prometheus last saw
    of it in `retired.prom`, and never take a text of that generation again."""
    with _locked(state_dir) as d:
        retired, text = _read_retired(d)
        path = d / f"slot-{index}.prom"
        kept = _read_slot(path)
        if kept is not None and kept.generation == generation:
            text = merge([text, kept.text], counters_only=True)
            path.unlink(missing_ok=True)
        retired.add(generation)
        _write(d / "retired.prom", f"# spanmeter-retired generations={','.join(map(str, sorted(retired)))}\n{text}")
