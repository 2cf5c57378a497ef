"""Finished spans built from a plain record and handed to the span processors directly.

A span we emit is known whole when it ends, so `LeanTracer` decides its identity when it
opens (the tracer's id generator and sampler) and, when it ends, builds the one
`ReadableSpan` the SDK would build and calls the same processors' `on_end` in the same
order, without the SDK's ~20 us of per-span machinery. A span the fast path cannot store
as the SDK would (other value types, over the limits) goes through the SDK's own
BoundedAttributes. What is kept of the SDK and why the rest can go: docs/telemetry.md,
"Lean spans".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Final, Protocol

from opentelemetry import trace
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits
from opentelemetry.sdk.trace import Tracer as SdkTracer
from opentelemetry.sdk.trace.sampling import DEFAULT_ON
from opentelemetry.trace import (
    INVALID_SPAN_CONTEXT,
    Link,
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
)
from opentelemetry.util.types import AttributeValue

from tracing import otel_compat
from tracing.records import Record

__all__ = ["LeanSpan", "LeanTracer", "RecordSink", "RecordTracer", "SdkSpans", "Spans", "spans_for"]

Attrs = dict[str, AttributeValue]

_UNSET: Final = Status(StatusCode.UNSET)
# Values the SDK stores as they are (its cleaning returns them unchanged); anything else
# is cleaned by the SDK's own function.
_KEPT: Final = frozenset({str, int, float, bool})
# (sampled, random trace id) -> the span's flags, as the SDK's tracer sets them.
_FLAGS: Final = {
    (True, False): TraceFlags(TraceFlags.SAMPLED),
    (False, False): TraceFlags(TraceFlags.DEFAULT),
    (True, True): TraceFlags(TraceFlags.SAMPLED | TraceFlags.RANDOM_TRACE_ID),
    (False, True): TraceFlags(TraceFlags.RANDOM_TRACE_ID),
}


def _kept(attrs: Attrs) -> bool:
    """Every value one the SDK stores as it is: a kept type, or a tuple of items of one kept
    type (it drops a tuple that mixes types, and makes any other sequence a tuple)."""
    for value in attrs.values():
        kind = type(value)
        if kind in _KEPT:
            continue
        if kind is not tuple:
            return False
        kinds = set(map(type, value))  # type: ignore[arg-type]
        if len(kinds) > 1 or not kinds <= _KEPT:
            return False
    return True


class LeanSpan(Protocol):
    """An open span, as tracing/spans.py and tracing/mcp.py use it (either path's)."""

    @property
    def context(self) -> SpanContext: ...

    def set_attributes(self, attrs: Mapping[str, AttributeValue]) -> None: ...

    def set_status(self, status: Status) -> None: ...

    def parent_context(self) -> Context: ...


class Spans(Protocol):
    """Opens and ends spans: `LeanTracer`, or `SdkSpans` (the SDK's public API)."""

    def open(self, name: str, parent: SpanContext | None, kind: SpanKind, attributes: Attrs, start_ns: int,
             links: Sequence[Link] = ()) -> LeanSpan: ...

    def end(self, span: LeanSpan, end_ns: int) -> None: ...


class _Lean:
    """An open span: who it is, and its attributes as a plain dict until it ends.
    `attributes` None: a span that records nothing (the sampler dropped it)."""

    __slots__ = ("attributes", "context", "kind", "links", "name", "parent", "recording", "start_ns", "status")

    def __init__(self, name: str, context: SpanContext, parent: SpanContext | None, kind: SpanKind,
                 start_ns: int, attributes: Attrs | None) -> None:
        self.name = name
        self.context = context
        self.parent = parent
        self.kind = kind
        self.start_ns = start_ns
        self.attributes: Attrs = {} if attributes is None else attributes
        self.links: Sequence[Link] = ()
        self.status = _UNSET
        self.recording = attributes is not None  # False once ended, and for spans the sampler dropped

    def set_attributes(self, attrs: Mapping[str, AttributeValue]) -> None:
        if not self.recording:
            return  # as the SDK's: nothing is set on an ended (or unrecorded) span
        mine = self.attributes
        if not mine.keys().isdisjoint(attrs):
            for key in attrs:  # BoundedAttributes moves a key set again to the end
                mine.pop(key, None)
        mine.update(attrs)

    def set_status(self, status: Status) -> None:
        # The SDK keeps OK once set and ignores UNSET; we only ever set ERROR.
        if not self.recording or self.status.status_code is StatusCode.OK or status.status_code is StatusCode.UNSET:
            return
        self.status = status

    def parent_context(self) -> Context:
        """A context holding this span, for child spans and metric exemplars."""
        return trace.set_span_in_context(NonRecordingSpan(self.context), Context())


INVALID: Final[LeanSpan] = _Lean("", INVALID_SPAN_CONTEXT, None, SpanKind.INTERNAL, 0, None)


class LeanTracer:
    """Opens and ends `LeanSpan`s with what `tracer` (an SDK tracer) would use."""

    def __init__(self, sdk: SdkTracer) -> None:
        """`sdk` is a tracer `otel_compat.internals` said yes to."""
        self._sdk = sdk
        self._ids = sdk.id_generator
        self._sampler = sdk.sampler
        self._default_sampler = sdk.sampler is DEFAULT_ON
        self._processor = sdk.span_processor
        self._resource = sdk.resource
        self._scope = otel_compat.scope(sdk)
        self._info = sdk.instrumentation_info
        self._limits: SpanLimits = otel_compat.span_limits(sdk)
        self._max_attributes = self._limits.max_span_attributes
        self._max_length = self._limits.max_attribute_length

    def open(self, name: str, parent: SpanContext | None, kind: SpanKind, attributes: Attrs, start_ns: int,
             links: Sequence[Link] = ()) -> LeanSpan:
        """A span's identity, as `Tracer.start_span(name, parent, kind, attributes, links)` decides it.

        `attributes` is kept (not copied): the caller hands it over."""
        if not otel_compat.tracer_enabled(self._sdk):
            # The SDK's disabled tracer answers with the parent's span, recording nothing.
            return _Lean(name, parent or INVALID_SPAN_CONTEXT, None, kind, start_ns, None)
        if parent is not None and not parent.is_valid:
            parent = None
        trace_id = self._ids.generate_trace_id() if parent is None else parent.trace_id
        if self._default_sampler:
            # ParentBased(ALWAYS_ON): a parent's decision, else sampled; the parent's trace state.
            sampled = parent.trace_flags.sampled if parent is not None else True
            recording = sampled
            trace_state = parent.trace_state if parent is not None else None
        else:
            ctx = trace.set_span_in_context(NonRecordingSpan(parent), Context()) if parent else Context()
            result = self._sampler.should_sample(ctx, trace_id, name, kind, attributes, links)
            sampled = result.decision.is_sampled()  # type: ignore[no-untyped-call]
            recording = result.decision.is_recording()  # type: ignore[no-untyped-call]
            trace_state = result.trace_state
            attributes = dict(result.attributes) if result.attributes else {}
        random = self._ids.is_trace_id_random() if parent is None else parent.trace_flags.random_trace_id
        flags = _FLAGS[sampled, bool(random)]
        context = SpanContext(trace_id, self._ids.generate_span_id(), is_remote=False, trace_flags=flags,
                              trace_state=trace_state)
        span = _Lean(name, context, parent, kind, start_ns, attributes if recording else None)
        if recording and links:
            span.links = self._links(links)
        return span

    def end(self, span: LeanSpan, end_ns: int) -> None:
        """Finish `span` and hand it to the span processors, once."""
        assert isinstance(span, _Lean)  # opened here
        if not span.recording:
            return
        span.recording = False
        readable = ReadableSpan(
            name=span.name,
            context=span.context,
            parent=span.parent,
            resource=self._resource,
            attributes=self._attributes(span.attributes),
            links=span.links,
            kind=span.kind,
            status=span.status,
            start_time=span.start_ns,
            end_time=end_ns,
            instrumentation_info=self._info,
            instrumentation_scope=self._scope,
        )
        self._processor.on_end(readable)

    def _attributes(self, attrs: Attrs) -> Attrs | BoundedAttributes:
        limit = self._max_attributes
        if self._max_length is None and (limit is None or len(attrs) <= limit) and _kept(attrs):
            return attrs  # the SDK's cleaning would return every value unchanged
        # Anything else is cleaned, bounded and stored by the SDK's own class, as its span does.
        return BoundedAttributes(limit, attrs, immutable=True, max_value_len=self._max_length)

    def _links(self, links: Sequence[Link]) -> Sequence[Link]:
        # As `_Span._new_links`: valid links only, their attributes bounded, at most max_links.
        from opentelemetry.sdk.util import BoundedList

        kept = [link for link in links if otel_compat.bound_link(link, self._limits)]
        return BoundedList.from_seq(self._limits.max_links, kept)


class RecordSink(Protocol):
    """Takes finished span records: tracing/export_process.py's `ExportProcessProcessor`."""

    def on_record(self, record: Record) -> None: ...


class RecordTracer(LeanTracer):
    """`LeanTracer` whose spans end as one flat record handed to `sink`, the export child's
    hand-off, instead of a `ReadableSpan` handed to the span processors: the record is what
    crossed the pipe anyway, and the child encodes OTLP from it (tracing/otlp_wire.py
    `RecordEncoder`). Used only where nothing else reads a `ReadableSpan` (`spans_for`);
    a span whose attributes the SDK would clean or bound still ends as the SDK's."""

    def __init__(self, sdk: SdkTracer, sink: RecordSink) -> None:
        super().__init__(sdk)
        self._sink = sink
        scope = self._scope
        self._scope_key = (scope.name, scope.version, scope.schema_url)

    def end(self, span: LeanSpan, end_ns: int) -> None:
        assert isinstance(span, _Lean)  # opened here
        attrs = span.attributes
        if not span.recording:
            return
        limit = self._max_attributes
        if (limit is not None and len(attrs) > limit) or not _kept(attrs):
            super().end(span, end_ns)  # the SDK's BoundedAttributes, then a ReadableSpan as before
            return
        span.recording = False
        ctx, parent, status = span.context, span.parent, span.status
        state = ctx.trace_state
        links = tuple(
            (ln.context.trace_id, ln.context.span_id, int(ln.context.trace_flags), ln.context.is_remote,
             tuple(ln.context.trace_state.items()) or None, dict(ln.attributes or {}))
            for ln in span.links) if span.links else ()  # fmt: skip
        self._sink.on_record((
            span.name, ctx.trace_id, ctx.span_id, int(ctx.trace_flags), tuple(state.items()) if state else None,
            parent.span_id if parent else None, parent.is_remote if parent else False,
            span.kind.value, span.start_ns, end_ns, attrs,
            status.status_code.value, status.description, (), links, self._scope_key,
        ))  # fmt: skip


def records_fit(tracer: SdkTracer) -> bool:
    """Can `tracer`'s spans end as records? With the default sampler and no value-length
    limit: what a record carries is then what the SDK's span would hold."""
    return tracer.sampler is DEFAULT_ON and otel_compat.span_limits(tracer).max_attribute_length is None


class _SdkSpan:
    """The SDK's own span behind the `LeanSpan` interface."""

    __slots__ = ("context", "span")

    def __init__(self, span: trace.Span) -> None:
        self.span = span
        self.context = span.get_span_context()

    def set_attributes(self, attrs: Mapping[str, AttributeValue]) -> None:
        self.span.set_attributes(attrs)

    def set_status(self, status: Status) -> None:
        self.span.set_status(status)

    def parent_context(self) -> Context:
        return trace.set_span_in_context(NonRecordingSpan(self.context), Context())


class SdkSpans:
    """The public path: every span started, filled and ended by the SDK's tracer."""

    def __init__(self, tracer: trace.Tracer) -> None:
        self._tracer = tracer

    def open(self, name: str, parent: SpanContext | None, kind: SpanKind, attributes: Attrs, start_ns: int,
             links: Sequence[Link] = ()) -> LeanSpan:
        ctx = trace.set_span_in_context(NonRecordingSpan(parent), Context()) if parent else Context()
        return _SdkSpan(self._tracer.start_span(name, context=ctx, kind=kind, attributes=attributes,
                                                links=links or None, start_time=start_ns))

    def end(self, span: LeanSpan, end_ns: int) -> None:
        assert isinstance(span, _SdkSpan)  # opened here
        span.span.end(end_time=end_ns)


def spans_for(tracer: trace.Tracer, records: RecordSink | None = None) -> Spans:
    """The lean path when `tracer`'s internals are as tracing/otel_compat.py expects (and it
    is not turned off), else the SDK's public API. With `records` (the export child's
    hand-off, when it is the only span processor), spans end as records there when the
    tracer's sampler and limits allow it (`records_fit`)."""
    if isinstance(tracer, SdkTracer) and otel_compat.internals(tracer):
        if records is not None and records_fit(tracer):
            return RecordTracer(tracer, records)
        return LeanTracer(tracer)
    return SdkSpans(tracer)
