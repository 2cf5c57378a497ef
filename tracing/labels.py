"""Metric label values that a caller, its model or an upstream can steer, kept bounded.

Prometheus keeps every label set a process ever recorded, so every label a request can
steer goes through `LabelBounds` before it reaches an instrument: a known value as sent,
the first few others (`MAX_MODEL_VARIANTS`, `MAX_ERROR_TYPES`, `MAX_TOOL_NAMES`,
`MAX_KINDS`, each at most `LABEL_VALUE_LIMIT` chars), else `_OTHER`; a refusal's
`spanmeter.reason` only from `proxy.model.REFUSAL_REASONS`.
Each label's rule and why: docs/telemetry.md, "Bounded metric labels".
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterable
from typing import Final

from proxy.model import REFUSAL_REASONS
from tracing import attributes as A

__all__ = [
    "KNOWN_ERROR_TYPES",
    "LABEL_VALUE_LIMIT",
    "MAX_ERROR_TYPES",
    "MAX_KINDS",
    "MAX_MODEL_VARIANTS",
    "MAX_TOOL_NAMES",
    "MCP_METHODS",
    "BoundedValues",
    "KnownModel",
    "LabelBounds",
    "ModelLabels",
]

OTHER: Final = A.LABEL_OTHER
LABEL_VALUE_LIMIT: Final = 64
MAX_MODEL_VARIANTS: Final = 256
MAX_TOOL_NAMES: Final = 256
MAX_ERROR_TYPES: Final = 64
MAX_KINDS: Final = 128
_RESOLVED_CACHE: Final = 4096  # model name -> priced name, for names up to _CACHED_NAME chars
_CACHED_NAME: Final = 256

# A label token: what providers allow in tool names and error codes. Models may also
# carry `/` (`models/gemini-2.5-pro`, `meta-llama/Llama-3`) and `@` (`claude-...@20250929`).
_TOKEN: Final = re.compile(r"[A-Za-z0-9_.:\-]+")
_MODEL: Final = re.compile(r"[A-Za-z0-9_.:@/\-]+")
_METHOD: Final = re.compile(r"[A-Za-z0-9_.:/\-]+")

# Client-to-server requests of the MCP specification (2024-11-05 to 2026-07-28).
MCP_METHODS: Final[frozenset[str]] = frozenset({
    "initialize", "ping", "server/discover", "tools/list", "tools/call", "prompts/list", "prompts/get",
    "resources/list", "resources/templates/list", "resources/read", "resources/subscribe",
    "resources/unsubscribe", "completion/complete", "logging/setLevel", "tasks/get", "tasks/list",
    "tasks/result", "tasks/cancel",
})

KNOWN_ERROR_TYPES: Final[frozenset[str]] = frozenset(
    {str(status) for status in range(100, 600)}
    | {
        # spanmeter's own (proxy/errors.py ProxyError.error_type; a test keeps this in step)
        "spanmeter.body_timeout", "spanmeter.body_too_large", "spanmeter.budget_exceeded",
        "spanmeter.config_error", "spanmeter.invalid_api_key", "spanmeter.invalid_request",
        "spanmeter.ledger_unavailable", "spanmeter.loop_detected", "spanmeter.malformed_body",
        "spanmeter.rate_limit_exceeded", "spanmeter.refused", "spanmeter.schema_violation",
        "spanmeter.spanmeter_error",
        "spanmeter.unknown_route", "spanmeter.upstream_error", "spanmeter.upstream_protocol_error",
        "spanmeter.upstream_timeout", "spanmeter.upstream_unreachable", "spanmeter.undecodable_body",
        "spanmeter.upstream_redirect", "spanmeter.no_upstream_credentials",
        "client_disconnected", "cancelled", "error", A.ERROR_TOOL, A.ERROR_TOOL_RESULT_MISSING,
        "queue_full", "export_failed", "export_process_down", A.LABEL_OTHER,
        # JSON-RPC 2.0 and MCP error codes (MCP spans' error.type is the code)
        "-32700", "-32600", "-32601", "-32602", "-32603", "-32000", "-32001", "-32002", "-32042",
        "-32020", "-32021", "-32022",
        # OpenAI error types and codes
        "invalid_request_error", "authentication_error", "permission_error", "not_found_error",
        "rate_limit_error", "rate_limit_exceeded", "insufficient_quota", "server_error",
        "context_length_exceeded", "invalid_api_key", "model_not_found", "tokens", "requests",
        # Anthropic
        "api_error", "overloaded_error", "request_too_large", "billing_error", "timeout_error",
        # Gemini (google.rpc status)
        "INVALID_ARGUMENT", "FAILED_PRECONDITION", "PERMISSION_DENIED", "UNAUTHENTICATED",
        "NOT_FOUND", "RESOURCE_EXHAUSTED", "INTERNAL", "UNAVAILABLE", "DEADLINE_EXCEEDED",
        "CANCELLED",
    }
)  # fmt: skip

KnownModel = Callable[[str], str | None]
"""The price-table name a model is billed under: itself, or the model a dated variant
belongs to (`gpt-4o-2024-08-06` -> `gpt-4o`); None for a model the table does not know."""


class BoundedValues:
    """One label's values: the known ones, plus the first `max_admitted` others that are
    tokens (`pattern`, at most `max_len` chars). Everything else is `_OTHER`.

    Reads are a set lookup; only admitting takes the lock. Safe to share between threads.
    """

    __slots__ = ("_lock", "_max_len", "_pattern", "_room", "_values")

    def __init__(
        self,
        max_admitted: int,
        *,
        known: Iterable[str] = (),
        pattern: re.Pattern[str] = _TOKEN,
        max_len: int = LABEL_VALUE_LIMIT,
    ) -> None:
        self._values: set[str] = {OTHER, *known}
        self._room = max_admitted
        self._pattern = pattern
        self._max_len = max_len
        self._lock = threading.Lock()

    def get(self, value: str, *, admit: bool = True) -> str:
        """`value` when known or admitted (now or before), else `_OTHER`."""
        if value in self._values:
            return value
        return value if admit and self._admit(value) else OTHER

    def _is_token(self, value: str) -> bool:
        return len(value) <= self._max_len and self._pattern.fullmatch(value) is not None

    def _admit(self, value: str) -> bool:
        if not self._is_token(value):
            return False
        with self._lock:
            if value in self._values:
                return True
            if self._room <= 0:
                return False
            self._room -= 1
            self._values.add(value)
            return True

    def __len__(self) -> int:
        return len(self._values)


class ModelLabels:
    """`gen_ai.request.model` / `gen_ai.response.model` label values (see the table above)."""

    __slots__ = ("_exact", "_resolve", "_resolved", "_variants")

    def __init__(self, known_model: KnownModel | None, *, max_variants: int = MAX_MODEL_VARIANTS) -> None:
        self._resolve = known_model
        # Names exactly as priced (with or without Gemini's `models/`): bounded by the table.
        self._exact: set[str] = set()
        self._variants = BoundedValues(max_variants, pattern=_MODEL)
        self._resolved: dict[str, str] = {}  # name -> priced name, "" for unknown; bounded

    def get(self, model: str | None, *, admit: bool = True) -> str | None:
        if model is None:
            return None
        if model in self._exact:
            return model
        if self._resolve is None:
            return self._variants.get(model, admit=admit)
        priced = self._priced(self._resolve, model)
        if not priced:
            return OTHER
        if model == priced or model.removeprefix("models/") == priced:
            self._exact.add(model)
            return model
        kept = self._variants.get(model, admit=admit)
        return priced if kept == OTHER else kept

    def _priced(self, resolve: KnownModel, model: str) -> str:
        if len(model) > _CACHED_NAME:  # looked up every time rather than held in memory
            return resolve(model) or ""
        found = self._resolved.get(model)
        if found is None:
            if len(self._resolved) >= _RESOLVED_CACHE:
                self._resolved.clear()
            found = self._resolved[model] = resolve(model) or ""
        return found


class LabelBounds:
    """Every steerable label of one process, bounded; see the module docstring."""

    __slots__ = ("error_types", "kinds", "mcp_methods", "models", "refusals", "tools")

    def __init__(
        self,
        known_model: KnownModel | None = None,
        *,
        max_model_variants: int = MAX_MODEL_VARIANTS,
        max_tool_names: int = MAX_TOOL_NAMES,
        max_error_types: int = MAX_ERROR_TYPES,
        max_kinds: int = MAX_KINDS,
    ) -> None:
        self.models = ModelLabels(known_model, max_variants=max_model_variants)
        self.error_types = BoundedValues(max_error_types, known=KNOWN_ERROR_TYPES)
        self.tools = BoundedValues(max_tool_names)
        self.kinds = BoundedValues(max_kinds)
        # Closed: a dashboard filters on these words, so no other may appear beside them.
        self.refusals = BoundedValues(0, known=REFUSAL_REASONS)
        self.mcp_methods = BoundedValues(max_kinds, known=MCP_METHODS, pattern=_METHOD)

    def model(self, model: str | None, *, admit: bool = True) -> str | None:
        return self.models.get(model, admit=admit)

    def error_type(self, error_type: str | None, *, admit: bool = True) -> str | None:
        return None if error_type is None else self.error_types.get(error_type, admit=admit)

    def tool(self, name: str, *, admit: bool = True) -> str:
        return self.tools.get(name, admit=admit)

    def kind(self, kind: str, *, admit: bool = True) -> str:
        return self.kinds.get(kind, admit=admit)

    def refusal(self, reason: str) -> str:
        """A refusal's reason: one of the vocabulary, else `_OTHER`."""
        return self.refusals.get(reason, admit=False)

    def mcp_method(self, method: str, *, admit: bool = True) -> str:
        return self.mcp_methods.get(method, admit=admit)
