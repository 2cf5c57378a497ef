"""Instruments: every metric spanmeter records, created once per Telemetry.

Labels are low-cardinality only: operation, provider, request and response model,
server address/port, error.type, tenant, and small enums of our own. Never a run id,
conversation id, response id or trace id. Values a caller, its model or an upstream can
steer (models, error types, tool names) pass through `Instruments.labels`
(tracing/labels.py) first: known or bounded values only.

The instruments are tracing/aggregate.py's plain-Python ones, not the SDK's: same call
signatures, a fraction of the cost per point. Label sets are built once and reused
(`LabelCache`): a point then only makes a tuple of the dict's items to find its series.

Budget gauges are read at collection time: the proxy pushes the latest numbers with
`Telemetry.set_budget()` and `BudgetValues` reports them when /metrics is rendered or a
push is built, so a scrape never touches the ledger.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Final, Generic, TypeVar

from opentelemetry.util.types import AttributeValue

from proxy.model import frozen
from tracing import attributes as A
from tracing.aggregate import Counter, GaugeSeries, Histogram, Instrument, SumSeries
from tracing.labels import KnownModel, LabelBounds

__all__ = ["BudgetValues", "CallKey", "CallLabels", "Instruments", "LabelCache", "build_kind_labels", "frozen_labels"]

Labels = dict[str, AttributeValue]
FrozenLabels = Mapping[str, AttributeValue]
K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

LABEL_CACHE_ENTRIES: Final = 4096


def frozen_labels(labels: Labels) -> FrozenLabels:
    """A label set to share: read-only by type (`Mapping`), so mypy rejects any change in
    place. A plain dict, not a MappingProxyType: a point iterates a dict faster, and a
    proxy would cost on every point for a guarantee the types already give."""
    return labels


class LabelCache(Generic[K, V]):
    """Label sets by key, built on first use and then shared.

    Bounded: when `max_entries` is reached the cache is cleared and refills. Labels are
    low-cardinality by design, so a full cache means unusual input (many tenants or
    models), where rebuilding costs what it did before the cache; an LRU's bookkeeping
    on every hit would cost the common case instead. Safe to share between threads:
    a race only builds an entry twice.
    """

    def __init__(self, build: Callable[[K], V], max_entries: int = LABEL_CACHE_ENTRIES) -> None:
        self._build = build
        self._entries: dict[K, V] = {}
        self._max = max_entries

    def get(self, key: K) -> V:
        found = self._entries.get(key)
        if found is None:
            if len(self._entries) >= self._max:
                self._entries.clear()
            found = self._entries[key] = self._build(key)
        return found

    def __len__(self) -> int:
        return len(self._entries)


# tenant, operation, provider, request model, response model, server address, server
# port, error type: everything a model call's metric labels depend on.
CallKey = tuple[str, str, str, str | None, str | None, str, int, str | None]
KindKey = tuple[str, str]  # the kind of a rewrite or repair, tenant


@frozen
class CallLabels:
    """The label sets of one model call's points."""

    base: FrozenLabels  # operation, provider, request/response model, server, tenant
    timed: FrozenLabels  # base plus error.type when the call failed
    input_tokens: FrozenLabels
    output_tokens: FrozenLabels
    money: FrozenLabels  # provider, request model, tenant: cost needs no more
    cache_read: FrozenLabels  # money plus spanmeter.cache.operation=read
    cache_write: FrozenLabels

    @staticmethod
    def build(key: CallKey) -> CallLabels:
        tenant, operation, provider, model, response_model, address, port, error_type = key
        base: Labels = {A.GEN_AI_OPERATION_NAME: operation}
        money: Labels = {}
        if provider:
            base[A.GEN_AI_PROVIDER_NAME] = money[A.GEN_AI_PROVIDER_NAME] = provider
        if model is not None:
            base[A.GEN_AI_REQUEST_MODEL] = money[A.GEN_AI_REQUEST_MODEL] = model
        if response_model is not None:
            base[A.GEN_AI_RESPONSE_MODEL] = response_model
        if address:
            base[A.SERVER_ADDRESS] = address
        if port:
            base[A.SERVER_PORT] = port
        base[A.SPANMETER_TENANT_ID] = money[A.SPANMETER_TENANT_ID] = tenant
        timed = {**base, A.ERROR_TYPE: error_type} if error_type else base
        return CallLabels(
            base=frozen_labels(base),
            timed=frozen_labels(timed),
            input_tokens=frozen_labels({**base, A.GEN_AI_TOKEN_TYPE: A.TOKEN_TYPE_INPUT}),
            output_tokens=frozen_labels({**base, A.GEN_AI_TOKEN_TYPE: A.TOKEN_TYPE_OUTPUT}),
            money=frozen_labels(money),
            cache_read=frozen_labels({**money, A.SPANMETER_CACHE_OPERATION: A.CACHE_READ}),
            cache_write=frozen_labels({**money, A.SPANMETER_CACHE_OPERATION: A.CACHE_WRITE}),
        )


def build_kind_labels(key: KindKey) -> FrozenLabels:
    """(kind, tenant) of a rewrite or repair."""
    return frozen_labels({A.SPANMETER_KIND: key[0], A.SPANMETER_TENANT_ID: key[1]})


@dataclass(slots=True)
class BudgetValues:
    """The latest budget numbers per (tenant, window), in micro-USD."""

    _values: dict[tuple[str, str], tuple[int, int | None]] = field(default_factory=dict)
    _labels: LabelCache[tuple[str, str], FrozenLabels] = field(
        default_factory=lambda: LabelCache(lambda key: frozen_labels(_budget_labels(*key))))
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def set(self, tenant: str, window: str, spent_micros: int, limit_micros: int | None) -> None:
        # Set from the event loop, read from whichever thread collects metrics.
        with self._lock:
            self._values[(tenant, window)] = (spent_micros, limit_micros)

    def snapshot(self) -> list[tuple[str, str, int, int | None]]:
        with self._lock:
            return [(t, w, s, lim) for (t, w), (s, lim) in self._values.items()]

    def spent(self) -> list[tuple[float, FrozenLabels]]:
        return [(s / 1e6, self._labels.get((t, w))) for t, w, s, _ in self.snapshot()]

    def limits(self) -> list[tuple[float, FrozenLabels]]:
        return [(lim / 1e6, self._labels.get((t, w))) for t, w, _, lim in self.snapshot() if lim is not None]


@frozen
class Instruments:
    operation_duration: Histogram
    token_usage: Histogram
    time_to_first_chunk: Histogram
    time_per_output_chunk: Histogram
    execute_tool_duration: Histogram
    mcp_duration: Histogram
    cost: Counter
    limit_rejections: Counter
    repairs: Counter
    tool_calls: Counter
    guard_actions: Counter
    rewrites: Counter
    ledger_overshoot: Counter
    dropped_spans: Counter
    cache_tokens: Counter
    cost_saved: Counter
    cache_write_premium: Counter
    budgets: BudgetValues
    wrap_up_notices: Counter
    runs_ended: Counter
    input_cost: Counter
    tool_context_cost: Counter
    tool_unused_cost: Counter
    labels: LabelBounds = field(default_factory=LabelBounds)
    call_labels: LabelCache[CallKey, CallLabels] = field(default_factory=lambda: LabelCache(CallLabels.build))
    kind_labels: LabelCache[KindKey, FrozenLabels] = field(default_factory=lambda: LabelCache(build_kind_labels))
    # The cost anatomy's series, found once and kept (bounded as the label caches are): the
    # input cost of each kind of part by (tenant, provider, model label), and the tool
    # results' context cost by (tenant, tool label); points with each run chain's flush
    # (tracing/spans.py `record_flushed`).
    input_cost_series: dict[tuple[str, str, str | None], dict[str, SumSeries]] = field(default_factory=dict)
    tool_context_series: dict[tuple[str, str], SumSeries] = field(default_factory=dict)

    @classmethod
    def create(cls, *, semconv_latest: bool = False, known_model: KnownModel | None = None) -> Instruments:
        """All instruments; inference metrics use the post-1.41 names when opted in.
        `known_model`: the price table's lookup, so unpriced models collapse in labels."""
        duration, ttfc, tpoc = (
            (
                A.LATEST_GEN_AI_CLIENT_INFERENCE_DURATION,
                A.LATEST_GEN_AI_CLIENT_TIME_TO_FIRST_CHUNK,
                A.LATEST_GEN_AI_CLIENT_TIME_PER_OUTPUT_CHUNK,
            )
            if semconv_latest
            else (
                A.GEN_AI_CLIENT_OPERATION_DURATION,
                A.GEN_AI_CLIENT_TIME_TO_FIRST_CHUNK,
                A.GEN_AI_CLIENT_TIME_PER_OUTPUT_CHUNK,
            )
        )
        return cls(
            operation_duration=_histogram(duration, A.DURATION_BUCKETS),
            token_usage=_histogram(A.GEN_AI_CLIENT_TOKEN_USAGE, A.TOKEN_BUCKETS),
            time_to_first_chunk=_histogram(ttfc, A.DURATION_BUCKETS),
            time_per_output_chunk=_histogram(tpoc, A.DURATION_BUCKETS),
            execute_tool_duration=_histogram(A.GEN_AI_EXECUTE_TOOL_DURATION, A.DURATION_BUCKETS),
            mcp_duration=_histogram(A.MCP_CLIENT_OPERATION_DURATION, A.MCP_DURATION_BUCKETS),
            cost=_counter(A.SPANMETER_COST),
            limit_rejections=_counter(A.SPANMETER_LIMIT_REJECTIONS),
            repairs=_counter(A.SPANMETER_REPAIRS_METRIC),
            tool_calls=_counter(A.SPANMETER_TOOL_CALLS),
            guard_actions=_counter(A.SPANMETER_GUARD_ACTIONS),
            rewrites=_counter(A.SPANMETER_REWRITES_METRIC),
            ledger_overshoot=_counter(A.SPANMETER_LEDGER_OVERSHOOT),
            dropped_spans=_counter(A.SPANMETER_TELEMETRY_DROPPED_SPANS),
            cache_tokens=_counter(A.SPANMETER_CACHE_INPUT_TOKENS),
            cost_saved=_counter(A.SPANMETER_COST_SAVED),
            cache_write_premium=_counter(A.SPANMETER_COST_CACHE_WRITE_PREMIUM),
            budgets=BudgetValues(),
            wrap_up_notices=_counter(A.SPANMETER_WRAP_UP_NOTICES),
            runs_ended=_counter(A.SPANMETER_RUNS_ENDED),
            input_cost=_counter(A.SPANMETER_INPUT_COST),
            tool_context_cost=_counter(A.SPANMETER_TOOL_CONTEXT_COST),
            tool_unused_cost=_counter(A.SPANMETER_TOOL_UNUSED_COST),
            labels=LabelBounds(known_model),
        )

    def all(self) -> list[Instrument]:
        """Every instrument, in the order expositions list them; the budget gauges last."""
        recorded: list[Instrument] = [
            self.operation_duration, self.token_usage, self.time_to_first_chunk, self.time_per_output_chunk,
            self.execute_tool_duration, self.mcp_duration, self.cost, self.limit_rejections, self.repairs,
            self.tool_calls, self.guard_actions, self.rewrites, self.ledger_overshoot, self.dropped_spans,
            self.cache_tokens, self.cost_saved, self.cache_write_premium, self.wrap_up_notices, self.runs_ended,
            self.input_cost, self.tool_context_cost, self.tool_unused_cost,
        ]  # fmt: skip
        return [*recorded, *_budget_gauges(self.budgets)]


def _histogram(name: str, buckets: tuple[float, ...]) -> Histogram:
    spec = A.METRICS_BY_NAME[name]
    return Histogram(name, spec.unit, spec.description, buckets)


def _counter(name: str) -> Counter:
    spec = A.METRICS_BY_NAME[name]
    return Counter(name, spec.unit, spec.description)


def _budget_gauges(budgets: BudgetValues) -> list[GaugeSeries]:
    spent = A.METRICS_BY_NAME[A.SPANMETER_BUDGET_SPENT_USD]
    limit = A.METRICS_BY_NAME[A.SPANMETER_BUDGET_LIMIT_USD]
    return [
        GaugeSeries(spent.name, spent.unit, spent.description, budgets.spent),
        GaugeSeries(limit.name, limit.unit, limit.description, budgets.limits),
    ]


def _budget_labels(tenant: str, window: str) -> Labels:
    return {A.SPANMETER_TENANT_ID: tenant, A.SPANMETER_WINDOW: window}
