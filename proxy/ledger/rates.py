"""Rate limits per minute, per tenant and per key: GCRA, as exact integers.

Why GCRA (the generic cell rate algorithm, a leaky bucket as a meter) and not a window:

- It rolls continuously. A fixed window lets a caller spend its limit at 11:59:59 and
  again at 12:00:00 (twice the rate across the boundary); GCRA admits at most `limit`
  units in any 60 s, and a used-up bucket refills smoothly (one request of 100/min every
  0.6 s), so `Retry-After` is short and exact.
- It is exact. A sliding-window *counter* (two fixed windows weighted) is an
  approximation; a sliding-window *log* is exact but keeps one entry per request.
- Its state is two integers per bucket (`debt`, `last_ms`), read and written inside the
  same atomic admission as every ceiling, in both stores (sqlite.py, lua/admit.lua), so
  500 concurrent admissions against 100 requests a minute admit exactly 100.

The bucket, in integers (exact in Redis's Lua doubles, below 2**53): one unit (a request,
or a token) costs `60,000` (ms in the window); the bucket holds `limit x 60,000` and
drains `limit` every millisecond. A call fits when the drained debt plus its cost still
fits. `remaining` is how many more units fit now, `reset` how long until the bucket is
empty again (OpenAI's `x-ratelimit-reset-*`), `wait` how long until this call would fit.

The clock is the admission's `now` (milliseconds), so tests control it; several
replicas need roughly synchronised clocks (a skew shifts when a unit comes back, never
how many fit).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Literal

from proxy.model import frozen

__all__ = ["WINDOW_MS", "Rate", "RateState", "duration", "epoch_ms", "rate_headers", "rate_step"]

WINDOW_MS = 60_000

Unit = Literal["requests", "tokens"]


@frozen
class Rate:
    """One bucket a call draws on: at most `limit` units a minute, `cost` of them now.

    `owner` is "tenant" or "key <key id>": buckets are kept per tenant, and per key within it.
    """

    owner: str
    unit: Unit
    limit: int
    cost: int

    @property
    def bucket(self) -> str:
        return f"{self.owner}/{self.unit}"


@frozen
class RateState:
    """A bucket after an admission looked at it."""

    rate: Rate
    remaining: int  # units that fit now (after this call, if it was admitted)
    reset_ms: int  # until the bucket is empty again
    wait_ms: int | None  # 0: this call fits; else until it would; None: it never can (cost > limit)


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def epoch_ms(now: datetime) -> int:
    """`now` in whole milliseconds since the epoch, exactly (no float rounding)."""
    return (now - _EPOCH) // timedelta(milliseconds=1)


def rate_step(debt: int, last_ms: int, now_ms: int, rate: Rate) -> tuple[int, RateState]:
    """(the bucket's debt with this call counted, or as drained when it does not fit; its state).

    `lua/admit.lua` mirrors this line for line; the store contract suite holds both to it.
    """
    cap = rate.limit * WINDOW_MS
    elapsed = min(max(0, now_ms - last_ms), WINDOW_MS)  # a full window drains any debt
    drained = max(0, debt - elapsed * rate.limit)
    need = drained + rate.cost * WINDOW_MS
    wait: int | None
    if rate.cost > rate.limit:
        wait, held = None, drained
    elif need <= cap:
        wait, held = 0, need
    else:
        wait, held = -(-(need - cap) // rate.limit), drained
    return held, RateState(rate, (cap - held) // WINDOW_MS, -(-held // rate.limit), wait)


def duration(ms: int) -> str:
    """A wait as OpenAI writes it in `x-ratelimit-reset-*`: `20ms`, `1.5s`, `6m0s`."""
    if ms < 1000:
        return f"{ms}ms"
    minutes, rest = divmod(ms, 60_000)
    seconds = f"{rest / 1000:.3f}".rstrip("0").rstrip(".")
    return f"{minutes}m{seconds}s" if minutes else f"{seconds}s"


def rate_headers(states: tuple[RateState, ...]) -> dict[str, str]:
    """OpenAI's `x-ratelimit-{limit,remaining,reset}-{requests,tokens}`, from the bucket of each
    unit with the least room (a key's and its tenant's buckets both hold; the tighter speaks)."""
    headers: dict[str, str] = {}
    for unit in ("requests", "tokens"):
        of_unit = [s for s in states if s.rate.unit == unit]
        if not of_unit:
            continue
        tight = min(of_unit, key=lambda s: (s.remaining, -s.reset_ms))
        headers[f"x-ratelimit-limit-{unit}"] = str(tight.rate.limit)
        headers[f"x-ratelimit-remaining-{unit}"] = str(tight.remaining)
        headers[f"x-ratelimit-reset-{unit}"] = duration(tight.reset_ms)
    return headers
