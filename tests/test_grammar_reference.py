"""A direct, slow port of llama.cpp's grammar matching, to check the fast engine against.

Stacks are tuples of (rule id, element index); a state is a list of stacks plus the
pending partial UTF-8 sequence, advanced one code point at a time exactly as
``llama_grammar_advance_stack``, ``llama_grammar_match_char``, ``decode_utf8`` and
``llama_grammar_reject_candidates`` do (token elements are left out).

One deliberate difference, shared with picollama's engine: bytes that cannot occur in
valid UTF-8 make a token invalid: a byte that should continue a sequence but does not
(llama.cpp checks this only for a sequence carried over from the previous token), the lead
bytes C0, C1 and F5-FF, and overlong, surrogate or above-U+10FFFF forms.
"""

from __future__ import annotations

from picollama.sampling.gbnf import GType

_LOOKUP = (1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 2, 2, 3, 4)
_SECOND_BYTE = {(0x0, 2): (0xA0, 0xBF), (0xD, 2): (0x80, 0x9F), (0x0, 3): (0x90, 0xBF)}
_SECOND_BYTE[(0x4, 3)] = (0x80, 0x8F)


def _valid_next(value: int, n_remain: int, b: int, fresh: bool) -> bool:
    """Whether continuation byte ``b`` may follow; ``fresh``: right after the lead."""
    if (b >> 6) != 2:
        return False
    if fresh and (value, n_remain) in _SECOND_BYTE:
        lo, hi = _SECOND_BYTE[(value, n_remain)]
        return lo <= b <= hi
    return True


def decode_utf8(data: bytes, partial: tuple[int, int]) -> tuple[list[int], tuple[int, int]]:
    """llama.cpp's decode_utf8 (a NUL byte ends the input, as in a C string)."""
    value, n_remain = partial
    cps: list[int] = []
    pos = 0
    n = len(data)
    while pos < n and data[pos] != 0 and n_remain > 0:
        b = data[pos]
        if not _valid_next(value, n_remain, b, value < 16 and n_remain >= 2):
            return [], (0, -1)
        value = (value << 6) + (b & 0x3F)
        pos += 1
        n_remain -= 1
    if partial[1] > 0 and n_remain == 0:
        cps.append(value)
    while pos < n and data[pos] != 0:
        b = data[pos]
        n_remain = _LOOKUP[b >> 4] - 1
        if n_remain < 0 or b in (0xC0, 0xC1) or b >= 0xF5:
            return [], (0, -1)
        value = b & ((1 << (7 - n_remain)) - 1)
        pos += 1
        fresh = True
        while pos < n and data[pos] != 0 and n_remain > 0:
            if not _valid_next(value, n_remain, data[pos], fresh):
                return [], (0, -1)
            fresh = False
            value = (value << 6) + (data[pos] & 0x3F)
            pos += 1
            n_remain -= 1
        if n_remain == 0:
            cps.append(value)
    if pos < n:  # stopped at a NUL
        return [], (0, -1)
    return cps, (value, n_remain)


class RefMatcher:
    def __init__(self, grammar):
        self.rules = grammar.rules
        root = grammar.symbol_ids[grammar.root]
        self.stacks: list[tuple] = []
        for start in self._alt_starts(root):
            stack = () if self._eos((root, start)) else ((root, start),)
            for s in self._advance(stack):
                if s not in self.stacks:
                    self.stacks.append(s)
        self.partial = (0, 0)

    def _el(self, pos):
        return self.rules[pos[0]][pos[1]]

    def _eos(self, pos) -> bool:
        return self._el(pos)[0] in (GType.END, GType.ALT)

    def _alt_starts(self, rule_id):
        rule = self.rules[rule_id]
        starts = [0]
        for i, (t, _) in enumerate(rule):
            if t == GType.ALT:
                starts.append(i + 1)
        return starts

    def _advance(self, stack):
        out, seen, todo = [], set(), [stack]
        while todo:
            cur = todo.pop()
            if cur in seen:
                continue
            seen.add(cur)
            if not cur:
                if cur not in out:
                    out.append(cur)
                continue
            pos = cur[-1]
            t, v = self._el(pos)
            if t == GType.RULE_REF:
                nxt = (pos[0], pos[1] + 1)
                base = cur[:-1] + (() if self._eos(nxt) else (nxt,))
                for a in self._alt_starts(v):
                    sub = (v, a)
                    todo.append(base + (() if self._eos(sub) else (sub,)))
            else:
                if cur not in out:
                    out.append(cur)
        return out

    def _match_char(self, pos, cp):
        rule = self.rules[pos[0]]
        i = pos[1]
        t0 = rule[i][0]
        positive = t0 in (GType.CHAR, GType.CHAR_ANY)
        found = False
        while True:
            if rule[i + 1][0] == GType.CHAR_RNG_UPPER:
                found = found or rule[i][1] <= cp <= rule[i + 1][1]
                i += 2
            elif rule[i][0] == GType.CHAR_ANY:
                found = True
                i += 1
            else:
                found = found or rule[i][1] == cp
                i += 1
            if rule[i][0] != GType.CHAR_ALT:
                break
        return found == positive, (pos[0], i)

    def _match_partial(self, pos, partial) -> bool:
        value, n_remain = partial
        rule = self.rules[pos[0]]
        i = pos[1]
        positive = rule[i][0] in (GType.CHAR, GType.CHAR_ANY)
        if n_remain < 0 or (n_remain == 1 and value < 2):
            return False
        low = value << (n_remain * 6)
        high = low | ((1 << (n_remain * 6)) - 1)
        if low == 0:
            if n_remain == 2:
                low = 1 << 11
            elif n_remain == 3:
                low = 1 << 16
        while True:
            if rule[i + 1][0] == GType.CHAR_RNG_UPPER:
                if rule[i][1] <= high and low <= rule[i + 1][1]:
                    return positive
                i += 2
            elif rule[i][0] == GType.CHAR_ANY:
                return True
            else:
                if low <= rule[i][1] <= high:
                    return positive
                i += 1
            if rule[i][0] != GType.CHAR_ALT:
                break
        return not positive

    def _is_char(self, pos) -> bool:
        return self._el(pos)[0] in (GType.CHAR, GType.CHAR_NOT, GType.CHAR_ANY)

    def _accept_cp(self, stacks, cp):
        out = []
        for stack in stacks:
            if not stack or not self._is_char(stack[-1]):
                continue
            ok, nxt = self._match_char(stack[-1], cp)
            if ok:
                base = stack[:-1] + (() if self._eos(nxt) else (nxt,))
                for s in self._advance(base):
                    if s not in out:
                        out.append(s)
        return out

    def run(self, piece: bytes):
        """(stacks, partial) after ``piece``, or None when llama.cpp rejects it."""
        if not piece:
            return None
        cps, partial = decode_utf8(piece, self.partial)
        if partial[1] < 0:
            return None
        stacks = self.stacks
        for cp in cps:
            stacks = self._accept_cp(stacks, cp)
            if not stacks:
                return None
        if partial[1] == 0:
            return stacks, partial
        if any(s and self._is_char(s[-1]) and self._match_partial(s[-1], partial) for s in stacks):
            return stacks, partial
        return None

    def allows(self, piece: bytes) -> bool:
        return self.run(piece) is not None

    def accept(self, piece: bytes) -> None:
        got = self.run(piece)
        assert got is not None
        self.stacks, self.partial = got

    def can_end(self) -> bool:
        return any(not s for s in self.stacks)


# -- the reference's own checks ---------------------------------------------------------------


def test_decode_utf8_like_llama_cpp():
    assert decode_utf8("aé".encode(), (0, 0)) == ([0x61, 0xE9], (0xE9, 0))
    cps, partial = decode_utf8(b"a\xe3\x81", (0, 0))
    assert cps == [0x61] and partial == ((0x3 << 6) | 0x01, 1)
    assert decode_utf8(b"\x82", partial)[0] == [0x3042]
    assert decode_utf8(b"\x80", (0, 0))[1][1] == -1  # continuation byte first
    assert decode_utf8(b"\xe3a", (0, 0))[1][1] == -1  # llama.cpp would decode garbage


def test_reference_matches_simple_grammar():
    from picollama.sampling.grammar import Grammar

    g = Grammar.parse('root ::= "a" [b-d]+ | "é"')
    m = RefMatcher(g)
    assert m.allows(b"ab") and not m.allows(b"ae") and m.allows(b"\xc3")
    m.accept(b"abc")
    assert m.can_end()
