"""Cost anatomy: a call's billed input tokens and input cost shared among its parts, and
what each tool's results cost over a run. Pure arithmetic, no I/O.

Tokens are shared by bytes; cached tokens are the earliest (reads, then writes, then the
rest); each share is priced at its window's billed rate; integers are shared by cumulative
rounding (`apportion`), so the shares sum to the whole. `Splits` keeps a run's last split,
so turn N+1 splits only what it appended; a `Chain` (a run's requests that extend one
another) prices its tool results over the run from one number a call, and `Chain.flush`
hands the sums to the bookkeeping (proxy/serve/bookkeeping.py).
The rules, their units and why: docs/anatomy.md.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from heapq import nlargest
from itertools import accumulate
from math import gcd
from operator import add, sub
from typing import Any, Final, Protocol
from zlib import crc32

from proxy.model import Anatomy, Flushed, InputPart, Usage
from proxy.pricing import STANDARD_FACTOR, Price, cost

__all__ = ["FLUSH_EVERY", "NANO", "OTHER", "TOP_RESULTS", "Chain", "Conversation", "Split", "Splits", "anatomy",
           "apportion", "shares", "shares_general", "split_of", "split_parts"]

class NamedCall(Protocol):
    """A tool call of a request's conversation: its id and the tool's name."""

    @property
    def call_id(self) -> str: ...

    @property
    def name(self) -> str: ...


class Conversation(Protocol):
    """What the anatomy reads of a request, in its API's shapes (the call's request side,
    proxy/providers/translator.py `Exchange`): the body's list of conversation items, the
    parts of a body (or of a body holding only some items), and its tool calls."""

    @property
    def conversation(self) -> str | None: ...

    def input_parts(self, body: dict[str, Any]) -> list[InputPart]: ...

    def tool_history(self, body: dict[str, Any]) -> Sequence[NamedCall]: ...


TOP_RESULTS: Final = 5  # the largest results, by bytes, listed per call
MAX_TRACKED: Final = 32  # results a chain prices one by one for the run's dearest (those ever in a call's top)
MAX_RESULT_GROUPS: Final = 64  # tools whose results are grouped by name; the rest are `_OTHER`
FLUSH_EVERY: Final = 16  # a chain's calls between flushes into the run's totals
NANO: Final = 1_000_000_000  # a chain's sums are in nano-micro-USD
OTHER: Final = "_OTHER"

# The units the arithmetic shares among: the kinds of parts (or each part, for `anatomy()`).
_KIND_UNITS: Final = ("system", "tools", "history", "new", "tool_result")
_KIND_UNITS_LIST: Final = list(_KIND_UNITS)
_UNIT: Final = {k: i for i, k in enumerate(_KIND_UNITS)}
_HISTORY, _NEW, _RESULT, _TOOLS = _UNIT["history"], _UNIT["new"], _UNIT["tool_result"], _UNIT["tools"]


def apportion(total: int, weights: Sequence[int]) -> list[int]:
    """`total` shared in proportion to `weights` (non-negative), summing to `total` exactly,
    each share within one of its exact value. Rounded cumulatively: share i is how far the
    rounded-down running total moves at weight i, so the rounding never drifts and no
    sort is needed (this runs several times per call). With no weight at all, the last
    share takes everything (the newest content)."""
    if not weights:
        return []
    cum = list(accumulate(weights))
    whole = cum[-1]
    if whole <= 0:
        return [0] * (len(weights) - 1) + [total]
    marks = [total * c // whole for c in cum]
    return [marks[0], *map(sub, marks[1:], marks)]


class Split:
    """A request's parts as the arithmetic needs them: each part's bytes, where it ends and
    its unit (its kind, or itself for `anatomy()`), the units' bytes, the tool results and
    their groups (by tool name), the largest results; and what the next request of the run
    is checked against: its size, where its conversation ends, its item count, its last
    item and its bytes (`raw`, the run's first request only), or their CRC-32 (`head`
    before the conversation's end, `tail` after; the whole request in `head` while that
    end is not known), which covers the last item too: a chain holds no parsed item.

    A run's next request extends its last one's split in place (`split_of`): the run's
    chain holds it, and nothing else reads an older state of it (the chain keeps its own
    counts of what it priced)."""

    __slots__ = ("definitions", "end", "ends", "head", "inherited", "items", "last_item", "name_id", "names",
                 "near", "new_parts", "per_part", "raw", "result_at", "result_name", "result_size", "size", "sizes",
                 "tail", "top", "unit_bytes", "unit_kind", "units")

    def __init__(self, per_part: bool = False) -> None:
        self.sizes: list[int] = []
        self.ends: list[int] = []  # cumulative bytes at each part's end
        self.units: list[int] = []
        self.per_part = per_part
        self.unit_kind: list[str] = [] if per_part else _KIND_UNITS_LIST
        self.unit_bytes: list[int] = [] if per_part else [0] * len(_KIND_UNITS)
        self.result_at: list[int] = []  # the tool results' part indexes, their bytes and group (tool name id)
        self.result_size: list[int] = []
        self.result_name: list[int] = []
        self.names: list[str] = []  # the groups' tool names (bounded, then `_OTHER`); only ever appended to
        self.name_id: dict[str, int] = {}
        self.new_parts: list[int] = []  # parts of this turn's new content (history once answered)
        self.top: list[tuple[int, int, str, str]] = []  # (bytes, part index, tool, call id), largest first
        self.definitions: dict[str, int] = {}  # tool name -> its definition's bytes
        self.inherited = False  # the definitions are the run's last request's (counted already)
        self.raw = b""
        self.size = 0  # the request's bytes
        self.end: int | None = None  # byte offset of the conversation's end in the request, once known
        self.head = self.tail = 0  # CRC-32s, once `raw` is let go
        self.items = 0
        self.last_item: object = None
        self.near: tuple[int, list[int]] = (0, [0] * len(self.unit_bytes))  # a part, and the units' bytes before it

    def _add(self, parts: Sequence[InputPart]) -> None:
        """Parts appended, as kind units (`_add_per_part` for `anatomy()`)."""
        sizes, units, ends, ub = self.sizes, self.units, self.ends, self.unit_bytes
        at = ends[-1] if ends else 0
        results: list[tuple[int, int, str, str]] = []
        defs: dict[str, int] | None = None  # copied before a change: an earlier call's anatomy holds it
        for i, (kind, size, name, call_id) in enumerate(parts, len(sizes)):
            unit = _UNIT.get(kind, _NEW)
            if unit == _RESULT:
                results.append((size, i, name, call_id))
                self._result(i, size, name)
            elif unit == _TOOLS:
                if defs is None:
                    defs = self.definitions = dict(self.definitions)
                    self.inherited = False
                defs[name] = defs.get(name, 0) + size
            elif unit == _NEW:
                self.new_parts.append(i)
            at += size
            sizes.append(size)
            units.append(unit)
            ends.append(at)
            ub[unit] += size
        top = self.top
        if results and (len(top) < TOP_RESULTS or any(r[0] > top[-1][0] for r in results)):
            self.top = nlargest(TOP_RESULTS, [*top, *results], key=_by_bytes)

    def _add_per_part(self, parts: Sequence[InputPart]) -> None:
        at = 0
        for i, (kind, size, name, call_id) in enumerate(parts):
            if kind == "tool_result":
                self._result(i, size, name)
                self.top.append((size, i, name, call_id))
            elif kind == "tools":
                self.definitions[name] = self.definitions.get(name, 0) + size
            at += size
            self.sizes.append(size)
            self.units.append(i)
            self.ends.append(at)
            self.unit_kind.append(kind)
            self.unit_bytes.append(size)
        self.top = nlargest(TOP_RESULTS, self.top, key=_by_bytes)

    def _result(self, i: int, size: int, name: str) -> None:
        nid = self.name_id.get(name)
        if nid is None:
            if len(self.names) >= MAX_RESULT_GROUPS:
                name = OTHER
                nid = self.name_id.get(name)
            if nid is None:
                nid = self.name_id[name] = len(self.names)
                self.names.append(name)
        self.result_at.append(i)
        self.result_size.append(size)
        self.result_name.append(nid)

    def _answered(self) -> None:
        """The model answered: the last turn's new content is earlier conversation now."""
        units, sizes, ub = self.units, self.sizes, self.unit_bytes
        at, before = self.near
        for i in self.new_parts:
            units[i] = _HISTORY
            ub[_NEW] -= sizes[i]
            ub[_HISTORY] += sizes[i]
            if i < at:
                before[_NEW] -= sizes[i]
                before[_HISTORY] += sizes[i]
        self.new_parts = []

    def units_before(self, k: int) -> list[int]:
        """Each unit's bytes in the parts before part k. Counted from the nearest of the
        start, the end and the last call's k (`near`): a cache's end moves a few parts
        from one call of a run to the next."""
        units, sizes = self.units, self.sizes
        n = len(sizes)
        if self.per_part:
            return sizes[:k] + [0] * (n - k)
        at, ub = self.near
        if k <= at // 2:
            at, ub = 0, [0] * len(self.unit_bytes)
        elif n - k < abs(k - at):
            at, ub = n, self.unit_bytes
        ub = ub.copy()
        for i in range(at, k):
            ub[units[i]] += sizes[i]
        for i in range(k, at):
            ub[units[i]] -= sizes[i]
        self.near = (k, ub)
        return ub


def _by_bytes(r: tuple[int, int, str, str]) -> int:
    return r[0]


def split_parts(parts: Sequence[InputPart], per_part: bool = False) -> Split:
    """The split of a request's parts (`per_part`: every part its own group)."""
    sp = Split(per_part)
    if per_part:
        sp._add_per_part(parts)
    else:
        sp._add(parts)
    return sp


def split_of(adapter: Conversation, raw: bytes, body: dict[str, Any], previous: Split | None) -> Split:
    """The request's split: `previous` (the run's last request) extended in place by the new
    items only, when the request is it with items appended; else the adapter's whole split."""
    key = adapter.conversation
    items = body.get(key) if key is not None else None
    if key is None or not isinstance(items, list):
        return split_parts(adapter.input_parts(body))
    if previous is not None:
        if len(raw) == previous.size and _again(previous, raw):  # the same request again (a retry, a loop)
            previous.inherited = True  # its tool list was counted with the call that made it
            return previous
        found = _appended(previous, raw, items)
        if found is not None:
            tail = adapter.input_parts({key: items[previous.items:]})
            answered = unnamed = False
            for kind, _, name, call_id in tail:
                if kind == "history":
                    answered = True
                elif kind == "tool_result" and not name and call_id:
                    unnamed = True
            if unnamed:
                tail = _named(adapter, body, tail)  # a result of a call made before the new items
            sp = previous
            if answered and sp.new_parts:
                sp._answered()
            sp.inherited = True
            sp._add(tail)
            sp.end, sp.head, sp.tail = found
            sp.raw, sp.size, sp.items, sp.last_item = b"", len(raw), len(items), None
            return sp
    sp = split_parts(adapter.input_parts(body))
    if previous is not None and sp.definitions == previous.definitions:  # the run's tool list, counted already
        sp.definitions, sp.inherited = previous.definitions, True
    sp.raw, sp.size, sp.items, sp.last_item = raw, len(raw), len(items), items[-1] if items else None
    return sp


def _named(adapter: Conversation, body: dict[str, Any], tail: list[InputPart]) -> list[InputPart]:
    names = {c.call_id: c.name for c in adapter.tool_history(body)}
    return [(kind, size, names.get(cid, ""), cid) if kind == "tool_result" and not name else (kind, size, name, cid)
            for kind, size, name, cid in tail]


def _again(prev: Split, raw: bytes) -> bool:
    """Whether `raw` is `prev`'s request (of the same size), byte for byte; `prev` keeps
    its CRCs from then on, not its bytes."""
    if prev.raw:
        if raw != prev.raw:
            return False
        prev.head, prev.tail = _crcs(raw, prev.end)
        prev.raw, prev.last_item = b"", None
        return True
    return _crcs(raw, prev.end) == (prev.head, prev.tail)


def _crcs(raw: bytes, end: int | None) -> tuple[int, int]:
    """The CRC-32 of `raw` before and after `end` (the whole of it, and of nothing, when None)."""
    mv = memoryview(raw)
    at = len(raw) if end is None else end
    return crc32(mv[:at]), crc32(mv[at:])


def _appended(prev: Split, raw: bytes, items: list[Any]) -> tuple[int, int, int] | None:
    """When `raw` is `prev`'s request with items inserted at the end of its conversation:
    where its conversation ends, and the CRCs of `raw` before and after that; else None."""
    grown = len(raw) - prev.size
    if grown <= 0 or len(items) <= prev.items:
        return None
    if prev.raw:  # the run's first request, byte for byte: find the insertion
        # Its last item unchanged: the longest common prefix may end inside an item that grew.
        if prev.items and items[prev.items - 1] != prev.last_item:
            return None
        old = memoryview(prev.raw)
        at = _common_prefix(raw, old)
        if not raw.endswith(old[at:]):
            return None
        return (at + grown, *_crcs(raw, at + grown))
    end = prev.end
    if end is None:  # only the whole request's CRC: where it grew is not known
        return None
    mv = memoryview(raw)
    head = crc32(mv[:end])
    if head != prev.head or crc32(mv[end + grown:]) != prev.tail:
        return None
    # The CRC goes on over the new items; the bytes after the conversation are the same: so is theirs.
    return end + grown, crc32(mv[end:end + grown], head), prev.tail


def _common_prefix(a: bytes, b: memoryview) -> int:
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a.startswith(b[:mid]):
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(slots=True)
class Tracked:
    """A result a chain prices one by one (one of its largest): its cost since it was
    added is `size * (scale - scale0) + extra`, its sends `calls - calls0`."""

    name: str
    call_id: str
    size: int
    scale0: int
    calls0: int
    j: int  # its index among the split's results
    extra: int = 0
    micros: int = 0  # flushed so far
    sends: int = 0


@dataclass(slots=True)
class Chain:
    """A run's requests in this process that extend one another (module docstring): the
    last one's split, and the sums its tool results are priced from.

    A call only appends to it (what arrived, and at what running total; its parts' sums;
    its results past the first window): the chain's state is cold in memory by the run's
    next call, and each object a call touches costs more than the arithmetic. `flush` does
    the per-tool and per-result work, once every `FLUSH_EVERY` calls. What it priced is its
    own (`seen`, `sizes`): a call whose split was extended but not priced (no usage) adds
    nothing, and its results count from the next call on."""

    split: Split
    scale: int = 0  # a byte of the first window, summed over the chain's calls (nano-micro-USD)
    calls: int = 0
    seen: int = 0  # the split's results the chain has priced since they arrived
    # Since the last flush: results that arrived (first index, `scale` and `calls` then), the
    # calls' `Anatomy.late_marks` and `Anatomy.late`, and their parts' sums (labels, tokens,
    # cached, micro-USD per kind unit; labels: the caller's, its provider and model).
    arrived: list[tuple[int, int, int]] = field(default_factory=list)
    marks: list[tuple[int, int, int]] = field(default_factory=list)
    late: list[tuple[int, int, int]] = field(default_factory=list)
    parts: list[tuple[tuple[str, ...], list[int], list[int], list[int]]] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)  # per result group: its results' bytes
    base: list[int] = field(default_factory=list)  # per result group: sum of bytes * scale when added
    extra: list[int] = field(default_factory=list)  # per result group: what lying past the first window added
    flushed: list[int] = field(default_factory=list)  # per result group: micro-USD flushed so far
    tracked: dict[int, Tracked] = field(default_factory=dict)  # by part index
    unflushed: int = 0  # calls since the last flush (the chain it replaced counted in)
    touched: float = 0.0  # when a call last added to it (monotonic seconds)
    kept: int = 0  # the bytes `Splits` counts for it (`_kept`)
    carried: Flushed | None = None  # what the chain it replaced had not flushed yet

    def add(self, sp: Split, an: Anatomy, now: float, labels: tuple[str, ...] = ()) -> None:
        """One call of the chain: `sp` (its split, extended, or the chain's first) priced as
        `an`; its parts' sums go with `labels` (opaque here)."""
        self.split = sp
        n = len(sp.result_at)
        if self.seen < n:  # results new to the chain: their share of the sum so far is not theirs
            self.arrived.append((self.seen, self.scale, self.calls))
            self.seen = n
        self.scale += an.byte_cost
        self.parts.append((labels, an.tokens, an.cached, an.costs))
        if an.late_marks:
            self.marks += an.late_marks
        if an.late:
            self.late += an.late
        self.calls += 1
        self.unflushed += 1
        self.touched = now

    def flush(self) -> Flushed:
        """What the chain's calls' parts and its results cost since the last flush (and it
        counts as flushed)."""
        self.unflushed = 0
        if self.arrived:
            self._arrived()
        if self.marks:
            self._marked()
        if self.late:
            self._late()
        names, scale, base, extra, flushed = self.split.names, self.scale, self.base, self.extra, self.flushed
        tools = []
        for nid, size in enumerate(self.sizes):
            now = (size * scale - base[nid] + extra[nid]) // NANO
            if now != flushed[nid]:
                tools.append((names[nid], now - flushed[nid]))
                flushed[nid] = now
        results = []
        for t in self.tracked.values():
            micros, sends = (t.size * (scale - t.scale0) + t.extra) // NANO, self.calls - t.calls0
            if sends != t.sends or micros != t.micros:
                results.append((t.name, t.call_id, t.size, micros - t.micros, sends - t.sends))
                t.micros, t.sends = micros, sends
        out = Flushed(tools, results, self._parts())
        if self.carried is not None:
            before, self.carried = self.carried, None
            out = Flushed(before.tools + out.tools, before.results + out.results, before.kinds + out.kinds)
        return out

    def _arrived(self) -> None:
        """The results that arrived since the last flush into their groups' sums; those
        among the split's largest are priced one by one from then on."""
        sp = self.split
        groups = len(sp.names)
        if len(self.base) < groups:
            grow = [0] * (groups - len(self.base))
            self.base += grow
            self.sizes += grow
            self.extra += grow
            self.flushed += grow
        at, names, result_sizes = sp.result_at, sp.result_name, sp.result_size
        base, sizes, tracked = self.base, self.sizes, self.tracked
        ends = [first for first, _, _ in self.arrived[1:]] + [self.seen]
        for (first, scale, calls), end in zip(self.arrived, ends, strict=True):
            for j in range(first, end):
                nid, size = names[j], result_sizes[j]
                sizes[nid] += size
                base[nid] += size * scale
            lo, hi = at[first], at[end - 1]
            for size, i, name, cid in sp.top:
                if lo <= i <= hi and i not in tracked and len(tracked) < MAX_TRACKED:
                    tracked[i] = Tracked(name, cid, size, scale, calls, bisect_left(at, i))
        self.arrived = []

    def _marked(self) -> None:
        """The calls' marks into their results' extras: per result, the sum of the per-byte
        costs above the first window of the calls it lay past that window in (a running
        sum over the results, each mark added at its first result and taken off past its last)."""
        diff = [0] * (self.seen + 1)
        for first, end, per in self.marks:
            diff[first] += per
            diff[end] -= per
        self.marks = []
        per_result = list(accumulate(diff))
        sp, extra = self.split, self.extra
        for nid, size, per in zip(sp.result_name, sp.result_size, per_result, strict=False):
            if per:
                extra[nid] += size * per
        for t in self.tracked.values():
            t.extra += t.size * per_result[t.j]

    def _late(self) -> None:
        """The results that lay across a window's end into their groups' and their own extras."""
        extra, tracked = self.extra, self.tracked
        for i, nid, above in self.late:
            extra[nid] += above
            if i in tracked:
                tracked[i].extra += above
        self.late = []

    def _parts(self) -> list[tuple[tuple[str, ...], str, int, int, int]]:
        """The calls' parts summed per labels and kind (kinds with nothing left out)."""
        sums: dict[tuple[str, ...], list[list[int]]] = {}
        for labels, tokens, cached, costs in self.parts:
            row = sums.get(labels)
            if row is None:
                sums[labels] = [tokens, cached, costs]
            else:
                row[0] = list(map(add, row[0], tokens))
                row[1] = list(map(add, row[1], cached))
                row[2] = list(map(add, row[2], costs))
        self.parts = []
        return [(labels, kind, t, c, m) for labels, (ts, cs, ms) in sums.items()
                for kind, t, c, m in zip(_KIND_UNITS, ts, cs, ms, strict=True) if t or c or m]


def _kept(sp: Split) -> int:
    """About what a chain of `sp` holds in memory: the request's bytes while it keeps them
    (its last item, parsed, only with them), and its split's lists (measured with
    gc.get_referents: ~1.9 KB for a short chat's 2 parts, ~10.6 KB for the bench's agent
    turn of 55)."""
    return len(sp.raw) + 2048 + 160 * len(sp.sizes)


class Splits:
    """Each run's chain, by (tenant, run id): its last request's split and its results' sums,
    for its next request. Bounded by runs and by the bytes its chains hold (`_kept`; least
    recently used out first). A process's own cache: a missing entry only means the next
    request is split whole. A chain pushed out with calls not flushed is flushed as it goes,
    and what it flushed waits in `dropped` for `idle`: only the sums wait, never the chain,
    whose split may hold its whole request (a 45 KB agent turn), however far the flusher
    falls behind."""

    # 4 MB: ~370 chains of the bench's 45 KB agent turn, as many as 16 MB of whole requests
    # held before. Twice as many cost ~5% more CPU per agent call (bench/run.py, agent_c64):
    # the cyclic collector walks every chain's lists, where whole requests were bytes it skips.
    def __init__(self, max_runs: int = 4096, max_bytes: int = 4 << 20) -> None:
        self._runs: dict[tuple[str, ...], Chain] = {}
        self._bytes = 0
        self.max_runs, self.max_bytes = max_runs, max_bytes
        self.dropped: list[tuple[tuple[str, ...], Flushed]] = []

    def get(self, key: tuple[str, ...]) -> Chain | None:
        return self._runs.get(key)

    def advance(self, key: tuple[str, ...], sp: Split, an: Anatomy, now: float,
                labels: tuple[str, ...] = ()) -> Chain:
        """The run's chain after a call of request `sp` priced as `an` (`labels`: `Chain.add`):
        its own, or a new one when `sp` does not extend it. A new one carries what the old
        one summed and had not flushed, and its count of calls since (a run whose requests
        never extend one another is flushed every `FLUSH_EVERY` calls too, not on each)."""
        chain = self._runs.pop(key, None)
        if chain is not None:
            self._bytes -= chain.kept
            if sp is not chain.split:  # not its request extended in place: the chain broke
                pending = chain.unflushed
                chain = Chain(sp, carried=chain.flush() if pending else None, unflushed=pending)
        if chain is None:
            chain = Chain(sp)
        chain.add(sp, an, now, labels)
        kept = _kept(sp)
        if kept > self.max_bytes:  # too large to keep: its sums are added a moment from now
            self.dropped.append((key, chain.flush()))
            return chain
        self._runs[key] = chain
        chain.kept = kept
        self._bytes += kept
        while self._bytes > self.max_bytes or len(self._runs) > self.max_runs:
            first = next(iter(self._runs))
            old = self._runs.pop(first)
            self._bytes -= old.kept
            if old.unflushed:
                self.dropped.append((first, old.flush()))
        return chain

    def forget(self, key: tuple[str, ...]) -> Chain | None:
        """The run's chain, no longer kept (its run ended)."""
        old = self._runs.pop(key, None)
        if old is not None:
            self._bytes -= old.kept
        return old

    def idle(self, before: float) -> list[tuple[tuple[str, ...], Flushed]]:
        """What to add to runs' totals now: the sums of the chains dropped, and the flush of
        each chain with calls not flushed that no call added to since `before` (kept: its
        run may go on)."""
        out, self.dropped = self.dropped, []
        out += [(key, chain.flush()) for key, chain in self._runs.items()
                if chain.unflushed and chain.touched < before]
        return out

    def of_run(self, tenant: str, run_id: str) -> list[tuple[tuple[str, ...], Flushed]]:
        """The run's sums not yet added: those of its chains dropped, and the flush of its
        chain, no longer kept (the run ends)."""
        key: tuple[str, ...] = (tenant, run_id)
        out = [(k, f) for k, f in self.dropped if k == key] if self.dropped else []
        if out:
            self.dropped = [(k, f) for k, f in self.dropped if k != key]
        chain = self.forget(key)
        if chain is not None:
            out.append((key, chain.flush()))
        return out


def anatomy(parts: Sequence[InputPart], usage: Usage, price: Price | None) -> Anatomy | None:
    """The parts' shares of `usage`'s input, each part its own group (or None when the
    input is unknown)."""
    return shares(split_parts(parts, per_part=True), usage, price)


def shares(sp: Split, usage: Usage, price: Price | None) -> Anatomy | None:
    """The split's units' shares of `usage`'s input, or None when the input is unknown."""
    total = usage.input_tokens
    if total is None or not sp.sizes:
        return None
    read, hour, five = _classes(usage, total)
    size = sp.ends[-1]
    if not (hour or five or sp.per_part) and price is not None and size > 0 and (
            (usage.cache_read_tokens or 0) + (usage.cache_write_tokens or 0) <= total):
        return _shares_read(sp, usage, price, total, read, size)
    return shares_general(sp, usage, price)


def shares_general(sp: Split, usage: Usage, price: Price | None) -> Anatomy | None:
    """`shares` for every case: four windows (cache reads, 1-hour writes, 5-minute writes,
    the rest), any units."""
    total = usage.input_tokens
    if total is None or not sp.sizes:
        return None
    read, hour, five = _classes(usage, total)
    amounts = (read, hour, five, total - read - hour - five)
    size = sp.ends[-1]
    n = len(sp.unit_bytes)
    rates = _rates(price, usage, total) if price is not None else (0, 0, 0, 0)
    if size <= 0:  # nothing to weigh: the newest part takes it all
        weights = [[0] * n for _ in range(4)]
        for w in range(4):
            weights[w][sp.units[-1]] = 1
    else:
        weights = _windows(sp, amounts, total, size)
    zero = [0] * n
    windows = [apportion(a, w) if a else zero for a, w in zip(amounts, weights, strict=True)]
    if hour or five:
        tokens = [a + b + c + d for a, b, c, d in zip(*windows, strict=True)]
    elif read:
        tokens = [a + d for a, d in zip(windows[0], windows[3], strict=True)]
    else:
        tokens = windows[3]
    whole = _input_cost(price, usage, amounts, rates) if price is not None else 0
    if whole:
        exact = _exact(windows, amounts, rates)
        costs = apportion(whole, exact if any(exact) else tokens)
    else:
        costs = zero
    kinds: dict[str, tuple[int, int, int]] = {}
    for kind, t, c, m, b in zip(sp.unit_kind, tokens, windows[0], costs, sp.unit_bytes, strict=True):
        if not (t or b):
            continue  # a kind the request does not have
        row = kinds.get(kind)
        kinds[kind] = (t, c, m) if row is None else (row[0] + t, row[1] + c, row[2] + m)
    pre = (read * rates[0] + hour * rates[1] + five * rates[2] + amounts[3] * rates[3]) * size  # exact, * size
    bounds = [0]
    for a in amounts:
        bounds.append(bounds[-1] + a * size)
    return _priced(Anatomy(sp.unit_kind, tokens, windows[0], costs, total, whole, kinds, [], sp.definitions,
                           not sp.inherited), sp, pre,
                   [(hi, r) for hi, a, r in zip(bounds[1:], amounts, rates, strict=True) if a])


def _shares_read(sp: Split, usage: Usage, price: Price, total: int, read: int, size: int) -> Anatomy:
    """`shares` of a call with no cache writes (all but Anthropic's cache-making calls), by
    kind of part: the same arithmetic with two windows (read, the rest) written out, since
    it runs on every call. Written to keep its integers small: past 2**30 CPython's
    arithmetic leaves its one-digit fast path, and that was most of this function's time."""
    rest = total - read
    ub = sp.unit_bytes
    r_in, r_cached, _, _ = price.rates(total)
    factor = price.multiplier(usage)
    micro = read * r_cached + rest * r_in
    whole = (-(-micro // 1_000_000) if factor is STANDARD_FACTOR
             else -(-micro * factor.numerator // (1_000_000 * factor.denominator)))
    if read == 0 or rest == 0:
        tokens = apportion(total, ub)
        cached = tokens if rest == 0 else [0] * len(ub)
    else:
        # The cached tokens are apportion(read, bytes * total before the mark), whose weights
        # sum to read * size: each running mark is read * c // (read * size), that is c // size.
        mark = read * size
        k = bisect_right(sp.ends, mark // total)  # the part the cache's end falls in
        before = _units_before(sp, k, mark, total)
        c0 = before[0]
        c1 = c0 + before[1]
        c2 = c1 + before[2]
        c3 = c2 + before[3]
        m0, m1, m2, m3 = c0 // size, c1 // size, c2 // size, c3 // size
        cached = [m0, m1 - m0, m2 - m1, m3 - m2, read - m3]
        # The rest likewise: weights bytes * total - before, summing to rest * size.
        c0 = ub[0] * total - c0
        c1 = c0 + ub[1] * total - before[1]
        c2 = c1 + ub[2] * total - before[2]
        c3 = c2 + ub[3] * total - before[3]
        m0, m1, m2, m3 = c0 // size, c1 // size, c2 // size, c3 // size
        tokens = [cached[0] + m0, cached[1] + m1 - m0, cached[2] + m2 - m1, cached[3] + m3 - m2,
                  cached[4] + rest - m3]
    # Costs shared by the exact costs, t * r_in - c * (r_in - r_cached), whose sum is the
    # call's exact cost: with the rates' common factor taken out, which changes no running mark.
    g = gcd(r_in, r_cached) or 1
    r_i, d = r_in // g, (r_in - r_cached) // g
    t0, t1, t2, t3, t4 = tokens
    k0, k1, k2, k3, k4 = cached
    s = micro // g
    if s and whole:
        q0 = t0 * r_i - k0 * d
        q1 = q0 + t1 * r_i - k1 * d
        q2 = q1 + t2 * r_i - k2 * d
        q3 = q2 + t3 * r_i - k3 * d
        x0, x1, x2, x3 = whole * q0 // s, whole * q1 // s, whole * q2 // s, whole * q3 // s
        costs = [x0, x1 - x0, x2 - x1, x3 - x2, whole - x3]
    else:
        costs = apportion(whole, tokens)
    kinds = {}
    if t0 or ub[0]:
        kinds["system"] = (t0, k0, costs[0])
    if t1 or ub[1]:
        kinds["tools"] = (t1, k1, costs[1])
    if t2 or ub[2]:
        kinds["history"] = (t2, k2, costs[2])
    if t3 or ub[3]:
        kinds["new"] = (t3, k3, costs[3])
    if t4 or ub[4]:
        kinds["tool_result"] = (t4, k4, costs[4])
    an = Anatomy(_KIND_UNITS_LIST, tokens, cached, costs, total, whole, kinds, [], sp.definitions, not sp.inherited)
    pre = micro * size
    if not (whole and pre):
        return _priced(an, sp, pre, [])
    # What the run's chain prices results with (`_priced`, the two windows written out).
    per_byte = whole * NANO * total  # / pre: a byte's nano-micro-USD per unit of rate
    unit = (r_cached if read else r_in) * per_byte // pre
    an.byte_cost = unit
    at = sp.result_at
    if not (read and rest and at):
        an.top = [(name, cid, b, b * total // size, b * unit // NANO) for b, _, name, cid in sp.top]
        return an
    # The results past the cached prefix cost `above` more per byte; the one the prefix ends
    # inside, its bytes past the end (bytes * total, one rounding): as `_priced`.
    above = d * g * per_byte // pre
    ends, mark = sp.ends, read * size
    k = bisect_right(ends, mark // total)
    j = bisect_left(at, k)
    inside, straddle = -1, 0  # the part the prefix ends inside, if a result, and its cost past the end
    if j < len(at) and at[j] == k and (ends[k - 1] if k else 0) * total < mark:
        straddle = (ends[k] * total - mark) * d * g * whole * NANO // pre
        if straddle:
            an.late = [(k, sp.result_name[j], straddle)]
        inside, j = k, j + 1
    if j < len(at) and above:
        an.late_marks = [(j, len(at), above)]
    past = at[j] if j < len(at) else len(ends)
    an.top = [(name, cid, b, b * total // size,
               (b * unit + (b * above if i >= past else straddle if i == inside else 0)) // NANO)
              for b, i, name, cid in sp.top]
    return an


def _priced(an: Anatomy, sp: Split, pre: int, windows: list[tuple[int, int]]) -> Anatomy:
    """`an` with what its run's chain needs to price its tool results (`Chain.add`): a
    byte's cost at the prompt's first window, and what the results lying past that window
    cost above it; and the largest results' cost this call. `pre`: the call's exact input
    cost * the prompt's bytes; `windows`: (end, rate) of the windows with tokens, in prompt
    order, ends in bytes * total."""
    total, whole, size = an.input_tokens, an.input_cost_micros, sp.ends[-1]
    if not (whole and pre and windows):
        an.top = [(name, cid, b, b * total // size if size else 0, 0) for b, _, name, cid in sp.top]
        return an
    per_byte = whole * NANO * total  # / pre: a byte's nano-micro-USD per unit of rate
    end0, rate0 = windows[0]
    unit = rate0 * per_byte // pre  # a byte in the first window
    late: list[tuple[int, int, int]] = []  # results across a window's end: (part index, group, cost above `unit`)
    marks: list[tuple[int, int, int]] = []  # results wholly in one later window: (first, end, per byte above)
    at = sp.result_at
    extras: dict[int, int] = {}
    if end0 < size * total and at:
        ends, sizes = sp.ends, sp.sizes
        first = bisect_left(at, bisect_right(ends, end0 // total))  # from the part the first window ends in
        for j in range(first, len(at)):
            i = at[j]
            hi = ends[i] * total
            width = sizes[i] * total
            lo, start, extra = hi - width, end0, 0
            for end, rate in windows[1:]:
                overlap = min(hi, end) - max(lo, start)
                if overlap == width:  # all in one window: its rate above the first, per byte
                    per = (rate - rate0) * per_byte // pre
                    if per and marks and marks[-1][1] == j and marks[-1][2] == per:
                        marks[-1] = (marks[-1][0], j + 1, per)
                    elif per:
                        marks.append((j, j + 1, per))
                    extras[i] = sizes[i] * per
                    break
                if overlap > 0:
                    extra += overlap * (rate - rate0)
                start = end
            else:
                cost_above = extra * whole * NANO // pre
                if cost_above:
                    late.append((i, sp.result_name[j], cost_above))
                    extras[i] = cost_above
    an.top = [(name, cid, b, b * total // size, (b * unit + extras.get(i, 0)) // NANO) for b, i, name, cid in sp.top]
    an.byte_cost, an.late, an.late_marks = unit, late, marks
    return an


def _units_before(sp: Split, k: int, at: int, total: int) -> list[int]:
    """Each unit's bytes before position `at` (bytes * total), which falls in part k."""
    ub = [b * total for b in sp.units_before(k)]
    ub[sp.units[k]] += at - (sp.ends[k - 1] if k else 0) * total
    return ub


def _windows(sp: Split, amounts: tuple[int, int, int, int], total: int, size: int) -> list[list[int]]:
    """Each unit's bytes in each window (cache reads, 1-hour writes, 5-minute writes, the
    rest), scaled by `total` (bytes * total) so that the prompt's `size` bytes map onto its
    `total` tokens without fractions. A window of no tokens gets no weights (they are not read)."""
    full_u = [b * total for b in sp.unit_bytes]
    zero_u = [0] * len(full_u)
    if amounts[3] == total:  # nothing cached or written: the usual first call
        return [zero_u, zero_u, zero_u, full_u]
    weights = []
    lo_u, mark = zero_u, 0
    for a in amounts:
        if not a:
            weights.append(zero_u)
            continue
        mark += a
        hi_u = full_u if mark >= total else _before(sp, mark * size, total)
        weights.append(hi_u if lo_u is zero_u else _minus(hi_u, lo_u))
        lo_u = hi_u
    return weights


def _minus(a: list[int], b: list[int]) -> list[int]:
    return [x - y for x, y in zip(a, b, strict=True)]


def _before(sp: Split, at: int, total: int) -> list[int]:
    """Each unit's bytes before position `at` (in bytes * total)."""
    return _units_before(sp, bisect_right(sp.ends, at // total), at, total)  # the part the position falls in


def _exact(windows: list[list[int]], amounts: tuple[int, int, int, int], rates: tuple[int, int, int, int],
           ) -> list[int]:
    """Each column's cost at its windows' rates, unrounded."""
    read, hour, five, rest = windows
    r_read, r_hour, r_five, r_in = rates
    if not (amounts[1] or amounts[2]):
        return [c * r_read + u * r_in for c, u in zip(read, rest, strict=True)]
    return [a * r_read + b * r_hour + c * r_five + d * r_in for a, b, c, d in zip(read, hour, five, rest, strict=True)]


def _input_cost(price: Price, usage: Usage, amounts: tuple[int, int, int, int],
                rates: tuple[int, int, int, int]) -> int:
    """`pricing.cost` of the usage without its output, without copying the usage when its
    cache counts fit in its input (they always do, as providers report them)."""
    if (usage.cache_read_tokens or 0) + (usage.cache_write_tokens or 0) > amounts[0] + amounts[1] + amounts[2]:
        return cost(price, replace(usage, output_tokens=0))
    factor = price.multiplier(usage)
    micro = sum(a * r for a, r in zip(amounts, rates, strict=True))
    return -(-micro * factor.numerator // (1_000_000 * factor.denominator))


def _classes(usage: Usage, total: int) -> tuple[int, int, int]:
    """(cache reads, 1-hour writes, 5-minute writes) tokens, in prompt order, clipped to
    the billed total; the rest is uncached."""
    read = min(usage.cache_read_tokens or 0, total)
    written = min(usage.cache_write_tokens or 0, total - read)
    hour = min(usage.cache_write_1h_tokens or 0, written)
    return read, hour, written - hour


def _rates(price: Price, usage: Usage, total: int) -> tuple[int, int, int, int]:
    """Rates of the cached, 1-hour written, 5-minute written and uncached tokens, as
    `pricing.cost` picks them (the tier multiplier applies to all alike, so it changes no share)."""
    size = max(total, (usage.cache_read_tokens or 0) + (usage.cache_write_tokens or 0))
    r_in, r_cached, r_write, _ = price.rates(size)
    return r_cached, price.cache_write_1h_rate(size), r_write, r_in
