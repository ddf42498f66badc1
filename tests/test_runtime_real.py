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

# Where greedy paths part, the two engines must have been at a near-tie: our token among
# llama.cpp's top 5, within this many nats of its first choice. With ``--no-repack`` our
# arithmetic follows ggml's op for op (integer block dots, F16 cache, its flash attention,
# exp, RoPE and GELU roundings): SmolLM2's logits equal llama.cpp's bit for bit, so all its
# prompts match. By default SmolLM2's Q4_1 matrices are multiplied 8 rows at a time
# (``simd_x8``), and Gemma 3's Q4_K and Q6_K ones through kernels whose float order we do
# not mirror (llama.cpp repacks Q4_K rows): float32 rounding then flips an occasional
# 8-bit activation or F16 cache rounding, which moves logits by up to ~0.2 nats, so paths
# part at near-ties within 32 tokens (4 of SmolLM2's 6 prompts, at gaps of 0.003 to 0.15
# nats, when this was written); the per-token check is what holds them.
NEAR_TIE_NATS = 0.25
SMOLLM2_PLAIN = SMOLLM2 + " --no-repack"
FULL_MATCHES = {SMOLLM2_PLAIN: 6, SMOLLM2: 0, GEMMA3: 3}


@pytest.fixture(scope="module", params=[SMOLLM2, SMOLLM2_PLAIN, GEMMA3])
def ctx(request):
    name = request.param.split()[0]
    backend = get_backend("cpu", n_threads=2, repack=request.param != SMOLLM2_PLAIN)
    c = Context(model_path(name), n_ctx=1024, backend=backend)
    c.name, c.case = name, request.param
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
        top = dict(ref["top"][i])
        assert ours[i] in top, (ref["prompt"], i, ours[i], ref["top"][i])
        assert ref["top"][i][0][1] - top[ours[i]] < NEAR_TIE_NATS, (ref["prompt"], i, top)
    assert full_matches >= FULL_MATCHES[ctx.case], f"{full_matches} prompts match 32 tokens"


def test_perplexity_matches_llama_cpp(ctx):
    """llama-perplexity's figure at c=512 on the whole license text, within 0.5% (SmolLM2
    with --no-repack: equal; repacked and Gemma 3: see NEAR_TIE_NATS for why not)."""
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
