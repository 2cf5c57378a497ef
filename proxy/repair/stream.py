"""Finding and normalising the JSON value in a text stream, fed only the new text.

`ValueStream` is the transducer both `StreamRepairer` and `StreamExtractor` build on:
text before the value (prose, an opening fence) is held and dropped, the value goes
through the `Scanner` and out as soon as it is safe, text after it (a closing fence,
prose) is dropped. Clean JSON comes out byte for byte, including surrounding whitespace.

Each character is scanned once, except that a bracket in prose starts a *tentative*
value that is held until it looks like JSON (an object's first key and colon, an
array's first element); if it fails first, at most `TENTATIVE_LIMIT` characters are
scanned again as prose.
"""

from __future__ import annotations

import re

from proxy.repair.scan import DONE, VALUE, Scanner

__all__ = ["TENTATIVE_LIMIT", "ValueStream"]

TENTATIVE_LIMIT = 4096
_FENCE_OPEN = re.compile(r"```[ \t]*[\w+.-]*[ \t]*(?:\r?\n|(?=[{\[]))")
_FENCE_LINE_MAX = 64  # a line starting with ``` longer than this is not a fence opener
_SCALAR_START = '"-0123456789'
_WORD_START = "tfnTFNIN'+."

PRE, TENTATIVE, IN_VALUE, POST, RAW = range(5)


class ValueStream:
    """Feed text pieces, drain strict-JSON pieces. See the module docstring.

    `starts` limits which brackets may open the value (a schema of type object makes
    `[` in prose irrelevant); `scalars` allows a top-level string/number/literal when
    the text (or a fence) starts with one.
    """

    def __init__(
        self,
        *,
        starts: str = "{[",
        scalars: bool = True,
        nonfinite: str = "null",
        collect_items: bool = False,
    ) -> None:
        self.starts = starts
        self._candidate = re.compile("```|[" + re.escape(starts) + "]" if starts else "```")
        self.scalars = scalars
        self.nonfinite = nonfinite
        self.collect_items = collect_items
        self.phase = PRE
        self.out: list[str] = []
        self.actions: list[str] = []
        self.raw: list[str] = []  # every input piece while no value is committed
        self.buf = ""  # pre phase: unscanned text; tentative: text from the candidate on
        self.fresh = True  # nothing but whitespace seen since the start or a fence opener
        self.lead: list[str] = []  # that whitespace, emitted if a value starts right after
        self.scanner: Scanner | None = None
        self.fed = 0  # characters fed to the scanner
        self.post_ws: list[str] = []
        self.post_dirty = False
        self.post_ticks = False  # only backticks after the value so far: a closing fence, unless more follows
        self.error: tuple[int, str] | None = None

    # ---------------------------------------------------------------- public

    def feed(self, delta: str) -> None:
        if not delta:
            return
        if self.phase == IN_VALUE:
            self._value(delta)
        elif self.phase == POST:
            self._post(delta)
        elif self.phase == RAW:
            self.out.append(delta)
        else:
            self.raw.append(delta)
            self.buf += delta
            self._pre()

    def finish(self, *, close: bool = False) -> None:
        """The stream ended. A cut value is closed only when `close` is set; otherwise
        what was held (a comma, a cut key or token) goes out as received."""
        if self.phase == TENTATIVE and self.scanner is not None:
            self.scanner.finish()
            if self.scanner.state == DONE and not self.scanner.error:
                self._tentative()
        if self.phase in (PRE, TENTATIVE):
            self._no_value()
            return
        sc = self.scanner
        if self.phase == IN_VALUE and sc is not None:
            sc.finish()
            self._drain()
            if sc.state == DONE:
                self.phase = POST
            elif sc.error:
                self._fail_raw()
                return
            else:
                self._act("truncation")
                if close:
                    self.out.extend(sc.closing())
                else:
                    self.out.extend(sc.pending)
                    self.out.append(sc.tail)
                return
        if self.phase == POST and not self.post_dirty:
            self.out.extend(self.post_ws)
        if self.post_ticks and "prose" not in self.actions:
            self._act("fence")

    @property
    def done(self) -> bool:
        return self.phase == POST

    @property
    def truncated(self) -> bool:
        return "truncation" in self.actions

    def drain(self) -> list[str]:
        out, self.out = self.out, []
        return out

    # ---------------------------------------------------------------- phases

    def _act(self, action: str) -> None:
        if action not in self.actions:
            self.actions.append(action)

    def _pre(self) -> None:
        """Look for the value's start in `buf`: leading whitespace, a fence, or prose."""
        while self.buf:
            if self.phase == TENTATIVE:
                if not self._tentative():
                    return
                continue
            if self.phase != PRE:
                return
            buf = self.buf
            i = len(buf) - len(buf.lstrip())
            if i == len(buf):
                if self.fresh:
                    self.lead.append(buf)
                self.buf = ""
                return
            if self.fresh and self._try_start(buf, i):
                continue
            if "```".startswith(buf[i : i + 3]) and len(buf) - i < 3:
                return  # maybe the start of a fence: wait for more
            if buf.startswith("```", i):
                if not self._fence(buf, i):
                    return
                continue
            if not self._prose(buf, i):
                return

    def _try_start(self, buf: str, i: int) -> bool:
        c = buf[i]
        if self.scalars and c in _SCALAR_START:
            self.out.extend(self.lead)
            self.out.append(buf[:i])
            self._start_value(buf[i:])
            return True
        if c in self.starts or (self.scalars and c in _WORD_START):
            # held until it looks like JSON: `{name}` or `true story` may be prose
            self.lead.append(buf[:i])
            self.buf = buf[i:]
            self.phase, self.scanner, self.fed = TENTATIVE, self._new_scanner(), 0
            return True
        return False

    def _fence(self, buf: str, i: int) -> bool:
        """Drop a fence opener line; False when it is not complete yet."""
        m = _FENCE_OPEN.match(buf, i)
        if m is None:
            line_end = buf.find("\n", i)
            if line_end == -1 and len(buf) - i < _FENCE_LINE_MAX:
                self.buf = buf[i:]
                return False
            self._act("prose")
            self.fresh = False
            self.buf = buf[i + 3 :]
            return True
        self._act("fence")
        self.fresh, self.lead = True, []
        self.buf = buf[m.end() :]
        return True

    def _prose(self, buf: str, i: int) -> bool:
        """Skip prose up to the next candidate bracket or fence; False when none yet."""
        self.fresh, self.lead = False, []
        m = self._candidate.search(buf, i)
        if m is None or m.start() > i:
            self._act("prose")
        if m is None:
            keep = 2 if buf.endswith("``") else 1 if buf.endswith("`") else 0
            self.buf = buf[len(buf) - keep :] if keep else ""
            return False
        self.buf = buf[m.start() :]
        if m.group() != "```":
            self.phase = TENTATIVE
            self.scanner = self._new_scanner()
            self.fed = 0
        return True

    def _tentative(self) -> bool:
        """Feed the held candidate; commit it, drop it, or wait. True to go on."""
        sc = self.scanner
        assert sc is not None
        fresh = self.buf[self.fed :]
        sc.feed(fresh)
        self.fed = len(self.buf)
        looks = _looks_like_json(sc)  # judged on shape, so an error after it still commits
        if not looks and (sc.error or len(self.buf) > TENTATIVE_LIMIT):
            self.phase, self.scanner = PRE, None
            self.buf = self.buf[1:]
            self.fresh, self.lead = False, []
            self._act("prose")
            return True
        if not looks:
            return False
        if self.fresh:
            self.out.extend(self.lead)
        else:
            self._act("prose")
        buf, self.buf = self.buf, ""
        self.phase, self.raw = IN_VALUE, []
        self._drain()
        self._after_feed(buf)
        return True

    def _start_value(self, text: str) -> None:
        self.phase, self.raw, self.buf = IN_VALUE, [], ""
        self.scanner = self._new_scanner()
        self.fed = 0
        self._value(text)

    def _new_scanner(self) -> Scanner:
        sc = Scanner(scalars=self.scalars, nonfinite=self.nonfinite)
        if self.collect_items:
            sc.items = []
        return sc

    def _value(self, delta: str) -> None:
        sc = self.scanner
        assert sc is not None
        sc.feed(delta)
        self.fed += len(delta)
        self._drain()
        self._after_feed(delta)

    def _after_feed(self, delta: str) -> None:
        sc = self.scanner
        assert sc is not None
        if sc.state == DONE:
            self.phase = POST
            rest = delta[len(delta) - (self.fed - sc.consumed) :] if self.fed > sc.consumed else ""
            if rest:
                self._post(rest)
        elif sc.error:
            self._fail_raw()

    def _drain(self) -> None:
        sc = self.scanner
        assert sc is not None
        self.out.extend(sc.drain())
        for a in sc.actions:
            self._act(a)

    def _post(self, text: str) -> None:
        if "prose" in self.actions and self.post_dirty:
            return
        if not self.post_dirty and text.isspace():
            self.post_ws.append(text)
            return
        self.post_dirty = True
        # Backticks alone are a closing fence only if nothing but them follows: the verdict
        # waits for the end, so it does not depend on where the stream was cut.
        if text.replace("`", "").strip():
            self._act("prose")
        else:
            self.post_ticks = True

    def _fail_raw(self) -> None:
        """The committed value cannot be repaired: pass the rest through as received."""
        sc = self.scanner
        assert sc is not None
        self.error = sc.error
        self._act("unrepairable")
        self.out.extend(sc.pending)
        self.out.append(sc.rest)
        self.phase = RAW

    def _no_value(self) -> None:
        self.error = (0, "no JSON value found")
        self.actions = ["unrepairable"]  # nothing was changed: the text goes out as received
        self.out.append("".join(self.raw))
        self.raw = []
        self.phase = RAW


def _looks_like_json(sc: Scanner) -> bool:
    """A bracket from prose counts as the value once it is past its first key and colon
    (object) or has a first element (array): `{name}` and `[sic]` never get there."""
    if sc.state == DONE or sc.values >= 2:
        return True
    return len(sc.stack) == 1 and sc.stack[0] == "{" and sc.state == VALUE
