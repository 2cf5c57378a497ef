"""Errors spanmeter itself raises, each rendered in the caller's own API dialect.

`ProxyError` (status, code, message: what, why, how to fix) and its families:
`ConfigError` (invalid settings at start), `RequestError` (4xx: the request cannot be
served as sent), `Refusal` (a policy said no before anything was sent upstream: 402, 409,
429) and `ServiceError` (5xx: spanmeter or its upstream failed). Each API module renders
them in its own words (proxy/providers/); nothing here knows a dialect. Errors raised by
the upstream are never wrapped: they pass through unchanged.
The tree, each error with its status: docs/internals.md, "Errors".
"""

from __future__ import annotations

from typing import Any, ClassVar

__all__ = [
    "NOT_ECHOED",
    "BodyTimeout",
    "BodyTooLarge",
    "CeilingReached",
    "ConfigError",
    "LoopRefused",
    "MalformedBody",
    "ProxyError",
    "RateLimited",
    "Refusal",
    "RequestError",
    "SchemaViolation",
    "ServiceError",
    "StoreUnavailable",
    "Unauthorized",
    "UndecodableBody",
    "UnknownRoute",
    "UpstreamConnectError",
    "UpstreamProtocolError",
    "UpstreamRedirect",
    "UpstreamTimeout",
]


# A rejected header's value is never repeated, in the answer or in the access log that
# quotes the answer: a client that put its key in the wrong header must not find it there.
NOT_ECHOED = "the value sent is not one (it is not repeated here: a header may hold a secret sent by mistake)."

class ProxyError(Exception):
    status: ClassVar[int] = 500
    code: ClassVar[str] = "spanmeter_error"
    retryable: ClassVar[bool] = False

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    @property
    def error_type(self) -> str:
        """`error.type` on spans and metrics: stable and low-cardinality."""
        return f"spanmeter.{self.code}"

    def headers(self) -> dict[str, str]:
        # The Stainless-generated SDKs honour x-should-retry over the status code.
        return {"x-should-retry": "true" if self.retryable else "false"}


class ConfigError(ProxyError):
    code = "config_error"


class RequestError(ProxyError):
    status = 400
    code = "invalid_request"


class Unauthorized(RequestError):
    status = 401
    code = "invalid_api_key"


class BodyTimeout(RequestError):
    status = 408
    code = "body_timeout"


class MalformedBody(RequestError):
    code = "malformed_body"


class UndecodableBody(MalformedBody):
    code = "undecodable_body"

    def __init__(self, encoding: str) -> None:
        super().__init__(
            f"The request body is labelled Content-Encoding: {encoding[:40]}, but it could not be decoded as "
            "that encoding. Send the body uncompressed with no Content-Encoding header, or compressed as "
            "labelled (spanmeter decodes gzip and deflate).", param="Content-Encoding")


class UnknownRoute(RequestError):
    status = 404
    code = "unknown_route"


class BodyTooLarge(RequestError):
    status = 413
    code = "body_too_large"


class SchemaViolation(RequestError):
    status = 422
    code = "schema_violation"


class Refusal(ProxyError):
    status = 402
    code = "refused"
    # Set by the ledger's admission, which closes the tool calls the request answers and
    # fixes the run's trace ids even when it refuses the call: their spans still follow.
    closed: tuple[dict[str, Any], ...] = ()
    trace: dict[str, Any] | None = None


class CeilingReached(Refusal):
    """A run or tenant ceiling would be crossed. 402: in no SDK's retry list."""

    code = "budget_exceeded"

    def __init__(self, message: str, *, limit: str) -> None:
        super().__init__(message)
        self.limit = limit  # which ceiling: run_calls, run_cost, tenant_day, tenant_month, ...


class LoopRefused(Refusal):
    status = 409
    code = "loop_detected"


class RateLimited(Refusal):
    """A rate limit per minute is used up. 429, which SDKs retry after `Retry-After`; the
    `x-ratelimit-*` headers are the de facto standard ones. A call too large to ever fit the limit
    (`wait_ms` None) is refused with `x-should-retry: false`: waiting would not help."""

    status = 429
    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, limit: str, wait_ms: int | None,
                 rate_headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.limit = limit  # which: rate_requests | rate_tokens
        self.wait_ms = wait_ms
        self.rate_headers = rate_headers or {}

    def headers(self) -> dict[str, str]:
        if self.wait_ms is None:
            return {"x-should-retry": "false", **self.rate_headers}
        # retry-after in whole seconds (rounded up) for every client, -ms for the Stainless SDKs.
        return {"x-should-retry": "true", "retry-after": str(max(1, -(-self.wait_ms // 1000))),
                "retry-after-ms": str(max(1, self.wait_ms)), **self.rate_headers}


class ServiceError(ProxyError):
    status = 502
    code = "upstream_error"
    retryable = True


class StoreUnavailable(ServiceError):
    status = 503
    code = "ledger_unavailable"


class UpstreamConnectError(ServiceError):
    code = "upstream_unreachable"


class UpstreamTimeout(ServiceError):
    status = 504
    code = "upstream_timeout"


class UpstreamProtocolError(ServiceError):
    code = "upstream_protocol_error"


class UpstreamRedirect(ServiceError):
    """The upstream answered 3xx. Following it would send upstream keys to another address;
    passing it back would let the SDK follow it with the caller's key, past every ceiling."""

    code = "upstream_redirect"
    retryable = False  # the same request gets the same redirect
