"""The price table knows the names real agents send: providers' aliases, older models,
dated snapshots (issue 25), and every model of the recorded real traffic."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path
from typing import Any

import pytest

from proxy.pricing import PriceTable
from tests.fakes.replay import MISSING, RECORDED, recorded_pairs

DATA = Path(__file__).resolve().parent.parent / "data" / "policy"
CASES: list[dict[str, Any]] = json.loads((DATA / "aliases.json").read_text())
TABLE = PriceTable.load()


@pytest.mark.parametrize("case", CASES, ids=lambda c: c["name"])
def test_a_model_name_is_priced_as_the_model_it_may_run(case: dict[str, Any]) -> None:
    price = TABLE.price(case["model"])
    if case["priced_as"] is None:
        assert price is None
        return
    assert price is not None
    assert (price.model, price.input, price.output) == (
        case["priced_as"], round(case["input"] * 1e6), round(case["output"] * 1e6))


def test_an_alias_to_an_unpriced_model_is_a_load_error(tmp_path: Path) -> None:
    f = tmp_path / "prices.yaml"
    f.write_text("models:\n  a: {input: 1, output: 2, source: s, as_of: x}\naliases:\n  a-latest: [b-2025]\n")
    with pytest.raises(ValueError, match="a-latest: b-2025 has no price"):
        PriceTable.load(f)


def _models(pair: dict[str, Any]) -> set[str]:
    """The request's model and any model the recorded answer names."""
    r = pair["response"]
    body = base64.b64decode(r["decoded_b64"] if r.get("decoded_b64") is not None else r["body_b64"] or "")
    named = re.findall(rb'"(?:model|modelVersion)"\s*:\s*"([^"]+)"', body)
    return {pair["model"], *(m.decode() for m in named)}


def test_every_model_of_the_recorded_traffic_is_priced_or_unpriced_on_purpose() -> None:
    if not RECORDED.exists():
        pytest.skip(MISSING)
    unpriced = TABLE.unpriced()
    names: set[str] = set()
    for pair in recorded_pairs():
        if pair["response"]["status"] < 300:
            names |= _models(pair)
    missing = sorted(n for n in names if n not in TABLE and n not in unpriced)
    assert not missing, ("models of real traffic with no price: add them to proxy/data/prices.yaml "
                         f"(`models:` or `aliases:`), or under `unpriced:` with the reason: {missing}")
