"""Ceilings and the ledger: prices (pricing), the store protocol (store) and its backends.

from proxy.policy.store import Limits, open_store
from proxy.policy.pricing import PriceTable, cost, input_bound, reservation
"""
