"""The error every conversion failure becomes: one line that names the problem."""

from __future__ import annotations

__all__ = ["ConvertError"]


class ConvertError(Exception):
    """A checkpoint that cannot be converted, or an output that must not be written."""
