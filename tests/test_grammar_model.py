"""Constrained generation with a real model (SmolLM2): under llama.cpp's json.gbnf, a JSON
schema with nested objects, arrays and enums, and a regex, 20 seeds each, every output is
checked by an independent parser (json.loads + jsonschema, re.fullmatch)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import NESTED_SCHEMA

from picollama.sampling.grammar import LlamaGrammar

pytestmark = [pytest.mark.model, pytest.mark.slow]

GRAMMARS = Path(__file__).parent / "data" / "grammars"
SEEDS = range(20)

SCHEMA = NESTED_SCHEMA
REGEX = r"(Mon|Tue|Wed|Thu|Fri) [0-2][0-9]:[0-5][0-9] (AM|PM)"


@pytest.fixture(scope="module")
def llm(smollm2_path):
    from picollama import Llama

    return Llama(str(smollm2_path), n_ctx=512, seed=0)


def generate(llm, prompt: str, seed: int, max_tokens: int, **kw) -> str:
    """A chat reply through the public API (``grammar=`` / ``response_format=``), from an
    empty cache so each seed's output does not depend on the test before it."""
    llm.ctx.reset()
    kw.setdefault("temperature", 0.8)
    out = llm.create_chat_completion(
        [{"role": "user", "content": prompt}], max_tokens=max_tokens, seed=seed, **kw
    )
    choice = out["choices"][0]
    assert choice["finish_reason"] == "stop", f"no end in {max_tokens} tokens"
    return choice["message"]["content"]


@pytest.mark.parametrize("seed", SEEDS)
def test_json_gbnf(llm, seed):
    g = LlamaGrammar.from_file(GRAMMARS / "json.gbnf")
    prompt = 'Return a JSON object with one key, "city", set to Paris.'
    # top_k 5: json.gbnf allows unbounded nesting, which the small model sometimes
    # rambles into with a wider top-k
    text = generate(llm, prompt, seed, 200, grammar=g, top_k=5)
    assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("seed", SEEDS)
def test_json_schema(llm, seed):
    jsonschema = pytest.importorskip("jsonschema")
    rf = {"type": "json_schema", "json_schema": {"name": "dog", "schema": SCHEMA}}
    text = generate(llm, "Describe a small dog as JSON.", seed, 200, response_format=rf)
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("seed", SEEDS)
def test_regex(llm, seed):
    g = LlamaGrammar.from_regex(REGEX)
    text = generate(llm, "When is the meeting?", seed, 40, grammar=g)
    assert re.fullmatch(REGEX, text)
