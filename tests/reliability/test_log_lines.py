"""What reaches the log: a rejected header is named with its rule, never its value; no
line separator a log consumer splits on survives raw, in text or JSON format."""

from __future__ import annotations

import io
import json
import logging

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
