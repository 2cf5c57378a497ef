"""What a finished call is charged: reported usage, nothing, or its reservation."""

from __future__ import annotations

import pytest

from proxy.govern.ceilings import Admitted, settle_amount
from proxy.ledger.store import Admission, Limits
from proxy.model import Usage
from proxy.pricing import PriceTable, cost

PRICE = PriceTable.load().price("sim-small")
RESERVED = 5_000


def _admitted(priced: bool = True) -> Admitted:
    adm = Admission("a1", "acme", "r1", RESERVED, 1, {}, "2026-11-29", "2026-11")
    return Admitted(adm, PRICE if priced else None, (), None, Limits())


CASES = [
    ("reported usage is charged exactly", Usage(100, 20), False, False, (cost(PRICE, Usage(100, 20)), "reported")),
    ("an upstream refusal with no usage costs nothing", Usage(), True, False, (0, "none")),
    ("a stream cut before final usage costs its reservation", Usage(100, None), False, False, (RESERVED, "estimate")),
    ("usage that never came is not zero", Usage(), False, False, (RESERVED, "estimate")),
    ("embeddings report input only and that is final", Usage(40, None), False, True,
     (cost(PRICE, Usage(40, None)), "reported")),
]


@pytest.mark.parametrize("name,usage,failed,input_only,expected", CASES, ids=[c[0] for c in CASES])
def test_settle_amount(name, usage, failed, input_only, expected):
    assert settle_amount(_admitted(), usage, failed_before_output=failed, input_only=input_only) == expected


def test_an_unpriced_model_without_cost_ceilings_is_recorded_at_zero():
    assert settle_amount(_admitted(priced=False), Usage(100, 20), failed_before_output=False) == (0, "unpriced")
