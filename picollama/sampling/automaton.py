"""The grammar engine: llama.cpp's pushdown stacks, determinized lazily over bytes.

llama.cpp keeps a set of parse stacks (each a list of positions into the rules, the top
always a terminal) and advances every stack over each code point of a token
(``llama_grammar_advance_stack``, ``llama_grammar_accept``). This module does the same
with two changes that make it fast without changing what is accepted:

- Stacks are interned as (parent, top) pairs, so a stack is an int, pushing and popping
  are O(1), and "advance this stack" and "advance this stack past its top" are computed
  once per stack.
- A state is a set of stacks plus a pending partial UTF-8 sequence; states are numbered
  as they are met and their byte transitions kept in a table (``trans``, -1 unknown, -2
  dead). Over time this is a DFA over exactly the states generation visits, and walking a
  token's bytes, or the whole vocabulary trie (``vocab_trie``), is array lookups.

Partial UTF-8 follows llama.cpp's ``decode_utf8``: a lead byte opens a sequence, a
continuation byte completes it, an unexpected byte (or NUL) kills the path; a token may
end inside a sequence when some stack's class can still match it
(``llama_grammar_match_partial_char``). Stricter than llama.cpp, bytes that cannot occur in
valid UTF-8 are rejected (a lead byte inside a sequence, C0, C1, F5-FF, overlong forms,
surrogates, code points above U+10FFFF), so constrained output is always valid UTF-8.
Partial states whose every stack either matches the whole range of code points the
sequence can complete to, or none of it, are shared across sequences, so free-text states
on large CJK/emoji vocabularies stay few.

Limits (``GrammarError`` when exceeded): ``MAX_STACKS`` stacks in one state,
``MAX_ADVANCE_WORK`` expansion steps for one advance, ``MAX_DFA_NODES`` states before the
table is rebuilt from scratch (``epoch`` counts rebuilds), ``MAX_STACK_DEPTH`` nested
rule positions in one stack (deeper paths are not followed, which bounds recursion such
as JSON nesting to that depth).
"""

from __future__ import annotations

import threading
from bisect import bisect_right
from collections.abc import Sequence

import numpy as np

from picollama.sampling.gbnf import GrammarError, GType, ParsedGrammar

__all__ = [
    "CharClass",
    "CompiledGrammar",
    "Automaton",
    "check_left_recursion",
    "EMPTY",
    "UNKNOWN",
    "DEAD",
    "MAX_STACKS",
    "MAX_STACK_DEPTH",
    "MAX_ADVANCE_WORK",
    "MAX_DFA_NODES",
]

EMPTY = 0  # the empty stack: the grammar has matched completely
UNKNOWN = -1  # transition not computed yet
DEAD = -2  # no stack survives

MAX_STACKS = 8192  # stacks in one state
MAX_STACK_DEPTH = 2048  # positions in one stack
MAX_ADVANCE_WORK = 1_000_000  # expansion steps in one advance
MAX_DFA_NODES = 16384  # states kept before the table is rebuilt
_HARD_DFA_NODES = 1 << 17  # states in one operation before giving up

_CHAR_TYPES = (GType.CHAR, GType.CHAR_NOT, GType.CHAR_ANY)
_TOKEN_TYPES = (GType.TOKEN, GType.TOKEN_NOT)
_UTF8_LEN = (1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 2, 2, 3, 4)  # by high nibble, as llama.cpp


# The byte after these lead bytes has a narrower range in valid UTF-8 (RFC 3629): keyed by
# the partial state right after the lead, (lead's value bits, bytes remaining).
_SECOND_BYTE = {
    (0x0, 2): (0xA0, 0xBF),  # E0: no overlong forms
    (0xD, 2): (0x80, 0x9F),  # ED: no surrogates
    (0x0, 3): (0x90, 0xBF),  # F0: no overlong forms
    (0x4, 3): (0x80, 0x8F),  # F4: nothing above U+10FFFF
}


def _second_byte_limited(value: int, n_remain: int) -> bool:
    return (value, n_remain) in _SECOND_BYTE


def _byte_tables() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per byte: continuation bytes left after it as a lead (0 for ASCII); whether its
    state can be shared with other bytes; whether it needs a state of its own (the leads
    whose next byte is restricted, and E0/F0 whose value bits are all zero)."""
    seq_len = np.zeros(256, dtype=np.int64)
    shared = np.zeros(256, dtype=bool)
    own = np.zeros(256, dtype=bool)
    for b in range(1, 0xF5):
        if 0x80 <= b < 0xC2:
            continue
        n = _UTF8_LEN[b >> 4] - 1
        v = b & ((1 << (7 - n)) - 1)
        seq_len[b] = n
        if n and (v == 0 or _second_byte_limited(v, n)):
            own[b] = True
        else:
            shared[b] = True
    return seq_len, shared, own


_BYTE_SEQ_LEN, _BYTE_SHARED, _BYTE_OWN = _byte_tables()


class CharClass:
    """A terminal: code point ranges, maybe negated; ``.`` is ``any``."""

    __slots__ = ("negated", "any", "lows", "highs", "ascii", "_row")

    def __init__(self, ranges: Sequence[tuple[int, int]], negated: bool, any_char: bool):
        merged: list[list[int]] = []
        for lo, hi in sorted(r for r in ranges if r[0] <= r[1]):
            if merged and lo <= merged[-1][1] + 1:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        self.negated = negated
        self.any = any_char
        self.lows = [r[0] for r in merged]
        self.highs = [r[1] for r in merged]
        bits = 0
        for cp in range(128):
            if self._match_slow(cp):
                bits |= 1 << cp
        self.ascii = bits
        self._row: np.ndarray | None = None

    def byte_row(self) -> np.ndarray:
        """Per byte, how the class meets the code points the byte can start (int8): for
        ASCII 0 or 2 (match), for valid lead bytes the ``relation`` of their whole range."""
        if self._row is None:
            row = np.zeros(256, dtype=np.int8)
            for b in range(1, 128):
                row[b] = 2 if (self.ascii >> b) & 1 else 0
            for b in range(0xC2, 0xF5):
                n = _UTF8_LEN[b >> 4] - 1
                lo = (b & ((1 << (7 - n)) - 1)) << (6 * n)
                row[b] = self.relation(lo, lo | ((1 << (6 * n)) - 1))
            self._row = row
        return self._row

    def _in_ranges(self, cp: int) -> bool:
        i = bisect_right(self.lows, cp) - 1
        return i >= 0 and cp <= self.highs[i]

    def _match_slow(self, cp: int) -> bool:
        if self.any:
            return True
        return self._in_ranges(cp) != self.negated

    def match(self, cp: int) -> bool:
        if cp < 128:
            return bool((self.ascii >> cp) & 1)
        return self._match_slow(cp)

    def relation(self, lo: int, hi: int) -> int:
        """How the class meets code points [lo, hi]: 0 none match, 1 some, 2 all."""
        if self.any:
            return 2
        i = bisect_right(self.lows, hi) - 1  # last range starting at or before hi
        if i < 0 or self.highs[i] < lo:
            inside = 0
        elif self.lows[i] <= lo and hi <= self.highs[i]:
            inside = 2
        else:
            inside = 1
        return 2 - inside if self.negated else inside

    def match_partial(self, value: int, n_remain: int) -> bool:
        """llama.cpp's llama_grammar_match_partial_char, quirks included."""
        if n_remain < 0 or (n_remain == 1 and value < 2):
            return False
        low = value << (n_remain * 6)
        high = low | ((1 << (n_remain * 6)) - 1)
        if low == 0:
            if n_remain == 2:
                low = 1 << 11
            elif n_remain == 3:
                low = 1 << 16
        if self.any:
            return True
        for a, b in zip(self.lows, self.highs, strict=True):
            if a <= high and low <= b:
                return not self.negated
        return self.negated


class CompiledGrammar:
    """Rules flattened into one element array, with per-position tables for the engine."""

    def __init__(self, parsed: ParsedGrammar, root_id: int):
        self.parsed = parsed
        self.root_id = root_id
        etype: list[int] = []
        evalue: list[int] = []
        self.rule_start: list[int] = []
        for rule in parsed.rules:
            self.rule_start.append(len(etype))
            for kind, value in rule:
                etype.append(int(kind))
                evalue.append(int(value))
        self.etype = etype
        self.evalue = evalue
        self.eos = [t == GType.END or t == GType.ALT for t in etype]
        # the first position of every alternative of every rule
        self.alt_starts: list[tuple[int, ...]] = []
        for rid, rule in enumerate(parsed.rules):
            base = self.rule_start[rid]
            starts = [base]
            for i, (kind, _) in enumerate(rule):
                if kind == GType.ALT:
                    starts.append(base + i + 1)
            self.alt_starts.append(tuple(starts))
        # character classes, keyed by their first position, and the position after them
        self.classes: dict[int, CharClass] = {}
        self.class_end: dict[int, int] = {}
        n = len(etype)
        for p in range(n):
            if etype[p] not in _CHAR_TYPES:
                continue
            # every CHAR / CHAR_NOT / CHAR_ANY starts a class (a literal is a run of
            # one-character classes); CHAR_ALT and CHAR_RNG_UPPER continue one
            ranges: list[tuple[int, int]] = []
            any_char = False
            i = p
            while True:
                if i + 1 < n and etype[i + 1] == GType.CHAR_RNG_UPPER:
                    ranges.append((evalue[i], evalue[i + 1]))
                    i += 2
                elif etype[i] == GType.CHAR_ANY:
                    any_char = True
                    i += 1
                else:
                    ranges.append((evalue[i], evalue[i]))
                    i += 1
                if i >= n or etype[i] != GType.CHAR_ALT:
                    break
            self.classes[p] = CharClass(ranges, etype[p] == GType.CHAR_NOT, any_char)
            self.class_end[p] = i


# -- left recursion -----------------------------------------------------------------------------


def _sccs(n: int, edges: list[list[int]]) -> list[list[int]]:
    """Strongly connected components (Tarjan's algorithm on an explicit stack)."""
    index = [-1] * n
    low = [0] * n
    on_stack = [False] * n
    stack: list[int] = []
    out: list[list[int]] = []
    counter = 0
    for root in range(n):
        if index[root] >= 0:
            continue
        work = [(root, 0)]
        while work:
            v, ei = work[-1]
            if ei == 0:
                index[v] = low[v] = counter
                counter += 1
                stack.append(v)
                on_stack[v] = True
            if ei < len(edges[v]):
                work[-1] = (v, ei + 1)
                w = edges[v][ei]
                if index[w] < 0:
                    work.append((w, 0))
                elif on_stack[w]:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                u = work[-1][0]
                low[u] = min(low[u], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack[w] = False
                    comp.append(w)
                    if w == v:
                        break
                out.append(comp)
    return out


def check_left_recursion(parsed: ParsedGrammar) -> None:
    """Refuse left recursion: llama.cpp's check, plus stack-growing cycles through nullables."""
    rules = parsed.rules
    n = len(rules)
    alts: list[list[list[tuple[int, int]]]] = []
    for rule in rules:
        cur: list[tuple[int, int]] = []
        per_rule = []
        for kind, value in rule:
            if kind == GType.END or kind == GType.ALT:
                per_rule.append(cur)
                cur = []
            else:
                cur.append((kind, value))
        alts.append(per_rule)
    directly_empty = [any(len(a) == 0 for a in per_rule) for per_rule in alts]

    # true nullability: a worklist over alternatives made only of rule references
    nullable = list(directly_empty)
    pending: list[int] = []  # per alternative: references not yet known nullable
    alt_owner: list[int] = []
    uses: list[list[int]] = [[] for _ in range(n)]
    for rid, per_rule in enumerate(alts):
        for alt in per_rule:
            if not alt or any(kind != GType.RULE_REF for kind, _ in alt):
                continue
            aid = len(pending)
            pending.append(len(alt))
            alt_owner.append(rid)
            for _, ref in alt:
                uses[ref].append(aid)
    work = [r for r in range(n) if nullable[r]]
    while work:
        r = work.pop()
        for aid in uses[r]:
            pending[aid] -= 1
            if pending[aid] == 0 and not nullable[alt_owner[aid]]:
                nullable[alt_owner[aid]] = True
                work.append(alt_owner[aid])

    def leftmost_edges(skip: list[bool]) -> tuple[list[list[int]], set[tuple[int, int]]]:
        edges: list[list[int]] = [[] for _ in range(n)]
        growing: set[tuple[int, int]] = set()
        for rid, per_rule in enumerate(alts):
            for alt in per_rule:
                for k, (kind, value) in enumerate(alt):
                    if kind != GType.RULE_REF:
                        break
                    edges[rid].append(value)
                    if k + 1 < len(alt):
                        growing.add((rid, value))
                    if not skip[value]:
                        break
        return edges, growing

    def fail(comp: list[int]) -> GrammarError:
        names = {sid: name for name, sid in parsed.symbol_ids.items()}
        # name a rule the user wrote where possible (generated names have a '_')
        rid = min(comp, key=lambda r: ("_" in names.get(r, "_"), r))
        name = names.get(rid, str(rid)).partition("_")[0]
        line, col = parsed.position(parsed.defined_at.get(rid, 0))
        return GrammarError(f"left recursion in rule {name!r}", line, col)

    # llama.cpp's check: leftmost references, skipping rules with an empty alternative
    edges, _ = leftmost_edges(directly_empty)
    for comp in _sccs(n, edges):
        if len(comp) > 1 or comp[0] in edges[comp[0]]:
            raise fail(comp)
    # cycles through rules that may match nothing, where the parse stack would grow
    edges, growing = leftmost_edges(nullable)
    for comp in _sccs(n, edges):
        members = set(comp)
        for a in comp:
            for b in edges[a]:
                if b in members and (a, b) in growing:
                    raise fail(comp)


# -- the engine ---------------------------------------------------------------------------------


class Automaton:
    """Interned stacks and the lazily built DFA over (stack set, partial UTF-8) states.

    One per grammar, shared by all matchers and vocabularies; its tables only grow (until
    ``MAX_DFA_NODES``), and every method is safe to call from several threads.
    """

    def __init__(self, grammar: CompiledGrammar):
        self.g = grammar
        self.lock = threading.RLock()
        # stacks: id 0 is the empty stack
        self.st_parent: list[int] = [0]
        self.st_top: list[int] = [-1]
        self.st_depth: list[int] = [0]
        self._st_index: dict[tuple[int, int], int] = {}
        self._advanced: dict[int, tuple[int, ...]] = {}
        self._expanded: dict[int, tuple[tuple[tuple[int, ...], ...], bool]] = {}
        self._after: dict[int, tuple[int, ...]] = {}
        self.epoch = 0
        self._reset_dfa()
        roots: set[int] = set()
        out: list[int] = []
        for a in grammar.alt_starts[grammar.root_id]:
            s = EMPTY if grammar.eos[a] else self._push(EMPTY, a)
            if s is None:
                continue
            for t in self.advance(s):
                if t not in roots:
                    roots.add(t)
                    out.append(t)
        self.initial_stacks = frozenset(out)

    # -- stacks -----------------------------------------------------------------------------

    def _push(self, parent: int, pos: int) -> int | None:
        key = (parent, pos)
        sid = self._st_index.get(key)
        if sid is None:
            depth = self.st_depth[parent] + 1
            if depth > MAX_STACK_DEPTH:
                return None
            sid = len(self.st_parent)
            self.st_parent.append(parent)
            self.st_top.append(pos)
            self.st_depth.append(depth)
            self._st_index[key] = sid
        return sid

    def _expand(self, pos: int) -> tuple[tuple[tuple[int, ...], ...], bool]:
        """llama_grammar_advance_stack on the stack ``[pos]`` alone: the stacks (relative
        to whatever lies below ``pos``) whose top is a terminal, and whether some path
        empties the stack (then the stack below is advanced in turn). Depends on ``pos``
        only, so it is computed once per grammar position."""
        got = self._expanded.get(pos)
        if got is not None:
            return got
        g = self.g
        etype, eos, alt_starts, evalue = g.etype, g.eos, g.alt_starts, g.evalue
        todo: list[tuple[int, ...]] = [(pos,)]
        seen: set[tuple[int, ...]] = set()
        out: list[tuple[int, ...]] = []
        passes = False
        while todo:
            st = todo.pop()
            if st in seen:
                continue
            seen.add(st)
            if len(seen) > MAX_ADVANCE_WORK:
                raise GrammarError(
                    f"grammar too ambiguous: expanding one position took over "
                    f"{MAX_ADVANCE_WORK} steps"
                )
            if not st:
                passes = True
                continue
            q = st[-1]
            if etype[q] == GType.RULE_REF:
                base = st[:-1] if eos[q + 1] else st[:-1] + (q + 1,)
                for a in alt_starts[evalue[q]]:
                    todo.append(base if eos[a] else base + (a,))
            else:
                out.append(st)
        if len(out) > MAX_STACKS:
            raise GrammarError(f"grammar too ambiguous: more than {MAX_STACKS} parse stacks")
        got = (tuple(out), passes)
        self._expanded[pos] = got
        return got

    def advance(self, stack: int) -> tuple[int, ...]:
        """llama_grammar_advance_stack: the stacks reachable whose top is a terminal (or
        the empty stack), expanding rule references; built from per-position expansions
        pushed onto the stack below, and walking down while expansions can be empty."""
        got = self._advanced.get(stack)
        if got is not None:
            return got
        etype, st_top, st_parent = self.g.etype, self.st_top, self.st_parent
        out: dict[int, None] = {}
        cur = stack
        while True:
            if cur == EMPTY or etype[st_top[cur]] != GType.RULE_REF:
                out[cur] = None
                break
            if cur != stack and cur in self._advanced:
                out.update(dict.fromkeys(self._advanced[cur]))
                break
            rels, passes = self._expand(st_top[cur])
            base = st_parent[cur]
            for rel in rels:
                t: int | None = base
                for q in rel:
                    t = self._push(t, q)
                    if t is None:
                        break
                if t is not None:
                    out[t] = None
            if not passes:
                break
            cur = base
        if len(out) > MAX_STACKS:
            raise GrammarError(f"grammar too ambiguous: more than {MAX_STACKS} parse stacks")
        got = tuple(out)
        self._advanced[stack] = got
        return got

    def after_top(self, stack: int) -> tuple[int, ...]:
        """The stacks after the top terminal (a char class or a token) matched."""
        got = self._after.get(stack)
        if got is not None:
            return got
        g = self.g
        p = self.st_top[stack]
        q = g.class_end[p] if p in g.class_end else p + 1
        base = self.st_parent[stack]
        ns = base if g.eos[q] else self._push(base, q)
        got = () if ns is None else self.advance(ns)
        self._after[stack] = got
        return got

    def stack_positions(self, stack: int) -> list[int]:
        """The positions of a stack, bottom first (for debugging and tests)."""
        out = []
        while stack != EMPTY:
            out.append(self.st_top[stack])
            stack = self.st_parent[stack]
        return out[::-1]

    # -- states -------------------------------------------------------------------------------

    def _reset_dfa(self) -> None:
        self._node_index: dict[tuple, int] = {}
        self.node_key: list[tuple] = []
        self.node_chars: list[tuple[int, ...]] = []  # stacks whose top is a char class
        self.node_tokens: list[tuple[int, ...]] = []  # stacks whose top is a token
        self.node_can_end: list[bool] = []
        cap = 1024
        self.trans = np.full((cap, 256), UNKNOWN, dtype=np.int32)
        self.end_ok = np.zeros(cap, dtype=np.uint8)
        # bytes known to lead from a state back to itself (256 bits as 4 words): a trie
        # walk takes a whole subtree at once when all its bytes loop (string contents)
        self.self_loops = np.zeros((cap, 4), dtype=np.uint64)
        # 1 where every non-ASCII code point leads back to the same state (free text)
        self.nonascii_loop = np.zeros(cap, dtype=np.uint8)
        # matched stacks -> state after them: most bytes of a state match the same stacks
        self._after_matched: dict[tuple[int, ...], int] = {}

    def maybe_reset(self) -> None:
        """Drop the state table when it has grown past ``MAX_DFA_NODES`` (call between
        operations only: node ids held by callers become stale, ``epoch`` says so)."""
        with self.lock:
            if len(self.node_key) > MAX_DFA_NODES:
                self._reset_dfa()
                self.epoch += 1

    def node(self, stacks: frozenset[int], value: int = 0, n_remain: int = 0) -> int:
        """The id of state (stacks, partial UTF-8 value, bytes remaining); ``value`` -1
        marks a shared partial state whose stacks all match the whole remaining range."""
        key = (stacks, value, n_remain)
        nid = self._node_index.get(key)
        if nid is not None:
            return nid
        with self.lock:
            nid = self._node_index.get(key)
            if nid is not None:
                return nid
            if len(stacks) > MAX_STACKS:
                raise GrammarError(f"grammar too ambiguous: more than {MAX_STACKS} parse stacks")
            g = self.g
            etype, st_top = g.etype, self.st_top
            chars = tuple(s for s in stacks if s != EMPTY and etype[st_top[s]] in _CHAR_TYPES)
            tokens = tuple(s for s in stacks if s != EMPTY and etype[st_top[s]] in _TOKEN_TYPES)
            if n_remain == 0:
                end_ok = True
            elif value < 0:
                end_ok = bool(chars)
            else:
                end_ok = any(g.classes[st_top[s]].match_partial(value, n_remain) for s in chars)
            nid = len(self.node_key)
            if nid >= _HARD_DFA_NODES:
                raise GrammarError(f"grammar state space too large: over {_HARD_DFA_NODES} states")
            if nid >= len(self.end_ok):
                self._grow()
            self.node_key.append(key)
            self.node_chars.append(chars)
            self.node_tokens.append(tokens)
            self.node_can_end.append(n_remain == 0 and EMPTY in stacks)
            self.end_ok[nid] = end_ok
            self._node_index[key] = nid
            return nid

    def _grow(self) -> None:
        cap = len(self.end_ok) * 2
        trans = np.full((cap, 256), UNKNOWN, dtype=np.int32)
        trans[: len(self.trans)] = self.trans
        end_ok = np.zeros(cap, dtype=np.uint8)
        end_ok[: len(self.end_ok)] = self.end_ok
        loops = np.zeros((cap, 4), dtype=np.uint64)
        loops[: len(self.self_loops)] = self.self_loops
        nonascii = np.zeros(cap, dtype=np.uint8)
        nonascii[: len(self.nonascii_loop)] = self.nonascii_loop
        self.trans, self.end_ok, self.self_loops = trans, end_ok, loops
        self.nonascii_loop = nonascii

    def _set(self, nid: int, byte: int, t: int) -> None:
        self.trans[nid, byte] = t
        if t == nid:
            self.self_loops[nid, byte >> 6] |= np.uint64(1 << (byte & 63))

    def initial(self) -> int:
        return self.node(self.initial_stacks)

    def _after_matched_stacks(self, matched: tuple[int, ...]) -> int:
        """The state after a code point that the tops of exactly ``matched`` accept."""
        got = self._after_matched.get(matched)
        if got is None:
            out: set[int] = set()
            for s in matched:
                out.update(self.after_top(s))
            got = self.node(frozenset(out)) if out else DEAD
            self._after_matched[matched] = got
        return got

    def _after_char(self, stacks: Sequence[int], cp: int) -> int:
        classes, st_top = self.g.classes, self.st_top
        return self._after_matched_stacks(tuple(s for s in stacks if classes[st_top[s]].match(cp)))

    def _partial(self, stacks: Sequence[int], value: int, n_remain: int) -> int:
        lo = value << (6 * n_remain)
        hi = lo | ((1 << (6 * n_remain)) - 1)
        classes, st_top = self.g.classes, self.st_top
        keep = []
        uniform = True
        for s in stacks:
            rel = classes[st_top[s]].relation(lo, hi)
            if rel:
                keep.append(s)
                if rel == 1:
                    uniform = False
        if not keep:
            return DEAD
        if uniform and value != 0 and not _second_byte_limited(value, n_remain):
            return self.node(frozenset(keep), -1, n_remain)
        return self.node(frozenset(keep), value, n_remain)

    def step(self, nid: int, byte: int) -> int:
        """The state after one more byte (DEAD if none), computed once and kept in ``trans``."""
        t = int(self.trans[nid, byte])
        if t != UNKNOWN:
            return t
        with self.lock:
            t = self._step(nid, byte)
            self._set(nid, byte, t)
        return t

    def fill_row(self, nid: int) -> None:
        """All 256 transitions of a state at once (for trie walks, which meet most bytes):
        bytes whose code points the same stacks accept share one computation."""
        with self.lock:
            row = np.full(256, DEAD, dtype=np.int32)
            stacks, value, n_remain = self.node_key[nid]
            chars = self.node_chars[nid]
            classes, st_top = self.g.classes, self.st_top
            if chars and n_remain == 0:
                # (256, stacks): how each stack's class meets what each byte starts; bytes
                # with the same row and sequence length lead to the same state
                rel = np.stack([classes[st_top[s]].byte_row() for s in chars], axis=1)
                rows, inverse = np.unique(rel, axis=0, return_inverse=True)
                inverse = inverse.reshape(-1)
                keys = inverse * 4 + _BYTE_SEQ_LEN
                partly = (rows == 1).any(axis=1)[inverse] & (_BYTE_SEQ_LEN > 0)
                for key in np.unique(keys[_BYTE_SHARED & ~partly]).tolist():
                    g, n = divmod(key, 4)
                    matched = tuple(
                        s for s, r in zip(chars, rows[g].tolist(), strict=True) if r == 2
                    )
                    if not matched:
                        t = DEAD
                    elif n:
                        t = self.node(frozenset(matched), -1, n)
                    else:
                        t = self._after_matched_stacks(matched)
                    row[(keys == key) & _BYTE_SHARED & ~partly] = t
                for b in np.nonzero(_BYTE_OWN | (partly & _BYTE_SHARED))[0].tolist():
                    n = _UTF8_LEN[b >> 4] - 1
                    row[b] = self._partial(chars, b & ((1 << (7 - n)) - 1), n)
                # do all non-ASCII code points match the same stacks and come back here?
                rels = [classes[st_top[s]].relation(0x80, 0x10FFFF) for s in chars]
                if 1 not in rels and 2 in rels:
                    matched = tuple(s for s, r in zip(chars, rels, strict=True) if r == 2)
                    self.nonascii_loop[nid] = self._after_matched_stacks(matched) == nid
            elif chars and value < 0:  # shared partial state
                t = self._step(nid, 0x80)
                row[0x80:0xC0] = t
            elif chars:
                for b in range(0x80, 0xC0):
                    row[b] = self._step(nid, b)
            self.trans[nid] = row
            loops = np.packbits(row == nid, bitorder="little").view(np.uint64)
            self.self_loops[nid] = loops

    def _step(self, nid: int, b: int) -> int:
        if b == 0:
            return DEAD  # NUL ends a C string in llama.cpp: never part of a match
        stacks, value, n_remain = self.node_key[nid]
        chars = self.node_chars[nid]
        if n_remain == 0:
            if not chars:
                return DEAD
            if b < 0x80:
                return self._after_char(chars, b)
            n = _UTF8_LEN[b >> 4] - 1
            if n < 0 or b in (0xC0, 0xC1) or b >= 0xF5:
                return DEAD  # not a lead byte of valid UTF-8
            return self._partial(chars, b & ((1 << (7 - n)) - 1), n)
        if (b >> 6) != 2:
            return DEAD  # a sequence cut short
        if value >= 0 and _second_byte_limited(value, n_remain):
            lo, hi = _SECOND_BYTE[(value, n_remain)]
            if not lo <= b <= hi:
                return DEAD  # overlong, surrogate or beyond U+10FFFF
        n = n_remain - 1
        if value < 0:  # shared partial state: every stack matches whatever completes it
            if n:
                return self.node(stacks, -1, n)
            out: set[int] = set()
            for s in chars:
                out.update(self.after_top(s))
            return self.node(frozenset(out)) if out else DEAD
        v = (value << 6) | (b & 0x3F)
        if n:
            return self._partial(chars, v, n)
        return self._after_char(chars, v)

    def walk(self, nid: int, data: bytes) -> int:
        """The state after ``data`` (DEAD if rejected on the way).

        A long input may rebuild the state table on the way (``epoch`` changes): state ids
        taken before the call are then stale; the one returned is current."""
        with self.lock:
            trans = self.trans
            for b in data:
                t = int(trans[nid, b])
                if t == UNKNOWN:
                    if len(self.node_key) > MAX_DFA_NODES:
                        key = self.node_key[nid]
                        self._reset_dfa()
                        self.epoch += 1
                        nid = self.node(*key)
                    t = self._step(nid, b)
                    self._set(nid, b, t)
                    trans = self.trans
                if t < 0:
                    return DEAD
                nid = t
            return nid

    def after_token(self, nid: int, token_id: int) -> frozenset[int]:
        """Stacks after a token element (``<[id]>`` / ``!<[id]>``) on top matched ``token_id``."""
        g = self.g
        out: set[int] = set()
        for s in self.node_tokens[nid]:
            p = self.st_top[s]
            want = g.evalue[p]
            if (g.etype[p] == GType.TOKEN) == (want == token_id):
                out.update(self.after_top(s))
        return frozenset(out)
