"""Child process for the leases' kill -9 test: admits and settles one hot run under a call
ceiling and a cost ceiling, with budget leases on, until killed.

    lease_child.py <ledger URL> [solo]

With `solo`, every call is a run of its own (no X-Run-Id: Turn.solo), served from the
tenant's lease.

Prints "admitted <micros>" once an admission returned and "settled <micros>" once its settle
did: what the ledger must still count after a kill -9.
"""

from __future__ import annotations

import asyncio
import sys
from datetime import UTC, datetime

from proxy.errors import CeilingReached
from proxy.ledger.backends import open_store
from proxy.ledger.store import Ask, Limits, Turn

LIMITS = Limits(run_max_calls=5_000, run_max_cost=5_000 * 100, day_budget=10**12)


async def main(url: str, solo: bool) -> None:
    store = open_store(url, leases=True)
    n = 0
    while True:
        n += 1
        run = f"gen-{n}" if solo else "hot"
        try:
            admission = await store.admit(Ask("crash", run, datetime.now(UTC), LIMITS, ttl_s=86400),
                                          Turn(reserve=(1, 100), solo=solo))
        except CeilingReached:
            print("refused", flush=True)
            await asyncio.sleep(3600)
            return
        print(f"admitted {admission.reserved}", flush=True)
        await store.settle(admission, 70, run_totals={"calls": 1})
        print("settled 70", flush=True)
        if solo:
            await store.run_end("crash", run)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2:] == ["solo"]))
