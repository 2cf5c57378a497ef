"""The call's state on its path through the proxy: typed records (no `Any` on the call
path's records), one price quote per call whose answers are admission's, and the repair
driver's verdict returned rather than left on a shared object."""

from __future__ import annotations

import ast
from datetime import UTC, datetime
from pathlib import Path

import pytest

from proxy.errors import CeilingReached
from proxy.govern.ceilings import Candidate, Plan, admit
from proxy.ledger.sqlite import SqliteStore
from proxy.ledger.store import Limits
from proxy.model import Call, Caller
from proxy.pricing import MIN_ANSWER_TOKENS, PriceTable, input_bound, quote

ROOT = Path(__file__).resolve().parents[2]
PRICES = PriceTable.load()
T0 = datetime(2026, 5, 14, 12, 0, tzinfo=UTC)

# The call path's modules, whose every function and record is typed without `Any`, and the
# records elsewhere that the call path builds (module, class).
CALL_PATH = ["proxy/serve/handler.py", "proxy/serve/bookkeeping.py", "proxy/serve/state.py",
             "proxy/govern/ceilings.py", "proxy/pricing/quote.py"]
RECORDS = [("proxy/model.py", "CallRecord"), ("proxy/model.py", "Outcome"), ("proxy/model.py", "Caller"),
           ("tracing/spans.py", "CallSpan"), ("proxy/govern/outputs.py", "Retry")]


def _annotations(tree: ast.AST) -> list[tuple[int, ast.expr]]:
    found: list[tuple[int, ast.expr]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.AnnAssign):
            found.append((node.lineno, node.annotation))
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            args = node.args
            for a in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]:
                if a is not None and a.annotation is not None:
                    found.append((node.lineno, a.annotation))
            if node.returns is not None:
                found.append((node.lineno, node.returns))
    return found


def _is_any(n: ast.AST) -> bool:
    if isinstance(n, ast.Name):
        return n.id == "Any"
    if isinstance(n, ast.Attribute):
        return n.attr == "Any"
    return isinstance(n, ast.Constant) and isinstance(n.value, str) and "Any" in n.value.replace("[", " ").split()


def _anys(tree: ast.AST) -> list[str]:
    return [f"line {line}: {ast.unparse(ann)}" for line, ann in _annotations(tree)
            if any(_is_any(n) for n in ast.walk(ann))]


@pytest.mark.parametrize("path", CALL_PATH)
def test_the_call_paths_modules_type_nothing_as_any(path: str) -> None:
    found = _anys(ast.parse((ROOT / path).read_text()))
    assert not found, f"{path} types {found} as Any: name the type (the call's records are typed end to end)"


@pytest.mark.parametrize(("path", "name"), RECORDS)
def test_the_call_paths_records_type_nothing_as_any(path: str, name: str) -> None:
    tree = ast.parse((ROOT / path).read_text())
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name)
    found = _anys(cls)
    assert not found, f"{path} {name} types {found} as Any"


def test_admission_asks_pricing_once() -> None:
    """Admission's pricing goes through the call's one quote: ceilings.py asks nothing else of it."""
    tree = ast.parse((ROOT / "proxy/govern/ceilings.py").read_text())
    called = [n.func.id if isinstance(n.func, ast.Name) else n.func.attr for n in ast.walk(tree)
              if isinstance(n, ast.Call) and isinstance(n.func, ast.Name | ast.Attribute)]
    assert called.count("quote") == 1
    asked = {"reservation", "affordable_output_tokens", "dearest_input_rate", "reserve_factor"} & set(called)
    assert not asked, f"ceilings.py asks pricing {sorted(asked)} outside the call's quote"


def _call(**kw: object) -> Call:
    return Call(api="chat", operation="chat", model="gpt-4o-mini", body_bytes=1_200, **kw)  # type: ignore[arg-type]


CALLS = {
    "a bounded answer": _call(max_output_tokens=500),
    "no max tokens (clamped to what the reservation affords)": _call(),
    "above the model's cap": _call(max_output_tokens=10**6),
    "four answers, priority tier": _call(max_output_tokens=300, output_multiplier=4, service_tier="priority"),
    "a 1-hour cache write": _call(max_output_tokens=200, cache_write="1h"),
    "an unpriced model": Call(api="chat", operation="chat", model="no-such-model", body_bytes=900),
    "input only": Call(api="embeddings", operation="embeddings", model="text-embedding-3-small", body_bytes=700,
                       generates_output=False),
}


@pytest.mark.parametrize("run_cost", [10**9, 2_000], ids=["roomy", "tight"])
@pytest.mark.parametrize("name", list(CALLS))
async def test_admissions_answers_are_the_quotes(tmp_path: Path, name: str, run_cost: int) -> None:
    call = CALLS[name]
    store = SqliteStore(str(tmp_path / "ledger.db"))
    try:
        priced = PRICES.price(call.model) is not None  # an unpriced model is refused under any cost limit
        limits = Limits(run_max_cost=run_cost if priced else None, run_max_tokens=10**7)
        candidate = Candidate(Caller("acme", "run-1", "header"), call, Plan(limits), patch_bytes=64)
        try:
            admitted = await admit(store, PRICES, candidate, tz="UTC", now=T0)
        except CeilingReached as exc:  # a tight run refuses what its least answer cannot fit in
            assert run_cost == 2_000 and exc.limit == "run_cost", exc
            return
    finally:
        await store.aclose()
    price = PRICES.price(call.model)
    q = quote(call, price, input_bound(call) + 64)
    assert admitted.quote == q
    adm = admitted.admission
    least, most = q.reserve
    assert least <= adm.reserved <= most
    if run_cost > 10**8:
        assert adm.reserved == most
    assert adm.tokens == q.tokens[1]
    if price is not None and call.generates_output and call.max_output_tokens is None:
        assert admitted.clamp_to == min(q.output_cap, max(MIN_ANSWER_TOKENS, q.affordable_output(adm.reserved, 0)))
    elif price is not None and call.max_output_tokens is not None and call.max_output_tokens > q.output_cap:
        assert admitted.clamp_to == q.output_cap
    else:
        assert admitted.clamp_to is None
