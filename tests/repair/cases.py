"""Loading the table-driven repair cases from tests/data/repair/*.jsonl."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

DATA = Path(__file__).resolve().parent.parent / "data" / "repair"


def load(name: str) -> list[Any]:
    """One pytest param per line, its id the case's sentence."""
    lines = (DATA / name).read_text(encoding="utf-8").splitlines()
    cases = [json.loads(line) for line in lines if line.strip()]
    return [pytest.param(c, id=c["name"]) for c in cases]
