"""Every private name of redis-py the Redis ledger uses, in one place, checked once.

    AbstractConnection._reader / ._writer   the streams redis_pipe.py takes over after
                                            redis-py's own connect and handshake
    redis._parsers.base.BaseParser.parse_error   an error reply -> redis-py's exception
                                            (NoScriptError, MovedError, ...) for redis_pipe.py
    redis._parsers.AsyncCommandsParser      subclassed by `FailoverCommandsParser`
    RedisCluster.commands_parser            set to that parser (`fail_over_command_lookup`):
                                            an undocumented attribute the client reads
    RedisCluster._initialize                set: learn the Cluster's layout again before the
                                            next command, after a node's connection failed

`internals()` checks them (imports, names, shapes) when a RedisStore is made: anything
missing or moved is logged once at WARNING with redis-py's version, and the store takes
the public path: its scripts go through redis-py's own pipelines (`Batched`, standalone)
or its Cluster client's routing, with redis-py's default Cluster parser. Slower per call,
the same replies and ledger state (tests/ledger/test_redis_compat.py).
SPANMETER_REDIS_INTERNALS=off takes the public path without asking (tests, the bench).
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import os
from collections.abc import Mapping
from typing import Final

from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import AbstractConnection, Connection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

__all__ = ["ENV", "FailoverCommandsParser", "fail_over_command_lookup", "internals", "parse_error", "relearn_layout",
           "take_streams"]

log = logging.getLogger(__name__)

ENV: Final = "SPANMETER_REDIS_INTERNALS"  # off: redis-py's public API only

try:
    from redis._parsers import AsyncCommandsParser
    from redis._parsers.base import BaseParser

    _IMPORTED: str | None = None
except ImportError as exc:  # moved: the public path needs neither
    AsyncCommandsParser = object  # type: ignore[assignment,misc]
    BaseParser = None  # type: ignore[assignment,misc]
    _IMPORTED = f"redis._parsers ({exc})"

_said: set[str] = set()


def forced_public(environ: Mapping[str, str] | None = None) -> bool:
    env = os.environ if environ is None else environ
    return (env.get(ENV) or "").strip().lower() in ("off", "false", "0", "no")


def internals(environ: Mapping[str, str] | None = None) -> bool:
    """May the ledger use redis-py's internals? False when forced off or when one moved
    (logged once a process)."""
    if forced_public(environ):
        return False
    gone = moved()
    if gone:
        key = ", ".join(gone)
        if key not in _said:
            _said.add(key)
            log.warning("redis-py %s: %s moved or changed shape; the ledger's scripts go through redis-py's public "
                        "pipelines and Cluster client instead (correct, more CPU per call). Pin redis to the range "
                        "pyproject.toml allows, or report it", _version(), key)
        return False
    return True


def moved() -> list[str]:
    """The private names this module uses that this redis-py lacks or keeps in another shape."""
    gone = [_IMPORTED] if _IMPORTED else []
    if BaseParser is not None and not callable(getattr(BaseParser, "parse_error", None)):
        gone.append("BaseParser.parse_error")
    if _IMPORTED is None and not callable(getattr(AsyncCommandsParser, "initialize", None)):
        gone.append("AsyncCommandsParser.initialize")
    conn = Connection()  # not connected: its streams are None until connect()
    if not (hasattr(conn, "_reader") and hasattr(conn, "_writer")):
        gone.append("AbstractConnection._reader/_writer")
    slots = getattr(RedisCluster, "__slots__", ())
    if "_initialize" not in slots:
        gone.append("RedisCluster._initialize")
    if "commands_parser" not in slots:
        gone.append("RedisCluster.commands_parser")
    return gone


def _version() -> str:
    try:
        return importlib.metadata.version("redis")
    except importlib.metadata.PackageNotFoundError:
        return "(version unknown)"


# --- the private uses (only after `internals()` said yes) -----------------------------


def take_streams(conn: AbstractConnection) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connected redis-py connection's streams, taken: redis-py lets go of them (it would
    close them, or warn that they are open, when the connection is collected)."""
    reader, writer = conn._reader, conn._writer
    if reader is None or writer is None:
        raise RedisConnectionError("redis-py's connection has no streams after connect()")
    conn._reader = conn._writer = None
    return reader, writer


def parse_error(message: str) -> RedisError:
    """An error reply's text as the exception redis-py would raise for it."""
    return BaseParser.parse_error(message)  # type: ignore[no-any-return,no-untyped-call]


def relearn_layout(client: RedisCluster) -> None:
    """As redis-py's client does after a connection error: learn the layout again before
    the next command (a replica may have taken over the node's slots)."""
    client._initialize = True


def fail_over_command_lookup(client: RedisCluster) -> None:
    """The Cluster client asks the primaries in turn for COMMAND (`FailoverCommandsParser`),
    not only the first of its layout."""
    client.commands_parser = FailoverCommandsParser(client)


class FailoverCommandsParser(AsyncCommandsParser):
    """redis-py's Cluster client asks the first primary of its layout for COMMAND whenever it
    (re)learns the layout, and fails as a whole when that primary is down: no command would
    go out, not even for the keys of the shards that are up. This one asks the other
    primaries in turn, and makes the one that answered the client's default node."""

    def __init__(self, client: RedisCluster) -> None:
        super().__init__()
        self._client = client

    async def initialize(self, node: ClusterNode | None = None) -> None:
        primaries = self._client.get_primaries()
        error: BaseException | None = None
        for candidate in [node, *(n for n in primaries if n is not node)]:
            if candidate is None:
                continue
            try:
                await super().initialize(candidate)
            except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
                error = exc
                continue
            self._client.nodes_manager.default_node = candidate
            return
        raise error or RedisConnectionError("no primary of the cluster answers")


