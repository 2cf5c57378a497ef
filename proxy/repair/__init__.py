"""Structured-output repair: tolerant extraction, stream-safe rewriting, validation.

Pure code (no I/O). The proxy calls `repair_output`, `repair_arguments` and
`StreamRepairer`; `extract_*` are the reusable extractors.
"""

from __future__ import annotations

from proxy.repair.extract import (
    ACTIONS,
    ExtractError,
    Extraction,
    StreamExtractor,
    extract_enum,
    extract_items,
    extract_json,
    extract_json_report,
    extract_jsonl,
)
from proxy.repair.output import (
    StreamRepairer,
    repair_arguments,
    repair_output,
    violation_feedback,
)
from proxy.repair.validate import normalize_schema, problems

__all__ = [
    "ACTIONS",
    "ExtractError",
    "Extraction",
    "StreamExtractor",
    "StreamRepairer",
    "extract_enum",
    "extract_items",
    "extract_json",
    "extract_json_report",
    "extract_jsonl",
    "normalize_schema",
    "problems",
    "repair_arguments",
    "repair_output",
    "violation_feedback",
]
