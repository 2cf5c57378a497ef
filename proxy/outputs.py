"""Repair on the response path: structured output and tool-call arguments. No dialect here.

Applies only when the request asked for structured output (`Call.output`) or declared
tools; plain text is never touched. Whole bodies are repaired in place, at the slots the
call's API module points to; streams are rewritten event by event by the module's own
rewriter, which hands this module the text and arguments as they stream (`StreamEdits`)
and sends what it gets back: a `StreamRepairer` each, holding back only what it must.
Every repair is recorded (`Hooks.repairs`, and `x-spanmeter-rewrites` for bodies).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import orjson

from proxy.config import RepairPolicy
from proxy.errors import SchemaViolation
from proxy.model import Call, OutputSpec, Repair, Rewrite
from proxy.providers.answer import CallKey, Json
from proxy.providers.base import ProviderAdapter
from proxy.relay import Hooks, recorded_when_done
from proxy.repair import StreamRepairer, problems, repair_arguments, repair_output, violation_feedback

__all__ = ["install"]


def install(adapter: ProviderAdapter, call: Call, policy: RepairPolicy, hooks: Hooks) -> None:
    """Add the body and stream hooks this call needs, if any."""
    if policy.mode == "off" or (call.output is None and not call.tools):
        return
    hooks.on_body.append(_BodyRepair(adapter, call, policy, hooks))
    if call.stream and policy.mode == "repair":
        rewriter = adapter.stream_rewriter(_StreamEdits(call, policy, hooks))
        if rewriter is not None:
            # Recorded (on the span: the headers are gone by then) only once it changes an event.
            hooks.on_event.append(recorded_when_done(rewriter, Rewrite("repair", "stream"), hooks))
            hooks.reads_text |= call.output is not None  # the text is repaired: no delta may be skipped


def _schema_of(call: Call, tool: str | None) -> dict[str, Any] | None:
    return next((t.parameters for t in call.tools if t.name == tool), None)


def _record(hooks: Hooks, policy: RepairPolicy, rep: Repair | None, changed: bool) -> None:
    if rep is None:
        return
    hooks.repairs.append(rep)
    if changed:
        hooks.rewrites.append(Rewrite("repair", f"{rep.target}:{'+'.join(rep.actions) or 'normalised'}"))
    if rep.valid is not False or "truncation" in rep.actions:
        return
    if policy.on_invalid == "retry" and rep.target == "output":
        hooks.retry_feedback = violation_feedback(list(rep.problems))
        return
    if policy.on_invalid == "error":
        where = "the structured output" if rep.target == "output" else f"the arguments of tool call {rep.target[5:]}"
        raise SchemaViolation(
            f"The model's answer does not match the schema the request declared, even after repair. "
            f"Problems in {where}: " + "; ".join(rep.problems) + ". Ask again with clearer instructions, or set "
            "repair.on_invalid to `pass` for this tenant to receive such answers unchanged.")


class _BodyRepair:
    """A whole answer: its text and each call's arguments, where the API module says they are."""

    def __init__(self, adapter: ProviderAdapter, call: Call, policy: RepairPolicy, hooks: Hooks) -> None:
        self.adapter, self.call, self.policy, self.hooks = adapter, call, policy, hooks

    def __call__(self, parsed: object) -> bytes | None:
        if not isinstance(parsed, dict):
            return None
        changed = False
        if self.call.output is not None:
            changed |= self._output(parsed, self.call.output)
        for holder, key, call_id, name in self.adapter.argument_slots(parsed):
            changed |= self._arguments(holder, key, call_id, name)
        return orjson.dumps(parsed) if changed else None

    def _output(self, parsed: Json, spec: OutputSpec) -> bool:
        slots = self.adapter.text_slots(parsed)
        if not slots:
            return False
        text = "".join(h[k] for h, k in slots)
        self.hooks.retry_output = text
        new, rep = repair_output(text, spec, close_truncated=bool(self.policy.close_truncated))
        apply = new is not None and self.policy.mode == "repair"
        _record(self.hooks, self.policy, rep, apply)
        if apply:
            for i, (holder, key) in enumerate(slots):
                holder[key] = new if i == 0 else ""
            self.hooks.delivered_text = new
        return apply

    def _arguments(self, holder: Json, key: str, call_id: str, name: str | None) -> bool:
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
            holder[key] = new
            self.hooks.delivered_arguments[call_id] = new
        return apply


class _StreamEdits:
    """The repair of one streamed answer (a `StreamEdits`): a repairer for its text, one
    per tool call's arguments."""

    def __init__(self, call: Call, policy: RepairPolicy, hooks: Hooks) -> None:
        self.call, self.hooks = call, hooks
        self.close = bool(policy.close_truncated)
        # The status line has gone out: a violation found mid-stream is recorded, not raised.
        self.policy = policy.model_copy(update={"on_invalid": "pass"})
        self._text = StreamRepairer(call.output, close_truncated=self.close) if call.output else None
        self._args: dict[CallKey, tuple[StreamRepairer, str]] = {}  # key -> (repairer, call id)

    @property
    def repairs_text(self) -> bool:
        return self._text is not None

    def text(self, fragment: str) -> str:
        return fragment if self._text is None else self._text.feed(fragment)

    def end_text(self) -> str:
        if self._text is None:
            return ""
        tail = self._text.finish()
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
        return self._args[key][0].feed(fragment)

    def end_arguments(self, key: CallKey) -> str:
        found = self._args.get(key)
        if found is None:
            return ""
        repairer, call_id = found
        tail = repairer.finish()
        rep = repairer.repair
        if rep is not None:
            _record(self.hooks, self.policy, replace(rep, target=f"tool:{call_id}"), False)
            if rep.actions:
                self.hooks.delivered_arguments[call_id] = repairer.emitted
        return tail
