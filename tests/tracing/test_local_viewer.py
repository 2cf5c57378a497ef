"""The local default exporter and `spanmeter runs` rendering, from spans the API emitted."""

from __future__ import annotations

import json
from pathlib import Path

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from proxy.model import Call, Caller, CallRecord, Outcome, Repair, ToolRecord, Usage
from tracing import spans
from tracing.local import JsonlSpanExporter, read_spans
from tracing.setup import Telemetry, TelemetryConfig, setup_telemetry
from tracing.viewer import load_runs, render_run_tree, render_runs_table

CALLER = Caller("acme", "run_view", "header", agent_name="weather-bot")
CALL = Call(api="chat", operation="chat", model="gpt-4o")
S = 1_000_000_000
T0 = 1_786_000_000 * S


def call(tel: Telemetry, run: spans.RunTrace, start: int, end: int, outcome: Outcome, **kw: object) -> spans.CallSpan:
    cs = spans.start_call(tel, CALLER, CALL, spans.Peer("openai", "api.openai.com", 443),
                          spans.Lineage(run_trace=run), start_ns=start)
    defaults: dict[str, object] = {"cost_micros": 3600, "usage_source": "reported", "budget_remaining_micros": None,
                                   "rewrites": [], "repairs": []}  # fmt: skip
    spans.end_call(tel, cs, CallRecord(cs.caller, CALL, outcome, cs.start_ns, end_ns=end, **{**defaults, **kw}))  # type: ignore[arg-type]
    return cs


def record_a_run(local_dir: Path) -> spans.RunTrace:
    tel = setup_telemetry(TelemetryConfig(local_dir=str(local_dir)), environ={})
    run = spans.new_run_trace(start_ns=T0)
    first = call(tel, run, T0, T0 + int(1.2 * S), Outcome(status=200, usage=Usage(1830, 96, cache_read_tokens=1024),
                 finish_reasons=("tool_calls",)), repairs=[Repair("tool:call_1", ("trailing_comma",))])  # fmt: skip
    spans.tool_span(tel, ToolRecord(CALLER, "get_weather", "call_1", '{"city": "Paris"}', "l1\nl2\nl3",
                                    T0 + int(1.2 * S), T0 + 2 * S,
                                    is_error=False), run_trace=run, link=first.ref)  # fmt: skip
    spans.tool_span(tel, ToolRecord(CALLER, "read_file", "call_2", '{"path": "a.py", "n": 1}',
                                    '{"ok": false, "error": "denied"}', T0 + int(1.2 * S), T0 + 2 * S,
                                    is_error=False), run_trace=run)  # fmt: skip
    call(tel, run, T0 + 2 * S, T0 + 3 * S, Outcome(status=429, error_type="429", error_message="slow down"),
         cost_micros=0)  # fmt: skip
    totals = {"model_calls": 2, "tool_calls": 2, "failures": 1, "tool_failures": 1, "cost_micros": 3600,
              "input_tokens": 1830, "cache_read_tokens": 1024}
    spans.end_run(tel, CALLER, run, totals, "ok", end_ns=T0 + 4 * S)
    tel.shutdown()
    return run


def test_spans_are_written_as_json_lines(tmp_path: Path) -> None:
    run = record_a_run(tmp_path)
    records = list(read_spans(tmp_path))
    assert [r["name"] for r in records] == ["chat gpt-4o", "execute_tool get_weather", "execute_tool read_file",
                                            "chat gpt-4o", "invoke_agent weather-bot"]  # fmt: skip
    root = records[-1]
    assert (root["trace_id"], root["span_id"]) == (f"{run.trace_id:032x}", f"{run.span_id:016x}")
    assert all(r["parent_span_id"] == root["span_id"] for r in records[:-1])
    assert records[1]["links"] == [{"trace_id": records[0]["trace_id"], "span_id": records[0]["span_id"]}]
    assert records[0]["attributes"]["gen_ai.response.finish_reasons"] == ["tool_calls"]


def test_runs_table(tmp_path: Path) -> None:
    record_a_run(tmp_path)
    [run] = load_runs(tmp_path)
    assert (run.run_id, run.tenant, run.calls, run.tool_calls, run.tokens, run.failures, run.tool_failures,
            run.status) == ("run_view", "acme", 2, 2, 1926, 1, 1, "ok")  # fmt: skip
    assert run.cost_usd == 0.0036
    assert run.cached_share == 1024 / 1830, "the run span's share, spanmeter.run.cache_read.share"
    table = render_runs_table([run]).splitlines()
    assert table[0].split() == ["RUN", "TENANT", "STARTED", "CALLS", "REFUSED", "TOKENS", "CACHED", "COST", "STATUS"]
    assert table[1].split()[:2] == ["run_view", "acme"]
    assert table[1].split()[-6:] == ["2", "0", "1,926", "56%", "$0.0036", "ok"]


def test_an_open_run_shows_the_cached_share_of_its_calls(tmp_path: Path) -> None:
    tel = setup_telemetry(TelemetryConfig(local_dir=str(tmp_path)), environ={})
    run = spans.new_run_trace(start_ns=T0)
    call(tel, run, T0, T0 + S, Outcome(status=200, usage=Usage(1000, 10, cache_read_tokens=900)))
    call(tel, run, T0 + S, T0 + 2 * S, Outcome(status=200, usage=Usage(1000, 10, cache_read_tokens=0)))
    call(tel, run, T0 + 2 * S, T0 + 3 * S, Outcome(status=500, error_type="500"))  # no usage: not counted
    tel.shutdown()
    [summary] = load_runs(tmp_path)
    assert summary.status == "open, failures" and summary.cached_share == 0.45
    assert render_runs_table([summary]).splitlines()[1].split()[-5:-2] == ["2,020", "45%", "$0.0108"]
    assert "2,020 tokens  45% of input cached  $0.0108  open, failures" in render_run_tree("run_view", tmp_path)


def test_a_run_without_input_shows_no_share(tmp_path: Path) -> None:
    tel = setup_telemetry(TelemetryConfig(local_dir=str(tmp_path)), environ={})
    run = spans.new_run_trace(start_ns=T0)
    call(tel, run, T0, T0 + S, Outcome(status=500, error_type="500"), cost_micros=0)
    tel.shutdown()
    [summary] = load_runs(tmp_path)
    assert summary.cached_share is None
    assert render_runs_table([summary]).splitlines()[1].split()[-4] == "-"
    assert "of input cached" not in render_run_tree("run_view", tmp_path)


def test_run_tree(tmp_path: Path) -> None:
    record_a_run(tmp_path)
    tree = render_run_tree("run_view", tmp_path)
    assert tree.splitlines() == [
        "run run_view (acme, agent weather-bot)  4.00s  2 calls  2 tool calls  1,926 tokens  56% of input cached"
        "  $0.0036  ok  1 failed call  1 failed tool call",
        "├─ chat gpt-4o  1.20s  1,830→96 tok (1,024 cached)  $0.0036  finish: tool_calls",
        "│     repair tool:call_1: trailing_comma",
        "├─ execute_tool get_weather  0.80s  Paris  ✓ 3 lines",
        "├─ execute_tool read_file  ERROR tool_error  0.80s  a.py  ✗ denied",
        "└─ chat gpt-4o  ERROR 429  1.00s  $0.00",
        "      error: slow down",
    ]


def test_an_unknown_run_and_an_empty_directory_say_so(tmp_path: Path) -> None:
    assert "No run 'nope'" in render_run_tree("nope", tmp_path)
    assert render_runs_table(load_runs(tmp_path)).startswith("No runs recorded yet")


def test_the_local_file_is_rotated_and_bounded(tmp_path: Path) -> None:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(JsonlSpanExporter(tmp_path, max_bytes=2_000, keep=2)))
    tracer = provider.get_tracer("t")
    for i in range(60):
        tracer.start_span(f"s{i}", attributes={"spanmeter.run.id": "r", "pad": "x" * 100}).end()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["spans.1.jsonl", "spans.2.jsonl", "spans.jsonl"]
    assert all(p.stat().st_size < 2_000 + 600 for p in tmp_path.iterdir())
    names = [r["name"] for r in read_spans(tmp_path)]
    assert names == sorted(names, key=lambda n: int(n[1:]))  # oldest file first
    assert names[-1] == "s59"


def test_a_torn_line_is_skipped(tmp_path: Path) -> None:
    record_a_run(tmp_path)
    with (tmp_path / "spans.jsonl").open("a") as f:
        f.write('{"name": "cut in the mid')
    assert len(list(read_spans(tmp_path))) == 5
    json.dumps(load_runs(tmp_path)[0].run_id)


def test_a_run_span_written_before_it_was_an_agent_invocation_is_still_the_run(tmp_path: Path) -> None:
    # Earlier versions named the run's span `run`, with no gen_ai.operation.name.
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(JsonlSpanExporter(tmp_path)))
    tracer = provider.get_tracer("t")
    tracer.start_span("run", attributes={"spanmeter.run.id": "old", "spanmeter.tenant.id": "acme",
                                         "spanmeter.run.status": "idle_timeout"}).end()
    [run] = load_runs(tmp_path)
    assert (run.run_id, run.status, run.calls) == ("old", "idle_timeout", 0)


def test_every_workers_span_files_are_read(tmp_path: Path) -> None:
    """`spanmeter serve --workers N`: each worker writes its own traces/worker-K/ (one writer
    per file); `spanmeter runs` reads them all, and the files of one process beside them: a
    run whose calls different workers served is one run."""
    record_a_run(tmp_path / "worker-1")
    record_a_run(tmp_path / "worker-2")
    record_a_run(tmp_path)
    (tmp_path / "worker-3").write_text("not a directory: ignored")
    assert len(list(read_spans(tmp_path))) == 15
    [run] = load_runs(tmp_path)
    assert (run.run_id, run.calls, run.tool_calls) == ("run_view", 6, 6)
