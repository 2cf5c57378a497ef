"""spanmeter serve | check-config | config | demo | simulate | runs | keys | spend | budget | ledger

Exit codes: 0 done; 1 the thing asked for is not there or the proxy said no (unknown run,
admin API error, proxy unreachable); 2 the command or the configuration is wrong (usage
errors, a configuration spanmeter refuses to start with); 130 interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import json
import logging
import math
import os
import socket
import sys
import textwrap
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from proxy.errors import ConfigError
from proxy.ops.workers import use_uvloop

if TYPE_CHECKING:
    from proxy.config import Settings

__all__ = ["main"]

DEFAULT_URL = "http://127.0.0.1:8787"
log = logging.getLogger("spanmeter")


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not getattr(args, "fn", None):
        # A command group without its action (`spanmeter keys`): that group's help.
        (getattr(args, "help_of", None) or parser).print_help()
        return 2
    try:
        return int(args.fn(args) or 0)
    except ConfigError as exc:
        text = exc.message
        if args.fn is _serve and _json_logs_asked():
            text = _json_line("ERROR", text, {"error": "config_error"})
        print(text, file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _json_line(level: str, message: str, fields: dict[str, Any]) -> str:
    """One line as the JSON log format writes it (proxy/serve/accesslog.py)."""
    from proxy.serve.accesslog import JsonFormatter, logged

    return JsonFormatter().format(logged("spanmeter", getattr(logging, level), "%s", (message,), fields))


def _json_logs_asked() -> bool:
    """Whether `serve` was asked for JSON logs, when the settings that say so did not load."""
    if os.environ.get("SPANMETER_LOG_FORMAT", "").strip().lower() == "json":
        return True
    path = os.environ.get("SPANMETER_CONFIG")
    if not path or "SPANMETER_LOG_FORMAT" in os.environ:
        return False
    from proxy.config import read_config_file

    try:
        return read_config_file(path).get("log_format") == "json"
    except ConfigError:
        return False


# --- the parser --------------------------------------------------------------------------


class _Help(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=32, width=100)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("spanmeter")
    except PackageNotFoundError:
        return "unknown (not installed: run from a source tree)"


def _env(name: str, fallback: str) -> str:
    return os.environ.get(name) or fallback


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="spanmeter", formatter_class=_Help,
        description=textwrap.fill("A reverse proxy and tracer for AI agents: OpenTelemetry spans for every "
                                  "model and tool call, ceilings that hold, structured-output repair.", 100),
        epilog="examples:\n"
               "  spanmeter serve                      # the proxy on http://127.0.0.1:8787, open mode\n"
               "  spanmeter demo                       # everything offline, against the simulated model API\n"
               "  spanmeter runs                       # recent runs\n"
               "  spanmeter COMMAND --help             # a command's options and examples\n\n"
               "Configuration reference and operations guide: docs/operations.md")
    p.add_argument("--version", action="version", version=f"spanmeter {_version()}")
    sub = p.add_subparsers(metavar="COMMAND", title="commands")

    s = _command(sub, "serve", "run the proxy",
                 "Runs the proxy. Settings come from defaults, then the YAML file named by SPANMETER_CONFIG "
                 "(or --config), then SPANMETER_* environment variables; options here win over all three. "
                 "spanmeter refuses to start (exit 2, one paragraph saying why) on a config file that is "
                 "missing, empty or not valid YAML, an invalid setting, a busy port, or, with tenants, an "
                 "upstream key variable that is not set. --workers N runs N processes on the one port (a "
                 "supervisor restarts any that dies), sharing the ledger and one /metrics.",
                 ["spanmeter serve",
                  "spanmeter serve --config spanmeter.yaml --host 0.0.0.0",
                  "spanmeter serve --workers auto         # one process per CPU on one port",
                  "SPANMETER_LOG_FORMAT=json spanmeter serve"])
    s.add_argument("--host", help=f"listen address; open mode listens on loopback only "
                                  f"(default: {_default('SPANMETER_HOST', '127.0.0.1')})")
    s.add_argument("--port", type=int, help=f"listen port, 0 for any free one "
                                            f"(default: {_default('SPANMETER_PORT', '8787')})")
    s.add_argument("--workers", type=_workers, metavar="N|auto",
                   help=f"processes serving the port, `auto` for one per CPU; 1 is a single process "
                        f"(default: {_default('SPANMETER_WORKERS', '1')})")
    _config_arg(s)
    s.set_defaults(fn=_serve)

    s = _command(sub, "check-config", "show what the proxy would run with, without starting it",
                 "Loads the configuration exactly as `spanmeter serve` would and prints what the proxy "
                 "would run with: listen address, mode, tenants and their ceilings, upstreams and whether "
                 "their key variables are set, ledger, exporters, admin API, logs. Exits 0 when serve would "
                 "start, 2 with the reason when it would refuse. The port is not tried: a running proxy "
                 "may hold it.",
                 ["spanmeter check-config", "spanmeter check-config --config /etc/spanmeter/spanmeter.yaml"])
    _config_arg(s)
    s.set_defaults(fn=_check_config)

    config = _command(sub, "config", "the configuration reference: every setting, its variable and default",
                      "What can go in the YAML file named by SPANMETER_CONFIG, and the SPANMETER_* variable of "
                      "each setting; the same table as docs/operations.md, for installs without the docs.",
                      ["spanmeter config reference", "spanmeter config reference | grep max_llm_calls"])
    actions = config.add_subparsers(metavar="ACTION", title="actions")
    config.set_defaults(help_of=config)
    s = _command(actions, "reference", "print every setting with its environment variable, type and default",
                 "Prints the configuration reference (a Markdown table: setting, environment variable, type, "
                 "default, meaning), then the standard OTEL_* variables spanmeter reads.",
                 ["spanmeter config reference"])
    s.set_defaults(fn=_config_reference)

    s = _command(sub, "demo", "offline demo: simulator + proxy + an openai SDK agent loop",
                 "Starts the simulated model API and the proxy on free ports, runs a short agent loop "
                 "through the real openai SDK (a tool call, a streamed answer, a structured answer that "
                 "arrives fenced with trailing commas) and prints what happened. The run's spans are "
                 "kept under --data-dir, so `spanmeter runs RUN_ID` draws it again afterwards.",
                 ["spanmeter demo", "spanmeter demo --data-dir /tmp/spanmeter-demo"])
    _data_dir_arg(s)
    s.set_defaults(fn=_demo)

    s = _command(sub, "simulate", "run the simulated model API (all four dialects)",
                 "Serves a scripted model API in the OpenAI Chat Completions, Responses, Anthropic Messages "
                 "and Gemini wire formats, with no key and no network. The last user message picks what "
                 "the model does (`--scenarios` lists the markers). Point spanmeter at it with "
                 "SPANMETER_OPENAI_BASE_URL (or the Anthropic and Gemini ones).",
                 ["spanmeter simulate --port 8788",
                  "SPANMETER_OPENAI_BASE_URL=http://127.0.0.1:8788 spanmeter serve",
                  "spanmeter simulate --scenarios"])
    s.add_argument("--host", default="127.0.0.1", help="listen address (default: 127.0.0.1)")
    s.add_argument("--port", type=int, default=8788, help="listen port (default: 8788)")
    s.add_argument("--scenarios", action="store_true",
                   help="list the scenario markers and what each does, then exit (default: off)")
    s.set_defaults(fn=_simulate)

    s = _command(sub, "runs", "list recent runs, or draw one run as a tree",
                 "Reads the spans spanmeter keeps under DATA_DIR/traces (setting local_traces, on by "
                 "default). Without RUN_ID: the most recent runs, newest first. With RUN_ID: the run as a "
                 "tree of model calls and tool executions, with durations, tokens, cost, repairs and "
                 "failures, then where its input cost went (by part, by tool, the largest tool results; "
                 "with SPANMETER_ANATOMY on). With --agent NAME --unused-tools: the tools the agent "
                 "declared and never called in its last --limit runs. A run id that is not there exits 1.",
                 ["spanmeter runs", "spanmeter runs --tenant acme --limit 10", "spanmeter runs first-run",
                  "spanmeter runs first-run --json | jq '.[0].anatomy.parts'",
                  "spanmeter runs --agent coder --unused-tools --limit 20",
                  "spanmeter runs --json | jq '.[0].cost_usd'"])
    s.add_argument("run_id", nargs="?", metavar="RUN_ID", help="draw this run (default: list recent runs)")
    _data_dir_arg(s)
    s.add_argument("--tenant", help="only this tenant's runs (default: every tenant)")
    s.add_argument("--limit", type=_positive_int, default=50, help="list at most this many runs (default: 50)")
    s.add_argument("--agent", help="only this agent's runs (X-Agent-Name; default: every agent)")
    s.add_argument("--unused-tools", action="store_true",
                   help="with --agent: the tools declared and never called in its last --limit runs (default: off)")
    _json_arg(s)
    s.set_defaults(fn=_runs)

    keys = _command(sub, "keys", "tenant keys: create one, list the configured ones",
                    "spanmeter keys are what agents send as their API key in tenant mode. spanmeter stores "
                    "only their sha256 hashes, in the config file.",
                    ["spanmeter keys create --tenant acme", "spanmeter keys list"])
    actions = keys.add_subparsers(metavar="ACTION", title="actions")
    keys.set_defaults(help_of=keys)
    s = _command(actions, "create", "print a new spanmeter key (once) and the hash to configure",
                 "Prints a new random key for TENANT, once, and the sha256 hash to add under "
                 "tenants.TENANT.keys in the config file. Nothing is written anywhere: give the key to "
                 "the tenant, put the hash in the config, restart (or roll) the proxy.",
                 ["spanmeter keys create --tenant acme",
                  "spanmeter keys create --tenant acme --json | jq -r .sha256"])
    s.add_argument("--tenant", required=True, help="the tenant the key is for (required)")
    _json_arg(s)
    s.set_defaults(fn=_keys_create)
    s = _command(actions, "list", "list the tenants and key hashes in the config",
                 "Lists each tenant's configured key hashes and their short ids (the first 8 hex digits, "
                 "what spans and logs call key id). Read from the config file, as `serve` would.",
                 ["spanmeter keys list", "spanmeter keys list --config spanmeter.yaml --json"])
    _config_arg(s)
    _json_arg(s)
    s.set_defaults(fn=_keys_list)

    s = _command(sub, "spend", "a tenant's spend: today, this month, one run (admin API)",
                 "Asks the running proxy (GET /admin/spend) what a tenant spent today and this month in "
                 "the budget timezone, with its budgets and what is left, and for one run with --run. "
                 "Amounts are exact to the micro-dollar and include calls in flight.",
                 ["spanmeter spend --tenant acme", "spanmeter spend --tenant acme --run first-run",
                  "spanmeter spend --tenant acme --json"])
    s.add_argument("--tenant", required=True, help="tenant name, `default` in open mode (required)")
    s.add_argument("--run", metavar="RUN_ID", help="also this run's spend and model calls (default: none)")
    _admin_args(s)
    s.set_defaults(fn=_spend)

    budget = _command(sub, "budget", "tenant budgets: show or change them (admin API)",
                      "Budgets set here are kept in the ledger and override the config file's "
                      "budgets.daily_usd / budgets.monthly_usd for that tenant, on every replica within 5 s.",
                      ["spanmeter budget get --tenant acme", "spanmeter budget set --tenant acme --daily-usd 25"])
    actions = budget.add_subparsers(metavar="ACTION", title="actions")
    budget.set_defaults(help_of=budget)
    s = _command(actions, "set", "change a tenant's daily and/or monthly USD budget",
                 "Changes only what is given: --daily-usd leaves the monthly budget as it is, and the other "
                 "way round. --clear-daily / --clear-monthly remove the admin setting, so the config "
                 "file's value (or none) applies again. At least one option is needed.",
                 ["spanmeter budget set --tenant acme --daily-usd 25",
                  "spanmeter budget set --tenant acme --monthly-usd 400 --clear-daily"])
    s.add_argument("--tenant", required=True, help="tenant name (required)")
    day = s.add_mutually_exclusive_group()
    day.add_argument("--daily-usd", type=_usd, metavar="USD",
                     help="daily budget in US dollars, more than 0 (default: unchanged)")
    day.add_argument("--clear-daily", action="store_true",
                     help="remove the admin daily budget; the config's applies (default: unchanged)")
    month = s.add_mutually_exclusive_group()
    month.add_argument("--monthly-usd", type=_usd, metavar="USD",
                       help="monthly budget in US dollars, more than 0 (default: unchanged)")
    month.add_argument("--clear-monthly", action="store_true",
                       help="remove the admin monthly budget; the config's applies (default: unchanged)")
    _admin_args(s)
    s.set_defaults(fn=_budget_set)
    s = _command(actions, "get", "show a tenant's budgets and where each comes from",
                 "Shows the daily and monthly budgets in force for a tenant and whether each comes from "
                 "the admin API or the config file.",
                 ["spanmeter budget get --tenant acme", "spanmeter budget get --tenant acme --json"])
    s.add_argument("--tenant", required=True, help="tenant name (required)")
    _admin_args(s)
    s.set_defaults(fn=_budget_get)

    s = _command(sub, "prices", "what a model costs per million tokens, and where each number came from",
                 "Prints a model's rates (input, cached input, cache writes, output, long-context tier, service "
                 "tiers and geographies, max output) as the proxy would price a call to it, each with where it "
                 "came from: genai-prices (its version and provider), a prices.yaml row (its source and date) "
                 "or the config's prices overrides. --refresh fetches genai-prices' published data into "
                 "{data_dir}/prices.json (the only network use, and only when asked); the proxy reads that "
                 "file at start-up when the setting prices_file names it. Exits 1 for a model with no price.",
                 ["spanmeter prices claude-sonnet-4-5",
                  "spanmeter prices gpt-4o --provider azure.ai.openai",
                  "spanmeter prices --refresh            # then set prices_file: .spanmeter/prices.json"])
    s.add_argument("model", nargs="?", help="the model name a request sends (required unless --refresh)")
    s.add_argument("--provider", metavar="P",
                   help="the provider the call goes to, as gen_ai.provider.name (openai, gcp.vertex_ai, "
                        "aws.bedrock, groq, ollama, ...) (default: none, the model's first-party provider)")
    s.add_argument("--refresh", action="store_true",
                   help="fetch genai-prices' latest data into {data_dir}/prices.json (default: off)")
    _config_arg(s)
    _data_dir_arg(s)
    s.set_defaults(fn=_prices)

    ledger = _command(sub, "ledger", "the ledger itself: migrate a Redis ledger's keys",
                      "Maintenance of the ledger the proxy counts spend in (ledger_url).",
                      ["spanmeter ledger migrate-keys --ledger redis://redis:6379/0"])
    actions = ledger.add_subparsers(metavar="ACTION", title="actions")
    ledger.set_defaults(help_of=ledger)
    s = _command(actions, "migrate-keys", "move a Redis ledger to the hash-tagged key layout (once, idempotent)",
                 "Renames every key of a Redis ledger written by spanmeter before hash-tagged keys "
                 "(sm:<kind>:<tenant>:...) to today's layout (sm:{<tenant>}:<kind>:...), so that it can run on "
                 "Redis Cluster: spend, budgets, runs, tool calls and calls in flight keep their values. Stop "
                 "the old proxies first; new proxies refuse calls (503) until the migration is done. Each step "
                 "is atomic and done once: after an interruption, run it again. Exits 0 when done, 1 when Redis "
                 "cannot be reached, 2 for a ledger that is not one Redis.",
                 ["spanmeter ledger migrate-keys --ledger redis://redis:6379/0 --dry-run",
                  "spanmeter ledger migrate-keys --config spanmeter.yaml"])
    s.add_argument("--ledger", metavar="URL",
                   help="the Redis ledger (default: the ledger_url of the configuration, as serve reads it)")
    _config_arg(s)
    s.add_argument("--dry-run", action="store_true",
                   help="count what would move and change nothing (default: off)")
    s.set_defaults(fn=_ledger_migrate)
    return p


def _command(sub: Any, name: str, summary: str, description: str, examples: Sequence[str]) -> Any:
    epilog = "examples:\n" + "\n".join(f"  {e}" for e in examples)
    return sub.add_parser(name, help=summary, description=textwrap.fill(description, 100), epilog=epilog,
                          formatter_class=_Help)


def _default(env: str, fallback: str) -> str:
    """How an option's default reads: the variable, and what it is now when it is set."""
    now = os.environ.get(env)
    return f"${env}, here {now}" if now else f"${env}, else {fallback}"


def _config_arg(s: argparse.ArgumentParser) -> None:
    s.add_argument("--config", metavar="FILE",
                   help=f"YAML config file; the same as SPANMETER_CONFIG "
                        f"(default: {_default('SPANMETER_CONFIG', 'none: defaults and SPANMETER_* variables')})")


def _data_dir_arg(s: argparse.ArgumentParser) -> None:
    s.add_argument("--data-dir", default=_env("SPANMETER_DATA_DIR", ".spanmeter"),
                   help=f"spanmeter's data directory, as the proxy's data_dir "
                        f"(default: {_default('SPANMETER_DATA_DIR', '.spanmeter')})")


def _json_arg(s: argparse.ArgumentParser) -> None:
    s.add_argument("--json", action="store_true", help="print JSON for scripts instead of a table (default: off)")


def _admin_args(s: argparse.ArgumentParser) -> None:
    s.add_argument("--url", default=_env("SPANMETER_URL", DEFAULT_URL),
                   help=f"the proxy's base URL (default: {_default('SPANMETER_URL', DEFAULT_URL)})")
    s.add_argument("--token", default=None,
                   help="the proxy's admin token (default: $SPANMETER_ADMIN_TOKEN, else admin_token in the "
                        "config file)")
    _config_arg(s)
    _json_arg(s)


def _usd(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"a budget is an amount of US dollars above 0, like 25 or 0.50; "
                                         f"got {text!r}")
    if round(value * 1_000_000) < 1:
        raise argparse.ArgumentTypeError(f"{text} is below one micro-dollar, the ledger's unit")
    return value


def _workers(text: str) -> int | str:
    if text.strip().lower() == "auto":
        return "auto"
    return _positive_int(text)


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"a whole number of at least 1, got {text!r}")
    return n


# --- prices ------------------------------------------------------------------------------


def _prices(args: argparse.Namespace) -> int:
    from proxy.app import _price_source
    from proxy.config import load_settings
    from proxy.ops.prices import describe, refresh
    from proxy.pricing import PriceTable

    if args.refresh:
        path = refresh(args.data_dir)
        print(f"Wrote {path}. The proxy reads it at start-up when the setting prices_file names it.")
        return 0
    if not args.model:
        print("spanmeter prices: name a model (or --refresh)", file=sys.stderr)
        return 2
    if args.config:
        os.environ["SPANMETER_CONFIG"] = args.config
    settings = load_settings()
    table = PriceTable.load(overrides=settings.prices, source=_price_source(settings.prices_file))
    lines = describe(table, args.model, args.provider, settings.prices)
    if lines is None:
        print(f"{args.model}: no known price{f' at {args.provider}' if args.provider else ''}. Add one under "
              "prices: in the config (input and output, USD per million tokens).", file=sys.stderr)
        return 1
    print("\n".join(lines))
    return 0


# --- serve and check-config ------------------------------------------------------------


def _settings(args: argparse.Namespace, **overrides: Any) -> Settings:
    """Settings as serve loads them, or ConfigError (tenant mode: upstream keys included)."""
    from proxy.config import load_settings, unset_keys_problem, unset_upstream_keys
    from proxy.serve.routes import check_upstreams

    if args.config:
        os.environ["SPANMETER_CONFIG"] = args.config
    settings = load_settings(**{k: v for k, v in overrides.items() if v is not None})
    check_upstreams(settings)
    missing = unset_upstream_keys(settings)
    if missing:
        raise ConfigError(unset_keys_problem(missing))
    return settings


def _start_warnings(settings: Settings) -> list[str]:
    from proxy.config import unknown_env_variables, unset_default_keys

    return [*unknown_env_variables(), *unset_default_keys(settings)]


def _serve(args: argparse.Namespace) -> int:
    from aiohttp import web

    from proxy.app import create_app
    from proxy.serve.accesslog import configure_logging

    settings = _settings(args, host=args.host, port=args.port, workers=args.workers)
    if settings.workers > 1:
        return _serve_workers(settings)
    socks = _bind(settings.host, settings.port)  # before saying "listening": a busy port is refused here
    stop_logs = configure_logging(settings.log_level, settings.log_format)
    _say_listening(settings, socks[0].getsockname()[1])
    use_uvloop()
    try:
        web.run_app(create_app(settings), sock=socks, print=None, handler_cancellation=True, access_log=None)
    finally:
        stop_logs()
    return 0


def _say_listening(settings: Settings, port: int) -> None:
    mode = "open mode (no tenants: callers' own provider keys pass through)" if settings.open_mode else \
        f"{len(settings.tenants)} tenant(s)"
    where = f"http://{_url_host(settings.host)}:{port}"
    workers = f"; {settings.workers} workers" if settings.workers > 1 else ""
    banner = f"spanmeter listening on {where} - {mode}; ledger {_redact_url(settings.ledger)}{workers}"
    if settings.log_format == "json":
        # A pipeline that merges stdout with stderr reads one JSON object per line, this one too.
        banner = _json_line("INFO", banner, {"url": where, "port": port, "workers": settings.workers})
    print(banner, flush=True)
    log.info("started (version %s): listening on %s, %s; ledger %s; admin API %s%s", _version(), where, mode,
             _redact_url(settings.ledger), "on" if settings.admin_token else "off", workers)
    if settings.fail_open:
        log.warning("fail_open is on: calls are served unmetered, with no ceilings, while the ledger is down")
    for warning in _start_warnings(settings):
        log.warning("%s", warning)


def _serve_workers(settings: Settings) -> int:
    """A supervisor and `settings.workers` worker processes on one port (proxy/ops/workers.py)."""
    probe = _bind(settings.host, settings.port, listen=False)  # anything on the port, ours or not: exit 2 here
    addresses = [(s.family, s.getsockname()) for s in probe]
    for sock in probe:
        sock.close()
    reserved = _reserve(settings.host, addresses)
    # Imported before the first fork: the workers share these pages and start at once.
    import proxy.app  # noqa: F401
    from proxy.ops.workers import Supervisor
    from proxy.serve.accesslog import JsonFormatter, TextFormatter

    # The supervisor forks at any time, so it keeps no thread: its few lines are written directly.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if settings.log_format == "json" else TextFormatter())
    root = logging.getLogger()
    for old in root.handlers[:]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(settings.log_level)
    try:
        supervisor = Supervisor(settings, reserved)
        _say_listening(settings, supervisor.port)
        return supervisor.run()
    finally:
        for sock in reserved:
            sock.close()


def _bind(host: str, port: int, *, listen: bool = True) -> list[socket.socket]:
    """Listening sockets for host:port (every address the name resolves to), or ConfigError.
    `listen=False`: bound only (a probe that the port is free)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(f"Cannot listen on {host}: the name does not resolve ({exc.strerror}). Set --host or "
                          "SPANMETER_HOST to an address of this machine, such as 127.0.0.1 or 0.0.0.0.") from None
    socks: list[socket.socket] = []
    seen: set[tuple[Any, ...]] = set()
    try:
        for family, kind, proto, _, addr in infos:
            if (family, addr) in seen:
                continue
            seen.add((family, addr))
            sock = socket.socket(family, kind, proto)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(addr)
            if listen:
                sock.listen(1024)
    except OSError as exc:
        for sock in socks:
            sock.close()
        raise ConfigError(_bind_problem(host, port, exc)) from None
    return socks


def _reserve(host: str, addresses: Sequence[tuple[int, Any]]) -> list[socket.socket]:
    """Bound, not listening, SO_REUSEPORT sockets on these exact addresses: they hold the
    port for the workers, who listen on their own SO_REUSEPORT sockets beside them."""
    socks: list[socket.socket] = []
    try:
        for family, addr in addresses:
            sock = socket.socket(family, socket.SOCK_STREAM)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(addr)
    except OSError as exc:
        for sock in socks:
            sock.close()
        raise ConfigError(_bind_problem(host, int(addresses[0][1][1]), exc)) from None
    return socks


def _bind_problem(host: str, port: int, exc: OSError) -> str:
    where = f"port {port} on {host}"
    if exc.errno == errno.EADDRINUSE:
        return (f"Cannot listen on {where}: the port is already in use, by another spanmeter or another "
                f"program (`ss -ltnp 'sport = :{port}'` shows which). Stop it, or choose another port with "
                "--port or SPANMETER_PORT.")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return (f"Cannot listen on {where}: permission denied (ports below 1024 need privileges). Choose a "
                "port above 1024 with --port or SPANMETER_PORT, and put a load balancer in front if needed.")
    if exc.errno == errno.EADDRNOTAVAIL:
        return (f"Cannot listen on {where}: {host} is not an address of this machine. Use one of its "
                "addresses, 127.0.0.1, or 0.0.0.0 for all of them (--host or SPANMETER_HOST).")
    return f"Cannot listen on {where}: {exc.strerror or exc}."


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _redact_url(url: str) -> str:
    """A ledger URL with any password replaced (redis://:secret@host)."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))


def _config_reference(args: argparse.Namespace) -> int:
    from proxy.ops.docgen import render_config_reference, render_otel_variables

    print("# spanmeter configuration reference\n\nSettings come from the YAML file named by SPANMETER_CONFIG "
          "(nested as written), or each from its environment variable (nested fields joined with `__`), which "
          "wins.\n")
    print(render_config_reference())
    print("## Standard OpenTelemetry variables\n")
    print(render_otel_variables())
    return 0


def _check_config(args: argparse.Namespace) -> int:
    from proxy.config import load_settings, unset_keys_problem, unset_upstream_keys
    from proxy.serve.routes import check_upstreams

    if args.config:
        os.environ["SPANMETER_CONFIG"] = args.config
    settings = load_settings()
    check_upstreams(settings)
    print(_describe(settings))
    missing = unset_upstream_keys(settings)
    if missing:
        print(f"\n{unset_keys_problem(missing)}", file=sys.stderr)
        return 2
    for warning in _start_warnings(settings):
        print(f"warning: {warning}")
    print("\nspanmeter serve would start with this configuration.")
    return 0


def _describe(settings: Settings) -> str:
    from proxy.serve.routes import upstream
    from tracing.setup import ENV_ENDPOINT, ENV_TRACES_ENDPOINT
    from tracing.summaries import money

    def usd_or_none(v: float | None) -> str:
        return money(v) if v is not None else "none"

    source = os.environ.get("SPANMETER_CONFIG")
    otlp = settings.otlp_endpoint or os.environ.get(ENV_TRACES_ENDPOINT) or os.environ.get(ENV_ENDPOINT)
    exporters = []
    if otlp:
        exporters.append(f"OTLP/HTTP to {otlp}")
    if settings.local_traces or not otlp:
        exporters.append(f"local span files in {Path(settings.data_dir) / 'traces'} (for `spanmeter runs`)")
    lines = [
        f"config file   {Path(source).absolute() if source else 'none (defaults and SPANMETER_* variables)'}",
        f"listen        http://{_url_host(settings.host)}:{settings.port}"
        + (f", {settings.workers} worker processes (a supervisor restarts any that dies)"
           if settings.workers > 1 else ", one process"),
        "mode          " + ("open: no tenants, each caller's own provider key goes upstream (loopback only)"
                            if settings.open_mode else f"tenants: {', '.join(sorted(settings.tenants))}"),
        f"ledger        {_redact_url(settings.ledger)} ("
        + ("fail open: serves unmetered while the ledger is down" if settings.fail_open
           else "fail closed: 503 while the ledger is down") + ")",
        f"budgets       calendar days and months in {settings.timezone}; runs end after "
        f"{settings.run_idle_timeout_s:g} s idle",
        "admin API     " + ("on (admin_token set)" if settings.admin_token else "off (no admin_token)"),
        f"exporters     {'; '.join(exporters)}",
        f"logs          {settings.log_level}, {settings.log_format}, to stderr",
        f"unknown paths {'forwarded unmetered (allow_passthrough)' if settings.allow_passthrough else '404'}",
        "",
        "upstreams",
    ]
    rows: list[tuple[str, ...]] = [("NAME", "API", "BASE URL", "KEY VARIABLE", "")]
    base = {"openai": settings.openai_base_url, "anthropic": settings.anthropic_base_url,
            "gemini": settings.gemini_base_url}
    for dialect, url in base.items():
        var = settings.upstream_keys.get(dialect)
        rows.append(("(default)", dialect, url, *(_key_state(var) if not settings.open_mode
                                                  else ("caller's own key", ""))))
    # Vertex AI: no key of its own by default; its host is the location each call names.
    vertex_var = settings.upstream_keys.get("vertex")
    rows.append(("(default)", "vertex", settings.vertex_base_url or "https://{location}-aiplatform.googleapis.com",
                 *(("caller's own token", "") if settings.open_mode else _key_state(vertex_var) if vertex_var
                   else ("Application Default Credentials", ""))))
    for tenant_name, t in sorted(settings.tenants.items()):
        for dialect, var in sorted(t.upstream_keys.items()):
            if not t.upstream and dialect in base:
                rows.append((f"(tenant {tenant_name})", dialect, base[dialect], *_key_state(var)))
    if settings.azure_openai_base_url:
        rows.append(("(default)", "azure", settings.azure_openai_base_url,
                     *(_key_state(settings.upstream_keys.get("azure")) if not settings.open_mode
                       else ("caller's own key", ""))))
    for name in sorted(settings.upstreams):
        up = upstream(settings, name)
        if up is not None:
            rows.append((name, up.dialect, up.base_url or "", *_key_state(up.key_env)))
    lines += _table(rows, indent="  ")
    rows = []
    lines += ["", "ceilings and budgets (tenant over global policy over defaults; admin budgets in the "
                  "ledger win over these)"]
    rows.append(("TENANT", "KEYS", "UPSTREAM", "CALLS/RUN", "COST/RUN", "DAILY", "MONTHLY", "GUARD", "REPAIR"))
    for name in sorted(settings.tenants) or ["default"]:
        tc = settings.tenants.get(name)
        p = settings.policy_for(name)
        guard = f"{p.guard.action} at {p.guard.threshold}" if p.guard.action != "off" else "off"
        rows.append((name, str(len(tc.keys)) if tc else "-", (tc.upstream if tc else None) or "-",
                     str(p.runs.max_llm_calls or "none"), usd_or_none(p.runs.max_cost_usd),
                     usd_or_none(p.budgets.daily_usd), usd_or_none(p.budgets.monthly_usd), guard,
                     f"{p.repair.mode}, invalid: {p.repair.on_invalid}"))
    lines += _table(rows, indent="  ")
    return "\n".join(lines)


def _key_state(var: str | None) -> tuple[str, str]:
    if not var:
        return "none (no key sent)", ""
    if var not in os.environ:
        return var, "NOT SET"
    return var, "set" if os.environ[var] else "set, empty (no key sent)"


def _table(rows: Sequence[Sequence[str]], indent: str = "") -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [(indent + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True))).rstrip() for r in rows]


# --- simulator, demo, runs ---------------------------------------------------------------


def _simulate(args: argparse.Namespace) -> None:
    if args.scenarios:
        from proxy.simulator.script import render_scenarios

        print(render_scenarios())
        return
    from aiohttp import web

    from proxy.simulator import create_simulator

    socks = _bind(args.host, args.port)
    port = socks[0].getsockname()[1]
    print(f"spanmeter simulator on http://{_url_host(args.host)}:{port} (`spanmeter simulate --scenarios` lists "
          "what it can do)", flush=True)
    use_uvloop()
    web.run_app(create_simulator(), sock=socks, print=None, access_log=None)


def _demo(args: argparse.Namespace) -> int:
    from proxy.ops.demo import run_demo

    return asyncio.run(run_demo(args.data_dir))


def _runs(args: argparse.Namespace) -> int:
    from tracing.viewer import load_runs, render_runs_table, run_spans, run_trees

    traces = Path(args.data_dir) / "traces"
    if args.unused_tools:
        return _unused_tools(args, traces)
    if args.run_id:
        trees = run_trees(args.run_id, traces, tenant=args.tenant)
        if not trees:
            whose = f" of tenant {args.tenant}" if args.tenant else ""
            print(f"No run {args.run_id!r}{whose} in {traces}. `spanmeter runs` lists the runs there; "
                  "--data-dir picks another data directory.", file=sys.stderr)
            return 1
        return _one_run(args, trees, run_spans(args.run_id, traces, tenant=args.tenant))
    runs = [r for r in load_runs(traces, limit=10**9) if args.tenant in (None, r.tenant)
            and args.agent in (None, r.agent)][: args.limit]
    if args.json:
        print(json.dumps([_run_json(r) for r in runs], indent=2))
    elif runs:
        print(render_runs_table(runs))
    elif args.tenant:
        print(f"No runs for tenant {args.tenant} in {traces}.")
    else:
        print(f"No runs recorded yet in {traces}: the proxy writes them there when it runs with this data "
              "directory and local_traces on (the default).")
    return 0


def _one_run(args: argparse.Namespace, trees: list[str], spans: list[tuple[str, list[dict[str, Any]]]]) -> int:
    """The run's tree and its anatomy (one per tenant with a run of this id)."""
    from tracing.anatomy_view import anatomy_of_spans, render_anatomy
    from tracing.viewer import summary_of

    if args.json:
        print(json.dumps([_run_json(summary_of(args.run_id, ss)) | {"anatomy": anatomy_of_spans(ss)}
                          for _, ss in spans], indent=2))
        return 0
    out = []
    for tree, (_, ss) in zip(trees, spans, strict=True):
        ra = anatomy_of_spans(ss)
        out.append(tree + ("\n\n" + render_anatomy(ra) if ra is not None else ""))
    print("\n\n".join(out))
    return 0


def _unused_tools(args: argparse.Namespace, traces: Path) -> int:
    from tracing.anatomy_view import render_unused, unused_tools
    from tracing.viewer import agent_anatomies

    if not args.agent:
        print("--unused-tools needs --agent NAME: the tools are those one agent (X-Agent-Name) declares across "
              "its runs. `spanmeter runs` shows each run's agent.", file=sys.stderr)
        return 2
    found = unused_tools(agent_anatomies(traces, args.agent, tenant=args.tenant), args.limit)
    print(json.dumps({"agent": args.agent, **found}, indent=2) if args.json else render_unused(args.agent, found))
    return 0


def _run_json(r: Any) -> dict[str, Any]:
    return {"run_id": r.run_id, "tenant": r.tenant, "start_ns": r.start_ns, "end_ns": r.end_ns, "calls": r.calls,
            "refused_calls": r.refused,
            "tool_calls": r.tool_calls, "tokens": r.tokens, "cost_usd": round(r.cost_usd, 6),
            "failures": r.failures, "status": r.status}


# --- keys --------------------------------------------------------------------------------


def _keys_create(args: argparse.Namespace) -> None:
    from proxy.config import hash_key
    from proxy.serve.tenants import new_key

    key = new_key()
    digest = hash_key(key)
    if args.json:
        print(json.dumps({"tenant": args.tenant, "key": key, "sha256": digest, "key_id": digest[:8]}))
        return
    print(f"New key for tenant {args.tenant!r} (shown once; spanmeter stores only its hash):\n\n  {key}\n")
    print("Add the hash to the config file named by SPANMETER_CONFIG (as it is, this is a whole config: the "
          "proxy then needs only the key of the provider you call, e.g. OPENAI_API_KEY, in its environment):\n")
    print(f"tenants:\n  {args.tenant}:\n    keys:\n      - {digest}")


def _keys_list(args: argparse.Namespace) -> int:
    from proxy.config import load_settings

    if args.config:
        os.environ["SPANMETER_CONFIG"] = args.config
    settings = load_settings()
    rows = [(name, k.key_id, k.hash) for name, t in sorted(settings.tenants.items()) for k in t.key_configs()]
    if args.json:
        print(json.dumps([{"tenant": t, "key_id": k, "sha256": h} for t, k, h in rows], indent=2))
    elif settings.open_mode:
        print("No tenants configured: open mode (callers' own provider keys pass through). "
              "`spanmeter keys create --tenant NAME` makes a key for a tenant.")
    else:
        keyless = sorted(n for n, t in settings.tenants.items() if not t.keys)
        print("\n".join(_table([("TENANT", "KEY ID", "SHA256"), *rows])))
        if keyless:
            print(f"\nTenants with no key (no one can call as them): {', '.join(keyless)}")
    return 0


# --- admin API commands ------------------------------------------------------------------


class _AdminError(Exception):
    """The admin API could not be asked, or said no: exit 1."""


class _UsageError(_AdminError):
    """The command as given cannot be sent: exit 2."""


def _admin_token(args: argparse.Namespace) -> str:
    """The token as the proxy reads it: --token, else SPANMETER_ADMIN_TOKEN, else `admin_token`
    in the config file (--config or SPANMETER_CONFIG)."""
    if args.token:
        return str(args.token)
    from proxy.config import load_settings

    if args.config:
        os.environ["SPANMETER_CONFIG"] = args.config
    token = load_settings().admin_token
    if not token:
        where = os.environ.get("SPANMETER_CONFIG")
        read = f"the config file {where} has no `admin_token:`" if where else "no config file is named"
        raise _UsageError(
            f"No admin token: SPANMETER_ADMIN_TOKEN is not set and {read}. The admin API needs the token the "
            "proxy was started with: put `admin_token: ...` in the config file both read (SPANMETER_CONFIG, or "
            "--config here), or set SPANMETER_ADMIN_TOKEN in the proxy's environment and here, or pass --token.")
    return token


def _admin(args: argparse.Namespace, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
    token = _admin_token(args)
    req = urllib.request.Request(args.url.rstrip("/") + path, method=method,
                                 data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Authorization": f"Bearer {token}",
                                          "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        raise _AdminError(f"spanmeter at {args.url} answered {exc.code}: {_error_text(exc.read())}") from None
    except urllib.error.URLError as exc:
        raise _AdminError(f"Cannot reach spanmeter at {args.url}: {exc.reason}. Is the proxy running there? "
                          "Pass --url or set SPANMETER_URL.") from None
    except (TimeoutError, ValueError) as exc:
        raise _AdminError(f"No usable answer from spanmeter at {args.url}: {exc}") from None


def _error_text(raw: bytes) -> str:
    """The message out of an error body in any of the dialects spanmeter answers in."""
    try:
        body = json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")[:500]
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return str(err["message"])
        if isinstance(body.get("message"), str):
            return str(body["message"])
    return json.dumps(body)[:500]


def _admin_command(fn: Any) -> Any:
    def run(args: argparse.Namespace) -> int:
        try:
            fn(args)
        except _UsageError as exc:
            print(exc, file=sys.stderr)
            return 2
        except _AdminError as exc:
            print(exc, file=sys.stderr)
            return 1
        return 0

    return run


@_admin_command
def _spend(args: argparse.Namespace) -> None:
    from tracing.summaries import money

    query = {"tenant": args.tenant, **({"run": args.run} if args.run else {})}
    spend = _admin(args, "GET", "/admin/spend?" + urllib.parse.urlencode(query))
    budgets = _admin(args, "GET", f"/admin/budgets/{urllib.parse.quote(args.tenant, safe='')}")
    if args.json:
        print(json.dumps({**spend, "budgets": budgets}, indent=2))
        return

    def left(spent: float, budget: float | None) -> str:
        return money(max(0.0, budget - spent)) if budget is not None else "-"

    rows = [("SCOPE", "PERIOD", "SPENT", "BUDGET", "LEFT", "CALLS"),
            ("day", spend["day"], money(spend["day_usd"]), _budget(budgets["daily_usd"]),
             left(spend["day_usd"], budgets["daily_usd"]), "-"),
            ("month", spend["month"], money(spend["month_usd"]), _budget(budgets["monthly_usd"]),
             left(spend["month_usd"], budgets["monthly_usd"]), "-")]
    if args.run:
        calls = spend.get("run_calls", 0)
        rows.append(("run", args.run, money(spend["run_usd"]), "", "", f"{calls} model call{'s' * (calls != 1)}"))
    print(f"Spend of tenant {spend['tenant']} (spent includes calls in flight)")
    print("\n".join(_table(rows)))
    # The ledger counts calls per run (for the run ceilings), not per day or month.
    print("CALLS: counted per run (--run RUN); per day or month, count gen_ai_client_operation_duration_seconds_count "
          "on /metrics")


def _budget(v: float | None) -> str:
    from tracing.summaries import money

    return money(v) if v is not None else "none"


@_admin_command
def _budget_set(args: argparse.Namespace) -> None:
    body: dict[str, Any] = {}
    if args.daily_usd is not None or args.clear_daily:
        body["daily_usd"] = None if args.clear_daily else args.daily_usd
    if args.monthly_usd is not None or args.clear_monthly:
        body["monthly_usd"] = None if args.clear_monthly else args.monthly_usd
    if not body:
        raise _UsageError("Nothing to change: give --daily-usd, --monthly-usd, --clear-daily or --clear-monthly "
                          "(`spanmeter budget get` shows the budgets).")
    _print_budgets(args, _admin(args, "PUT", f"/admin/budgets/{urllib.parse.quote(args.tenant, safe='')}", body))


@_admin_command
def _budget_get(args: argparse.Namespace) -> None:
    _print_budgets(args, _admin(args, "GET", f"/admin/budgets/{urllib.parse.quote(args.tenant, safe='')}"))


def _print_budgets(args: argparse.Namespace, b: dict[str, Any]) -> None:
    if args.json:
        print(json.dumps(b, indent=2))
        return
    sources = b.get("sources") or {}
    config = b.get("config") or {}
    rows = [("TENANT", "WINDOW", "BUDGET", "FROM")]
    for window, field in (("daily", "daily_usd"), ("monthly", "monthly_usd")):
        src = sources.get(field, b.get("source", ""))
        if src == "admin":
            under = config.get(field)
            src = "admin API" + (f" (config: {_budget(under)})" if under is not None else " (config: none)")
        elif b.get(field) is None:
            src = "-"
        else:
            src = "config file"
        rows.append((b["tenant"], window, _budget(b.get(field)), src))
    print("\n".join(_table(rows)))



# --- ledger --------------------------------------------------------------------------------


def _ledger_migrate(args: argparse.Namespace) -> int:
    from proxy.errors import StoreUnavailable
    from proxy.ledger.redis_migrate import migrate_keys

    url = args.ledger
    if url is None:
        from proxy.config import load_settings

        if args.config:
            os.environ["SPANMETER_CONFIG"] = args.config
        url = load_settings().ledger
    try:
        report = asyncio.run(migrate_keys(url, dry_run=args.dry_run))
    except StoreUnavailable as exc:
        print(exc.message, file=sys.stderr)
        return 1
    where = _redact_url(url)
    if not report.changed:
        print(f"Nothing to migrate: the ledger at {where} has no keys in the layout before hash tags.")
    else:
        kinds = ", ".join(f"{n} {kind}" for kind, n in sorted((report.moved + report.merged).items()))
        verb = "would move" if args.dry_run else "moved"
        print(f"{'Dry run: ' if args.dry_run else ''}The ledger at {where}: {verb} {report.reservations} "
              f"reservation(s) of calls in flight, {report.active_runs} active run(s) and "
              f"{sum(report.moved.values())} other key(s) ({kinds or 'none'}) of {len(report.tenants)} tenant(s)"
              + (f"; {sum(report.merged.values())} merged into keys a new proxy had written" if report.merged
                 else "") + ".")
    if report.left:
        print(f"Left alone, not spanmeter's keys as it knows them: {', '.join(sorted(report.left)[:10])}"
              + (" ..." if len(report.left) > 10 else ""), file=sys.stderr)
    return 0
