"""GBNF: llama.cpp's grammar format, parsed into llama.cpp's rule representation.

A grammar is a list of rules; a rule is a flat list of ``(GType, value)`` elements, its
alternatives separated by ``ALT`` and closed by ``END``, exactly as ``llama_grammar_parser``
builds them: groups ``( ... )`` and repetitions become generated rules named
``<rule>_<id>``, and a character class is one ``CHAR``/``CHAR_NOT``/``CHAR_ANY`` element
followed by ``CHAR_ALT`` and ``CHAR_RNG_UPPER`` elements. Symbol ids are handed out in the
order llama.cpp hands them out, so ``symbol_ids`` and ``rules`` equal its parser's.

Syntax (llama.cpp's ``grammars/README.md``): ``name ::= alternatives`` with names of
``[a-zA-Z0-9-]``; literals ``"..."``; classes ``[...]`` / ``[^...]`` with ranges; ``.``;
escapes ``\\n \\r \\t \\\\ \\" \\[ \\] \\- \\xHH \\uHHHH \\UHHHHHHHH``; groups; ``|``;
repetition ``* + ? {m} {m,} {m,n}``; ``# comments``; tokens ``<[id]>``, ``<text>`` and their
negations ``!<[id]>``; a newline ends a rule except inside parentheses or after ``|``.

Limits (each a ``GrammarError`` naming line and column; llama.cpp's own limit is marked):

- ``MAX_GRAMMAR_CHARS``: grammar text size.
- ``MAX_RULES``: rules the text defines; ``MAX_SYMBOLS``: rules including generated ones.
- ``MAX_NESTING``: depth of nested parentheses (the parser keeps its own stack, so any
  depth up to the limit costs no Python recursion).
- ``MAX_REPETITION`` (llama.cpp's ``MAX_REPETITION_THRESHOLD``): ``{m}`` with m above it is
  refused, as is a repetition whose generated rules (nested repetitions multiply) exceed it;
  an upper bound above it means "no upper bound", as in llama.cpp. ``{m,n}`` with n < m is
  refused (llama.cpp would loop forever).
- ``MAX_ELEMENTS``: total elements after expanding repetitions.
- Left recursion is refused: llama.cpp's check (leftmost references, skipping rules with an
  empty alternative) and, beyond it, any left-recursive cycle through rules that can match
  the empty string which would make the parse stack grow (llama.cpp hangs on those).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum

__all__ = [
    "GType",
    "GrammarError",
    "ParsedGrammar",
    "parse_gbnf",
    "format_rules",
    "gbnf_literal",
    "gbnf_class",
    "MAX_GRAMMAR_CHARS",
    "MAX_RULES",
    "MAX_SYMBOLS",
    "MAX_NESTING",
    "MAX_REPETITION",
    "MAX_ELEMENTS",
]

MAX_GRAMMAR_CHARS = 1 << 20  # 1 Mi characters of grammar text
MAX_RULES = 4096  # rules defined by the text (``name ::= ...``)
MAX_SYMBOLS = 1 << 16  # rules including those generated for groups and repetitions
MAX_NESTING = 256  # nested parentheses
MAX_REPETITION = 2000  # llama.cpp's MAX_REPETITION_THRESHOLD
MAX_ELEMENTS = 1 << 20  # elements of all rules after expanding repetitions


class GType(IntEnum):
    """llama.cpp's ``llama_gretype``."""

    END = 0  # end of a rule definition
    ALT = 1  # start of an alternate definition for a rule
    RULE_REF = 2  # non-terminal: the value is a rule id
    CHAR = 3  # terminal: a code point, or the first of a class
    CHAR_NOT = 4  # first element of an inverse class ([^...])
    CHAR_RNG_UPPER = 5  # upper bound of a range whose lower bound is the element before
    CHAR_ALT = 6  # one more code point (or range start) of the class
    CHAR_ANY = 7  # any code point (.)
    TOKEN = 8  # one vocabulary token, by id
    TOKEN_NOT = 9  # any token but this id


class GrammarError(ValueError):
    """A grammar (or schema, or regex) that cannot be built, with where it went wrong.

    ``line`` and ``column`` count from 1 and point into the grammar text (``None`` where no
    position applies).
    """

    def __init__(self, message: str, line: int | None = None, column: int | None = None):
        self.message = message
        self.line = line
        self.column = column
        where = f" at line {line}, column {column}" if line is not None else ""
        super().__init__(message + where)


Element = tuple[int, int]


@dataclass
class ParsedGrammar:
    """The parser's output: ``symbol_ids`` (name -> id) and ``rules`` (indexed by id)."""

    text: str
    symbol_ids: dict[str, int]
    rules: list[list[Element]]
    # where each symbol was defined (or, for generated ones, the construct that made it),
    # and where each was first referenced: offsets into ``text``
    defined_at: dict[int, int] = field(default_factory=dict)
    referenced_at: dict[int, int] = field(default_factory=dict)

    def position(self, offset: int) -> tuple[int, int]:
        return _line_col(self.text, offset)

    def name_of(self, rule_id: int) -> str:
        for name, i in self.symbol_ids.items():
            if i == rule_id:
                return name
        return f"#{rule_id}"


def _line_col(text: str, offset: int) -> tuple[int, int]:
    offset = max(0, min(offset, len(text)))
    line = text.count("\n", 0, offset) + 1
    column = offset - (text.rfind("\n", 0, offset) + 1) + 1
    return line, column


def _is_word_char(c: str) -> bool:
    return ("a" <= c <= "z") or ("A" <= c <= "Z") or ("0" <= c <= "9") or c == "-"


def _is_digit(c: str) -> bool:
    return "0" <= c <= "9"


_HEX = "0123456789abcdefABCDEF"
_SIMPLE_ESCAPES = {"t": 9, "r": 13, "n": 10, "\\": 92, '"': 34, "[": 91, "]": 93, "-": 45}


@dataclass
class _Frame:
    """One level of ``parse_alternates``: the rule being built and its sequence state."""

    rule: list[Element]
    rule_id: int
    nested: bool
    open_at: int  # offset of '(' for a group, of the rule name otherwise
    n_rules_before: int = 0
    last_sym_start: int = 0
    n_prev_rules: int = 1


class _Parser:
    def __init__(self, text: str, token_lookup: Callable[[str], int | None] | None):
        self.text = text
        self.n = len(text)
        self.token_lookup = token_lookup
        self.symbol_ids: dict[str, int] = {}
        self.rules: list[list[Element] | None] = []
        self.defined_at: dict[int, int] = {}
        self.referenced_at: dict[int, int] = {}
        self.n_defined = 0
        self.n_elements = 0

    # -- errors and positions ---------------------------------------------------------------

    def error(self, message: str, offset: int) -> GrammarError:
        line, col = _line_col(self.text, offset)
        return GrammarError(message, line, col)

    def at(self, pos: int) -> str:
        return self.text[pos] if pos < self.n else ""

    # -- symbols ------------------------------------------------------------------------------

    def _check_symbols(self, offset: int) -> None:
        if len(self.symbol_ids) >= MAX_SYMBOLS:
            raise self.error(f"grammar has more than {MAX_SYMBOLS} rules", offset)

    def get_symbol_id(self, name: str, offset: int) -> int:
        sid = self.symbol_ids.get(name)
        if sid is None:
            self._check_symbols(offset)
            sid = self.symbol_ids[name] = len(self.symbol_ids)
        return sid

    def generate_symbol_id(self, base: str, offset: int) -> int:
        self._check_symbols(offset)
        next_id = len(self.symbol_ids)
        self.symbol_ids[f"{base}_{next_id}"] = next_id
        self.defined_at.setdefault(next_id, offset)
        return next_id

    def add_rule(self, rule_id: int, rule: list[Element], offset: int) -> None:
        self.n_elements += len(rule)
        if self.n_elements > MAX_ELEMENTS:
            raise self.error(f"grammar expands to more than {MAX_ELEMENTS} elements", offset)
        while len(self.rules) <= rule_id:
            self.rules.append(None)
        self.rules[rule_id] = rule

    # -- lexical helpers (llama.cpp's parse_space, parse_name, parse_int, parse_char) ---------

    def parse_space(self, pos: int, newline_ok: bool) -> int:
        text, n = self.text, self.n
        while pos < n:
            c = text[pos]
            if c == " " or c == "\t" or (newline_ok and (c == "\r" or c == "\n")):
                pos += 1
            elif c == "#":
                while pos < n and text[pos] not in "\r\n":
                    pos += 1
            else:
                break
        return pos

    def parse_name(self, pos: int) -> int:
        end = pos
        while end < self.n and _is_word_char(self.text[end]):
            end += 1
        if end == pos:
            raise self.error(f"expecting a rule name, found {self._show(pos)}", pos)
        return end

    def parse_int(self, pos: int) -> tuple[int, int]:
        end = pos
        while end < self.n and _is_digit(self.text[end]):
            end += 1
        if end == pos:
            raise self.error(f"expecting an integer, found {self._show(pos)}", pos)
        if end - pos > 30:
            raise self.error("integer too large", pos)
        return int(self.text[pos:end]), end

    def parse_char(self, pos: int) -> tuple[int, int]:
        text = self.text
        if pos >= self.n:
            raise self.error("unexpected end of input", pos)
        c = text[pos]
        if c != "\\":
            return ord(c), pos + 1
        e = self.at(pos + 1)
        size = {"x": 2, "u": 4, "U": 8}.get(e)
        if size is not None:
            digits = text[pos + 2 : pos + 2 + size]
            if len(digits) != size or any(d not in _HEX for d in digits):
                raise self.error(f"expecting {size} hex digits after \\{e}", pos)
            return int(digits, 16), pos + 2 + size
        if e in _SIMPLE_ESCAPES:
            return _SIMPLE_ESCAPES[e], pos + 2
        raise self.error(f"unknown escape \\{e}" if e else "unexpected end of input", pos)

    def _show(self, pos: int) -> str:
        if pos >= self.n:
            return "end of input"
        return repr(self.text[pos : pos + 10])

    # -- rules ----------------------------------------------------------------------------------

    def parse(self) -> int:
        pos = self.parse_space(0, True)
        while pos < self.n:
            pos = self.parse_rule(pos)
        return pos

    def parse_rule(self, pos: int) -> int:
        name_end = self.parse_name(pos)
        name = self.text[pos:name_end]
        p = self.parse_space(name_end, False)
        rule_id = self.get_symbol_id(name, pos)
        if self.text[p : p + 3] != "::=":
            raise self.error(f"expecting ::= after rule name {name!r}", p)
        self.defined_at.setdefault(rule_id, pos)
        self.n_defined += 1
        if self.n_defined > MAX_RULES:
            raise self.error(f"grammar defines more than {MAX_RULES} rules", pos)
        p = self.parse_space(p + 3, True)
        p = self.parse_alternates(p, name, rule_id, pos)
        c = self.at(p)
        if c == "\r":
            p += 2 if self.at(p + 1) == "\n" else 1
        elif c == "\n":
            p += 1
        elif c:
            raise self.error(f"expecting newline or end after rule {name!r}, found {c!r}", p)
        return self.parse_space(p, True)

    def parse_alternates(self, pos: int, rule_name: str, rule_id: int, name_at: int) -> int:
        """llama.cpp's mutually recursive parse_alternates / parse_sequence, on a stack."""
        frames = [_Frame([], rule_id, False, name_at)]
        text = self.text
        while True:
            f = frames[-1]
            c = self.at(pos)
            if c == '"':  # literal string
                start = pos
                pos += 1
                f.last_sym_start = len(f.rule)
                f.n_prev_rules = 1
                while self.at(pos) != '"':
                    if pos >= self.n:
                        raise self.error("unterminated literal", start)
                    cp, pos = self.parse_char(pos)
                    f.rule.append((GType.CHAR, cp))
                pos = self.parse_space(pos + 1, f.nested)
            elif c == "[":  # character class
                start = pos
                pos += 1
                start_type = GType.CHAR
                if self.at(pos) == "^":
                    pos += 1
                    start_type = GType.CHAR_NOT
                f.last_sym_start = len(f.rule)
                f.n_prev_rules = 1
                while self.at(pos) != "]":
                    if pos >= self.n:
                        raise self.error("unterminated character class", start)
                    cp, pos = self.parse_char(pos)
                    kind = GType.CHAR_ALT if f.last_sym_start < len(f.rule) else start_type
                    f.rule.append((kind, cp))
                    if self.at(pos) == "-" and self.at(pos + 1) != "]":
                        if pos + 1 >= self.n:
                            raise self.error("unterminated character class", start)
                        cp, pos = self.parse_char(pos + 1)
                        f.rule.append((GType.CHAR_RNG_UPPER, cp))
                pos = self.parse_space(pos + 1, f.nested)
            elif c == "<" or c == "!":  # token
                kind = GType.TOKEN
                start = pos
                if c == "!":
                    kind = GType.TOKEN_NOT
                    pos += 1
                token_id, pos = self.parse_token(pos, start)
                f.last_sym_start = len(f.rule)
                f.n_prev_rules = 1
                f.rule.append((kind, token_id))
                pos = self.parse_space(pos, f.nested)
            elif c and _is_word_char(c):  # rule reference
                name_end = self.parse_name(pos)
                ref_id = self.get_symbol_id(text[pos:name_end], pos)
                self.referenced_at.setdefault(ref_id, pos)
                pos = self.parse_space(name_end, f.nested)
                f.last_sym_start = len(f.rule)
                f.n_prev_rules = 1
                f.rule.append((GType.RULE_REF, ref_id))
            elif c == "(":  # grouping: nested alternates into a generated rule
                if len(frames) > MAX_NESTING:
                    raise self.error(f"parentheses nested deeper than {MAX_NESTING}", pos)
                open_at = pos
                pos = self.parse_space(pos + 1, True)
                n_before = len(self.symbol_ids)
                sub_id = self.generate_symbol_id(rule_name, open_at)
                frames.append(_Frame([], sub_id, True, open_at, n_rules_before=n_before))
            elif c == ".":  # any char
                f.last_sym_start = len(f.rule)
                f.n_prev_rules = 1
                f.rule.append((GType.CHAR_ANY, 0))
                pos = self.parse_space(pos + 1, f.nested)
            elif c == "*":
                op = pos
                pos = self.parse_space(pos + 1, f.nested)
                self.repeat(f, rule_name, 0, None, op)
            elif c == "+":
                op = pos
                pos = self.parse_space(pos + 1, f.nested)
                self.repeat(f, rule_name, 1, None, op)
            elif c == "?":
                op = pos
                pos = self.parse_space(pos + 1, f.nested)
                self.repeat(f, rule_name, 0, 1, op)
            elif c == "{":
                op = pos
                pos = self.parse_space(pos + 1, f.nested)
                if not _is_digit(self.at(pos)):
                    raise self.error(
                        f"expecting an integer after '{{', found {self._show(pos)}", pos
                    )
                min_times, pos = self.parse_int(pos)
                pos = self.parse_space(pos, f.nested)
                max_times: int | None = None
                if self.at(pos) == "}":
                    max_times = min_times
                    pos = self.parse_space(pos + 1, f.nested)
                elif self.at(pos) == ",":
                    pos = self.parse_space(pos + 1, f.nested)
                    if _is_digit(self.at(pos)):
                        max_times, pos = self.parse_int(pos)
                        pos = self.parse_space(pos, f.nested)
                    if self.at(pos) != "}":
                        raise self.error(f"expecting '}}', found {self._show(pos)}", pos)
                    pos = self.parse_space(pos + 1, f.nested)
                else:
                    raise self.error(f"expecting ',' or '}}', found {self._show(pos)}", pos)
                if min_times > MAX_REPETITION:
                    raise self.error(
                        f"repetition {{{min_times}}} exceeds the limit of {MAX_REPETITION}", op
                    )
                if max_times is not None and max_times < min_times:
                    raise self.error(
                        f"repetition upper bound {max_times} is below lower bound {min_times}", op
                    )
                if max_times is not None and max_times > MAX_REPETITION:
                    max_times = None  # as llama.cpp: no upper bound
                self.repeat(f, rule_name, min_times, max_times, op)
            elif c == "|":
                f.rule.append((GType.ALT, 0))
                pos = self.parse_space(pos + 1, True)
                f.last_sym_start = len(f.rule)
                f.n_prev_rules = 1
            else:  # end of this sequence and of these alternates
                f.rule.append((GType.END, 0))
                self.add_rule(f.rule_id, f.rule, f.open_at)
                if not f.nested:
                    return pos
                if c != ")":
                    if pos >= self.n:
                        raise self.error("unclosed '('", f.open_at)
                    raise self.error(f"expecting ')', found {self._show(pos)}", pos)
                frames.pop()
                parent = frames[-1]
                parent.n_prev_rules = max(1, len(self.symbol_ids) - f.n_rules_before)
                parent.last_sym_start = len(parent.rule)
                parent.rule.append((GType.RULE_REF, f.rule_id))
                pos = self.parse_space(pos + 1, parent.nested)

    def parse_token(self, pos: int, start: int) -> tuple[int, int]:
        if self.at(pos) != "<":
            raise self.error(f"expecting '<', found {self._show(pos)}", pos)
        pos += 1
        if self.at(pos) == "[":
            value, pos = self.parse_int(pos + 1)
            if value > 0xFFFFFFFF:
                raise self.error(f"token id {value} is too large", start)
            if self.at(pos) != "]":
                raise self.error(f"expecting ']', found {self._show(pos)}", pos)
            if self.at(pos + 1) != ">":
                raise self.error(f"expecting '>', found {self._show(pos + 1)}", pos + 1)
            return value, pos + 2
        end = self.text.find(">", pos)
        if end < 0:
            raise self.error("unterminated token, expecting '>'", start)
        token_text = self.text[pos - 1 : end + 1]
        if self.token_lookup is None:
            raise self.error(f"token {token_text} needs a vocabulary to resolve", start)
        token_id = self.token_lookup(token_text)
        if token_id is None:
            raise self.error(
                f"invalid token {token_text!r}: not one token of the vocabulary", start
            )
        return int(token_id), end + 1

    def repeat(self, f: _Frame, rule_name: str, min_times: int, max_times: int | None, op: int):
        """llama.cpp's handle_repetitions: S{m,n} -> S (m times) then n-m optional rules."""
        no_max = max_times is None
        if f.last_sym_start == len(f.rule):
            raise self.error("expecting an item before the repetition operator", op)
        prev = f.rule[f.last_sym_start :]
        total = 1
        if not no_max and max_times > 0:
            total = max_times
        elif min_times > 0:
            total = min_times
        if f.n_prev_rules * total > MAX_REPETITION:
            raise self.error(
                f"repetition generates {f.n_prev_rules * total} rules, above the limit of "
                f"{MAX_REPETITION}; use fewer repetitions or a simpler repeated item",
                op,
            )
        n_opt = 1 if no_max else max_times - min_times
        growth = len(prev) * max(min_times - 1, 0) + (len(prev) + 3) * n_opt
        if self.n_elements + len(f.rule) + growth > MAX_ELEMENTS:
            raise self.error(f"grammar expands to more than {MAX_ELEMENTS} elements", op)
        if min_times == 0:
            del f.rule[f.last_sym_start :]
        else:
            for _ in range(1, min_times):
                f.rule.extend(prev)
        last_rec = 0
        for i in range(n_opt):
            rec = list(prev)
            rec_id = self.generate_symbol_id(rule_name, op)
            if i > 0 or no_max:
                rec.append((GType.RULE_REF, rec_id if no_max else last_rec))
            rec.append((GType.ALT, 0))
            rec.append((GType.END, 0))
            self.add_rule(rec_id, rec, op)
            last_rec = rec_id
        if n_opt > 0:
            f.rule.append((GType.RULE_REF, last_rec))
        f.n_prev_rules *= total


def parse_gbnf(
    text: str | bytes, token_lookup: Callable[[str], int | None] | None = None
) -> ParsedGrammar:
    """Parse GBNF text into llama.cpp's rules; every rule referenced must be defined.

    ``token_lookup`` resolves ``<text>`` tokens to a token id (``None``: not one token);
    without it such tokens are an error. Root and left-recursion checks are the caller's
    (``Grammar.parse``).
    """
    if isinstance(text, bytes | bytearray):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError as err:
            raise GrammarError(f"grammar is not valid UTF-8 (byte offset {err.start})") from None
    if not isinstance(text, str):
        raise GrammarError(f"grammar must be a string, got {type(text).__name__}")
    if len(text) > MAX_GRAMMAR_CHARS:
        raise GrammarError(f"grammar has {len(text)} characters, above {MAX_GRAMMAR_CHARS}")
    if "\x00" in text:
        # llama.cpp reads the grammar as a C string: everything after a NUL is ignored
        text = text[: text.index("\x00")]
    p = _Parser(text, token_lookup)
    p.parse()
    if not p.rules:
        raise GrammarError("empty grammar: no rules", 1, 1)
    # every symbol mentioned must have a definition
    undefined = [
        (p.referenced_at.get(sid, 0), name)
        for name, sid in p.symbol_ids.items()
        if sid >= len(p.rules) or p.rules[sid] is None
    ]
    if undefined:
        offset, name = min(undefined)
        raise p.error(f"undefined rule {name!r}", offset)
    return ParsedGrammar(text, p.symbol_ids, p.rules, p.defined_at, p.referenced_at)


# -- printing ---------------------------------------------------------------------------------


def _char_text(cp: int, in_class: bool) -> str:
    special = {9: "\\t", 10: "\\n", 13: "\\r", 92: "\\\\"}
    if cp in special:
        return special[cp]
    if in_class and cp in (0x5D, 0x5B, 0x2D, 0x5E):  # ] [ - ^
        return "\\" + chr(cp) if cp != 0x5E else "\\x5E"
    if not in_class and cp == 0x22:
        return '\\"'
    if cp < 0x20 or cp == 0x7F:
        return f"\\x{cp:02X}"
    if 0xD800 <= cp <= 0xDFFF or cp > 0x10FFFF:
        return f"\\U{cp:08X}"
    return chr(cp)


def format_rules(parsed: ParsedGrammar) -> str:
    """The rules back as GBNF text (like llama.cpp's ``llama_grammar_parser::print``, but
    parseable again: generated names ``rule_3`` are written ``rule-3``)."""
    taken = set(parsed.symbol_ids)
    names = {}
    for name, sid in parsed.symbol_ids.items():
        if "_" in name:
            new = name.replace("_", "-")
            while new in taken:
                new += "-g"
            taken.add(new)
            name = new
        names[sid] = name
    lines = []
    for rid, rule in enumerate(parsed.rules):
        out: list[str] = []
        i = 0
        while i < len(rule) - 1:
            kind, value = rule[i]
            if kind == GType.ALT:
                if not out or out[-1] == "|":
                    out.append('""')  # an empty alternative, written so it parses back
                out.append("|")
                i += 1
            elif kind == GType.RULE_REF:
                out.append(names.get(value, f"#{value}"))
                i += 1
            elif kind == GType.TOKEN:
                out.append(f"<[{value}]>")
                i += 1
            elif kind == GType.TOKEN_NOT:
                out.append(f"!<[{value}]>")
                i += 1
            elif kind == GType.CHAR_ANY:
                out.append(".")
                i += 1
            elif kind in (GType.CHAR, GType.CHAR_NOT):
                parts = ["[^" if kind == GType.CHAR_NOT else "["]
                parts.append(_char_text(value, True))
                i += 1
                while i < len(rule) and rule[i][0] in (GType.CHAR_ALT, GType.CHAR_RNG_UPPER):
                    if rule[i][0] == GType.CHAR_RNG_UPPER:
                        parts.append("-")
                    parts.append(_char_text(rule[i][1], True))
                    i += 1
                parts.append("]")
                out.append("".join(parts))
            else:
                i += 1
        if not out or out[-1] == "|":
            out.append('""')
        lines.append(f"{names.get(rid, f'#{rid}')} ::= {' '.join(out)}")
    return "\n".join(lines) + "\n"


# -- writing GBNF (for generated grammars) ----------------------------------------------------


def gbnf_literal(s: str) -> str:
    """``s`` as a GBNF string literal."""
    return '"' + "".join(_char_text(ord(c), False) for c in s) + '"'


def gbnf_class(ranges: list[tuple[int, int]], negated: bool = False) -> str:
    """A GBNF character class from inclusive code point ranges."""
    parts = ["[^" if negated else "["]
    for lo, hi in ranges:
        parts.append(_char_text(lo, True))
        if hi > lo:
            if hi > lo + 1:
                parts.append("-")
            parts.append(_char_text(hi, True))
    parts.append("]")
    return "".join(parts)
