"""`metrics_text()` scraped by a real Prometheus (Debian's binary) and queried over its HTTP API."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from proxy.model import Call, Caller, CallRecord, Outcome, Usage
from tracing import attributes as A
from tracing import spans
from tracing.setup import METRICS_CONTENT_TYPE, Telemetry, TelemetryConfig, setup_telemetry

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
pytestmark = [
    pytest.mark.prometheus,
    pytest.mark.skipif(not os.path.exists(PROMETHEUS), reason="no prometheus binary"),
]


def serve_metrics(tel: Telemetry) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = tel.metrics_text()
            self.send_response(200)
            self.send_header("Content-Type", METRICS_CONTENT_TYPE)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def listening_port(pid: int, deadline: float) -> int:
    """The TCP port a process listens on: Prometheus was told port 0 and does not log the real one."""
    while time.monotonic() < deadline:
        inodes = set()
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
        for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:  # LISTEN
                return int(cols[1].split(":")[1], 16)
        time.sleep(0.1)
    raise AssertionError("prometheus did not start listening")


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[Any]:
    procs: list[subprocess.Popen[bytes]] = []

    def start(target: str) -> str:
        config = tmp_path / "prometheus.yml"
        config.write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            f"scrape_configs:\n  - job_name: spanmeter\n    static_configs: [{{targets: ['{target}']}}]\n"
        )
        proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
             "--web.listen-address=127.0.0.1:0"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        procs.append(proc)
        return f"http://127.0.0.1:{listening_port(proc.pid, time.monotonic() + 30)}"

    yield start
    for proc in procs:
        proc.terminate()
        proc.wait(10)


def query(base: str, promql: str) -> list[dict[str, Any]]:
    url = f"{base}/api/v1/query?{urllib.parse.urlencode({'query': promql})}"
    with urllib.request.urlopen(url, timeout=5) as r:
        return list(json.load(r)["data"]["result"])


def poll(base: str, promql: str, deadline: float) -> list[dict[str, Any]]:
    while time.monotonic() < deadline:
        try:
            found = query(base, promql)
        except OSError:
            found = []
        if found:
            return found
        time.sleep(0.25)
    raise AssertionError(f"prometheus never had {promql}")


def test_prometheus_scrapes_our_metrics_under_the_documented_names(prometheus: Any, tmp_path: Path) -> None:
    tel = setup_telemetry(TelemetryConfig(local_dir=str(tmp_path / "spans")), environ={})
    server = serve_metrics(tel)
    try:
        caller = Caller("acme", "run_prom", "header")
        call = Call(api="chat", operation="chat", model="gpt-4o")
        cs = spans.start_call(tel, caller, call, spans.Peer("openai", "api.openai.com", 443))  # fmt: skip
        spans.end_call(tel, cs, CallRecord(cs.caller, call, Outcome(status=200, usage=Usage(100, 20)), cs.start_ns,
                                           cost_micros=2500,
                       usage_source="reported", budget_remaining_micros=None, rewrites=[], repairs=[]))  # fmt: skip
        tel.set_budget("acme", "day", 2500, 1_000_000)
        base = prometheus(f"127.0.0.1:{server.server_address[1]}")
        deadline = time.monotonic() + 60

        cost = poll(base, f'{A.prometheus_series(A.SPANMETER_COST)[0]}{{spanmeter_tenant_id="acme"}}', deadline)
        assert float(cost[0]["value"][1]) == pytest.approx(0.0025)
        assert cost[0]["metric"]["gen_ai_request_model"] == "gpt-4o"
        assert cost[0]["metric"]["job"] == "spanmeter"

        tokens = poll(base, "sum by (gen_ai_token_type) (gen_ai_client_token_usage_sum)", deadline)
        assert {r["metric"]["gen_ai_token_type"]: float(r["value"][1]) for r in tokens} == {
            "input": 100.0, "output": 20.0}  # fmt: skip

        count = A.prometheus_series(A.GEN_AI_CLIENT_OPERATION_DURATION)[2]
        calls = poll(base, f"sum by (gen_ai_provider_name) ({count})", deadline)
        assert calls[0]["metric"] == {"gen_ai_provider_name": "openai"}
        assert float(calls[0]["value"][1]) == 1.0

        spent = poll(base, 'spanmeter_budget_spent_usd{spanmeter_budget_window="day"}', deadline)
        assert float(spent[0]["value"][1]) == pytest.approx(0.0025)
    finally:
        server.shutdown()
        tel.shutdown()
