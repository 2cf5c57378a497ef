"""Finished spans as an OTLP `ExportTraceServiceRequest`, written straight to protobuf bytes.

The exporter's own encoder (`opentelemetry.exporter.otlp.proto.common.trace_encoder
.encode_spans`) builds a protobuf object per span, per attribute and per value, and
serializes the tree: ~130-240 us a call span on the bench machine, most of the export
child's CPU (bench/bench_export.py). The wire format of the few messages a span batch
uses is small and fixed (opentelemetry-proto, `trace/v1/trace.proto`,
`common/v1/common.proto`, `resource/v1/resource.proto`), so this writes it directly, field
for field as that encoder fills them: the same fields set, in field-number order, the
same groups (by resource, then by instrumentation scope, in the order first seen).
tests/tracing/test_otlp_wire.py holds it byte for byte to the exporter's encoder.

What it does not write, it refuses (`NotEncodable`) and the caller uses the exporter's
encoder for that batch: an attribute value other than str, bool, int, float, bytes or a
tuple/list of them (the SDK cleans our spans' values to these; a mapping or None would be
rare); an int outside int64, or a string that is not valid UTF-8 (the exporter's
encoder drops such an attribute and logs it; the batch goes through it, so it still does).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext

__all__ = ["NotEncodable", "RecordEncoder", "encode_spans"]

_DOUBLE: Final = struct.Struct("<d").pack
_FIXED64: Final = struct.Struct("<Q").pack
_FIXED32: Final = struct.Struct("<I").pack
_INT64_MIN: Final = -(1 << 63)
_INT64_MAX: Final = (1 << 63) - 1
_U64: Final = (1 << 64) - 1

# Span flags: the parent's is-remote bit is known (always), and set when the parent is remote.
_HAS_IS_REMOTE: Final = 0x100
_IS_REMOTE: Final = 0x200


class NotEncodable(ValueError):
    """A batch this module does not write: the exporter's own encoder takes it."""


def _varint(n: int) -> bytes:
    if n < 0x80:
        return _SMALL[n]
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_SMALL: Final = [bytes((i,)) for i in range(0x80)]


def _field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field: its tag byte(s), the length, the payload."""
    n = len(payload)
    return tag + (_SMALL[n] if n < 0x80 else _varint(n)) + payload


# --- values (common.proto: AnyValue, KeyValue) --------------------------------------------

_KEYS: dict[str, bytes] = {}  # attribute key -> its KeyValue.key field, encoded once
_KEYS_MAX: Final = 4096


def _key(key: str) -> bytes:
    done = _KEYS.get(key)
    if done is None:
        done = _field(b"\x0a", _utf8(key)) if key else b""  # proto3 leaves an empty string out
        if len(_KEYS) < _KEYS_MAX:
            _KEYS[key] = done
    return done


def _utf8(text: str) -> bytes:
    try:
        return text.encode()
    except UnicodeEncodeError as exc:  # a lone surrogate: the exporter drops the attribute and logs
        raise NotEncodable("a string that is not valid UTF-8") from exc


def _value(value: Any) -> bytes:
    """AnyValue's fields for `value`, in the exporter encoder's order of type checks."""
    kind = type(value)
    if kind is str:
        return _field(b"\x0a", _utf8(value))
    if kind is bool:
        return b"\x10\x01" if value else b"\x10\x00"
    if kind is int:
        if not _INT64_MIN <= value <= _INT64_MAX:
            raise NotEncodable("an int outside int64")
        return b"\x18" + _varint(value & _U64)
    if kind is float:
        return b"\x21" + _DOUBLE(value)
    if kind is bytes:
        return _field(b"\x3a", value)
    if kind is tuple or kind is list:
        return _field(b"\x2a", b"".join([_field(b"\x0a", _value(v)) for v in value]))
    raise NotEncodable(f"an attribute value of type {kind.__name__}")


def _pair(tag: bytes, key: str, value: Any) -> bytes:
    """One attribute: a KeyValue field under `tag`."""
    return _field(tag, _key(key) + _field(b"\x12", _value(value)))


def _attributes(tag: bytes, attributes: Mapping[str, Any] | None) -> Iterable[bytes]:
    if not attributes:
        return ()
    return [_pair(tag, k, v) for k, v in attributes.items()]


# A span attribute's whole field, for the values that come again: a call span's model,
# operation, provider, address, tenant, finish reason and the like (~half of its ~25
# values) are the same from call to call, and each costs five small encodings. Kept per
# key for short strings and ints, up to _VALUES_PER_KEY values; a key with more (ids,
# digests, token counts) is left to the plain path from then on. The keys are spanmeter's
# own attribute names (~150; _KEYS_MAX bounds them anyway), so what is kept stays under a
# few MB even when every key fills up.
_PAIRS: dict[str, dict[str | int, bytes]] = {}
_VARIED: set[str] = set()
_VALUES_PER_KEY: Final = 64
_SHORT: Final = 128


def _span_attributes(attributes: Mapping[str, Any] | None) -> list[bytes]:
    if not attributes:
        return []
    out = []
    for k, v in attributes.items():
        kind = type(v)
        if (kind is int or (kind is str and len(v) <= _SHORT)) and k not in _VARIED:
            values = _PAIRS.get(k)
            if values is None and len(_PAIRS) < _KEYS_MAX:
                values = _PAIRS[k] = {}
            if values is not None:
                done = values.get(v)
                if done is None:
                    done = _pair(b"\x4a", k, v)
                    if len(values) < _VALUES_PER_KEY:
                        values[v] = done
                    else:
                        _VARIED.add(k)
                        _PAIRS.pop(k, None)
                out.append(done)
                continue
        out.append(_pair(b"\x4a", k, v))
    return out


def _count(tag: bytes, n: int) -> bytes:
    return tag + _varint(n) if n else b""


def _text(tag: bytes, text: str | None) -> bytes:
    return _field(tag, _utf8(text)) if text else b""


# --- spans (trace.proto) -------------------------------------------------------------------


def _flags(parent: SpanContext | None) -> bytes:
    return _FIXED32(_HAS_IS_REMOTE | _IS_REMOTE if parent is not None and parent.is_remote else _HAS_IS_REMOTE)


def _span(span: ReadableSpan) -> bytes:
    ctx = span.context
    assert ctx is not None  # a finished SDK span has one
    parts = [b"\x0a\x10" + ctx.trace_id.to_bytes(16, "big"), b"\x12\x08" + ctx.span_id.to_bytes(8, "big")]
    if ctx.trace_state is not None:
        parts.append(_text(b"\x1a", ",".join([f"{k}={v}" for k, v in ctx.trace_state.items()])))
    parent = span.parent
    if parent:
        parts.append(b"\x22\x08" + parent.span_id.to_bytes(8, "big"))
    parts.append(_text(b"\x2a", span.name))
    parts.append(b"\x30" + _varint(span.kind.value + 1))  # the API's INTERNAL is 0, the proto's 1
    if span.start_time:
        parts.append(b"\x39" + _FIXED64(span.start_time))
    if span.end_time:
        parts.append(b"\x41" + _FIXED64(span.end_time))
    parts.extend(_span_attributes(span.attributes))
    parts.append(_count(b"\x50", span.dropped_attributes))
    for event in span.events:
        parts.append(_event(event.name, event.timestamp, event.attributes, event.dropped_attributes))
    parts.append(_count(b"\x60", span.dropped_events))
    for link in span.links:
        body = b"\x0a\x10" + link.context.trace_id.to_bytes(16, "big") + b"\x12\x08" + link.context.span_id.to_bytes(
            8, "big")
        body += b"".join(_attributes(b"\x22", link.attributes)) + _count(b"\x28", link.dropped_attributes)
        parts.append(_field(b"\x6a", body + b"\x35" + _flags(link.context)))
    parts.append(_count(b"\x70", span.dropped_links))
    status = span.status
    parts.append(_field(b"\x7a", _text(b"\x12", status.description) + _count(b"\x18", status.status_code.value)))
    parts.append(b"\x85\x01" + _flags(parent))
    return b"".join(parts)


def _event(name: str, timestamp: int | None, attributes: Mapping[str, Any] | None, dropped: int) -> bytes:
    body = (b"\x09" + _FIXED64(timestamp) if timestamp else b"") + _text(b"\x12", name)
    body += b"".join(_attributes(b"\x1a", attributes)) + _count(b"\x20", dropped)
    return _field(b"\x5a", body)


def _scope(scope: InstrumentationScope | None) -> bytes:
    if scope is None:
        return b""
    return _text(b"\x0a", scope.name) + _text(b"\x12", scope.version) + b"".join(
        _attributes(b"\x1a", scope.attributes))


def encode_spans(spans: Sequence[ReadableSpan]) -> bytes:
    """The serialized `ExportTraceServiceRequest` the exporter would send for `spans`.
    Raises NotEncodable for a batch it leaves to the exporter's encoder."""
    # Grouped as the exporter groups them: by resource, then scope (dict keys: equal ones
    # merge), in first-seen order. Hashing a Resource serializes it, so each distinct
    # object is looked up once.
    groups: dict[Resource, dict[InstrumentationScope | None, list[bytes]]] = {}
    seen: dict[int, dict[InstrumentationScope | None, list[bytes]]] = {}
    for span in spans:
        resource = span.resource
        by_scope = seen.get(id(resource))
        if by_scope is None:
            by_scope = seen[id(resource)] = groups.setdefault(resource, {})
        by_scope.setdefault(span.instrumentation_scope or None, []).append(_field(b"\x12", _span(span)))
    out = []
    for resource, by_scope in groups.items():
        body = [_field(b"\x0a", b"".join(_attributes(b"\x0a", resource.attributes)))]
        for scope, encoded in by_scope.items():
            schema = scope.schema_url if scope is not None else None
            body.append(_field(b"\x12", _field(b"\x0a", _scope(scope)) + b"".join(encoded) + _text(b"\x1a", schema)))
        body.append(_text(b"\x1a", resource.schema_url))
        out.append(_field(b"\x0a", b"".join(body)))
    return b"".join(out)


# --- span records (tracing/export_process.py `encode_span`: the tuple one span travels as) --

_REMOTE_FLAGS: Final = {remote: b"\x85\x01" + _FIXED32(_HAS_IS_REMOTE | (_IS_REMOTE if remote else 0))
                        for remote in (False, True)}
_LINK_FLAGS: Final = {remote: b"\x35" + _FIXED32(_HAS_IS_REMOTE | (_IS_REMOTE if remote else 0))
                      for remote in (False, True)}
_KINDS: Final = [b"\x30" + _varint(k + 1) for k in range(5)]  # the API's SpanKind values 0-4
_UNSET_STATUS: Final = _field(b"\x7a", b"")
_ERROR: Final = 2  # StatusCode.ERROR: the only code whose description the API keeps


def _record(rec: Sequence[Any]) -> bytes:
    """One span record's Span message: the bytes `_span` writes for the ReadableSpan the
    record decodes to (`decode_span`), read from the tuple's fields."""
    (name, trace_id, span_id, _, state, parent_id, parent_remote, kind, start, end, attributes,
     code, description, events, links, _) = rec  # fmt: skip
    parts = [b"\x0a\x10" + trace_id.to_bytes(16, "big"), b"\x12\x08" + span_id.to_bytes(8, "big")]
    if state:
        parts.append(_text(b"\x1a", ",".join([f"{k}={v}" for k, v in state])))
    if parent_id is not None:
        parts.append(b"\x22\x08" + parent_id.to_bytes(8, "big"))
    parts.append(_text(b"\x2a", name))
    parts.append(_KINDS[kind])
    if start:
        parts.append(b"\x39" + _FIXED64(start))
    if end:
        parts.append(b"\x41" + _FIXED64(end))
    parts.extend(_span_attributes(attributes))
    for event_name, timestamp, event_attributes in events:
        parts.append(_event(event_name, timestamp, event_attributes, 0))
    for link_trace, link_span, _link_flags, link_remote, _link_state, link_attributes in links:
        body = b"\x0a\x10" + link_trace.to_bytes(16, "big") + b"\x12\x08" + link_span.to_bytes(8, "big")
        parts.append(_field(b"\x6a", body + b"".join(_attributes(b"\x22", link_attributes)) + _LINK_FLAGS[link_remote]))
    if code:
        parts.append(_field(b"\x7a", _text(b"\x12", description if code == _ERROR else None) + _count(b"\x18", code)))
    else:
        parts.append(_UNSET_STATUS)
    parts.append(_REMOTE_FLAGS[bool(parent_remote)])
    return b"".join(parts)


Scope = tuple[str, "str | None", "str | None"]


class RecordEncoder:
    """Span records of one resource as the `ExportTraceServiceRequest` `encode_spans` writes
    for the ReadableSpans they decode to. Each span is written once, as it comes (`span`),
    and a batch of written spans is wrapped into a request (`request`); what never changes
    from batch to batch, the resource's attributes and each scope's fields, is written once."""

    def __init__(self, resource: Resource) -> None:
        self._resource = _field(b"\x0a", b"".join(_attributes(b"\x0a", resource.attributes)))
        self._resource_schema = _text(b"\x1a", resource.schema_url)
        self._scopes: dict[Scope, tuple[bytes, bytes]] = {}

    def span(self, record: Sequence[Any]) -> tuple[Scope, bytes]:
        """One record's scope and its Span field. Raises NotEncodable as `encode_spans` does,
        for a value it leaves to the exporter's encoder (and OverflowError for an id out of range)."""
        return record[15], _field(b"\x12", _record(record))

    def request(self, spans: Sequence[tuple[Scope, bytes]]) -> bytes:
        """The request of spans `span` wrote, grouped by scope in first-seen order."""
        by_scope: dict[Scope, list[bytes]] = {}
        for scope, encoded in spans:
            by_scope.setdefault(scope, []).append(encoded)
        # The nested messages' lengths are summed, not written by wrapping: the batch's spans
        # are copied once, into the request (a 512-span batch is ~0.5 MB).
        parts = [self._resource]
        for scope, fields in by_scope.items():
            head, schema = self._scope(scope)
            parts += (b"\x12", _varint(len(head) + sum(map(len, fields)) + len(schema)), head, *fields, schema)
        parts.append(self._resource_schema)
        return b"".join([b"\x0a", _varint(sum(map(len, parts))), *parts])

    def encode(self, records: Sequence[Sequence[Any]]) -> bytes:
        return self.request([self.span(r) for r in records])

    def _scope(self, scope: Scope) -> tuple[bytes, bytes]:
        done = self._scopes.get(scope)
        if done is None:
            name, version, schema = scope
            done = self._scopes[scope] = (_field(b"\x0a", _text(b"\x0a", name) + _text(b"\x12", version)),
                                          _text(b"\x1a", schema))
        return done
