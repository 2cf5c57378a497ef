"""spanmeter serve | demo | simulate | runs | keys | spend | budget"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from aiohttp import web

from proxy.errors import ConfigError

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not getattr(args, "fn", None):
        parser.print_help()
        return 2
    try:
        return int(args.fn(args) or 0)
    except ConfigError as exc:
        print(exc.message, file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="spanmeter", description="A proxy and tracer for AI agents.")
    sub = p.add_subparsers(metavar="COMMAND")

    s = sub.add_parser("serve", help="run the proxy (settings from SPANMETER_* env and SPANMETER_CONFIG)")
    s.add_argument("--host")
    s.add_argument("--port", type=int)
    s.add_argument("--config", help="YAML config file (same as SPANMETER_CONFIG)")
    s.set_defaults(fn=_serve)

    s = sub.add_parser("simulate", help="run the simulated model API (all four dialects)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8788)
    s.set_defaults(fn=_simulate)

    s = sub.add_parser("demo", help="offline demo: simulator + proxy + an openai SDK agent loop")
    s.set_defaults(fn=_demo)

    s = sub.add_parser("runs", help="list recent runs, or draw one run as a tree")
    s.add_argument("run_id", nargs="?")
    s.add_argument("--data-dir", default=os.environ.get("SPANMETER_DATA_DIR", ".spanmeter"))
    s.add_argument("--tenant", help="only this tenant's runs")
    s.set_defaults(fn=_runs)

    keys = sub.add_parser("keys", help="tenant keys").add_subparsers(metavar="ACTION")
    s = keys.add_parser("create", help="print a new spanmeter key (once) and the hash to configure")
    s.add_argument("--tenant", required=True)
    s.set_defaults(fn=_keys_create)

    s = sub.add_parser("spend", help="spend of a tenant (admin API)")
    s.add_argument("--tenant", required=True)
    s.add_argument("--run")
    _admin_args(s)
    s.set_defaults(fn=_spend)

    budget = sub.add_parser("budget", help="tenant budgets (admin API)").add_subparsers(metavar="ACTION")
    s = budget.add_parser("set", help="set a tenant's daily/monthly USD budget")
    s.add_argument("--tenant", required=True)
    s.add_argument("--daily-usd", type=float)
    s.add_argument("--monthly-usd", type=float)
    _admin_args(s)
    s.set_defaults(fn=_budget_set)
    s = budget.add_parser("get", help="show a tenant's budgets")
    s.add_argument("--tenant", required=True)
    _admin_args(s)
    s.set_defaults(fn=_budget_get)
    return p


def _admin_args(s: argparse.ArgumentParser) -> None:
    s.add_argument("--url", default=os.environ.get("SPANMETER_URL", "http://127.0.0.1:8787"))
    s.add_argument("--token", default=os.environ.get("SPANMETER_ADMIN_TOKEN"),
                   help="admin token (default: $SPANMETER_ADMIN_TOKEN)")


def _loop_policy() -> None:
    try:
        import uvloop
    except ImportError:
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def _serve(args: argparse.Namespace) -> None:
    from proxy.app import create_app
    from proxy.config import load_settings

    if args.config:
        os.environ["SPANMETER_CONFIG"] = args.config
    overrides = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    settings = load_settings(**overrides)
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    mode = "open mode (no tenants: callers' own provider keys pass through)" if settings.open_mode else \
        f"{len(settings.tenants)} tenant(s)"
    print(f"spanmeter listening on http://{settings.host}:{settings.port} - {mode}; ledger {settings.ledger}",
          flush=True)
    _loop_policy()
    web.run_app(create_app(settings), host=settings.host, port=settings.port, print=None,
                handler_cancellation=True, access_log=None)


def _simulate(args: argparse.Namespace) -> None:
    from proxy.simulator import create_simulator

    print(f"spanmeter simulator on http://{args.host}:{args.port}", flush=True)
    _loop_policy()
    web.run_app(create_simulator(), host=args.host, port=args.port, print=None, access_log=None)


def _demo(args: argparse.Namespace) -> int:
    from proxy.demo import run_demo

    return asyncio.run(run_demo())


def _runs(args: argparse.Namespace) -> None:
    from tracing.viewer import load_runs, render_run_tree, render_runs_table

    traces = Path(args.data_dir) / "traces"
    if args.run_id:
        print(render_run_tree(args.run_id, traces, tenant=args.tenant))
    else:
        runs = [r for r in load_runs(traces) if args.tenant in (None, r.tenant)]
        print(render_runs_table(runs))


def _keys_create(args: argparse.Namespace) -> None:
    from proxy.config import hash_key
    from proxy.tenants import new_key

    key = new_key()
    print(f"New key for tenant {args.tenant!r} (shown once; spanmeter stores only its hash):\n\n  {key}\n")
    print("Add the hash to the config file named by SPANMETER_CONFIG:\n")
    print(f"tenants:\n  {args.tenant}:\n    keys:\n      - {hash_key(key)}")


def _admin(args: argparse.Namespace, method: str, path: str, body: dict[str, Any] | None = None) -> int:
    if not args.token:
        print("Set SPANMETER_ADMIN_TOKEN (or pass --token): the admin API needs it.", file=sys.stderr)
        return 2
    req = urllib.request.Request(args.url.rstrip("/") + path, method=method,
                                 data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Authorization": f"Bearer {args.token}",
                                          "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            print(json.dumps(json.loads(resp.read()), indent=2))
            return 0
    except urllib.error.HTTPError as exc:
        print(f"{exc.code}: {exc.read().decode(errors='replace')}", file=sys.stderr)
    except urllib.error.URLError as exc:
        print(f"cannot reach spanmeter at {args.url}: {exc.reason}", file=sys.stderr)
    return 1


def _spend(args: argparse.Namespace) -> int:
    q = f"?tenant={args.tenant}" + (f"&run={args.run}" if args.run else "")
    return _admin(args, "GET", "/admin/spend" + q)


def _budget_set(args: argparse.Namespace) -> int:
    return _admin(args, "PUT", f"/admin/budgets/{args.tenant}",
                  {"daily_usd": args.daily_usd, "monthly_usd": args.monthly_usd})


def _budget_get(args: argparse.Namespace) -> int:
    return _admin(args, "GET", f"/admin/budgets/{args.tenant}")
