"""Every private name of opentelemetry-sdk that spanmeter reads, in one place, checked once.

The lean span path (tracing/lean.py) and the OTLP exporter that writes its bytes with
tracing/otlp_wire.py read what the SDK keeps to itself; each such name is read here alone,
probed on the objects at hand (`internals`, `exporter_moved`), with the public path as the
fallback when a release moved it or SPANMETER_OTEL_INTERNALS=off.
The names, and what happens when one moves: docs/telemetry.md, "The SDK's private names".
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import os
import zlib
from collections.abc import Mapping, Sequence
from typing import Any, Final

from opentelemetry.attributes import BoundedAttributes
from opentelemetry.sdk import trace as sdk_trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits
from opentelemetry.sdk.trace import Tracer as SdkTracer
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext

from tracing import otlp_wire
from tracing.records import decode_span

__all__ = ["ENV", "bound_link", "exporter_moved", "forced_public", "gzip_bytes", "internals", "otlp_span_exporter",
           "scope", "span_limits", "tracer_enabled"]

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


def _say_once(gone: list[str], package: str = "opentelemetry-sdk",
              instead: str = "spans are built through the SDK's public API instead (correct, ~2x the tracing CPU)",
              ) -> None:
    key = ", ".join(gone)
    if key in _warned:
        return
    _warned.add(key)
    log.warning("%s %s: %s moved or changed shape; %s. Pin %s to the range pyproject.toml allows, or report it",
                package, _version(package), key, instead, package)


def _version(package: str = "opentelemetry-sdk") -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "(version unknown)"


# --- the OTLP span exporter, its batches written by tracing/otlp_wire.py -----------------


def otlp_span_exporter(endpoint: str, timeout: float, compression: Any,
                       environ: Mapping[str, str] | None = None, gzip_level: int | None = None) -> SpanExporter:
    """An OTLP/HTTP span exporter for `endpoint`: the one that encodes with
    tracing/otlp_wire.py when the exporter's internals are as expected, else as shipped.
    `gzip_level` (1-9): the level its gzip compresses at; None, the client's (9)."""
    from opentelemetry.exporter.otlp.proto.http import Compression
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    if forced_public(environ):
        return OTLPSpanExporter(endpoint=endpoint, timeout=timeout, compression=compression)
    exporter: SpanExporter = _wire_exporter_class()(endpoint=endpoint, timeout=timeout, compression=compression)
    gone = exporter_moved(exporter)
    if gone:
        _say_once(gone, "opentelemetry-exporter-otlp-proto-http",
                  "span batches are encoded by the exporter's own encoder instead (correct, more CPU per span)")
        exporter.wire = False  # type: ignore[attr-defined]
    elif gzip_level is not None and compression == Compression.Gzip:
        if callable(getattr(exporter._client, "_compress", None)):  # type: ignore[attr-defined]
            exporter._client._compress = functools.partial(gzip_bytes, level=gzip_level)  # type: ignore[attr-defined]
        else:
            _say_once(["OTLPSpanExporter._client._compress"], "opentelemetry-exporter-otlp-proto-http",
                      "span batches are gzipped at the exporter's own level (correct, more CPU per span)")
    return exporter


def gzip_bytes(data: bytes, level: int) -> bytes:
    """`data` as one gzip member, as the client's GzipFile writes it but for the level (and
    a zero mtime): one zlib call, without GzipFile's Python layers."""
    return zlib.compress(data, level, wbits=31)


def exporter_moved(exporter: Any) -> list[str]:
    """The private names `WireExporter.export` reads that `exporter` lacks or keeps in
    another shape; empty when all are as expected."""
    gone = []
    if not callable(getattr(getattr(exporter, "_client", None), "export", None)):
        gone.append("OTLPSpanExporter._client.export")
    if not isinstance(getattr(exporter, "_shutdown", None), bool):
        gone.append("OTLPSpanExporter._shutdown")
    if not callable(getattr(getattr(exporter, "_metrics", None), "export_operation", None)):
        gone.append("OTLPSpanExporter._metrics.export_operation")
    if not isinstance(getattr(exporter, "_max_request_size", None), int):
        gone.append("OTLPSpanExporter._max_request_size")
    return gone


@functools.cache
def _wire_exporter_class() -> Any:
    # Made on first use: the exporter package is imported only where spans go over OTLP.
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.semconv.attributes.http_attributes import HTTP_RESPONSE_STATUS_CODE

    class WireExporter(OTLPSpanExporter):
        """`OTLPSpanExporter` whose batches are written by tracing/otlp_wire.py; anything
        that encoder refuses, a batch over the size limit, or a shut-down exporter goes
        through the exporter's own `export`, which logs and fails as it always does."""

        wire = True
        _held_encoder: tuple[Resource, otlp_wire.RecordEncoder] | None = None  # the child's one resource

        @property
        def records(self) -> bool:
            """Does `export_records` write the batches itself? (Else it decodes them first.)"""
            return self.wire

        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            if not self.wire or self._shutdown or not spans:
                return super().export(spans)
            try:
                data = otlp_wire.encode_spans(spans)
            except Exception:  # NotEncodable, or ids or times out of their range: as shipped
                return super().export(spans)
            if 0 < self._max_request_size < len(data):
                return super().export(spans)  # its warning and its error, as shipped
            return self._send(data, len(spans))

        def encode_record(self, record: Sequence[Any], resource: Resource) -> Any:
            """A span record (tracing/records.py) of `resource` written as its Span field
            (otlp_wire's `RecordEncoder.span`), or the record as it is when the encoder
            refuses it (or the exporter is as shipped): `export_records` takes either."""
            if not self.wire:
                return record
            try:
                return self._encoder(resource).span(record)
            except Exception:  # NotEncodable, or ids or times out of their range: as in `export`
                return record

        def export_records(self, items: Sequence[Any], resource: Resource) -> SpanExportResult:
            """What `encode_record` gave, as one request of the written spans; records it
            could not write go as `export` sends the spans they decode to."""
            written = [i for i in items if type(i[1]) is bytes]
            plain = [decode_span(i, resource) for i in items if type(i[1]) is not bytes]
            result = SpanExportResult.SUCCESS
            if written:
                data = self._encoder(resource).request(written)
                if self._shutdown or 0 < self._max_request_size < len(data):
                    log.warning("Dropping span batch of %d: %s", len(written),
                                "exporter shut down" if self._shutdown else
                                f"serialized size {len(data)} bytes exceeds max_request_size {self._max_request_size}")
                    result = SpanExportResult.FAILURE
                else:
                    result = self._send(data, len(written))
            if plain and super().export(plain) is not SpanExportResult.SUCCESS:
                result = SpanExportResult.FAILURE
            return result

        def _encoder(self, resource: Resource) -> otlp_wire.RecordEncoder:
            held = self._held_encoder
            if held is None or held[0] is not resource:
                held = self._held_encoder = (resource, otlp_wire.RecordEncoder(resource))
            return held[1]

        def _send(self, data: bytes, n: int) -> SpanExportResult:
            with self._metrics.export_operation(n) as result:
                sent = self._client.export(data)
                if not sent.success:
                    result.error = sent.error
                    result.error_attrs = (
                        {HTTP_RESPONSE_STATUS_CODE: sent.status_code} if sent.status_code is not None else None)
                    return SpanExportResult.FAILURE
            return SpanExportResult.SUCCESS

    return WireExporter


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

