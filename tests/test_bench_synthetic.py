"""The synthetic models of ``bench_synthetic``: the files other hosts benchmark stand in for
the real ones there, so their tensor types and shapes must be the real files' (the weights
are random bytes with small finite scales: only the byte format matters for speed)."""

from __future__ import annotations

import numpy as np

from picollama.backends.cuda.bench_synthetic import main
from picollama.generation import Context
from picollama.gguf import GGMLType, GGUFReader


def test_the_135m_q4_1_file_has_smollm2_q4_1s_layout_and_decodes_on_the_cpu(tmp_path, capsys):
    """``--write-only`` writes it with no GPU, and the CPU backend runs it."""
    assert main(["--models", "135m-q4_1", "--write-only", "--dir", str(tmp_path)]) == 0
    path = tmp_path / "synth-135m-q4_1.gguf"
    assert capsys.readouterr().out.splitlines()[-1] == str(path)
    with GGUFReader(path) as reader:
        assert reader.get("general.file_type") == 3  # LLAMA_FTYPE_MOSTLY_Q4_1
        types = {t.name: t.type for t in reader.tensors}
        shapes = {t.name: tuple(t.shape) for t in reader.tensors}
    # SmolLM2-135M-Instruct's Q4_1 file: Q4_1 matrices, Q8_0 tied embeddings, F32 norms
    assert types.pop("token_embd.weight") == GGMLType.Q8_0
    assert shapes["token_embd.weight"] == (576, 49152)
    assert "output.weight" not in types
    assert len([n for n in types if n.endswith("_norm.weight")]) == 61
    assert {t for n, t in types.items() if not n.endswith("_norm.weight")} == {GGMLType.Q4_1}
    assert shapes["blk.29.ffn_down.weight"] == (1536, 576)
    assert shapes["blk.0.attn_k.weight"] == (576, 192)
    ctx = Context(str(path), n_ctx=32)
    logits = ctx.eval([256, 72, 101, 108])
    assert logits.shape[-1] == 49152 and np.isfinite(logits).all()
