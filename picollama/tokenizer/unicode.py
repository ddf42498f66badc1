"""Codepoint classes and byte mappings, as llama.cpp's unicode.cpp defines them.

llama.cpp classifies each codepoint by its Unicode general category (one flag: letter,
number, mark, punctuation, symbol, separator, control or undefined) plus a White_Space bit,
from its own table (Unicode 15.1, shipped here as ``_unicode_data``). Its regex pre-tokenizer
runs C++ ``std::regex`` on a *collapsed* copy of the text in which every non-ASCII codepoint
is replaced by one byte naming its class; ``collapse`` builds the same copy so that
Python's ``re`` sees exactly what llama.cpp's regex sees.
"""

from __future__ import annotations

import functools
from bisect import bisect_right

from picollama.tokenizer._unicode_data import (
    CATEGORY_RANGES,
    LOWERCASE,
    NFD_RANGES,
    UNICODE_VERSION,
)

__all__ = [
    "UNICODE_VERSION",
    "UNDEFINED",
    "NUMBER",
    "LETTER",
    "SEPARATOR",
    "MARK",
    "PUNCTUATION",
    "SYMBOL",
    "CONTROL",
    "WHITESPACE",
    "category_flag",
    "is_whitespace",
    "is_han",
    "nfd_first",
    "to_lower",
    "collapse",
    "widen",
    "COLLAPSED_CLASS",
    "BYTE_TO_UNICODE",
    "UNICODE_TO_BYTE",
    "bytes_to_unicode",
]

# Category flags (llama.cpp unicode.h ``unicode_cpt_flags``); each codepoint has exactly one.
UNDEFINED = 0x01
NUMBER = 0x02  # \p{N}
LETTER = 0x04  # \p{L}
SEPARATOR = 0x08  # \p{Z}
MARK = 0x10  # \p{M}
PUNCTUATION = 0x20  # \p{P}
SYMBOL = 0x40  # \p{S}
CONTROL = 0x80  # \p{C}

# White_Space from Unicode's PropList.txt, as llama.cpp's gen-unicode-data.py lists it.
WHITESPACE = frozenset(
    [*range(0x09, 0x0E), 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B)]
    + [0x2028, 0x2029, 0x202F, 0x205F, 0x3000]
)


def _parse_ranges() -> tuple[list[int], list[int]]:
    starts: list[int] = []
    flags: list[int] = []
    for entry in CATEGORY_RANGES.split():
        start, flag = entry.split(":")
        starts.append(int(start, 16))
        flags.append(int(flag, 16))
    return starts, flags


_STARTS, _FLAGS = _parse_ranges()


def category_flag(cp: int) -> int:
    """The category flag of codepoint ``cp`` (``UNDEFINED`` past U+10FFFF)."""
    if cp >= 0x110000:
        return UNDEFINED
    return _FLAGS[bisect_right(_STARTS, cp) - 1]


@functools.cache
def _nfd_table() -> tuple[list[int], list[tuple[int, int]]]:
    firsts: list[int] = []
    rest: list[tuple[int, int]] = []
    for entry in NFD_RANGES.split():
        first, last, nfd = (int(x, 16) for x in entry.split(":"))
        firsts.append(first)
        rest.append((last, nfd))
    return firsts, rest


def nfd_first(cp: int) -> int:
    """The first codepoint of ``cp``'s canonical decomposition (llama.cpp's
    ``unicode_cpts_normalize_nfd``, which keeps only that one: é -> e)."""
    firsts, rest = _nfd_table()
    i = bisect_right(firsts, cp) - 1
    if i >= 0 and cp <= rest[i][0]:
        return rest[i][1]
    return cp


@functools.cache
def _lower_table() -> dict[int, int]:
    table = {}
    for entry in LOWERCASE.split():
        cp, low = entry.split(":")
        table[int(cp, 16)] = int(low, 16)
    return table


def to_lower(cp: int) -> int:
    """Simple lowercase mapping (llama.cpp ``unicode_tolower``)."""
    return _lower_table().get(cp, cp)


def is_whitespace(cp: int) -> bool:
    return cp in WHITESPACE


def is_han(cp: int) -> bool:
    """CJK ideographs, with the ranges of llama.cpp's ``unicode_cpt_is_han``."""
    return (
        0x4E00 <= cp <= 0x9FFF
        or 0x3400 <= cp <= 0x4DBF
        or 0x20000 <= cp <= 0x2A6DF
        or 0x2A700 <= cp <= 0x2B73F
        or 0x2B740 <= cp <= 0x2B81F
        or 0x2B820 <= cp <= 0x2CEAF
        or 0x2CEB0 <= cp <= 0x2EBEF
        or 0xF900 <= cp <= 0xFAFF
        or 0x2F800 <= cp <= 0x2FA1F
    )


# The byte that stands for each class in the collapsed text (llama.cpp ``k_ucat_cpt``);
# whitespace collapses to a vertical tab, which std::regex's ``\s`` matches.
COLLAPSED_CLASS = {
    NUMBER: "\xd1",
    LETTER: "\xd2",
    PUNCTUATION: "\xd3",
    MARK: "\xd4",
    SYMBOL: "\xd5",
}
_COLLAPSED_OTHER = "\xd0"
_COLLAPSED_SPACE = "\x0b"


class _CollapseTable(dict):
    """``str.translate`` table that classifies each non-ASCII codepoint on first sight."""

    def __missing__(self, cp: int) -> str:
        if cp in WHITESPACE:
            value = _COLLAPSED_SPACE
        else:
            value = COLLAPSED_CLASS.get(category_flag(cp), _COLLAPSED_OTHER)
        self[cp] = value
        return value


class _WidenTable(dict):
    """``str.translate`` table that only maps non-ASCII whitespace to a vertical tab."""

    def __missing__(self, cp: int) -> int:
        value = 0x0B if cp in WHITESPACE else cp
        self[cp] = value
        return value


_COLLAPSE = _CollapseTable({cp: cp for cp in range(128)})
_WIDEN = _WidenTable({cp: cp for cp in range(128)})


def collapse(text: str) -> str:
    """One character per codepoint: ASCII kept, others replaced by their class byte."""
    return text.translate(_COLLAPSE)


def widen(text: str) -> str:
    """The text that llama.cpp gives ``std::wregex``: non-ASCII whitespace as ``\\v``."""
    return text.translate(_WIDEN)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte-to-character map (llama.cpp ``unicode_byte_to_utf8_map``).

    Printable Latin-1 bytes map to themselves; the other 68 bytes map, in order, to
    U+0100, U+0101, ... so that every byte has a visible, non-space character.
    """
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    mapping = {b: chr(b) for b in keep}
    n = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + n)
            n += 1
    return mapping


BYTE_TO_UNICODE: dict[int, str] = bytes_to_unicode()
UNICODE_TO_BYTE: dict[str, int] = {c: b for b, c in BYTE_TO_UNICODE.items()}
