"""The commands the README promises, run as a user runs them: real subprocesses."""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp

from tests.fixtures.redis import free_port

ROOT = Path(__file__).resolve().parents[2]


def _spanmeter(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "proxy", *args], capture_output=True, text=True, timeout=60,
                          cwd=ROOT, env={**os.environ, **(env or {})})


def test_keys_create_prints_a_key_once_and_only_its_hash_for_the_config():
    out = _spanmeter("keys", "create", "--tenant", "acme").stdout
    key = re.search(r"^  (sm-\S+)$", out, re.M).group(1)
    assert f"- {hashlib.sha256(key.encode()).hexdigest()}" in out
    assert "tenants:\n  acme:\n    keys:" in out


async def test_serve_then_curl_then_runs_then_spend(sim, tmp_path):
    key = re.search(r"^  (sm-\S+)$", _spanmeter("keys", "create", "--tenant", "acme").stdout, re.M).group(1)
    cfg = tmp_path / "spanmeter.yaml"
    cfg.write_text(f"tenants:\n  acme:\n    keys: ['{hashlib.sha256(key.encode()).hexdigest()}']\n"
                   "    policy: {budgets: {daily_usd: 5}}\n")
    port = free_port()
    env = {**os.environ, "SPANMETER_PORT": str(port), "SPANMETER_OPENAI_BASE_URL": sim.url,
           "SPANMETER_DATA_DIR": str(tmp_path / "data"), "SPANMETER_CONFIG": str(cfg),
           "SPANMETER_ADMIN_TOKEN": "admin-secret", "OPENAI_API_KEY": "sk-upstream"}
    proc = subprocess.Popen([sys.executable, "-m", "proxy", "serve"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as s:
            for _ in range(200):
                try:
                    async with s.get(f"{url}/healthz") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientConnectionError:
                    await asyncio.sleep(0.05)
            async with s.post(f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}",
                              "X-Run-Id": "cli-run", "X-Run-End": "true"},
                              json={"model": "sim-small", "messages": [{"role": "user", "content": "hi"}]}) as r:
                assert r.status == 200
                assert (await r.json())["choices"][0]["message"]["content"].startswith("Hello!")
        spend = await asyncio.to_thread(_spanmeter, "spend", "--tenant", "acme", "--run", "cli-run", "--url", url,
                                        env={"SPANMETER_ADMIN_TOKEN": "admin-secret"})
        assert '"run_calls": 1' in spend.stdout, spend.stderr
        budget = await asyncio.to_thread(_spanmeter, "budget", "set", "--tenant", "acme", "--daily-usd", "7",
                                         "--url", url, env={"SPANMETER_ADMIN_TOKEN": "admin-secret"})
        assert '"daily_usd": 7' in budget.stdout, budget.stderr
    finally:
        os.kill(proc.pid, signal.SIGTERM)  # graceful: telemetry is flushed to the local span file
        out = proc.communicate(timeout=30)[0].decode()
    assert f"spanmeter listening on http://127.0.0.1:{port}" in out
    runs = _spanmeter("runs", "--data-dir", str(tmp_path / "data")).stdout
    assert "cli-run" in runs and "acme" in runs
    tree = _spanmeter("runs", "cli-run", "--data-dir", str(tmp_path / "data")).stdout
    assert "chat sim-small" in tree
    assert key not in runs + tree + out


def test_demo_runs_offline_and_shows_the_tool_round_trip():
    out = _spanmeter("demo")
    assert out.returncode == 0, out.stderr
    assert "model asked for get_weather" in out.stdout
    assert "execute_tool get_weather" in out.stdout
    assert "repair=output:" in out.stdout
    assert "run demo-run-1 (default, agent demo-agent)" in out.stdout  # the run, ended, as the agent's


def test_invalid_config_exits_2_with_the_field_and_source(tmp_path):
    out = _spanmeter("serve", env={"SPANMETER_READ_TIMEOUT_S": "-1"})
    assert out.returncode == 2
    assert "read_timeout_s (from environment variable SPANMETER_READ_TIMEOUT_S)" in out.stderr
