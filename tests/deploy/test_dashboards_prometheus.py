"""Every PromQL query of every dashboard, run by a real Prometheus against a real proxy.

A simulator-driven load goes through the proxy (chat with and without streaming, a tool
round trip, a failed tool, an upstream error, a run ceiling, the loop guard reminding and
refusing, a structured-output repair). Prometheus, started from deploy/prometheus.yml with
only the target and the interval changed, scrapes the proxy's /metrics. Then each panel's
query must parse and return at least one series: a panel that matches nothing is a
dashboard that silently lies.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from tests.deploy import dashboards as D
from tests.deploy.load import drive_load, running_proxy, upstream_keys
from tests.fixtures.redis import free_port

pytestmark = pytest.mark.prometheus

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
DEPLOY_CONFIG = D.ROOT / "deploy" / "prometheus.yml"
DEADLINE_S = 30.0  # for Prometheus to start and scrape; the whole test stays well under 40 s

QUERIES = D.all_queries("promql")


@dataclass
class Evaluated:
    results: dict[str, dict[str, Any]] = field(default_factory=dict)  # query id -> API answer
    statuses: dict[str, int] = field(default_factory=dict)  # load step -> HTTP status
    scraped: set[str] = field(default_factory=set)  # metric names Prometheus holds


def _prometheus_config(target: str) -> dict[str, Any]:
    """deploy/prometheus.yml with the spanmeter job pointed at the test proxy, scraped every second."""
    cfg = yaml.safe_load(DEPLOY_CONFIG.read_text())
    job = next(j for j in cfg["scrape_configs"] if j["job_name"] == "spanmeter")
    job["static_configs"] = [{"targets": [target]}]
    cfg["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    cfg["scrape_configs"] = [job]
    return cfg


class Prometheus:
    def __init__(self, workdir: Path, target: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = workdir / "prometheus.yml"
        config.write_text(yaml.safe_dump(_prometheus_config(target)))
        self.log = (workdir / "prometheus.log").open("wb")
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--enable-feature=exemplar-storage"],
            stdout=self.log, stderr=subprocess.STDOUT)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()

    def get(self, path: str, **params: str) -> dict[str, Any]:
        url = f"{self.url}{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                answer: dict[str, Any] = orjson.loads(resp.read())
        except urllib.error.HTTPError as exc:  # 400 on a query that does not parse
            answer = orjson.loads(exc.read())
        return answer

    def query(self, expr: str) -> dict[str, Any]:
        return self.get("/api/v1/query", query=expr)

    def scrapes(self) -> int:
        """How many successful scrapes of spanmeter Prometheus holds (0 before the first)."""
        try:
            r = self.query('count_over_time(up{job="spanmeter"}[5m]) and on() up{job="spanmeter"} == 1')
        except (urllib.error.URLError, ConnectionError):
            return 0
        rows = r.get("data", {}).get("result", [])
        return int(float(rows[0]["value"][1])) if rows else 0


def _wait_until(check: Any, deadline: float, what: str, prom: Prometheus) -> None:
    while not check():
        if prom.proc.poll() is not None or time.monotonic() > deadline:
            log = Path(prom.log.name).read_text()[-2000:]
            raise AssertionError(f"{what} did not happen in time; prometheus log:\n{log}")
        time.sleep(0.2)


async def _evaluate(workdir: Path) -> Evaluated:
    out = Evaluated()
    async with running_proxy(workdir / "proxy") as proxy:
        # First pass before Prometheus starts: every series exists at the first scrape.
        out.statuses.update(await drive_load(proxy.proxy_url, "1"))
        prom = Prometheus(workdir, f"127.0.0.1:{proxy.proxy_port}")
        try:
            deadline = time.monotonic() + DEADLINE_S
            await asyncio.to_thread(_wait_until, lambda: prom.scrapes() >= 1, deadline,
                                    "a first scrape", prom)
            # Second pass between scrapes: counters move, so rates are not all zero.
            out.statuses.update({f"{k} (2)": v for k, v in (await drive_load(proxy.proxy_url, "2")).items()})
            await asyncio.to_thread(_wait_until, lambda: prom.scrapes() >= 4, deadline,
                                    "four scrapes", prom)
            for q in QUERIES:
                out.results[q.id] = prom.query(D.concrete(q.text))
            names = prom.get("/api/v1/label/__name__/values")
            out.scraped = set(names.get("data", []))
        finally:
            prom.stop()
    return out


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Evaluated]:
    if not Path(PROMETHEUS).exists():
        pytest.skip("prometheus is not installed (apt-get install prometheus): dashboard queries not run")
    workdir = tmp_path_factory.mktemp("dashboards")
    with _clean_env(), upstream_keys():
        yield asyncio.run(_evaluate(workdir))


class _clean_env:
    """The proxy reads SPANMETER_*/OTEL_* from the environment; this module-scoped run
    starts before the per-test clean_environ fixture, so it isolates itself the same way."""

    def __enter__(self) -> None:
        self.saved = dict(os.environ)
        for k in list(os.environ):
            if k.startswith(("SPANMETER_", "OTEL_")):
                del os.environ[k]

    def __exit__(self, *exc: object) -> None:
        os.environ.clear()
        os.environ.update(self.saved)


def test_the_load_covered_every_scenario(evaluated: Evaluated) -> None:
    s = evaluated.statuses
    assert s["acme stream=False"] == s["acme stream=True"] == 200
    assert s["acme error"] == 500, "the simulator's upstream error passes through"
    assert s["capped 2"] == 402, "the third call of a run capped at two is refused"
    assert s["loop refuse"] == 409, "globex's loop guard refuses the repeated tool call"
    assert s["loop remind"] == s["tool ok"] == s["tool failed"] == 200
    assert s["acme cached"] == s["globex cached"] == 200
    assert s["wrap up"] == 200, "the run answered after acme's wrap-up note, within its 4 calls"
    assert s["rate 1"] == 429, "the second request of a key limited to one a minute"


def _panel_values(evaluated: Evaluated, title: str) -> dict[str, float]:
    """Each series of a panel's (only) query: its model label (or "") -> value."""
    [q] = [q for q in QUERIES if q.dashboard == "spanmeter-overview" and q.panel == title]
    rows = evaluated.results[q.id]["data"]["result"]
    return {r["metric"].get("gen_ai_request_model", ""): float(r["value"][1]) for r in rows}


def test_the_prompt_cache_panels_show_the_cached_share_and_the_savings(evaluated: Evaluated) -> None:
    """Every call reports input; the `cached` ones report 8 of it as read from the cache, each
    saving 7 micro-USD on sim-small ($1.00/M input, $0.10/M cached). The share is a true
    share (above 0, below 1), and the money saved is what the price table says."""
    by_model = _panel_values(evaluated, "Cached share of input tokens by model")
    assert 0 < by_model["sim-small"] < 1
    [share] = _panel_values(evaluated, "Cached input share").values()
    assert 0 < share < 1
    [saved] = _panel_values(evaluated, "Saved by prompt cache").values()
    # Two tenants x one cached call per load pass, 7 micro-USD each. Prometheus first scrapes
    # after pass 1, so increase() sees pass 2 (14 micro-USD, extrapolated up a little), and
    # never more than both passes.
    assert 2 * 7e-6 * 0.99 <= saved <= 4 * 7e-6
    assert _panel_values(evaluated, "Saved by prompt cache per hour by model")["sim-small"] > 0


def test_the_anatomy_panels_show_input_cost_by_part_and_tool(evaluated: Evaluated) -> None:
    """The tool round trip sends get_weather's result back and declares send_email, never
    called: input cost shows by part, get_weather among the tools by context cost, and
    send_email (only) among the unused definitions."""
    [q] = [q for q in QUERIES if q.panel == "Input cost per hour by part"]
    parts = {r["metric"]["spanmeter_input_part"] for r in evaluated.results[q.id]["data"]["result"]}
    assert {"tools", "tool_result", "history", "new"} <= parts
    by_tool = {}
    for title in ("Top tools by context cost", "Unused tool-definition cost"):
        [q] = [q for q in QUERIES if q.panel == title]
        by_tool[title] = {r["metric"]["gen_ai_tool_name"]: float(r["value"][1])
                          for r in evaluated.results[q.id]["data"]["result"]}
    assert by_tool["Top tools by context cost"]["get_weather"] > 0
    assert set(by_tool["Unused tool-definition cost"]) == {"send_email"}
    assert by_tool["Unused tool-definition cost"]["send_email"] > 0


# Panels whose metric the proxy does not emit yet: xfail with the reason while it is
# missing, pass as soon as it appears.
NOT_YET_EMITTED = {
    "spanmeter_repairs_total": "structured-output repair is not integrated in the proxy yet "
                               "(no spanmeter.repairs measurement)",
}


@pytest.mark.parametrize("q", QUERIES, ids=lambda q: q.id)
def test_every_dashboard_query_returns_series(evaluated: Evaluated, q: D.Query) -> None:
    answer = evaluated.results[q.id]
    assert answer.get("status") == "success", f"{q.id}: {answer.get('error')}\n{D.concrete(q.text)}"
    series = answer["data"]["result"]
    if not series:
        metrics, _ = D.promql_names(q.text)
        for metric in sorted(metrics):
            if metric in NOT_YET_EMITTED and metric not in evaluated.scraped:
                pytest.xfail(NOT_YET_EMITTED[metric])
    assert series, (f"{q.id} returned no series; Prometheus holds: "
                    f"{sorted(n for n in evaluated.scraped if not n.startswith(('prometheus_', 'go_')))}\n"
                    f"{D.concrete(q.text)}")
