"""Secrets stay inside, tenants stay apart.

A full scenario (all four dialects, streams, a tool round trip, upstream errors, a cut
stream, refusals, bad keys) runs in tenant mode with content capture on; everything
spanmeter emits is then searched for the secrets: spans at the OTLP receiver and in the
local files, /metrics, every log record, every response, the runs viewer, the admin API.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from proxy.config import hash_key
from proxy.serve.appkeys import STORE, TEL
from tests.fixtures.otlp import otlp_receiver  # noqa: F401
from tests.reliability.dialects import DIALECTS, Reply, post, settled_span
from tracing.local import read_spans
from tracing.viewer import load_runs, render_run_tree, render_runs_table

UPSTREAM = {"OPENAI_API_KEY": "sk-proj-UPSTREAMSECRET-openai-9f8e7d6c5b4a",
            "ANTHROPIC_API_KEY": "sk-ant-api03-UPSTREAMSECRET-anthropic-1a2b3c",
            "GEMINI_API_KEY": "AIzaSyUPSTREAMSECRET-gemini-0z9y8x7w"}
KEY_A = "sm-TENANTSECRET-alpha-Qm9vYmFyYmF6cXV4"
KEY_B = "sm-TENANTSECRET-bravo-cXV4cXV1eGJhcmJheg"
ADMIN = "adm-ADMINSECRET-token-77aa"
WRONG = "sm-WRONGSECRET-presented-by-a-stranger"
SECRETS = [*UPSTREAM.values(), KEY_A, KEY_B, ADMIN, WRONG]
TOOLS_CHAT = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture
async def tenant_proxy(otlp_receiver, make_proxy, monkeypatch_env):  # noqa: F811
    for k, v in UPSTREAM.items():
        monkeypatch_env(k, v)
    monkeypatch_env("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", "SPAN_ONLY")
    proxy = await make_proxy(otlp_endpoint=otlp_receiver.endpoint, admin_token=ADMIN, tenants={
        "alpha": {"keys": [hash_key(KEY_A)], "policy": {"runs": {"max_llm_calls": 40}}},
        "bravo": {"keys": [hash_key(KEY_B)], "policy": {"runs": {"max_llm_calls": 4}}}})
    return proxy, otlp_receiver


async def _get(url: str, token: str | None = None) -> Reply:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession() as s, s.get(url, headers=headers) as r:
        return Reply(r.status, {k.lower(): v for k, v in r.headers.items()}, await r.read())


async def _scenario(url: str) -> list[Reply]:
    out: list[Reply] = []
    for d in DIALECTS:
        for stream in (False, True):
            for text in ("hi", "SCENARIO:error:500", "SCENARIO:error:401", "SCENARIO:json_fenced"):
                out.append(await post(url, d.path(stream), d.body(text, stream), key=KEY_A,
                                      headers={"X-Run-Id": f"sec-{d.name}"}))
        out.append(await post(url, d.path(True), d.body("SCENARIO:reset:2", True), key=KEY_A,
                              headers={"X-Run-Id": f"sec-{d.name}"}))
        out.append(await post(url, d.path(False), d.body("hi", False), key=WRONG))
        out.append(await post(url, d.path(False) + ("&" if "?" in d.path(False) else "?") + f"key={WRONG}",
                              d.body("hi", False), key=""))
    out += await _chat_tool_round_trip(url, KEY_A, "sec-tools")
    for _ in range(5):  # bravo's ceiling is 4 calls: the fifth is refused
        out.append(await post(url, DIALECTS[2].path(False), DIALECTS[2].body("hi", False), key=KEY_B,
                              headers={"X-Run-Id": "sec-refused"}))
    out.append(await post(url, "/v1/completions", {"prompt": "x"}, key=KEY_A))
    return out


async def _chat_tool_round_trip(url: str, key: str, run: str) -> list[Reply]:
    d = DIALECTS[0]
    msgs: list[Any] = [{"role": "user", "content": "SCENARIO:tool weather?"}]
    first = await post(url, d.path(False), {"model": d.model, "messages": msgs, "tools": TOOLS_CHAT}, key=key,
                       headers={"X-Run-Id": run})
    message = orjson.loads(first.body)["choices"][0]["message"]
    msgs += [message, {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": '{"ok": true}'}]
    second = await post(url, d.path(False), {"model": d.model, "messages": msgs, "tools": TOOLS_CHAT}, key=key,
                        headers={"X-Run-Id": run})
    return [first, second]


async def test_no_secret_appears_in_anything_spanmeter_emits(tenant_proxy, sim, caplog):
    proxy, receiver = tenant_proxy
    caplog.set_level(logging.DEBUG)
    replies = await _scenario(proxy.url)
    assert {r.status for r in replies} >= {200, 401, 402, 404, 500}
    await settled_span(proxy, "sec-tools", n=2)
    await asyncio.to_thread(proxy.app[TEL].force_flush)
    spans = await asyncio.to_thread(receiver.wait_for_spans, 40)
    traces = Path(proxy.data_dir) / "traces"
    admin = [await _get(proxy.url + p, ADMIN) for p in
             ("/admin/tenants", "/admin/runs", "/admin/spend?tenant=alpha", "/admin/runs/alpha/sec-tools")]
    assert all(r.status == 200 for r in admin)
    runs = load_runs(traces)
    emitted = {
        "otlp spans": json.dumps(spans),
        "local spans": json.dumps(list(read_spans(traces))),
        "metrics": (await _get(proxy.url + "/metrics")).body.decode(),
        "logs": "\n".join(f"{r.getMessage()} {r.exc_text or ''}" for r in caplog.records),
        "responses": "\n".join(f"{r.headers} {r.body.decode(errors='replace')}" for r in replies),
        "viewer": render_runs_table(runs) + "\n".join(render_run_tree(r.run_id, traces) for r in runs),
        "admin api": "\n".join(r.body.decode() for r in admin),
        "ledger": (Path(proxy.data_dir) / "ledger.db").read_bytes().decode("latin-1"),
    }
    assert "gen_ai.input.messages" in emitted["otlp spans"], "content capture was on"
    for where, text in emitted.items():
        for secret in SECRETS:
            assert secret not in text, f"{secret[:12]}... leaked into {where}"
    # The spanmeter keys never reach the provider; each dialect got its own upstream key.
    upstream = "\n".join(f"{r.headers} {r.query}" for r in sim.received)
    for secret in (KEY_A, KEY_B, WRONG):
        assert secret not in upstream
    assert UPSTREAM["ANTHROPIC_API_KEY"] in upstream and UPSTREAM["GEMINI_API_KEY"] in upstream


async def test_the_admin_api_needs_its_token_and_a_tenant_key_is_refused(tenant_proxy, make_proxy):
    proxy, _ = tenant_proxy
    for path in ("/admin/tenants", "/admin/runs", "/admin/spend?tenant=alpha", "/admin/budgets/alpha"):
        for token in (None, KEY_A, ADMIN + "x", ADMIN[:-1]):
            r = await _get(proxy.url + path, token)
            assert r.status == 401, (path, token)
            assert "admin token" in orjson.loads(r.body)["error"]["message"]
    disabled = await make_proxy()
    r = await _get(disabled.url + "/admin/tenants", "anything")
    assert r.status == 401 and "SPANMETER_ADMIN_TOKEN" in r.body.decode()


async def test_one_run_id_in_two_tenants_shares_no_ledger_and_no_tool_state(tenant_proxy, sim):
    proxy, _ = tenant_proxy
    store = proxy.app[STORE]
    d = DIALECTS[0]
    first = await post(proxy.url, d.path(False), {"model": d.model, "tools": TOOLS_CHAT,
                                                  "messages": [{"role": "user", "content": "SCENARIO:tool"}]},
                       key=KEY_A, headers={"X-Run-Id": "shared"})
    message = orjson.loads(first.body)["choices"][0]["message"]
    call_id = message["tool_calls"][0]["id"]
    await settled_span(proxy, "shared")
    # Tenant bravo answers alpha's tool call in a run with the same id: it must close nothing.
    msgs = [{"role": "user", "content": "SCENARIO:tool"}, message,
            {"role": "tool", "tool_call_id": call_id, "content": "stolen"}]
    r = await post(proxy.url, d.path(False), {"model": d.model, "messages": msgs, "tools": TOOLS_CHAT},
                   key=KEY_B, headers={"X-Run-Id": "shared"})
    assert r.status == 200
    await settled_span(proxy, "shared", n=2)
    assert [p["id"] for p in await store.tools_pending("alpha", "shared")] == [call_id]
    assert await store.run_calls("alpha", "shared") == 1 and await store.run_calls("bravo", "shared") == 1
    a, b = await store.spend("alpha", run_id="shared"), await store.spend("bravo", run_id="shared")
    assert a > 0 and b > 0
    assert await store.spend("alpha") == a and await store.spend("bravo") == b
    admin = orjson.loads((await _get(proxy.url + "/admin/runs?tenant=bravo", ADMIN)).body)
    assert {r["tenant"] for r in admin["runs"]} == {"bravo"}


async def test_the_runs_viewer_keeps_two_tenants_runs_with_one_id_apart(tenant_proxy):
    proxy, _ = tenant_proxy
    d = DIALECTS[0]
    for key in (KEY_A, KEY_B):
        await post(proxy.url, d.path(False), d.body("hi", False), key=key, headers={"X-Run-Id": "same-id"})
    await settled_span(proxy, "same-id", n=2)
    runs = [r for r in load_runs(Path(proxy.data_dir) / "traces") if r.run_id == "same-id"]
    assert sorted((r.tenant, r.calls) for r in runs) == [("alpha", 1), ("bravo", 1)]
    alpha = render_run_tree("same-id", Path(proxy.data_dir) / "traces", tenant="alpha")
    assert "(alpha)" in alpha and "bravo" not in alpha


async def test_incoming_trace_context_is_not_identity_and_never_reaches_the_provider(tenant_proxy, sim):
    proxy, _ = tenant_proxy
    tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    ctx = {"traceparent": tp, "tracestate": "vendor=secret", "baggage": "tenant=alpha,user=root"}
    # No key, but trace context that names a tenant: still 401.
    r = await post(proxy.url, "/v1/chat/completions", DIALECTS[0].body("hi", False), key="", headers=ctx)
    assert r.status == 401
    # Bravo's call with a baggage claiming alpha: bravo's ledger, and no context upstream.
    for d in DIALECTS:
        r = await post(proxy.url, d.path(False), d.body("hi", False), key=KEY_B, headers=ctx)
        assert r.status == 200
        sent = {k.lower() for k in sim.last.headers}
        assert not sent & {"traceparent", "tracestate", "baggage"}, d.name
    run = "4bf92f3577b34da6a3ce929d0e0e4736"  # the run id comes from the trace; the tenant from the key
    span = await settled_span(proxy, run, n=4)
    assert span["attributes"]["spanmeter.tenant.id"] == "bravo"
    assert await proxy.app[STORE].run_calls("alpha", run) == 0


async def test_an_over_long_auth_header_never_reaches_the_logs(tenant_proxy, caplog):
    proxy, _ = tenant_proxy
    caplog.set_level(logging.DEBUG)
    async with aiohttp.ClientSession() as s, s.post(
            proxy.url + "/v1/chat/completions", data=b"{}",
            headers={"Authorization": f"Bearer {KEY_A}" + "x" * 9000}) as r:
        assert r.status == 400
    logged = "\n".join(f"{r.getMessage()} {r.exc_text or ''}" for r in caplog.records)
    assert "rejected an unparsable HTTP request: 400 LineTooLong" in logged
    assert KEY_A not in logged
