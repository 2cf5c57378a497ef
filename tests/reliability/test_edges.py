"""Edges (issue 14): keys stay where they belong, forwarding is faithful, no input gives
a 500, and every ceiling is checked where it is set (config, admin API, request header).

The outside world here is two tiny aiohttp apps of the test's own: a recorder that keeps
every request it gets (method, path, query, headers, body), and a redirector that answers
every request with a redirect to the recorder. See docs/reliability.md, "Edges".
"""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import anthropic
import openai
import orjson
import pytest
from aiohttp import web

from proxy.config import MAX_RUN_CALLS, MAX_USD, hash_key, load_settings
from proxy.errors import ConfigError
from proxy.ledger.store import MAX_MICROS
from proxy.ops.demo import serve_on_free_port
from proxy.serve.appkeys import STORE
from tests.reliability.dialects import DIALECTS, Dialect, Reply, post

KEY = "sm-EDGESECRET-tenant-key-5f4e3d2c1b"
ADMIN = "adm-edges-token-31"
UPSTREAM_KEYS = {"OPENAI_API_KEY": "sk-EDGEUPSTREAM-openai", "ANTHROPIC_API_KEY": "sk-ant-EDGEUPSTREAM",
                 "GEMINI_API_KEY": "AIzaEDGEUPSTREAM-gemini"}
CHAT = DIALECTS[0]


@dataclass
class Seen:
    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: bytes

    def text(self) -> str:
        return f"{self.method} {self.path}?{self.query} {self.headers} {self.body!r}"


def _seen(request: web.Request, body: bytes) -> Seen:
    """What the upstream received, its query still percent-encoded as sent."""
    return Seen(request.method, request.path, request.rel_url.raw_query_string, dict(request.headers), body)


@dataclass
class Fake:
    url: str
    seen: list[Seen] = field(default_factory=list)


async def _serve(handler: Any) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    return await serve_on_free_port(app)


@pytest.fixture
async def recorder() -> AsyncIterator[Fake]:
    """Keeps every request as its server read it (a gzip body arrives decoded, as aiohttp decodes)."""
    fake = Fake("")

    async def handle(request: web.Request) -> web.Response:
        try:
            body = await request.read()
        except Exception as exc:  # a body its label does not match: keep what was seen, answer as a server would
            fake.seen.append(_seen(request, b""))
            return web.json_response({"error": f"recorder could not read the body: {exc!r}"}, status=400)
        fake.seen.append(_seen(request, body))
        return web.json_response({"ok": True})

    runner, fake.url = await _serve(handle)
    yield fake
    await runner.cleanup()


@pytest.fixture
async def redirector(recorder: Fake) -> AsyncIterator[Fake]:
    """Answers 307 (body kept on the way) to the recorder: a different origin, same path."""
    fake = Fake("")

    async def handle(request: web.Request) -> web.Response:
        fake.seen.append(_seen(request, b""))
        raise web.HTTPTemporaryRedirect(f"{recorder.url}{request.path}?token=LOCATIONSECRET")

    runner, fake.url = await _serve(handle)
    yield fake
    await runner.cleanup()


async def _tenant_proxy(make_proxy: Any, monkeypatch_env: Any, base_url: str, **settings: Any) -> Any:
    for k, v in UPSTREAM_KEYS.items():
        monkeypatch_env(k, v)
    policy = settings.pop("policy", {})
    return await make_proxy(openai_base_url=base_url, anthropic_base_url=base_url, gemini_base_url=base_url,
                            admin_token=ADMIN, tenants={"acme": {"keys": [hash_key(KEY)], "policy": policy}},
                            **settings)


async def _send(url: str, method: str, path: str, *, data: bytes | None = None,
                headers: dict[str, str] | None = None, key: str | None = KEY, json: Any = None) -> Reply:
    hdrs = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession() as s, s.request(method, url + path, data=data, json=json,
                                                       headers={**hdrs, **(headers or {})}) as r:
        return Reply(r.status, {k.lower(): v for k, v in r.headers.items()}, await r.read())


def _message(reply: Reply) -> str:
    return str(orjson.loads(reply.body)["error"]["message"])


# --- 1. Keys stay where they belong ---------------------------------------------------------

# (query as sent, query the upstream must get): `key` in any case or percent-encoding, a
# `;`-joined key, and the key under another name, each among parameters that must stay.
QUERIES = [
    (f"key={KEY}", ""),
    (f"a=1&KEY={KEY}&b=2", "a=1&b=2"),
    (f"alt=sse&Key={KEY}", "alt=sse"),
    (f"%6Bey={KEY}&a=1", "a=1"),
    (f"k%45Y={KEY}", ""),
    (f"+key={KEY}&a=1", "a=1"),
    (f"a=1;key={KEY}&b=2", "b=2"),
    (f"api_key={KEY}&a=1", "a=1"),
    (f"a=1&token={KEY.replace('-', '%2D')}", "a=1"),
    # Encoded separators stay encoded: decoded, %26 would split a value and %23 cut the query.
    ("x=a%26b%23c&alt=sse", "x=a%26b%23c&alt=sse"),
]
# Metered routes of every dialect, and pass-through routes (GET /v1/models always; the
# others because SPANMETER_ALLOW_PASSTHROUGH is on).
ROUTES = [
    ("POST", "/v1/chat/completions", CHAT.body("hi", False)),
    ("POST", "/v1/responses", DIALECTS[1].body("hi", False)),
    ("POST", "/v1/messages", DIALECTS[2].body("hi", False)),
    ("POST", "/v1beta/models/gemini-2.5-flash:generateContent", DIALECTS[3].body("hi", False)),
    ("GET", "/v1/models", None),
    ("GET", "/v1beta/cachedContents", None),
    ("POST", "/v1/files", {"purpose": "batch"}),
    ("DELETE", "/v1/files/file-1", None),
]


@pytest.mark.parametrize("method,path,body", ROUTES, ids=lambda v: v if isinstance(v, str) else "")
async def test_a_spanmeter_key_in_the_query_never_reaches_the_upstream_on_any_route(
        make_proxy, monkeypatch_env, recorder, method, path, body):
    proxy = await _tenant_proxy(make_proxy, monkeypatch_env, recorder.url, allow_passthrough=True)
    for query, forwarded in QUERIES:
        r = await _send(proxy.url, method, f"{path}?{query}", json=body)
        assert r.status == 200, (query, r.body[:300])
        assert recorder.seen[-1].query == forwarded, query
    assert len(recorder.seen) == len(QUERIES)
    for seen in recorder.seen:
        assert KEY not in seen.text() and "EDGESECRET" not in seen.text(), seen.text()
        assert seen.method == method and seen.path == path


async def test_an_upstream_redirect_is_never_followed_and_never_passed_on(
        make_proxy, monkeypatch_env, recorder, redirector):
    """aiohttp follows redirects and drops only Authorization: x-api-key and x-goog-api-key
    went to whatever origin the upstream named. A 3xx handed back would be followed by the
    SDK (openai and anthropic set follow_redirects) with the caller's key, past every ceiling."""
    proxy = await _tenant_proxy(make_proxy, monkeypatch_env, redirector.url, allow_passthrough=True,
                                policy={"budgets": {"daily_usd": 10}})
    replies: list[Reply] = []
    async with anthropic.AsyncAnthropic(base_url=proxy.url, api_key=KEY, max_retries=0,
                                        default_headers={"X-Run-Id": "redirected"}) as client:
        with pytest.raises(anthropic.APIStatusError) as ai:
            await client.messages.create(model="claude-sonnet-4-6", max_tokens=50,
                                         messages=[{"role": "user", "content": "hi"}])
    async with openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key=KEY,
                                  default_headers={"X-Run-Id": "redirected"}) as oai:
        with pytest.raises(openai.APIStatusError) as oi:
            await oai.chat.completions.create(model="sim-small", messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(openai.APIStatusError) as mi:
            await oai.models.list()
    assert ai.value.status_code == oi.value.status_code == mi.value.status_code == 502
    assert oi.value.response.headers["x-should-retry"] == "false"
    replies.append(await post(proxy.url, DIALECTS[3].path(True), DIALECTS[3].body("hi", True), key=KEY,
                              headers={"X-Run-Id": "redirected"}))
    replies.append(await _send(proxy.url, "PUT", "/v1/files/file-1", data=b"payload"))
    assert [r.status for r in replies] == [502, 502]
    messages = [str(ai.value.message), str(oi.value.message), str(mi.value.message), *map(_message, replies)]
    for m in messages:
        assert f"redirect to {recorder.url}/" in m and "does not follow redirects" in m, m
        assert "LOCATIONSECRET" not in m, "a Location's query may carry a token"
    assert len(redirector.seen) == 5, "every call went to the configured upstream"
    assert recorder.seen == [], "nothing, and so no key, ever reached the address a redirect named"
    await proxy.settled()
    assert await proxy.app[STORE].spend("acme", run_id="redirected") == 0, "a redirect generated nothing"


@pytest.mark.parametrize("status,location,says", [
    (301, "/v2/chat/completions?sig=LOCATIONSECRET", "redirect to http://127.0.0.1:"),
    (302, "https://user:LOCATIONSECRET@elsewhere.example/v1", "redirect to https://elsewhere.example/v1."),
    (303, "http://[broken", "redirect to an address that is not a valid URL"),
    (308, None, "a redirect with no Location"),
])
async def test_every_redirect_status_is_a_502_saying_where_it_pointed(make_proxy, sim, status, location, says):
    async def handle(request: web.Request) -> web.Response:
        return web.Response(status=status, headers={"Location": location} if location else None)

    runner, url = await _serve(handle)
    proxy = await make_proxy(openai_base_url=url)
    r = await post(proxy.url, CHAT.path(False), CHAT.body("hi", False))
    await runner.cleanup()
    assert r.status == 502
    message = _message(r)
    assert f"answered {status}" in message and says in message, message
    assert "LOCATIONSECRET" not in message


# --- 2. Forwarding is faithful --------------------------------------------------------------


@pytest.mark.parametrize("method", ["PUT", "DELETE", "PATCH", "POST"])
async def test_pass_through_keeps_the_method_and_the_body(make_proxy, monkeypatch_env, recorder, method):
    proxy = await _tenant_proxy(make_proxy, monkeypatch_env, recorder.url, allow_passthrough=True)
    r = await _send(proxy.url, method, "/v1/files/file-1?purpose=x", data=b'{"name": "n"}',
                    headers={"Content-Type": "application/json"})
    assert r.status == 200
    seen = recorder.seen[-1]
    assert (seen.method, seen.path, seen.query, seen.body) == (method, "/v1/files/file-1", "purpose=x",
                                                               b'{"name": "n"}')
    assert seen.headers["Authorization"] == f"Bearer {UPSTREAM_KEYS['OPENAI_API_KEY']}"


ENCODINGS = {"gzip": gzip.compress, "deflate": zlib.compress}


@pytest.mark.parametrize("encoding", list(ENCODINGS))
@pytest.mark.parametrize("d", DIALECTS, ids=lambda d: d.name)
async def test_a_compressed_body_is_forwarded_decoded_without_its_label(proxy, sim, d: Dialect, encoding: str):
    raw = orjson.dumps(d.body("hi", False))
    r = await post(proxy.url, d.path(False), data=ENCODINGS[encoding](raw), headers={"Content-Encoding": encoding})
    assert r.status == 200, r.body[:300]
    sent = {k.lower(): v for k, v in sim.last.headers.items()}
    assert "content-encoding" not in sent, "the label must match the bytes: they go decoded"
    assert sim.last.body == raw


async def test_pass_through_forwards_a_decoded_body_unlabelled_and_an_unknown_encoding_as_sent(
        make_proxy, monkeypatch_env, recorder):
    proxy = await _tenant_proxy(make_proxy, monkeypatch_env, recorder.url, allow_passthrough=True)
    r = await _send(proxy.url, "PUT", "/v1/files/f", data=gzip.compress(b"plain bytes"),
                    headers={"Content-Encoding": "gzip"})
    assert r.status == 200
    assert recorder.seen[-1].body == b"plain bytes" and "Content-Encoding" not in recorder.seen[-1].headers
    # An encoding aiohttp does not decode reaches us as sent: it goes on as sent, label and all.
    r = await _send(proxy.url, "PUT", "/v1/files/f", data=b"\x01opaque", headers={"Content-Encoding": "x-custom"})
    assert r.status == 200
    assert recorder.seen[-1].body == b"\x01opaque" and recorder.seen[-1].headers["Content-Encoding"] == "x-custom"


@pytest.mark.parametrize("d", DIALECTS, ids=lambda d: d.name)
async def test_a_body_labelled_gzip_that_is_not_gzip_is_a_400_in_the_dialect(proxy, sim, d: Dialect, caplog):
    r = await post(proxy.url, d.path(False), data=orjson.dumps(d.body("hi", False)),
                   headers={"Content-Encoding": "gzip"})
    assert r.status == 400, r.body[:300]
    body = orjson.loads(r.body)
    message = d.error_message(body)
    assert "Content-Encoding: gzip" in message and "Send the body uncompressed" in message
    assert r.headers["x-should-retry"] == "false"
    assert r.headers["connection"] == "close", "the rest of a broken body cannot be read past: no reuse"
    if d.name == "gemini":
        assert body["error"]["status"] == "INVALID_ARGUMENT"
        assert body["error"]["details"][0]["reason"] == "UNDECODABLE_BODY"
    else:
        assert body["error"]["type"] == "invalid_request_error"
        assert d.name == "anthropic" or body["error"]["code"] == "undecodable_body"
    assert sim.received == []
    assert not [rec for rec in caplog.records if rec.exc_info], "a caller's bad body is not a traceback of ours"


async def test_pass_through_answers_a_body_labelled_gzip_that_is_not_gzip_with_a_400(
        make_proxy, monkeypatch_env, recorder):
    proxy = await _tenant_proxy(make_proxy, monkeypatch_env, recorder.url, allow_passthrough=True)
    auth = {"Authorization": f"Bearer {KEY}"}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as s:  # one connection, reused
        async with s.put(f"{proxy.url}/v1/files/f", data=b"not gzip",
                         headers={**auth, "Content-Encoding": "gzip"}) as r:
            assert r.status == 400 and "Content-Encoding: gzip" in (await r.json())["error"]["message"]
        assert recorder.seen == []
        async with s.put(f"{proxy.url}/v1/files/f", data=b"fine", headers=auth) as r:
            assert r.status == 200, "the next request of the client is served, on a new connection"
    assert recorder.seen[-1].body == b"fine"


# --- 3. No 500 from any input, and 4. numbers validated where they are set ------------------


@pytest.mark.parametrize("limit", ["abc", "1e3", "0", "-1", "1001", "99999999999999999999", "", "1.5", "١٢"])
async def test_admin_runs_limit_outside_its_range_is_a_400_naming_it(make_proxy, monkeypatch_env, recorder, limit):
    proxy = await _tenant_proxy(make_proxy, monkeypatch_env, recorder.url)
    r = await _send(proxy.url, "GET", f"/admin/runs?limit={limit}", key=ADMIN)
    assert r.status == 400, r.body[:300]
    assert "limit must be a whole number from 1 to 1000" in _message(r)
    ok = await _send(proxy.url, "GET", "/admin/runs?limit=1000", key=ADMIN)
    assert ok.status == 200


@pytest.mark.parametrize("body,field", [
    (b'{"daily_usd": 1e300}', "daily_usd"), (b'{"daily_usd": 1e10}', "daily_usd"),
    (b'{"monthly_usd": 1000000001}', "monthly_usd"), (b'{"daily_usd": 0}', "daily_usd"),
    (b'{"monthly_usd": -5}', "monthly_usd"), (b'{"daily_usd": "5"}', "daily_usd"),
    (b'{"daily_usd": true}', "daily_usd"), (b'{"daily_usd": 1e400}', "daily_usd"),
    (b'{"daily_usd": NaN}', "daily_usd"), (b'{"daily_usd": ' + b"9" * 400 + b"}", "daily_usd"),
    (b'{"daily_usd": 1, "monthly_usd": [1]}', "monthly_usd"),
])
async def test_an_admin_budget_outside_its_range_is_refused_where_it_is_set(
        make_proxy, monkeypatch_env, sim, body, field):
    proxy = await _tenant_proxy(make_proxy, monkeypatch_env, sim.url, policy={"budgets": {"daily_usd": 5}})
    r = await _send(proxy.url, "PUT", "/admin/budgets/acme", key=ADMIN, data=body)
    assert r.status == 400, r.body[:300]
    assert f"{field} must be a number of US dollars above 0 and at most {MAX_USD}" in _message(r)
    got = orjson.loads((await _send(proxy.url, "GET", "/admin/budgets/acme", key=ADMIN)).body)
    assert got["source"] == "config" and got["daily_usd"] == 5, "nothing was stored"
    async with openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key=KEY) as c:
        await c.chat.completions.create(model="sim-small", messages=[{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("data", [b"not json", b"[1]", b'"x"', b"null"])
async def test_an_admin_budget_body_that_is_not_an_object_is_a_400(make_proxy, monkeypatch_env, sim, data):
    proxy = await _tenant_proxy(make_proxy, monkeypatch_env, sim.url)
    r = await _send(proxy.url, "PUT", "/admin/budgets/acme", key=ADMIN, data=data)
    assert r.status == 400 and "daily_usd" in _message(r)


HEADERS = [
    ("X-Run-Max-Calls", "99999999999999999999", "must be a whole number from 1 to 1000000000"),
    ("X-Run-Max-Calls", str(MAX_RUN_CALLS + 1), "must be a whole number from 1 to 1000000000"),
    ("X-Run-Max-Calls", "0", "must be a whole number from 1 to 1000000000"),
    ("X-Run-Max-Cost-Usd", "1e300", "must be an amount of US dollars above 0 and at most 1000000000"),
    ("X-Run-Max-Cost-Usd", "1000000001", "must be an amount of US dollars above 0 and at most 1000000000"),
    ("X-Run-Max-Cost-Usd", "inf", "must be an amount of US dollars above 0 and at most 1000000000"),
    ("X-Run-Max-Cost-Usd", "nan", "must be an amount of US dollars above 0 and at most 1000000000"),
]


@pytest.mark.parametrize("d", DIALECTS, ids=lambda d: d.name)
@pytest.mark.parametrize("header,value,says", HEADERS, ids=lambda v: v if len(v) < 24 else v[:10])
async def test_a_ceiling_header_outside_its_range_is_a_400_on_a_tenant_without_that_ceiling(
        make_proxy, monkeypatch_env, sim, d: Dialect, header: str, value: str, says: str):
    proxy = await _tenant_proxy(make_proxy, monkeypatch_env, sim.url)  # no ceilings at all: the header is the limit
    r = await post(proxy.url, d.path(False), d.body("hi", False), key=KEY, headers={header: value})
    assert r.status == 400, r.body[:300]
    assert f"{header} {says}" in d.error_message(orjson.loads(r.body))
    assert sim.received == []


@pytest.mark.parametrize("where", ["env", "file"])
@pytest.mark.parametrize("setting,value,bound", [
    ("policy.budgets.daily_usd", "1e10", MAX_USD), ("policy.budgets.monthly_usd", "1e300", MAX_USD),
    ("policy.runs.max_cost_usd", "1000000001", MAX_USD),
    ("policy.runs.max_llm_calls", "99999999999999999999", MAX_RUN_CALLS),
    ("tenants.acme.policy.budgets.daily_usd", "1e10", MAX_USD),
    ("tenants.acme.policy.runs.max_llm_calls", str(MAX_RUN_CALLS + 1), MAX_RUN_CALLS),
])
def test_an_absurd_ceiling_in_the_config_is_refused_at_start_up(tmp_path, monkeypatch_env, where, setting, value,
                                                                 bound):
    path = setting.split(".")
    if where == "file" or path[0] == "tenants":
        doc: dict[str, Any] = {}
        node = doc
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = float(value) if "." in value or "e" in value else int(value)
        cfg = tmp_path / "spanmeter.yaml"
        cfg.write_text(json.dumps(doc))  # JSON is YAML
        monkeypatch_env("SPANMETER_CONFIG", str(cfg))
    else:
        monkeypatch_env("SPANMETER_" + "__".join(path).upper(), value)
    with pytest.raises(ConfigError) as ei:
        load_settings()
    message = ei.value.message
    assert f"- {setting} (from " in message and f"less than or equal to {bound}" in message, message



async def test_the_largest_accepted_ceilings_let_calls_through_everywhere(make_proxy, monkeypatch_env, sim, ledger):
    """Before: a daily budget of $1e10 (admin API) made every later call of the tenant a 500."""
    assert MAX_USD * 1_000_000 * 4 < MAX_MICROS, "room for reservations on top of the largest budget"
    proxy = await _tenant_proxy(make_proxy, monkeypatch_env, sim.url, ledger_url=ledger, policy={
        "budgets": {"daily_usd": MAX_USD, "monthly_usd": MAX_USD},
        "runs": {"max_cost_usd": MAX_USD, "max_llm_calls": MAX_RUN_CALLS}})
    headers = {"X-Run-Id": "max", "X-Run-Max-Calls": str(MAX_RUN_CALLS), "X-Run-Max-Cost-Usd": str(MAX_USD)}
    for d in DIALECTS:
        for stream in (False, True):
            r = await post(proxy.url, d.path(stream), d.body("hi", stream), key=KEY, headers=headers)
            assert r.status == 200, (d.name, r.body[:300])
    refused = await _send(proxy.url, "PUT", "/admin/budgets/acme", key=ADMIN, json={"daily_usd": 1e10})
    assert refused.status == 400
    set_ = await _send(proxy.url, "PUT", "/admin/budgets/acme", key=ADMIN,
                       json={"daily_usd": MAX_USD, "monthly_usd": MAX_USD})
    assert set_.status == 200 and orjson.loads(set_.body)["source"] == "admin"
    async with openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key=KEY, default_headers=headers) as c:
        for _ in range(2):
            await c.chat.completions.create(model="sim-small", messages=[{"role": "user", "content": "hi"}])
    await proxy.settled()
    spent = await proxy.app[STORE].spend("acme", run_id="max")
    assert 0 < spent < 1_000_000, "ten small calls, charged as usual"
    assert await proxy.app[STORE].run_calls("acme", "max") == 10
