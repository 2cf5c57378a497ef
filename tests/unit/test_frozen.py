"""`proxy.model.frozen`: value types immutable as mypy checks them, plain slotted dataclasses at run
time. The run time no longer refuses an assignment, so the check that does is part of the suite:
mypy over proxy/ and tracing/, and over a snippet that assigns to a field."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from proxy.model import Call, Usage, frozen

ROOT = Path(__file__).resolve().parents[2]


def _mypy(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    pytest.importorskip("mypy", reason="mypy is in the dev extra: make test installs it, make test-lowest does not")
    return subprocess.run([sys.executable, "-m", "mypy", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


def test_a_value_type_compares_and_hashes_by_its_fields_as_a_frozen_dataclass_does() -> None:
    a, b = Usage(input_tokens=3, output_tokens=4), Usage(input_tokens=3, output_tokens=4)
    assert a == b and a is not b
    assert hash(a) == hash(b)
    assert len({a, b, Usage(input_tokens=3)}) == 2
    assert dataclasses.replace(a, output_tokens=5) == Usage(input_tokens=3, output_tokens=5)
    assert not hasattr(a, "__dict__")  # slotted: no per-instance dict
    assert dataclasses.is_dataclass(Call)


def test_a_class_with_its_own_hash_keeps_it() -> None:
    @frozen
    class Named:
        name: str
        size: int = 0

        def __hash__(self) -> int:
            return hash(self.name)

    assert hash(Named("a", 1)) == hash("a") == hash(Named("a", 2))
    assert Named("a", 1) != Named("a", 2)


def test_mypy_refuses_an_assignment_to_a_field(tmp_path: Path) -> None:
    snippet = tmp_path / "assigns.py"
    snippet.write_text(textwrap.dedent("""
        from proxy.model import Usage, frozen

        @frozen
        class Point:
            x: int
            y: int = 0

        p = Point(1)
        p.x = 2
        u = Usage()
        u.input_tokens = 3
        q = Point(1, y=2)
    """))
    done = _mypy("--strict", "--no-incremental", "--cache-dir", str(tmp_path / "cache"), str(snippet),
                 cwd=ROOT)
    errors = [line for line in done.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 2, done.stdout
    assert 'Property "x" defined in "Point" is read-only' in errors[0]
    assert 'Property "input_tokens" defined in "Usage" is read-only' in errors[1]


def test_the_packages_type_check() -> None:
    """What makes `@frozen` immutable: no assignment to a value type's field anywhere in the code."""
    done = _mypy("proxy", "tracing")
    assert done.returncode == 0, done.stdout + done.stderr
