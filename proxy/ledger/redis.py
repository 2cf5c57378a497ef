"""The shared ledger for several replicas: Redis or Redis Cluster, every multi-key step one Lua script.

`redis://`, `rediss://`, `unix://` (one Redis) or `redis+cluster://` (Redis Cluster; Valkey
too). Every key is `sm:{<tenant>}:<kind>:<...>`, percent-encoded, with the tenant as its
hash tag, so each script touches one tenant's keys on one shard and declares them in KEYS.
Every redis error becomes StoreUnavailable here and nowhere else; only operations safe
to repeat are retried, once. Keys, scripts, pipelining and retries: docs/internals.md,
"The Redis ledger"; docs/scale.md.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote, unquote

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.exceptions import (
    AskError,
    ClusterDownError,
    MovedError,
    NoScriptError,
    RedisClusterException,
    RedisError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from proxy.errors import ConfigError, StoreUnavailable
from proxy.ledger import redis_compat
from proxy.ledger.rates import RateState, epoch_ms
from proxy.ledger.redis_pipe import Batched, Pipe, Scripts
from proxy.ledger.store import (
    CONTEXT_KEPT_S,
    NO_TURN,
    SCOPES,
    TENANT_SCOPES,
    Admission,
    Ask,
    Decision,
    DerivedOps,
    RunRow,
    Spend,
    Standing,
    ToolTurn,
    Turn,
    WholeRun,
    context_refusal,
    guard_refusal,
    rate_refusal,
    refusal,
    refused_with,
    release_if_cancelled,
    run_record,
    scope_of,
    tool_ceiling,
    tool_entry,
    unpriced_refusal,
    window_keys,
    with_budgets,
)

__all__ = ["CLUSTER_SCHEMES", "OLD_LAYOUT", "REGISTRY", "RedisStore", "is_cluster_url", "key", "tag"]

log = logging.getLogger("spanmeter.ledger")
T = TypeVar("T")

_LUA = Path(__file__).with_name("lua")
_WINDOW_TTL_S = 400 * 86400  # day/month windows outlive any report that reads them
_EXPIRED_KEPT_S = 7 * 86400
_EXPIRE_BATCH = 500
_REGISTER_EVERY_S = 600.0  # a registration lost in a failover comes back within this
_SWEEP_PARALLEL = 8  # operations a walk over every tenant has in flight: the calls keep the rest
REGISTRY = "sm:tenants"  # every tenant the ledger has admitted a call for
_SWEEPER = "sm:sweeper"  # the lease of the replica that sweeps this period
# The global keys of the layout before hash tags: while any exists, the ledger has not
# been migrated (`spanmeter ledger migrate-keys`) and admissions fail closed.
OLD_LAYOUT = ("sm:exp", "sm:runs", "sm:active")
CLUSTER_SCHEMES = ("redis+cluster://", "rediss+cluster://")


_PLAIN = re.compile(r"[A-Za-z0-9_.~-]*")  # what quote(safe="") leaves as it is
_TAGS: dict[str, str] = {}
_TAGS_KEPT = 4096


def _quote(part: str) -> str:
    # Run ids, dates and key ids are mostly plain: a match is cheaper than quote's walk.
    return part if _PLAIN.fullmatch(part) else quote(part, safe="")


def tag(tenant: str) -> str:
    """`sm:{<tenant>}`: the prefix of every key of a tenant, its Cluster hash tag between the
    braces. Percent-encoding leaves no brace in the tag; the empty tenant gets `%`, which no
    encoded name is (an empty tag would hash each key whole)."""
    found = _TAGS.get(tenant)
    if found is None:
        if len(_TAGS) >= _TAGS_KEPT:  # tenants are few; this only bounds a flood of names
            _TAGS.clear()
        found = _TAGS[tenant] = "sm:{" + (_quote(tenant) or "%") + "}"
    return found


def key(tenant: str, kind: str, *parts: str) -> str:
    return ":".join([tag(tenant), kind, *(_quote(p) for p in parts)])


def is_cluster_url(url: str) -> bool:
    return url.startswith(CLUSTER_SCHEMES)


def _limit(value: int | None) -> int:
    return -1 if value is None else value


class RedisStore(DerivedOps):
    """`Store` over Redis or Redis Cluster.

    `url`: redis://host:port/db, rediss://..., unix://...; redis+cluster://host:port[,host:port]
    (rediss+cluster:// for TLS; a Cluster has only db 0). The scripts of the calls go
    pipelined on one connection per server, any number in flight; one whose reply has not
    come `timeout_s` after it was sent fails closed, with every one behind it on that
    connection. The other operations take pooled connections, at most `max_connections` in
    flight; one that waits longer than `timeout_s` for a connection, or its reply, fails closed."""

    def __init__(self, url: str, *, max_connections: int = 64, timeout_s: float = 2.0) -> None:
        self.url = url
        self.cluster = is_cluster_url(url)
        self._timeout_s = timeout_s
        self._gate: asyncio.Semaphore | None = None
        self._pipe: Scripts | None = None  # standalone: the scripts' connection
        self._pipes: dict[str, Pipe] = {}  # Cluster: one per node, by name
        # redis-py's internals as proxy/ledger/redis_compat.py expects them: the scripts on
        # our own pipelined connections; else through redis-py's public API only.
        self._internals = redis_compat.internals()
        self._redis: Any
        if self.cluster:
            self._redis = _cluster_client(url, max_connections=max_connections, timeout_s=timeout_s,
                                          failover=self._internals)
            # The Cluster client refuses (MaxConnectionsError) past max_connections per node
            # instead of waiting: the gate makes it wait, as the standalone pool does.
            self._gate = asyncio.Semaphore(max_connections)
        else:
            pool = aioredis.BlockingConnectionPool.from_url(
                url,
                max_connections=max_connections,
                timeout=timeout_s,
                socket_timeout=timeout_s,
                socket_connect_timeout=timeout_s,
                decode_responses=True,
                retry=Retry(NoBackoff(), 0),
            )
            self._redis = aioredis.Redis(connection_pool=pool)
            # The scripts of every call (admit, settle, ...) go on one pipelined connection
            # made with the pool's settings; the other operations (reads, sweeps, admin) on the pool.
            self._pipe = Pipe(pool.make_connection, timeout_s=timeout_s) if self._internals else Batched(self._redis)
        self._scripts = {p.stem: _Script(_script_text(p)) for p in _LUA.glob("*.lua")}
        self._registered: dict[str, float] = {}  # tenant -> when this process last registered it
        self._registering: set[str] = set()
        self._tried: set[str] = set()
        self._background: set[asyncio.Future[None]] = set()
        self._layout_checked = False
        self._layout_check: asyncio.Future[None] | None = None
        self._layout_retry_at = 0.0

    # --- plumbing --------------------------------------------------------------------

    async def _call(self, make: Callable[[], Awaitable[T]], *, repeatable: bool, tenant: str | None = None,
                    gated: bool = True) -> T:
        """Run one redis operation; translate its errors once, here (fail closed)."""
        for attempt in (1, 2):
            try:
                if self._gate is None or not gated:
                    return await make()
                return await self._gated(make)
            except (ClusterDownError, TryAgainError) as exc:
                if attempt == 1:  # the node said the command did not run: any operation may go again
                    await asyncio.sleep(0.05)
                    continue
                raise self._unavailable(exc, tenant) from exc
            except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
                if repeatable and attempt == 1:
                    continue  # a pooled connection died with the old server: try a fresh one
                raise self._unavailable(exc, tenant) from exc
            except (RedisError, RedisClusterException) as exc:
                raise self._unavailable(exc, tenant) from exc
        raise AssertionError("unreachable")

    async def _gated(self, make: Callable[[], Awaitable[T]]) -> T:
        assert self._gate is not None
        if self._gate.locked():  # wait_for costs a task: only when there is a wait
            try:
                await asyncio.wait_for(self._gate.acquire(), self._timeout_s)
            except TimeoutError:
                raise RedisConnectionError(f"no connection free within {self._timeout_s:g} s") from None
        else:
            await self._gate.acquire()
        try:
            return await make()
        finally:
            self._gate.release()

    def _unavailable(self, exc: BaseException, tenant: str | None) -> StoreUnavailable:
        where = ""
        if self.cluster and tenant is not None:
            where = (f" for tenant {tenant}, whose keys live in Redis Cluster slot "
                     f"{key_slot(tag(tenant).encode())} (`redis-cli -c cluster nodes` shows its shard)")
        return StoreUnavailable(
            f"The shared ledger at {_redact(self.url)} is unreachable{where} ({type(exc).__name__}: "
            f"{exc}). No call is forwarded while spend cannot be recorded. Check that Redis "
            f"is up, or set the store to fail open (not recommended)."
        )

    async def _script(self, name: str, keys: list[str], args: list[Any], *, repeatable: bool,
                      tenant: str | None = None) -> Any:
        script = self._scripts[name]

        async def piped(pipe: Scripts) -> Any:
            try:
                return await pipe.call(("EVALSHA", script.sha, len(keys), *keys, *args))
            except NoScriptError:  # this node has not seen the script (yet, or since a restart)
                return await pipe.call(("EVAL", script.text, len(keys), *keys, *args))

        if self._pipe is not None:
            standalone = self._pipe
            return await self._call(lambda: piped(standalone), repeatable=repeatable, tenant=tenant)

        async def pooled() -> Any:
            try:
                return await self._redis.evalsha(script.sha, len(keys), *keys, *args)
            except NoScriptError:
                return await self._redis.eval(script.text, len(keys), *keys, *args)

        if not self._internals:  # redis-py's Cluster client routes it, as any other command
            return await self._call(pooled, repeatable=repeatable, tenant=tenant)
        slot = key_slot(keys[0].encode())  # every key of a script shares its tenant's hash tag

        async def clustered() -> Any:
            await self._redis.initialize()  # at once unless an error below asked to learn the layout again
            node = self._redis.nodes_manager.get_node_from_slot(slot)
            try:
                return await piped(self._node_pipe(node))
            except (MovedError, AskError, TryAgainError, ClusterDownError):
                # Not run: the slot is moving or has moved, or the shard is between masters.
                # The call goes again through redis-py's client, as it did before these
                # connections: it follows the redirection and updates the slot map later calls
                # are routed by, waits out TRYAGAIN, and learns the layout again after CLUSTERDOWN.
                return await self._gated(pooled)
            except (RedisConnectionError, RedisTimeoutError, OSError):
                # As redis-py's client does: the layout is learnt again before the next
                # command (a replica may have taken over the node's slots).
                self._redis.nodes_manager.move_node_to_end_of_cached_nodes(node.name)  # asked last for it
                redis_compat.relearn_layout(self._redis)
                raise

        return await self._call(clustered, repeatable=repeatable, tenant=tenant, gated=False)

    def _node_pipe(self, node: ClusterNode) -> Pipe:
        pipe = self._pipes.get(node.name)
        if pipe is None:
            def connection() -> Any:
                # As redis-py's client makes its nodes' connections: no retry below ours.
                return node.connection_class(**{**node.connection_kwargs, "retry": Retry(NoBackoff(), 0)})

            pipe = self._pipes[node.name] = Pipe(connection, timeout_s=self._timeout_s)
        return pipe

    async def _admitting(self, tenant: str, name: str, keys: list[str], args: list[Any]) -> Any:
        """Run an admission script, after checking the key layout (once per process) and
        beside registering the tenant (the sweeps walk the registry)."""
        if not self._layout_checked and time.monotonic() >= self._layout_retry_at:
            if self._layout_check is None:
                # One check for the calls that arrive together at start (each would take a
                # pooled connection of its own), its outcome theirs.
                self._layout_check = asyncio.ensure_future(self._check_layout())
                self._layout_check.add_done_callback(self._layout_done)
            await asyncio.shield(self._layout_check)
        due = time.monotonic() - self._registered.get(tenant, -_REGISTER_EVERY_S) >= _REGISTER_EVERY_S
        if not due or tenant in self._registering:
            return await self._script(name, keys, args, repeatable=True, tenant=tenant)
        self._registering.add(tenant)
        if tenant not in self._tried:
            # The tenant's first call here: registered beside its admission, so that a sweep
            # right after it sees the tenant.
            self._tried.add(tenant)
            reply, _ = await asyncio.gather(self._script(name, keys, args, repeatable=True, tenant=tenant),
                                            self._register(tenant))
            return reply
        # Again later (or after a failure): in the background, so that no call waits on the
        # shard that holds the registry.
        task = asyncio.ensure_future(self._register(tenant))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return await self._script(name, keys, args, repeatable=True, tenant=tenant)

    def _layout_done(self, check: asyncio.Future[None]) -> None:
        self._layout_check = None  # a failed check is made again by the next call
        if not check.cancelled():
            check.exception()  # each waiter raises it; not one for the loop to log

    async def _check_layout(self) -> None:
        if self.cluster:
            # One EXISTS per key (each its own slot): a shard that is down must not stop the
            # tenants of the others; its keys are looked at again a little later.
            found = await asyncio.gather(*(self._exists(k) for k in OLD_LAYOUT), return_exceptions=True)
            for f in found:
                if isinstance(f, BaseException) and not isinstance(f, StoreUnavailable):
                    raise f
            old = sum(f for f in found if isinstance(f, int))
            if not old and any(isinstance(f, StoreUnavailable) for f in found):
                self._layout_retry_at = time.monotonic() + 5
                return
        else:
            old = int(await self._call(lambda: self._redis.exists(*OLD_LAYOUT), repeatable=True))
        if old:
            raise StoreUnavailable(
                f"The ledger at {_redact(self.url)} holds spend in the key layout of spanmeter before "
                f"hash-tagged keys ({', '.join(OLD_LAYOUT)}): run `spanmeter ledger migrate-keys` once, with "
                f"the old proxies stopped (docs/operations.md, 'Migrating Redis keys'). No call is forwarded "
                f"until then, so that no budget is spent twice.")
        self._layout_checked = True

    async def _exists(self, name: str) -> int:
        return int(await self._call(lambda: self._redis.exists(name), repeatable=True))

    async def _register(self, tenant: str) -> None:
        """Add the tenant to the registry, beside an admission (never inside it). A failure
        is left for the tenant's next call."""
        now = time.monotonic()
        try:
            await self._call(lambda: self._redis.sadd(REGISTRY, tenant), repeatable=True)
            self._registered[tenant] = now
        except StoreUnavailable:
            pass
        finally:
            self._registering.discard(tenant)

    async def _tenants(self) -> list[str]:
        members = await self._call(lambda: self._redis.smembers(REGISTRY), repeatable=True)
        return sorted(members)

    async def _each(self, tenants: Iterable[str], op: Callable[[str], Awaitable[T]], what: str) -> list[T]:
        """`op` for every tenant; a tenant whose shard is down is logged and skipped, so
        one shard's outage does not stop the sweep of the others."""
        results = await _bounded([op(t) for t in tenants], return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        for r in failed:
            if not isinstance(r, StoreUnavailable):
                raise r
        if failed:
            log.warning("%s: %d tenant(s) skipped, their ledger shard is unreachable: %s", what, len(failed),
                        failed[0])
        return [r for r in results if not isinstance(r, BaseException)]

    # --- ledger ----------------------------------------------------------------------

    async def admit(self, ask: Ask, turn: Turn = NO_TURN) -> Admission:
        tenant, run_id, limits, now = ask.tenant, ask.run_id, ask.limits, ask.now
        windows = window_keys(now, ask.tz)
        min_reserve, max_reserve = turn.reserve
        if not 0 <= min_reserve <= max_reserve:
            raise ValueError(f"need 0 <= least ({min_reserve}) <= most ({max_reserve}) in Turn.reserve")
        rid = f"{_quote(tenant)}.{os.urandom(16).hex()}"
        ts = now.timestamp()
        guard = turn.guard
        names = _call_keys(tenant, run_id, windows, turn.key)
        keys = [*names.scopes, key(tenant, "res", rid), *names.admit,
                *(key(tenant, "rate", rate.bucket) for rate in turn.rates),
                *(key(tenant, "ctx", ref) for ref in turn.context)]
        args: list[Any] = [
            _limit(limits.run_max_calls), _limit(limits.run_max_cost), _limit(limits.day_budget),
            _limit(limits.month_budget), min_reserve, max_reserve, repr(ts), repr(ts + ask.ttl_s),
            run_id, _WINDOW_TTL_S,
            json.dumps(turn.trace) if turn.trace is not None else "",
            guard.threshold if guard else -1, 1 if guard and guard.refuse else 0,
            _limit(guard.max_failures if guard else None), 1 if turn.priced else 0, turn.input_rate,
            _limit(limits.run_max_tokens), -1 if limits.run_max_seconds is None else repr(limits.run_max_seconds),
            _limit(limits.key_day_budget), _limit(limits.key_month_budget), 1 if turn.key is not None else 0,
            epoch_ms(now), len(turn.rates)]
        for rate in turn.rates:
            args += [rate.limit, rate.cost]
        args.append(len(turn.results))
        for call_id, ok in turn.results:
            args += [call_id, "1" if ok else "0"]
        args += [turn.tokens[0], turn.tokens[1], turn.count]

        async def admitting() -> Admission:
            reply = await self._admitting(tenant, "admit", keys, args)
            return self._admission(reply, rid, ask, windows, turn)

        return await release_if_cancelled(self, admitting)

    def _admission(self, reply: list[Any], rid: str, ask: Ask, windows: tuple[str, str], turn: Turn) -> Admission:
        tenant, run_id, limits = ask.tenant, ask.run_id, ask.limits
        kind, flat, trace_json = reply[0], reply[1], reply[2]
        closed = tuple({**json.loads(flat[i]), "streak": int(flat[i + 1]), "failures": int(flat[i + 2]),
                        "ok": flat[i + 3] == "1"} for i in range(0, len(flat), 4))
        trace = json.loads(trace_json) if trace_json else None
        scopes = SCOPES if turn.key is not None else TENANT_SCOPES
        if kind == "dup":
            remaining: dict[str, int | None] = dict.fromkeys(scopes)
            return Admission(rid, tenant, run_id, int(reply[3]), int(reply[4]), remaining, *windows, limits=limits,
                             key=turn.key, tokens=int(reply[5]))
        if kind == "loop":
            loop = guard_refusal(tenant, run_id, closed, turn.guard)
            assert loop is not None, "admit.lua and guard_refusal disagree"
            raise refused_with(loop, closed, trace)
        eff = with_budgets(limits, int(reply[3]) if reply[3] else None, int(reply[4]) if reply[4] else None)
        if kind == "unpriced":
            raise refused_with(unpriced_refusal(tenant, turn.model, turn.price_hint), closed, trace)
        if kind == "context":
            unknown = [turn.context[i] for i, ref in enumerate(turn.context)
                       if key(tenant, "ctx", ref) in set(reply[5])]
            raise refused_with(context_refusal(tenant, unknown, eff), closed, trace)
        if kind == "refused":
            scope, settled, reserved = reply[5], int(reply[6]), int(reply[7])
            extra, run_tokens, elapsed = int(reply[8]), int(reply[9]), float(reply[10])
            ledger: dict[str, Spend] = dict.fromkeys(scopes, Spend())
            ledger[scope] = Spend(settled, reserved)
            least, needed = turn.reserve[0] + extra, int(reply[12])
            found = Standing(eff, ledger, (least, least), run_tokens=run_tokens, tokens=(needed, needed),
                             tokens_held=int(reply[11]), elapsed_s=elapsed)
            raise refused_with(refusal(Decision(refused=scope), ask, found, turn.key), closed, trace)
        if kind == "rate":
            raise refused_with(rate_refusal(tenant, _rate_states(turn, reply[5])), closed, trace)
        left = [None if v == "none" else int(v) for v in (*reply[7:10], reply[11], reply[12])]
        remaining = {s: v for s, v in zip(SCOPES, left, strict=True) if s in scopes}
        return Admission(rid, tenant, run_id, int(reply[5]), int(reply[6]), remaining, *windows,
                         closed=closed, trace=trace, context_tokens=int(reply[10]), limits=eff,
                         run_tokens=int(reply[13]), started_at=float(reply[14]) if reply[14] else None,
                         rates=_rate_states(turn, reply[15]), key=turn.key, tokens=int(reply[16]))

    async def admit_tool(self, ask: Ask, turn: ToolTurn) -> Admission:
        tenant, run_id, limits, now = ask.tenant, ask.run_id, ask.limits, ask.now
        windows = window_keys(now, ask.tz)
        if turn.cost < 0:
            raise ValueError(f"a tool call cannot cost less than nothing (cost={turn.cost})")
        rid = f"{_quote(tenant)}.{os.urandom(16).hex()}"
        ts = now.timestamp()
        guard = turn.guard
        keys = [*self._scope_keys(tenant, run_id, *windows), key(tenant, "res", rid), *self._index_keys(tenant),
                key(tenant, "tools", run_id), key(tenant, "budget"), key(tenant, "totals", run_id),
                *self._key_scopes(tenant, turn.key, windows),
                *(key(tenant, "rate", rate.bucket) for rate in turn.rates)]
        args: list[Any] = [
            turn.name or "", turn.sig, turn.cost, _limit(turn.max_calls), _limit(limits.run_max_cost),
            _limit(limits.day_budget), _limit(limits.month_budget), repr(ts), repr(ts + ask.ttl_s),
            run_id, _WINDOW_TTL_S, json.dumps(turn.trace) if turn.trace is not None else "",
            guard.threshold if guard else -1, 1 if guard and guard.refuse else 0,
            -1 if limits.run_max_seconds is None else repr(limits.run_max_seconds),
            _limit(limits.key_day_budget), _limit(limits.key_month_budget), 1 if turn.key is not None else 0,
            epoch_ms(now), len(turn.rates)]
        for rate in turn.rates:
            args += [rate.limit, rate.cost]

        async def admitting() -> Admission:
            reply = await self._admitting(tenant, "admit_tool", keys, args)
            return self._tool_admission(reply, rid, ask, windows, turn)

        return await release_if_cancelled(self, admitting)

    def _tool_admission(self, reply: list[Any], rid: str, ask: Ask, windows: tuple[str, str],
                        turn: ToolTurn) -> Admission:
        tenant, run_id, limits = ask.tenant, ask.run_id, ask.limits
        kind, matched, streak, trace_json = reply[0], reply[1], int(reply[2]), reply[3]
        trace = json.loads(trace_json) if trace_json else None
        scopes = SCOPES if turn.key is not None else TENANT_SCOPES
        if kind == "trace":
            return Admission("", tenant, run_id, 0, 0, {}, *windows, trace=trace, limits=limits,
                             rates=_rate_states(turn, reply[4]), key=turn.key)
        entry = (tool_entry(json.loads(matched) if matched else None, turn, streak),) if turn.name else ()
        if kind == "rate":
            raise refused_with(rate_refusal(tenant, _rate_states(turn, reply[6])), entry, trace)
        if kind == "dup":
            return Admission(rid, tenant, run_id, int(reply[4]), int(reply[5]), dict.fromkeys(scopes), *windows,
                             closed=entry, limits=limits, key=turn.key)
        if kind == "loop":
            loop = guard_refusal(tenant, run_id, entry, turn.guard)
            assert loop is not None, "admit_tool.lua and guard_refusal disagree"
            raise refused_with(loop, entry, trace)
        eff = with_budgets(limits, int(reply[4]) if reply[4] else None, int(reply[5]) if reply[5] else None)
        if kind == "calls":
            raise refused_with(tool_ceiling(tenant, run_id, turn.max_calls or 0), entry, trace)
        if kind == "refused":
            ledger: dict[str, Spend] = dict.fromkeys(scopes, Spend())
            ledger[reply[6]] = Spend(int(reply[7]), int(reply[8]))
            found = Standing(eff, ledger, (turn.cost, turn.cost), elapsed_s=float(reply[9]))
            raise refused_with(refusal(Decision(refused=reply[6]), ask, found, turn.key), entry, trace)
        left = [None if v == "none" else int(v) for v in reply[8:13]]
        return Admission(rid, tenant, run_id, int(reply[6]), int(reply[7]),
                         {s: v for s, v in zip(SCOPES, left, strict=True) if s in scopes}, *windows, closed=entry,
                         trace=trace, limits=eff,
                         started_at=float(reply[13]) if limits.run_max_seconds is not None else None,
                         rates=_rate_states(turn, reply[14]), key=turn.key)

    @staticmethod
    def _scope_keys(tenant: str, run_id: str, day: str, month: str) -> list[str]:
        return [key(tenant, "run", run_id), key(tenant, "day", day), key(tenant, "month", month),
                key(tenant, "total")]

    @staticmethod
    def _key_scopes(tenant: str, key_id: str | None, windows: tuple[str, str]) -> list[str]:
        """The key's day and month hashes (declared, and untouched, for a call without a key)."""
        k = key_id if key_id is not None else ""
        return [key(tenant, "keyday", f"{k}/{windows[0]}"), key(tenant, "keymonth", f"{k}/{windows[1]}")]

    @staticmethod
    def _index_keys(tenant: str) -> list[str]:
        """The tenant's expiry, runs and active-runs sorted sets."""
        return [key(tenant, "exp"), key(tenant, "runs"), key(tenant, "active")]

    async def settle(
        self,
        admission: Admission,
        actual: int,
        *,
        run_totals: dict[str, int] | None = None,
        tools: list[dict[str, Any]] | None = None,
        contexts: dict[str, int] | None = None,
    ) -> int:
        if actual < 0:
            raise ValueError(f"a call cannot cost less than nothing (actual={actual})")
        tenant, run_id = admission.tenant, admission.run_id
        totals = run_totals or {}
        seen = contexts or {}
        args: list[Any] = [actual, len(totals)]
        for name, value in totals.items():
            args += [name, int(value)]
        args += [len(tools or []), *_tool_args(tools or []), CONTEXT_KEPT_S, *(int(t) for t in seen.values())]
        names = _call_keys(tenant, run_id, (admission.day_key, admission.month_key), admission.key)
        keys = [key(tenant, "res", admission.id), *names.settle, *(key(tenant, "ctx", ref) for ref in seen)]
        # Repeatable: the script deletes the reservation, so a retry applies nothing twice.
        found, amount = await self._script("settle", keys, args, repeatable=True, tenant=tenant)
        return max(0, actual - int(amount)) if int(found) else 0

    async def expire(self, now: datetime) -> int:
        ts = repr(now.timestamp())
        return sum(await self._each(await self._tenants(), lambda t: self._expire_tenant(t, ts), "expiry sweep"))

    async def _expire_tenant(self, tenant: str, ts: str) -> int:
        exp = key(tenant, "exp")
        total = 0
        while True:
            due: list[str] = await self._call(
                lambda: self._redis.zrangebyscore(exp, "-inf", ts, start=0, num=_EXPIRE_BATCH), repeatable=True,
                tenant=tenant)
            for res in due:  # one after another: reservations left to expire are a crash's few
                total += await self._expire_one(tenant, exp, res)
            if len(due) < _EXPIRE_BATCH:
                return total

    async def _expire_one(self, tenant: str, exp: str, res: str) -> int:
        fields = ["run", "day", "month", "total", "keyday", "keymonth"]
        names = await self._call(lambda: self._redis.hmget(res, fields), repeatable=True, tenant=tenant)
        held = [n for n in names if n is not None]
        return int(await self._script("expire", [exp, res, *held], [_EXPIRED_KEPT_S], repeatable=True,
                                      tenant=tenant))

    async def spend_detail(
        self,
        tenant: str,
        *,
        run_id: str | None = None,
        day: str | None = None,
        month: str | None = None,
        key_id: str | None = None,
    ) -> Spend:
        scope, part = scope_of(run_id, day, month, key_id)
        name = key(tenant, "total") if scope == "total" else key(tenant, scope, part)
        v = await self._call(lambda: self._redis.hmget(name, ["settled", "reserved"]), repeatable=True, tenant=tenant)
        return Spend(int(v[0] or 0), int(v[1] or 0))

    async def run_calls(self, tenant: str, run_id: str) -> int:
        run = key(tenant, "run", run_id)
        v = await self._call(lambda: self._redis.hget(run, "calls"), repeatable=True, tenant=tenant)
        return int(v or 0)

    # --- run state -------------------------------------------------------------------

    async def run_add(self, tenant: str, run_id: str, deltas: dict[str, int], *, soon: bool = False) -> None:
        if not deltas:
            return
        args = [x for name, value in deltas.items() for x in (name, int(value))]
        # Not repeatable: a repeat would count twice.
        await self._script("run_add", [key(tenant, "totals", run_id)], args, repeatable=False, tenant=tenant)

    async def run_totals(self, tenant: str, run_id: str) -> dict[str, int]:
        name = key(tenant, "totals", run_id)
        raw = await self._call(lambda: self._redis.hgetall(name), repeatable=True, tenant=tenant)
        return {k: int(v) for k, v in raw.items()}

    async def run_end(self, tenant: str, run_id: str) -> dict[str, Any] | None:
        first = await self._script("run_end", [key(tenant, "run", run_id), key(tenant, "active")],
                                   [repr(time.time()), run_id], repeatable=False, tenant=tenant)
        return await self._record(tenant, run_id) if int(first) else None

    async def _record(self, tenant: str, run_id: str) -> dict[str, Any] | None:
        run = key(tenant, "run", run_id)
        raw = await self._call(lambda: self._redis.hgetall(run), repeatable=True, tenant=tenant)
        if not raw:
            return None
        stored = RunRow(
            calls=int(raw.get("calls", 0)),
            first_seen=float(raw["first_seen"]) if "first_seen" in raw else None,
            last_seen=float(raw["last_seen"]) if "last_seen" in raw else None,
            ended=raw.get("ended") == "1",
            trace=json.loads(raw["trace"]) if raw.get("trace") else None,
        )
        spend = Spend(int(raw.get("settled", 0)), int(raw.get("reserved", 0)))
        return run_record(tenant, run_id, stored, spend, await self.run_totals(tenant, run_id))

    async def idle_runs(self, before: datetime) -> list[tuple[str, str]]:
        bound = f"({before.timestamp()!r}"

        async def idle(tenant: str) -> list[tuple[str, str]]:
            active = key(tenant, "active")
            ids = await self._call(lambda: self._redis.zrangebyscore(active, "-inf", bound), repeatable=True,
                                   tenant=tenant)
            return [(tenant, r) for r in ids]

        found = await self._each(await self._tenants(), idle, "idle-run sweep")
        return [pair for pairs in found for pair in pairs]

    def queues_settle(self, admission: Admission) -> bool:
        return False  # a round trip, under redis-py's timeouts (which read the running task)

    async def run_guard(self, tenant: str, run_id: str, state: tuple[str | None, int, int]) -> None:
        run, (sig, streak, failures) = key(tenant, "run", run_id), state
        await self._call(lambda: self._redis.hset(run, mapping={"sig": sig or "", "streak": streak,
                                                                "failures": failures}),
                         repeatable=True, tenant=tenant)

    async def runs_record(self, runs: Sequence[WholeRun]) -> None:
        by_tenant: dict[str, list[WholeRun]] = {}
        for run in runs:
            by_tenant.setdefault(run.tenant, []).append(run)
        for tenant, whole in by_tenant.items():
            keys = [key(tenant, "runs"), key(tenant, "active")]
            args: list[Any] = []
            for run in whole:
                keys += [key(tenant, "run", run.run_id), key(tenant, "totals", run.run_id)]
                args += [run.run_id, run.calls, repr(run.first_seen), repr(run.last_seen),
                         "" if run.ended_at is None else repr(run.ended_at),
                         json.dumps(run.trace) if run.trace else "", int(run.settled),
                         len(run.totals), *(x for name, value in run.totals.items() for x in (name, int(value)))]
            # Not repeatable: a repeat would count twice.
            await self._script("runs_record", keys, args, repeatable=False, tenant=tenant)

    async def list_runs(self, tenant: str | None, limit: int = 50) -> list[dict[str, Any]]:
        async def latest(t: str) -> list[tuple[float, str, str]]:
            index = key(t, "runs")
            ids = await self._call(lambda: self._redis.zrevrange(index, 0, limit - 1, withscores=True),
                                   repeatable=True, tenant=t)
            return [(float(score), t, r) for r, score in ids]

        if tenant is None:
            per_tenant = await _bounded([latest(t) for t in await self._tenants()])
            ranked = sorted((x for xs in per_tenant for x in xs), key=lambda x: -x[0])[:limit]
        else:
            ranked = await latest(tenant)
        records = await asyncio.gather(*(self._record(t, r) for _, t, r in ranked))
        return [r for r in records if r is not None]

    async def sweep_turn(self, every_s: float) -> bool:
        """At most one replica sweeps in each period: the one that takes the lease."""
        ms = max(1, int(every_s * 900))  # a little under the period, so the next one is free
        return bool(await self._call(lambda: self._redis.set(_SWEEPER, uuid.uuid4().hex, nx=True, px=ms),
                                     repeatable=False))

    # --- tool calls ------------------------------------------------------------------

    async def tools_put(self, tenant: str, run_id: str, calls: list[dict[str, Any]]) -> None:
        if not calls:
            return
        await self._script("tools_put", [key(tenant, "tools", run_id), key(tenant, "toolseq", run_id)],
                           _tool_args(calls), repeatable=True, tenant=tenant)

    async def tools_take(self, tenant: str, run_id: str, ids: list[str]) -> list[dict[str, Any]]:
        if not ids:
            return []
        taken = await self._script("tools_take", [key(tenant, "tools", run_id)], list(dict.fromkeys(ids)),
                                   repeatable=False, tenant=tenant)
        return [json.loads(v.split("\t", 1)[1]) for v in taken]

    async def tools_pending(self, tenant: str, run_id: str) -> list[dict[str, Any]]:
        name = key(tenant, "tools", run_id)
        raw = await self._call(lambda: self._redis.hvals(name), repeatable=True, tenant=tenant)
        split = sorted((int(s), body) for s, body in (v.split("\t", 1) for v in raw))
        return [json.loads(body) for _, body in split]

    # --- admin -----------------------------------------------------------------------

    async def budget_set(self, tenant: str, day: int | None, month: int | None) -> None:
        args = ["" if day is None else day, "" if month is None else month]
        await self._script("budget_set", [key(tenant, "budget")], args, repeatable=True, tenant=tenant)

    async def budget_get(self, tenant: str) -> tuple[int | None, int | None]:
        name = key(tenant, "budget")
        day, month = await self._call(lambda: self._redis.hmget(name, ["day", "month"]), repeatable=True,
                                      tenant=tenant)
        return (int(day) if day else None, int(month) if month else None)

    async def ping(self) -> None:
        """Standalone: PING. Cluster: ready when some primary answers; a tenant whose shard
        is down gets 503 on its own calls, the others are served."""
        if not self.cluster:
            await self._call(self._redis.ping, repeatable=True)
            return
        await self._call(self._ping_some_primary, repeatable=True)

    async def _ping_some_primary(self) -> None:
        await self._redis.initialize()
        error: BaseException | None = None
        for node in self._redis.get_primaries():
            try:
                await self._redis.execute_command("PING", target_nodes=node)
                return
            except (RedisError, OSError) as exc:
                error = exc
        raise error or RedisConnectionError("the cluster has no primary")

    async def aclose(self) -> None:
        await asyncio.gather(*self._background, *([self._layout_check] if self._layout_check else []),
                             return_exceptions=True)
        await asyncio.gather(*(p.aclose() for p in [*self._pipes.values(), *([self._pipe] if self._pipe else [])]))
        await self._redis.aclose()
        if not self.cluster:
            await self._redis.connection_pool.disconnect()


async def _bounded(coros: list[Awaitable[T]], *, return_exceptions: bool = False) -> list[Any]:
    """gather, at most _SWEEP_PARALLEL at a time (a walk over 10,000 tenants must not take
    every pooled connection from the calls being admitted meanwhile)."""
    gate = asyncio.Semaphore(_SWEEP_PARALLEL)

    async def one(c: Awaitable[T]) -> T:
        async with gate:
            return await c

    return await asyncio.gather(*(one(c) for c in coros), return_exceptions=return_exceptions)


def _script_text(path: Path) -> str:
    """A script as Redis runs it: the shared functions of lua/lib/ it calls, in front of it
    (Redis has no includes; every script must be whole)."""
    text = path.read_text(encoding="utf-8")
    libs = [lib.read_text(encoding="utf-8") for lib in sorted((_LUA / "lib").glob("*.lua")) if f"{lib.stem}_" in text]
    return "".join(libs) + text


class _Script:
    def __init__(self, text: str) -> None:
        self.text = text
        self.sha = hashlib.sha1(text.encode()).hexdigest()


def _cluster_client(url: str, *, max_connections: int, timeout_s: float, failover: bool) -> RedisCluster:
    """redis-py's Cluster client from redis+cluster://[user:password@]host:port[,host:port...]:
    the nodes are where it learns the cluster's layout (any one that answers will do).
    `failover`: it asks another primary for COMMAND when the first is down
    (redis_compat.FailoverCommandsParser)."""
    scheme, _, rest = url.partition("://")
    base = "rediss" if scheme.startswith("rediss") else "redis"
    netloc, sep, tail = rest.partition("/")
    path, qsep, query = tail.partition("?")
    if sep and path not in ("", "0"):
        raise ConfigError(f"A Redis Cluster has only database 0, not {path!r}: drop it from {_redact(url)}.")
    auth, at, hosts = netloc.rpartition("@")
    nodes = [h for h in hosts.split(",") if h]
    if not nodes:
        raise ConfigError(f"No node in the Redis Cluster URL {_redact(url)}: use redis+cluster://HOST:PORT.")
    parsed: list[tuple[str, int]] = []
    for node in nodes:
        host, _, port = node.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"{node!r} in {_redact(url)} is not HOST:PORT.")
        parsed.append((unquote(host.strip("[]")), int(port)))
    first = f"{base}://{auth}{at}{nodes[0]}" + (f"/?{query}" if qsep else "")
    client = RedisCluster.from_url(
        first,
        startup_nodes=[ClusterNode(h, p) for h, p in parsed[1:]],
        # A shard without a master (down, no replica to promote) leaves its slots unserved:
        # its tenants fail closed, the others go on (the server needs
        # cluster-require-full-coverage no for that too).
        require_full_coverage=False,
        max_connections=max_connections,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        decode_responses=True,
        retry=Retry(NoBackoff(), 0),
    )
    if failover:
        redis_compat.fail_over_command_lookup(client)
    return client


class _CallKeys:
    """The keys a run's model calls name in admit.lua and settle.lua, in their order, but
    the reservation's and the per-call ones. The same for every call of a run in a day."""

    __slots__ = ("admit", "scopes", "settle")

    def __init__(self, tenant: str, run_id: str, windows: tuple[str, str], key_id: str | None) -> None:
        scopes = RedisStore._scope_keys(tenant, run_id, *windows)
        key_scopes = RedisStore._key_scopes(tenant, key_id, windows)
        indexes = RedisStore._index_keys(tenant)
        exp, totals, tools = indexes[0], key(tenant, "totals", run_id), key(tenant, "tools", run_id)
        self.scopes = tuple(scopes)
        self.admit = (*indexes, tools, key(tenant, "budget"), totals, *key_scopes)
        self.settle = (exp, totals, tools, key(tenant, "toolseq", run_id), *scopes, *key_scopes)


_CALL_KEYS: dict[tuple[str, str, tuple[str, str], str | None], _CallKeys] = {}
_CALL_KEYS_KEPT = 4096  # runs in flight in one process; past it the cache starts again


def _call_keys(tenant: str, run_id: str, windows: tuple[str, str], key_id: str | None) -> _CallKeys:
    found = _CALL_KEYS.get((tenant, run_id, windows, key_id))
    if found is None:
        if len(_CALL_KEYS) >= _CALL_KEYS_KEPT:
            _CALL_KEYS.clear()
        found = _CALL_KEYS[(tenant, run_id, windows, key_id)] = _CallKeys(tenant, run_id, windows, key_id)
    return found


def _rate_states(turn: Turn | ToolTurn, flat: list[Any]) -> tuple[RateState, ...]:
    """The buckets' states as admit.lua lists them: remaining, reset ms, wait ms (-1: never)."""
    return tuple(RateState(rate, int(flat[3 * j]), int(flat[3 * j + 1]),
                           None if int(flat[3 * j + 2]) < 0 else int(flat[3 * j + 2]))
                 for j, rate in enumerate(turn.rates))


def _tool_args(calls: list[dict[str, Any]]) -> list[str]:
    """id1, json1, id2, json2, ... as tools_put.lua and settle.lua read them."""
    args: list[str] = []
    for call in calls:
        args += [str(call["id"]), json.dumps(call)]
    return args


def _redact(url: str) -> str:
    """The URL without its password, for messages."""
    scheme, sep, rest = url.partition("://")
    if "@" in rest:
        rest = "***@" + rest.split("@", 1)[1]
    return f"{scheme}{sep}{rest}"
