from __future__ import annotations

from tests.fixtures.otlp import otlp_receiver

__all__ = ["otlp_receiver"]
