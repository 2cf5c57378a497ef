"""Child process for the kill -9 test: admits and settles in a loop until killed.

    ledger_child.py <sqlite URL>

Prints one line per finished operation, after the store returned (so after commit):
"settled <micros>" (a combined settle: cost, one run total `calls`, one tool call) or
"inflight <micros>" (admitted, deliberately never settled).
"""

from __future__ import annotations

import asyncio
import sys
from datetime import UTC, datetime

from proxy.ledger.backends import open_store
from proxy.ledger.store import Ask, Limits, Turn


async def main(url: str) -> None:
    store = open_store(url, leases=False)  # the backend's own durability (leases: lease_child.py)
    i = 0
    while True:
        run_id = f"r{i % 5}"
        admission = await store.admit(Ask("crash", run_id, datetime.now(UTC), Limits(), ttl_s=86400),
                                      Turn(reserve=(1, 100)))
        if i % 3 == 0:
            print(f"inflight {admission.reserved}", flush=True)
        else:
            await store.settle(admission, 70, run_totals={"calls": 1}, tools=[{"id": f"c{i}", "run": run_id}])
            print("settled 70", flush=True)
        i += 1


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
