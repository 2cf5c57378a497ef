"""The composition root: create_app(settings) wires the model routes, the MCP route and the admin
API. Resources live in cleanup contexts under AppKeys."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, Final

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from proxy.anatomy import Splits
from proxy.config import Settings
from proxy.errors import ProxyError
from proxy.govern.caching import PrefixMemory
from proxy.govern.ceilings import Plans
from proxy.govern.runs import Runs
from proxy.ledger.backends import open_store
from proxy.ledger.failopen import FailOpenStore
from proxy.ledger.store import Store
from proxy.mcp.route import MCP_PREFIX, handle_mcp
from proxy.pricing import PriceTable
from proxy.pricing.source import PriceSource
from proxy.providers.apis import answering
from proxy.providers.translator import Api, error_headers
from proxy.serve import accesslog, admin
from proxy.serve.appkeys import (
    AWS_SIGNER,
    BACKGROUND,
    CLOUD_TOKEN,
    DEPLOYMENTS,
    KEYS,
    PLANS,
    PREFIXES,
    PRICES,
    RUNS,
    SETTINGS,
    SPLITS,
    STORE,
    TEL,
    UPSTREAM,
)
from proxy.serve.aws_sign import AwsSigner
from proxy.serve.background import Background
from proxy.serve.bookkeeping import flush_anatomy
from proxy.serve.cloud_token import CloudToken
from proxy.serve.deployments import Deployments
from proxy.serve.handler import handle_call
from proxy.serve.routes import check_upstreams, match, unknown_route
from proxy.serve.siblings import WORKER, WORKER_ATTRIBUTE, Worker, gather_metrics, worker_ctx
from proxy.serve.tenants import KeyIndex
from proxy.serve.upstream import Upstream
from tracing.setup import Telemetry, TelemetryConfig, setup_telemetry

__all__ = ["create_app"]

log = logging.getLogger("spanmeter")
# The API a request's errors are answered in. aiohttp 3.14 added typed request keys and
# warns on a str key; the releases before it (down to our floor) take a str.
ANSWERING_API: Final[Any] = (web.RequestKey("answering_api", Api) if hasattr(web, "RequestKey")
                             else "spanmeter.answering_api")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class _NoRequestBytesInLogs(logging.Filter):
    """aiohttp logs a request it cannot parse with the offending bytes and a traceback; an
    over-long header may be an Authorization header. Keep the event, drop the bytes."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            record.msg, record.args = "rejected an unparsable HTTP request: %s %s", (exc.code, type(exc).__name__)
            record.exc_info, record.exc_text = None, None
        elif isinstance(exc, RequestPayloadError):
            # The caller already has its 400 (e.g. a body labelled gzip that is not gzip);
            # aiohttp then fails to drain the rest and closes the connection. Not our fault.
            record.msg, record.args = "closed a connection whose request body could not be read: %s", (
                type(exc.__cause__ or exc).__name__,)
            record.exc_info, record.exc_text = None, None
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


_REDACT_PARSE_ERRORS = _NoRequestBytesInLogs()


def create_app(
    settings: Settings, *, store: Store | None = None, telemetry: Telemetry | None = None,
    worker: Worker | None = None,
) -> web.Application:
    """The proxy application. Tests inject a store or telemetry instead of patching.
    `worker`: this process is one of `spanmeter serve --workers N` (proxy/ops/workers.py)."""
    logging.getLogger("aiohttp.server").addFilter(_REDACT_PARSE_ERRORS)  # idempotent
    app = web.Application(middlewares=[_errors], client_max_size=settings.max_body_bytes + 1)
    check_upstreams(settings)
    app[SETTINGS] = settings
    app[KEYS] = KeyIndex(settings)
    app[PRICES] = PriceTable.load(overrides=settings.prices, source=_price_source(settings.prices_file))
    app[DEPLOYMENTS] = Deployments(settings.azure_deployments)
    app[PLANS] = Plans()
    app[CLOUD_TOKEN] = CloudToken()  # no I/O until a call needs a token
    app[AWS_SIGNER] = AwsSigner()  # the same: credentials are loaded when a Bedrock call needs them
    app.cleanup_ctx.append(_store_ctx(store))
    app.cleanup_ctx.append(_telemetry_ctx(telemetry))
    app.cleanup_ctx.append(_upstream_ctx)
    app.cleanup_ctx.append(_runs_ctx)
    app.cleanup_ctx.append(_background_ctx)  # last in, first out: drained before the store closes
    app.cleanup_ctx.append(_gc_ctx)  # after everything it freezes was built
    if worker is not None:
        app[WORKER] = worker
        app.cleanup_ctx.append(worker_ctx)  # its private /metrics port, and the client for the siblings'
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/readyz", _readyz)
    app.router.add_get("/metrics", _metrics)
    app.router.add_post("/runs/{run_id}/end", admin.end_run)
    admin.add_routes(app)
    app.router.add_route("*", "/{tail:.*}", _dispatch)
    return app


async def _dispatch(request: web.Request) -> web.StreamResponse:
    if request.raw_path.startswith(MCP_PREFIX):
        return await handle_mcp(request)  # routes.match there too; its errors are JSON-RPC errors
    # The path exactly as sent, not aiohttp's decoded `request.path`: what is matched and
    # metered must be byte for byte what goes upstream.
    try:
        path, _, query = request.raw_path.partition("?")
        route = match(path, query)
    except ProxyError:
        request[ANSWERING_API] = _answering(request)  # the refusal is answered and logged in it
        raise
    api, upstream_name = route.api, route.upstream_name
    request.match_info["tail"] = route.path.removeprefix("/")
    # The API errors are answered in: the route's, guessed only off the metered routes.
    request[ANSWERING_API] = api if api is not None else _answering(request)
    if api is not None and request.method == "POST":
        return await handle_call(request, api, upstream_name)
    if (request.method == "GET" and route.path == "/v1/models") or request.app[SETTINGS].allow_passthrough:
        return await admin.passthrough(request, request[ANSWERING_API], upstream_name)
    raise unknown_route(request.method, request.path)


def _answering(request: web.Request) -> Api:
    return answering(request.path, request.headers)


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    token = accesslog.request_started()
    try:
        return await handler(request)
    except ProxyError as exc:
        _log_error(request, exc)
        return render(request, exc)
    except web.HTTPException as exc:
        if exc.status == 404:
            not_found = unknown_route(request.method, request.path)
            _log_error(request, not_found)
            return render(request, not_found)
        raise
    except Exception:
        log.exception("unexpected failure serving %s %s", request.method, request.path)
        error = ProxyError("spanmeter failed unexpectedly while serving this call; the failure is in its log. "
                           "Nothing was charged for a call that was not forwarded.")
        _log_error(request, error)
        return render(request, error)
    finally:
        accesslog.request_finished(token)


def _log_error(request: web.Request, exc: ProxyError) -> None:
    """The access line of a request that failed before a call was admitted (after that, the
    call's own line, written by its bookkeeping or the refusal path, says it)."""
    if accesslog.request_logged():
        return
    api = request.get(ANSWERING_API)
    if api is None:  # the admin API and run control: not a model call
        log.log(logging.ERROR if exc.status >= 500 else logging.INFO, "%s %s answered %d %s: %s",
                request.method, json.dumps(request.path), exc.status, exc.error_type, exc.message)
        return
    accesslog.before_call(api.api, exc.status, exc.error_type, exc.message)


def render(request: web.Request, exc: ProxyError) -> web.Response:
    api: Api = request.get(ANSWERING_API) or _answering(request)
    request_id = "req_" + uuid.uuid4().hex[:24]
    headers = {**exc.headers(), **error_headers(api, exc), "x-request-id": request_id}
    response = web.Response(body=api.render_error(exc, request_id), status=exc.status,
                            content_type="application/json", headers=headers)
    if request.content.exception() is not None:
        # The body broke on the way in (labelled gzip, not gzip): the rest of it cannot be
        # read past, so say the connection closes rather than let the client reuse it.
        response.force_close()
    return response


def _store_ctx(injected: Store | None) -> Callable[[web.Application], AsyncIterator[None]]:
    async def ctx(app: web.Application) -> AsyncIterator[None]:
        settings = app[SETTINGS]
        if injected is None and settings.ledger.startswith("sqlite:///"):
            path = settings.ledger.removeprefix("sqlite:///").partition("?")[0]
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        store = injected or open_store(settings.ledger, leases=settings.ledger_leases)
        app[STORE] = FailOpenStore(store) if settings.fail_open else store
        yield
        if injected is None:
            await store.aclose()

    return ctx


def _telemetry_ctx(injected: Telemetry | None) -> Callable[[web.Application], AsyncIterator[None]]:
    async def ctx(app: web.Application) -> AsyncIterator[None]:
        s = app[SETTINGS]
        traces = Path(s.data_dir) / "traces"
        worker = app.get(WORKER)
        resource: dict[str, str] = {}
        if worker is not None:  # one span file per worker; the resource says which worker
            traces = traces / f"worker-{worker.index}"
            resource = {WORKER_ATTRIBUTE: str(worker.index), "process.pid": str(os.getpid())}
        app[TEL] = tel = injected or setup_telemetry(TelemetryConfig.from_env(
            otlp_endpoint=s.otlp_endpoint,
            push_metrics=s.otlp_metrics,
            project_name=s.project_name,
            local_dir=str(traces) if s.local_traces else None, export_process=s.export_process,
            known_model=_priced_name(app[PRICES]), resource_attributes=resource))
        yield
        if injected is None:
            # Shutdown flushes exporters and may block up to their timeout: not on the loop.
            await asyncio.get_running_loop().run_in_executor(None, tel.shutdown)

    return ctx


def _price_source(path: str | None) -> PriceSource | None:
    """A refreshed genai-prices file (`spanmeter prices --refresh`), else None: the installed data."""
    if not path:
        return None
    from proxy.pricing.compiler import from_snapshot  # genai-prices' types: only when a refreshed file is named

    return from_snapshot(Path(path).read_bytes())


def _priced_name(prices: PriceTable) -> Callable[[str], str | None]:
    """For metric labels: the price table's name of a model, None when it has no price."""
    def name(model: str) -> str | None:
        price = prices.price(model)
        return price.model if price is not None else None

    return name


async def _upstream_ctx(app: web.Application) -> AsyncIterator[None]:
    s = app[SETTINGS]
    app[UPSTREAM] = up = Upstream(connect_timeout_s=s.connect_timeout_s, read_timeout_s=s.read_timeout_s,
                                  max_connections=s.max_connections)
    await up.start()
    yield
    await up.aclose()


async def _runs_ctx(app: web.Application) -> AsyncIterator[None]:
    app[RUNS] = runs = Runs(app[STORE], app[TEL], app[SETTINGS].run_idle_timeout_s)
    runs.start_sweeper()
    yield
    await runs.stop_sweeper()


async def _background_ctx(app: web.Application) -> AsyncIterator[None]:
    app[BACKGROUND] = background = Background()
    app[PREFIXES] = PrefixMemory()
    app[SPLITS] = splits = Splits()
    flusher = None
    if app[SETTINGS].anatomy:
        app[RUNS].before_end = lambda tenant, run_id: flush_anatomy(app, splits.of_run(tenant, run_id))
        flusher = asyncio.get_running_loop().create_task(_flush_idle_chains(app, splits))
    yield
    if flusher is not None:
        flusher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await flusher
    await background.drain()
    await flush_anatomy(app, splits.idle(float("inf")))  # the store is still open


# How long a run's calls pause before what its tool results cost is added to its totals on
# its own (proxy/anatomy/shares.py): well under any run's idle end.
ANATOMY_IDLE_S = 1.0


async def _flush_idle_chains(app: web.Application, splits: Splits) -> None:
    while True:
        await asyncio.sleep(ANATOMY_IDLE_S)
        try:
            flushed = splits.idle(time.monotonic() - ANATOMY_IDLE_S)
            if flushed:
                await flush_anatomy(app, flushed)
        except Exception:
            log.warning("could not flush the cost anatomy of idle runs; will retry", exc_info=True)


# Young-generation threshold while serving. A call allocates a few thousand container
# objects that nearly all die by reference counting; at Python's 700 the collector ran
# several times per call, each pass walking whatever was alive in flight.
GC_GEN0_THRESHOLD = 20_000


async def _gc_ctx(app: web.Application) -> AsyncIterator[None]:
    """Start-up built hundreds of thousands of long-lived objects (imported modules, the
    price table, pydantic models, the OpenTelemetry SDK); freezing them keeps every later
    full collection from walking them again. Undone at shutdown so a test process that
    builds many apps does not accumulate frozen garbage."""
    if not app[SETTINGS].gc_tuning:
        yield
        return
    previous = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(GC_GEN0_THRESHOLD, previous[1], previous[2])
    try:
        yield
    finally:
        gc.set_threshold(*previous)
        gc.unfreeze()


async def _healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def _readyz(request: web.Request) -> web.Response:
    try:
        await request.app[STORE].ping()
    except ProxyError as exc:
        return web.json_response({"status": "unavailable", "ledger": exc.message}, status=503)
    return web.json_response({"status": "ready"})


async def _metrics(request: web.Request) -> web.Response:
    headers = {"Content-Type": "text/plain; version=0.0.4; charset=utf-8"}
    worker = request.app.get(WORKER)
    if worker is not None:  # one of N workers: every worker's metrics, merged
        body = await gather_metrics(request.app)
        headers["x-spanmeter-worker"] = str(worker.index)  # which one answered
    else:
        # Collecting every series takes ~10 ms: off the event loop, so calls are not held up.
        body = await asyncio.get_running_loop().run_in_executor(None, request.app[TEL].metrics_text)
    return web.Response(body=body, headers=headers)

