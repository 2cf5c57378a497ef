"""One finished span as one flat record: the tuple a span crosses the export pipe as.

    (name, trace id, span id, flags, trace state pairs or None, parent span id or None,
     parent is remote, kind value, start, end, attributes, status code value, description,
     events ((name, timestamp, attributes), ...),
     links ((trace id, span id, flags, is remote, trace state pairs or None, attributes), ...),
     scope (name, version, schema url))

tracing/lean.py `RecordTracer` builds it when a span ends; `encode_span` makes it of any
`ReadableSpan` (the SDK tracer's own spans); the export child encodes OTLP from it
(tracing/otlp_wire.py `RecordEncoder`) or, for the exporters that need one, makes a
`ReadableSpan` of it again (`decode_span`). Plain ints, strings, tuples and dicts: pickled
as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState

__all__ = ["Record", "decode_span", "encode_span"]

Record = tuple[Any, ...]


def encode_span(span: ReadableSpan, scopes: dict[int, tuple[str, str | None, str | None]]) -> tuple[Any, ...]:
    """A finished span as plain data (ints, strings, tuples, dicts)."""
    ctx = span.context
    assert ctx is not None
    parent = span.parent
    scope = span.instrumentation_scope
    key = id(scope)
    scoped = scopes.get(key)
    if scoped is None:
        scoped = scopes[key] = (scope.name, scope.version, scope.schema_url) if scope else ("", None, None)
    events = tuple((e.name, e.timestamp, dict(e.attributes or {})) for e in span.events) if span.events else ()
    links = tuple(
        (ln.context.trace_id, ln.context.span_id, int(ln.context.trace_flags), ln.context.is_remote,
         _state(ln.context.trace_state), dict(ln.attributes or {}))
        for ln in span.links
    ) if span.links else ()
    status = span.status
    return (
        span.name, ctx.trace_id, ctx.span_id, int(ctx.trace_flags), _state(ctx.trace_state),
        parent.span_id if parent else None, parent.is_remote if parent else False,
        span.kind.value, span.start_time, span.end_time, _attributes(span),
        status.status_code.value, status.description, events, links, scoped,
    )  # fmt: skip


def _attributes(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})  # a lean span's: a plain dict's copy, at C speed


def _state(state: Any) -> tuple[tuple[str, str], ...] | None:
    return tuple(state.items()) if state else None


_SCOPES: dict[tuple[str, str | None, str | None], InstrumentationScope] = {}


def decode_span(data: Sequence[Any], resource: Any) -> ReadableSpan:
    """The child's side of `encode_span`: a ReadableSpan the SDK's exporters take."""
    (name, trace_id, span_id, flags, state, parent_id, parent_remote, kind, start, end, attributes,
     code, description, events, links, scope) = data  # fmt: skip
    context = SpanContext(trace_id, span_id, False, TraceFlags(flags), TraceState(state) if state else None)
    parent = SpanContext(trace_id, parent_id, parent_remote, TraceFlags(flags)) if parent_id is not None else None
    return ReadableSpan(
        name=name,
        context=context,
        parent=parent,
        resource=resource,
        attributes=attributes,
        events=[Event(n, a, ts) for n, ts, a in events],
        links=[Link(SpanContext(t, s, r, TraceFlags(f), TraceState(st) if st else None), a)
               for t, s, f, r, st, a in links],
        kind=SpanKind(kind),
        status=Status(StatusCode(code), description),
        start_time=start,
        end_time=end,
        instrumentation_scope=_SCOPES.get(scope) or _SCOPES.setdefault(scope, InstrumentationScope(*scope)),
    )
