"""The packages are the architecture (docs/architecture.md): each may import only the rooms
below it, and no module imports itself back through another. Read from the code's own imports."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Each room and the rooms it may import; every room may import its own modules.
ALLOWED: dict[str, set[str]] = {
    "proxy": set(),  # the package itself: its __init__
    "proxy.model": set(),
    "proxy.errors": set(),
    "proxy.config": {"proxy.errors", "proxy.model"},
    "tracing": {"proxy.model"},
    "proxy.repair": {"proxy.model", "proxy.errors"},
    "proxy.providers": {"proxy.model", "proxy.errors"},
    "proxy.pricing": {"proxy.model", "proxy.errors"},
    "proxy.anatomy": {"proxy.model", "proxy.errors", "proxy.pricing"},
    "proxy.ledger": {"proxy.model", "proxy.errors"},
    "proxy.simulator": {"proxy.model", "proxy.errors"},
    "proxy.govern": {"proxy.model", "proxy.errors", "proxy.config", "proxy.repair", "proxy.providers",
                     "proxy.ledger", "proxy.pricing", "tracing"},
    "proxy.serve": {"proxy.model", "proxy.errors", "proxy.config", "proxy.repair", "proxy.providers",
                    "proxy.ledger", "proxy.pricing", "proxy.anatomy", "tracing", "proxy.govern"},
    "proxy.mcp": {"proxy.model", "proxy.errors", "proxy.config", "proxy.providers", "proxy.ledger", "proxy.pricing",
                  "tracing", "proxy.govern", "proxy.serve"},
    "proxy.app": {"proxy.model", "proxy.errors", "proxy.config", "proxy.providers", "proxy.ledger", "proxy.pricing",
                  "proxy.anatomy", "tracing", "proxy.govern", "proxy.serve", "proxy.mcp"},
    "proxy.ops": {"proxy.model", "proxy.errors", "proxy.config", "proxy.ledger", "proxy.pricing", "tracing",
                  "proxy.serve", "proxy.simulator", "proxy.app"},
    "proxy.__main__": {"proxy.ops"},
}


def _room(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] == "tracing":
        return "tracing"
    if parts[0] != "proxy":
        return None
    if len(parts) == 1:
        return "proxy"
    return f"proxy.{parts[1]}"


def _modules() -> dict[str, Path]:
    files = [*(ROOT / "proxy").rglob("*.py"), *(ROOT / "tracing").rglob("*.py")]
    return {".".join(f.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): f for f in files}


def _imports(path: Path, module: str) -> set[str]:
    found: set[str] = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return found


GRAPH: dict[str, set[str]] = defaultdict(set)
MODULES = _modules()
for _name, _path in MODULES.items():
    GRAPH[_name] = {m for m in _imports(_path, _name) if m in MODULES and m != _name}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_a_module_imports_only_the_rooms_below_its_own(module: str) -> None:
    room = _room(module)
    assert room in ALLOWED, f"{module} is in no room of docs/architecture.md: add it to ALLOWED and the doc"
    upward = sorted(m for m in GRAPH[module] if _room(m) != room and _room(m) not in ALLOWED[room])
    assert not upward, f"{module} ({room}) imports {upward}, which its room may not import"


def test_no_module_imports_itself_back() -> None:
    cycles: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(GRAPH[node]):
            if state.get(nxt) == 1:
                cycles.append([*stack[stack.index(nxt):], nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for module in sorted(MODULES):
        if module not in state:
            visit(module)
    assert not cycles, f"import cycles: {cycles}"


# What a wire format is lives in its API module (issue 27): the shared code knows a call
# through proxy.providers.translator and a path through proxy.providers.apis, nothing more.
API_MODULES = {m for m in MODULES if m.startswith("proxy.providers.") and m.rpartition(".")[2].partition("_")[0]
               in ("chat", "responses", "anthropic", "gemini", "embeddings")}
DIALECT_WORDS = re.compile(r"openai|anthropic|gemini|google", re.IGNORECASE)


def _code_words(path: Path) -> list[str]:
    """The names and strings of a module's code; its prose (docstrings, comments) may tell
    what the providers do."""
    tree = ast.parse(path.read_text())
    prose = {id(n.body[0].value) for n in ast.walk(tree)
             if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and n.body
             and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    words: list[str] = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in prose:
            words.append(n.value)
        elif isinstance(n, ast.Name):
            words.append(n.id)
        elif isinstance(n, ast.Attribute):
            words.append(n.attr)
        elif isinstance(n, ast.alias):
            words += [n.name, n.asname or ""]
        elif isinstance(n, ast.ImportFrom):
            words.append(n.module or "")
        elif isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            words.append(n.name)
    return words


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _room(m) not in ("proxy.providers", "proxy.simulator")))
def test_only_the_providers_import_an_api_module(module: str) -> None:
    named = sorted(GRAPH[module] & API_MODULES)
    assert not named, f"{module} imports {named}: go through proxy.providers.translator (a call) or .apis (a path)"


@pytest.mark.parametrize("module", ["proxy.errors", "proxy.app", "proxy.govern.caching", "proxy.govern.outputs",
                                    "proxy.serve.handler", "proxy.serve.relay", "proxy.serve.bookkeeping",
                                    "proxy.anatomy.shares"])
def test_the_shared_code_names_no_dialect(module: str) -> None:
    found = sorted({m.group(0).lower() for word in _code_words(MODULES[module]) for m in DIALECT_WORDS.finditer(word)})
    assert not found, f"{module} names {found}: that knowledge belongs in the API's module under proxy/providers/"
