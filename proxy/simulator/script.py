"""What the simulated model says, chosen by the last user message. Dialect-neutral.

A scenario is named in the last user message as `SCENARIO:<name>[:<arg>]`. Renderers
(one module per dialect) turn a `Script` into that dialect's exact wire format.

spanmeter's wrap-up note starts with `WRAP_UP_MARK` (a copy of proxy/govern/wrapup.py's
`MARK`: the simulator imports nothing of the proxy; tests/unit/test_wrap_up.py holds the
two equal). A request whose last user turn carries it is marked `notice`, and the note is
not "what the user said": the scenario comes from the user text before it. `SCENARIO:wrap_up` is an agent that
keeps calling its first tool (a new argument each turn) until a request carries the note,
and then answers.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import field, replace

from proxy.model import frozen

__all__ = ["SCENARIOS", "SCENARIO_HELP", "WRAPPED_UP", "WRAP_UP_MARK", "Request", "Script", "render_scenarios",
           "said", "script_for"]

_SCENARIO = re.compile(r"SCENARIO:([a-z_]+)(?::([0-9.]+))?")

GREETING = "Hello! I am the spanmeter simulator. Everything you see here is made up."
FENCED_JSON = (
    'Sure! Here is the JSON you asked for:\n```json\n'
    '{"name": "Ada Lovelace", "born": 1815, "tags": [\'math\', "poetry",],}\n'
    '```\nLet me know if you need more.'
)
CLEAN_JSON = '{"name": "Ada Lovelace", "born": 1815, "tags": ["math", "poetry"]}'
TRUNCATED_JSON = '{"name": "Ada Lovelace", "born": 1815, "tags": ["math", "poe'
# The start of spanmeter's wrap-up note: the simulator's own copy (it imports nothing of the proxy).
WRAP_UP_MARK = "[spanmeter] Budget notice"
WRAPPED_UP = "Final answer, with what I have so far: it is 14 C and sunny in Paris."


@frozen
class Request:
    """What a renderer extracted from the request."""

    model: str
    stream: bool
    last_user: str
    tool_result: str | None  # the result of the previous tool call, if this request carries one
    tools: tuple[str, ...]
    input_chars: int
    notice: bool = False  # the last user turn carries spanmeter's wrap-up note
    turns: int = 0  # messages (items, contents) in the request


@frozen
class Script:
    chunks: tuple[str, ...] = ()  # text, split as it will stream
    tool: tuple[str, str] | None = None  # (name, arguments JSON text)
    finish: str = "stop"  # stop | length | tool
    delay_s: float = 0.0  # between stream events
    error_status: int | None = None
    reset_after: int | None = None  # stream events before the connection is cut
    stall_s: float = 0.0  # before the status line: a slow or hung upstream
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    extra: dict[str, str] = field(default_factory=dict)
    hang_after: int | None = None  # stream events before the body stalls for good
    garbage: bool = False  # a body that is not JSON, or junk events inside the stream
    encoding: str | None = None  # Content-Encoding of the response: gzip, or br (undecodable)


def _words(text: str) -> tuple[str, ...]:
    parts = re.findall(r"\S+\s*|\s+", text)
    return tuple(parts) or ("",)


def _pieces(text: str, size: int = 6) -> tuple[str, ...]:
    return tuple(text[i : i + size] for i in range(0, len(text), size)) or ("",)


def _tool_call(req: Request, args: str) -> Script:
    # The first declared tool, or the one `TOOL=name` in the last user message names.
    m = re.search(r"TOOL=([A-Za-z0-9_.:-]+)", req.last_user)
    name = m.group(1) if m and m.group(1) in req.tools else req.tools[0] if req.tools else "get_weather"
    return Script(tool=(name, args), finish="tool")


def script_for(req: Request) -> Script:
    m = _SCENARIO.search(req.last_user)
    name, arg = (m.group(1), m.group(2)) if m else ("text", None)
    if "did not match the required JSON schema" in req.last_user:
        name = "json"  # a model that listens when its schema problems are fed back
    build = SCENARIOS.get(name, SCENARIOS["text"])
    s = build(req, arg)
    out_tokens = s.output_tokens or max(1, sum(len(c) for c in s.chunks) // 4) + (8 if s.tool else 0)
    return replace(s, input_tokens=max(1, req.input_chars // 4), output_tokens=out_tokens)


def said(texts: list[str]) -> tuple[str, bool]:
    """(the last thing the user said, whether the last user turn carries the wrap-up note),
    from the texts of the user turns in order."""
    notice = bool(texts) and WRAP_UP_MARK in texts[-1]
    for text in reversed(texts):
        text = text.split(WRAP_UP_MARK, 1)[0].strip() if WRAP_UP_MARK in text else text
        if text:
            return text, notice
    return "", notice


def _text(req: Request, arg: str | None) -> Script:
    return Script(_words(GREETING))


def _tool(req: Request, arg: str | None) -> Script:
    if req.tool_result is None:
        return _tool_call(req, '{"city": "Paris", "unit": "celsius"}')
    return Script(_words(f"The tool answered: {req.tool_result[:200]}. Done."))


def _loop(req: Request, arg: str | None) -> Script:
    # A model stuck on one call: the same tool, the same arguments, whatever it is told
    # (`PATH=/x` in the last user message changes the argument).
    m = re.search(r"PATH=(\S+)", req.last_user)
    return _tool_call(req, json.dumps({"path": m.group(1) if m else "/etc/config.yaml"}))


def _bad_args(req: Request, arg: str | None) -> Script:
    if req.tool_result is None:
        return _tool_call(req, "{'city': 'Paris', unit: \"celsius\",}")
    return Script(_words("Thanks, that worked."))


def _wrap_up(req: Request, arg: str | None) -> Script:
    if req.notice:
        return Script(_words(WRAPPED_UP))
    return _tool_call(req, json.dumps({"city": "Paris", "step": req.turns}))


def _long(req: Request, arg: str | None) -> Script:
    n = int(float(arg)) if arg else 50
    return Script(tuple(f"tok{i} " for i in range(n)))


SCENARIOS: dict[str, Callable[[Request, str | None], Script]] = {
    "text": _text,
    "tool": _tool,
    "loop": _loop,
    "bad_args": _bad_args,
    "wrap_up": _wrap_up,
    "json": lambda r, a: Script(_pieces(CLEAN_JSON)),
    "json_extra": lambda r, a: Script(_pieces(CLEAN_JSON[:-1] + ', "nickname": "Ada"}')),
    "json_fenced": lambda r, a: Script(_pieces(FENCED_JSON)),
    "truncated": lambda r, a: Script(_pieces(TRUNCATED_JSON), finish="length"),
    "braces": lambda r, a: Script(_words('Use the format {"name": "value"} as you were told.')),
    "slow": lambda r, a: Script(_words(GREETING), delay_s=float(a) if a else 0.05),
    "error": lambda r, a: Script(error_status=int(float(a)) if a else 500),
    "reset": lambda r, a: Script(_words(GREETING), reset_after=int(float(a)) if a else 3),
    "long": _long,
    "stall": lambda r, a: Script(_words(GREETING), stall_s=float(a) if a else 5.0),
    "cached": lambda r, a: Script(_words(GREETING), cached_tokens=8),
    "hang": lambda r, a: Script(_words(GREETING), hang_after=int(float(a)) if a else 2),
    "garbage": lambda r, a: Script(_words(GREETING), garbage=True),
    "gzip": lambda r, a: Script(_words(GREETING), encoding="gzip"),
    "br": lambda r, a: Script(_words(GREETING), encoding="br"),
}


# What each marker does, for `spanmeter simulate --scenarios` and docs/simulator.md; a
# test holds this to SCENARIOS, so a scenario cannot be added without saying what it does.
SCENARIO_HELP: dict[str, tuple[str, str]] = {
    "text": ("(no marker)", "A short greeting as plain text. Any message without a marker gets it."),
    "tool": ("SCENARIO:tool", "Asks for the request's first tool (get_weather when it declares none) with "
             '{"city": "Paris", "unit": "celsius"}; once the request carries the tool\'s result, '
             "answers with a sentence that quotes it."),
    "loop": ("SCENARIO:loop", "A stuck model: asks for the same tool with the same arguments every time "
             '({"path": "/etc/config.yaml"}; PATH=/x in the message changes the path). Trips the loop guard.'),
    "bad_args": ("SCENARIO:bad_args", "A tool call whose arguments are JSON5, not JSON "
                 "({'city': 'Paris', unit: \"celsius\",}); after the result, a short thanks."),
    "wrap_up": ("SCENARIO:wrap_up", "An agent that sees its budget coming: asks for the request's first tool "
                '({"city": "Paris", "step": N}, N new each turn) until the last user turn carries spanmeter\'s '
                "wrap-up note ([spanmeter] Budget notice), then answers with a final answer. The note's turn "
                "is not what the user said: the marker still comes from the text before it."),
    "json": ("SCENARIO:json", 'Clean JSON: {"name": "Ada Lovelace", "born": 1815, "tags": ["math", "poetry"]}. '
             "A message saying it \"did not match the required JSON schema\" (a repair retry) also gets it."),
    "json_extra": ("SCENARIO:json_extra", 'The JSON with an extra "nickname" property: valid JSON that '
                   "violates a schema with additionalProperties: false."),
    "json_fenced": ("SCENARIO:json_fenced", "The JSON in a ```json fence with prose around it, single quotes "
                    "and trailing commas: what structured-output repair is for."),
    "truncated": ("SCENARIO:truncated", "The JSON cut mid-string, with the dialect's finish reason for "
                  "hitting the token limit."),
    "braces": ("SCENARIO:braces", 'Plain text with literal braces (Use the format {"name": "value"} ...): '
               "must reach the client untouched."),
    "long": ("SCENARIO:long:N", "N words, tok0 tok1 ... (default 50): a long answer or stream."),
    "slow": ("SCENARIO:slow:S", "The greeting, streamed with S seconds between events (default 0.05)."),
    "stall": ("SCENARIO:stall:S", "Waits S seconds before the status line (default 5): a slow or hung upstream."),
    "hang": ("SCENARIO:hang:N", "Streams N events, then stalls for an hour (default 2): a body that stops."),
    "reset": ("SCENARIO:reset:N", "Streams N events, then resets the connection (default 3)."),
    "error": ("SCENARIO:error:STATUS", "Answers HTTP STATUS (default 500) with the dialect's error body; "
              "429 adds retry-after: 0."),
    "cached": ("SCENARIO:cached", "The greeting, with 8 of its input tokens reported as read from the "
               "prompt cache."),
    "garbage": ("SCENARIO:garbage", "Not JSON: a body cut mid-object, or, streamed, junk between events "
                "(a cut JSON line, a line with no field, bytes that are not UTF-8, an event with no data)."),
    "gzip": ("SCENARIO:gzip", "The greeting with Content-Encoding: gzip, flushed per event."),
    "br": ("SCENARIO:br", "Content-Encoding: br with bytes no brotli decoder accepts."),
}


def render_scenarios(markdown: bool = False) -> str:
    """The scenario list: a table for the terminal, or Markdown for docs/simulator.md."""
    rows = [SCENARIO_HELP[name] for name in SCENARIOS]
    if markdown:
        lines = ["| marker | what the simulated model does |", "|---|---|"]
        pipe, tick = "\\|", "\\`"
        lines += [f"| `{m}` | {d.replace('|', pipe).replace('`', tick)} |" for m, d in rows]
        return "\n".join(lines) + "\n"
    width = max(len(m) for m, _ in rows)
    out = ["Put a marker in the last user message; the simulator answers in the dialect of the route it",
           "was called on (chat, responses, messages, generateContent). N and S are numbers.", ""]
    for marker, text in rows:
        words, line, lines = text.split(), "", []
        for w in words:
            if line and len(line) + len(w) + 1 > 100 - width:
                lines.append(line)
                line = w
            else:
                line = f"{line} {w}" if line else w
        lines.append(line)
        out.append(f"  {marker.ljust(width)}  {lines[0]}")
        out += [f"  {' ' * width}  {rest}" for rest in lines[1:]]
    return "\n".join(out)
