"""picollama.sampling: the sampler chain and structured output.

Structured output (GBNF grammars, JSON schemas, regexes, fixed choices) compiles to one
engine (``grammar``) that constrains the sampler chain (``samplers.Sampler(grammar=...)``).
``LlamaGrammar`` is the llama-cpp-python face: ``from_string``, ``from_file``,
``from_json_schema``, plus ``from_regex`` and ``from_choices``.
"""

from picollama.sampling.gbnf import GrammarError
from picollama.sampling.grammar import (
    Grammar,
    GrammarMatcher,
    GrammarState,
    LlamaGrammar,
    TokenConstraint,
    TokenVocab,
    grammar_from_request,
)
from picollama.sampling.json_schema import SchemaError, schema_to_gbnf
from picollama.sampling.regex import RegexError, choices_to_gbnf, regex_to_gbnf

__all__ = [
    "GrammarError",
    "SchemaError",
    "RegexError",
    "Grammar",
    "GrammarMatcher",
    "GrammarState",
    "LlamaGrammar",
    "TokenConstraint",
    "TokenVocab",
    "grammar_from_request",
    "schema_to_gbnf",
    "regex_to_gbnf",
    "choices_to_gbnf",
]
