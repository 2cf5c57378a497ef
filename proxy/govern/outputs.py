"""Repair on the response path: structured output and tool-call arguments. No dialect here.

Applies only when the request asked for structured output (`Call.output`) or declared
tools; plain text is never touched. Whole bodies are repaired in place, at the slots the
call's answer reader points to; streams are rewritten event by event by its API's own
rewriter, which hands this module the text and arguments as they stream (`StreamEdits`)
and sends what it gets back: a `StreamRepairer` each, holding back only what it must.
Every repair is recorded (`Hooks.repairs`, and `x-spanmeter-rewrites` for bodies).
`response_hooks` returns the call's verdict: once the answer is read, `retry()` says whether
to ask again (`repair.on_invalid: retry`) and with what.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import replace
from typing import Any, Final

import orjson

from proxy.config import Policy, RepairPolicy
from proxy.errors import SchemaViolation
from proxy.model import Call, OutputSpec, Repair, Rewrite, StreamEvent, ToolCall, frozen
from proxy.providers.answer import CallKey, Json
from proxy.providers.hooks import EventHook, Hooks
from proxy.providers.sse import SseEvent
from proxy.providers.translator import Answer
from proxy.repair import StreamRepairer, problems, repair_arguments, repair_output, violation_feedback

__all__ = ["HOLD_LIMIT", "NO_RETRY", "Retry", "Verdict", "install", "response_hooks"]

log = logging.getLogger("spanmeter.outputs")

# Bytes of events a stream's repair may hold back while it is only behind. Past this the
# events go out as the repair has them so far: a long answer under structured output that
# never becomes JSON still streams.
HOLD_LIMIT = 64 * 1024


@frozen
class Retry:
    """Ask the model again: the answer that did not match the schema, and the problems."""

    output: str
    feedback: str


class Verdict:
    """What the repair driver decided for one call, read once its answer is done."""

    __slots__ = ()

    def retry(self) -> Retry | None:
        """The retry to send (`repair.on_invalid: retry`), or None."""
        return None


NO_RETRY: Final = Verdict()  # a call whose output is not repaired (most): nothing to decide


def install(answer: Answer, policy: RepairPolicy) -> Verdict:
    """Add the body and stream hooks this call's answer needs, if any; the verdict they reach."""
    call, hooks = answer.call, answer.hooks
    if policy.mode == "off" or (call.output is None and not call.tools):
        return NO_RETRY
    body = _BodyRepair(answer, call, policy, hooks)
    hooks.on_body.append(body)
    if call.stream and policy.mode == "repair":
        edits = _StreamEdits(call, policy, hooks)
        rewriter = answer.rewriter(edits)
        if rewriter is not None:
            held = _HeldStream(rewriter, edits, hooks)
            hooks.on_event.append(held)
            hooks.holds.append(held)
            hooks.reads_text |= call.output is not None  # the text is repaired: no delta may be skipped
        elif call.output is not None:
            hooks.check_unrewritten = functools.partial(unrepaired_output, call.output)
    return body


def unrepaired_output(spec: OutputSpec, text: str, calls: tuple[ToolCall, ...]) -> str | None:
    """What a repair would have done to a streamed answer's declared output (its text, or the
    forced tool's arguments), as a span note: `output_not_repaired:fence+...`, or
    `output_invalid` when it does not match its schema even so; None when it was fine."""
    if spec.kind == "tool":
        args = next((c.arguments for c in calls if c.name == spec.name), None)
        if args is None:
            return None
        _, rep = repair_arguments(args, spec.schema, "output")
    else:
        _, rep = repair_output(text, spec)
    if rep is None:
        return None
    if rep.actions and rep.actions != ("unrepairable",):
        return "output_not_repaired:" + "+".join(rep.actions)
    return "output_invalid" if rep.valid is False or rep.actions else None


def _schema_of(call: Call, tool: str | None) -> dict[str, Any] | None:
    return next((t.parameters for t in call.tools if t.name == tool), None)


def _record(hooks: Hooks, policy: RepairPolicy, rep: Repair | None, changed: bool,
            body: _BodyRepair | None = None) -> None:
    if rep is None:
        return
    hooks.repairs.append(rep)
    if changed:
        hooks.rewrites.append(Rewrite("repair", f"{rep.target}:{'+'.join(rep.actions) or 'normalised'}"))
    if rep.valid is not False or "truncation" in rep.actions:
        return
    if policy.on_invalid == "retry" and rep.target == "output" and body is not None:
        body.feedback = violation_feedback(list(rep.problems))
        return
    if policy.on_invalid == "error":
        where = "the structured output" if rep.target == "output" else f"the arguments of tool call {rep.target[5:]}"
        raise SchemaViolation(
            f"The model's answer does not match the schema the request declared, even after repair. "
            f"Problems in {where}: " + "; ".join(rep.problems) + ". Ask again with clearer instructions, or set "
            "repair.on_invalid to `pass` for this tenant to receive such answers unchanged.")


class _BodyRepair(Verdict):
    """A whole answer: its text and each call's arguments, where the API module says they
    are; and the verdict on it (a retry when its output stayed invalid under on_invalid: retry)."""

    __slots__ = ("answer", "call", "feedback", "hooks", "output", "policy")

    def __init__(self, answer: Answer, call: Call, policy: RepairPolicy, hooks: Hooks) -> None:
        self.answer, self.call, self.policy, self.hooks = answer, call, policy, hooks
        self.feedback: str | None = None  # the problems, when the output should be asked for again
        self.output = ""  # the answer that did not match, shown to the model with the feedback

    def retry(self) -> Retry | None:
        return None if self.feedback is None else Retry(self.output, self.feedback)

    def __call__(self, parsed: object) -> bytes | None:
        if not isinstance(parsed, dict):
            return None
        changed = False
        if self.call.output is not None:
            changed |= self._output(parsed, self.call.output)
        for slot in self.answer.argument_slots(parsed):
            changed |= self._arguments(slot.holder, slot.key, slot.call_id, slot.name, parsed=slot.parsed)
        return orjson.dumps(parsed) if changed else None

    def _output(self, parsed: Json, spec: OutputSpec) -> bool:
        slots = self.answer.text_slots(parsed)
        if not slots:
            return False
        text = "".join(h[k] for h, k in slots)
        self.output = text
        new, rep = repair_output(text, spec, close_truncated=bool(self.policy.close_truncated))
        apply = new is not None and self.policy.mode == "repair"
        _record(self.hooks, self.policy, rep, apply, self)
        if apply:
            for i, (holder, key) in enumerate(slots):
                holder[key] = new if i == 0 else ""
            self.hooks.delivered_text = new
        return apply

    def _arguments(self, holder: Json, key: str, call_id: str, name: str | None, *, parsed: bool = False) -> bool:
        value = holder.get(key)
        schema = _schema_of(self.call, name)
        if isinstance(value, dict):  # sent already parsed (Anthropic input, Gemini args): validate only
            found = problems(value, schema) if schema else []
            if found:
                _record(self.hooks, self.policy, Repair(f"tool:{call_id}", (), False, tuple(found)), False)
            return False
        if not isinstance(value, str):
            return False
        new, rep = repair_arguments(value, schema, call_id, close_truncated=bool(self.policy.close_truncated))
        apply = new is not None and self.policy.mode == "repair"
        _record(self.hooks, self.policy, rep, apply)
        if apply and new is not None:
            holder[key] = orjson.loads(new) if parsed else new
            self.hooks.delivered_arguments[call_id] = new
        return apply


_TEXT = ("text",)  # the answer's text among the keys of `_StreamEdits._behind` (call keys are ints and strs)


class _StreamEdits:
    """The repair of one streamed answer (a `StreamEdits`): a repairer for its text, one
    per tool call's arguments. `behind` and `diverged` say, over all of them, whether the
    events that carried their input may still go out as they came (see _HeldStream)."""

    def __init__(self, call: Call, policy: RepairPolicy, hooks: Hooks) -> None:
        self.call, self.hooks = call, hooks
        self.close = bool(policy.close_truncated)
        # The status line has gone out: a violation found mid-stream is recorded, not raised.
        self.policy = policy.model_copy(update={"on_invalid": "pass"})
        self._text = StreamRepairer(call.output, close_truncated=self.close) if call.output else None
        self._args: dict[CallKey, tuple[StreamRepairer, str]] = {}  # key -> (repairer, call id)
        self._behind: set[Any] = set()  # the repairers holding back input they have not changed
        self.diverged = False  # some repairer changed its input

    @property
    def repairs_text(self) -> bool:
        return self._text is not None

    @property
    def behind(self) -> bool:
        return bool(self._behind)

    def _follow(self, key: Any, repairer: StreamRepairer, out: str) -> str:
        """`out`, after noting where `repairer` stands (kept per call, so asking is O(1))."""
        self.diverged |= repairer.diverged
        if repairer.behind:
            self._behind.add(key)
        else:
            self._behind.discard(key)
        return out

    def text(self, fragment: str) -> str:
        return fragment if self._text is None else self._follow(_TEXT, self._text, self._text.feed(fragment))

    def end_text(self) -> str:
        if self._text is None:
            return ""
        tail = self._follow(_TEXT, self._text, self._text.finish())
        _record(self.hooks, self.policy, self._text.repair, False)
        if self._text.repair is not None and self._text.repair.actions:
            self.hooks.delivered_text = self._text.emitted
        return tail

    def open_call(self, key: CallKey, call_id: str, name: str | None) -> None:
        if key not in self._args:
            spec = OutputSpec("tool", _schema_of(self.call, name), name)
            self._args[key] = (StreamRepairer(spec, close_truncated=self.close), call_id)

    def is_open(self, key: CallKey) -> bool:
        return key in self._args

    def open_calls(self) -> list[CallKey]:
        return list(self._args)

    def arguments(self, key: CallKey, fragment: str) -> str:
        repairer = self._args[key][0]
        return self._follow(key, repairer, repairer.feed(fragment))

    def end_arguments(self, key: CallKey) -> str:
        found = self._args.get(key)
        if found is None:
            return ""
        repairer, call_id = found
        tail = self._follow(key, repairer, repairer.finish())
        rep = repairer.repair
        if rep is not None:
            _record(self.hooks, self.policy, replace(rep, target=f"tool:{call_id}"), False)
            if rep.actions:
                self.hooks.delivered_arguments[call_id] = repairer.emitted
        return tail


class _HeldStream:
    """A stream's repair that never touches a stream needing none (a `relay.Holder`).

    The repairers hold back the end of what they were given (a `{` until its first key, a
    comma that may be trailing), so the rewriter's events cut the text elsewhere than the
    upstream did, with the same content. While the repair is only behind, whole events
    are held instead; once it has caught up they go out as they came, byte for byte, and
    nothing is recorded. Once it changed something (or the held bytes pass HOLD_LIMIT),
    the held events go out as the rewriter made them, and every later one does too: the
    change is recorded then. Each event is held at most once.
    """

    __slots__ = ("_edits", "_held", "_hooks", "_passing", "_recorded", "_rewriter", "_size")

    def __init__(self, rewriter: EventHook, edits: _StreamEdits, hooks: Hooks) -> None:
        self._rewriter, self._edits, self._hooks = rewriter, edits, hooks
        self._held: list[tuple[bytes, bytes | None]] = []  # (the event as it came, as rewritten)
        self._size = 0
        self._passing = False
        self._recorded = False

    @property
    def held(self) -> bool:
        return bool(self._held)

    def __call__(self, event: SseEvent, parsed: list[StreamEvent]) -> bytes | None:
        try:
            out = self._rewriter(event, parsed)
        except Exception:  # never cut a client's stream over a rewrite; and never reorder it
            log.exception("stream rewrite failed; forwarding the stream as the repair has it")
            self._passing = True
            return self._rewritten(event.raw, None)
        if self._passing:
            if out is not None:
                self._record()
            return out
        if self._edits.diverged or self._size > HOLD_LIMIT:
            self._passing = True
            return self._rewritten(event.raw, out)
        if self._edits.behind:
            self._held.append((event.raw, out))
            self._size += len(event.raw)
            return b""
        return self.release() + event.raw if self._held else None

    def release(self) -> bytes:
        """The held events as they came: the repair changed nothing in them (also at the
        stream's end, when it ended before the repair could finish)."""
        out = b"".join(raw for raw, _ in self._held)
        self._held, self._size = [], 0
        return out

    def _rewritten(self, raw: bytes, out: bytes | None) -> bytes:
        held = [*self._held, (raw, out)]
        self._held, self._size = [], 0
        if any(o is not None for _, o in held):
            self._record()
        return b"".join(raw if o is None else o for raw, o in held)

    def _record(self) -> None:
        if not self._recorded:  # on the span: the headers are gone by then
            self._recorded = True
            self._hooks.rewrites.append(Rewrite("repair", "stream"))


def response_hooks(answer: Answer, policy: Policy, *, retry: bool = False) -> Verdict:
    """The repair this call's answer gets under the tenant's policy (after the API's own
    stream filters, which the answer installed when it was opened), and its verdict."""
    repair = policy.repair
    if retry or answer.call.stream:  # one retry at most; a stream's status line is gone before the verdict
        repair = repair.model_copy(update={"on_invalid": "pass" if repair.on_invalid == "retry" else repair.on_invalid})
    return install(answer, repair)
