"""Shared fixtures: a running simulator (the outside world) and running proxies.

Everything binds 127.0.0.1 port 0. Nothing of ours is mocked: tests drive the real
SDKs through a real proxy to the simulated model API.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from proxy.app import create_app
from proxy.config import Settings
from proxy.ops.demo import serve_on_free_port
from proxy.serve.appkeys import BACKGROUND
from proxy.simulator import RECEIVED, STREAMS, Received, create_simulator
from tests.fixtures.ledgers import ledger  # noqa: F401  (once per ledger backend)
from tests.fixtures.redis import redis_server  # noqa: F401  (session fixture)
from tests.fixtures.redis_cluster import redis_cluster  # noqa: F401  (session fixture)


@pytest.fixture(autouse=True)
def clean_environ() -> Iterator[None]:
    """Keeps os.environ clean for every test without mocking it."""
    saved = dict(os.environ)
    for k in list(os.environ):
        if k.startswith(("SPANMETER_", "OTEL_", "OPENAI_", "ANTHROPIC_", "GEMINI_", "GOOGLE_")):
            del os.environ[k]
    yield
    os.environ.clear()
    os.environ.update(saved)


@dataclass
class Sim:
    url: str
    app: web.Application

    @property
    def received(self) -> list[Received]:
        return list(self.app[RECEIVED])

    @property
    def last(self) -> Received:
        return self.app[RECEIVED][-1]

    @property
    def streams(self) -> dict[str, str]:
        return self.app[STREAMS]


@dataclass
class Proxy:
    url: str
    app: web.Application
    data_dir: Path

    async def settled(self) -> None:
        """Wait for the bookkeeping (ledger, spans) of every answer already delivered."""
        await self.app[BACKGROUND].drain()


@pytest.fixture
async def sim() -> AsyncIterator[Sim]:
    app = create_simulator()
    runner, url = await serve_on_free_port(app)
    yield Sim(url, app)
    await runner.cleanup()


ProxyFactory = Callable[..., Awaitable[Proxy]]


@pytest.fixture
async def make_proxy(sim: Sim, tmp_path: Path) -> AsyncIterator[ProxyFactory]:
    runners: list[web.AppRunner] = []

    async def make(inject: dict[str, Any] | None = None, **overrides: Any) -> Proxy:
        data = tmp_path / f"proxy{len(runners)}"
        fields: dict[str, Any] = {"openai_base_url": sim.url, "anthropic_base_url": sim.url,
                                  "gemini_base_url": sim.url, "data_dir": str(data), "port": 0}
        settings = Settings(**{**fields, **overrides}).check()
        app = create_app(settings, **(inject or {}))
        runner, url = await serve_on_free_port(app)
        runners.append(runner)
        return Proxy(url, app, data)

    yield make
    # Last in, first out: each app restores the process state it found (gc thresholds).
    for r in reversed(runners):
        await r.cleanup()


@pytest.fixture
async def proxy(make_proxy: ProxyFactory) -> Proxy:
    return await make_proxy()


@pytest.fixture
def monkeypatch_env() -> Callable[[str, str], None]:
    """Set a real environment variable for this test; clean_environ restores the rest."""

    def set_(name: str, value: str) -> None:
        os.environ[name] = value

    return set_
