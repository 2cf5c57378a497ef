"""The W3C `traceparent` header: the one parser of it (stdlib only).

Both the run id (`proxy.serve.tenants`, a run named by the agent's trace) and the span
parenting (`tracing.spans`) read the header through `parse_traceparent`, so a run is
never named after a context the tracer rejects.

The rules (W3C Trace Context, section 3.2 and "Versioning of traceparent"):

    traceparent = version "-" trace-id "-" parent-id "-" trace-flags
    version     = 2 HEXDIGLC, not "ff"
    trace-id    = 32 HEXDIGLC, not all zeros
    parent-id   = 16 HEXDIGLC, not all zeros
    trace-flags = 2 HEXDIGLC; bit 0 is `sampled`

Hex is lowercase only (an upper-case id is invalid and the header is ignored). Version
"00" has exactly these four fields; a higher version may append "-" and more fields,
which are ignored. Spaces and tabs around the value are optional whitespace.
"""

from __future__ import annotations

import re

from proxy.model import frozen

__all__ = ["TraceParent", "parse_traceparent"]

_HEADER = re.compile(r"[ \t]*([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-[^ \t]*)?[ \t]*")


@frozen
class TraceParent:
    """An incoming W3C trace context."""

    trace_id: int
    span_id: int
    sampled: bool = True
    tracestate: str | None = None

    @property
    def trace_id_hex(self) -> str:
        return f"{self.trace_id:032x}"


def parse_traceparent(header: str | None, tracestate: str | None = None) -> TraceParent | None:
    """The context the header carries, or None when it is absent or invalid (then ignored)."""
    m = _HEADER.fullmatch(header or "")
    if m is None:
        return None
    version, trace_hex, span_hex, flags, rest = m.groups()
    if version == "ff" or (version == "00" and rest is not None):
        return None
    trace_id, span_id = int(trace_hex, 16), int(span_hex, 16)
    if trace_id == 0 or span_id == 0:
        return None
    return TraceParent(trace_id, span_id, bool(int(flags, 16) & 1), tracestate)
