"""Run a ledger child (ledger_child.py, lease_child.py) under load and kill -9 it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def killed_after(child: str, args: list[str], settles: int) -> list[bytes]:
    """Run `child` (a script beside this file) with `args` until it has printed `settles`
    "settled" lines, kill -9 it, and return every line it printed (those acknowledged before
    the kill included)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name(child)), *args],
                            stdout=subprocess.PIPE, env=env, cwd=ROOT)
    assert proc.stdout is not None
    lines: list[bytes] = []
    while sum(line.startswith(b"settled") for line in lines) < settles:
        line = proc.stdout.readline()
        assert line, f"the child died early with {proc.wait()}"
        lines.append(line)
    os.kill(proc.pid, signal.SIGKILL)
    lines += proc.stdout.read().splitlines()
    proc.wait()
    return lines
