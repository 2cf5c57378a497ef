"""A frozen value is built whole: no module sets a field of one after it is built
(`object.__setattr__`, `setattr`), so a `Call` is what its API module's `parse_request` made.
A class may cache in its own slot (`object.__setattr__(self, ...)`) only when listed here."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# (module, class): a frozen class that keeps a derived value in a slot of its own, lazily.
SELF_CACHES = {("tracing/spans.py", "RunTrace")}


def _setters(tree: ast.AST) -> list[tuple[str | None, ast.Call]]:
    """Every `object.__setattr__(...)` and `setattr(...)` call, with its enclosing class."""
    found: list[tuple[str | None, ast.Call]] = []

    def walk(node: ast.AST, cls: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                walk(child, child.name)
                continue
            if isinstance(child, ast.Call):
                f = child.func
                if (isinstance(f, ast.Attribute) and f.attr == "__setattr__") or (
                        isinstance(f, ast.Name) and f.id == "setattr"):
                    found.append((cls, child))
            walk(child, cls)

    walk(tree, None)
    return found


def test_no_module_sets_a_field_of_a_built_value() -> None:
    offenders = []
    for path in sorted([*ROOT.joinpath("proxy").rglob("*.py"), *ROOT.joinpath("tracing").rglob("*.py")]):
        rel = path.relative_to(ROOT).as_posix()
        for cls, call in _setters(ast.parse(path.read_text(), rel)):
            target = call.args[0] if call.args else None
            on_self = isinstance(target, ast.Name) and target.id == "self"
            if not (on_self and (rel, cls) in SELF_CACHES):
                offenders.append(f"{rel}:{call.lineno} {ast.unparse(call)}")
    assert not offenders, ("a frozen value is built whole (pass the facts to its constructor, as "
                           "providers.base.open_exchange passes ByteFacts to parse_request): "
                           + "; ".join(offenders))


def test_the_test_finds_a_mutation() -> None:
    tree = ast.parse("def f(call):\n    object.__setattr__(call, 'body_bytes', 3)\n")
    assert [ast.unparse(c) for _, c in _setters(tree)] == ["object.__setattr__(call, 'body_bytes', 3)"]
