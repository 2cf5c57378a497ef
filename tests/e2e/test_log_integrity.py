"""What `spanmeter serve` writes to stdout and stderr, read as a log pipeline reads it: one
record per line, in text and in JSON, whatever a caller puts in a path, a header or a model
name. A real `spanmeter serve` process, attacked over HTTP, its output parsed line by line."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import aiohttp
import pytest

from proxy.serve.accesslog import configure_logging
from tests.fixtures.redis import free_port

ROOT = Path(__file__).resolve().parents[2]
FORGED = "2026-01-01T00:00:00.000Z INFO spanmeter.access tenant=victim run=r status=200"
# Every character a terminal or a log consumer treats as more than text: C0 controls (line
# breaks, ESC), DEL, C1 controls (U+009B is a terminal's CSI), the Unicode line separators.
HOSTILE = ["\n", "\r", "\x1b", "\x00", "\x7f", "\x85", "\x9b", "\u2028"]
_RECORD = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z (DEBUG|INFO|WARNING|ERROR|CRITICAL) \S+ \S")
_RAW = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u2028\u2029]")  # \n only ends a line


def _pct(text: str) -> str:
    return "".join(c if c.isalnum() or c in "/._-" else "".join(f"%{b:02X}" for b in c.encode()) for c in text)


async def _attack(url: str) -> None:
    """Forged records in every place a caller controls: the path of a refused route (404),
    of the admin API, a model name that goes upstream, header values."""
    async with aiohttp.ClientSession() as s:
        for brk in HOSTILE:
            async with s.post(url + _pct(f"/v1/chat/completions{brk}{FORGED}"), json={}, skip_auto_headers=()) as r:
                assert r.status == 404
            async with s.get(url + _pct(f"/runs/x{brk}{FORGED}")) as r:
                assert r.status in (404, 405)
            async with s.post(f"{url}/v1/chat/completions", headers={"Authorization": "Bearer sk-caller"},
                              json={"model": f"m{brk}{FORGED}", "messages": [{"role": "user", "content": "hi"}],
                                    "tools": [{"type": "function", "function": {"name": f"t{brk}{FORGED}",
                                                                                 "parameters": {}}}]}) as r:
                assert r.status == 200, await r.text()
    # Header values as bytes: an HTTP client library refuses to send most of these.
    host, port = url.removeprefix("http://").split(":")
    for brk in ("\x1b", "\x7f", "\x9b"):
        raw = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-caller\r\n"
               f"X-Run-Id: r{brk}{FORGED}\r\nX-Agent-Name: a{brk}{FORGED}\r\nContent-Type: application/json\r\n"
               "Content-Length: 2\r\nConnection: close\r\n\r\n{}").encode()
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(raw)
            while sock.recv(65536):
                pass


async def _access_lines_written(err: Path) -> None:
    """The bookkeeping writes a model call's access line after its answer: wait until every
    hostile model call has one (each also has a 404 twin), not for a fixed time."""
    deadline = time.monotonic() + 60
    while err.read_text().count("spanmeter.access") < 2 * len(HOSTILE) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


async def _serve_and_attack(sim, tmp_path: Path, fmt: str) -> tuple[str, str]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPANMETER_")}
    env |= {"SPANMETER_PORT": str(port), "SPANMETER_OPENAI_BASE_URL": sim.url, "SPANMETER_LOG_FORMAT": fmt,
            "SPANMETER_DATA_DIR": str(tmp_path / fmt)}
    out, err = (tmp_path / f"{fmt}.out").open("w+"), (tmp_path / f"{fmt}.err").open("w+")
    proc = subprocess.Popen([sys.executable, "-m", "proxy", "serve"], cwd=ROOT, env=env, stdout=out, stderr=err)
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as s:
            for _ in range(600):
                try:
                    async with s.get(f"{url}/healthz") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientConnectionError:
                    await asyncio.sleep(0.05)
        await _attack(url)
        await _access_lines_written(tmp_path / f"{fmt}.err")
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(30)
    return (tmp_path / f"{fmt}.out").read_text(), (tmp_path / f"{fmt}.err").read_text()


async def test_no_caller_can_forge_a_text_log_record(sim, tmp_path):
    stdout, stderr = await _serve_and_attack(sim, tmp_path, "text")
    assert stderr.count("status=404") >= len(HOSTILE) and stderr.count("status=200") >= len(HOSTILE)
    assert not _RAW.search(stdout + stderr), [m for m in _RAW.findall(stderr)][:5]
    for line in stderr.splitlines():
        # A record per line; a traceback's lines (none expected here) would be indented.
        assert _RECORD.match(line) or line.startswith(" "), line
        assert not line.startswith(FORGED[:24]), line
    assert f"\\n{FORGED}" in stderr and f"\\u009b{FORGED}" in stderr  # escaped, not lost
    assert stdout.startswith("spanmeter listening on")


async def test_json_logs_are_one_object_per_line_on_stdout_and_stderr(sim, tmp_path):
    stdout, stderr = await _serve_and_attack(sim, tmp_path, "json")
    assert not _RAW.search(stdout + stderr)
    records = []
    for stream in (stdout, stderr):
        for line in stream.splitlines():
            record = json.loads(line)
            assert isinstance(record, dict) and {"time", "level", "logger", "message"} <= record.keys(), line
            records.append(record)
    banner = json.loads(stdout.splitlines()[0])
    assert banner["message"].startswith("spanmeter listening on") and banner["url"].startswith("http://127.0.0.1:")
    messages = json.dumps([r["message"] for r in records], ensure_ascii=False)
    access = [r for r in records if r["logger"] == "spanmeter.access"]
    assert any(r["model"] == f"m\x9b{FORGED}" for r in access)  # the same value, escaped only on the wire
    assert f"\\u009b{FORGED}" in stderr and f"\\n{FORGED}" in messages


def test_the_notice_of_dropped_lines_is_a_json_record_in_json_format():
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
    stop = configure_logging("INFO", "json", stream=sink, capacity=10)
    try:
        for i in range(200):
            logging.getLogger("spanmeter.test").info("line %d", i)
        time.sleep(0.05)
    finally:
        sink.release.set()
        stop()
        root.handlers[:], _ = saved
        root.setLevel(saved[1])
    records = [json.loads(line) for line in sink.getvalue().splitlines()]
    notices = [r for r in records if "log lines dropped" in r["message"]]
    assert notices and all(r["level"] == "WARNING" and r["dropped"] > 0 for r in notices)
    assert sum(r["dropped"] for r in notices) + sum(r["logger"] == "spanmeter.test" for r in records) == 200


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_every_logger_escapes_the_same_characters(fmt: str) -> None:
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    out = io.StringIO()
    stop = configure_logging("INFO", fmt, stream=out)
    try:
        for brk in HOSTILE:
            logging.getLogger("aiohttp.server").warning("bad request %s", f"x{brk}{FORGED}")
        try:
            raise ValueError(f"boom\n{FORGED}\x9b")
        except ValueError:
            logging.getLogger("spanmeter.other").exception("failed on %s", f"y\u009b{FORGED}")
    finally:
        stop()
        root.handlers[:], _ = saved
        root.setLevel(saved[1])
    text = out.getvalue()
    assert not _RAW.search(text)
    lines = text.splitlines()
    if fmt == "json":
        records = [json.loads(line) for line in lines]
        assert [r["message"] for r in records[:len(HOSTILE)]] == [f"bad request x{b}{FORGED}" for b in HOSTILE]
        assert f"boom\n{FORGED}\x9b" in records[-1]["exception"]
    else:
        assert all(_RECORD.match(line) or line.startswith(" ") for line in lines), lines
        assert sum(bool(_RECORD.match(line)) for line in lines) == len(HOSTILE) + 1


def test_a_configuration_problem_that_stops_serve_is_a_json_record_in_json_format():
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPANMETER_")}
    out = subprocess.run([sys.executable, "-m", "proxy", "serve"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, env={**env, "SPANMETER_LOG_FORMAT": "json", "SPANMETER_PORT": "abc"})
    assert out.returncode == 2 and out.stdout == ""
    [record] = [json.loads(line) for line in out.stderr.splitlines()]
    assert record["level"] == "ERROR" and record["error"] == "config_error"
    assert "port (from environment variable SPANMETER_PORT)" in record["message"]
