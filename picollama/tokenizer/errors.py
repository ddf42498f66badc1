"""Typed errors of the tokenizer and of chat templates."""

from __future__ import annotations

__all__ = ["TokenizerError", "TemplateError", "TemplateSecurityError"]


class TokenizerError(ValueError):
    """A vocabulary the tokenizer cannot use, text it cannot encode, or ids it cannot decode.

    The message names the offending value and where it came from (a metadata key, a byte
    offset in the input, a token id and the vocabulary size).
    """


class TemplateError(ValueError):
    """A chat template that does not parse, fails while rendering or exceeds its budgets."""


class TemplateSecurityError(TemplateError):
    """A chat template that reached for something the sandbox forbids (``__class__``, ...)."""
