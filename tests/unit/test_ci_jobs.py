"""`make test-lowest` runs the suite at our floors, less the test files that need the extra
`test-agents` (the MCP SDK, openai-agents, uvicorn need newer libraries than our floors). A
new such file missing from the Makefile's list breaks that job at collection: caught here."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_AGENT_IMPORT = re.compile(r"^\s*(from|import) (mcp|agents|uvicorn|tests\.fixtures\.mcp_server)\b", re.M)


def _listed() -> set[str]:
    makefile = (ROOT / "Makefile").read_text()
    block = re.search(r"^AGENT_TESTS\s*:=((?:.*\\\n)*.*)$", makefile, re.M)
    assert block, "the Makefile names the test files left out of test-lowest in AGENT_TESTS"
    return set(block.group(1).replace("\\\n", " ").split())


def test_every_test_file_that_needs_the_agent_extra_is_left_out_of_the_floors_job() -> None:
    needing = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
               if _AGENT_IMPORT.search(p.read_text())}
    assert needing, "the pattern finds the MCP tests"
    assert needing <= _listed(), f"add to AGENT_TESTS in the Makefile: {sorted(needing - _listed())}"


def test_every_listed_file_exists() -> None:
    assert all((ROOT / f).is_file() for f in _listed())
