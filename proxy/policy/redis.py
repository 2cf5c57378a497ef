"""The shared ledger for several replicas: Redis, every multi-key step one Lua script.

Scripts live in lua/*.lua and run with EVALSHA; redis-py loads them (SCRIPT LOAD) on
first use and again after a NOSCRIPT reply, so a restarted Redis needs no new store.

Every redis error becomes StoreUnavailable here and nowhere else (fail closed: the
handler answers 503 unless the operator chose fail-open). redis-py's own retries are
off, because re-sending a script whose reply was lost could apply it twice; instead
operations that are safe to repeat are retried once here: reads, settle (the
reservation is deleted on first apply), and admit (its reservation id is chosen
before sending; the script answers a repeat with the first result).

Keys are `sm:<kind>:<tenant>:<...>` with each part percent-encoded, so no tenant or
run id can reach into another's keys. Scripts touch keys that other keys name (the
expiry sweep), so this targets one Redis (or a primary with replicas), not Cluster.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from proxy.errors import StoreUnavailable
from proxy.policy.rates import RateState, epoch_ms
from proxy.policy.store import (
    CONTEXT_KEPT_S,
    NO_TURN,
    SCOPES,
    TENANT_SCOPES,
    Admission,
    Decision,
    DerivedOps,
    Limits,
    Spend,
    ToolTurn,
    Turn,
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

__all__ = ["RedisStore"]

_LUA = Path(__file__).with_name("lua")
_WINDOW_TTL_S = 400 * 86400  # day/month windows outlive any report that reads them
_EXPIRED_KEPT_S = 7 * 86400
_EXP, _RUNS, _ACTIVE = "sm:exp", "sm:runs", "sm:active"


def _k(*parts: str) -> str:
    return ":".join(quote(p, safe="") for p in parts)


def _member(tenant: str, run_id: str) -> str:
    return json.dumps([tenant, run_id])


def _limit(value: int | None) -> int:
    return -1 if value is None else value


class RedisStore(DerivedOps):
    """`Store` over Redis. `url`: redis://host:port/db (query: max_connections, timeout)."""

    def __init__(self, url: str, *, max_connections: int = 64, timeout_s: float = 2.0) -> None:
        self.url = url
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
        self._scripts = {p.stem: self._redis.register_script(p.read_text(encoding="utf-8")) for p in _LUA.glob("*.lua")}

    async def _call(self, make: Callable[[], Awaitable[Any]], *, repeatable: bool) -> Any:
        """Run one redis operation; translate its errors once, here (fail closed)."""
        for attempt in (1, 2):
            try:
                return await make()
            except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
                if repeatable and attempt == 1:
                    continue  # a pooled connection died with the old server: try a fresh one
                raise self._unavailable(exc) from exc
            except RedisError as exc:
                raise self._unavailable(exc) from exc
        raise AssertionError("unreachable")

    def _unavailable(self, exc: BaseException) -> StoreUnavailable:
        return StoreUnavailable(
            f"The shared ledger at {_redact(self.url)} is unreachable ({type(exc).__name__}: "
            f"{exc}). No call is forwarded while spend cannot be recorded. Check that Redis "
            f"is up, or set the store to fail open (not recommended)."
        )

    async def _script(self, name: str, keys: list[str], args: list[Any], *, repeatable: bool) -> Any:
        script = self._scripts[name]
        return await self._call(lambda: script(keys=keys, args=args), repeatable=repeatable)

    # --- ledger ----------------------------------------------------------------------

    async def admit(
        self,
        tenant: str,
        run_id: str,
        *,
        min_reserve: int,
        max_reserve: int,
        limits: Limits,
        now: datetime,
        tz: str = "UTC",
        ttl_s: int = 900,
        turn: Turn = NO_TURN,
    ) -> Admission:
        windows = window_keys(now, tz)
        if not 0 <= min_reserve <= max_reserve:
            raise ValueError(f"need 0 <= min_reserve ({min_reserve}) <= max_reserve ({max_reserve})")
        rid = f"{quote(tenant, safe='')}.{uuid.uuid4().hex}"
        ts = now.timestamp()
        guard = turn.guard
        key = turn.key if turn.key is not None else ""
        keys = [*self._scope_keys(tenant, run_id, *windows), _k("sm", "res", rid), _EXP, _RUNS,
                _k("sm", "runs", tenant), _ACTIVE, _k("sm", "tools", tenant, run_id), _k("sm", "budget", tenant),
                _k("sm", "totals", tenant, run_id), _k("sm", "keyday", tenant, f"{key}/{windows[0]}"),
                _k("sm", "keymonth", tenant, f"{key}/{windows[1]}"),
                *(_k("sm", "rate", tenant, rate.bucket) for rate in turn.rates),
                *(_k("sm", "ctx", tenant, ref) for ref in turn.context)]
        args: list[Any] = [
            _limit(limits.run_max_calls), _limit(limits.run_max_cost), _limit(limits.day_budget),
            _limit(limits.month_budget), min_reserve, max_reserve, repr(ts), repr(ts + ttl_s),
            _member(tenant, run_id), run_id, _WINDOW_TTL_S,
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

        async def admitting() -> Admission:
            reply = await self._script("admit", keys, args, repeatable=True)
            return self._admission(reply, rid, tenant, run_id, limits, windows, tz, min_reserve, turn)

        return await release_if_cancelled(self, admitting)

    def _admission(
        self,
        reply: list[Any],
        rid: str,
        tenant: str,
        run_id: str,
        limits: Limits,
        windows: tuple[str, str],
        tz: str,
        min_reserve: int,
        turn: Turn,
    ) -> Admission:
        kind, flat, trace_json = reply[0], reply[1], reply[2]
        closed = tuple({**json.loads(flat[i]), "streak": int(flat[i + 1]), "failures": int(flat[i + 2]),
                        "ok": flat[i + 3] == "1"} for i in range(0, len(flat), 4))
        trace = json.loads(trace_json) if trace_json else None
        scopes = SCOPES if turn.key is not None else TENANT_SCOPES
        if kind == "dup":
            remaining: dict[str, int | None] = dict.fromkeys(scopes)
            return Admission(rid, tenant, run_id, int(reply[3]), int(reply[4]), remaining, *windows, limits=limits)
        if kind == "loop":
            loop = guard_refusal(tenant, run_id, closed, turn.guard)
            assert loop is not None, "admit.lua and guard_refusal disagree"
            raise refused_with(loop, closed, trace)
        eff = with_budgets(limits, int(reply[3]) if reply[3] else None, int(reply[4]) if reply[4] else None)
        if kind == "unpriced":
            raise refused_with(unpriced_refusal(tenant, turn.model), closed, trace)
        if kind == "context":
            unknown = [turn.context[i] for i, ref in enumerate(turn.context)
                       if _k("sm", "ctx", tenant, ref) in set(reply[5])]
            raise refused_with(context_refusal(tenant, unknown, eff), closed, trace)
        if kind == "refused":
            scope, settled, reserved = reply[5], int(reply[6]), int(reply[7])
            extra, run_tokens, elapsed = int(reply[8]), int(reply[9]), float(reply[10])
            ledger: dict[str, Spend] = dict.fromkeys(scopes, Spend())
            ledger[scope] = Spend(settled, reserved)
            error = refusal(Decision(refused=scope), tenant=tenant, run_id=run_id, limits=eff, ledger=ledger,
                            windows=windows, tz=tz, min_reserve=min_reserve + extra, run_tokens=run_tokens,
                            elapsed_s=elapsed, key=turn.key)
            raise refused_with(error, closed, trace)
        if kind == "rate":
            raise refused_with(rate_refusal(tenant, _rate_states(turn, reply[5])), closed, trace)
        left = [None if v == "none" else int(v) for v in (*reply[7:10], reply[11], reply[12])]
        remaining = {s: v for s, v in zip(SCOPES, left, strict=True) if s in scopes}
        return Admission(rid, tenant, run_id, int(reply[5]), int(reply[6]), remaining, *windows,
                         closed=closed, trace=trace, context_tokens=int(reply[10]), limits=eff,
                         run_tokens=int(reply[13]), started_at=float(reply[14]) if reply[14] else None,
                         rates=_rate_states(turn, reply[15]))

    async def admit_tool(
        self,
        tenant: str,
        run_id: str,
        *,
        turn: ToolTurn,
        limits: Limits,
        now: datetime,
        tz: str = "UTC",
        ttl_s: int = 900,
    ) -> Admission:
        windows = window_keys(now, tz)
        if turn.cost < 0:
            raise ValueError(f"a tool call cannot cost less than nothing (cost={turn.cost})")
        rid = f"{quote(tenant, safe='')}.{uuid.uuid4().hex}"
        ts = now.timestamp()
        guard = turn.guard
        keys = [*self._scope_keys(tenant, run_id, *windows), _k("sm", "res", rid), _EXP, _RUNS,
                _k("sm", "runs", tenant), _ACTIVE, _k("sm", "tools", tenant, run_id), _k("sm", "budget", tenant),
                _k("sm", "totals", tenant, run_id)]
        args: list[Any] = [
            turn.name or "", turn.sig, turn.cost, _limit(turn.max_calls), _limit(limits.run_max_cost),
            _limit(limits.day_budget), _limit(limits.month_budget), repr(ts), repr(ts + ttl_s),
            _member(tenant, run_id), run_id, _WINDOW_TTL_S, json.dumps(turn.trace) if turn.trace is not None else "",
            guard.threshold if guard else -1, 1 if guard and guard.refuse else 0]

        async def admitting() -> Admission:
            reply = await self._script("admit_tool", keys, args, repeatable=True)
            return self._tool_admission(reply, rid, tenant, run_id, limits, windows, tz, turn)

        return await release_if_cancelled(self, admitting)

    def _tool_admission(self, reply: list[Any], rid: str, tenant: str, run_id: str, limits: Limits,
                        windows: tuple[str, str], tz: str, turn: ToolTurn) -> Admission:
        kind, matched, streak, trace_json = reply[0], reply[1], int(reply[2]), reply[3]
        trace = json.loads(trace_json) if trace_json else None
        if kind == "trace":
            return Admission("", tenant, run_id, 0, 0, {}, *windows, trace=trace, limits=limits)
        entry = (tool_entry(json.loads(matched) if matched else None, turn, streak),)
        if kind == "dup":
            return Admission(rid, tenant, run_id, int(reply[4]), int(reply[5]), dict.fromkeys(TENANT_SCOPES), *windows,
                             closed=entry, limits=limits)
        if kind == "loop":
            loop = guard_refusal(tenant, run_id, entry, turn.guard)
            assert loop is not None, "admit_tool.lua and guard_refusal disagree"
            raise refused_with(loop, entry, trace)
        eff = with_budgets(limits, int(reply[4]) if reply[4] else None, int(reply[5]) if reply[5] else None)
        if kind == "calls":
            raise refused_with(tool_ceiling(tenant, run_id, turn.max_calls or 0), entry, trace)
        if kind == "refused":
            ledger: dict[str, Spend] = dict.fromkeys(TENANT_SCOPES, Spend())
            ledger[reply[6]] = Spend(int(reply[7]), int(reply[8]))
            error = refusal(Decision(refused=reply[6]), tenant=tenant, run_id=run_id, limits=eff, ledger=ledger,
                            windows=windows, tz=tz, min_reserve=turn.cost)
            raise refused_with(error, entry, trace)
        left = [None if v == "none" else int(v) for v in reply[8:11]]
        return Admission(rid, tenant, run_id, int(reply[6]), int(reply[7]), dict(zip(TENANT_SCOPES, left, strict=True)),
                         *windows, closed=entry, trace=trace, limits=eff)

    def _scope_keys(self, tenant: str, run_id: str, day: str, month: str) -> list[str]:
        return [
            _k("sm", "run", tenant, run_id),
            _k("sm", "day", tenant, day),
            _k("sm", "month", tenant, month),
            _k("sm", "total", tenant),
        ]

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
        keys = [
            _k("sm", "res", admission.id),
            _EXP,
            _k("sm", "totals", tenant, run_id),
            _k("sm", "tools", tenant, run_id),
            _k("sm", "toolseq", tenant, run_id),
            *(_k("sm", "ctx", tenant, ref) for ref in seen),
        ]
        # Repeatable: the script deletes the reservation, so a retry applies nothing twice.
        found, amount = await self._script("settle", keys, args, repeatable=True)
        return max(0, actual - int(amount)) if int(found) else 0

    async def expire(self, now: datetime) -> int:
        total = 0
        while True:
            n = int(
                await self._script("expire", [_EXP], [repr(now.timestamp()), 500, _EXPIRED_KEPT_S], repeatable=True)
            )
            total += n
            if n < 500:
                return total

    async def spend_detail(
        self,
        tenant: str,
        *,
        run_id: str | None = None,
        day: str | None = None,
        month: str | None = None,
        key_id: str | None = None,
    ) -> Spend:
        scope, key = scope_of(run_id, day, month, key_id)
        name = _k("sm", "total", tenant) if scope == "total" else _k("sm", scope, tenant, key)
        return await self._spend(name)

    async def _spend(self, name: str) -> Spend:
        v = await self._call(lambda: self._redis.hmget(name, ["settled", "reserved"]), repeatable=True)
        return Spend(int(v[0] or 0), int(v[1] or 0))

    async def run_calls(self, tenant: str, run_id: str) -> int:
        run = _k("sm", "run", tenant, run_id)
        v = await self._call(lambda: self._redis.hget(run, "calls"), repeatable=True)
        return int(v or 0)

    # --- run state -------------------------------------------------------------------

    def _index_keys(self, tenant: str, run_id: str) -> list[str]:
        return [_k("sm", "run", tenant, run_id), _RUNS, _k("sm", "runs", tenant), _ACTIVE]

    async def run_add(self, tenant: str, run_id: str, deltas: dict[str, int]) -> None:
        name = _k("sm", "totals", tenant, run_id)

        async def add() -> None:
            async with self._redis.pipeline(transaction=True) as pipe:
                for field, value in deltas.items():
                    pipe.hincrby(name, field, int(value))
                await pipe.execute()

        await self._call(add, repeatable=False)  # a repeat would count twice

    async def run_totals(self, tenant: str, run_id: str) -> dict[str, int]:
        name = _k("sm", "totals", tenant, run_id)
        raw = await self._call(lambda: self._redis.hgetall(name), repeatable=True)
        return {k: int(v) for k, v in raw.items()}

    async def run_end(self, tenant: str, run_id: str) -> dict[str, Any] | None:
        first = await self._script(
            "run_end",
            [_k("sm", "run", tenant, run_id), _ACTIVE],
            [repr(time.time()), _member(tenant, run_id)],
            repeatable=False,
        )
        return await self._record(tenant, run_id) if int(first) else None

    async def _record(self, tenant: str, run_id: str) -> dict[str, Any] | None:
        run = _k("sm", "run", tenant, run_id)
        raw = await self._call(lambda: self._redis.hgetall(run), repeatable=True)
        if not raw:
            return None
        return run_record(
            tenant,
            run_id,
            calls=int(raw.get("calls", 0)),
            spend=Spend(int(raw.get("settled", 0)), int(raw.get("reserved", 0))),
            first_seen=float(raw["first_seen"]) if "first_seen" in raw else None,
            last_seen=float(raw["last_seen"]) if "last_seen" in raw else None,
            ended=raw.get("ended") == "1",
            trace=json.loads(raw["trace"]) if raw.get("trace") else None,
            totals=await self.run_totals(tenant, run_id),
        )

    async def idle_runs(self, before: datetime) -> list[tuple[str, str]]:
        ts = before.timestamp()
        members = await self._call(lambda: self._redis.zrangebyscore(_ACTIVE, "-inf", f"({ts!r}"), repeatable=True)
        return [(t, r) for t, r in map(json.loads, members)]

    async def list_runs(self, tenant: str | None, limit: int = 50) -> list[dict[str, Any]]:
        if tenant is None:
            members = await self._call(lambda: self._redis.zrevrange(_RUNS, 0, limit - 1), repeatable=True)
            pairs = [(t, r) for t, r in map(json.loads, members)]
        else:
            index = _k("sm", "runs", tenant)
            ids = await self._call(lambda: self._redis.zrevrange(index, 0, limit - 1), repeatable=True)
            pairs = [(tenant, r) for r in ids]
        records = [await self._record(t, r) for t, r in pairs]
        return [r for r in records if r is not None]

    # --- tool calls ------------------------------------------------------------------

    async def tools_put(self, tenant: str, run_id: str, calls: list[dict[str, Any]]) -> None:
        if not calls:
            return
        await self._script(
            "tools_put",
            [_k("sm", "tools", tenant, run_id), _k("sm", "toolseq", tenant, run_id)],
            _tool_args(calls),
            repeatable=True,
        )

    async def tools_take(self, tenant: str, run_id: str, ids: list[str]) -> list[dict[str, Any]]:
        if not ids:
            return []
        taken = await self._script(
            "tools_take",
            [_k("sm", "tools", tenant, run_id)],
            list(dict.fromkeys(ids)),
            repeatable=False,
        )
        return [json.loads(v.split("\t", 1)[1]) for v in taken]

    async def tools_pending(self, tenant: str, run_id: str) -> list[dict[str, Any]]:
        name = _k("sm", "tools", tenant, run_id)
        raw = await self._call(lambda: self._redis.hvals(name), repeatable=True)
        split = sorted((int(s), body) for s, body in (v.split("\t", 1) for v in raw))
        return [json.loads(body) for _, body in split]

    # --- admin -----------------------------------------------------------------------

    async def budget_set(self, tenant: str, day: int | None, month: int | None) -> None:
        name = _k("sm", "budget", tenant)

        async def put() -> None:
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.delete(name)
                values = {k: v for k, v in (("day", day), ("month", month)) if v is not None}
                if values:
                    pipe.hset(name, mapping=values)  # type: ignore[arg-type]
                await pipe.execute()

        await self._call(put, repeatable=True)

    async def budget_get(self, tenant: str) -> tuple[int | None, int | None]:
        name = _k("sm", "budget", tenant)
        day, month = await self._call(lambda: self._redis.hmget(name, ["day", "month"]), repeatable=True)
        return (int(day) if day else None, int(month) if month else None)

    async def ping(self) -> None:
        await self._call(self._redis.ping, repeatable=True)

    async def aclose(self) -> None:
        await self._redis.aclose()
        await self._redis.connection_pool.disconnect()


def _rate_states(turn: Turn, flat: list[Any]) -> tuple[RateState, ...]:
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
