"""Record what three workers' `/metrics` say, into tests/data/exposition/worker-K.prom.

Not a test: run `.venv/bin/python -m tests.tracing.record_expositions` to refresh the
recordings after a change to the instruments or an OpenTelemetry upgrade. Each "worker"
is a real Telemetry (its own MeterProvider and Prometheus registry, as each worker of
`spanmeter serve --workers N` has) that saw different calls: overlapping label sets
(same tenant and model in workers 1 and 2), label sets only one worker has (tenant beta,
a refusal, a tool call), budget gauges seen at different moments, and an idle worker.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from proxy.model import Call, Caller, CallRecord, Outcome, Repair, Rewrite, ToolRecord, Usage
from tracing import spans
from tracing.setup import Telemetry, TelemetryConfig, setup_telemetry

DATA = Path(__file__).resolve().parent.parent / "data" / "exposition"
T0 = 1_764_000_000_000_000_000  # fixed times: the same buckets on every recording
WHERE = spans.Peer("openai", "api.openai.com", 443)


def _call(tel: Telemetry, tenant: str, model: str, seconds: float, usage: Usage, cost: int, *,
          stream: bool = False, repairs: tuple[Repair, ...] = ()) -> None:
    caller = Caller(tenant, f"run-{tenant}", "header")
    call = Call(api="chat", operation="chat", model=model, stream=stream)
    cs = spans.start_call(tel, caller, call, WHERE, start_ns=T0)
    outcome = Outcome(status=200, usage=usage, first_chunk_s=0.3 if stream else None)
    spans.end_call(tel, cs, CallRecord(cs.caller, call, outcome, cs.start_ns, cost_micros=cost,
                                       usage_source="reported", budget_remaining_micros=None,
                   rewrites=[Rewrite("include_usage")] if stream else [], repairs=list(repairs),
                   end_ns=T0 + int(seconds * 1e9), chunk_gaps_s=[0.02] if stream else ()))


def worker_1(tel: Telemetry) -> None:
    for seconds in (0.4, 1.5, 3.0):
        _call(tel, "acme", "gpt-4o", seconds, Usage(120, 30), 600)
    tel.set_budget("acme", "day", 1_800, 10_000_000)
    tel.set_budget("acme", "month", 51_800, None)


def worker_2(tel: Telemetry) -> None:
    _call(tel, "acme", "gpt-4o", 0.9, Usage(80, 20), 400, stream=True)
    _call(tel, "acme", "gpt-4o", 6.0, Usage(2000, 900), 14_000, repairs=(Repair("output", ("fence",)),))
    _call(tel, "beta", "gpt-4o-mini", 0.2, Usage(10, 5), 7)
    # A refused call, as the proxy records it: its duration series carry error_type, so this
    # worker's exporter writes error_type="" on its other series, where worker 1 writes none.
    caller = Caller("acme", "run-acme", "header")
    call = Call(api="chat", operation="chat", model="gpt-4o")
    cs = spans.start_call(tel, caller, call, WHERE, start_ns=T0)
    spans.end_call(tel, cs, CallRecord(cs.caller, call, Outcome(status=402, error_type="spanmeter.budget_exceeded"),
                                       cs.start_ns, cost_micros=0,
                   usage_source="", budget_remaining_micros=None, rewrites=[], repairs=[], refusal="run_calls",
                   end_ns=T0 + 2_000_000))
    spans.tool_span(tel, ToolRecord(caller, "get_weather", "c1", '{"city": "Paris"}', "ok", T0, T0 + 2_000_000_000,
                                    is_error=False))
    tel.set_budget("acme", "day", 16_200, 10_000_000)  # later than worker 1's view: more spent
    tel.set_budget("acme", "month", 66_200, None)
    tel.set_budget("beta", "day", 7, 500_000)


def worker_3(tel: Telemetry) -> None:
    """Idle: only its target_info."""


def main() -> None:
    DATA.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for n, fill in enumerate((worker_1, worker_2, worker_3), 1):
            tel = setup_telemetry(TelemetryConfig(local_dir=tmp, resource_attributes={
                "service.instance.id": f"worker-{n}-instance", "spanmeter.worker": str(n)}), environ={})
            fill(tel)
            (DATA / f"worker-{n}.prom").write_bytes(tel.metrics_text())
            tel.shutdown()
            print(f"wrote {DATA / f'worker-{n}.prom'}")


if __name__ == "__main__":
    main()
