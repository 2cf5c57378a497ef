"""One auto-pipelined connection to a Redis server, for the ledger's per-call scripts.

redis-py sends each command on a connection taken from its pool and returned after the
reply, packing it in Python and arming a timeout per read: about half of the serving
process's CPU per admit+settle pair went there. Here every command issued in one
event-loop iteration goes out in one write on one connection, and replies, which Redis
sends in order, are matched to their callers in order; hiredis packs and parses in C.

The connection itself (TLS, unix sockets, AUTH, SELECT, the handshake) is made by
redis-py's own Connection class from the pool's settings; once it is up, its streams are
taken (proxy/ledger/redis_compat.py, which checks that redis-py still keeps them where
this expects) and read and written here and nowhere else. When it does not, or
SPANMETER_REDIS_INTERNALS=off, `Batched` is used instead: the commands of one loop
iteration go as one of redis-py's own pipelines on a pooled connection.

Failure semantics are those of the pooled client: a command whose reply has not come
`timeout_s` after it was written fails with TimeoutError, and so does every command
behind it on that connection (their fate is as unknown), and the connection is dropped;
a lost connection fails everything in flight on it with ConnectionError; the next
command opens a new connection. A caller that goes away (cancelled) leaves its slot, and
its reply is read and dropped when it comes, so the replies behind it stay matched.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import hiredis
import redis.asyncio as aioredis
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import InvalidResponse, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from proxy.ledger import redis_compat

__all__ = ["Batched", "Pipe", "Scripts"]

Command = tuple[str | bytes | int | float, ...]  # (name, *args)

_READ_SIZE = 65536


class _Link:
    """One open connection: what was written on it and awaits its reply, in order."""

    def __init__(self, conn: AbstractConnection, timeout_s: float, on_dead: Callable[[_Link], None]) -> None:
        reader, writer = redis_compat.take_streams(conn)  # made by redis-py's handshake; ours from here
        self.reader: asyncio.StreamReader = reader
        self.writer: asyncio.StreamWriter = writer
        self.loop = asyncio.get_running_loop()
        self.timeout_s = timeout_s
        self.where = f"{getattr(conn, 'host', getattr(conn, 'path', '?'))}:{getattr(conn, 'port', '')}"
        self.parser = hiredis.Reader(protocolError=InvalidResponse, replyError=redis_compat.parse_error,
                                     encoding="utf-8")
        self.pending: deque[tuple[asyncio.Future[Any], float]] = deque()  # (caller, reply deadline)
        self.out: list[bytes] = []
        self.flush_due = False
        self.timer: asyncio.TimerHandle | None = None
        self.dead: BaseException | None = None  # why the connection was given up
        self._on_dead = on_dead
        self.task = self.loop.create_task(self._read())

    def send(self, packed: bytes) -> asyncio.Future[Any]:
        fut: asyncio.Future[Any] = self.loop.create_future()
        if self.dead is not None:  # lost between the caller's connect and its send
            fut.set_exception(self.dead)
            return fut
        self.pending.append((fut, self.loop.time() + self.timeout_s))
        self.out.append(packed)
        if not self.flush_due:
            self.flush_due = True
            self.loop.call_soon(self._flush)
        if self.timer is None:
            self.timer = self.loop.call_at(self.pending[0][1], self._check)
        return fut

    def _flush(self) -> None:
        self.flush_due = False
        if self.dead is not None or not self.out:
            return
        data = self.out[0] if len(self.out) == 1 else b"".join(self.out)
        self.out.clear()
        try:
            self.writer.write(data)
        except (OSError, RuntimeError) as exc:
            self.fail(RedisConnectionError(f"Error while writing to {self.where}: {exc}"))

    def _check(self) -> None:
        """The oldest reply is overdue: the connection is given up; else look again then."""
        self.timer = None
        if self.dead is not None or not self.pending:
            return
        deadline = self.pending[0][1]
        if deadline <= self.loop.time():
            self.fail(RedisTimeoutError(f"Timeout reading from {self.where}"))
        else:
            self.timer = self.loop.call_at(deadline, self._check)

    async def _read(self) -> None:
        try:
            while True:
                data = await self.reader.read(_READ_SIZE)
                if not data:
                    raise RedisConnectionError(f"Connection closed by server ({self.where}).")
                self.parser.feed(data)
                while (reply := self.parser.gets()) is not False:
                    fut = self.pending.popleft()[0]
                    if not fut.done():
                        fut.set_result(reply)
        except asyncio.CancelledError:
            self.fail(RedisConnectionError(f"Connection to {self.where} closed."))
            raise
        except RedisError as exc:
            self.fail(exc)
        except (OSError, IndexError) as exc:  # IndexError: a reply nobody asked for; out of step
            self.fail(RedisConnectionError(f"Error while reading from {self.where}: {exc!r}"))

    def fail(self, exc: BaseException) -> None:
        if self.dead is not None:
            return
        self.dead = exc
        self._on_dead(self)
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if asyncio.current_task() is not self.task:
            self.task.cancel()
        self.writer.close()
        while self.pending:
            fut = self.pending.popleft()[0]
            if not fut.done():
                fut.set_exception(exc)

    async def close(self) -> None:
        self.fail(RedisConnectionError(f"Connection to {self.where} closed."))
        await asyncio.gather(self.task, return_exceptions=True)
        with contextlib.suppress(OSError):
            await self.writer.wait_closed()


class Scripts(Protocol):
    """Where the ledger's per-call scripts go: `Pipe` or `Batched`."""

    async def call(self, command: Command) -> Any: ...

    async def aclose(self) -> None: ...


class Pipe:
    """Commands to one server on one connection, pipelined; opened on first use and again
    after it is lost. `connection()` makes an unconnected redis-py Connection."""

    def __init__(self, connection: Callable[[], AbstractConnection], *, timeout_s: float) -> None:
        self._connection = connection
        self._timeout_s = timeout_s
        self._link: _Link | None = None
        self._opening: asyncio.Future[_Link] | None = None
        self._closed = False

    async def call(self, command: Command) -> Any:
        """Send one command; its reply, or the server's error reply raised."""
        link = self._link
        if link is None:
            link = await self._open()
        # The stub types its argument as a 1-tuple; it takes (name, *args).
        reply = await link.send(hiredis.pack_command(command))  # type: ignore[arg-type]
        if isinstance(reply, RedisError):
            raise reply
        return reply

    async def _open(self) -> _Link:
        if self._closed:
            raise RedisConnectionError("The ledger's Redis connection is closed.")
        if self._opening is None:
            # One connect for every caller that finds no connection; a caller that is
            # cancelled while it waits does not cancel it for the others.
            self._opening = asyncio.ensure_future(self._connect())
            self._opening.add_done_callback(self._opened)
        return await asyncio.shield(self._opening)

    async def _connect(self) -> _Link:
        conn = self._connection()
        try:
            await conn.connect()  # type: ignore[no-untyped-call]
        except BaseException:
            await conn.disconnect()
            raise
        try:
            link = _Link(conn, self._timeout_s, self._dropped)
        except BaseException:
            await conn.disconnect()
            raise
        if self._closed:
            await link.close()
            raise RedisConnectionError("The ledger's Redis connection is closed.")
        self._link = link
        return link

    def _opened(self, fut: asyncio.Future[_Link]) -> None:
        self._opening = None
        if not fut.cancelled():
            fut.exception()  # retrieved: a connect failure is each waiter's to raise, not the loop's to log

    def _dropped(self, link: _Link) -> None:
        if self._link is link:
            self._link = None

    async def aclose(self) -> None:
        self._closed = True
        if self._opening is not None:
            await asyncio.gather(self._opening, return_exceptions=True)
        if self._link is not None:
            await self._link.close()


class Batched:
    """The public path: the commands issued in one event-loop iteration go as one of
    redis-py's pipelines (no transaction) on a connection of `client`'s pool; each caller
    gets its own reply, or its error reply raised. A failure of the pipeline (connection
    lost, timeout) fails every command in it, as `Pipe` fails what is in flight."""

    def __init__(self, client: aioredis.Redis) -> None:
        self._client = client
        self._batch: list[tuple[Command, asyncio.Future[Any]]] = []
        self._sending: set[asyncio.Task[None]] = set()

    async def call(self, command: Command) -> Any:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        if not self._batch:
            loop.call_soon(self._flush)
        self._batch.append((command, fut))
        return await fut

    def _flush(self) -> None:
        batch, self._batch = self._batch, []
        task = asyncio.ensure_future(self._send(batch))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _send(self, batch: list[tuple[Command, asyncio.Future[Any]]]) -> None:
        try:
            async with self._client.pipeline(transaction=False) as pipe:
                for command, _ in batch:
                    pipe.execute_command(*command)
                replies = await pipe.execute(raise_on_error=False)
        except BaseException as exc:
            for _, fut in batch:
                if not fut.done():
                    fut.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        for (_, fut), reply in zip(batch, replies, strict=True):
            if fut.done():
                continue
            if isinstance(reply, Exception):
                fut.set_exception(reply)
            else:
                fut.set_result(reply)

    async def aclose(self) -> None:
        if self._sending:
            await asyncio.gather(*self._sending, return_exceptions=True)
