"""The ledger: prices (pricing), the store protocol (store: the per-call Ledger and the read
and admin Views), its backends (sqlite, redis, chosen by URL in backends), rate limits and
refusal messages.

from proxy.ledger.backends import open_store
from proxy.ledger.pricing import PriceTable, cost, input_bound, reservation
from proxy.ledger.store import Limits
"""
