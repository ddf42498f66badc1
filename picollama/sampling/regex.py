"""Regular expressions and fixed choices as GBNF (SGLang's ``regex`` and ``choices``).

``regex_to_gbnf(pattern)`` gives a grammar whose language is the strings ``pattern``
matches in full (``re.fullmatch``). The supported subset is that of a finite automaton:
literals and escapes (``\\n \\t \\r \\f \\v \\xHH \\uHHHH \\UHHHHHHHH``, escaped
punctuation), classes ``[...]`` / ``[^...]`` with ranges, ``.`` (anything but a newline),
``\\d \\w \\s`` and their negations (ASCII meanings, as ``re.ASCII``), groups ``(...)``
``(?:...)`` ``(?P<name>...)``, ``|``, quantifiers ``* + ? {m} {m,} {,n} {m,n}`` (lazy
forms too: the language is the same), and ``^``/``$``/``\\A``/``\\Z`` at the very start and
end. Anything else (backreferences, lookaround, ``\\b``, inline flags, possessive
quantifiers, anchors inside) is a ``RegexError`` (a ``GrammarError``) naming the column:
it is never widened to "any string".

Bounded repetitions above the GBNF limit (2000) are written as repetitions of chunks, so
``a{0,100000}`` is a grammar of a few hundred rules that still counts exactly.

The same translation serves JSON schema ``pattern`` (``json_string=True``): characters are
produced in their JSON-escaped form, and an unanchored pattern may be surrounded by any text,
as JSON schema's search semantics say.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from picollama.sampling.gbnf import GrammarError, gbnf_class, gbnf_literal

__all__ = [
    "RegexError",
    "regex_to_gbnf",
    "choices_to_gbnf",
    "RegexCompiler",
    "repeat_gbnf",
    "MAX_PATTERN_CHARS",
    "MAX_PATTERN_NESTING",
    "MAX_CHOICES",
]

MAX_PATTERN_CHARS = 1 << 16  # characters of one pattern
MAX_PATTERN_NESTING = 100  # nested groups (llama.cpp's MAX_PATTERN_DEPTH)
MAX_CHOICES = 1 << 16  # strings in one choices list
MAX_REPEAT_BOUND = 1 << 31  # largest {m,n} bound
_CHUNK = 1000  # repetitions written directly; larger counts are repetitions of chunks

_MAX_CP = 0x10FFFF
_SURROGATES = (0xD800, 0xDFFF)


class RegexError(GrammarError):
    """A pattern outside the supported subset, or not a valid pattern."""


# -- code point range sets ----------------------------------------------------------------------

Ranges = list[tuple[int, int]]


def _normalize(ranges: Ranges) -> Ranges:
    out: Ranges = []
    for lo, hi in sorted(r for r in ranges if r[0] <= r[1]):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _complement(ranges: Ranges) -> Ranges:
    out: Ranges = []
    nxt = 1  # code point 0 (NUL) never matches
    for lo, hi in _normalize(ranges):
        if lo > nxt:
            out.append((nxt, lo - 1))
        nxt = max(nxt, hi + 1)
    if nxt <= _MAX_CP:
        out.append((nxt, _MAX_CP))
    return _subtract(out, [_SURROGATES])


def _subtract(ranges: Ranges, remove: Ranges) -> Ranges:
    out: Ranges = []
    remove = _normalize(remove)
    for lo, hi in _normalize(ranges):
        cur = lo
        for rlo, rhi in remove:
            if rhi < cur or rlo > hi:
                continue
            if rlo > cur:
                out.append((cur, rlo - 1))
            cur = max(cur, rhi + 1)
            if cur > hi:
                break
        if cur <= hi:
            out.append((cur, hi))
    return out


def _intersect(a: Ranges, b: Ranges) -> Ranges:
    return _subtract(a, _complement(b) + [(0, 0)])


_DIGIT: Ranges = [(0x30, 0x39)]
_WORD: Ranges = [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)]
_SPACE: Ranges = [(0x09, 0x0D), (0x20, 0x20)]
_SHORTHAND = {
    "d": (_DIGIT, False),
    "D": (_DIGIT, True),
    "w": (_WORD, False),
    "W": (_WORD, True),
    "s": (_SPACE, False),
    "S": (_SPACE, True),
}
_CHAR_ESCAPES = {"n": 10, "t": 9, "r": 13, "f": 12, "v": 11, "a": 7}
_HEX_ESCAPES = {"x": 2, "u": 4, "U": 8}
_HEX = "0123456789abcdefABCDEF"


# -- the pattern's syntax tree --------------------------------------------------------------------
# nodes: ("chars", ranges) one code point from a set; ("seq", [nodes]); ("alt", [nodes]);
# ("rep", node, lo, hi_or_None); ("bol",) / ("eol",) anchors


class _Parser:
    def __init__(self, pattern: str):
        self.p = pattern
        self.n = len(pattern)

    def error(self, message: str, pos: int) -> RegexError:
        return RegexError(f"regex {message}", 1, pos + 1)

    def parse(self) -> tuple:
        p, n = self.p, self.n
        # frames: (alternatives (list of sequences), open position)
        frames: list[tuple[list[list[tuple]], int]] = [([[]], -1)]
        pos = 0
        while pos < n:
            c = p[pos]
            alts, _ = frames[-1]
            seq = alts[-1]
            if c == "(":
                start = pos
                pos += 1
                if p.startswith("?", pos):
                    if p.startswith("?:", pos):
                        pos += 2
                    elif p.startswith("?P<", pos) or (
                        p.startswith("?<", pos) and not p.startswith(("?<=", "?<!"), pos)
                    ):
                        close = p.find(">", pos)
                        if close < 0:
                            raise self.error("has an unterminated group name", start)
                        pos = close + 1
                    else:
                        what = "lookaround" if p.startswith(("?=", "?!", "?<"), pos) else "flags"
                        raise self.error(f"uses unsupported {what} '(?...'", start)
                if len(frames) > MAX_PATTERN_NESTING:
                    raise self.error(f"nests groups deeper than {MAX_PATTERN_NESTING}", start)
                frames.append(([[]], start))
                continue
            if c == ")":
                if len(frames) == 1:
                    raise self.error("has unbalanced parentheses", pos)
                alts, _ = frames.pop()
                frames[-1][0][-1].append(_alt(alts))
                pos += 1
                continue
            if c == "|":
                alts.append([])
                pos += 1
                continue
            if c in "*+?":
                pos = self.quantify(
                    seq, pos, (0, None) if c == "*" else (1, None) if c == "+" else (0, 1), pos + 1
                )
                continue
            if c == "{":
                bounds = self.braces(pos)
                if bounds is not None:
                    lo, hi, end = bounds
                    pos = self.quantify(seq, pos, (lo, hi), end)
                    continue
                seq.append(("chars", [(ord(c), ord(c))]))
                pos += 1
                continue
            if c == "[":
                node, pos = self.char_class(pos)
                seq.append(node)
                continue
            if c == ".":
                seq.append(("chars", _complement([(10, 10)])))
                pos += 1
                continue
            if c == "^":
                seq.append(("bol",))
                pos += 1
                continue
            if c == "$":
                seq.append(("eol",))
                pos += 1
                continue
            if c == "\\":
                node, pos = self.escape(pos, in_class=False)
                seq.append(node)
                continue
            seq.append(("chars", [(ord(c), ord(c))]))
            pos += 1
        if len(frames) > 1:
            raise self.error("has unbalanced parentheses", frames[-1][1])
        return _alt(frames[0][0])

    def quantify(self, seq: list, pos: int, bounds: tuple[int, int | None], end: int) -> int:
        lo, hi = bounds
        if not seq or seq[-1][0] in ("bol", "eol"):
            raise self.error("has nothing to repeat", pos)
        if seq[-1][0] == "rep" and seq[-1][4]:
            raise self.error("repeats a repetition (multiple repeat)", pos)
        if hi is not None and hi < lo:
            raise self.error(f"has a repetition {{{lo},{hi}}} with max < min", pos)
        if lo > MAX_REPEAT_BOUND or (hi is not None and hi > MAX_REPEAT_BOUND):
            raise self.error(f"has a repetition bound above {MAX_REPEAT_BOUND}", pos)
        if end < self.n and self.p[end] == "?":
            end += 1  # lazy: the same language
        elif end < self.n and self.p[end] == "+":
            raise self.error("uses a possessive quantifier", end)
        seq[-1] = ("rep", seq[-1], lo, hi, True)
        return end

    def braces(self, pos: int) -> tuple[int, int | None, int] | None:
        """``{m}``, ``{m,}``, ``{,n}``, ``{m,n}`` at ``pos``, or None (a literal '{')."""
        close = self.p.find("}", pos)
        if close < 0:
            return None
        body = self.p[pos + 1 : close]
        lo_s, comma, hi_s = body.partition(",")
        if not (lo_s.isdigit() or (comma and lo_s == "")) or not (hi_s == "" or hi_s.isdigit()):
            return None
        if not lo_s.isascii() or not hi_s.isascii():
            return None
        if len(lo_s) > 12 or len(hi_s) > 12:
            raise self.error("has a repetition bound that is too large", pos)
        lo = int(lo_s) if lo_s else 0
        if not comma:
            return lo, lo, close + 1
        return lo, (int(hi_s) if hi_s else None), close + 1

    def escape(self, pos: int, in_class: bool) -> tuple[tuple, int]:
        p = self.p
        if pos + 1 >= self.n:
            raise self.error("ends with a lone backslash", pos)
        e = p[pos + 1]
        if e in _SHORTHAND:
            ranges, negated = _SHORTHAND[e]
            return ("chars", _complement(ranges) if negated else list(ranges)), pos + 2
        if e in _CHAR_ESCAPES:
            cp = _CHAR_ESCAPES[e]
            return ("chars", [(cp, cp)]), pos + 2
        if e in _HEX_ESCAPES:
            size = _HEX_ESCAPES[e]
            digits = p[pos + 2 : pos + 2 + size]
            if len(digits) != size or any(d not in _HEX for d in digits):
                raise self.error(f"has a bad \\{e} escape", pos)
            cp = int(digits, 16)
            if cp == 0 or cp > _MAX_CP or _SURROGATES[0] <= cp <= _SURROGATES[1]:
                raise self.error(f"has an unsupported character U+{cp:04X}", pos)
            return ("chars", [(cp, cp)]), pos + 2 + size
        if in_class and e == "b":
            return ("chars", [(8, 8)]), pos + 2  # backspace inside a class, as in Python
        if not in_class and e in "AZ":
            return ("bol",) if e == "A" else ("eol",), pos + 2
        if e == "0" or e.isdigit():
            raise self.error(
                "uses a NUL character" if e == "0" else "uses a backreference (unsupported)", pos
            )
        if e.isascii() and e.isalnum():
            raise self.error(f"uses unsupported escape \\{e}", pos)
        return ("chars", [(ord(e), ord(e))]), pos + 2

    def char_class(self, pos: int) -> tuple[tuple, int]:
        p, n = self.p, self.n
        start = pos
        pos += 1
        negated = False
        if pos < n and p[pos] == "^":
            negated = True
            pos += 1
        ranges: Ranges = []
        first = True
        while True:
            if pos >= n:
                raise self.error("has an unterminated character class", start)
            c = p[pos]
            if c == "]" and not first:
                pos += 1
                break
            first = False
            if c == "\\":
                node, pos = self.escape(pos, in_class=True)
                item = node[1]
            else:
                item = [(ord(c), ord(c))]
                pos += 1
            # a range a-b: both ends single characters
            if (
                len(item) == 1
                and item[0][0] == item[0][1]
                and pos + 1 < n
                and p[pos] == "-"
                and p[pos + 1] != "]"
            ):
                if p[pos + 1] == "\\":
                    node, end = self.escape(pos + 1, in_class=True)
                    hi_item = node[1]
                else:
                    hi_item = [(ord(p[pos + 1]), ord(p[pos + 1]))]
                    end = pos + 2
                if len(hi_item) != 1 or hi_item[0][0] != hi_item[0][1]:
                    raise self.error("has a bad range in a character class", pos)
                lo, hi = item[0][0], hi_item[0][0]
                if hi < lo:
                    raise self.error("has a reversed range in a character class", pos)
                item = [(lo, hi)]
                pos = end
            ranges.extend(item)
        ranges = _subtract(_normalize(ranges), [(0, 0), _SURROGATES])
        if negated:
            ranges = _complement(ranges)
        return ("chars", ranges), pos


def _alt(alts: list[list[tuple]]) -> tuple:
    seqs = [("seq", s) for s in alts]
    return seqs[0] if len(seqs) == 1 else ("alt", seqs)


# -- GBNF output ------------------------------------------------------------------------------


def _quant(atom: str, lo: int, hi: int | None) -> str:
    if hi == 0:
        return ""
    if (lo, hi) == (0, 1):
        return atom + "?"
    if hi is None:
        return atom + ("*" if lo == 0 else "+" if lo == 1 else f"{{{lo},}}")
    if lo == hi:
        return atom if lo == 1 else f"{atom}{{{lo}}}"
    return f"{atom}{{{lo},{hi}}}"


def _join(*parts: str) -> str:
    return " ".join(p for p in parts if p)


def repeat_gbnf(atom: str, lo: int, hi: int | None, new_rule: Callable[[str], str]) -> str:
    """``atom`` (one GBNF symbol: a rule name, class or literal) repeated lo..hi times
    (hi None: no bound). Counts above the GBNF limit become repetitions of chunk rules
    made with ``new_rule(body) -> name``, so any bound stays exact in a small grammar."""
    if hi is not None and hi < lo:
        raise GrammarError(f"repetition with max {hi} < min {lo}")

    def exact(a: str, count: int) -> str:
        if count <= _CHUNK:
            return _quant(a, count, count)
        chunk = new_rule(_quant(a, _CHUNK, _CHUNK))
        q, r = divmod(count, _CHUNK)
        return _join(exact(chunk, q), _quant(a, r, r))

    def upto(a: str, count: int) -> str:
        if count <= _CHUNK:
            return _quant(a, 0, count)
        chunk = new_rule(_quant(a, _CHUNK, _CHUNK))
        q, r = divmod(count, _CHUNK)
        # count a*CHUNK + b: a < q with any b < CHUNK, or a == q with b <= r
        first = _join(upto(chunk, q - 1), _quant(a, 0, _CHUNK - 1))
        second = _join(exact(chunk, q), _quant(a, 0, r))
        return new_rule(first + " | " + second)

    if hi is None:
        if lo <= _CHUNK:
            return _quant(atom, lo, None)
        return _join(exact(atom, lo), atom + "*")
    if hi <= _CHUNK:
        return _quant(atom, lo, hi)
    return _join(exact(atom, lo), upto(atom, hi - lo))


_JSON_SHORT = {8: "\\b", 9: "\\t", 10: "\\n", 12: "\\f", 13: "\\r", 0x22: '\\"', 0x5C: "\\\\"}


def _json_char_alternatives(ranges: Ranges) -> list[str]:
    """GBNF for one code point of ``ranges`` as written inside a JSON string.

    Quote, backslash and control characters are written escaped. Control characters without
    a short escape (``\\u0001``...) are offered only when the class is mostly about them
    (a subset of the class is still correct, and keeps ``.`` small)."""
    plain = _subtract(ranges, [(0, 0x1F), (0x22, 0x22), (0x5C, 0x5C)])
    out = [gbnf_class(plain)] if plain else []
    special = [
        cp
        for lo, hi in _intersect(ranges, [(1, 0x1F), (0x22, 0x22), (0x5C, 0x5C)])
        for cp in range(lo, hi + 1)
    ]
    rare = [cp for cp in special if cp not in _JSON_SHORT]
    for cp in special:
        if cp in _JSON_SHORT or not plain or len(rare) <= 4:
            out.append(gbnf_literal(_JSON_SHORT.get(cp, f"\\u{cp:04x}")))
    return out


class RegexCompiler:
    """Turns patterns into GBNF rules, adding them to ``rules`` (name -> body)."""

    def __init__(self, rules: dict[str, str], json_string: bool = False):
        self.rules = rules
        self.json_string = json_string
        self._dot_rule: str | None = None
        self._by_body: dict[tuple[str, str], str] = {}

    def new_rule(self, base: str, body: str) -> str:
        """A rule named after ``base`` with ``body`` (the same body reuses one rule)."""
        got = self._by_body.get((base, body))
        if got is not None:
            return got
        i = len(self.rules)
        while f"{base}-{i}" in self.rules:
            i += 1
        name = self._by_body[(base, body)] = f"{base}-{i}"
        self.rules[name] = body
        return name

    def compile(self, pattern: str, name: str, search: bool = False) -> str:
        """A GBNF expression for the strings ``pattern`` matches in full, or (``search``)
        that contain a match (anchors ``^``/``$`` then pin it to the start or end)."""
        if not isinstance(pattern, str):
            raise RegexError(f"pattern must be a string, got {type(pattern).__name__}")
        if len(pattern) > MAX_PATTERN_CHARS:
            raise RegexError(f"pattern has {len(pattern)} characters, above {MAX_PATTERN_CHARS}")
        tree = _Parser(pattern).parse()
        alts = tree[1] if tree[0] == "alt" else [tree]
        out = []
        for alt in alts:
            items = list(alt[1])
            at_start = at_end = False
            while items and items[0][0] == "bol":
                items.pop(0)
                at_start = True
            while items and items[-1][0] == "eol":
                items.pop()
                at_end = True
            body = self._emit(("seq", items), name, pattern)
            if search:
                anything = self._any_text(name)
                body = _join("" if at_start else anything, body, "" if at_end else anything)
            out.append(body or '""')
        return out[0] if len(out) == 1 else "(" + " | ".join(out) + ")"

    def _any_text(self, name: str) -> str:
        if self._dot_rule is None:
            self._dot_rule = self.new_rule(name + "-any", self._chars(_complement([])) + "*")
        return self._dot_rule

    def _chars(self, ranges: Ranges) -> str:
        if not ranges:
            raise RegexError("pattern has an empty character class (matches nothing)")
        if not self.json_string:
            return gbnf_class(ranges)
        alts = _json_char_alternatives(ranges)
        if len(alts) == 1:
            return alts[0]
        return self.new_rule("char", " | ".join(alts))

    def _emit(self, node: tuple, name: str, pattern: str) -> str:
        kind = node[0]
        if kind == "chars":
            return self._chars(node[1])
        if kind in ("bol", "eol"):
            raise RegexError(f"regex {pattern!r} has an anchor inside the pattern (unsupported)")
        if kind == "seq":
            parts: list[str] = []
            literal: list[str] = []
            for item in node[1]:
                if item[0] == "chars" and len(item[1]) == 1 and item[1][0][0] == item[1][0][1]:
                    cp = item[1][0][0]
                    if self.json_string:
                        alts = _json_char_alternatives([(cp, cp)])
                        literal.append(alts[0] if alts[0].startswith('"') else chr(cp))
                    else:
                        literal.append(chr(cp))
                    continue
                if literal:
                    parts.append(self._literal(literal))
                    literal = []
                parts.append(self._emit(item, name, pattern))
            if literal:
                parts.append(self._literal(literal))
            return _join(*parts)
        if kind == "alt":
            return "(" + " | ".join(self._emit(a, name, pattern) or '""' for a in node[1]) + ")"
        if kind == "rep":
            inner, lo, hi = node[1], node[2], node[3]
            body = self._emit(inner, name, pattern)
            if inner[0] == "chars":
                atom = body  # a class, a one-character literal or a rule name
            else:
                atom = self.new_rule(name, body or '""')
            return repeat_gbnf(atom, lo, hi, lambda b: self.new_rule(name, b))
        raise AssertionError(kind)  # pragma: no cover

    @staticmethod
    def _literal(chars: list[str]) -> str:
        # pieces that are already GBNF literals (JSON escapes) stay as they are
        out: list[str] = []
        run = ""
        for ch in chars:
            if len(ch) > 1:
                if run:
                    out.append(gbnf_literal(run))
                    run = ""
                out.append(ch)
            else:
                run += ch
        if run:
            out.append(gbnf_literal(run))
        return " ".join(out)


def regex_to_gbnf(pattern: str) -> str:
    """A GBNF grammar (root ``root``) for the strings ``pattern`` fully matches."""
    rules: dict[str, str] = {}
    expr = RegexCompiler(rules).compile(pattern, "root")
    return _format({"root": expr or '""', **rules})


def choices_to_gbnf(choices: Sequence[str]) -> str:
    """A GBNF grammar matching exactly one of ``choices``."""
    if isinstance(choices, str) or not isinstance(choices, Sequence):
        raise GrammarError("choices must be a list of strings")
    if not choices:
        raise GrammarError("choices is empty: nothing could be generated")
    if len(choices) > MAX_CHOICES:
        raise GrammarError(f"{len(choices)} choices, above {MAX_CHOICES}")
    seen: dict[str, None] = {}
    for i, c in enumerate(choices):
        if not isinstance(c, str):
            raise GrammarError(f"choice {i} is not a string: {c!r}")
        if "\x00" in c:
            raise GrammarError(f"choice {i} contains a NUL character")
        seen.setdefault(c, None)
    return _format({"root": " | ".join(gbnf_literal(c) for c in seen)})


def _format(rules: dict[str, str]) -> str:
    return "".join(f"{name} ::= {body}\n" for name, body in rules.items())
