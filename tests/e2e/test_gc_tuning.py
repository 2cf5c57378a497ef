"""The garbage collector's tuning while serving (SPANMETER_GC_TUNING), and its undoing."""

from __future__ import annotations

import gc
from pathlib import Path

import aiohttp

from proxy.app import GC_GEN0_THRESHOLD, create_app
from proxy.config import Settings
from proxy.ops.demo import serve_on_free_port
from tests.conftest import ProxyFactory


async def test_serving_freezes_start_up_objects_and_collects_the_young_less_often(tmp_path: Path) -> None:
    before = gc.get_threshold()
    assert before[0] != GC_GEN0_THRESHOLD
    runner, url = await serve_on_free_port(create_app(Settings(data_dir=str(tmp_path), port=0).check()))
    try:
        async with aiohttp.ClientSession() as client, client.get(f"{url}/healthz") as resp:
            assert resp.status == 200
        assert gc.get_threshold()[0] == GC_GEN0_THRESHOLD
        assert gc.get_freeze_count() > 10_000  # the SDKs, aiohttp, pydantic: everything imported
    finally:
        await runner.cleanup()
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0


async def test_off_leaves_pythons_defaults(make_proxy: ProxyFactory) -> None:
    before = gc.get_threshold()
    await make_proxy(gc_tuning=False)
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0
