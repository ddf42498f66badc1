"""Architectures on tiny random models against a float64 numpy forward; load-time errors.

The reference in model_factory.py computes in float64 from the same (dequantized) weights.
These tests check the model code, so they run the CPU backend's "exact" arithmetic (float32
dot products of dequantized blocks); the default "ggml" arithmetic, which rounds activations
to 8 bits as llama.cpp does, is checked against llama.cpp itself in test_qdot.py and
test_runtime_real.py. With exact arithmetic the only differences are float32 roundings: a
few float32 ulps per accumulated term, which over two to six layers stays below 1e-4
relative to the largest logit. A wrong RoPE ordering, mask or norm moves logits by O(1).
"""

from __future__ import annotations

import numpy as np
import pytest
from model_factory import TinySpec, reference_logits, write_tiny_model

from picollama.backends.base import get_backend
from picollama.generation import Context, ContextOverflowError
from picollama.gguf import GGMLType, GGUFReader
from picollama.models import load_model
from picollama.models.base import ModelLoadError

TOKENS = [256, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33, 10, 65, 66]


def _logits(path, tokens, batch=None):
    backend = get_backend("cpu", n_threads=2, arithmetic="exact")
    with GGUFReader(path) as reader:
        model = load_model(reader, backend)
        cache = model.new_cache(64)
        if batch is None:
            return model.forward(np.array(tokens), 0, cache, np.arange(len(tokens)))
        rows = []
        for s in range(0, len(tokens), batch):
            part = np.array(tokens[s : s + batch])
            rows.append(model.forward(part, s, cache, np.arange(len(part))))
        return np.concatenate(rows)


def _check(got, ref):
    scale = np.abs(ref).max()
    assert np.abs(got - ref).max() <= 1e-4 * scale, np.abs(got - ref).max() / scale


@pytest.mark.parametrize(
    "spec",
    [
        TinySpec(),
        TinySpec(tied=False, n_kv_heads=4),
        TinySpec(n_kv_heads=1, weight_type=GGMLType.Q8_0),
        TinySpec(weight_type=GGMLType.Q4_K, n_embd=256, n_ff=256, head_dim=64),
        TinySpec(
            arch="gemma3",
            n_layers=6,
            n_heads=2,
            n_kv_heads=1,
            head_dim=32,
            sliding_window=5,
            rope_base=1e6,
        ),
    ],
    ids=["llama-f32", "llama-untied", "llama-q8_0-mqa", "llama-q4_k", "gemma3-swa"],
)
def test_forward_matches_reference(tmp_path, spec):
    path = tmp_path / "m.gguf"
    weights = write_tiny_model(path, spec)
    ref = reference_logits(spec, weights, TOKENS)
    _check(_logits(path, TOKENS), ref)
    # token by token through the KV cache, and in uneven batches: the same logits
    _check(_logits(path, TOKENS, batch=1), ref)
    _check(_logits(path, TOKENS, batch=5), ref)


def test_generation_respects_context(tmp_path):
    path = tmp_path / "m.gguf"
    write_tiny_model(path, TinySpec())
    ctx = Context(path, n_ctx=16, n_threads=2)
    with pytest.raises(ContextOverflowError, match="17 tokens.*16"):
        ctx.prefill(list(range(17)))
    from picollama.sampling.samplers import Sampler, SamplingParams

    sampler = Sampler(SamplingParams(temperature=0.0), ctx.n_vocab)
    with pytest.raises(ContextOverflowError, match="10 more"):
        list(ctx.generate([256, 65, 66, 67, 68, 69, 70], sampler, max_tokens=10))
    out = list(ctx.generate([256, 65, 66], sampler, max_tokens=-1, ignore_eos=True))
    assert len(out) == 16 - 3 + 1 and ctx.finish_reason == "length"


def test_unknown_architecture_lists_supported(tmp_path):
    path = tmp_path / "m.gguf"
    write_tiny_model(path, TinySpec(arch="mamba9"))
    with GGUFReader(path) as reader, pytest.raises(ModelLoadError) as err:
        load_model(reader, get_backend("cpu", arithmetic="exact"))
    assert "mamba9" in str(err.value) and "gemma3" in str(err.value) and "llama" in str(err.value)


def test_wrong_tensor_shape_is_named(tmp_path):
    path = tmp_path / "m.gguf"
    bad = {"blk.1.attn_k.weight": ((64, 48), None)}
    write_tiny_model(path, TinySpec(overrides=bad))
    with GGUFReader(path) as reader, pytest.raises(ModelLoadError, match="blk.1.attn_k.weight"):
        load_model(reader, get_backend("cpu", arithmetic="exact"))


def test_unsupported_tensor_type_is_named(tmp_path):
    path = tmp_path / "m.gguf"
    bad = {"blk.0.ffn_up.weight": ((256, 256), GGMLType.IQ2_XXS)}
    write_tiny_model(path, TinySpec(n_embd=256, n_ff=256, head_dim=64, overrides=bad))
    with GGUFReader(path) as reader, pytest.raises(ModelLoadError) as err:
        load_model(reader, get_backend("cpu", arithmetic="exact"))
    assert "blk.0.ffn_up.weight" in str(err.value) and "IQ2_XXS" in str(err.value)


def test_metadata_disagreeing_with_tensors(tmp_path):
    path = tmp_path / "m.gguf"
    write_tiny_model(path, TinySpec(declared_layers=3))
    with GGUFReader(path) as reader, pytest.raises(ModelLoadError, match="blk.2.attn_norm"):
        load_model(reader, get_backend("cpu", arithmetic="exact"))


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_batched_sequences_equal_separate_runs(tmp_path, arch):
    """Continuous batching: sequences at different positions in one pass, no cross-talk."""
    from picollama.models.base import Segment

    spec = TinySpec(arch=arch, n_layers=6 if arch == "gemma3" else 2, sliding_window=4)
    path = tmp_path / "m.gguf"
    weights = write_tiny_model(path, spec)
    a, b = TOKENS, TOKENS[3:12]
    with GGUFReader(path) as reader:
        model = load_model(reader, get_backend("cpu", n_threads=2, arithmetic="exact"))
        ca, cb = model.new_cache(64), model.new_cache(64)
        # prefill A fully and B partly in one batch, then decode one token of each together
        la, lb = model.forward_batch(
            [
                Segment(np.array(a[:-1]), 0, ca, np.arange(len(a) - 1)),
                Segment(np.array(b[:-1]), 0, cb),
            ]
        )
        la2, lb2 = model.forward_batch(
            [
                Segment(np.array(a[-1:]), len(a) - 1, ca),
                Segment(np.array(b[-1:]), len(b) - 1, cb),
            ]
        )
    ref_a = reference_logits(spec, weights, a)
    ref_b = reference_logits(spec, weights, b)
    _check(la, ref_a[:-1])
    _check(la2, ref_a[-1:])
    _check(lb, ref_b[-2:-1])
    _check(lb2, ref_b[-1:])
