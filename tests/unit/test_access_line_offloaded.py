"""An access line's text and JSON are made by the log's writer thread, not on the event loop
(proxy/serve/accesslog.py `_AccessLine`), and read as they did when the loop made them."""

from __future__ import annotations

import io
import json
import logging
import threading

import pytest

from proxy.model import Call, Caller, CallRecord, Outcome, Rewrite, Usage
from proxy.serve import accesslog
from proxy.serve.accesslog import access, configure_logging

RECORDS = [
    CallRecord(Caller("acme", "r-1", "header"), Call(api="chat", operation="chat", model="gpt-4o-mini"),
               Outcome(status=200, usage=Usage(input_tokens=1830, output_tokens=96)), 0, 412_000_000,
               cost_micros=332, rewrites=[Rewrite("max_tokens_clamp", "4096")]),
    CallRecord(Caller("acme", "r 2", "header"), Call(api="messages", operation="chat", model="m\n2026 INFO x" * 30),
               Outcome(status=502, error_type="spanmeter.upstream_timeout", error_message="the upstream timed out"),
               0, 1_500_000, cost_micros=0),
    CallRecord(Caller("t", "r3", "generated"), Call(api="chat", operation="chat", model=None),
               Outcome(status=402, error_type="spanmeter.ceiling", error_message="run_calls reached"), 0, 0,
               forwarded=False, cost_micros=0, refusal="run_calls"),
]

# As the loop wrote them before (c13488d: the same lines, text and JSON, but for the time).
TEXT = [
    "INFO spanmeter.access tenant=acme run=r-1 api=chat model=gpt-4o-mini status=200 upstream=200 duration=0.412s "
    'tokens=1830/96 cost=$0.000332 rewrites="max_tokens_clamp=4096"',
    'ERROR spanmeter.access tenant=acme run="r 2" api=messages model=' + json.dumps(("m\n2026 INFO x" * 30)[:200])
    + ' status=502 upstream=502 duration=0.002s cost=$0.00 error=spanmeter.upstream_timeout '
    'reason="the upstream timed out"',
    "INFO spanmeter.access tenant=t run=r3 api=chat model=- status=402 upstream=- duration=0.000s "
    'refused=run_calls error=spanmeter.ceiling reason="run_calls reached"',
]


def _lines(fmt: str) -> list[str]:
    out = io.StringIO()
    stop = configure_logging("INFO", fmt, stream=out)
    try:
        for record in RECORDS:
            access(record)
    finally:
        stop()
    return out.getvalue().splitlines()


def test_text_lines_read_as_before() -> None:
    lines = _lines("text")
    assert [line.split(" ", 1)[1] for line in lines] == TEXT


def test_json_lines_carry_the_same_fields_as_before() -> None:
    lines = [json.loads(line) for line in _lines("json")]
    assert [r["message"] for r in lines] == [t.split(" ", 2)[2] for t in TEXT]
    first = {k: v for k, v in lines[0].items() if k != "time"}
    assert first == {
        "level": "INFO", "logger": "spanmeter.access", "message": TEXT[0].split(" ", 2)[2],
        "tenant": "acme", "run_id": "r-1", "api": "chat", "model": "gpt-4o-mini", "status": 200,
        "upstream_status": 200, "duration_s": 0.412, "input_tokens": 1830, "output_tokens": 96,
        "cost_usd": 0.000332, "rewrites": ["max_tokens_clamp=4096"], "refusal": None, "error": None, "reason": None,
    }
    assert lines[1]["model"] == ("m\n2026 INFO x" * 30)[:200] and lines[1]["upstream_status"] == 502
    assert lines[2]["reason"] == "run_calls reached" and lines[2]["upstream_status"] is None


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_the_line_is_made_by_the_writer_thread(fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[str] = []
    text, fields = accesslog._text, accesslog._AccessLine.fields

    def traced_text(line: accesslog._Line) -> str:
        made.append(threading.current_thread().name)
        return text(line)

    def traced_fields(self: accesslog._AccessLine) -> dict[str, object]:
        made.append(threading.current_thread().name)
        return fields(self)

    monkeypatch.setattr(accesslog, "_text", traced_text)
    monkeypatch.setattr(accesslog._AccessLine, "fields", traced_fields)
    assert len(_lines(fmt)) == len(RECORDS)
    assert made and set(made) == {"spanmeter-log"}


def test_another_handler_reads_the_same_line(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="spanmeter.access"):
        access(RECORDS[0])
    [rec] = [r for r in caplog.records if r.name == "spanmeter.access"]
    assert rec.getMessage() == TEXT[0].split(" ", 2)[2]
