"""What the proxy calls: repair a whole output, tool arguments, or a stream of text deltas.

Pure: text and a spec in, replacement text and a `Repair` record out. `None` as the
replacement means "leave the bytes alone" (they were clean, or could not be fixed);
`None` as the record means nothing was wrong.

A value cut off at the end is never completed unless the caller opts in
(`close_truncated`): it is recorded as truncated and passed on as received.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import orjson

from proxy.model import OutputSpec, Repair
from proxy.repair.extract import ExtractError, extract_json_report, ordered
from proxy.repair.stream import ValueStream
from proxy.repair.validate import SchemaError, problems

__all__ = ["StreamRepairer", "repair_arguments", "repair_output", "violation_feedback"]

TRUNCATED = "output was cut off before the JSON value ended (truncated); it was not completed"
_SCALAR_TYPES = frozenset({"string", "number", "integer", "boolean", "null"})


def repair_output(text: str, spec: OutputSpec, *, close_truncated: bool = False) -> tuple[str | None, Repair | None]:
    """Repair a whole structured-output text against `spec` (see the module docstring)."""
    return _repair(text, _schema(spec), "output", spec.kind != "json_schema", close_truncated)


def repair_arguments(
    args: str, schema: dict[str, Any] | None, call_id: str, *, close_truncated: bool = False
) -> tuple[str | None, Repair | None]:
    """Repair a tool call's arguments; they must be a JSON object. Empty arguments become
    `{}` only when the schema accepts an empty object."""
    target = f"tool:{call_id}"
    if not args.strip():
        found = _problems({}, schema, require_object=True) or []
        if found:
            empty = ("the arguments are empty", *found)
            return None, Repair(target, ("unrepairable",), False, empty)
        return "{}", Repair(target, ("empty_arguments",), None if schema is None else True)
    return _repair(args, schema, target, True, close_truncated)


def violation_feedback(problems: list[str]) -> str:
    """A message for the model: what was wrong, and to answer with corrected JSON only."""
    lines = "\n".join(f"- {p}" for p in problems)
    return (
        "Your previous reply did not match the required JSON schema:\n"
        f"{lines}\n"
        "Reply again with only the corrected JSON value: no prose, no code fences, "
        "no comments, and no fields the schema does not define."
    )


def _repair(
    text: str, schema: dict[str, Any] | None, target: str, require_object: bool, close: bool
) -> tuple[str | None, Repair | None]:
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError:
        pass
    else:
        found = _problems(value, schema, require_object)
        return None, (Repair(target, (), False, tuple(found)) if found else None)
    try:
        ext = extract_json_report(text, allow_partial=True)
    except ExtractError as exc:
        return None, Repair(target, ("unrepairable",), False, (exc.reason,))
    if ext.truncated and not close:
        return None, Repair(target, ("truncation",), False, (TRUNCATED,))
    try:
        fixed = orjson.dumps(ext.value).decode()
    except orjson.JSONEncodeError as exc:  # nesting orjson will not write
        return None, Repair(target, ("unrepairable",), False, (str(exc),))
    found = _problems(ext.value, schema, require_object)
    unjudged = found is None or (schema is None and not require_object)
    return fixed, Repair(target, ext.actions, None if unjudged else not found, tuple(found or ()))


def _schema(spec: OutputSpec) -> dict[str, Any] | None:
    return spec.schema if spec.kind != "json_object" else None


def _problems(value: Any, schema: dict[str, Any] | None, require_object: bool) -> list[str] | None:
    if require_object and not isinstance(value, dict):
        return [f"expected a JSON object at $, got {_kind(value)}"]
    if schema is None:
        return []
    try:
        return problems(value, schema)
    except SchemaError:
        return None  # the request's schema is broken: the output cannot be judged


def _kind(value: Any) -> str:
    if isinstance(value, list):
        return "an array"
    if isinstance(value, str):
        return "a string"
    if value is None:
        return "null"
    return "a boolean" if isinstance(value, bool) else "a number"


class _Lag:
    """How the text that came out compares with the text that went in: `behind` while
    the output is the input with its end still held back, `diverged` once it differs.
    Each input character is compared once, at most."""

    __slots__ = ("_at", "_held", "diverged")

    def __init__(self) -> None:
        self._held: deque[str] = deque()  # input pieces not yet matched by output
        self._at = 0  # in the first of them
        self.diverged = False

    @property
    def behind(self) -> bool:
        return bool(self._held)

    def fed(self, text: str) -> None:
        if text and not self.diverged:
            self._held.append(text)

    def finished(self) -> None:
        """No more output: input still held back was dropped."""
        if self._held:
            self.diverged = True
            self._held.clear()

    def emitted(self, text: str) -> None:
        i = 0
        while i < len(text) and not self.diverged:
            if not self._held:
                self.diverged = True  # more out than in
                break
            head = self._held[0]
            n = min(len(head) - self._at, len(text) - i)
            if not head.startswith(text[i : i + n], self._at):
                self.diverged = True
                break
            i, self._at = i + n, self._at + n
            if self._at == len(head):
                self._held.popleft()
                self._at = 0
        if self.diverged:
            self._held.clear()


class StreamRepairer:
    """Repairs a structured-output stream delta by delta.

    The concatenation of everything `feed` and `finish` return is the repaired JSON:
    fences and prose around the value dropped, JSON5-isms fixed. Clean JSON comes out
    byte for byte. Held back: only what might still be dropped (text before the value, a
    comma that may be trailing, an object key until its value starts, a token that may
    go on). Each character is scanned once.

    `behind` and `diverged` tell a caller holding the stream's events whether it may
    still send them as they came: while the output so far is the input so far with its
    end held back, and once the output caught up, nothing was changed.
    """

    def __init__(self, spec: OutputSpec, *, close_truncated: bool = False) -> None:
        self.spec = spec
        self.close_truncated = close_truncated
        self._schema = _schema(spec)
        starts, scalars = _starts(spec)
        self._stream = ValueStream(starts=starts, scalars=scalars, nonfinite="null")
        self._emitted: list[str] = []
        self._repair: Repair | None = None
        self._finished = False
        self._lag = _Lag()

    def feed(self, delta: str) -> str:
        self._lag.fed(delta)
        self._stream.feed(delta)
        return self._take()

    @property
    def behind(self) -> bool:
        """Some input has not come out yet, and what came out is the input unchanged."""
        return self._lag.behind

    @property
    def diverged(self) -> bool:
        """What came out is not the input: the repair changed something."""
        return self._lag.diverged

    def finish(self) -> str:
        if self._finished:
            return ""
        self._finished = True
        self._stream.finish(close=self.close_truncated)
        tail = self._take()
        self._lag.finished()
        self._repair = self._judge()
        return tail

    @property
    def emitted(self) -> str:
        """Everything `feed` and `finish` returned so far: the repaired value as delivered."""
        return "".join(self._emitted)

    @property
    def repair(self) -> Repair | None:
        """The record, once `finish()` was called (before that: actions seen so far)."""
        if self._finished:
            return self._repair
        actions = ordered(self._stream.actions)
        return Repair("output", actions) if actions else None

    def _take(self) -> str:
        text = "".join(self._stream.drain())
        if text:
            self._emitted.append(text)
            self._lag.emitted(text)
        return text

    def _judge(self) -> Repair | None:
        stream = self._stream
        actions = ordered(stream.actions)
        if stream.error is not None:
            return Repair("output", ordered((*actions, "unrepairable")), False, (stream.error[1],))
        if stream.truncated and not self.close_truncated:
            return Repair("output", actions, False, (TRUNCATED,))
        try:
            value = orjson.loads("".join(self._emitted))
        except orjson.JSONDecodeError as exc:
            return Repair("output", ordered((*actions, "unrepairable")), False, (str(exc),))
        found = _problems(value, self._schema, self.spec.kind != "json_schema")
        if not actions and not found:
            return None
        unjudged = found is None or (self._schema is None and self.spec.kind == "json_schema")
        return Repair("output", actions, None if unjudged else not found, tuple(found or ()))


def _starts(spec: OutputSpec) -> tuple[str, bool]:
    """Which brackets may open the value, and whether a top-level scalar may."""
    if spec.kind != "json_schema":
        return "{", False
    kind = (spec.schema or {}).get("type")
    kind = kind.lower() if isinstance(kind, str) else None
    if kind == "object":
        return "{", False
    if kind == "array":
        return "[", False
    return ("", True) if kind in _SCALAR_TYPES else ("{[", kind is None)
