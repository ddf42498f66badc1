"""A byte trie over a vocabulary, and the Numba walk that turns a grammar state into a mask.

The trie is stored in preorder: node ``i`` has a byte, a depth, and ``next[i]``, the first
node after its subtree, so skipping a subtree the grammar rejects is one jump. Tokens whose
bytes end at a node are listed in CSR form (``tok_start``/``tok_end`` into ``tok_ids``).
Sorting the distinct token byte strings gives the preorder directly: each string adds the
nodes past its common prefix with the one before it.

``walk_mask`` walks the trie from a grammar state over the engine's transition table
(``Automaton.trans``); where a transition is not known yet it records (node, state) and
skips the subtree, the caller fills those transitions in Python and walks on from them.
Each round only goes deeper, so a cold state takes at most (longest token) rounds and a
warm one a single pass of array lookups.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

__all__ = ["VocabTrie", "walk_mask", "pieces_from_tokens"]

_njit = None


def _numba():
    global _njit
    if _njit is None:
        from numba import njit

        _njit = njit
    return _njit


_KERNELS: dict[str, object] = {}
_ROW_FILL = 24  # missing transitions of one state above which its whole row is computed


def _build_kernel():
    njit = _numba()

    @njit(cache=True, nogil=True)
    def build(buf, offs, n_max, max_len, utf8_next):
        n_pieces = len(offs) - 1
        t_byte = np.zeros(n_max, np.uint8)
        t_depth = np.zeros(n_max, np.int32)
        t_next = np.zeros(n_max, np.int32)
        term = np.empty(n_pieces, np.int32)
        path = np.zeros(max_len + 1, np.int32)
        n = 1
        path_len = 0
        for k in range(n_pieces):
            a = offs[k]
            length = offs[k + 1] - a
            lcp = 0
            if k > 0:
                pa = offs[k - 1]
                plen = a - pa
                while lcp < length and lcp < plen and buf[a + lcp] == buf[pa + lcp]:
                    lcp += 1
            for d in range(lcp + 1, path_len + 1):
                t_next[path[d]] = n
            for j in range(lcp, length):
                t_byte[n] = buf[a + j]
                t_depth[n] = j + 1
                path[j + 1] = n
                n += 1
            path_len = length
            term[k] = n - 1
        for d in range(1, path_len + 1):
            t_next[path[d]] = n
        t_next[0] = n
        # the bytes below each node (256 bits as 4 words), children before parents
        sub = np.zeros((n, 4), np.uint64)
        parent = np.zeros(n, np.int32)
        for d in range(max_len + 1):
            path[d] = 0
        for i in range(1, n):
            parent[i] = path[t_depth[i] - 1]
            path[t_depth[i]] = i
        # utf8_ok[i] bit f: every path below node i is valid UTF-8 (a last character may be
        # cut short) when read from UTF-8 decoder phase f at node i (phases: _UTF8_NEXT)
        utf8_ok = np.full(n, 0xFF, np.uint8)
        for i in range(n - 1, 0, -1):
            p = parent[i]
            b = t_byte[i]
            for w in range(4):
                sub[p, w] |= sub[i, w]
            sub[p, b >> 6] |= np.uint64(1) << np.uint64(b & 63)
            for f in range(8):
                if (utf8_ok[p] >> f) & 1:
                    nf = utf8_next[f, b]
                    if nf < 0 or not (utf8_ok[i] >> nf) & 1:
                        utf8_ok[p] &= np.uint8(~(1 << f) & 0xFF)
        return n, t_byte, t_depth, t_next, term, sub, utf8_ok

    return build


def _walk_kernel():
    njit = _numba()

    @njit(cache=True, nogil=True)
    def walk(
        t_byte, t_depth, t_next, tok_start, tok_end, tok_ids, sub_bytes, utf8_ok,
        trans, end_ok, self_loops, nonascii_loop, starts_node, starts_state, n_starts,
        mask, unk_node, unk_state, state_at,
    ):  # fmt: skip
        n_unk = 0
        for k in range(n_starts):
            i = starts_node[k]
            end = t_next[i]
            if i == 0:
                state_at[0] = starts_state[k]
                i = 1
            else:
                state_at[t_depth[i] - 1] = starts_state[k]
            while i < end:
                d = t_depth[i]
                p = state_at[d - 1]
                s = trans[p, t_byte[i]]
                if s < 0:
                    if s == -1:
                        unk_node[n_unk] = i
                        unk_state[n_unk] = p
                        n_unk += 1
                    i = t_next[i]
                    continue
                state_at[d] = s
                if end_ok[s]:
                    nxt = t_next[i]
                    if (
                        (sub_bytes[i, 0] & ~self_loops[s, 0]) == 0
                        and (sub_bytes[i, 1] & ~self_loops[s, 1]) == 0
                        and (
                            (sub_bytes[i, 2] | sub_bytes[i, 3]) == 0
                            or (nonascii_loop[s] and (utf8_ok[i] & 1))
                        )
                    ):
                        # every character below loops back to s (an ASCII byte known to,
                        # or valid UTF-8 where all of non-ASCII does): the whole subtree
                        # is accepted
                        j_end = tok_start[nxt] if nxt < len(tok_start) else len(tok_ids)
                        for j in range(tok_start[i], j_end):
                            mask[tok_ids[j]] = 1
                        i = nxt
                        continue
                    for j in range(tok_start[i], tok_end[i]):
                        mask[tok_ids[j]] = 1
                i += 1
        return n_unk

    return walk


def _utf8_table() -> np.ndarray:
    """UTF-8 decoder phases (RFC 3629) and their next phase per byte, -1 invalid: 0 at a
    character boundary, 1-3 continuation bytes left, 4 after E0, 5 after ED, 6 after F0,
    7 after F4 (whose next byte has a narrower range)."""
    nxt = np.full((8, 256), -1, dtype=np.int8)
    nxt[0, 0x01:0x80] = 0
    nxt[0, 0xC2:0xE0] = 1
    nxt[0, 0xE0] = 4
    nxt[0, 0xE1:0xED] = 2
    nxt[0, 0xED] = 5
    nxt[0, 0xEE:0xF0] = 2
    nxt[0, 0xF0] = 6
    nxt[0, 0xF1:0xF4] = 3
    nxt[0, 0xF4] = 7
    nxt[1, 0x80:0xC0] = 0
    nxt[2, 0x80:0xC0] = 1
    nxt[3, 0x80:0xC0] = 2
    nxt[4, 0xA0:0xC0] = 1
    nxt[5, 0x80:0xA0] = 1
    nxt[6, 0x90:0xC0] = 2
    nxt[7, 0x80:0x90] = 2
    return nxt


def _kernel(name: str):
    k = _KERNELS.get(name)
    if k is None:
        k = _KERNELS[name] = _build_kernel() if name == "build" else _walk_kernel()
    return k


class VocabTrie:
    """The byte trie of ``pieces`` (index = token id); empty pieces are left out."""

    def __init__(self, pieces: Sequence[bytes]):
        n_vocab = len(pieces)
        ids = [i for i in range(n_vocab) if pieces[i]]
        ids.sort(key=pieces.__getitem__)
        uniq: list[bytes] = []
        counts: list[int] = []
        for i in ids:
            p = pieces[i]
            if uniq and uniq[-1] == p:
                counts[-1] += 1
            else:
                uniq.append(p)
                counts.append(1)
        lengths = np.fromiter((len(p) for p in uniq), dtype=np.int64, count=len(uniq))
        offs = np.zeros(len(uniq) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offs[1:])
        buf = np.frombuffer(b"".join(uniq), dtype=np.uint8)
        max_len = int(lengths.max()) if len(uniq) else 0
        n_max = int(offs[-1]) + 1
        n, t_byte, t_depth, t_next, term, sub, utf8_ok = _kernel("build")(
            buf, offs, n_max, max_len, _utf8_table()
        )
        self.utf8_ok = utf8_ok
        self.n_nodes = int(n)
        self.t_byte = t_byte[: self.n_nodes].copy()
        self.t_depth = t_depth[: self.n_nodes].copy()
        self.t_next = t_next[: self.n_nodes].copy()
        cum = np.zeros(len(uniq) + 1, dtype=np.int32)
        np.cumsum(np.asarray(counts, dtype=np.int32), out=cum[1:])
        self.sub_bytes = sub
        # tok_start[i]: the first token at or after node i in preorder, so the tokens of
        # node i's subtree are tok_ids[tok_start[i]:tok_start[next[i]]]; tok_end[i]: the
        # end of node i's own tokens
        counts_at = np.zeros(self.n_nodes + 1, dtype=np.int32)
        counts_at[term + 1] = np.asarray(counts, dtype=np.int32)
        self.tok_start = np.cumsum(counts_at, dtype=np.int32)[: self.n_nodes].copy()
        self.tok_end = self.tok_start.copy()
        self.tok_end[term] = cum[1:]
        self.tok_ids = np.asarray(ids, dtype=np.int32)
        self.max_len = max_len
        self.n_vocab = n_vocab
        # scratch for walks (one walk at a time per trie: callers hold the engine's lock)
        self._unk_node = np.empty(self.n_nodes, dtype=np.int32)
        self._unk_state = np.empty(self.n_nodes, dtype=np.int32)
        self._state_at = np.zeros(max_len + 2, dtype=np.int32)


def walk_mask(trie: VocabTrie, automaton, start_state: int, mask: np.ndarray) -> int:
    """Set ``mask[t]`` (uint8) for every token whose bytes the grammar accepts from
    ``start_state``; returns the number of rounds. The caller holds ``automaton.lock``."""
    walk = _kernel("walk")
    starts_node = np.zeros(1, dtype=np.int32)
    starts_state = np.full(1, start_state, dtype=np.int32)
    rounds = 0
    while True:
        rounds += 1
        n_unk = walk(
            trie.t_byte, trie.t_depth, trie.t_next, trie.tok_start, trie.tok_end, trie.tok_ids,
            trie.sub_bytes, trie.utf8_ok, automaton.trans, automaton.end_ok,
            automaton.self_loops, automaton.nonascii_loop,
            starts_node, starts_state, len(starts_node),
            mask, trie._unk_node, trie._unk_state, trie._state_at,
        )  # fmt: skip
        if n_unk == 0:
            return rounds
        starts_node = trie._unk_node[:n_unk].copy()
        starts_state = trie._unk_state[:n_unk].copy()
        # a state missing many transitions gets its whole row (shared work across bytes),
        # one missing a few gets just those, each (state, byte) once
        keys = np.unique(starts_state.astype(np.int64) * 256 + trie.t_byte[starts_node])
        states, counts = np.unique(keys >> 8, return_counts=True)
        many = states[counts >= _ROW_FILL]
        for p in many.tolist():
            automaton.fill_row(p)
        few = keys[~np.isin(keys >> 8, many)]
        for key in few.tolist():
            automaton.step(key >> 8, key & 0xFF)


def pieces_from_tokens(tokens: Iterable[str], kind: str) -> list[bytes]:
    """Token byte strings from GGUF token texts (a test helper for vocabularies without
    a tokenizer): ``kind`` "spm" maps ``▁`` to a space and ``<0xXX>`` to a byte, "gpt2"
    undoes the GPT-2 byte-to-unicode map."""
    out: list[bytes] = []
    if kind == "spm":
        for t in tokens:
            if len(t) == 6 and t.startswith("<0x") and t.endswith(">"):
                out.append(bytes([int(t[3:5], 16)]))
            else:
                out.append(t.replace("\u2581", " ").encode("utf-8"))
        return out
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    decode = {chr(c): b for b, c in zip(bs, cs, strict=True)}
    for t in tokens:
        try:
            out.append(bytes(decode[ch] for ch in t))
        except KeyError:
            out.append(t.encode("utf-8"))
    return out
