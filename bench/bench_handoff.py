"""What handing work to another thread and back costs, beside doing it in place.

The ledger's writer thread (proxy/ledger/sqlite.py) takes every operation from the event
loop through a queue and hands the result back. At one connection nothing batches those
hand-offs, so their cost is paid per call. This measures, per round trip, in microseconds
of the process's CPU and of wall time:

    empty        a SimpleQueue ping-pong with a thread that does nothing else
    sqlite here  a small write transaction (BEGIN IMMEDIATE, two upserts, an insert, a
                 read, COMMIT; WAL, synchronous=NORMAL) run by the calling thread
    sqlite there the same transaction run by the other thread, through the ping-pong

    .venv/bin/python bench/bench_handoff.py [--n 5000]
    taskset -c 0 .venv/bin/python bench/bench_handoff.py   # both threads on one core

Two threads on two cores pay for waking an idle core on every hand-off; on one core they
pay a context switch. `bench/run.py` pins the proxy, all its threads, to one core.
"""

from __future__ import annotations

import argparse
import os
import queue
import sqlite3
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path


def _connect(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    conn.execute("CREATE TABLE IF NOT EXISTS spend (k TEXT PRIMARY KEY, v INTEGER) WITHOUT ROWID")
    conn.execute("CREATE TABLE IF NOT EXISTS held (id TEXT PRIMARY KEY, amount INTEGER)")
    return conn


def _transaction(conn: sqlite3.Connection) -> Callable[[int], None]:
    def run(i: int) -> None:
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("INSERT INTO spend VALUES (?, 1) ON CONFLICT DO UPDATE SET v = v + 1", (f"run-{i % 10}",))
        conn.execute("INSERT INTO spend VALUES ('day', 1) ON CONFLICT DO UPDATE SET v = v + 1")
        conn.execute("INSERT INTO held VALUES (?, 1)", (os.urandom(8).hex(),))
        conn.execute("SELECT v FROM spend WHERE k = 'day'").fetchone()
        conn.execute("COMMIT")
    return run


def _in_place(work: Callable[[int], None], n: int) -> tuple[float, float]:
    cpu, wall = time.process_time(), time.perf_counter()
    for i in range(n):
        work(i)
    return (time.process_time() - cpu) / n * 1e6, (time.perf_counter() - wall) / n * 1e6


def _handed_off(work: Callable[[int], None], n: int) -> tuple[float, float]:
    there: queue.SimpleQueue[int | None] = queue.SimpleQueue()
    back: queue.SimpleQueue[int] = queue.SimpleQueue()

    def serve() -> None:
        while (i := there.get()) is not None:
            work(i)
            back.put(i)

    thread = threading.Thread(target=serve)
    thread.start()
    cpu, wall = time.process_time(), time.perf_counter()
    for i in range(n):
        there.put(i)
        back.get()
    result = (time.process_time() - cpu) / n * 1e6, (time.perf_counter() - wall) / n * 1e6
    there.put(None)
    thread.join()
    return result


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=5000)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-handoff-") as tmp:
        conn = _connect(Path(tmp) / "ledger.db")
        tx = _transaction(conn)
        _in_place(tx, 500)  # warm: pages, statement cache
        rows = [("empty", _handed_off(lambda i: None, args.n)),
                ("sqlite here", _in_place(tx, args.n)),
                ("sqlite there", _handed_off(tx, args.n))]
        conn.close()
    cpus = sorted(os.sched_getaffinity(0))
    print(f"per round trip, us (CPUs {cpus}, {args.n} each)\n\n| | process CPU | wall |\n|---|---|---|")
    for name, (cpu, wall) in rows:
        print(f"| {name} | {cpu:.1f} | {wall:.1f} |")


if __name__ == "__main__":
    main()
