"""The ledger's backends, chosen by URL. Imported lazily: Redis is an optional extra."""

from __future__ import annotations

import os
from urllib.parse import parse_qs

from proxy.errors import ConfigError
from proxy.ledger.store import Store

__all__ = ["open_store"]


def open_store(url: str, *, leases: bool | None = None) -> Store:
    """`sqlite:///relative.db`, `sqlite:////abs/path.db`, `redis://host:port/db`,
    `redis+cluster://host:port[,host:port...]` (Redis Cluster; `rediss+cluster://` for TLS).

    SQLite takes `?synchronous=normal` (default `full`): see proxy/ledger/sqlite.py for
    what each survives. `sqlite:///:memory:` works but is not durable: tests only.

    `leases` wraps the backend in budget leases (proxy/ledger/leases.py). The app passes its
    `ledger_leases` setting; left None (tools, benches, tests), the environment's
    SPANMETER_LEDGER_LEASES, the same setting's variable, decides (on unless false).
    """
    store = _backend(url)
    if leases is None:
        leases = os.environ.get("SPANMETER_LEDGER_LEASES", "").strip().lower() not in ("0", "false", "no", "off")
    if not leases:
        return store
    from proxy.ledger.leases import LeasedStore

    return LeasedStore(store)


def _backend(url: str) -> Store:
    if url.startswith("sqlite:///"):
        from proxy.ledger.sqlite import SqliteStore

        path, synchronous = _sqlite_options(url)
        return SqliteStore(path, synchronous=synchronous)
    if url.startswith(("redis://", "rediss://", "unix://", "redis+cluster://", "rediss+cluster://")):
        from proxy.ledger.redis import RedisStore

        return RedisStore(url)
    raise ConfigError(
        f"Unknown store URL {url!r}: use sqlite:///path/to/ledger.db (the default, one "
        f"machine), redis://host:6379/0 (several replicas sharing one ledger) or "
        f"redis+cluster://host:6379 (a Redis Cluster)."
    )


def _sqlite_options(url: str) -> tuple[str, str]:
    """(path, synchronous) from a sqlite:/// URL."""
    from proxy.ledger.sqlite import SYNCHRONOUS

    path, _, query = url.removeprefix("sqlite:///").partition("?")
    synchronous = "FULL"
    for name, values in parse_qs(query, keep_blank_values=True).items():
        value = values[-1].upper()
        if name != "synchronous" or value not in SYNCHRONOUS:
            raise ConfigError(
                f"Unknown SQLite ledger option {name}={values[-1]!r} in {url!r}: the only option is "
                f"synchronous={'|'.join(v.lower() for v in SYNCHRONOUS)} (full, the default, survives "
                f"power loss; normal survives process crashes and saves an fsync per commit)."
            )
        synchronous = value
    return path, synchronous
