"""A refused call's span and metrics as the proxy records them.

The proxy refuses a call before it reaches the upstream (a ceiling, a rate limit, the loop
guard) in proxy/serve/bookkeeping.refused: the call's span, opened when the request
arrived, is ended with the record of a call never forwarded, whose `refusal` is its
reason in the one vocabulary (proxy/serve/pipeline.refusal_reason). `refuse` makes the
same two calls on `tracing.spans` from a real error of proxy/errors.py.
"""

from __future__ import annotations

import time

from proxy.errors import ProxyError
from proxy.model import Call, Caller, CallRecord, Outcome
from proxy.serve.pipeline import refusal_reason
from tracing import spans
from tracing.setup import Telemetry

NO_PEER = spans.Peer("")


def refuse(tel: Telemetry, caller: Caller, call: Call, exc: ProxyError, peer: spans.Peer = NO_PEER,
           lineage: spans.Lineage = spans.NO_LINEAGE, *, start_ns: int | None = None,
           end_ns: int | None = None) -> spans.CallSpan:
    cs = spans.start_call(tel, caller, call, peer, lineage, start_ns=start_ns)
    outcome = Outcome(status=exc.status, error_type=exc.error_type, error_message=exc.message, complete=False)
    record = CallRecord(caller, call, outcome, cs.start_ns, time.time_ns() if end_ns is None else end_ns,
                        forwarded=False, cost_micros=0, refusal=refusal_reason(exc))
    spans.end_call(tel, cs, record)
    return cs
