"""The ledger and run-state store: one protocol (`Store`: the per-call `Ledger` and the
read and admin `Views`), two backends, one contract suite (tests/ledger).

An admission reads an `Ask` and a `Turn` (model call) or `ToolTurn` (MCP request) in one
atomic step; both backends judge it with the same `decide` over one `Standing` and explain
a refusal with `refusal`. Money is integer micro-USD; every key is tenant-scoped;
`admit` reserves, `settle` replaces the reservation by the actual cost, `release` settles
at zero, and an unsettled reservation expires at its reserved amount.
Scopes, tokens, windows and expiry: docs/internals.md, "The store protocol".
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import field, replace
from datetime import datetime
from typing import Any, Literal, Protocol
from zoneinfo import ZoneInfo

from proxy.errors import CeilingReached, LoopRefused, RateLimited, Refusal
from proxy.ledger import messages
from proxy.ledger.rates import Rate, RateState, rate_headers
from proxy.model import frozen

__all__ = [
    "CONTEXT_KEPT_S",
    "MAX_MICROS",
    "SCOPES",
    "TENANT_SCOPES",
    "Admission",
    "Ask",
    "Decision",
    "GuardRule",
    "HeldEnd",
    "Ledger",
    "Limits",
    "Rate",
    "RateState",
    "RunRow",
    "Spend",
    "Standing",
    "Store",
    "ToolTurn",
    "Turn",
    "Views",
    "WholeRun",
    "decide",
    "done_future",
    "rate_refusal",
    "refusal",
    "release_if_cancelled",
    "release_later",
    "release_soon",
    "window_keys",
]

Scope = Literal["run_cost", "tenant_day", "tenant_month", "key_day", "key_month"]
# In this order: of two scopes with the same headroom, the first is the one refused.
SCOPES: tuple[Scope, ...] = ("run_cost", "tenant_day", "tenant_month", "key_day", "key_month")
TENANT_SCOPES: tuple[Scope, ...] = SCOPES[:3]
MAX_MICROS = 2**53
# How long the size of a stored response or conversation is remembered (OpenAI keeps
# stored responses 30 days).
CONTEXT_KEPT_S = 30 * 86400


# scope -> the Limits field that caps it
_COST_LIMITS = {"run_cost": "run_max_cost", "tenant_day": "day_budget", "tenant_month": "month_budget",
                "key_day": "key_day_budget", "key_month": "key_month_budget"}


@frozen
class Limits:
    """Ceilings in force for one call; None = no limit. Cost limits in micro-USD.

    `origin` names where each limit came from ("tenant setting runs.max_llm_calls",
    "request header X-Run-Max-Calls"), keyed run_calls/run_cost/run_tokens/run_seconds/
    tenant_day/tenant_month/key_day/key_month, so that a refusal can say how to raise it.
    The key budgets apply to calls made with a key (`Turn.key`).
    """

    run_max_calls: int | None = None
    run_max_cost: int | None = None
    day_budget: int | None = None
    month_budget: int | None = None
    run_max_tokens: int | None = None  # input + output tokens of the run's calls, settled and in flight
    run_max_seconds: float | None = None  # wall time since the run's first call
    key_day_budget: int | None = None
    key_month_budget: int | None = None
    origin: Mapping[str, str] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        # Redis Lua numbers are doubles: integers stay exact only below 2^53 (~$9e9).
        for name in ("run_max_calls", "run_max_cost", "day_budget", "month_budget", "run_max_tokens",
                     "run_max_seconds", "key_day_budget", "key_month_budget"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < MAX_MICROS:
                raise ValueError(f"{name}={value} must be between 0 and 2^53")

    def cost_limit(self, scope: str) -> int | None:
        # Called for every scope of every admission: a lookup, not a dict built per call.
        name = _COST_LIMITS.get(scope)
        limit: int | None = None if name is None else getattr(self, name)
        return limit


@frozen
class WholeRun:
    """A run as budget leases kept it in memory (proxy/ledger/leases.py), to be written whole
    (`Views.runs_record`): ended, or still open when it lived too long in memory."""

    tenant: str
    run_id: str
    calls: int
    first_seen: float  # epoch seconds
    last_seen: float
    trace: dict[str, Any] | None
    settled: int  # micro-USD its calls cost: the run's own scope
    totals: Mapping[str, int]
    ended_at: float | None = None  # None: open, for the idle sweeper to end


@frozen
class HeldEnd:
    """The end of a run this process held in memory (`Views.end_held`): its record as
    `run_end` gives it, its open tool calls (taken), and how to add to its totals before
    it is written (what ending it counts: its tool calls never answered)."""

    record: dict[str, Any]
    tools: list[dict[str, Any]]
    add: Callable[[dict[str, int]], None]


@frozen
class GuardRule:
    """The loop guard's refusals, decided inside the admission from the streaks it counts."""

    threshold: int  # identical calls in a row from which `refuse` refuses
    refuse: bool  # False: streaks are counted and reminders follow, nothing refused here
    max_failures: int | None = None  # consecutive failed tool results that refuse the call


@frozen
class Ask:
    """Whose admission it is, under which ceilings and when: what `Ledger.admit` and
    `Ledger.admit_tool` read besides the turn. Built once per call by its caller."""

    tenant: str
    run_id: str
    now: datetime  # the admission's clock: timezone-aware
    limits: Limits = field(default_factory=Limits)  # before the admin API's budgets
    tz: str = "UTC"  # the zone of the day and month windows
    ttl_s: int = 900  # after this a reservation never settled expires at its amount


@frozen
class Turn:
    """What one model call asks of the ledger, in the same atomic step: its reservation's
    bounds, the tool calls its results close (with ok flags), the loop guard, the run's
    trace ids to keep if the run has none, and the stored context it names."""

    # (least, most) micro-USD to reserve: the input and the least answer worth sending,
    # and the worst case. The least is refused when some scope cannot hold it; the most is
    # cut to the smallest headroom.
    reserve: tuple[int, int] = (0, 0)
    results: tuple[tuple[str, bool], ...] = ()  # (tool call id, the result is not a failure)
    guard: GuardRule | None = None
    trace: dict[str, Any] | None = None
    context: tuple[str, ...] = ()  # stored-context refs, e.g. "response:resp_1"
    input_rate: int = 0  # micro-USD per million tokens of stored context (dearest input rate)
    priced: bool = True  # False: the model has no price, refused under any cost limit
    model: str | None = None  # named in that refusal
    price_hint: str = ""  # and what to do about it, where the model is an Azure deployment's
    key: str | None = None  # the caller's key id: its budget scopes and rate buckets
    rates: tuple[Rate, ...] = ()  # rate-limit buckets this call draws on
    # (least, most) tokens the call may use: input bound + the least worth answering, and +
    # the output bound. Under runs.max_tokens the reservation is cut to the headroom left
    # (never below the least), and the caller clamps the request's output to what it holds.
    tokens: tuple[int, int] = (0, 0)
    # Calls to count on the run: 1 for a model call. A budget lease (proxy/ledger/leases.py)
    # counts the calls it may serve up front, so a crash can only over-count them.
    count: int = 1
    # The run was made for this one call (no X-Run-Id, no traceparent) and no other call
    # names it: budget leases keep it in memory and write it whole (`Views.runs_record`).
    solo: bool = False


NO_TURN = Turn()


@frozen
class ToolTurn:
    """One request on the MCP route as the ledger sees it (`Store.admit_tool`).

    A `tools/call` names its tool (`name`, `sig` = name + sha256 of canonical arguments,
    as the loop guard compares model tool calls). Any other request leaves `name` None:
    it draws on `rates` and the run's trace ids are kept (`trace`), nothing is counted
    or reserved.
    """

    name: str | None = None
    sig: str = ""
    cost: int = 0  # micro-USD: the tool's fixed price (mcp_servers.X.tool_costs), reserved like a call's
    max_calls: int | None = None  # runs.max_tool_calls, the tenant's or its key's when tighter
    guard: GuardRule | None = None
    trace: dict[str, Any] | None = None
    key: str | None = None  # the caller's key id: its budget scopes and rate buckets, as a model call's
    rates: tuple[Rate, ...] = ()  # requests-per-minute buckets this request draws on (any request, not only tools)


# The run total that counts MCP tool calls; `runs.max_tool_calls` is checked against it.
MCP_TOOL_CALLS = "mcp_tool_calls"


@frozen
class Admission:
    """A counted call holding `reserved` micro-USD on every scope until settled."""

    id: str
    tenant: str
    run_id: str
    reserved: int
    calls: int  # the run's call count, this call included
    remaining: dict[str, int | None]  # scope -> micro-USD left after this reservation
    day_key: str
    month_key: str
    # The tool calls this request answered, each with the run's `streak` of identical
    # calls and consecutive `failures` after it; the run's trace ids; stored-context tokens.
    closed: tuple[dict[str, Any], ...] = ()
    trace: dict[str, Any] | None = None
    context_tokens: int = 0
    limits: Limits | None = None  # in force: config limits with the admin API's budgets
    # Read only when a ceiling needs them: the run's settled tokens before this call, and
    # when its first call arrived (epoch seconds).
    run_tokens: int = 0
    started_at: float | None = None
    rates: tuple[RateState, ...] = ()  # each rate bucket after this call
    key: str | None = None  # the caller's key id (`Turn.key`): settle finds the key's scopes by it
    tokens: int = 0  # tokens held on the run until settled (stored context included)


@frozen
class Spend:
    settled: int = 0
    reserved: int = 0

    @property
    def total(self) -> int:
        return self.settled + self.reserved


@frozen
class Decision:
    """What `decide` concluded: reserve `amount`, or refuse on `scope`."""

    amount: int = 0
    refused: str | None = None  # run_calls | run_tokens | run_seconds | a scope of SCOPES
    remaining: dict[str, int | None] = field(default_factory=dict)
    tokens: int = 0  # tokens to hold on the run


@frozen
class Standing:
    """The run and its scopes as an admission found them, and what the call asks of them:
    the facts `decide` judges and `refusal` explains."""

    limits: Limits  # in force: with the admin API's budgets
    ledger: Mapping[str, Spend]  # the scopes the call reserves on (those of SCOPES it has)
    reserve: tuple[int, int]  # (least, most) micro-USD, stored context included
    calls: int = 0  # the run's calls before this one
    run_tokens: int = 0  # the run's settled tokens
    tokens: tuple[int, int] = (0, 0)  # (least, most) tokens the call may use
    tokens_held: int = 0  # by the run's calls in flight
    elapsed_s: float = 0.0  # since the run's first call
    count: int = 1  # calls the admission counts (`Turn.count`)


def window_keys(now: datetime, tz: str = "UTC") -> tuple[str, str]:
    """("YYYY-MM-DD", "YYYY-MM") of `now` in `tz`. `now` must be timezone-aware."""
    if now.tzinfo is None:
        raise ValueError("admission time must be timezone-aware (use datetime.now(UTC))")
    local = now.astimezone(ZoneInfo(tz))
    # Formatted by hand: strftime twice took 3/4 of this, once per admission on the loop.
    month = f"{local.year:04d}-{local.month:02d}"
    return f"{month}-{local.day:02d}", month


def decide(found: Standing) -> Decision:
    """The admission rule, shared by both backends (redis.py's admit.lua mirrors it).

    Refuse when the run's call count or wall time is at its ceiling, when its token
    headroom (the ceiling - `run_tokens` settled - `tokens_held` in flight) is used up or
    below `tokens[0]`, or when some scope of `ledger` has less headroom than the least
    reservation (`reserve[0]`); otherwise reserve min(`reserve[1]`, smallest headroom)
    and, under a token ceiling, min(tokens[1], token headroom).
    """
    limits, ledger, calls, tokens = found.limits, found.ledger, found.calls, found.tokens
    min_reserve, max_reserve = found.reserve
    if limits.run_max_calls is not None and calls + found.count > limits.run_max_calls:
        return Decision(refused="run_calls")
    # Tokens are held only under a token ceiling: without one nothing reads them, and the
    # settle then has no run row to write back.
    held = 0
    if limits.run_max_tokens is not None:
        left = limits.run_max_tokens - found.run_tokens - found.tokens_held
        if left <= 0 or left < tokens[0]:
            return Decision(refused="run_tokens")
        held = min(tokens[1], left)
    if limits.run_max_seconds is not None and found.elapsed_s >= limits.run_max_seconds:
        return Decision(refused="run_seconds")
    headroom: dict[str, int | None] = {}
    tightest: tuple[int, str] | None = None
    for scope in SCOPES:
        if scope not in ledger:
            continue
        limit = limits.cost_limit(scope)
        headroom[scope] = h = None if limit is None else limit - ledger[scope].total
        if h is not None and (tightest is None or h < tightest[0]):
            tightest = (h, scope)
    if tightest is not None and tightest[0] < min_reserve:
        return Decision(refused=tightest[1])
    amount = max_reserve if tightest is None else min(max_reserve, tightest[0])
    remaining = {s: None if h is None else h - amount for s, h in headroom.items()}
    return Decision(amount=amount, remaining=remaining, tokens=held)


def ledger_keys(run_id: str, windows: tuple[str, str], key: str | None) -> dict[str, tuple[str, str]]:
    """scope -> (ledger scope, ledger key) of every scope a call reserves on."""
    keys = {"run_cost": ("run", run_id), "tenant_day": ("day", windows[0]), "tenant_month": ("month", windows[1])}
    if key is not None:
        keys |= {"key_day": ("keyday", f"{key}/{windows[0]}"), "key_month": ("keymonth", f"{key}/{windows[1]}")}
    return keys


ADMIN_BUDGET = "admin budget (`spanmeter budget set` / PUT /admin/budgets)"


def with_budgets(limits: Limits, day: int | None, month: int | None) -> Limits:
    """`limits` with the budgets the admin API stored, read inside the admission itself,
    so a change holds from the next call on every replica."""
    if day is None and month is None:
        return limits
    origin = dict(limits.origin)
    if day is not None:
        origin["tenant_day"] = ADMIN_BUDGET
    if month is not None:
        origin["tenant_month"] = ADMIN_BUDGET
    return replace(limits, day_budget=limits.day_budget if day is None else day,
                   month_budget=limits.month_budget if month is None else month, origin=origin)


def costed(limits: Limits) -> bool:
    return any(limits.cost_limit(scope) is not None for scope in SCOPES)


def streak_of(state: tuple[str | None, int, int], sig: str, ok: bool, *, step: bool = True) -> tuple[str, int, int]:
    """(signature, streak, failures) of a run after one more closed tool call. `step` is
    False for the calls after the first that one admission closes: they answer one model
    turn, and identical calls within one answer (parallel calls) are one step of a streak.
    admit.lua mirrors it."""
    last, streak, failures = state
    return sig, (streak + step if last == sig else 1), 0 if ok else failures + 1


def guard_refusal(tenant: str, run_id: str, closed: tuple[dict[str, Any], ...],
                  rule: GuardRule | None) -> LoopRefused | None:
    """The loop guard's refusal of this call, judged on the tool calls it closed."""
    if rule is None:
        return None
    for c in closed:
        if rule.max_failures is not None and c["failures"] >= rule.max_failures:
            return LoopRefused(messages.failure_ceiling(tenant, run_id, c["name"], c["failures"], rule.max_failures))
    for c in closed:
        if rule.refuse and c["streak"] >= rule.threshold:
            return LoopRefused(messages.loop_ceiling(tenant, run_id, c["name"], c["streak"], rule.threshold))
    return None


def match_pending(pending: list[dict[str, Any]], name: str, sig: str) -> dict[str, Any] | None:
    """The open model tool call (in the order the model made them) that an MCP `tools/call`
    executes: the first with the same tool and arguments, else the first with the same tool;
    never one an MCP call took already. admit_tool.lua mirrors it."""
    free = [p for p in pending if not p.get("mcp")]
    return next((p for p in free if p.get("sig") == sig), None) or next(
        (p for p in free if p.get("name") == name), None)


def tool_entry(matched: dict[str, Any] | None, turn: ToolTurn, streak: int) -> dict[str, Any]:
    """What admit_tool answers about the call, in `Admission.closed[0]`: the model tool call
    it executes (its id, link and arguments, marked `mcp`) when one matched, and the streak."""
    base = {**matched, "mcp": True} if matched is not None else {"name": turn.name, "sig": turn.sig}
    return {**base, "streak": streak, "failures": 0}


def tool_ceiling(tenant: str, run_id: str, limit: int) -> CeilingReached:
    return CeilingReached(messages.tool_call_ceiling(tenant, run_id, limit), limit="run_tool_calls")


def context_refusal(tenant: str, unknown: list[str], limits: Limits) -> CeilingReached:
    return CeilingReached(messages.unbounded_context(tenant, unknown), limit="stored_context")


def unpriced_refusal(tenant: str, model: str | None, hint: str = "") -> CeilingReached:
    return CeilingReached(messages.unknown_price(model, tenant) + hint, limit="unknown_price")


def context_micros(tokens: int, rate: int) -> int:
    return -(-tokens * rate // 1_000_000)


def refused_with(error: Refusal, closed: tuple[dict[str, Any], ...], trace: dict[str, Any] | None) -> Refusal:
    error.closed, error.trace = closed, trace
    return error


def refusal(decision: Decision, ask: Ask, found: Standing, key: str | None = None) -> CeilingReached:
    """The CeilingReached error for a refused decision, with its message. `key` is the
    caller's key id, named when one of its budgets refused."""
    tenant, run_id, limits = ask.tenant, ask.run_id, found.limits
    scope = decision.refused or "run_calls"
    origin = limits.origin.get(scope)
    who = messages.Who(tenant, run_id, key)
    if scope == "run_calls":
        text = messages.call_ceiling(tenant, run_id, limits.run_max_calls or 0, origin)
        return CeilingReached(text, limit=scope)
    if scope == "run_tokens":
        tally = messages.Tally(limits.run_max_tokens or 0, found.run_tokens, found.tokens_held, found.tokens[0])
        return CeilingReached(messages.token_ceiling(who, tally, origin), limit=scope)
    if scope == "run_seconds":
        text = messages.time_ceiling(tenant, run_id, limits.run_max_seconds or 0, found.elapsed_s, origin)
        return CeilingReached(text, limit=scope)
    spend = found.ledger[scope]
    day, month = window_keys(ask.now, ask.tz)
    window = day if scope.endswith("_day") else month if scope.endswith("_month") else None
    tally = messages.Tally(limits.cost_limit(scope) or 0, spend.settled, spend.reserved, found.reserve[0])
    text = messages.cost_ceiling(scope, who, tally, window=window, tz=ask.tz, origin=origin)
    return CeilingReached(text, limit=scope)


def rate_refusal(tenant: str, states: tuple[RateState, ...]) -> RateLimited:
    """The 429 for an admission some rate bucket refused: the one that makes the call wait
    longest (or that it can never fit) speaks; the headers describe every bucket."""
    refused = [s for s in states if s.wait_ms != 0]
    never = [s for s in refused if s.wait_ms is None]
    worst = never[0] if never else max(refused, key=lambda s: s.wait_ms or 0)
    text = messages.rate_limit(tenant, worst)
    return RateLimited(text, limit=f"rate_{worst.rate.unit}", wait_ms=worst.wait_ms,
                       rate_headers=rate_headers(states))


async def release_if_cancelled(store: Store, admitting: Callable[[], Awaitable[Admission]]) -> Admission:
    """Run an admission so that a caller cancelled mid-way does not leak it.

    The store operation runs to completion in its own task; if our caller is cancelled
    meanwhile, the admission it would have returned is released (the call was never
    forwarded, so zero is its true cost) instead of expiring at its reserved amount.
    """
    task = asyncio.ensure_future(admitting())
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        task.add_done_callback(lambda t: release_later(store, t))
        raise


_RELEASING: set[asyncio.Task[None]] = set()  # keeps fire-and-forget releases alive


def release_later(store: Store, task: asyncio.Future[Any]) -> None:
    """Release the admission an abandoned admit produced (a refusal needs nothing)."""
    if task.cancelled() or task.exception() is not None or not isinstance(task.result(), Admission):
        return
    release_soon(store, task.result())


def release_soon(store: Store, admission: Admission) -> None:
    """Release an admission whose call was never forwarded (zero is its true cost), in a
    task kept alive until it is done."""
    releasing = asyncio.ensure_future(store.release(admission))
    _RELEASING.add(releasing)
    releasing.add_done_callback(_RELEASING.discard)


class Ledger(Protocol):
    """The per-call operations: what the request path does to the ledger. All are atomic
    per call and raise StoreUnavailable (never a backend's own exception) when the
    backend cannot be reached.

    A model call makes two: `admit` before forwarding and `settle` after the answer,
    whatever the turn carries; an MCP request `admit_tool` and `settle`. `release` gives
    back an admission never forwarded, `expire` charges the abandoned ones."""

    async def admit(self, ask: Ask, turn: Turn = NO_TURN) -> Admission:
        """For `ask.tenant`'s run `ask.run_id`, in one atomic step: close the tool calls
        `turn.results` answer (counting the run's streaks and failures), keep `turn.trace`
        if the run has none, apply the admin budgets over `ask.limits`, bound
        `turn.context`, check the run's calls, settled tokens and wall time, then the
        headroom of every scope (the key's too, with `turn.key`), then draw on `turn.rates`
        (GCRA, proxy/ledger/rates.py), and count the call and reserve between the bounds of
        `turn.reserve` (plus the stored context) on every scope, for `ask.ttl_s`.

        Raises LoopRefused, CeilingReached or RateLimited (call not counted, nothing
        reserved, no rate bucket drawn on; the tool calls stay closed and the error
        carries them in `closed` and the trace in `trace`)."""
        ...

    async def admit_tool(self, ask: Ask, turn: ToolTurn) -> Admission:
        """One request on the MCP route, in one atomic step: keep `turn.trace` if the run
        has none; for a `tools/call` (`turn.name` set) also take the open model tool call it
        executes (`match_pending`, marked `mcp` so that the request carrying its result
        emits no inferred span for it), count the run's streak of identical MCP calls,
        then refuse (loop guard, `turn.max_calls`, the run's wall time, a cost scope: the
        key's too with `turn.key`) or count it in the run's `mcp_tool_calls` (and
        `tool_calls` when no model call matched) and reserve `turn.cost` on every scope.
        Any request, tool call or not, then draws on `turn.rates`. `closed` holds one entry
        (`tool_entry`); settle the admission as a model call's. A request that is not a
        tool call gets id "".

        Raises LoopRefused, CeilingReached or RateLimited (nothing counted, reserved or
        drawn; the entry and trace ride on the error as `closed` and `trace`)."""
        ...

    async def settle(
        self,
        admission: Admission,
        actual: int,
        *,
        run_totals: dict[str, int] | None = None,
        tools: list[dict[str, Any]] | None = None,
        contexts: dict[str, int] | None = None,
    ) -> int:
        """Replace the reservation by `actual` on every scope; returns the overshoot
        (actual - reserved when positive, charged in full).

        In the same atomic step, for the admission's tenant and run: adds `run_totals`
        as `run_add` would, remembers `tools` (open tool calls, closed by a later admit),
        and remembers the size in tokens of each stored context this answer revealed
        (`contexts`: ref -> tokens, the largest kept). A second settle of the same
        admission is a no-op as a whole."""
        ...

    async def settle_in_order(
        self,
        admission: Admission,
        actual: int,
        *,
        run_totals: dict[str, int] | None = None,
        tools: list[dict[str, Any]] | None = None,
        contexts: dict[str, int] | None = None,
    ) -> Awaitable[int]:
        """`settle` in two steps: returns once every operation this process submits after it
        will see its effect, with the settle's own result (the overshoot) to await.

        What lets a run's next call be admitted before its previous call's settle is done.
        A store that applies operations in the order they were submitted (SQLite's one
        writer) returns at once; one that cannot promise that order (Redis: a retry after a
        lost connection may land after a later operation) returns once the settle is done."""
        ...

    def queues_settle(self, admission: Admission) -> bool:
        """Whether `settle_in_order(admission, ...)` queues the settle without waiting and
        needs no running task (nothing in it reads the task: no network timeout): the call's
        bookkeeping then runs as a plain callback (serve/bookkeeping.py)."""
        ...

    async def release(self, admission: Admission) -> None: ...

    async def expire(self, now: datetime) -> int:
        """Turn reservations past their ttl into settled charges; returns how many."""
        ...



class Views(Protocol):
    """Reads and admin writes: run ends, the idle sweeper, the CLI and the admin API."""

    async def spend(
        self,
        tenant: str,
        *,
        run_id: str | None = None,
        day: str | None = None,
        month: str | None = None,
        key_id: str | None = None,
    ) -> int:
        """Settled + reserved micro-USD of one scope (run, day, month; none = all time)."""
        ...

    async def spend_detail(
        self,
        tenant: str,
        *,
        run_id: str | None = None,
        day: str | None = None,
        month: str | None = None,
        key_id: str | None = None,
    ) -> Spend: ...

    async def run_calls(self, tenant: str, run_id: str) -> int: ...
    async def run_add(self, tenant: str, run_id: str, deltas: dict[str, int], *, soon: bool = False) -> None:
        """Add `deltas` to the run's totals. `soon`: they are analytics a power cut may lose
        (the cost anatomy's sums), so the call need not wait for them to reach the disk."""
        ...
    async def run_totals(self, tenant: str, run_id: str) -> dict[str, int]: ...

    async def run_end(self, tenant: str, run_id: str) -> dict[str, Any] | None:
        """Mark the run ended; the run record goes to the first caller only."""
        ...

    def end_held(self, tenant: str, run_id: str) -> HeldEnd | None:
        """End a run this process holds in memory (budget leases' runs of one call), here
        and now: no store operation, nothing to wait for. None: the run is not held here
        (end it with `run_end`); a backend of its own holds none."""
        ...

    async def idle_runs(self, before: datetime) -> list[tuple[str, str]]: ...

    async def run_guard(self, tenant: str, run_id: str, state: tuple[str | None, int, int]) -> None:
        """Set the run's loop-guard state (signature, streak, consecutive failures): what
        budget leases moved in memory by closing tool calls there, written back."""
        ...

    async def runs_record(self, runs: Sequence[WholeRun]) -> None:
        """Write runs kept in memory (budget leases' runs of one call) whole: their rows, the
        money their calls settled on the run's own scope (the tenant's scopes were settled
        by the lease that served them) and their totals, added to whatever is there."""
        ...

    async def sweep_turn(self, every_s: float) -> bool:
        """Whether this replica runs the sweep (expire, idle runs) of the period of
        `every_s` starting now: on a shared ledger, one replica per period does."""
        ...

    async def list_runs(self, tenant: str | None, limit: int = 50) -> list[dict[str, Any]]: ...
    async def tools_put(self, tenant: str, run_id: str, calls: list[dict[str, Any]]) -> None: ...
    async def tools_take(self, tenant: str, run_id: str, ids: list[str]) -> list[dict[str, Any]]: ...
    async def tools_pending(self, tenant: str, run_id: str) -> list[dict[str, Any]]: ...
    async def budget_set(self, tenant: str, day: int | None, month: int | None) -> None: ...
    async def budget_get(self, tenant: str) -> tuple[int | None, int | None]: ...


class Store(Ledger, Views, Protocol):
    """One backend: the per-call Ledger and the Views over the same data."""

    async def ping(self) -> None: ...
    async def aclose(self) -> None: ...


class DerivedOps:
    """Store operations both backends derive from their own primitives."""

    def end_held(self, tenant: str, run_id: str) -> HeldEnd | None:
        return None  # a backend holds every run in the store itself

    async def spend_detail(
        self, tenant: str, *, run_id: str | None = None, day: str | None = None, month: str | None = None,
        key_id: str | None = None,
    ) -> Spend:
        raise NotImplementedError

    async def settle(self, admission: Admission, actual: int, *, run_totals: dict[str, int] | None = None,
                     tools: list[dict[str, Any]] | None = None, contexts: dict[str, int] | None = None) -> int:
        raise NotImplementedError

    async def settle_in_order(self, admission: Admission, actual: int, *, run_totals: dict[str, int] | None = None,
                              tools: list[dict[str, Any]] | None = None,
                              contexts: dict[str, int] | None = None) -> Awaitable[int]:
        # Ordered once done: true of any store.
        return done_future(await self.settle(admission, actual, run_totals=run_totals, tools=tools, contexts=contexts))

    async def spend(
        self, tenant: str, *, run_id: str | None = None, day: str | None = None, month: str | None = None,
        key_id: str | None = None,
    ) -> int:
        return (await self.spend_detail(tenant, run_id=run_id, day=day, month=month, key_id=key_id)).total

    async def release(self, admission: Admission) -> None:
        await self.settle(admission, 0)


def done_future(result: int) -> asyncio.Future[int]:
    fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    fut.set_result(result)
    return fut


@frozen
class RunRow:
    """A run as a backend keeps it, read for `run_record`."""

    calls: int
    first_seen: float | None
    last_seen: float | None
    ended: bool
    trace: dict[str, Any] | None


def run_record(tenant: str, run_id: str, row: RunRow, spend: Spend, totals: dict[str, int]) -> dict[str, Any]:
    """The one shape both backends return for a run."""
    return {
        "tenant": tenant,
        "run_id": run_id,
        "calls": row.calls,
        "settled": spend.settled,
        "reserved": spend.reserved,
        "spend": spend.total,
        "first_seen": row.first_seen,
        "last_seen": row.last_seen,
        "ended": row.ended,
        "trace": row.trace,
        "totals": totals,
    }


def scope_of(run_id: str | None, day: str | None, month: str | None,
             key_id: str | None = None) -> tuple[str, str]:
    """(scope, key) for spend(): at most one of run_id/day/month; none = all time. With
    `key_id`, the day or month of that key (one of them is then required)."""
    given = [(s, k) for s, k in (("run", run_id), ("day", day), ("month", month)) if k is not None]
    if len(given) > 1:
        raise ValueError("spend() takes at most one of run_id, day, month")
    if key_id is not None:
        if not given or given[0][0] == "run":
            raise ValueError("spend(key_id=...) takes a day or a month")
        return f"key{given[0][0]}", f"{key_id}/{given[0][1]}"
    return given[0] if given else ("total", "")
