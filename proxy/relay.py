"""Moves the upstream response to the client, feeding the observer on the way.

Bytes go to the client before the observer sees them only in the sense that
observation never delays or fails the write: a parse failure becomes an observer
note, never an exception into the stream. Streams are forwarded event by event,
as soon as each event is complete; everything read in one upstream chunk goes
out in one write.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import orjson
from aiohttp import web
from multidict import CIMultiDict

from proxy.errors import ProxyError
from proxy.model import Outcome, Repair, Rewrite, StreamError, StreamEvent
from proxy.observer import Observer
from proxy.providers.base import Framer, ProviderAdapter, SseEvent, parse_sse_event
from proxy.providers.shortcut import TextShortcut
from proxy.upstream import UpstreamResponse, response_headers

__all__ = ["BodyHook", "EventHook", "Flow", "Holder", "Hooks", "StreamRelay", "recorded_when_done", "relay"]

T = TypeVar("T")
log = logging.getLogger("spanmeter.relay")

EventHook = Callable[[SseEvent, list[StreamEvent]], bytes | None]
"""Returns replacement bytes for an event (b"" drops it) or None to forward it unchanged.
Unless `Hooks.reads_text`, it must forward a plain text delta (one the dialect's
`TextShape.plain` accepts) unchanged and learn nothing from it: such events may not be
shown to it at all."""



class Holder(Protocol):
    """An event hook that may hold events back (it answers b"" for them) and send them
    later, in order, with a later event's bytes or `release()`d at the stream's end. While
    it holds any, every event is offered to the hooks: none may overtake the held ones."""

    @property
    def held(self) -> bool: ...

    def release(self) -> bytes: ...


BodyHook = Callable[[object], bytes | None]
"""Given the parsed JSON body, returns a replacement body or None."""


@dataclass
class Flow:
    """What the relay learnt so far; owned by the handler so a cancelled relay loses nothing."""

    observer: Observer = field(default_factory=Observer)
    status: int = 0
    complete: bool = False
    first_chunk_s: float | None = None
    delivered_ns: int = 0
    chunk_gaps_s: list[float] = field(default_factory=list)  # time_per_output_chunk samples

    def outcome(self) -> Outcome:
        return self.observer.finish(self.status, complete=self.complete, first_chunk_s=self.first_chunk_s)


@dataclass
class Hooks:
    """Per-call response rewriting, chosen by the handler; every change is recorded."""

    on_event: list[EventHook] = field(default_factory=list)
    on_body: list[BodyHook] = field(default_factory=list)
    reads_text: bool = False  # an event hook must see every text delta (the answer's text is repaired)
    holds: list[Holder] = field(default_factory=list)  # the event hooks that may hold events back
    rewrites: list[Rewrite] = field(default_factory=list)
    repairs: list[Repair] = field(default_factory=list)
    retry_feedback: str | None = None  # set when repaired output should be asked for again
    retry_output: str = ""  # the answer that did not match, shown to the model with the feedback
    # What the agent received where a repair changed the model's answer (the observer keeps
    # what the model sent): the answer's text, and tool-call arguments by call id.
    delivered_text: str | None = None
    delivered_arguments: dict[str, str] = field(default_factory=dict)


def recorded_when_done(rewrite: EventHook, record: Rewrite, hooks: Hooks) -> EventHook:
    """`rewrite`, recording `record` once it first changes an event. A stream's headers
    leave before its body, so a stream rewrite is never announced there: it is on the
    span, and only if it happened (a usage chunk is dropped only if one came)."""
    done = False

    def hook(event: SseEvent, parsed: list[StreamEvent]) -> bytes | None:
        nonlocal done
        out = rewrite(event, parsed)
        if out is not None and not done:
            done = True
            hooks.rewrites.append(record)
        return out

    return hook


async def relay(
    request: web.Request,
    upstream: UpstreamResponse,
    adapter: ProviderAdapter,
    extra_headers: dict[str, str],
    hooks: Hooks,
    flow: Flow,
    started: float,
) -> web.StreamResponse:
    headers = response_headers(upstream.headers)
    headers.update(extra_headers)
    flow.status = upstream.status
    if upstream.is_sse and upstream.status < 300:
        return await _stream(request, upstream, adapter, headers, hooks, flow, started)
    return await _whole(upstream, adapter, headers, hooks, flow)


async def _whole(
    upstream: UpstreamResponse, adapter: ProviderAdapter, headers: CIMultiDict[str], hooks: Hooks, flow: Flow,
) -> web.StreamResponse:
    raw = await upstream.read()
    observer = flow.observer
    if upstream.status < 300:
        try:
            parsed = orjson.loads(raw)
        except orjson.JSONDecodeError:
            observer.note("unparsed_body")
        else:
            observer.feed(_safe(adapter.parse_response, parsed, observer))
            for hook in hooks.on_body:
                try:
                    replaced = hook(parsed)
                except ProxyError:
                    raise  # a decision (repair.on_invalid=error), not a failure
                except Exception:  # a rewrite that fails leaves the answer as it came
                    log.exception("response rewrite failed; forwarding the body unchanged")
                    observer.note("rewrite_failed")
                    continue
                if replaced is not None:
                    raw = replaced
    _stamp(headers, hooks)
    flow.complete = True
    return web.Response(body=raw, status=upstream.status, headers=headers)


async def _stream(
    request: web.Request, upstream: UpstreamResponse, adapter: ProviderAdapter,
    headers: CIMultiDict[str], hooks: Hooks, flow: Flow, started: float,
) -> web.StreamResponse:
    # Headers leave before the body, so rewrites decided up front are all that can be
    # listed here; stream repairs are recorded on the span.
    _stamp(headers, hooks)
    resp = web.StreamResponse(status=upstream.status, headers=headers)
    await resp.prepare(request)
    stream = StreamRelay(adapter, flow.observer, hooks)
    last = 0.0
    try:
        async for chunk in upstream.chunks():
            now = time.perf_counter()
            if flow.first_chunk_s is None:
                flow.first_chunk_s = now - started
            else:
                flow.chunk_gaps_s.append(now - last)
            last = now
            out = stream.feed(chunk)
            if out:
                await resp.write(out)
        out = stream.flush()
        if out:
            await resp.write(out)
        flow.complete = True
    except ProxyError as exc:
        # The status line is gone already: end the stream with the dialect's error event,
        # after what was held back of the answer.
        flow.observer.feed([_stream_error(exc)])
        await _try_write(resp, stream.release() + adapter.render_stream_error(exc))
    await _try_eof(resp)
    return resp


class StreamRelay:
    """What relaying one stream does between the upstream's chunks and the client's writes:
    frame the events, feed the observer, let the hooks rewrite.

    While no hook reads the answer's text (`Hooks.reads_text`), a text delta whose shape
    this stream has shown before is taken by its bytes (proxy/providers/shortcut.py): no
    parse, no event objects, its bytes forwarded as they came. Every other event is parsed
    and offered to the hooks.
    """

    __slots__ = ("_adapter", "_framer", "_hooks", "_observer", "_shortcut", "taken")

    def __init__(self, adapter: ProviderAdapter, observer: Observer, hooks: Hooks) -> None:
        self._adapter = adapter
        self._observer = observer
        self._hooks = hooks
        self._framer = Framer()
        shape = adapter.text_shape
        self._shortcut = None if shape is None or hooks.reads_text else TextShortcut(adapter, shape, observer)
        self.taken = 0  # events taken by their bytes, unparsed

    def feed(self, chunk: bytes) -> bytes:
        """The bytes to send the client for what `chunk` completes."""
        shortcut = self._shortcut
        if self._framer.single(chunk):
            if shortcut is not None and not self._holding() and shortcut.take(chunk, 0, len(chunk)):
                self.taken += 1
                return chunk
            out = self._event(chunk)
            return chunk if out is None else out
        ends = self._framer.begin(chunk)
        buf = ends.buf
        parts: list[bytes] = []
        sent, start = 0, ends.first  # buf[sent:start] goes out as it came
        while (end := ends.after(start)) != -1:
            if shortcut is not None and not self._holding() and shortcut.take(buf, start, end):
                self.taken += 1
            else:
                out = self._event(buf[start:end])
                if out is not None:
                    parts += (buf[sent:start], out)
                    sent = end
            start = end
        self._framer.keep(ends, start)
        if not parts:
            return buf[:start]
        parts.append(buf[sent:start])
        return b"".join(parts)

    def flush(self) -> bytes:
        """The bytes for an unterminated last event and what the hooks still hold, at the
        stream's end."""
        raw = self._framer.flush_raw()
        if raw is None:
            last = b""
        elif not raw.strip():
            last = raw  # line ends after the last event: no event, forwarded as they came
        else:
            out = self._event(raw)
            last = raw if out is None else out
        return last + self.release()

    def release(self) -> bytes:
        """What the hooks hold, as they hold it: the stream ends."""
        return b"".join(h.release() for h in self._hooks.holds)

    def _holding(self) -> bool:
        holds = self._hooks.holds
        return bool(holds) and any(h.held for h in holds)

    def _event(self, raw: bytes) -> bytes | None:
        """An event parsed in full, fed and offered to the hooks: its replacement, or None."""
        observer = self._observer
        event = parse_sse_event(raw)
        parsed = _safe(self._adapter.parse_event, event, observer)
        observer.feed(parsed)
        if self._shortcut is not None:
            self._shortcut.learn(event, parsed)
        # The first hook that claims an event decides its bytes; the hooks of one call never
        # claim the same events (the usage-only chunk has no text to repair).
        for hook in self._hooks.on_event:
            try:
                out = hook(event, parsed)
            except Exception:  # never cut a client's stream over a rewrite
                log.exception("stream rewrite failed; forwarding the event unchanged")
                observer.note("rewrite_failed")
                continue
            if out is not None:
                return out
        return None


def _safe(fn: Callable[[T], list[StreamEvent]], arg: T, observer: Observer) -> list[StreamEvent]:
    try:
        return fn(arg)
    except (ValueError, TypeError, KeyError, AttributeError, IndexError):
        observer.note("unparsed_event")
        return []


def _stream_error(exc: ProxyError) -> StreamEvent:
    return StreamError(exc.error_type, exc.message)


def _stamp(headers: CIMultiDict[str], hooks: Hooks) -> None:
    if hooks.rewrites:
        headers["x-spanmeter-rewrites"] = ", ".join(r.header_value() for r in hooks.rewrites)


async def _try_write(resp: web.StreamResponse, data: bytes) -> None:
    with contextlib.suppress(ConnectionError, RuntimeError):  # the client may be gone already
        await resp.write(data)


async def _try_eof(resp: web.StreamResponse) -> None:
    with contextlib.suppress(ConnectionError, RuntimeError):
        await resp.write_eof()
