"""What reaches the log: a rejected header is named with its rule, never its value; no
line separator a log consumer splits on survives raw, in text or JSON format."""

from __future__ import annotations

import io
import json
import logging
import time

import pytest

from proxy.model import Call, Caller, CallRecord, Outcome
from proxy.serve.accesslog import access, configure_logging
from tests.reliability.dialects import DIALECTS, Dialect, post

SECRET = "sk-proj-PASTEDINTOTHEWRONGHEADER 0123456789"
BREAKS = ["\u2028", "\u2029", "\u0085", "\r", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e"]


@pytest.mark.parametrize("header", ["X-Run-Id", "X-Agent-Name", "X-Conversation-Id", "X-Run-Max-Calls",
                                    "X-Run-Max-Cost-Usd", "X-Run-Max-Seconds"])
async def test_a_rejected_header_value_is_never_echoed(make_proxy, sim, caplog, header: str) -> None:
    d: Dialect = DIALECTS[0]
    value = SECRET * 5 if header == "X-Agent-Name" else SECRET  # too long: invalid
    proxy = await make_proxy()
    with caplog.at_level(logging.INFO):
        r = await post(proxy.url, d.path(False), d.body("hi", False), key="sk-caller", headers={header: value})
    assert r.status == 400
    message = d.error_message(json.loads(r.body))
    assert header in message and "it is not repeated here" in message
    assert "PASTEDINTOTHEWRONGHEADER" not in r.body.decode() + caplog.text
    assert sim.received == []


@pytest.mark.parametrize("fmt", ["text", "json"])
@pytest.mark.parametrize("brk", BREAKS, ids=lambda b: f"U+{ord(b):04X}")
def test_line_separators_are_escaped_in_every_log_format(fmt: str, brk: str) -> None:
    out = io.StringIO()
    stop = configure_logging("INFO", fmt, stream=out)
    try:
        call = Call(api="chat", operation="chat", model=f"gpt{brk}forged status=200")
        access(CallRecord(Caller("acme", "r1", "header"), call, Outcome(status=200), 0, 100_000_000))
        logging.getLogger("spanmeter.other").warning("upstream said %s", f"a{brk}b")
    finally:
        stop()
    text = out.getvalue()
    assert brk not in text
    lines = text.splitlines()  # splits on every one of BREAKS too
    assert len(lines) == 2, lines
    if fmt == "json":
        assert json.loads(lines[0])["model"] == f"gpt{brk}forged status=200"  # escaped, not lost
        assert json.loads(lines[1])["message"] == f"upstream said a{brk}b"


async def test_a_body_that_is_not_json_from_a_known_caller_is_logged_with_its_tenant_and_run(
        make_proxy, caplog) -> None:
    from proxy.config import hash_key

    key = "sm-log-lines-test-key"
    proxy = await make_proxy(tenants={"acme": {"keys": [hash_key(key)]}})
    with caplog.at_level(logging.INFO, logger="spanmeter.access"):
        r = await post(proxy.url, "/v1/chat/completions", data=b"{not json", key=key,
                       headers={"X-Run-Id": "bad-json-run"})
    assert r.status == 400
    [line] = [rec.getMessage() for rec in caplog.records if rec.name == "spanmeter.access"]
    assert line.startswith("tenant=acme run=bad-json-run api=chat "), line


class _CountingSink(io.StringIO):
    """A log sink that counts the writes it gets."""

    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    def write(self, s: str) -> int:
        self.writes += 1
        return super().write(s)


def test_lines_that_arrive_while_the_writer_lingers_share_its_writes() -> None:
    """The writer wakes once for a burst of lines, not once a line: each line here comes
    after a pause that hands the GIL over (as the event loop does between calls), so a
    writer woken per line writes each alone. All of them reach the sink, whole and in order."""
    from proxy.serve.accesslog import TextFormatter, _Offloaded

    out = _CountingSink()
    handler = _Offloaded(out, capacity=1000, linger_s=0.5)
    handler.setFormatter(TextFormatter())
    logger = logging.getLogger("spanmeter.test-linger")
    n = 40
    try:
        for i in range(n):
            handler.handle(logger.makeRecord(logger.name, logging.INFO, __file__, 0, f"line {i:03d}", (), None))
            time.sleep(0.002)
    finally:
        handler.stop(5.0)  # writes what the lingering writer holds, at once
    lines = out.getvalue().splitlines()
    assert [line.rsplit(" ", 1)[-1] for line in lines] == [f"{i:03d}" for i in range(n)]
    assert out.writes <= 4, f"{out.writes} writes for {n} lines"  # ~60 bytes a line: 1 chunk of PIPE_BUF, or a few
