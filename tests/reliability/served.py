"""`spanmeter serve` as a real subprocess, for the faults only a process can have:
kill -9, a full disk (RLIMIT_FSIZE), a restart on the same ledger."""

from __future__ import annotations

import asyncio
import os
import resource
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import aiohttp

from tests.fixtures.redis import free_port

__all__ = ["Served", "serve"]


class Served:
    def __init__(self, proc: asyncio.subprocess.Process, url: str) -> None:
        self.proc, self.url = proc, url

    async def kill(self) -> None:
        if self.proc.returncode is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            await self.proc.wait()

    async def stderr(self) -> str:
        assert self.proc.stderr is not None
        return (await self.proc.stderr.read()).decode(errors="replace")


def _fsize_limit(max_bytes: int) -> Callable[[], None]:
    def apply() -> None:
        # Python ignores SIGXFSZ, so a write past the limit fails with EFBIG ("disk full")
        # instead of killing the process.
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_bytes, max_bytes))

    return apply


async def serve(data_dir: Path, upstream: str, *, max_file_bytes: int | None = None,
                env: dict[str, str] | None = None) -> Served:
    port = free_port()
    full_env = {**os.environ, "SPANMETER_DATA_DIR": str(data_dir), "SPANMETER_PORT": str(port),
                "SPANMETER_OPENAI_BASE_URL": upstream, "SPANMETER_ANTHROPIC_BASE_URL": upstream,
                "SPANMETER_GEMINI_BASE_URL": upstream, **(env or {})}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy", "serve", env=full_env, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        preexec_fn=_fsize_limit(max_file_bytes) if max_file_bytes else None)
    served = Served(proc, f"http://127.0.0.1:{port}")
    async with aiohttp.ClientSession() as s:
        for _ in range(500):
            if proc.returncode is not None:
                raise RuntimeError(f"spanmeter serve exited with {proc.returncode}: {await served.stderr()}")
            try:
                async with s.get(served.url + "/healthz") as r:
                    if r.status == 200:
                        return served
            except aiohttp.ClientConnectionError:
                await asyncio.sleep(0.02)
    await served.kill()
    raise RuntimeError("spanmeter serve did not answer /healthz within 10 s")
