"""A prefix tree of KV entries shared by all slots, in the spirit of SGLang's RadixAttention.

Each edge of the tree holds a run of tokens and the K/V rows the model computed for them at
their positions (a node at depth ``d`` holds positions ``d ..``); the path from the root
spells a token sequence whose KV the server has evaluated once. A slot that starts a request
walks the tree with its prompt and copies the longest cached prefix into its own KV cache, so
its prefill starts after the shared part; when a slot has evaluated a prompt (and again when
it finishes) it inserts its tokens, so the next request with that prefix, on any slot, finds
them, even after the slot that computed them has moved on to another prompt.

The slots' caches stay contiguous arrays (the compiled decode step and the attention kernels
take them whole), so the tree keeps its own copy of what it holds rather than pages that the
slots point into, and is bounded by ``capacity`` tokens: the least recently used leaves go
first. Entries computed under different model views (LoRA adapter scales) are kept apart,
under one root per view.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

__all__ = ["PrefixTree"]


class _Node:
    __slots__ = ("tokens", "k", "v", "children", "parent", "last_used")

    def __init__(self, tokens: list[int], k: np.ndarray, v: np.ndarray, parent: _Node | None):
        self.tokens = tokens  # the edge's label; k, v: (n_layers, len(tokens), ...)
        self.k = k
        self.v = v
        self.children: dict[int, _Node] = {}  # keyed by the child's first token
        self.parent = parent
        self.last_used = 0


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class PrefixTree:
    """Token sequences and their KV rows, shared by the slots of one engine.

    ``capacity``: the most tokens (over all edges) the tree holds; 0 disables it. Caches are
    ``picollama.backends`` KV caches whose per-layer ``k[layer]`` / ``v[layer]`` arrays are
    indexed by position first.
    """

    def __init__(self, capacity: int):
        if capacity < 0:
            raise ValueError(f"the prefix tree's capacity must be >= 0 tokens, got {capacity}")
        self.capacity = int(capacity)
        self.n_tokens = 0  # tokens held, over every root
        self._roots: dict[Hashable, _Node] = {}
        self._clock = 0

    def _root(self, view: Hashable) -> _Node:
        root = self._roots.get(view)
        if root is None:
            empty = np.zeros((0,), np.float32)
            root = self._roots[view] = _Node([], empty, empty, None)
        return root

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _walk(self, view: Hashable, tokens: Sequence[int]) -> tuple[list[tuple[_Node, int]], int]:
        """The path of ``tokens`` from the root: (node, how many of its tokens match) for each
        node entered, and the total number of tokens matched."""
        path: list[tuple[_Node, int]] = []
        node, n = self._roots.get(view), 0
        if node is None:
            return path, 0
        while n < len(tokens):
            child = node.children.get(tokens[n])
            if child is None:
                break
            m = _common(child.tokens, tokens[n : n + len(child.tokens)])
            path.append((child, m))
            n += m
            if m < len(child.tokens):
                break
            node = child
        return path, n

    def match(self, view: Hashable, tokens: Sequence[int]) -> int:
        """How many leading tokens of ``tokens`` the tree holds under ``view``."""
        return self._walk(view, tokens)[1]

    def restore(self, view: Hashable, tokens: Sequence[int], cache, start: int, end: int) -> int:
        """Copy the tree's KV rows of positions ``start .. end`` of ``tokens`` into ``cache``
        (as far as the tree holds them); return the position reached (``start`` if none)."""
        path, n = self._walk(view, tokens[:end])
        if n <= start:
            return start
        now, pos = self._tick(), 0
        for node, m in path:
            node.last_used = now
            lo, hi = max(start, pos), min(n, pos + m)
            if lo < hi:
                for layer in range(len(cache.k)):
                    cache.k[layer][lo:hi] = node.k[layer, lo - pos : hi - pos]
                    cache.v[layer][lo:hi] = node.v[layer, lo - pos : hi - pos]
            pos += m
        return n

    def insert(self, view: Hashable, tokens: Sequence[int], cache) -> int:
        """Add ``tokens`` (positions 0 .. len-1 of ``cache``, already evaluated) under
        ``view``, copying the KV rows the tree does not hold yet; return how many tokens were
        added (0 when it held them all, or when there is no room even after evicting)."""
        if self.capacity == 0 or not tokens:
            return 0
        tokens = [int(t) for t in tokens]
        path, n = self._walk(view, tokens)
        now = self._tick()
        for node, _ in path:
            node.last_used = now
        parent = self._root(view)
        if path:
            node, m = path[-1]
            if m < len(node.tokens):
                parent = self._split(node, m)
            else:
                parent = node
        add = min(len(tokens) - n, self.capacity)
        if add <= 0:
            return 0
        self._evict(self.n_tokens + add - self.capacity, keep=parent)
        add = min(add, self.capacity - self.n_tokens)
        if add <= 0:
            return 0
        k = np.stack([a[n : n + add] for a in cache.k])  # (n_layers, add, n_kv_heads, dim)
        v = np.stack([a[n : n + add] for a in cache.v])
        leaf = _Node(tokens[n : n + add], k, v, parent)
        leaf.last_used = now
        parent.children[leaf.tokens[0]] = leaf
        self.n_tokens += add
        return add

    def _split(self, node: _Node, m: int) -> _Node:
        """Cut ``node``'s edge after ``m`` tokens; return the new upper node."""
        upper = _Node(node.tokens[:m], node.k[:, :m], node.v[:, :m], node.parent)
        upper.last_used = node.last_used
        node.parent.children[upper.tokens[0]] = upper
        node.tokens, node.k, node.v = node.tokens[m:], node.k[:, m:], node.v[:, m:]
        node.parent = upper
        upper.children[node.tokens[0]] = node
        return upper

    def _evict(self, n_needed: int, keep: _Node) -> None:
        """Drop least recently used leaves until ``n_needed`` tokens are free; ``keep`` and
        its ancestors stay (a new leaf is about to hang from it)."""
        protected = set()
        node = keep
        while node is not None:
            protected.add(id(node))
            node = node.parent
        while n_needed > 0:
            leaves = [x for x in self._nodes() if not x.children and id(x) not in protected]
            if not leaves:
                return
            victim = min(leaves, key=lambda x: x.last_used)
            del victim.parent.children[victim.tokens[0]]
            self.n_tokens -= len(victim.tokens)
            n_needed -= len(victim.tokens)

    def _nodes(self):
        stack = [c for root in self._roots.values() for c in root.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def clear(self) -> None:
        self._roots.clear()
        self.n_tokens = 0
