"""The errors a user can cause (bad file, bad flag, too long a prompt), gathered for the tools.

Libraries raise these; the console tools catch ``USER_ERRORS`` and print one line instead of
a traceback. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

from picollama.backends.base import BackendError
from picollama.generation import ContextOverflowError
from picollama.gguf import GGUFError
from picollama.lora import LoraError
from picollama.models.base import ModelLoadError
from picollama.models.registry import ModelFetchError, ModelNotFoundError
from picollama.quant import UnsupportedTypeError
from picollama.speculative import SpeculativeError
from picollama.tokenizer import TemplateError, TokenizerError

__all__ = ["USER_ERRORS"]

USER_ERRORS: tuple[type[BaseException], ...] = (
    GGUFError,
    ModelLoadError,
    ModelNotFoundError,
    ModelFetchError,
    UnsupportedTypeError,
    BackendError,
    ContextOverflowError,
    SpeculativeError,
    LoraError,
    TokenizerError,
    TemplateError,
    OSError,
)
