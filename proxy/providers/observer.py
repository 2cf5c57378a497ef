"""Folds stream events into an Outcome. Pure, synchronous, never raises into the relay."""

from __future__ import annotations

from collections.abc import Iterable

from proxy.model import (
    Finish,
    MetaEvent,
    Outcome,
    StreamError,
    StreamEvent,
    TextDelta,
    ToolCall,
    ToolCallDelta,
    Usage,
    UsageEvent,
)

__all__ = ["Observer"]


class Observer:
    """Accumulates what a response says, event by event.

    Text is kept as a list of pieces (joined once at the end) so a long stream costs
    linear time. Tool-call arguments are assembled per index from their fragments; the
    indexes are the answer's own, as its API module's reader numbers them (no wire format's rule
    lives here).
    """

    __slots__ = ("_args", "_calls", "_error", "_finish", "_id", "_model", "_notes", "_text", "_usage")

    def __init__(self) -> None:
        self._id: str | None = None
        self._model: str | None = None
        self._usage = Usage()
        self._text: list[str] = []
        self._finish: dict[int, str] = {}
        self._calls: dict[int, list[str | None]] = {}  # index -> [id, name]
        self._args: dict[int, list[str]] = {}
        self._error: StreamError | None = None
        self._notes: list[str] = []

    def feed(self, events: Iterable[StreamEvent]) -> None:
        for e in events:
            if isinstance(e, TextDelta):
                self._text.append(e.text)
            elif isinstance(e, ToolCallDelta):
                self._tool(e)
            elif isinstance(e, UsageEvent):
                self._usage = self._usage.merge(e.usage)
            elif isinstance(e, MetaEvent):
                self._id = e.response_id or self._id
                self._model = e.model or self._model
            elif isinstance(e, Finish):
                self._finish[e.index] = e.reason
            elif isinstance(e, StreamError):
                self._error = e

    def add_text(self, text: str) -> None:
        """A piece of the answer's text, as a TextDelta would bring it."""
        self._text.append(text)

    def add_texts(self, texts: list[str]) -> None:
        """Pieces of the answer's text, in order, as that many TextDeltas would bring them."""
        self._text.extend(texts)

    def note(self, note: str) -> None:
        if note not in self._notes:
            self._notes.append(note)

    @property
    def usage(self) -> Usage:
        return self._usage

    def _tool(self, e: ToolCallDelta) -> None:
        slot = self._calls.get(e.index)
        if slot is None:
            slot = self._calls[e.index] = [None, None]
            self._args[e.index] = []
        if e.id:
            slot[0] = e.id
        if e.name:
            slot[1] = e.name
        if e.complete:
            self._args[e.index] = [e.arguments]
        elif e.arguments:
            self._args[e.index].append(e.arguments)

    def tool_calls(self) -> tuple[ToolCall, ...]:
        return tuple(
            ToolCall(id=slot[0] or f"call_{i}", name=slot[1] or "", arguments="".join(self._args[i]) or "{}",
                     index=i)
            for i, slot in sorted(self._calls.items())
        )

    def text(self) -> str:
        return "".join(self._text)

    def finish(
        self, status: int, *, complete: bool = True, first_chunk_s: float | None = None
    ) -> Outcome:
        err = self._error
        return Outcome(
            status=status,
            response_id=self._id,
            response_model=self._model,
            usage=self._usage,
            finish_reasons=tuple(r for _, r in sorted(self._finish.items())),
            tool_calls=self.tool_calls(),
            text=self.text(),
            error_type=err.type if err else (None if status < 400 else str(status)),
            error_message=err.message if err else None,
            complete=complete,
            first_chunk_s=first_chunk_s,
            notes=tuple(self._notes),
        )
