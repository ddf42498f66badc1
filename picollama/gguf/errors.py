"""Typed errors for GGUF files: each names the field and the byte offset where it was found."""

from __future__ import annotations

__all__ = ["GGUFError", "GGUFKeyError", "quote"]

# Names and keys come from the file: quote them with escapes and cap their length so that an
# error message never carries terminal control sequences or a megabyte of key.
_QUOTE_LIMIT = 80


def quote(text: str, limit: int = _QUOTE_LIMIT) -> str:
    """``text`` as a quoted, escaped literal of at most about ``limit`` characters."""
    if len(text) > limit:
        return repr(text[:limit])[:-1] + f"...' ({len(text)} chars)"
    return repr(text)


class GGUFError(ValueError):
    """A malformed or unsupported GGUF file, or a metadata value of the wrong type.

    ``field`` names what was being read (``"version"``, ``"key 'general.name' (#2)"``,
    ``"tensor 'blk.0.attn_q.weight' (#3)"``) and ``offset`` is the absolute byte offset in the
    file where the offending bytes start (``None`` when there is no such place, for example a
    missing key). The message reads ``"{field} at offset {offset}: {detail}"``.
    """

    def __init__(self, detail: str, *, field: str | None = None, offset: int | None = None):
        self.detail = detail
        self.field = field
        self.offset = offset
        if offset is not None:
            message = f"{field or 'file'} at offset {offset}: {detail}"
        elif field is not None:
            message = f"{field}: {detail}"
        else:
            message = detail
        super().__init__(message)

    # KeyError (a base of GGUFKeyError) quotes its message; keep the plain text for both.
    __str__ = ValueError.__str__


class GGUFKeyError(GGUFError, KeyError):
    """A metadata key or tensor name that the file does not have."""
