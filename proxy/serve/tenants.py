"""Who is calling: spanmeter key -> tenant, and which run the call belongs to."""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Mapping

from proxy.config import KEY_PREFIX, Settings, hash_key, key_id_of
from proxy.errors import NOT_ECHOED, RequestError, Unauthorized
from proxy.model import Caller, RunIdSource
from tracing.traceparent import parse_traceparent

__all__ = ["KeyIndex", "identify", "new_key", "presented_key"]

OPEN_TENANT = "default"
KEY_HEADERS = ("authorization", "x-api-key", "x-goog-api-key", "api-key")  # api-key: Azure OpenAI's
_RUN_ID = re.compile(r"^[A-Za-z0-9._:@/+=-]{1,128}$")
AGENT_NAME_MAX = 128
CONVERSATION_ID_MAX = 256
_CONVERSATION_ID = re.compile(rf"[\x21-\x7e]{{1,{CONVERSATION_ID_MAX}}}")


class KeyIndex:
    """sha256(key) -> tenant, built once from settings. Keys are never held in clear."""

    def __init__(self, settings: Settings) -> None:
        self._by_hash = {k.hash: name for name, t in settings.tenants.items() for k in t.key_configs()}

    def tenant_of(self, key: str) -> tuple[str, str] | None:
        """(tenant, key id) of a presented key, or None: one sha256 for both."""
        # The lookup is by sha256 of the presented key: timing can reveal at most how
        # a hash the caller cannot steer compares, never a prefix of a stored key.
        digest = hash_key(key)
        tenant = self._by_hash.get(digest)
        return None if tenant is None else (tenant, key_id_of(digest))


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def presented_key(headers: Mapping[str, str], query: Mapping[str, str]) -> str | None:
    """The key in the SDK's native auth header (case-insensitive), or `?key=` for curl."""
    auth = headers.get("authorization")
    if auth:
        scheme, _, token = auth.partition(" ")
        return token.strip() if scheme.lower() == "bearer" else auth.strip()
    return (headers.get("x-api-key") or headers.get("x-goog-api-key") or headers.get("api-key")
            or query.get("key"))


def identify(
    headers: Mapping[str, str], query: Mapping[str, str], settings: Settings, keys: KeyIndex
) -> Caller:
    key = presented_key(headers, query)
    if settings.open_mode:
        tenant, upstream_key, key_id = OPEN_TENANT, key, None
    else:
        if not key:
            raise Unauthorized(
                "No spanmeter key was sent. Send your spanmeter key as the SDK's API key "
                "(Authorization: Bearer, x-api-key, x-goog-api-key or Azure's api-key). Create one with "
                "`spanmeter keys create --tenant NAME`."
            )
        found = keys.tenant_of(key)
        if found is None:
            raise Unauthorized(
                "The API key is not a spanmeter key of any tenant. Use the key printed by "
                "`spanmeter keys create --tenant NAME` (spanmeter injects the provider key itself)."
            )
        (tenant, key_id), upstream_key = found, None
    run_id, source = _run(headers)
    return Caller(tenant, run_id, source, key_id, upstream_key,
                  agent_name=_agent_name(headers.get("x-agent-name")),
                  conversation_id=_conversation_id(headers.get("x-conversation-id")))


def _agent_name(value: str | None) -> str | None:
    """X-Agent-Name: printable text, AGENT_NAME_MAX characters at most (it names the run's span)."""
    if value is None:
        return None
    name = value.strip()
    if not name or len(name) > AGENT_NAME_MAX or not name.isprintable():
        raise RequestError(
            f"X-Agent-Name is not a valid agent name: use 1 to {AGENT_NAME_MAX} printable characters (no control "
            f"characters or line breaks), e.g. `X-Agent-Name: support-bot`; {NOT_ECHOED}",
            param="X-Agent-Name",
        )
    return name


def _conversation_id(value: str | None) -> str | None:
    """X-Conversation-Id: the caller's own conversation (session, thread) id, kept as sent."""
    if value is None:
        return None
    cid = value.strip()
    if not _CONVERSATION_ID.fullmatch(cid):
        raise RequestError(
            f"X-Conversation-Id is not a valid conversation id: use 1 to {CONVERSATION_ID_MAX} visible ASCII "
            f"characters without spaces (your session or thread id); {NOT_ECHOED}",
            param="X-Conversation-Id",
        )
    return cid


def _run(headers: Mapping[str, str]) -> tuple[str, RunIdSource]:
    rid = headers.get("x-run-id")
    if rid is not None:
        rid = rid.strip()
        if not _RUN_ID.match(rid):
            raise RequestError(
                "X-Run-Id is not a valid run id: use 1 to 128 characters of letters, digits and . _ : @ / + = -; "
                f"{NOT_ECHOED}",
                param="X-Run-Id",
            )
        return rid, "header"
    # The tracer's own parser: a run is named after a trace only if its spans join it.
    parent = parse_traceparent(headers.get("traceparent"))
    if parent is not None:
        return parent.trace_id_hex, "traceparent"
    return "run-" + _RUN_IDS.next_hex(), "generated"


class _RandomHex:
    """16 random hex digits at a time (what uuid4().hex[:16] gave), from os.urandom drawn
    4 KiB at a time. os.urandom releases the GIL: drawn per call, on the event loop, it
    handed the GIL to the ledger's thread once per request and the loop then waited to
    get it back (in the bench the largest wall-clock item of identify). Same source of
    randomness; a forked worker drops the parent's bytes, so no two processes share any.
    Used on the event loop's thread only (identify), so `_at` needs no lock."""

    _BYTES = 8
    _CHUNK = 4096

    def __init__(self) -> None:
        self._pool = b""
        self._at = 0
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        self._pool, self._at = b"", 0

    def next_hex(self) -> str:
        if self._at + self._BYTES > len(self._pool):
            self._pool, self._at = os.urandom(self._CHUNK), 0
        at = self._at
        self._at = at + self._BYTES
        return self._pool[at:at + self._BYTES].hex()


_RUN_IDS = _RandomHex()
