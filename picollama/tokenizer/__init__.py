"""Tokenizers built from GGUF metadata (SPM, BPE, WPM, as llama.cpp runs them); chat templates."""

from picollama.tokenizer.chat import BUILTIN_TEMPLATES, ChatTemplate
from picollama.tokenizer.errors import TemplateError, TemplateSecurityError, TokenizerError
from picollama.tokenizer.pretokenize import PRE_TOKENIZERS, PreTokenizer, pre_tokenizer_for
from picollama.tokenizer.tokenizer import Detokenizer, Tokenizer
from picollama.tokenizer.vocab import TOKEN_NULL, TokenAttr, TokenType, Vocab, VocabType

__all__ = [
    "ChatTemplate",
    "BUILTIN_TEMPLATES",
    "Tokenizer",
    "Detokenizer",
    "Vocab",
    "VocabType",
    "TokenAttr",
    "TokenType",
    "TOKEN_NULL",
    "PreTokenizer",
    "PRE_TOKENIZERS",
    "pre_tokenizer_for",
    "TokenizerError",
    "TemplateError",
    "TemplateSecurityError",
]
