"""A real Arize Phoenix reads spanmeter's spans (`make test-integrations`; marker `phoenix`).

Phoenix runs as a subprocess from its own virtualenv: `PHOENIX_BIN` names its `phoenix`
executable (else `.venv-phoenix/bin/phoenix` in the repository, else `phoenix` on PATH);
without one the test is skipped. A running proxy exports the spans of an agent loop with a
tool to Phoenix's OTLP/HTTP endpoint, and the test reads them back through Phoenix's REST
API: the run is an AGENT span, the model calls LLM spans with their tokens, the tool a
TOOL span with its summaries, all in one trace, and the conversation a Phoenix session.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from proxy.serve.appkeys import RUNS, TEL
from tests.e2e.test_agent_traces import HEADERS, chat_loop

ROOT = Path(__file__).resolve().parents[2]


def phoenix_bin() -> str | None:
    found = Path(os.environ.get("PHOENIX_BIN") or ROOT / ".venv-phoenix" / "bin" / "phoenix")
    return str(found.resolve()) if found.is_file() else shutil.which("phoenix")


PHOENIX = phoenix_bin()
pytestmark = [pytest.mark.phoenix,
              pytest.mark.skipif(PHOENIX is None, reason="Arize Phoenix is not installed (make test-integrations)")]
PROJECT = "spanmeter-it"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def phoenix(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    work = tmp_path_factory.mktemp("phoenix")
    port = _free_port()
    # Its own environment: no OTEL_* of ours, ports of its own (gRPC OTLP included), no pixels.
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(work), "PHOENIX_HOST": "127.0.0.1",
           "PHOENIX_PORT": str(port), "PHOENIX_GRPC_PORT": str(_free_port()), "PHOENIX_WORKING_DIR": str(work),
           "PHOENIX_TELEMETRY_ENABLED": "false"}
    log = (work / "phoenix.log").open("wb")
    assert PHOENIX is not None
    proc = subprocess.Popen([PHOENIX, "serve"], env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while not _healthy(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail("Phoenix did not start:\n" + (work / "phoenix.log").read_text()[-3000:])
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()


def _healthy(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"{url}/healthz", timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


async def _get(session: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    async with session.get(url) as r:
        return r.status, (await r.json() if r.content_type == "application/json" else await r.text())


async def _spans(phoenix: str, n: int, timeout: float = 60) -> list[dict[str, Any]]:
    """The project's spans once Phoenix has stored `n` (it inserts them in the background)."""
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while True:
            status, body = await _get(s, f"{phoenix}/v1/projects/{PROJECT}/spans?limit=100")
            data = body.get("data", []) if status == 200 and isinstance(body, dict) else []
            if len(data) >= n or time.monotonic() > deadline:
                return list(data)
            await asyncio.sleep(0.5)


async def test_phoenix_reads_a_run_as_an_agent_with_llm_and_tool_spans(phoenix, make_proxy, monkeypatch_env):
    monkeypatch_env("SPANMETER_PROJECT_NAME", PROJECT)
    proxy = await make_proxy(otlp_endpoint=phoenix)
    await chat_loop(proxy.url)
    await proxy.settled()
    assert await proxy.app[RUNS].end("default", HEADERS["X-Run-Id"])
    assert await asyncio.to_thread(proxy.app[TEL].force_flush)
    spans = await _spans(phoenix, 4)
    assert len(spans) == 4, [s["name"] for s in spans]
    kinds = sorted(s["span_kind"] for s in spans)
    assert kinds == ["AGENT", "LLM", "LLM", "TOOL"]
    assert len({s["context"]["trace_id"] for s in spans}) == 1  # one trace

    (agent,) = [s for s in spans if s["span_kind"] == "AGENT"]
    assert agent["parent_id"] is None and agent["name"] == "invoke_agent weather-bot"
    assert agent["attributes"]["input.value"] == "run trip-1 (agent weather-bot, conversation conv-42)"
    assert agent["attributes"]["output.value"].startswith("ended: 2 model calls, 1 tool call, ")

    llms = sorted((s for s in spans if s["span_kind"] == "LLM"), key=lambda s: s["start_time"])
    for llm in llms:
        a = llm["attributes"]
        assert llm["parent_id"] == agent["context"]["span_id"]
        assert a["llm.model_name"] == "sim-small" and a["llm.provider"] == "openai"
        assert a["llm.token_count.prompt"] > 0 and a["llm.token_count.completion"] > 0
        assert "get_weather" in a["llm.tools.0.tool.json_schema"]  # from gen_ai.tool.definitions
        assert a["session.id"] == "conv-42"
    assert llms[0]["attributes"]["output.value"] == "tool call get_weather(Paris)"

    (tool,) = [s for s in spans if s["span_kind"] == "TOOL"]
    t = tool["attributes"]
    assert t["tool.name"] == "get_weather" and t["tool.description"] == "Current weather in a city"
    assert t["input.value"] == "Paris" and t["output.value"] == "✓ {temp_c, conditions}"

    async with aiohttp.ClientSession() as s:
        status, body = await _get(s, f"{phoenix}/v1/sessions/conv-42")
        assert status == 200, body
        session = body["data"]
        assert session["session_id"] == "conv-42" and len(session["traces"]) == 1
        status, body = await _get(s, f"{phoenix}/v1/projects/{PROJECT}/sessions")
        assert status == 200 and [x["session_id"] for x in body["data"]] == ["conv-42"]
    # The agent span carries the run's totals (gen_ai.usage.*), and Phoenix rolls up LLM
    # spans only: the session counts each token once.
    prompt = sum(x["attributes"]["llm.token_count.prompt"] for x in llms)
    completion = sum(x["attributes"]["llm.token_count.completion"] for x in llms)
    assert (agent["attributes"]["gen_ai.usage.input_tokens"], agent["attributes"]["gen_ai.usage.output_tokens"]) \
        == (prompt, completion)
    assert (session["token_count_prompt"], session["token_count_completion"]) == (prompt, completion)
