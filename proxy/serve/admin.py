"""Admin API under /admin (admin token), run control for tenants, and pass-through routes."""

from __future__ import annotations

import hmac
from datetime import UTC, datetime
from zoneinfo import ZoneInfo

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from proxy.config import MAX_USD
from proxy.errors import RequestError, Unauthorized
from proxy.govern.runs import read_whole
from proxy.providers.translator import Api
from proxy.serve.appkeys import CLOUD_TOKEN, KEYS, RUNS, SETTINGS, STORE, UPSTREAM
from proxy.serve.cloud_token import authorized
from proxy.serve.routes import target_for
from proxy.serve.tenants import identify, presented_key
from proxy.serve.upstream import forward_url, request_headers, response_headers, unreadable_body

__all__ = ["add_routes", "end_run", "passthrough"]

MAX_RUNS_LISTED = 1000


def add_routes(app: web.Application) -> None:
    r = app.router
    r.add_get("/admin/tenants", _tenants)
    r.add_get("/admin/budgets/{tenant}", _budget_get)
    r.add_put("/admin/budgets/{tenant}", _budget_set)
    r.add_get("/admin/spend", _spend)
    r.add_get("/admin/runs", _runs)
    r.add_get("/admin/runs/{tenant}/{run_id}", _run)


def _require_admin(request: web.Request) -> None:
    token = request.app[SETTINGS].admin_token
    if not token:
        raise Unauthorized("The admin API of this proxy is disabled: it was started with no admin token. Set "
                           "`admin_token:` in the config file it reads (SPANMETER_CONFIG) or SPANMETER_ADMIN_TOKEN in "
                           "its environment, restart it, and send the same token (the spanmeter CLI reads it from "
                           "the same config file or variable, or --token).")
    given = presented_key(request.headers, {}) or ""
    # Constant time: the token is compared byte by byte against a caller-chosen value.
    if not hmac.compare_digest(given.encode(), token.encode()):
        raise Unauthorized("The admin API needs this proxy's admin token (its `admin_token:` setting, or "
                           "SPANMETER_ADMIN_TOKEN) as a Bearer token; the one sent does not match, and tenant keys "
                           "cannot use it.")


def _tenant(request: web.Request) -> str:
    tenant = request.match_info.get("tenant") or request.query.get("tenant")
    settings = request.app[SETTINGS]
    known = set(settings.tenants) or {"default"}
    if tenant not in known:
        raise RequestError(f"Unknown tenant {tenant!r}: no tenant of that name is configured. The configured "
                           f"tenants are {', '.join(sorted(known))}.", param="tenant")
    return tenant


async def _tenants(request: web.Request) -> web.Response:
    _require_admin(request)
    s = request.app[SETTINGS]
    names = sorted(s.tenants) or ["default"]
    return web.json_response({"tenants": [
        {"name": n, "keys": len(s.tenants[n].keys) if n in s.tenants else 0,
         "policy": s.policy_for(n).model_dump(mode="json")} for n in names]})


async def _budget_get(request: web.Request) -> web.Response:
    _require_admin(request)
    tenant = _tenant(request)
    day, month = await request.app[STORE].budget_get(tenant)
    policy = request.app[SETTINGS].policy_for(tenant).budgets
    return web.json_response({
        "tenant": tenant,
        "daily_usd": day / 1e6 if day is not None else policy.daily_usd,
        "monthly_usd": month / 1e6 if month is not None else policy.monthly_usd,
        "source": "admin" if day is not None or month is not None else "config",
        "sources": {"daily_usd": "admin" if day is not None else "config",
                    "monthly_usd": "admin" if month is not None else "config"},
        "config": {"daily_usd": policy.daily_usd, "monthly_usd": policy.monthly_usd}})


async def _budget_set(request: web.Request) -> web.Response:
    _require_admin(request)
    tenant = _tenant(request)
    # A field left out keeps its admin setting; null clears it (the config's value applies).
    current = await request.app[STORE].budget_get(tenant)
    try:
        body = await request.json()
    except ValueError:
        body = None
    except RequestPayloadError as exc:
        raise unreadable_body(exc, request.headers.get("Content-Encoding")) from None
    if not isinstance(body, dict):
        raise RequestError('Send a JSON object: {"daily_usd": number|null, "monthly_usd": number|null}; '
                           "a field left out keeps its setting.")
    day = _usd(body, "daily_usd") if "daily_usd" in body else current[0]
    month = _usd(body, "monthly_usd") if "monthly_usd" in body else current[1]
    await request.app[STORE].budget_set(tenant, day, month)
    return await _budget_get(request)


def _usd(body: dict[str, object], field: str) -> int | None:
    """A budget in micro-USD, within the range the config accepts too; null means "use the config"."""
    v = body.get(field)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float) or not 0 < v <= MAX_USD:
        raise RequestError(f"{field} must be a number of US dollars above 0 and at most {MAX_USD}, or null "
                           f"to use the configured budget; got {str(v)[:40]}.", param=field)
    return round(v * 1_000_000)


async def _spend(request: web.Request) -> web.Response:
    _require_admin(request)
    tenant = _tenant(request)
    s = request.app[SETTINGS]
    today = datetime.now(UTC).astimezone(ZoneInfo(s.timezone))
    day = request.query.get("day", today.strftime("%Y-%m-%d"))
    month = request.query.get("month", today.strftime("%Y-%m"))
    store = request.app[STORE]
    out = {"tenant": tenant, "day": day, "month": month,
           "day_usd": await store.spend(tenant, day=day) / 1e6,
           "month_usd": await store.spend(tenant, month=month) / 1e6}
    if run := request.query.get("run"):
        out["run"] = run
        out["run_usd"] = await store.spend(tenant, run_id=run) / 1e6
        out["run_calls"] = await store.run_calls(tenant, run)
    return web.json_response(out)


async def _runs(request: web.Request) -> web.Response:
    _require_admin(request)
    tenant = request.query.get("tenant")
    limit = _limit(request.query.get("limit", "50"))
    runs = await request.app[STORE].list_runs(tenant, limit)
    return web.json_response({"runs": [run | {"totals": read_whole(run["totals"])} for run in runs]})


def _limit(value: str) -> int:
    n = int(value) if value.isascii() and value.isdigit() and len(value) < 8 else 0
    if not 1 <= n <= MAX_RUNS_LISTED:
        raise RequestError(f"limit must be a whole number from 1 to {MAX_RUNS_LISTED}, got {value[:24]!r}.",
                           param="limit")
    return n


async def _run(request: web.Request) -> web.Response:
    _require_admin(request)
    tenant = _tenant(request)
    run_id = request.match_info["run_id"]
    totals = read_whole(await request.app[STORE].run_totals(tenant, run_id))
    return web.json_response({"tenant": tenant, "run_id": run_id, "totals": totals})


async def end_run(request: web.Request) -> web.Response:
    """POST /runs/{id}/end with the tenant's own key: a tenant can only end its own runs."""
    settings = request.app[SETTINGS]
    caller = identify(request.headers, request.query, settings, request.app[KEYS])
    run_id = request.match_info["run_id"]
    ended = await request.app[RUNS].end(caller.tenant, run_id)
    return web.json_response({"run_id": run_id, "ended": ended})


async def passthrough(request: web.Request, api: Api, upstream_name: str | None) -> web.StreamResponse:
    """Unmetered forwarding: GET /v1/models always, anything else only when allowed."""
    settings = request.app[SETTINGS]
    caller = identify(request.headers, request.query, settings, request.app[KEYS])
    path = request.match_info.get("tail")
    target = await authorized(target_for(settings, api, caller, upstream_name,
                                         "/" + path if path is not None else request.path), request.app[CLOUD_TOKEN])
    url = forward_url(target.base_url, "/" + path if path is not None else request.path,
                      request.rel_url.raw_query_string, presented_key(request.headers, request.query))
    headers = request_headers(request.headers, target.auth)
    if request.method == "GET":
        status, up_headers, body = await request.app[UPSTREAM].get(url, headers)
    else:
        try:
            sent = await request.read()
        except RequestPayloadError as exc:
            raise unreadable_body(exc, request.headers.get("Content-Encoding")) from None
        async with request.app[UPSTREAM].send(url, sent, headers, method=request.method) as up:
            status, up_headers, body = up.status, up.headers, await up.read()
    return web.Response(body=body, status=status, headers=response_headers(up_headers))
