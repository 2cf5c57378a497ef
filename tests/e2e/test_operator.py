"""The operator's side: what `spanmeter serve` refuses to start with, `check-config`, the
access log (text and JSON), runs of one call, and how soon `spanmeter runs` sees a call.

Start-up checks run the real entry point as subprocesses, started together so the group
costs about one process start."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from proxy.config import hash_key
from proxy.serve.accesslog import configure_logging
from tests.fixtures.redis import free_port
from tracing.local import read_spans
from tracing.viewer import load_runs

ROOT = Path(__file__).resolve().parents[2]
KEY = "sm-acme-operator-key-0001"


def _start(args: list[str], env: dict[str, str], cwd: Path = ROOT) -> subprocess.Popen[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SPANMETER_", "OPENAI_", "ANTHROPIC_",
                                                                        "GEMINI_"))}
    return subprocess.Popen([sys.executable, "-m", "proxy", *args], cwd=cwd, env={**clean, **env}, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _finish(proc: subprocess.Popen[str], hang_s: float = 600.0) -> tuple[int, str, str]:
    """Its exit code and output, once it exits. What tells a refusal from a start is what the
    process says, not how soon it exits: several interpreters importing at once on a loaded
    machine took more than 30 s each. One that says it is listening has started: it is
    stopped and fails at once. `hang_s` only guards against a process that does neither."""
    deadline = time.monotonic() + hang_s
    while True:
        try:
            out, err = proc.communicate(timeout=0.5)
            return proc.returncode, out, err
        except subprocess.TimeoutExpired as exc:
            said = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout or ""
            if "spanmeter listening on" in said or time.monotonic() > deadline:
                proc.kill()
                out, err = proc.communicate()
                raise AssertionError(f"spanmeter did not exit: it started?\n{out}\n{err}") from None


def test_serve_refuses_what_it_cannot_honour_with_exit_2_and_one_paragraph(tmp_path: Path):
    (tmp_path / "empty.yaml").write_text("# nothing but a comment\n\n")
    (tmp_path / "broken.yaml").write_text("tenants:\n  acme:\n    keys: [abc\n")
    (tmp_path / "indent.yaml").write_text("host: 127.0.0.1\n  port: 9\n")
    (tmp_path / "tenants.yaml").write_text(
        f"tenants:\n  acme:\n    keys: ['{hash_key(KEY)}']\n  beta:\n    keys: []\n"
        "    upstream_keys: {openai: BETA_OPENAI_KEY}\n"
        "upstreams:\n  local: {dialect: openai, base_url: 'http://127.0.0.1:1', key_env: LOCAL_KEY}\n")
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    busy_port = busy.getsockname()[1]
    data = str(tmp_path / "data")
    cases = {
        "missing": (["serve"], {"SPANMETER_CONFIG": "nope.yaml"}),
        "empty": (["serve", "--config", str(tmp_path / "empty.yaml")], {}),
        "broken": (["serve"], {"SPANMETER_CONFIG": str(tmp_path / "broken.yaml")}),
        "indent": (["serve"], {"SPANMETER_CONFIG": str(tmp_path / "indent.yaml")}),
        "keys": (["serve"], {"SPANMETER_CONFIG": str(tmp_path / "tenants.yaml"), "OPENAI_API_KEY": "sk-x",
                             "GEMINI_API_KEY": ""}),
        "port": (["serve", "--port", str(busy_port)], {"SPANMETER_DATA_DIR": data}),
        "port, workers": (["serve", "--port", str(busy_port), "--workers", "2"], {}),
        "workers in memory": (["serve", "--workers", "2"], {"SPANMETER_LEDGER_URL": "sqlite:///:memory:",
                                                               "SPANMETER_PORT": "0"}),
        "workers, data_dir": (["serve", "--workers", "2", "--port", "0"],
                              {"SPANMETER_DATA_DIR": str(tmp_path / "empty.yaml" / "data")}),
    }
    try:
        procs = {name: _start(args, {"SPANMETER_DATA_DIR": data, **env}) for name, (args, env) in cases.items()}
        done = {name: _finish(p) for name, p in procs.items()}
    finally:
        busy.close()
    for name, (code, out, err) in done.items():
        assert code == 2, (name, out, err)
        assert "Traceback" not in err and "listening" not in out, (name, out, err)
        assert len(err.strip().splitlines()) == 1, (name, err)  # one paragraph
    assert ("The config file 'nope.yaml' (" + str(ROOT / "nope.yaml") + ") named by SPANMETER_CONFIG (or --config) "
            "does not exist. spanmeter will not fall back to open mode") in done["missing"][2]
    assert "empty.yaml' is empty (no settings, only comments or blank lines)" in done["empty"][2]
    broken = done["broken"][2]
    assert "broken.yaml' is not valid YAML: at line 4, column 1: expected ',' or ']', but got '<stream end>'" in broken
    assert "while parsing a flow sequence that starts at line 3, column 11" in broken
    assert ("indent.yaml' is not valid YAML: at line 2, column 7: mapping values are not allowed here "
            "(the line reads `  port: 9`)") in done["indent"][2]
    keys = done["keys"][2]
    assert keys.startswith("Refusing to start: in tenant mode spanmeter injects the upstream keys itself")
    # The built-in ANTHROPIC_API_KEY is not named by this config: a warning at start, not a refusal.
    assert "ANTHROPIC_API_KEY" not in keys
    assert "BETA_OPENAI_KEY (openai API of tenant beta)" in keys
    assert "LOCAL_KEY (upstream local, openai API, for any tenant)" in keys
    assert "OPENAI_API_KEY (" not in keys and "GEMINI_API_KEY" not in keys  # set (GEMINI's to empty): fine
    assert done["port"][2].startswith(f"Cannot listen on port {busy_port} on 127.0.0.1: the port is already in use")
    assert done["port, workers"][2] == done["port"][2]
    assert done["workers in memory"][2].startswith("Refusing to start ") and "workers on the in-memory ledger" in (
        done["workers in memory"][2])
    assert done["workers, data_dir"][2].startswith("Cannot write the workers' state directory ")


def test_check_config_prints_what_would_run_and_exits_2_when_serve_would_refuse(tmp_path: Path):
    cfg = tmp_path / "spanmeter.yaml"
    cfg.write_text(f"host: 0.0.0.0\nupstream_keys: {{openai: OPENAI_API_KEY}}\nadmin_token: secret-admin\n"
                   f"tenants:\n  acme:\n    keys: ['{hash_key(KEY)}']\n"
                   "    policy: {runs: {max_llm_calls: 50, max_cost_usd: 2.5}, budgets: {daily_usd: 20}}\n"
                   "  beta:\n    keys: []\n    upstream_keys: {openai: BETA_KEY}\n")
    ledger = "redis://:hunter2@redis.internal:6379/0"
    ok = _start(["check-config", "--config", str(cfg)], {"OPENAI_API_KEY": "sk-upstream-secret", "BETA_KEY": "",
                                                          "SPANMETER_LEDGER_URL": ledger, "SPANMETER_WORKERS": "3"})
    refused = _start(["check-config", "--config", str(cfg)], {"SPANMETER_LEDGER_URL": ledger})
    code, out, err = _finish(ok)
    assert code == 0, err
    assert "listen        http://0.0.0.0:8787, 3 worker processes (a supervisor restarts any that dies)" in out
    assert "mode          tenants: acme, beta" in out
    assert "ledger        redis://:***@redis.internal:6379/0 (fail closed" in out
    assert "admin API     on" in out
    rows = {tuple(line.split()[:3]): line.split()[3:] for line in out.splitlines() if line.startswith("  (")}
    assert rows[("(default)", "openai", "https://api.openai.com")] == ["OPENAI_API_KEY", "set"]
    assert rows[("(default)", "anthropic", "https://api.anthropic.com")] == ["none", "(no", "key", "sent)"]
    assert rows[("(tenant", "beta)", "openai")][1:] == ["BETA_KEY", "set,", "empty", "(no", "key", "sent)"]
    acme = next(line for line in out.splitlines() if line.strip().startswith("acme "))
    assert acme.split()[:7] == ["acme", "1", "-", "50", "$2.50", "$20.00", "none"]
    assert out.rstrip().endswith("spanmeter serve would start with this configuration.")
    assert "sk-upstream-secret" not in out and "hunter2" not in out and "secret-admin" not in out
    code, out, err = _finish(refused)
    assert code == 2 and "NOT SET" in out
    assert "BETA_KEY (openai API of tenant beta); OPENAI_API_KEY (openai API of tenant acme)" in err
    assert "Traceback" not in err


# --- the access log -------------------------------------------------------------------------


@pytest.fixture
def json_log():
    """The process's real logging set-up in JSON, into a buffer; restored afterwards."""
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    buffer = io.StringIO()
    stop = configure_logging("INFO", "json", stream=buffer)

    def lines() -> list[dict]:
        stop()  # flushes the writer thread
        return [json.loads(line) for line in buffer.getvalue().splitlines()]

    yield lines
    stop()
    root.handlers[:], _ = saved
    root.setLevel(saved[1])


async def test_access_lines_in_json_one_per_call_refusal_and_failure(json_log, make_proxy, sim, monkeypatch_env):
    monkeypatch_env("OPENAI_API_KEY", "sk-upstream-secret-777")
    proxy = await make_proxy(
        tenants={"acme": {"keys": [hash_key(KEY)], "policy": {"runs": {"max_llm_calls": 1}}}},
        upstreams={"dead": {"dialect": "openai", "base_url": f"http://127.0.0.1:{free_port()}"}})
    async with openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key=KEY, max_retries=0,
                                  default_headers={"X-Run-Id": "r-log"}) as client:
        await client.chat.completions.create(model="sim-small", messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(openai.APIStatusError):
            await client.chat.completions.create(model="sim-small", messages=[{"role": "user", "content": "hi"}])
    async with openai.AsyncOpenAI(base_url=f"{proxy.url}/upstreams/dead/v1", api_key=KEY, max_retries=0,
                                  default_headers={"X-Run-Id": "r-dead"}) as client:
        with pytest.raises(openai.APIStatusError) as ei:
            await client.chat.completions.create(model="sim-small", messages=[{"role": "user", "content": "hi"}])
    assert ei.value.status_code == 502
    async with aiohttp.ClientSession() as s, s.post(f"{proxy.url}/v1/chat/completions", data=b"{not json",
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert r.status == 400
    await proxy.settled()
    records = json_log()
    access = [r for r in records if r["logger"] == "spanmeter.access"]
    assert len(access) == 4, access  # one per call, the 502 included once
    by_status = {r["status"]: r for r in access}
    ok, refused, dead, bad = (by_status[s] for s in (200, 402, 502, 400))
    assert ok["level"] == "INFO" and ok["tenant"] == "acme" and ok["run_id"] == "r-log" and ok["api"] == "chat"
    assert ok["model"] == "sim-small" and ok["status"] == ok["upstream_status"] == 200
    assert ok["input_tokens"] > 0 and ok["output_tokens"] > 0 and ok["cost_usd"] > 0 and ok["duration_s"] >= 0
    assert ok["rewrites"] == [] and ok["refusal"] is None and ok["error"] is None
    assert refused["status"] == 402 and refused["upstream_status"] is None and refused["refusal"] == "run_calls"
    assert refused["reason"].startswith("Run r-log of tenant acme reached its ceiling of 1 model call ")
    assert dead["level"] == "ERROR" and dead["status"] == 502 and dead["upstream_status"] is None
    assert dead["error"] == "spanmeter.upstream_unreachable" and "could not connect" in dead["reason"]
    # The key was checked before the body was read: the line names the caller (issue 24.8).
    assert bad["status"] == 400 and bad["tenant"] == "acme" and bad["error"] == "spanmeter.malformed_body"
    assert all(r["time"].endswith("Z") and r["message"] for r in records)
    everything = json.dumps(records)
    assert "sk-upstream-secret-777" not in everything and KEY not in everything and "hi" not in [
        r.get("reason") for r in access]


async def test_a_hostile_model_name_cannot_forge_a_log_line(proxy):
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    buffer = io.StringIO()
    stop = configure_logging("INFO", "text", stream=buffer)
    try:
        async with aiohttp.ClientSession() as s, s.post(
                f"{proxy.url}/v1/chat/completions", headers={"Authorization": "Bearer sk-caller-secret"},
                json={"model": "m\n2026-01-01T00:00:00.000Z INFO spanmeter.access tenant=root",
                      "messages": [{"role": "user", "content": "a secret prompt"}]}) as r:
            assert r.status == 200
        await proxy.settled()
    finally:
        stop()
        root.handlers[:], _ = saved
        root.setLevel(saved[1])
    [line] = [line for line in buffer.getvalue().splitlines() if "spanmeter.access" in line]
    assert 'model="m\\n2026-01-01T00:00:00.000Z INFO spanmeter.access tenant=root"' in line
    assert "sk-caller-secret" not in buffer.getvalue() and "a secret prompt" not in buffer.getvalue()


def test_a_log_sink_that_stops_reading_never_blocks_the_caller():
    class Stuck(io.StringIO):
        def __init__(self) -> None:
            super().__init__()
            self.release = threading.Event()

        def write(self, s: str) -> int:
            self.release.wait(10)
            return super().write(s)

    root = logging.getLogger()
    saved = root.handlers[:], root.level
    sink = Stuck()
    stop = configure_logging("INFO", "text", stream=sink, capacity=100)
    try:
        started = time.perf_counter()
        for i in range(5_000):
            logging.getLogger("spanmeter.test").info("line %d", i)
        assert time.perf_counter() - started < 2.0, "logging waited for a sink that does not read"
    finally:
        sink.release.set()
        stop()
        root.handlers[:], _ = saved
        root.setLevel(saved[1])
    text = sink.getvalue()
    assert "line 0" in text
    dropped = sum(int(m) for m in re.findall(r"WARNING spanmeter.log (\d+) log lines dropped", text))
    written = text.count("spanmeter.test line")
    assert dropped > 4_000 and written < 300 and dropped + written >= 4_990  # counted, not lost silently


# --- runs -----------------------------------------------------------------------------------


async def test_a_call_without_a_run_id_is_a_run_that_ends_with_it_and_runs_shows_it_at_once(proxy):
    async with openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="sk-caller") as client:
        raw = await client.chat.completions.with_raw_response.create(
            model="sim-small", messages=[{"role": "user", "content": "hi"}])
    run_id = raw.headers["x-spanmeter-run-id"]
    await proxy.settled()  # the bookkeeping: no flush of the exporters
    traces = proxy.data_dir / "traces"
    deadline = time.monotonic() + 0.9  # written within 0.1 s (the usual schedule is 1 s); room for a busy machine
    while time.monotonic() < deadline and not any(_is_run(s) for s in read_spans(traces)):
        await asyncio.sleep(0.02)
    [run] = load_runs(traces)
    assert (run.run_id, run.calls, run.status) == (run_id, 1, "ended")
    root = next(s for s in read_spans(traces) if _is_run(s))
    assert root["attributes"]["spanmeter.run.id_source"] == "generated"
    assert root["attributes"]["spanmeter.run.model_calls"] == 1


def _is_run(span: dict) -> bool:
    return bool(span["attributes"].get("gen_ai.operation.name") == "invoke_agent")


def test_a_workers_log_lines_say_which_worker_and_are_written_in_whole_lines_of_at_most_pipe_buf():
    class Writes(io.StringIO):
        def __init__(self) -> None:
            super().__init__()
            self.writes: list[str] = []

        def write(self, s: str) -> int:
            self.writes.append(s)
            return super().write(s)

    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        for fmt in ("text", "json"):
            sink = Writes()
            stop = configure_logging("INFO", fmt, stream=sink, worker=2)
            for i in range(400):
                logging.getLogger("spanmeter.test").info("line %d %s", i, "é" * (i % 7) * 40)
            stop()
            lines = sink.getvalue().splitlines()
            assert len(lines) == 400
            if fmt == "text":
                assert all(line.endswith(" worker=2") for line in lines)
            else:
                assert all(json.loads(line)["worker"] == 2 for line in lines)
            # Each write is whole lines and at most 4096 bytes: lines of two workers sharing a
            # pipe never cut into each other.
            assert all(w.endswith("\n") and len(w.encode()) <= 4096 for w in sink.writes)
            assert len(sink.writes) > 1
    finally:
        root.handlers[:], _ = saved
        root.setLevel(saved[1])


async def test_the_printed_key_snippet_is_a_whole_config_that_starts_with_one_provider_key(tmp_path: Path,
                                                                                            make_proxy: Any):
    """`spanmeter keys create`'s snippet, used as the whole config, with only OPENAI_API_KEY
    set: check-config says serve would start (warning about the others); a call to an API
    whose key is unset gets an error in that SDK's shape naming the variable."""
    import anthropic

    code, out, err = _finish(_start(["keys", "create", "--tenant", "acme"], {}))
    assert code == 0, err
    snippet = out[out.index("tenants:"):]
    key = re.search(r"^  (sm-\S+)$", out, re.M).group(1)
    cfg = tmp_path / "spanmeter.yaml"
    cfg.write_text(snippet)
    code, out, err = _finish(_start(["check-config", "--config", str(cfg)], {"OPENAI_API_KEY": "sk-x"}))
    assert code == 0, err
    assert "warning: ANTHROPIC_API_KEY is not set: calls to the anthropic API of tenant acme" in out
    assert out.rstrip().endswith("spanmeter serve would start with this configuration.")

    os.environ.pop("ANTHROPIC_API_KEY", None)
    proxy = await make_proxy(tenants={"acme": {"keys": [hash_key(key)]}})
    client = anthropic.AsyncAnthropic(base_url=proxy.url, api_key=key, max_retries=0)
    with pytest.raises(anthropic.APIStatusError) as caught:
        await client.messages.create(model="claude-sonnet-4-6", max_tokens=10,
                                     messages=[{"role": "user", "content": "hi"}])
    assert caught.value.status_code == 500
    assert "ANTHROPIC_API_KEY, which is not set in the proxy's environment" in caught.value.message
