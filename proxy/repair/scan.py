"""An incremental JSON5-to-JSON normaliser: the one scanner every repair path shares.

`Scanner` reads one value (it knows nothing of prose or fences) and writes strict JSON
pieces to `out`. It is fed text in pieces and keeps only an unfinished token as its tail,
so a stream costs linear time. Clean stretches of JSON are consumed by a few C-level
regex runs (members of an object, elements of an array); only brackets, JSON5-isms and
token boundaries take the per-token Python path.

Output that may still have to be dropped is held in `pending`: a comma (it may turn out
to be trailing), and an object key with its colon (a truncated member is dropped whole).
"""

from __future__ import annotations

import re

__all__ = ["MAX_DEPTH", "Scanner"]

MAX_DEPTH = 1000  # below orjson's 1024, so whatever we emit it can parse

_STR = r'"[^"\\\x00-\x1f]*(?:\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4})[^"\\\x00-\x1f]*)*"'
_NUM = r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?(?![\w.$])"
_LIT = r"(?:true|false|null)(?![\w$])"
_VAL = "(?:" + _STR + "|" + _NUM + "|" + _LIT + ")"
_W = r"[ \t\n\r]*"
# Runs of complete members (elements) joined by commas, ending at a value that is followed
# by ',' or the closing bracket. A run never ends inside a token and never commits a comma
# whose next member might be cut: that comma goes through the slow path, held.
_MEMBER = _STR + _W + ":" + _W + _VAL
_OBJ_RUN = re.compile(_MEMBER + "(?:" + _W + "," + _W + _MEMBER + ")*(?=" + _W + "[,}])")
_ARR_RUN = re.compile(_VAL + "(?:" + _W + "," + _W + _VAL + ")*(?=" + _W + r"[,\]])")
_CLEAN_STR = re.compile(_STR)
_KEY_COLON = re.compile(_STR + _W + ":")
_JSON_WS = re.compile(r"[ \t\n\r]+")
_OTHER_WS = "\f\v\u00a0\u1680\u2028\u2029\u202f\u205f\u3000\ufeff" + "".join(chr(c) for c in range(0x2000, 0x200B))
_ANY_WS = re.compile("[ \t\n\r" + _OTHER_WS + "]+")
_NUM5 = re.compile(r"[-+]?(?:0[xX][0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?|Infinity|NaN)")
_STRICT_NUM = re.compile(_NUM)
_IDENT = re.compile(r"(?:[^\W\d]|\$)[\w$]*")
_STR_RUN = re.compile(r"[^\"'\\\x00-\x1f]+")
_HEX4 = re.compile(r"[0-9a-fA-F]{4}")
_LOW_HALF = re.compile(r"\\(?:u(?:[dD](?:[c-fC-F][0-9a-fA-F]{0,2})?)?)?")  # a prefix of \uDC00-\uDFFF
_HEX2 = re.compile(r"[0-9a-fA-F]{2}")
_IDENT_CHARS = re.compile(r"[\w$.]")
_TOKEN = re.compile(r"[\w$.+\-]*")

_LITERALS = {"true": "true", "false": "false", "null": "null"}
_PY_LITERALS = {"True": "true", "False": "false", "None": "null"}
_SPECIAL = {"Infinity": "Infinity", "NaN": "NaN"}
_SIMPLE_ESC = {'"': '\\"', "\\": "\\\\", "/": "\\/", "b": "\\b", "f": "\\f", "n": "\\n"}
_SIMPLE_ESC |= {"r": "\\r", "t": "\\t", "'": "'", "v": "\\u000b", "0": "\\u0000"}
_CONTROL = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\b": "\\b", "\f": "\\f"}

# parser states
VALUE, KEY, COLON, AFTER, DONE = range(5)


class Scanner:
    """Reads one JSON5 value from text fed in pieces and writes strict JSON to `out`.

    `nonfinite` is what `NaN`/`Infinity` become: "keep" writes them as Python's json
    module reads them, "null" writes `null` (the only strict-JSON spelling).
    """

    def __init__(self, *, scalars: bool = True, nonfinite: str = "keep") -> None:
        self.out: list[str] = []
        self.pending: list[str] = []
        self.actions: list[str] = []
        self.stack: list[str] = []
        self.open_at: list[int] = []  # input position of each open bracket
        self.state = VALUE
        self.allow_close = False
        self.scalars = scalars
        self.nonfinite = nonfinite
        self.quote = ""  # inside a string: its quote character
        self.in_key = False
        self.comment = ""  # inside a comment: "line" or "block"
        self.tail = ""  # unconsumed input: an unfinished token
        self.base = 0  # input position of the current buffer's first character
        self.pos = 0  # input position just after what was consumed
        self._rest = ("", 0)
        self.started = False
        self.values = 0  # values (or runs of them) started so far, the outermost included
        self.done_at = -1
        self.error: tuple[int, str] | None = None
        self.too_deep = False  # the error is nesting deeper than MAX_DEPTH
        self.string_start = -1
        self.sent = 0  # index in `out` up to which `drain()` handed pieces out
        self.item_start = -1  # index in `out` where the current depth-1 array item starts
        # set to a list to collect depth-1 array items as (json text, is a run of several)
        self.items: list[tuple[str, bool]] | None = None

    # ---------------------------------------------------------------- feeding

    def drain(self) -> list[str]:
        """Take the output written since the last drain (keeps a collected item's text)."""
        pieces = self.out[self.sent :]
        if self.item_start < 0:
            self.out, self.sent = [], 0
        else:
            self.out = self.out[self.item_start :]
            self.sent = len(self.out)
            self.item_start = 0
        return pieces

    def feed(self, text: str) -> None:
        """Consume more input; stops at the end of the value or at an error."""
        if self.state == DONE or self.error:
            return
        buf = self.tail + text if self.tail else text
        self._scan(buf, 0, self.pos)

    def scan_from(self, text: str, start: int) -> None:
        """One-shot use: read the value starting at `text[start]` (no copy of the text)."""
        self._scan(text, start, 0)
        self.finish()

    def _scan(self, buf: str, i: int, base: int) -> None:
        self.base = base
        i = self.run(buf, i, final=False)
        self.tail = buf[i:] if self.state != DONE and not self.error else ""
        self.pos = base + i
        self._rest = (buf, i)

    @property
    def rest(self) -> str:
        """Unconsumed input of the last buffer: the text from an error on."""
        buf, i = self._rest
        return buf[i:]

    def finish(self) -> None:
        """The input ended: consume the unfinished token if it is a whole one, else keep
        it in `tail` (a cut token: `tru`, `-`, a dangling escape) for the caller to drop."""
        if not self.tail or self.state == DONE or self.error:
            return
        buf, self.tail = self.tail, ""
        self.base = self.pos
        i = self.run(buf, 0, final=True)
        if self.error and self.started and self.error[0] >= self.base + i:
            self.error = None  # the cut token itself is bad: it is dropped, not fatal
        self.tail = buf[i:] if self.state != DONE and not self.error else ""
        self.pos = self.base + i
        self._rest = (buf, i)

    @property
    def consumed(self) -> int:
        """Input position just after the last character consumed."""
        return self.pos

    @property
    def truncated(self) -> bool:
        return self.error is None and self.state != DONE and self.started

    def run(self, buf: str, i: int, final: bool) -> int:
        """Scan `buf` from `i`; returns where it stopped (end, end of value, or error)."""
        n = len(buf)
        step = self._step
        while i < n and self.state != DONE and self.error is None:
            j = step(buf, i, n, final)
            if j == i:  # an unfinished token at the end: wait for more input
                break
            i = j
        return i

    def _step(self, buf: str, i: int, n: int, final: bool) -> int:
        if self.quote:
            return self._string(buf, i, n, final)
        if self.comment:
            return self._in_comment(buf, i, n)
        c = buf[i]
        st = self.state
        if c in " \t\n\r":
            j = _JSON_WS.match(buf, i).end()  # type: ignore[union-attr]
            self._ws(buf[i:j])
            return j
        if st == KEY and c == '"':
            return self._obj_run(buf, i)
        if st == VALUE:
            if self.stack and self.stack[-1] == "[" and c in '"-0123456789tfn':
                return self._arr_run(buf, i, n, final)
            return self._value(buf, i, n, final, c)
        if c == "/":
            return self._comment(buf, i, n, final)
        if c in _OTHER_WS:
            return self._odd_ws(buf, i)
        if st == KEY:
            return self._key(buf, i, n, final, c)
        if st == COLON:
            if c == ":":
                self.pending.append(":")
                self.state, self.allow_close = VALUE, False
                return i + 1
            return self._fail(i, f"expected ':' after the key, found {c!r}")
        return self._after(i, c)

    # ---------------------------------------------------------------- output

    def _emit(self, s: str) -> None:
        if self.pending:
            self.out.extend(self.pending)
            self.pending.clear()
        self.out.append(s)

    def _ws(self, s: str) -> None:
        (self.pending if self.pending else self.out).append(s)

    def _act(self, action: str) -> None:
        if action not in self.actions:
            self.actions.append(action)

    def _fail(self, i: int, reason: str) -> int:
        self.error = (self.base + i, reason)
        return i

    # ---------------------------------------------------------------- values

    def _start_value(self) -> None:
        """Called before the first piece of any value is emitted."""
        if self.pending:
            self.out.extend(self.pending)
            self.pending.clear()
        self.started = True
        self.values += 1
        if self.items is not None and len(self.stack) == 1 and self.stack[0] == "[":
            self.item_start = len(self.out)

    def _value_done(self, i: int) -> None:
        if self.items is not None and self.item_start >= 0 and len(self.stack) == 1:
            self.items.append(("".join(self.out[self.item_start :]), False))
            self.item_start = -1
        if self.stack:
            self.state = AFTER
        else:
            self.state = DONE
            self.done_at = self.base + i

    def _value(self, buf: str, i: int, n: int, final: bool, c: str) -> int:
        if not self.stack and not self.scalars and c not in "{[ \t\n\r/" + _OTHER_WS:
            return self._fail(i, f"expected '{{' or '[', found {c!r}")
        if c == "{" or c == "[":
            return self._open(i, c)
        if c == '"' or c == "'":
            return self._string_start(buf, i, c)
        if c in "-+.0123456789":
            return self._number(buf, i, n, final)
        if c == "]" and self.allow_close and self.stack and self.stack[-1] == "[":
            return self._close(i, c)
        if c == "/":
            return self._comment(buf, i, n, final)
        if c in _OTHER_WS:
            return self._odd_ws(buf, i)
        m = _IDENT.match(buf, i)
        if m is None:
            return self._fail(i, f"expected a value, found {c!r}")
        if m.end() == n and not final:
            return i
        word = m.group()
        if word in _LITERALS:
            lit = word
        elif word in _PY_LITERALS:
            lit = _PY_LITERALS[word]
            self._act("python_literal")
        elif word in _SPECIAL:
            lit = "null" if self.nonfinite == "null" else word
            self._act("special_number")
        else:
            return self._fail(i, f"expected a value, found the word {word!r}")
        self._start_value()
        self.out.append(lit)
        self._value_done(m.end())
        return m.end()

    def _open(self, i: int, c: str) -> int:
        if len(self.stack) >= MAX_DEPTH:
            self.too_deep = True
            return self._fail(i, f"nesting deeper than {MAX_DEPTH} levels")
        self._start_value()
        self.out.append(c)
        self.stack.append(c)
        self.open_at.append(self.base + i)
        self.state = KEY if c == "{" else VALUE
        self.allow_close = True
        return i + 1

    def _close(self, i: int, c: str) -> int:
        if self.pending:  # a held comma before the bracket: trailing, dropped
            if self.pending[0] == ",":
                self._act("trailing_comma")
            self.out.extend(p for p in self.pending if p.isspace())
            self.pending.clear()
        self.out.append(c)
        self.stack.pop()
        self.open_at.pop()
        self._value_done(i + 1)
        return i + 1

    def _after(self, i: int, c: str) -> int:
        st, top = self.state, (self.stack[-1] if self.stack else "")
        if c == "," and st == AFTER:
            self.pending.append(",")
            self.state = KEY if top == "{" else VALUE
            self.allow_close = True
            return i + 1
        closes = (c == "}" and top == "{") or (c == "]" and top == "[")
        if closes and (st == AFTER or (st == KEY and self.allow_close)):
            return self._close(i, c)
        if c in "}]" and top:
            return self._fail(i, f"{c!r} does not close {top!r}")
        if st == KEY:
            return self._fail(i, f"expected a key or '}}', found {c!r}")
        return self._fail(i, f"expected ',' or a closing bracket, found {c!r}")

    def _number(self, buf: str, i: int, n: int, final: bool) -> int:
        if not final and _TOKEN.match(buf, i).end() == n:  # type: ignore[union-attr]
            return i  # the number may go on in the next piece
        m = _NUM5.match(buf, i)
        if m is None:
            return self._fail(i, f"bad number starting {buf[i : i + 8]!r}")
        j = m.end()
        if j == n and not final:
            return i
        if j < n and _IDENT_CHARS.match(buf, j):
            return self._fail(i, f"bad number {buf[i : j + 1]!r}")
        tok = m.group()
        self._start_value()
        self.out.append(tok if _STRICT_NUM.fullmatch(tok) else self._fix_number(tok))
        self._value_done(j)
        return j

    def _fix_number(self, tok: str) -> str:
        sign = "-" if tok[0] == "-" else ""
        body = tok.lstrip("+-")
        if body in _SPECIAL:
            self._act("special_number")
            if self.nonfinite == "null":
                return "null"
            return "NaN" if body == "NaN" else sign + body
        if body[:2] in ("0x", "0X"):
            self._act("hex")
            return sign + str(int(body, 16))
        if tok[0] == "+":
            self._act("special_number")
        mant, e, exp = body.replace("E", "e").partition("e")
        whole, dot, frac = mant.partition(".")
        if dot and not whole:
            self._act("leading_dot")
        elif (dot and not frac) or (len(whole) > 1 and whole[0] == "0"):
            self._act("special_number")
        whole = whole.lstrip("0") or "0"
        return sign + whole + ("." + (frac or "0") if dot else "") + (e + exp if e else "")

    # ---------------------------------------------------------------- keys

    def _obj_run(self, buf: str, i: int) -> int:
        m = _OBJ_RUN.match(buf, i)
        if m is None:
            k = _KEY_COLON.match(buf, i)
            if k is None:
                return self._string_start(buf, i, '"')
            self.pending.append(k.group())  # a clean key whose value is a container
            self.state, self.allow_close = VALUE, False
            return k.end()
        if self.pending:  # keys are not values: commit the held comma only
            self.out.extend(self.pending)
            self.pending.clear()
        j = m.end()
        self.out.append(buf[i:j])
        self.values += 1
        self.state = AFTER
        return j

    def _key(self, buf: str, i: int, n: int, final: bool, c: str) -> int:
        if c == "'":
            return self._string_start(buf, i, c)
        if c == "}":
            return self._after(i, c)
        m = _IDENT.match(buf, i)
        if m is None:
            return self._fail(i, f"expected a key or '}}', found {c!r}")
        if m.end() == n and not final:
            return i
        self._act("unquoted_key")
        self.pending.append('"' + m.group() + '"')
        self.state = COLON
        return m.end()

    # ---------------------------------------------------------------- strings

    def _string_start(self, buf: str, i: int, q: str) -> int:
        key = self.state == KEY
        if not key and self.state != VALUE:
            where = "key" if self.state == COLON else "value"
            return self._fail(i, f"unexpected string after a {where}")
        if q == '"' and not key:
            m = _CLEAN_STR.match(buf, i)
            if m is not None:
                self._start_value()
                self.out.append(m.group())
                self._value_done(m.end())
                return m.end()
        if q == "'":
            self._act("single_quotes")
        if key:
            self.pending.append('"')
        else:
            self._start_value()
            self.out.append('"')
        self.quote, self.in_key, self.string_start = q, key, self.base + i
        return i + 1

    def _string(self, buf: str, i: int, n: int, final: bool) -> int:
        sink = self.pending if self.in_key else self.out
        m = _STR_RUN.match(buf, i)
        if m is not None:
            sink.append(m.group())
            return m.end()
        c = buf[i]
        if c == self.quote:
            sink.append('"')
            self.quote = ""
            if self.in_key:
                self.state = COLON
            else:
                self._value_done(i + 1)
            return i + 1
        if c == '"':
            sink.append('\\"')
            return i + 1
        if c == "'":
            sink.append("'")
            return i + 1
        if c == "\\":
            return self._escape(buf, i, n, final, sink)
        self._act("string_escape")
        sink.append(_CONTROL.get(c) or f"\\u{ord(c):04x}")
        return i + 1

    def _escape(self, buf: str, i: int, n: int, final: bool, sink: list[str]) -> int:
        if i + 1 >= n:
            return i  # a dangling backslash: wait (or, at the end, it is dropped)
        c = buf[i + 1]
        if c == "u":
            m = _HEX4.match(buf, i + 2)
            if m is None:
                if n - i < 6:
                    return i  # cut inside the escape: wait, or at the end drop it
                self._act("string_escape")
                sink.append("u")
                return i + 2
            if "\ud800" <= chr(int(m.group(), 16)) <= "\udbff" and _cut_pair(buf, i + 6, n):
                return i  # a high surrogate whose low half may follow: wait, or at the end drop both
            sink.append(buf[i : i + 6])
            return i + 6
        if c == "x":
            m = _HEX2.match(buf, i + 2)
            if m is None and n - i < 4:
                return i
            self._act("string_escape")
            sink.append(f"\\u00{m.group()}" if m else "x")
            return i + 4 if m else i + 2
        if c in "\n\r\u2028\u2029":  # a line continuation
            self._act("string_escape")
            j = i + 2 + (c == "\r" and i + 2 < n and buf[i + 2] == "\n")
            return j
        if c in _SIMPLE_ESC:
            if c in "v0":
                self._act("string_escape")
            sink.append(_SIMPLE_ESC[c])
            return i + 2
        self._act("string_escape")
        sink.append(_CONTROL.get(c) or (c if c >= " " else f"\\u{ord(c):04x}"))
        return i + 2

    # ---------------------------------------------------------------- space, comments

    def _odd_ws(self, buf: str, i: int) -> int:
        j = _ANY_WS.match(buf, i).end()  # type: ignore[union-attr]
        self._act("whitespace")
        self._ws(" ")
        return j

    def _comment(self, buf: str, i: int, n: int, final: bool) -> int:
        if i + 1 >= n:
            return self._fail(i, "unexpected '/'") if final else i
        c = buf[i + 1]
        if c not in "/*":
            return self._fail(i, "unexpected '/'")
        self._act("comment")
        self.comment = "line" if c == "/" else "block"
        return self._in_comment(buf, i + 2, n)

    def _in_comment(self, buf: str, i: int, n: int) -> int:
        if self.comment == "line":
            j = buf.find("\n", i)
            if j == -1:
                return n
            self.comment = ""
            return j
        j = buf.find("*/", i)
        if j == -1:  # keep a final '*': it may start the '*/'
            return max(i, n - 1) if buf.endswith("*") else n
        self.comment = ""
        return j + 2

    # ---------------------------------------------------------------- arrays

    def _arr_run(self, buf: str, i: int, n: int, final: bool) -> int:
        m = _ARR_RUN.match(buf, i)
        if m is None:
            return self._value(buf, i, n, final, buf[i])
        j = m.end()
        if self.pending:
            self.out.extend(self.pending)
            self.pending.clear()
        self.started = True
        self.values += 1
        run = buf[i:j]
        if self.items is not None and len(self.stack) == 1:
            self.items.append(("[" + run + "]", True))
        self.out.append(run)
        self.state = AFTER
        return j

    # ---------------------------------------------------------------- the end

    def closing(self) -> list[str]:
        """What completes a truncated value: a cut string closed, a cut key dropped,
        open brackets closed. Call after `finish()`; `[]` when nothing can."""
        if self.error or not self.started or self.state == DONE:
            return []
        pieces: list[str] = []
        if self.quote and not self.in_key:
            pieces.append('"')
        # a held comma, a cut key, or a key without its value are dropped with `pending`
        pieces.extend("}" if b == "{" else "]" for b in reversed(self.stack))
        return pieces


def _cut_pair(buf: str, j: int, n: int) -> bool:
    """Does the buffer end at `j`, or inside what may be the low-surrogate escape that
    completes the high surrogate before `j`? Then the pair is cut (so far)."""
    return j == n or (n - j < 6 and _LOW_HALF.fullmatch(buf, j) is not None)
