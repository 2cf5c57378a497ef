"""Instruments: every metric spanmeter records, created once from a Meter.

Labels are low-cardinality only: operation, provider, request and response model,
server address/port, error.type, tenant, and small enums of our own. Never a run id,
conversation id, response id or trace id.

Budget gauges are observable: the proxy pushes the latest numbers with
`Instruments.set_budget()` and the callback reports them at collection time, so a
scrape never touches the ledger.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

from opentelemetry.metrics import CallbackOptions, Counter, Histogram, Meter, Observation
from opentelemetry.util.types import AttributeValue

from tracing import attributes as A

__all__ = ["BudgetValues", "Instruments"]

Labels = dict[str, AttributeValue]


@dataclass(slots=True)
class BudgetValues:
    """The latest budget numbers per (tenant, window), in micro-USD."""

    _values: dict[tuple[str, str], tuple[int, int | None]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def set(self, tenant: str, window: str, spent_micros: int, limit_micros: int | None) -> None:
        # Set from the event loop, read from whichever thread collects metrics.
        with self._lock:
            self._values[(tenant, window)] = (spent_micros, limit_micros)

    def snapshot(self) -> list[tuple[str, str, int, int | None]]:
        with self._lock:
            return [(t, w, s, lim) for (t, w), (s, lim) in self._values.items()]


@dataclass(frozen=True, slots=True)
class Instruments:
    operation_duration: Histogram
    token_usage: Histogram
    time_to_first_chunk: Histogram
    time_per_output_chunk: Histogram
    execute_tool_duration: Histogram
    cost: Counter
    limit_rejections: Counter
    repairs: Counter
    tool_calls: Counter
    guard_actions: Counter
    rewrites: Counter
    ledger_overshoot: Counter
    dropped_spans: Counter
    budgets: BudgetValues

    @classmethod
    def create(cls, meter: Meter, *, semconv_latest: bool = False) -> Instruments:
        """All instruments on `meter`; inference metrics use the post-1.41 names when opted in."""
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
        budgets = BudgetValues()
        _budget_gauges(meter, budgets)
        return cls(
            operation_duration=_histogram(meter, duration, A.DURATION_BUCKETS),
            token_usage=_histogram(meter, A.GEN_AI_CLIENT_TOKEN_USAGE, A.TOKEN_BUCKETS),
            time_to_first_chunk=_histogram(meter, ttfc, A.DURATION_BUCKETS),
            time_per_output_chunk=_histogram(meter, tpoc, A.DURATION_BUCKETS),
            execute_tool_duration=_histogram(meter, A.GEN_AI_EXECUTE_TOOL_DURATION, A.DURATION_BUCKETS),
            cost=_counter(meter, A.SPANMETER_COST),
            limit_rejections=_counter(meter, A.SPANMETER_LIMIT_REJECTIONS),
            repairs=_counter(meter, A.SPANMETER_REPAIRS_METRIC),
            tool_calls=_counter(meter, A.SPANMETER_TOOL_CALLS),
            guard_actions=_counter(meter, A.SPANMETER_GUARD_ACTIONS),
            rewrites=_counter(meter, A.SPANMETER_REWRITES_METRIC),
            ledger_overshoot=_counter(meter, A.SPANMETER_LEDGER_OVERSHOOT),
            dropped_spans=_counter(meter, A.SPANMETER_TELEMETRY_DROPPED_SPANS),
            budgets=budgets,
        )


def _histogram(meter: Meter, name: str, buckets: tuple[float, ...]) -> Histogram:
    spec = A.METRICS_BY_NAME[name]
    return meter.create_histogram(
        name,
        unit=spec.unit,
        description=spec.description,
        explicit_bucket_boundaries_advisory=list(buckets),
    )


def _counter(meter: Meter, name: str) -> Counter:
    spec = A.METRICS_BY_NAME[name]
    return meter.create_counter(name, unit=spec.unit, description=spec.description)


def _budget_gauges(meter: Meter, budgets: BudgetValues) -> None:
    def spent(_options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(s / 1e6, _budget_labels(t, w)) for t, w, s, _ in budgets.snapshot()]

    def limit(_options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(lim / 1e6, _budget_labels(t, w)) for t, w, _, lim in budgets.snapshot() if lim is not None]

    for name, callback in (
        (A.SPANMETER_BUDGET_SPENT_USD, spent),
        (A.SPANMETER_BUDGET_LIMIT_USD, limit),
    ):
        spec = A.METRICS_BY_NAME[name]
        meter.create_observable_gauge(name, callbacks=[callback], unit=spec.unit, description=spec.description)


def _budget_labels(tenant: str, window: str) -> Labels:
    return {A.SPANMETER_TENANT_ID: tenant, A.SPANMETER_WINDOW: window}
