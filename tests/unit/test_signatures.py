"""No function in proxy/ or tracing/ takes more than 6 parameters.

What travels together is named once, as a small frozen record built once and passed
through (proxy/model.py's CallRecord and ToolRecord, the ledger's Ask and Turn, the
spans' Peer and Lineage), not handed along fact by fact. `self`/`cls` are not counted;
*args and **kwargs count one each.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("proxy", "tracing")
MAX_PARAMETERS = 6

# A function allowed past the limit must be named here with the reason (none is today).
ALLOWED: set[str] = set()


def parameters(fn: ast.FunctionDef | ast.AsyncFunctionDef, in_class: bool) -> int:
    args = fn.args
    positional = [a.arg for a in (*args.posonlyargs, *args.args)]
    count = len(positional) + len(args.kwonlyargs) + (args.vararg is not None) + (args.kwarg is not None)
    static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in fn.decorator_list)
    if in_class and not static and positional and positional[0] in ("self", "cls"):
        count -= 1
    return count


def functions(tree: ast.AST, prefix: str = "", in_class: bool = False) -> list[tuple[str, int]]:
    """(qualified name, parameters) of every function, nested ones and methods included."""
    found: list[tuple[str, int]] = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            found.append((prefix + node.name, parameters(node, in_class)))
            found += functions(node, f"{prefix}{node.name}.", False)
        elif isinstance(node, ast.ClassDef):
            found += functions(node, f"{prefix}{node.name}.", True)
    return found


def too_wide(root: Path) -> dict[str, int]:
    wide: dict[str, int] = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            for name, count in functions(ast.parse(path.read_text(), str(path))):
                if count > MAX_PARAMETERS:
                    wide[f"{path.relative_to(root).as_posix()}:{name}"] = count
    return wide


def test_no_function_takes_more_than_six_parameters() -> None:
    wide = {name: n for name, n in too_wide(ROOT).items() if name not in ALLOWED}
    assert not wide, (
        f"These functions take more than {MAX_PARAMETERS} parameters: "
        + ", ".join(f"{name} ({n})" for name, n in sorted(wide.items()))
        + ". Name what travels together in a small frozen dataclass built once and passed through "
        "(as proxy/model.py's CallRecord), rather than adding parameters."
    )


def test_the_allowlist_names_only_functions_still_too_wide() -> None:
    """An entry whose function was shrunk (or renamed) is dropped, so the list only shrinks."""
    stale = ALLOWED - too_wide(ROOT).keys()
    assert not stale, f"Remove from ALLOWED, these no longer take more than {MAX_PARAMETERS}: {sorted(stale)}"


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("def f(a, b, c, d, e, f): ...", {}),
        ("def f(a, b, c, d, e, f, g): ...", {"m.py:f": 7}),
        ("def f(a, *args, b, c, d, e, **kw): ...", {"m.py:f": 7}),
        ("class C:\n    def m(self, a, b, c, d, e, f): ...", {}),
        ("class C:\n    @classmethod\n    def m(cls, a, b, c, d, e, f, g): ...", {"m.py:C.m": 7}),
        ("class C:\n    @staticmethod\n    def m(self, a, b, c, d, e, f): ...", {"m.py:C.m": 7}),
        ("async def f(a):\n    def inner(a, b, c, d, e, f, g): ...", {"m.py:f.inner": 7}),
        ("def f(a, /, b, *, c, d, e, f, g): ...", {"m.py:f": 7}),
    ],
    ids=["six is fine", "seven is not", "*args and **kwargs count one each", "self is not counted",
         "cls is not counted", "a static method's first parameter counts", "nested functions count",
         "positional-only and keyword-only count"],
)
def test_the_scan_counts_parameters_as_the_rule_says(tmp_path: Path, source: str, expected: dict[str, int]) -> None:
    (tmp_path / "proxy").mkdir()
    (tmp_path / "tracing").mkdir()
    (tmp_path / "proxy" / "m.py").write_text(source)
    assert too_wide(tmp_path) == {f"proxy/{name}": n for name, n in expected.items()}
