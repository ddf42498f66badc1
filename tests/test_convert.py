"""picollama-convert on tiny random HF checkpoints (tests/data/convert, made by
tests/gen_convert_fixtures.py with transformers, which these tests do not need).

Each converted file must give transformers' frozen logits through our engine, our tokenizer
on it must give the HF tokenizer's frozen ids, and the safety promises hold: no pickles
opened, no output over an input, no partial file. (tests/test_archs.py holds the per
architecture checks: greedy generation, sliding windows, softcaps, chat templates.)
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("safetensors", reason="needs the convert extra")  # in the test extra

from picollama.backends.base import get_backend  # noqa: E402
from picollama.convert import ConvertError, convert_hf_to_gguf  # noqa: E402
from picollama.convert.archs import permute_qk  # noqa: E402
from picollama.convert.checkpoint import Checkpoint  # noqa: E402
from picollama.convert.vocab import CHKHSH_PRE, check_hash, pre_from_definition  # noqa: E402
from picollama.generation import Context  # noqa: E402
from picollama.gguf import GGUFReader  # noqa: E402
from picollama.gguf.constants import GGMLType  # noqa: E402
from picollama.quant import dequantize  # noqa: E402
from picollama.tokenizer import Tokenizer  # noqa: E402
from picollama.tokenizer.pretokenize import pre_tokenizer_for  # noqa: E402
from picollama.tools.convert import main  # noqa: E402

DATA = Path(__file__).parent / "data" / "convert"
ARCHS = ["llama", "qwen2", "qwen3", "gemma3", "mistral", "phi3", "gemma2"]
GGUF_ARCH = {"mistral": "llama"}  # llama.cpp's converter writes Mistral as llama
OUTTYPES = ["f32", "f16", "bf16", "q8_0"]

# Logit error bounds, relative to the largest |logit| of the prompt. f32 only reorders float32
# sums (measured < 1.2e-6 on every architecture and prompt). The other types round each
# matrix weight once, with a relative error of order the format's unit roundoff: f16
# 2^-11 = 4.9e-4, bf16 2^-8 = 3.9e-3, and Q8_0 steps of max|w|/127 per block of 32, about
# 1e-2 of a typical weight (test_weights_within_format_rounding checks each weight against
# exactly those bounds).
# These random 2-layer models carry weight error to the logits 3-10x amplified; measured
# worst case over 7 architectures x the 2 short prompts: f16 2.5e-3, bf16 1.7e-2, q8_0 6.2e-2.
# The bounds sit 1.6-2.4x above that and an order of magnitude below the O(1) error that a
# transposed, unpermuted or unshifted tensor gives. The long third prompt (about 100
# positions, for the sliding windows) is checked in f32 only: its max over many more
# positions reaches 8.4e-2 in q8_0, too close to that bound to tell a fault from rounding.
REL_ERROR = {"f32": 1e-4, "f16": 5e-3, "bf16": 4e-2, "q8_0": 1e-1}
# general.file_type of each output type (llama.h llama_ftype)
FILE_TYPE = {"f32": 0, "f16": 1, "q8_0": 7, "bf16": 32}
MATRIX_TYPE = {
    "f32": GGMLType.F32,
    "f16": GGMLType.F16,
    "bf16": GGMLType.BF16,
    "q8_0": GGMLType.Q8_0,
}


def refs(arch: str) -> dict:
    return json.loads((DATA / arch / "refs.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(arch, outtype) -> converted file, each made once for the module."""
    out_dir = tmp_path_factory.mktemp("converted")
    cache: dict[tuple[str, str], Path] = {}

    def get(arch: str, outtype: str) -> Path:
        key = (arch, outtype)
        if key not in cache:
            cache[key] = convert_hf_to_gguf(
                DATA / arch, out_dir / f"{arch}-{outtype}.gguf", outtype=outtype
            )
        return cache[key]

    return get


def _values(t) -> np.ndarray:
    """A GGUF tensor's values as float64, numpy order."""
    if t.type in (GGMLType.F32, GGMLType.F16):
        return np.array(t.array(), dtype=np.float64)
    if t.type == GGMLType.BF16:
        return (t.array().astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return dequantize(t.array(), t.type).astype(np.float64)


def our_logits(path: Path, ids: list[int]) -> np.ndarray:
    backend = get_backend("cpu", n_threads=2, arithmetic="exact")
    ctx = Context(path, n_ctx=160, backend=backend)
    try:
        return ctx.eval(ids, all_logits=True)
    finally:
        ctx.close()


# -- numerics ------------------------------------------------------------------------------


@pytest.mark.parametrize("outtype", OUTTYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers(converted, arch, outtype):
    path = converted(arch, outtype)
    prompts = refs(arch)["prompts"]
    for i, prompt in enumerate(prompts if outtype == "f32" else prompts[:2]):
        expected = np.load(DATA / arch / f"logits_{i}.npy")
        got = our_logits(path, prompt["ids"])
        assert got.shape == expected.shape
        err = np.abs(got - expected).max() / np.abs(expected).max()
        assert err <= REL_ERROR[outtype], (arch, outtype, i, err)
        # and greedy choices agree wherever transformers' top two are not a near tie
        top2 = np.sort(expected, axis=1)[:, -2:]
        clear = top2[:, 1] - top2[:, 0] > 4 * REL_ERROR[outtype] * np.abs(expected).max()
        assert (got.argmax(1) == expected.argmax(1))[clear].all()


# -- what the file holds -------------------------------------------------------------------


@pytest.mark.parametrize("outtype", OUTTYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_tensor_types_and_metadata(converted, arch, outtype):
    gguf_arch = GGUF_ARCH.get(arch, arch)
    with GGUFReader(converted(arch, outtype)) as r:
        assert r.get("general.architecture") == gguf_arch
        assert r.get("general.file_type") == FILE_TYPE[outtype]
        assert r.get(f"{gguf_arch}.block_count") == 2
        assert r.get(f"{gguf_arch}.embedding_length") == 32
        for t in r.tensors:
            if len(t.shape) == 1 or t.name.endswith("_norm.weight"):
                assert t.type == GGMLType.F32, t.name
            else:
                assert t.type == MATRIX_TYPE[outtype], t.name
        names = {t.name for t in r.tensors}
    untied = ("llama", "qwen2", "mistral", "phi3")
    assert ("output.weight" in names) == (arch in untied)
    assert ("blk.0.attn_q.bias" in names) == (arch == "qwen2")
    assert ("blk.1.attn_k_norm.weight" in names) == (arch in ("qwen3", "gemma3"))
    assert ("blk.0.post_ffw_norm.weight" in names) == (arch in ("gemma2", "gemma3"))
    assert ("blk.0.attn_qkv.weight" in names) == (arch == "phi3")


@pytest.mark.parametrize("outtype", ["f16", "bf16", "q8_0"])
@pytest.mark.parametrize("arch", ARCHS)
def test_weights_within_format_rounding(converted, arch, outtype):
    """Every matrix equals the f32 file's within one rounding of its format (nearest, so half
    a unit in the last place; Q8_0: half a step of its block's scale, max|w|/127)."""
    with GGUFReader(converted(arch, "f32")) as exact, GGUFReader(converted(arch, outtype)) as r:
        for t in r.tensors:
            want = _values(exact.tensor(t.name))
            got = _values(t)
            if t.type == GGMLType.F32:
                assert np.array_equal(got, want), t.name
                continue
            if t.type == GGMLType.Q8_0:
                blocks = want.reshape(-1, 32)
                step = np.abs(blocks).max(axis=1, keepdims=True) / 127
                # half a step, plus up to 127 steps of the f16 rounding of the stored scale
                bound = step * (0.5 + 127 * 2.0**-11) + 1e-12
                bound = np.broadcast_to(bound, blocks.shape).reshape(want.shape)
            else:
                ulp = 2.0 ** -(10 if t.type == GGMLType.F16 else 7)
                bound = np.abs(want) * ulp / 2 + 2.0**-24
            assert (np.abs(got - want) <= bound).all(), t.name


def test_llama_keys_and_layouts(converted):
    """llama.cpp's llama keys, Q/K rows permuted to adjacent RoPE pairs, V untouched."""
    ckpt = Checkpoint(DATA / "llama")
    with GGUFReader(converted("llama", "f32")) as r:
        assert r.get("llama.vocab_size") == 400
        assert r.get("llama.rope.dimension_count") == 8
        assert r.get("llama.attention.head_count_kv") == 2
        assert r.get("tokenizer.ggml.model") == "llama"
        assert r.get("tokenizer.ggml.add_bos_token") is True
        assert r.get("tokenizer.ggml.bos_token_id") == 1
        q = r.tensor("blk.1.attn_q.weight").array()
        k = r.tensor("blk.1.attn_k.weight").array()
        v = r.tensor("blk.1.attn_v.weight").array()
    hf_q = ckpt.load("model.layers.1.self_attn.q_proj.weight")
    hf_k = ckpt.load("model.layers.1.self_attn.k_proj.weight")
    assert np.array_equal(q, permute_qk(hf_q, 4)) and not np.array_equal(q, hf_q)
    assert np.array_equal(k, permute_qk(hf_k, 2))
    assert np.array_equal(v, ckpt.load("model.layers.1.self_attn.v_proj.weight"))
    # head 0, pair 0: rows 0 and head_dim/2 of HF become rows 0 and 1
    assert np.array_equal(q[:2], hf_q[[0, 4]])


def test_gemma3_norms_and_keys(converted):
    ckpt = Checkpoint(DATA / "gemma3")
    with GGUFReader(converted("gemma3", "f16")) as r:
        assert r.get("gemma3.attention.sliding_window") == 64
        assert r.get("gemma3.rope.freq_base") == 1_000_000.0
        assert r.get("gemma3.rope.freq_base_swa") == 10000.0
        assert r.get("gemma3.attention.key_length") == 16
        assert r.get("tokenizer.ggml.add_space_prefix") is False
        for hf, gg in (
            ("model.layers.0.pre_feedforward_layernorm.weight", "blk.0.ffn_norm.weight"),
            ("model.layers.1.self_attn.q_norm.weight", "blk.1.attn_q_norm.weight"),
            ("model.norm.weight", "output_norm.weight"),
        ):
            assert np.array_equal(r.tensor(gg).array(), ckpt.load(hf) + np.float32(1)), gg


def test_qwen_keys(converted):
    with GGUFReader(converted("qwen2", "f32")) as r:
        assert r.get("qwen2.rope.freq_base") == 1_000_000.0
        assert r.get("tokenizer.ggml.model") == "gpt2"
        assert r.get("tokenizer.ggml.pre") == "qwen2"
        tokens = r.get("tokenizer.ggml.tokens")
        assert len(tokens) == 304 and tokens[-1] == "[PAD303]"  # config vocab_size pads
        assert r.get("tokenizer.ggml.eos_token_id") == tokens.index("<|im_end|>")
        assert "<|im_start|>" in r.get("tokenizer.chat_template")
        assert len(r.get("tokenizer.ggml.merges")) > 0
    with GGUFReader(converted("qwen3", "f32")) as r:
        assert r.get("qwen3.attention.key_length") == 16  # head_dim * heads != hidden
        assert r.tensor("blk.0.attn_q.weight").shape == (32, 64)


def test_pypi_gguf_reads_the_output(converted):
    """The gguf package (llama.cpp's gguf-py) reads our file: names, types, shapes agree."""
    gguf = pytest.importorskip("gguf")
    path = converted("gemma3", "q8_0")
    theirs = gguf.GGUFReader(path)
    with GGUFReader(path) as ours:
        assert [t.name for t in theirs.tensors] == [t.name for t in ours.tensors]
        for t in theirs.tensors:
            mine = ours.tensor(t.name)
            assert int(t.tensor_type) == int(mine.type)
            assert tuple(int(d) for d in t.shape) == mine.shape


# -- tokenizer -----------------------------------------------------------------------------

# Lines where transformers 5's tokenizer disagrees with the sentencepiece library itself on
# the same tokenizer.model (its converted Metaspace tokenizer splits a leading space from
# the dummy prefix); llama.cpp and we follow sentencepiece there.
HF_SPM_DIFFERENCES = {
    (arch, " leading space and  double  spaces") for arch in ("llama", "mistral", "phi3")
}


@pytest.mark.parametrize("arch", ARCHS)
def test_tokenizer_matches_hf(converted, arch):
    with GGUFReader(converted(arch, "f32")) as r:
        tok = Tokenizer.from_gguf(r)
    sp = None
    if (DATA / arch / "tokenizer.model").is_file():
        import sentencepiece

        sp = sentencepiece.SentencePieceProcessor(model_file=str(DATA / arch / "tokenizer.model"))
    data = refs(arch)
    for entry in data["prompts"]:
        assert tok.encode(entry["text"]) == entry["ids"], entry["text"]
    differences = set()
    for entry in data["corpus"]:
        text = entry["text"]
        ours = tok.encode(text)
        if sp is not None:
            assert ours == [tok.bos_id] * tok.add_bos + sp.encode(text), text
        if ours != entry["ids"]:
            differences.add((arch, text))
        else:
            assert tok.encode(text, add_bos=False) == entry["ids_no_special"], text
    assert differences == {d for d in HF_SPM_DIFFERENCES if d[0] == arch}


def test_check_hash_table_names_are_known_pre_tokenizers():
    for name in set(CHKHSH_PRE.values()):
        pre_tokenizer_for(name)  # raises for a name our tokenizer does not implement


def test_pre_tokenizer_identification():
    """Tiny vocabularies are not in llama.cpp's hash table: named from their definition."""
    path = DATA / "qwen2" / "tokenizer.json"
    assert check_hash(path) not in CHKHSH_PRE
    assert len(check_hash(path)) == 64
    assert pre_from_definition(json.loads(path.read_text(encoding="utf-8"))) == "qwen2"
    gpt2 = {"pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}}
    assert pre_from_definition(gpt2) == "gpt-2"
    assert pre_from_definition({"pre_tokenizer": {"type": "Whitespace"}}) is None


# -- the command line and its safety -------------------------------------------------------


@pytest.fixture
def llama_copy(tmp_path):
    folder = tmp_path / "llama"
    shutil.copytree(DATA / "llama", folder)
    return folder


def test_cli_writes_the_same_file(converted, tmp_path, capsys):
    out = tmp_path / "cli.gguf"
    assert main([str(DATA / "qwen3"), "-o", str(out), "--outtype", "q8_0", "-q"]) == 0
    assert out.read_bytes() == converted("qwen3", "q8_0").read_bytes()
    assert "wrote" in capsys.readouterr().err


def test_cli_default_name_and_auto_type(llama_copy, capsys):
    assert main([str(llama_copy), "-q"]) == 0
    out = llama_copy / "llama-F16.gguf"  # f32 checkpoint: auto is f16, as in llama.cpp
    with GGUFReader(out) as r:
        assert r.get("general.file_type") == 1


def test_bf16_checkpoint_auto_is_bf16(llama_copy, tmp_path):
    import ml_dtypes
    from safetensors.numpy import load_file, save_file

    path = llama_copy / "model.safetensors"
    tensors = {k: v.astype(ml_dtypes.bfloat16) for k, v in load_file(path).items()}
    save_file(tensors, path)
    out = convert_hf_to_gguf(llama_copy, tmp_path / "bf16.gguf")
    with GGUFReader(out) as r:
        assert r.get("general.file_type") == 32
        emb = r.tensor("token_embd.weight")
        assert emb.type == GGMLType.BF16
        bits = tensors["model.embed_tokens.weight"].view(np.uint16)
        assert np.array_equal(emb.array(), bits)  # bf16 -> f32 -> bf16 is exact
        norm = r.tensor("blk.0.attn_norm.weight").array()
        want = tensors["model.layers.0.input_layernorm.weight"].astype(np.float32)
        assert norm.dtype == np.float32 and np.array_equal(norm, want)


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    assert err.startswith("picollama-convert: error: "), err
    return err


def test_refuses_output_over_an_input(llama_copy, tmp_path, capsys):
    weights = llama_copy / "model.safetensors"
    before = weights.read_bytes()
    assert main([str(llama_copy), "-o", str(weights), "-q"]) == 1
    assert "input" in _one_line_error(capsys)
    link = tmp_path / "link.gguf"
    link.symlink_to(weights)
    assert main([str(llama_copy), "-o", str(link), "-q"]) == 1
    _one_line_error(capsys)
    hard = tmp_path / "hard.gguf"
    os.link(weights, hard)
    assert main([str(llama_copy), "-o", str(hard), "-q"]) == 1
    _one_line_error(capsys)
    assert weights.read_bytes() == before
    tok = llama_copy / "tokenizer.json"
    assert main([str(llama_copy), "-o", str(tok), "-q"]) == 1
    _one_line_error(capsys)


class _Payload:
    """Unpickling this makes a folder: the test fails if anything unpickles the checkpoint."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_refuses_pickled_checkpoints(llama_copy, tmp_path, capsys):
    marker = tmp_path / "unpickled"
    (llama_copy / "model.safetensors").unlink()
    (llama_copy / "pytorch_model.bin").write_bytes(pickle.dumps(_Payload(str(marker))))
    assert main([str(llama_copy), "-o", str(tmp_path / "x.gguf"), "-q"]) == 1
    err = _one_line_error(capsys)
    assert "pytorch_model.bin" in err and "pickle" in err
    assert not marker.exists() and not (tmp_path / "x.gguf").exists()


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.suffix in (".gguf", ".tmp"))


def test_truncated_shard_leaves_nothing(tmp_path, capsys):
    folder = tmp_path / "qwen2"
    shutil.copytree(DATA / "qwen2", folder)
    shard = folder / "model-00002-of-00003.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1000])
    out = folder / "out.gguf"
    assert main([str(folder), "-o", str(out), "-q"]) == 1
    assert "model-00002-of-00003.safetensors" in _one_line_error(capsys)
    assert _leftovers(folder) == []


@pytest.mark.parametrize("failure", [KeyboardInterrupt, OSError(28, "No space left on device")])
def test_failure_midway_leaves_nothing(llama_copy, tmp_path, monkeypatch, capsys, failure):
    """A failure while tensors are being written (after the header): the old file at the
    output path is untouched and no temporary file remains."""
    out = tmp_path / "out.gguf"
    out.write_bytes(b"previous")
    calls = []
    real_load = Checkpoint.load

    def flaky_load(self, name):
        calls.append(name)
        if len(calls) == 5:
            raise failure
        return real_load(self, name)

    monkeypatch.setattr(Checkpoint, "load", flaky_load)
    rc = main([str(llama_copy), "-o", str(out), "--outtype", "q8_0", "-q"])
    assert rc == (130 if failure is KeyboardInterrupt else 1)
    assert len(calls) == 5
    assert out.read_bytes() == b"previous"
    assert _leftovers(tmp_path) == ["out.gguf"]
    assert "Traceback" not in capsys.readouterr().err


def test_unsupported_architecture(llama_copy, capsys):
    config = json.loads((llama_copy / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (llama_copy / "config.json").write_text(json.dumps(config))
    assert main([str(llama_copy), "-q"]) == 1
    assert "GPT2LMHeadModel" in _one_line_error(capsys)
    with pytest.raises(ConvertError):
        convert_hf_to_gguf(llama_copy)
    assert _leftovers(llama_copy) == []
