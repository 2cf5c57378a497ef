"""Every private name of opentelemetry-sdk that spanmeter reads, in one place, checked once.

The lean span path (tracing/lean.py) builds the `ReadableSpan` the SDK's tracer would build
without the SDK's per-span machinery; for that it reads what the tracer keeps to itself:

    Tracer._instrumentation_scope, Tracer._span_limits, Tracer._is_enabled()
    opentelemetry.sdk.trace._is_valid_link, Link._attributes (set: bounded, as the SDK does)


`internals(tracer)` probes all of them on the objects at hand: a name missing, or of
another shape than the code expects (a release that moved it), is logged once at WARNING
with the SDK's version, and the caller takes the public path (`Tracer.start_span`,
tracing/lean.py `SdkSpans`), which costs more CPU but is the same on the wire.
SPANMETER_OTEL_INTERNALS=off takes the public path without asking (tests, the bench).
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
from collections.abc import Mapping
from typing import Any, Final

from opentelemetry.attributes import BoundedAttributes
from opentelemetry.sdk import trace as sdk_trace
from opentelemetry.sdk.trace import SpanLimits
from opentelemetry.sdk.trace import Tracer as SdkTracer
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext

__all__ = ["ENV", "bound_link", "forced_public", "internals", "scope", "span_limits", "tracer_enabled"]

log = logging.getLogger(__name__)

ENV: Final = "SPANMETER_OTEL_INTERNALS"  # off: the SDK's public API only
_warned: set[str] = set()  # what moved, said once a process


def forced_public(environ: Mapping[str, str] | None = None) -> bool:
    env = os.environ if environ is None else environ
    return (env.get(ENV) or "").strip().lower() in ("off", "false", "0", "no")


def internals(tracer: Any, environ: Mapping[str, str] | None = None) -> bool:
    """May the lean path read `tracer`'s internals? False when forced off, when `tracer` is
    not the SDK's, or when a name moved (logged once)."""
    if forced_public(environ) or not isinstance(tracer, SdkTracer):
        return False
    gone = moved(tracer)
    if gone:
        _say_once(gone)
        return False
    return True


def moved(tracer: SdkTracer) -> list[str]:
    """The private names this module reads that `tracer` (and its SDK) lack or keep in
    another shape; empty when all are as expected."""
    gone: list[str] = []
    if not isinstance(getattr(tracer, "_instrumentation_scope", None), InstrumentationScope):
        gone.append("Tracer._instrumentation_scope")
    limits = getattr(tracer, "_span_limits", None)
    if not isinstance(limits, SpanLimits) or not all(
        hasattr(limits, n) for n in ("max_span_attributes", "max_attribute_length", "max_links", "max_link_attributes")
    ):
        gone.append("Tracer._span_limits")
    if not callable(getattr(tracer, "_is_enabled", None)):
        gone.append("Tracer._is_enabled")
    if not callable(getattr(sdk_trace, "_is_valid_link", None)):
        gone.append("opentelemetry.sdk.trace._is_valid_link")
    link = Link(SpanContext(1, 1, False), {"k": "v"})
    if not isinstance(getattr(link, "_attributes", None), Mapping):
        gone.append("Link._attributes")
    return gone


def _say_once(gone: list[str]) -> None:
    key = ", ".join(gone)
    if key in _warned:
        return
    _warned.add(key)
    log.warning("opentelemetry-sdk %s: %s moved or changed shape; spans are built through the SDK's public API "
                "instead (correct, ~2x the tracing CPU). Pin opentelemetry-sdk to the range pyproject.toml allows, "
                "or report it", _version(), key)


def _version() -> str:
    try:
        return importlib.metadata.version("opentelemetry-sdk")
    except importlib.metadata.PackageNotFoundError:
        return "(version unknown)"


# --- the private reads, for tracing/lean.py (only after `internals` said yes) ------------


def scope(tracer: SdkTracer) -> InstrumentationScope:
    return tracer._instrumentation_scope


def span_limits(tracer: SdkTracer) -> SpanLimits:
    return tracer._span_limits


def tracer_enabled(tracer: SdkTracer) -> bool:
    return bool(tracer._is_enabled())


def bound_link(link: Link, limits: SpanLimits) -> bool:
    """Keep `link` as `_Span._new_links` does: valid only, its attributes bounded. False
    when the SDK would drop it."""
    if not (link and sdk_trace._is_valid_link(link.context, link.attributes)):
        return False
    link._attributes = BoundedAttributes(
        limits.max_link_attributes, link.attributes, max_value_len=limits.max_attribute_length, immutable=True)
    return True

