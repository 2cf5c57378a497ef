"""Spans encoded and exported by a child process (tracing/export_process.py): real child
processes, a real OTLP receiver, real signals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.trace import Link, NonRecordingSpan, SpanKind, Status, StatusCode, TraceState, set_span_in_context

from tests.fixtures.otlp import OtlpReceiver, closed_endpoint
from tests.tracing.test_export_health import dropped, one_call
from tracing.export_process import MAX_RESPAWNS, NICER_BY
from tracing.local import read_spans
from tracing.setup import ExportProcess, Telemetry, TelemetryConfig, setup_telemetry

ROOT = Path(__file__).resolve().parents[2]
CHILD = "tracing.export_process"


def export_children(parent: int | None = None) -> set[int]:
    """PIDs of the live (not zombie) export processes whose parent is `parent` (us)."""
    parent = os.getpid() if parent is None else parent
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == parent and state != "Z" and CHILD.encode() in cmdline:
            found.add(int(entry.name))
    return found


_BASELINE: set[int] = set()


@pytest.fixture(autouse=True)
def baseline() -> None:
    """Children of telemetries other tests left running are not this test's."""
    _BASELINE.clear()
    _BASELINE.update(export_children())


def ours() -> set[int]:
    return export_children() - _BASELINE


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_until(condition: Any, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return bool(condition())


def telemetry(endpoint: str | None, mode: ExportProcess = "auto", **kw: Any) -> tuple[Telemetry, set[int]]:
    """Telemetry and the PIDs of the export children it started."""
    before = export_children()
    cfg = TelemetryConfig(otlp_endpoint=endpoint, export_process=mode, metric_export_interval_ms=3_600_000, **kw)
    tel = setup_telemetry(cfg, environ={})
    return tel, export_children() - before


@pytest.fixture
def receiver(otlp_receiver: OtlpReceiver) -> Iterator[OtlpReceiver]:
    yield otlp_receiver


def varied_spans(tel: Telemetry) -> None:
    """Spans with what the wire has to carry: parents, links, events, a trace state,
    array attributes, an error status, every kind."""
    tracer = tel.tracer
    with tracer.start_as_current_span("root", kind=SpanKind.SERVER, attributes={"a.int": 3, "a.list": ["x", "y"]}):
        other = tracer.start_span("other")
        other.end()
        child = tracer.start_span("child", kind=SpanKind.CLIENT, links=[Link(other.get_span_context(), {"why": "x"})],
                                  attributes={"a.float": 1.5, "a.bool": True, "a.ints": [1, 2]})
        child.add_event("retry", {"attempt": 2})
        child.set_status(Status(StatusCode.ERROR, "upstream 502"))
        child.end()
    state = tracer.start_span("state")
    state.end()
    ctx = state.get_span_context()
    parent = NonRecordingSpan(type(ctx)(ctx.trace_id, ctx.span_id, True, ctx.trace_flags, TraceState([("k", "v")])))
    tracer.start_span("remote-child", context=set_span_in_context(parent), kind=SpanKind.CONSUMER).end()
    one_call(tel)


def comparable(spans: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for s in spans:
        s = dict(s)
        s["resource"] = {k: v for k, v in s["resource"].items() if k != "service.instance.id"}
        for k in ("trace_id", "span_id", "parent_span_id", "start_ns", "end_ns"):
            s[k] = bool(s[k])
        s["links"] = len(s["links"])
        out.append(s)
    return sorted(out, key=lambda s: s["name"])


def test_spans_reach_the_collector_through_the_child_as_they_do_in_process(receiver: OtlpReceiver) -> None:
    tel, started = telemetry(receiver.endpoint, "off")
    assert started == set()  # off: no child
    try:
        varied_spans(tel)
        assert tel.force_flush()
    finally:
        tel.shutdown()
    in_process = receiver.wait_for_spans(6)
    receiver_b = OtlpReceiver().start()
    try:
        tel, started = telemetry(receiver_b.endpoint)  # auto: OTLP is exported, so a child
        assert len(started) == 1
        try:
            varied_spans(tel)
            assert tel.force_flush()  # force_flush goes through the child
            through_child = receiver_b.spans()
        finally:
            tel.shutdown()
    finally:
        receiver_b.close()
    assert len(through_child) == 6
    assert comparable(through_child) == comparable(in_process)
    child_span = next(s for s in through_child if s["name"] == "child")
    root = next(s for s in through_child if s["name"] == "root")
    assert child_span["parent_span_id"] == root["span_id"]
    assert child_span["status"] == "STATUS_CODE_ERROR" and child_span["status_message"] == "upstream 502"
    assert child_span["links"][0]["span_id"] == next(s for s in through_child if s["name"] == "other")["span_id"]
    assert child_span["attributes"]["a.ints"] == [1, 2]
    assert wait_until(lambda: not (started & export_children()))  # shutdown ended the child


def test_shutdown_flushes_everything_queued_through_the_child(receiver: OtlpReceiver) -> None:
    # Hour-long delays: nothing leaves before shutdown, which must send it all.
    tel, started = telemetry(receiver.endpoint, schedule_delay_ms=3_600_000, local_schedule_delay_ms=3_600_000)
    assert len(started) == 1
    for _ in range(300):
        one_call(tel)
    tel.shutdown()
    assert len(receiver.spans()) == 300
    assert dropped(tel, "queue_full") == dropped(tel, "export_failed") == 0
    assert not (started & export_children())


def test_local_files_alone_stay_in_process_unless_on(tmp_path: Path) -> None:
    tel, started = telemetry(None, local_dir=str(tmp_path / "auto"))
    tel.shutdown()
    assert started == set()  # auto: the local files alone are written in this process
    tel, started = telemetry(None, "on", local_dir=str(tmp_path / "on"))
    assert len(started) == 1
    for _ in range(7):
        one_call(tel)
    tel.shutdown()
    assert len(list(read_spans(tmp_path / "on"))) == 7


def test_a_collector_that_is_down_is_counted_through_the_child() -> None:
    tel, started = telemetry(closed_endpoint(), export_timeout=0.5, schedule_delay_ms=3_600_000)
    assert len(started) == 1
    try:
        for _ in range(5):
            one_call(tel)
        tel.force_flush()  # the child reports its failed export before it answers the flush
        assert dropped(tel, "export_failed") == 5
        assert dropped(tel, "queue_full") == 0
    finally:
        tel.shutdown()


def test_a_hanging_collector_holds_up_no_call_and_every_span_is_exported_or_counted(
    receiver: OtlpReceiver,
) -> None:
    receiver.hold()
    tel, started = telemetry(receiver.endpoint, max_queue=4, max_export_batch=1, schedule_delay_ms=10,
                             local_schedule_delay_ms=10, export_timeout=60)
    assert len(started) == 1
    try:
        one_call(tel)
        assert receiver.arrived.wait(20), "the child never reached the collector"
        for _ in range(50):
            one_call(tel)  # returns although the child's export hangs
        assert receiver.requests == 1
        # Both queues (ours, then the child's) are bounded: spans are dropped and counted.
        assert wait_until(lambda: dropped(tel, "queue_full") >= 50 - 2 * 4)
        receiver.release()
        tel.tracer_provider.shutdown()  # spans only: the counter must stay readable
        assert len(receiver.spans()) + dropped(tel, "queue_full") == 51
        assert dropped(tel, "export_failed") == 0
    finally:
        receiver.release()
        tel.shutdown()


def test_the_child_runs_nicer_than_the_serving_process_and_still_exports(receiver: OtlpReceiver) -> None:
    # Where the two share a core, a request that arrives during a batch's encoding is
    # served first; the spans still all arrive.
    tel, started = telemetry(receiver.endpoint)
    (child,) = started
    try:
        ours_nice = os.getpriority(os.PRIO_PROCESS, 0)
        assert os.getpriority(os.PRIO_PROCESS, child) == min(19, ours_nice + NICER_BY)
        for _ in range(3):
            one_call(tel)
        assert tel.force_flush()
        assert len(receiver.spans()) == 3
    finally:
        tel.shutdown()


def test_a_killed_child_is_replaced_and_what_it_held_is_counted(receiver: OtlpReceiver) -> None:
    receiver.hold()  # the child holds the span it was given: an export that hangs
    tel, started = telemetry(receiver.endpoint, max_export_batch=1, schedule_delay_ms=10,
                             local_schedule_delay_ms=10, export_timeout=60)
    (first,) = started
    try:
        one_call(tel)
        assert receiver.arrived.wait(20)
        os.kill(first, signal.SIGKILL)
        # Noticed while idle (EOF of its reports), reaped and replaced without a new span.
        assert wait_until(lambda: ours() - {first} and not alive(first))
        replaced = ours() - {first}
        assert len(replaced) == 1
        # The proxy keeps serving; the next spans go to the new child.
        for i in range(4):
            tel.tracer.start_span(f"after-{i}").end()
        receiver.release()
        assert tel.force_flush()
        names = {s["name"] for s in receiver.spans()}
        assert {f"after-{i}" for i in range(4)} <= names
        assert dropped(tel, "export_failed") == 1  # the span the dead child held
    finally:
        receiver.release()
        tel.shutdown()
    assert not (replaced & export_children())


PARENT = textwrap.dedent("""
    import sys, time
    from tests.tracing.test_export_health import one_call
    from tracing.setup import TelemetryConfig, setup_telemetry
    tel = setup_telemetry(TelemetryConfig(otlp_endpoint=sys.argv[1], schedule_delay_ms=20,
                                          metric_export_interval_ms=3_600_000), environ={})
    for _ in range(3):
        one_call(tel)
    print("called", flush=True)
    time.sleep(600)
""")


def test_the_child_exits_when_its_parent_is_killed(receiver: OtlpReceiver) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    parent = subprocess.Popen([sys.executable, "-c", PARENT, receiver.endpoint], stdout=subprocess.PIPE, env=env)
    try:
        assert parent.stdout is not None
        assert parent.stdout.readline() == b"called\n"
        assert len(receiver.wait_for_spans(3, timeout=30)) == 3
        (child,) = export_children(parent.pid)
        parent.kill()  # SIGKILL: no shutdown, no atexit
        parent.wait()
        assert wait_until(lambda: not alive(child), timeout=30), "the export child outlived its parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def test_a_fork_of_the_parent_does_not_keep_the_child_alive(receiver: OtlpReceiver) -> None:
    # Exported only when the child sees EOF: an hour's delay.
    tel, started = telemetry(receiver.endpoint, schedule_delay_ms=3_600_000, local_schedule_delay_ms=3_600_000)
    (child,) = started
    pid = os.fork()
    if pid == 0:  # the fork: holds a copy of every fd, the child's stdin included, for a while
        time.sleep(120)  # longer than our shutdown waits for the child
        os._exit(0)
    try:
        tel.tracer.start_span("before-shutdown").end()
        tel.shutdown()  # closes our end: the export child must see EOF despite the fork
        assert wait_until(lambda: not alive(child))
        assert [s["name"] for s in receiver.spans()] == ["before-shutdown"]
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def test_restarts_are_bounded_then_spans_are_counted_as_dropped(
    receiver: OtlpReceiver, caplog: pytest.LogCaptureFixture
) -> None:
    tel, started = telemetry(receiver.endpoint)
    current = set(started)
    try:
        for _ in range(MAX_RESPAWNS + 1):  # the first start and every restart it allows
            (pid,) = current
            os.kill(pid, signal.SIGKILL)
            assert wait_until(lambda p=pid: not alive(p) and (ours() - {p} or "not restarted" in caplog.text))
            current = ours()
        assert current == set() and "span export process: not restarted" in caplog.text
        for i in range(3):
            tel.tracer.start_span(f"no-child-{i}").end()  # the proxy goes on; its spans are counted
        assert not tel.force_flush()
        assert dropped(tel, "export_process_down") == 3
        assert "span export process is down" in caplog.text  # said at the first drop
        assert 'error_type="export_process_down"' in tel.metrics_text().decode()
        assert not [s for s in receiver.spans() if s["name"].startswith("no-child")]
    finally:
        tel.shutdown()


@pytest.mark.parametrize(("setting", "otlp", "children"), [
    ("auto", True, 1), ("auto", False, 0), ("off", True, 0), ("on", False, 1),
])  # fmt: skip
async def test_the_setting_reaches_the_proxy(make_proxy: Any, receiver: OtlpReceiver, setting: str, otlp: bool,
                                             children: int) -> None:
    endpoint = {"otlp_endpoint": receiver.endpoint} if otlp else {}
    await make_proxy(export_process=setting, **endpoint)
    assert len(ours()) == children


def test_the_childs_log_lines_take_the_configured_format_once_a_minute(capfd: pytest.CaptureFixture[str]) -> None:
    """The collector is down: the SDK in the child logs failures; they reach the parent's
    log as JSON lines with time and level, and a repeat within a minute is counted, not
    written. Nothing raw reaches stderr."""
    import io
    import json

    from proxy.serve.accesslog import configure_logging

    out = io.StringIO()
    stop = configure_logging("INFO", "json", stream=out)
    tel, _ = telemetry(closed_endpoint(), mode="on", export_timeout=0.5, schedule_delay_ms=50)
    try:
        for batch in range(4):
            tel.tracer.start_span(f"lost-{batch}").end()
            tel.force_flush(5_000)
        assert wait_until(lambda: "span export process" in out.getvalue())
    finally:
        tel.shutdown()
        stop()
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    child = [r for r in lines if r["logger"] == "spanmeter.export"]
    assert child and all(r["level"] in ("WARNING", "ERROR") and r["time"] for r in child)
    failures = [r for r in child if "export" in r["message"].lower()]
    assert 1 <= len(failures) <= 3, child  # one line per kind of failure, not three per batch
    assert "Failed to export" not in capfd.readouterr().err
