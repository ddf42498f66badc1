"""CUDA backend end to end: synthetic llama and gemma3 models against the CPU backend.

The models are written with fixed seeds by model_factory (our GGUF writer and quantizers).
Greedy decoding runs 64 tokens on both backends and must pick the same tokens; decode steps
run as CUDA graphs (op by op, then whole) and must give the very logits of eager execution;
perplexity must agree within 0.1%.

Which CPU backend: the CPU's "exact" arithmetic (float32 dot products of exactly
dequantized weights) is what the CUDA kernels compute with arithmetic="exact", up to the
order of float32 sums (relative differences ~1e-6). The CUDA KV cache is fp16, the CPU's
float32; for the greedy comparison the CPU reference rounds what it stores to fp16 too, so
that a storage choice the issue asks for does not count as a kernel error: with ~1e-6
relative differences a greedy flip needs two logits within ~1e-6 of each other, which on
these models (logits spread over ~1) has odds of order 1e-4 over 64 tokens. Perplexity is
compared with the plain CPU backend (float32 cache).

The default arithmetic ("ggml": int8 activations in the matvecs, as llama.cpp's CUDA
backend) is off by the activation rounding, ~5e-3 of each matmul's outputs; it is compared
teacher-forced (test_int8_activations_follow_cpu).
"""

from __future__ import annotations

import numpy as np
import pytest
from model_factory import TinySpec, write_tiny_model

from picollama.backends.base import BackendError, get_backend
from picollama.backends.cuda.backend import _TRUST_AFTER, MV_MAX_TOKENS
from picollama.gguf import GGMLType, GGUFReader
from picollama.models import load_model

N_GEN = 64
PROMPT = [256, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33, 10, 65, 66]


def _cuda(**options):
    try:
        return get_backend("cuda", **options)
    except BackendError as err:
        pytest.skip(f"CUDA backend unavailable here: {err}")


def _f16_kv_cpu():
    from picollama.backends.cpu.backend import CPUBackend

    class F16KVCPU(CPUBackend):
        """The CPU reference with its KV cache rounded to fp16, as the CUDA cache is."""

        def store_kv(self, cache, layer, k, v, start):
            k16 = k.astype(np.float16).astype(np.float32)
            v16 = v.astype(np.float16).astype(np.float32)
            super().store_kv(cache, layer, k16, v16, start)

    return F16KVCPU(arithmetic="exact")


LLAMA = TinySpec(
    n_layers=4,
    n_embd=256,
    n_heads=4,
    n_kv_heads=2,
    head_dim=64,
    n_ff=512,
    weight_type=GGMLType.Q4_K,
    tied=False,
    seed=7,
    overrides={
        **{f"blk.{i}.ffn_down.weight": ((512, 256), GGMLType.Q6_K) for i in range(4)},
        "output.weight": ((256, 258), GGMLType.Q6_K),
        "blk.1.attn_v.weight": ((256, 128), GGMLType.Q8_0),
    },
)
GEMMA3 = TinySpec(
    arch="gemma3",
    n_layers=6,
    n_embd=256,
    n_heads=4,
    n_kv_heads=1,
    head_dim=64,
    n_ff=512,
    sliding_window=8,
    rope_base=1e6,
    eps=1e-6,
    weight_type=GGMLType.Q8_0,
    seed=11,
)
SPECS = {"llama-q4_k_m": LLAMA, "gemma3-q8_0-swa": GEMMA3}


@pytest.fixture(scope="module", params=list(SPECS))
def model_file(request, tmp_path_factory):
    _cuda()  # skip before writing files when there is no GPU
    path = tmp_path_factory.mktemp("cuda_models") / f"{request.param}.gguf"
    write_tiny_model(path, SPECS[request.param])
    return path


def _greedy(backend, path, n_gen=N_GEN):
    """Greedy tokens and every step's logits: one prefill, then one token at a time."""
    with GGUFReader(path) as reader:
        model = load_model(reader, backend)
        cache = model.new_cache(128)
        logits = model.forward(np.array(PROMPT), 0, cache)[-1]
        tokens, all_logits = [], [logits]
        pos = len(PROMPT)
        for _ in range(n_gen):
            tok = int(np.argmax(logits))
            tokens.append(tok)
            logits = model.forward(np.array([tok]), pos, cache)[-1]
            all_logits.append(logits)
            pos += 1
    return tokens, np.array(all_logits)


def _forced(backend, path, tokens):
    """Logits of the prompt and then of each of ``tokens`` fed one at a time."""
    with GGUFReader(path) as reader:
        model = load_model(reader, backend)
        cache = model.new_cache(128)
        logits = [model.forward(np.array(PROMPT), 0, cache)[-1]]
        for pos, tok in enumerate(tokens, start=len(PROMPT)):
            logits.append(model.forward(np.array([tok]), pos, cache)[-1])
    return np.array(logits)


def test_greedy_tokens_match_cpu(model_file):
    cuda = _cuda(graphs=True, arithmetic="exact")
    tokens, logits = _greedy(cuda, model_file)
    ref_tokens, ref_logits = _greedy(_f16_kv_cpu(), model_file)
    assert tokens == ref_tokens
    scale = np.abs(ref_logits).max()
    assert np.abs(logits - ref_logits).max() <= 1e-4 * scale
    # the decode steps ran as graphs, and the first one was recorded; after _TRUST_AFTER
    # clean op-by-op replays the rest ran whole (no Python per op)
    assert cuda.graph_stats["recorded"] == 1
    assert 0 < cuda.graph_stats["kernels"]
    assert cuda.graph_stats["replayed"] == N_GEN - 1
    assert cuda.graph_stats["whole"] == N_GEN - 1 - _TRUST_AFTER
    assert cuda.graph_stats["fallbacks"] == 0


def test_int8_activations_follow_cpu(model_file):
    """Arithmetic "ggml" (int8 activations, fused kernels, whole-step graphs), fed the CPU's
    greedy tokens. Each matmul is off by its activation rounding (test_cuda_backend's
    bound: ~5e-3 of its outputs in practice), and the errors pass through the layers: on
    these models the logits stay within ~2e-2 of the CPU's largest logit (seen: 1.7e-2 for
    llama, 1.1e-2 for gemma3); we allow 5e-2, while a wrong kernel moves them by O(1).
    The argmax must agree wherever the CPU's top-2 margin exceeds twice that step's largest
    logit error (elsewhere the rounding may legitimately pick either)."""
    ref_tokens, ref_logits = _greedy(_f16_kv_cpu(), model_file)
    cuda = _cuda(graphs=True)
    logits = _forced(cuda, model_file, ref_tokens)
    scale = np.abs(ref_logits).max()
    err = np.abs(logits - ref_logits).max(axis=1)
    assert err.max() <= 5e-2 * scale, float(err.max() / scale)
    top2 = np.sort(ref_logits, axis=1)[:, -2:]
    decided = top2[:, 1] - top2[:, 0] > 2 * err
    same = np.argmax(logits, axis=1) == np.argmax(ref_logits, axis=1)
    assert np.all(same[decided]), np.nonzero(decided & ~same)[0]
    assert decided.mean() > 0.5  # the check above is not vacuous
    print(f"int8: logit error {err.max() / scale:.2e} of the scale; argmax agrees "
          f"{same.sum()}/{len(same)}")  # fmt: skip
    assert cuda.graph_stats["whole"] == N_GEN - 1 - _TRUST_AFTER


@pytest.mark.parametrize("arithmetic", ["ggml", "exact"])
@pytest.mark.parametrize("fuse", [False, True])
def test_graph_replay_equals_eager(model_file, fuse, arithmetic):
    """The same kernels on the same inputs. Unfused, replay must be bit-identical to eager;
    fused, the norm's float64 sum of squares is added in another order, which can move a
    norm's float32 scale by one ulp in rare cases (and with int8 activations, in rarer
    ones, an int8 code by one): 1e-6 of the largest logit allows the first, 1e-4 the
    second, while a wrong buffer or position moves logits by O(1). The other fusions
    (Q/K/V, with RoPE and the KV write for int8; gate/up/activation; rope/store_kv) compute
    bit-identical values. The graphs' kernels are programmatic dependents here (sm_90 on;
    each waits for the one before inside): a missing wait would show as a race."""
    graphs = _cuda(graphs=True, fuse=fuse, arithmetic=arithmetic, dependent_launch=True)
    tokens_g, logits_g = _greedy(graphs, model_file, n_gen=12)
    tokens_e, logits_e = _greedy(_cuda(graphs=False, arithmetic=arithmetic), model_file, n_gen=12)
    assert tokens_g == tokens_e
    assert graphs.graph_stats["whole"] == 12 - 1 - _TRUST_AFTER
    if int(graphs.cp.cuda.Device(graphs.device_id).compute_capability) >= 90:
        assert graphs.graph_stats["dependent_launch"]  # used, not fallen back from
    if fuse:
        tol = 1e-6 if arithmetic == "exact" else 1e-4
        assert np.abs(logits_g - logits_e).max() <= tol * np.abs(logits_e).max()
    else:
        np.testing.assert_array_equal(logits_g, logits_e)


# rows of 2048: whole units of matvec_q8_n1_cp (mmvq.cu, MVQ_CP) for Q4_K and Q6_K
WIDE = TinySpec(
    n_layers=2,
    n_embd=2048,
    n_heads=16,
    n_kv_heads=4,
    head_dim=128,
    n_ff=2048,
    weight_type=GGMLType.Q4_K,
    tied=False,
    seed=13,
    overrides={
        **{f"blk.{i}.ffn_down.weight": ((2048, 2048), GGMLType.Q6_K) for i in range(2)},
        "output.weight": ((2048, 258), GGMLType.Q6_K),
    },
)


def test_graph_replay_equals_eager_wide_rows(tmp_path):
    """Rows of 2048 weights, 16 heads of 128 in GQA groups of 4: where mmvq.cu is built with
    MVQ_CP, the one-token Q4_K / Q6_K matvecs (Q/K/V with RoPE, attn_output, gate+up,
    ffn_down, output) take the kernels that copy their weights into shared memory before
    their dependent-launch wait (matvec_q8_n1_cp, run 11); else the register kernels. Fused
    int8 graphs with programmatic launches against eager execution, within
    test_graph_replay_equals_eager's bound for that case."""
    _cuda()
    path = tmp_path / "wide.gguf"
    write_tiny_model(path, WIDE)
    graphs = _cuda(graphs=True, dependent_launch=True)
    tokens_g, logits_g = _greedy(graphs, path, n_gen=12)
    tokens_e, logits_e = _greedy(_cuda(graphs=False), path, n_gen=12)
    assert tokens_g == tokens_e
    assert graphs.graph_stats["whole"] == 12 - 1 - _TRUST_AFTER
    assert np.abs(logits_g - logits_e).max() <= 1e-4 * np.abs(logits_e).max()


def test_two_sequences_alternating_fall_back_correctly(model_file):
    """Decode steps of two caches in turn: the graph recorded for one cache does not match
    the other, so steps fall back to eager execution, and every logit stays right."""
    be_g, be_e = _cuda(graphs=True), _cuda(graphs=False)
    results = []
    for be in (be_g, be_e):
        with GGUFReader(model_file) as reader:
            model = load_model(reader, be)
            caches = [model.new_cache(64), model.new_cache(64)]
            starts = [PROMPT[:5], PROMPT[:9]]
            out = []
            for cache, prompt in zip(caches, starts, strict=True):
                out.append(model.forward(np.array(prompt), 0, cache)[-1])
            pos = [5, 9]
            for step in range(8):
                i = step % 2 if step >= 4 else 0  # first a run on cache 0, then alternate
                tok = int(np.argmax(out[-1]))
                out.append(model.forward(np.array([tok]), pos[i], caches[i])[-1])
                pos[i] += 1
            results.append(np.array(out))
    np.testing.assert_array_equal(results[0], results[1])
    assert be_g.graph_stats["replayed"] >= 2
    assert be_g.graph_stats["fallbacks"] >= 1


@pytest.mark.parametrize("arithmetic,n_batch", [("exact", 64), ("ggml", 64), ("ggml", 8)])
def test_perplexity_matches_cpu(model_file, arithmetic, n_batch):
    """Batches of 64 run through the dequantized-tile GEMM (float32 with "exact"; fp16
    inputs with "ggml", ~1e-4 of each matmul's outputs): within 0.1% of the CPU. Batches
    of 8 run through the matvec kernels, with int8 activations in "ggml": each matmul is
    then off by ~5e-3 of its outputs (the rounding of test_cuda_backend's bound), which
    moves the perplexity of these random models by a few 1e-3 (seen: +0.28% llama,
    +0.005% gemma3): within 1%."""
    from picollama.generation import Context
    from picollama.tools.perplexity import perplexity

    rng = np.random.default_rng(5)
    tokens = rng.integers(0, 256, size=4 * 64).tolist()
    ppl = {}
    backends = (
        ("cuda", _cuda(arithmetic=arithmetic), n_batch),
        ("cpu", get_backend("cpu", arithmetic="exact"), 64),
    )
    for name, backend, batch in backends:
        ctx = Context(model_file, n_ctx=64, n_batch=batch, backend=backend)
        ppl[name] = perplexity(ctx, tokens, n_ctx=64).ppl
        ctx.close()
    print(f"{arithmetic} n_batch {n_batch}: cuda/cpu - 1 = {ppl['cuda'] / ppl['cpu'] - 1:+.2e}")
    assert abs(ppl["cuda"] / ppl["cpu"] - 1) < (1e-3 if n_batch > MV_MAX_TOKENS else 1e-2), ppl


def test_python_api_on_cuda(model_file):
    from picollama.api import Llama

    _cuda()
    llm = Llama(model_path=str(model_file), n_ctx=64, backend="cuda")
    out = llm.create_completion("Hello", max_tokens=8, temperature=0.0)
    assert out["usage"]["completion_tokens"] <= 8
    assert isinstance(out["choices"][0]["text"], str)
