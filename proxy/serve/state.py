"""One model call's state once it is answered: its request, admission and answer parts,
typed and built once, by the handler, for the call's bookkeeping (proxy/serve/bookkeeping.py).

The content-capture decision (the process's OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT
and the tenant's `capture_content`) is made once per call (`captures`) and travels here.
"""

from __future__ import annotations

from aiohttp import web

from proxy.config import Policy
from proxy.govern.ceilings import Admitted
from proxy.model import frozen
from proxy.providers.translator import Answer, Translator
from tracing import spans
from tracing.setup import CaptureMode

__all__ = ["CallState", "captures"]


def captures(process: CaptureMode, policy: Policy) -> bool:
    """Is this call's content captured: the process records it (SPAN_ONLY) and the tenant
    did not lower it (NO_CONTENT)."""
    return process == "SPAN_ONLY" and policy.capture_content != "NO_CONTENT"


@frozen
class CallState:
    """A forwarded call, as its bookkeeping reads it. `request`, `tr`: the request part (the
    HTTP request, the call's translator: its facts and bytes). `admitted`: the admission part
    (the ledger's answer, the quote, the clamp). `answer`: the answer part (its outcome,
    and in its hooks what spanmeter changed). `span`: the call's open span. `capture`: its
    content is captured. `deployment`: the Azure deployment it named, learnt from the answer."""

    request: web.Request
    tr: Translator
    admitted: Admitted
    answer: Answer
    span: spans.CallSpan
    capture: bool
    deployment: str | None = None
