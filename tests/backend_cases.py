"""What the GPU backends' end-to-end tests share: the synthetic llama and gemma3 models
(written by model_factory with fixed seeds), the prompt, and the CPU reference whose KV
cache holds F16 values as theirs does."""

from __future__ import annotations

import numpy as np
from model_factory import TinySpec

from picollama.gguf import GGMLType

N_GEN = 64
PROMPT = [256, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33, 10, 65, 66]

# Q4_K_M's mix: Q4_K, Q6_K ffn_down and output (258 rows: a ragged last row pair), one
# layer's value rows in Q8_0
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
# one KV head, a sliding window of 8 in 5 of each 6 layers, GELU, the embedding tied
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


def f16_kv_cpu():
    """The CPU backend's exact arithmetic with its KV cache rounded to F16, as the GPU
    backends' caches are: a storage format the issues ask for is then no kernel error."""
    from picollama.backends.cpu.backend import CPUBackend

    class F16KVCPU(CPUBackend):
        def store_kv(self, cache, layer, k, v, start):
            k16 = k.astype(np.float16).astype(np.float32)
            v16 = v.astype(np.float16).astype(np.float32)
            super().store_kv(cache, layer, k16, v16, start)

    return F16KVCPU(arithmetic="exact")
