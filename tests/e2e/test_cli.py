"""The commands the README promises, run as a user runs them: real subprocesses of the
`spanmeter` entry point, against a real `spanmeter serve`. Checks are grouped per process
start (each costs ~0.3 s), and independent commands run side by side."""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp

from proxy.ops.cli import _parser
from proxy.simulator.script import SCENARIO_HELP
from tests.fixtures.redis import free_port

ROOT = Path(__file__).resolve().parents[2]


def _spanmeter(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "proxy", *args], capture_output=True, text=True, timeout=60,
                          cwd=ROOT, env={**os.environ, **(env or {})})


async def _many(*commands: tuple[str, ...], env: dict[str, str] | None = None) -> list[
        subprocess.CompletedProcess[str]]:
    """Several spanmeter commands at once (each its own process)."""
    return list(await asyncio.gather(*(asyncio.to_thread(_spanmeter, *c, env=env) for c in commands)))


def _key(out: str) -> str:
    return re.search(r"^  (sm-\S+)$", out, re.M).group(1)


async def test_version_keys_and_the_help_of_command_groups(tmp_path):
    cfg = tmp_path / "spanmeter.yaml"
    cfg.write_text("tenants:\n  acme:\n    keys: ['" + "a" * 64 + "', '" + "b" * 64 + "']\n  idle:\n    keys: []\n")
    version, create, create_json, keys_alone, budget_alone, listed, listed_json, listed_open = await _many(
        ("--version",), ("keys", "create", "--tenant", "acme"), ("keys", "create", "--tenant", "acme", "--json"),
        ("keys",), ("budget",), ("keys", "list", "--config", str(cfg)),
        ("keys", "list", "--config", str(cfg), "--json"), ("keys", "list"))
    assert version.returncode == 0 and re.fullmatch(r"spanmeter \d+\.\d+\.\S+\n", version.stdout)
    key = _key(create.stdout)
    assert f"- {hashlib.sha256(key.encode()).hexdigest()}" in create.stdout
    assert "tenants:\n  acme:\n    keys:" in create.stdout
    made = json.loads(create_json.stdout)
    assert made["sha256"] == hashlib.sha256(made["key"].encode()).hexdigest() and made["key_id"] == made["sha256"][:8]
    # A group alone shows its own actions, not the top-level help.
    assert keys_alone.returncode == 2 and "usage: spanmeter keys" in keys_alone.stdout
    assert "create" in keys_alone.stdout and "list" in keys_alone.stdout and "serve" not in keys_alone.stdout
    assert budget_alone.returncode == 2 and "usage: spanmeter budget" in budget_alone.stdout
    assert listed.stdout.splitlines()[0].split() == ["TENANT", "KEY", "ID", "SHA256"]
    assert listed.stdout.splitlines()[1].split() == ["acme", "aaaaaaaa", "a" * 64]
    assert "Tenants with no key (no one can call as them): idle" in listed.stdout
    assert json.loads(listed_json.stdout)[1] == {"tenant": "acme", "key_id": "bbbbbbbb", "sha256": "b" * 64}
    assert listed_open.returncode == 0 and listed_open.stdout.startswith("No tenants configured: open mode")


def _subparsers(p: argparse.ArgumentParser, path: str = "spanmeter") -> list[tuple[str, argparse.ArgumentParser]]:
    found = [(path, p)]
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _subparsers(sub, f"{path} {name}")
    return found


def test_every_command_has_examples_and_every_option_help_and_its_default():
    commands = _subparsers(_parser())
    assert {c for c, _ in commands} >= {"spanmeter serve", "spanmeter check-config", "spanmeter runs",
                                        "spanmeter spend", "spanmeter budget set", "spanmeter keys list"}
    for name, parser in commands:
        assert "examples:\n  spanmeter" in (parser.epilog or ""), name
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction | argparse._HelpAction | argparse._VersionAction):
                continue
            text = action.help or ""
            assert len(text) > 15, (name, action.dest)
            assert "default" in text or "required" in text, (name, action.dest, text)
    shown = _spanmeter("runs", "--help", env={"SPANMETER_DATA_DIR": "/srv/spanmeter"}).stdout
    assert "(default: 50)" in shown and "$SPANMETER_DATA_DIR, here /srv/spanmeter" in shown
    assert "examples:\n  spanmeter runs" in shown


def test_simulate_lists_every_scenario_marker():
    out = _spanmeter("simulate", "--scenarios")
    assert out.returncode == 0
    for marker, _ in SCENARIO_HELP.values():
        assert f"  {marker} " in out.stdout, marker
    assert "SCENARIO:error:STATUS  Answers HTTP STATUS (default 500)" in out.stdout


async def _wait_healthy(url: str) -> None:
    async with aiohttp.ClientSession() as s:
        for _ in range(400):
            try:
                async with s.get(f"{url}/healthz") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientConnectionError:
                await asyncio.sleep(0.05)
    raise AssertionError("spanmeter serve did not come up")


async def _chat(s: aiohttp.ClientSession, url: str, key: str, **headers: str) -> aiohttp.ClientResponse:
    async with s.post(f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}", **headers},
                      json={"model": "sim-small", "messages": [{"role": "user", "content": "hi"}]}) as r:
        await r.read()
        return r


async def test_serve_then_calls_then_runs_spend_and_budgets(sim, tmp_path):
    key = _key(_spanmeter("keys", "create", "--tenant", "acme").stdout)
    cfg = tmp_path / "spanmeter.yaml"
    # admin_token in the file only: the CLI reads the same config the proxy does.
    cfg.write_text(f"upstream_keys: {{openai: OPENAI_API_KEY}}\nadmin_token: admin-secret\n"
                   f"tenants:\n  acme:\n    keys: ['{hashlib.sha256(key.encode()).hexdigest()}']\n"
                   "    policy: {budgets: {daily_usd: 5}}\n  beta:\n    keys: []\n")
    port = free_port()
    data = tmp_path / "data"
    env = {**os.environ, "SPANMETER_PORT": str(port), "SPANMETER_OPENAI_BASE_URL": sim.url,
           "SPANMETER_DATA_DIR": str(data), "SPANMETER_CONFIG": str(cfg), "OPENAI_API_KEY": "sk-upstream"}
    log = (tmp_path / "stderr.log").open("w+")
    proc = subprocess.Popen([sys.executable, "-m", "proxy", "serve"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=log, text=True)
    url = f"http://127.0.0.1:{port}"
    admin = {"SPANMETER_CONFIG": str(cfg), "SPANMETER_URL": url, "SPANMETER_DATA_DIR": str(data)}
    try:
        await _wait_healthy(url)
        async with aiohttp.ClientSession() as s:
            first = await _chat(s, url, key, **{"X-Run-Id": "cli-run"})
            assert first.status == 200
            refused = await _chat(s, url, key, **{"X-Run-Id": "cli-run", "X-Run-Max-Calls": "1"})
            assert refused.status == 402
            last = await _chat(s, url, key, **{"X-Run-Id": "cli-run", "X-Run-End": "true"})
            assert last.status == 200
            single = await _chat(s, url, key)
            lone_run = single.headers["x-spanmeter-run-id"]
        runs, tree, missing, beta, spend, spend_json, no_tenant = await _many(
            ("runs",), ("runs", "cli-run"), ("runs", "no-such-run"), ("runs", "--tenant", "beta"),
            ("spend", "--tenant", "acme", "--run", "cli-run"), ("spend", "--tenant", "acme", "--json"),
            ("spend", "--tenant", "nobody"), env=admin)
        set_daily = _spanmeter("budget", "set", "--tenant", "acme", "--daily-usd", "7", env=admin)
        set_monthly, negative, nothing = await _many(
            ("budget", "set", "--tenant", "acme", "--monthly-usd", "100"),
            ("budget", "set", "--tenant", "acme", "--daily-usd", "-5"), ("budget", "set", "--tenant", "acme"),
            env=admin)
        got = _spanmeter("budget", "get", "--tenant", "acme", env=admin)
        cleared = _spanmeter("budget", "set", "--tenant", "acme", "--clear-daily", "--json", env=admin)
    finally:
        os.kill(proc.pid, signal.SIGTERM)  # graceful: telemetry is flushed to the local span file
        out = proc.communicate(timeout=30)[0]
        log.seek(0)
        err = log.read()
        log.close()
    assert f"spanmeter listening on http://127.0.0.1:{port}" in out

    # runs: what the tree view shows, at once; the call without a run id is a run that ended.
    header = runs.stdout.splitlines()[0].split()
    rows = {line.split()[0]: line.split() for line in runs.stdout.splitlines()[1:]}
    # STARTED takes two words (date and time): columns after it sit one further right.
    at = {name: i + (1 if i > header.index("STARTED") else 0) for i, name in enumerate(header)}
    assert rows["cli-run"][1] == "acme" and rows["cli-run"][-1] == "ceiling"
    # The refused call is apart: 2 calls went upstream, against the ceiling of 1 it hit.
    assert [rows["cli-run"][at["CALLS"]], rows["cli-run"][at["REFUSED"]], rows["cli-run"][at["TOKENS"]]] == [
        "2", "1", "38"]
    assert rows[lone_run][at["CALLS"]] == "1" and rows[lone_run][-1] == "ended"
    assert "$0.0000 " not in runs.stdout and re.search(r"\$0\.0000[1-9]", rows["cli-run"][at["COST"]])
    assert tree.stdout.startswith("run cli-run (acme)") and tree.stdout.count("chat sim-small") == 3
    assert "  2 calls  1 refused  " in tree.stdout.splitlines()[0]
    assert "refused: run_calls" in tree.stdout and "rewrite max_tokens_clamp=" in tree.stdout
    assert missing.returncode == 1 and missing.stderr.startswith(f"No run 'no-such-run' in {data / 'traces'}.")
    assert beta.returncode == 0 and beta.stdout.strip() == f"No runs for tenant beta in {data / 'traces'}."

    # spend: a table with exact, non-zero money; --json for scripts; an unknown tenant says so.
    assert spend.returncode == 0, spend.stderr
    table = {line.split()[0]: line.split() for line in spend.stdout.splitlines()[2:]}
    assert table["day"][3:4] == ["$5.00"] and table["month"][3] == "none"
    assert table["day"][-1] == table["month"][-1] == "-" and "CALLS: counted per run" in spend.stdout
    assert re.fullmatch(r"\$0\.0000\d\d", table["run"][2]) and table["run"][3:] == ["2", "model", "calls"]
    assert "e-05" not in spend.stdout
    assert json.loads(spend_json.stdout)["day_usd"] > 0
    assert no_tenant.returncode == 1
    assert ("answered 400: Unknown tenant 'nobody': no tenant of that name is configured. The configured tenants "
            "are acme, beta.") in no_tenant.stderr

    # budget set changes only what it is given, validates, and clears only on request.
    assert set_daily.returncode == 0, set_daily.stderr
    assert set_daily.stdout.splitlines()[1].split() == ["acme", "daily", "$7.00", "admin", "API", "(config:", "$5.00)"]
    assert set_monthly.stdout.splitlines()[1].split()[:3] == ["acme", "daily", "$7.00"]  # not reset
    assert set_monthly.stdout.splitlines()[2].split()[:3] == ["acme", "monthly", "$100.00"]
    assert got.stdout == set_monthly.stdout
    assert negative.returncode == 2 and "argument --daily-usd: a budget is an amount of US dollars above 0" in (
        negative.stderr) and "{" not in negative.stderr
    assert nothing.returncode == 2 and nothing.stderr.startswith("Nothing to change: give --daily-usd")
    back = json.loads(cleared.stdout)
    assert (back["daily_usd"], back["monthly_usd"], back["sources"]) == (
        5, 100, {"daily_usd": "config", "monthly_usd": "admin"})

    # the access log: one line per call, none with a key or content.
    access = [line for line in err.splitlines() if " spanmeter.access " in line]
    assert len(access) == 4, err
    assert re.search(r'INFO spanmeter GET "/admin/spend" answered 400 spanmeter.invalid_request: Unknown tenant', err)
    assert re.search(r"INFO spanmeter\.access tenant=acme run=cli-run api=chat model=sim-small status=200 "
                     r"upstream=200 duration=\d+\.\d{3}s tokens=1/18 cost=\$0\.0000\d+ "
                     r"rewrites=\"max_tokens_clamp=\d+\"$", access[0]), access[0]
    assert "status=402 upstream=- " in access[1] and "refused=run_calls" in access[1]
    assert "(request header X-Run-Max-Calls)" in access[1]
    assert any(f"run={lone_run} " in line for line in access)
    assert key not in err + out + runs.stdout + tree.stdout and "sk-upstream" not in err and "Traceback" not in err


def test_demo_runs_offline_and_the_command_it_prints_draws_the_run(tmp_path):
    env = {"SPANMETER_DATA_DIR": str(tmp_path / "demo-data")}
    out = _spanmeter("demo", env=env)
    assert out.returncode == 0, out.stderr
    assert "model asked for get_weather" in out.stdout
    assert "execute_tool get_weather" in out.stdout
    assert "repair=output:" in out.stdout
    command = re.search(r"`spanmeter (runs demo-\S+ --data-dir \S+)` draws it again", out.stdout).group(1)
    again = _spanmeter(*command.split(), env=env)
    assert again.returncode == 0, again.stderr
    assert again.stdout.startswith(f"run {command.split()[1]} (default, agent demo-agent)")
    assert "execute_tool get_weather" in again.stdout and again.stdout.strip() in out.stdout
    assert re.search(r"run demo-\S+ \(default, agent demo-agent\)", out.stdout)  # the run, ended, as the agent's
    # Its anatomy, in the demo and again from the span files: two of its three tools never called.
    assert "2 of 3 declared tools never called: search_files, send_email" in again.stdout


def test_invalid_config_exits_2_with_the_field_and_source(tmp_path):
    out = _spanmeter("serve", env={"SPANMETER_READ_TIMEOUT_S": "-1"})
    assert out.returncode == 2
    assert "read_timeout_s (from environment variable SPANMETER_READ_TIMEOUT_S)" in out.stderr
    assert "Traceback" not in out.stderr


def test_admin_commands_say_where_the_token_belongs(tmp_path):
    cfg = tmp_path / "spanmeter.yaml"
    cfg.write_text("port: 8787\n")
    out = _spanmeter("spend", "--tenant", "acme", "--config", str(cfg), env={"SPANMETER_ADMIN_TOKEN": ""})
    assert out.returncode == 2
    assert f"the config file {cfg} has no `admin_token:`" in out.stderr
    assert "put `admin_token: ...` in the config file both read" in out.stderr and "Traceback" not in out.stderr


def test_prices_says_what_a_model_costs_and_where_each_number_came_from(tmp_path: Path) -> None:
    config = tmp_path / "spanmeter.yaml"
    config.write_text("prices:\n  claude-sonnet-4-5: {output: 16}\n")
    shipped = _spanmeter("prices", "claude-sonnet-4-5", "--config", str(config))
    assert shipped.returncode == 0, shipped.stderr
    out = shipped.stdout
    assert re.search(r"input\s+\$3\s+genai-prices \S+ \(anthropic\)", out)
    assert re.search(r"output\s+\$16\s+config prices \(override\)", out)
    assert re.search(r"long_context\s+over 200000", out) and re.search(r"max_output\s+64000\s+prices.yaml", out)
    ours = _spanmeter("prices", "claude-sonnet-4")  # a row prices.yaml keeps whole
    assert re.search(r"long_context\s+over 200000\s+prices.yaml \(https://", ours.stdout), ours.stdout
    local = _spanmeter("prices", "qwen3:8b", "--provider", "ollama")
    assert re.search(r"output\s+\$0\s+ollama: .*\$0 deliberately", local.stdout), local.stdout
    groq = _spanmeter("prices", "llama-3.3-70b-versatile", "--provider", "groq")
    assert "genai-prices" in groq.stdout and "(groq)" in groq.stdout
    unknown = _spanmeter("prices", "no-such-model-9")
    assert unknown.returncode == 1 and "no known price" in unknown.stderr


# A raw key where its hash belongs (or a provider key where a variable's name belongs), in
# every shape an operator's slip gives it: the error says where and what was expected, and
# never repeats the value, on stdout or stderr.
_PASTED = "sm-PASTEDkey0123456789abcdefghij"
_PROVIDER = "sk-proj-PASTEDprovider0123456789"
_SHAPES = {
    "a scalar for the list": f"keys: {_PASTED}",
    "{hash: KEY}": f"keys: [{{hash: {_PASTED}}}]",
    "{key: KEY}": f"keys: [{{key: {_PASTED}}}]",
    "a typo beside it": f"keys: [{{hash: {_PASTED}, polcy: {{}}}}]",
    "a mapping": f"keys: {{main: {_PASTED}}}",
    "a list in a list": f"keys: [[{_PASTED}]]",
    "the tenant's block as text": f"{_PASTED}",
    "a provider key for a variable's name": f"keys: ['{'a' * 64}']\n    upstream_keys: {{openai: {_PROVIDER}}}",
}


def _tenant_config(tmp_path: Path, name: str, shape: str) -> Path:
    cfg = tmp_path / f"{re.sub(r'[^a-z]+', '-', name)}.yaml"
    body = f"tenants:\n  acme: {shape}\n" if not shape.startswith(("keys", "upstream")) else \
        f"tenants:\n  acme:\n    {shape}\n"
    cfg.write_text(body)
    return cfg


def _leaks(out: subprocess.CompletedProcess[str]) -> bool:
    text = out.stdout + out.stderr
    return _PASTED in text or _PROVIDER in text or "PASTED" in text


async def test_no_config_error_repeats_a_pasted_key(tmp_path):
    configs = {name: _tenant_config(tmp_path, name, shape) for name, shape in _SHAPES.items()}
    checked = await _many(*(("check-config", "--config", str(c)) for c in configs.values()))
    served = await _many(*(("serve", "--port", "0", "--config", str(configs[n]))
                           for n in ("a scalar for the list", "{key: KEY}", "a list in a list",
                                     "a provider key for a variable's name")))
    by_env = await _many(*(("check-config",) for _ in range(1)),
                         env={"SPANMETER_TENANTS": json.dumps({"acme": {"keys": _PASTED}})})
    nested_env = await _many(("check-config",), env={"SPANMETER_TENANTS__ACME__UPSTREAM_KEYS__OPENAI": _PROVIDER,
                                                     "SPANMETER_TENANTS": json.dumps({"acme": {"keys": ["a" * 64]}})})
    for name, out in [*zip(configs, checked, strict=True), *zip(("serve",) * 4, served, strict=True),
                      ("env", by_env[0]), ("nested env", nested_env[0])]:
        assert out.returncode == 2, (name, out.stdout, out.stderr)
        assert not _leaks(out), (name, out.stdout + out.stderr)
        assert "Traceback" not in out.stderr, name
        assert "tenants.acme" in out.stderr, (name, out.stderr)  # where it was
    # What was expected, and where it came from.
    assert "sha256" in checked[0].stderr and f"config file {configs['a scalar for the list']}" in checked[0].stderr
    assert "environment variable" in checked[-1].stderr and "upstream_keys.openai" in checked[-1].stderr
    assert "environment variable SPANMETER_TENANTS" in by_env[0].stderr
    assert "environment variable SPANMETER_TENANTS__ACME__UPSTREAM_KEYS__OPENAI" in nested_env[0].stderr
