"""Libraries through their front doors (docs/architecture.md): a library's private name (a
`_name` it keeps to itself, a `_private` module, an undocumented attribute we set on its
objects) is used only in that library's compat module (`*_compat.py`), which checks it at
start-up and falls back to the public path. Read from the code's own syntax trees."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FILES = sorted(p for d in ("proxy", "tracing") for p in (ROOT / d).rglob("*.py"))
COMPAT = {p for p in FILES if p.name.endswith("_compat.py")}
# Attributes of libraries' objects that carry no underscore but are not their public API.
KNOWN_PRIVATE = frozenset({"commands_parser"})
# Underscored names that are public API: os._exit, namedtuple's methods.
PUBLIC = frozenset({"_exit", "_replace", "_asdict", "_fields", "_make", "_field_defaults"})


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__")) and name not in PUBLIC


def _ours() -> set[str]:
    """Every name our own code defines: its functions, classes, attributes, variables and
    parameters, outside the compat modules. A private attribute read that is none of them
    belongs to a library."""
    names: set[str] = set()
    for path in FILES:
        if path in COMPAT:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and isinstance(
                    node.value, ast.Name) and node.value.id in ("self", "cls"):
                names.add(node.attr)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
                names.add(node.value)  # __slots__ entries, namedtuple fields
    return names


OURS = _ours()
OUR_PACKAGES = ("proxy", "tracing")


def _uses(path: Path) -> list[str]:
    found: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            parts = node.module.split(".")
            if parts[0] not in OUR_PACKAGES:
                found += [f"line {node.lineno}: from {node.module}" for p in parts if _private(p)][:1]
                found += [f"line {node.lineno}: import {a.name} from {node.module}" for a in node.names
                          if _private(a.name)]
        elif isinstance(node, ast.Import):
            found += [f"line {node.lineno}: import {a.name}" for a in node.names
                      if a.name.split(".")[0] not in OUR_PACKAGES and any(_private(p) for p in a.name.split("."))]
        elif isinstance(node, ast.Attribute):
            if node.attr in KNOWN_PRIVATE or (_private(node.attr) and node.attr not in OURS):
                found.append(f"line {node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in (
                "getattr", "setattr", "hasattr") and len(node.args) >= 2:
            name = node.args[1]
            if isinstance(name, ast.Constant) and isinstance(name.value, str) and (
                    name.value in KNOWN_PRIVATE or (_private(name.value) and name.value not in OURS)):
                found.append(f"line {node.lineno}: {node.func.id}(..., {name.value!r})")
    return found


@pytest.mark.parametrize("path", [p for p in FILES if p not in COMPAT], ids=lambda p: str(p.relative_to(ROOT)))
def test_no_private_library_name_outside_the_compat_modules(path: Path) -> None:
    found = _uses(path)
    assert not found, (f"{path.relative_to(ROOT)} uses a library's private names {found}: move that use into "
                       "the library's *_compat.py module, checked at start-up with the public path as fallback")


def test_the_compat_modules_are_where_the_private_names_are() -> None:
    """The probe above finds what it looks for: each compat module uses private names."""
    for path in COMPAT:
        assert _uses(path), f"{path.relative_to(ROOT)} uses no private library name: the test cannot see them"
