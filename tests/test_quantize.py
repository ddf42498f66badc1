"""picollama-quantize against llama.cpp's llama-quantize, frozen in tests/data/quantize/.

- Synthetic llama models (built by tests/gen_quantize_refs.py from a fixed seed with our GGUF
  writer; the input's sha256 is checked, so both tools saw the same bytes): for every TYPE and
  a few option sets, our output file has the sha256 of llama-quantize's and the same tensor
  type table.
- The type policy (picollama.quant.mixes) against llama-quantize --dry-run's choices for every
  tensor of SmolLM2-135M and Gemma 3 270M, for every TYPE.
- Refusals (same file in and out, bad arguments, hostile files, quantized input without
  --allow-requantize) give one line and exit code 1, and leave nothing at the output path.
- The Numba kernels write the numpy references' bytes on random rows of awkward sizes.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest
from gen_quantize_refs import MODELS, write_model

from picollama.backends.base import get_backend
from picollama.gguf import GGMLType, GGUFReader, GGUFWriter
from picollama.models import load_model
from picollama.quant import fast
from picollama.quant.mixes import (
    SUPPORTED_FTYPES,
    ModelParams,
    QuantizeParams,
    parse_ftype,
    parse_ggml_type,
    plan_types,
    use_more_bits,
)
from picollama.tools import quantize as tool

DATA = Path(__file__).parent / "data" / "quantize"
SYNTHETIC = json.loads((DATA / "synthetic.json").read_text())
REAL = json.loads((DATA / "real_mixes.json").read_text())


def sha256(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """The synthetic inputs, each checked to be the exact file llama-quantize was given."""
    d = tmp_path_factory.mktemp("quantize")
    for name in MODELS:
        path = d / f"{name}-f32.gguf"
        write_model(name, path)
        assert sha256(path) == SYNTHETIC["models"][name]["sha256"], name
    return d


def _run(*argv) -> int:
    return tool.main([*map(str, argv), "--no-progress"])


def _produce(work: Path, key: str) -> Path:
    """Our output for case ``key`` (its input first, when that is another case's output)."""
    case = SYNTHETIC["cases"][key]
    model, name = key.split("/")
    dst = work / f"{model}-{name}.gguf"
    if dst.exists():
        return dst
    src = work / f"{model}-f32.gguf"
    if case["input"] != "f32":
        src = _produce(work, f"{model}/{case['input']}")
    rc = _run(*case["options"], src, dst, case["type"], 2)
    if case["out"] is None:
        assert rc == 1
        assert not dst.exists()
    else:
        assert rc == 0
    return dst


@pytest.mark.parametrize("key", [k for k, c in SYNTHETIC["cases"].items() if c["out"]])
def test_output_is_llama_quantize_bytes(work, key):
    expected = SYNTHETIC["cases"][key]["out"]
    path = _produce(work, key)
    with GGUFReader(path) as r:
        assert [[t.name, t.type.name] for t in r.tensors] == expected["types"]
        assert r.metadata["general.file_type"] == int(parse_ftype(SYNTHETIC["cases"][key]["type"]))
        assert r.metadata["general.quantization_version"] == 2
        assert list(r.metadata)[-2:] == ["general.quantization_version", "general.file_type"]
    assert sha256(path) == expected["sha256"]


def test_quantized_input_refused_without_allow_requantize(work, capsys):
    src = _produce(work, "untied/Q8_0")
    dst = work / "refused.gguf"
    assert _run(src, dst, "Q4_0") == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("picollama-quantize: error: tensor 'output.weight': requantizing")
    assert "from type Q8_0 is disabled" in err
    assert not dst.exists()
    assert not [p for p in os.listdir(work) if p.endswith(".tmp")]


# ------------------------------------------------------------------ policy on real models


@pytest.mark.parametrize("arch", sorted(REAL))
@pytest.mark.parametrize("label", [f.label for f in SUPPORTED_FTYPES])
def test_mix_matches_llama_quantize_on_real_shapes(arch, label):
    real = REAL[arch]
    model = ModelParams.from_metadata(real["metadata"])
    tensors = [(n, tuple(s), GGMLType[t]) for n, s, t in real["tensors"]]
    plan = plan_types(tensors, model, QuantizeParams(parse_ftype(label)))
    got = [c.new_type.name for c in plan]
    assert got == real["mixes"][label]


def test_mix_details():
    # the _M mixes' extra-bits layers for 30 layers: first/last eighth and every third
    assert [i for i in range(30) if use_more_bits(i, 30)] == [
        0,
        1,
        2,
        5,
        8,
        11,
        14,
        17,
        20,
        23,
        26,
        27,
        28,
        29,
    ]
    assert parse_ftype("q4_k") == parse_ftype("Q4_K_M") == parse_ftype("15")
    assert parse_ggml_type("q8_0") == GGMLType.Q8_0
    model = ModelParams.from_metadata(
        {
            "general.architecture": "llama",
            "llama.block_count": 80,
            "llama.attention.head_count": 64,
            "llama.attention.head_count_kv": 8,
        }
    )
    assert model.is_70b and model.n_gqa == 8
    # 70B: attn_v's Q4_K of Q4_K_S after the first 4 layers becomes Q5_K
    tensors = [(f"blk.{i}.attn_v.weight", (8192, 1024), GGMLType.F32) for i in range(6)]
    params = QuantizeParams(parse_ftype("Q4_K_S"))
    assert [c.new_type for c in plan_types(tensors, model, params)] == [GGMLType.Q5_K] * 6
    assert [
        c.new_type
        for c in plan_types(
            tensors, ModelParams("llama", n_layer=6, n_head=64, n_head_kv=8), params
        )
    ] == [GGMLType.Q5_K] * 4 + [GGMLType.Q4_K] * 2
    # a tensor of rows that no block divides falls back, with llama-quantize's warning
    plan = plan_types([("blk.0.ffn_down.weight", (40, 8), GGMLType.F32)], model, params)
    assert plan[0].new_type == GGMLType.F16 and "must use F16" in plan[0].fallback
    # 1-D tensors, norms and tensors not ending in "weight" are never quantized
    for name, shape in [
        ("x.weight", (256,)),
        ("blk.0.attn_norm.weight", (256, 4)),
        ("blk.0.attn_q.bias", (256, 4)),
        ("blk.0.ffn_gate_inp.weight", (256, 8)),
    ]:
        assert plan_types([(name, shape, GGMLType.F32)], model, params)[0].new_type == GGMLType.F32


# ------------------------------------------------------------------ refusals and safety


def test_refuses_output_that_is_the_input(work, capsys):
    src = work / "tied-f32.gguf"
    before = sha256(src)
    link = work / "link.gguf"
    hard = work / "hard.gguf"
    link.symlink_to(src)
    os.link(src, hard)
    for out in (src, link, hard):
        assert _run(src, out, "Q8_0") == 1
        assert "is the input file" in capsys.readouterr().err
    assert sha256(src) == before
    link.unlink()
    hard.unlink()


@pytest.mark.parametrize(
    "args, message",
    [
        (["Q9_9"], "unknown quantization type"),
        (["Q4_0", "0"], "NTHREADS must be a positive integer"),
        (["Q4_0", "two"], "NTHREADS must be a positive integer"),
        (["Q4_0", "--output-tensor-type", "q9"], "unknown tensor type"),
    ],
)
def test_bad_arguments(work, capsys, args, message):
    out = work / "bad-args.gguf"
    assert _run(work / "tied-f32.gguf", out, *args) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1] and err[-1].startswith("picollama-quantize: error:")
    assert not out.exists()


def test_hostile_inputs(work, tmp_path, capsys):
    good = (work / "tied-f32.gguf").read_bytes()
    cases = {
        "truncated.gguf": good[: len(good) // 2],
        "header-only.gguf": good[:100],
        "not-gguf.gguf": b"PK\x03\x04" + good[4:200],
        "empty.gguf": b"",
    }
    for name, data in cases.items():
        src = tmp_path / name
        src.write_bytes(data)
        out = tmp_path / f"out-{name}"
        assert _run(src, out, "Q4_0") == 1, name
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 1 and "error:" in err and "Traceback" not in err, err
        assert not out.exists()
    assert _run(tmp_path / "missing.gguf", tmp_path / "o.gguf", "Q4_0") == 1
    assert sorted(os.listdir(tmp_path)) == sorted(cases)


def _tiny_gguf(path, metadata: dict, tensors: dict) -> None:
    w = GGUFWriter(path)
    for key, value in metadata.items():
        if isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_uint32(key, value)
    for name, data in tensors.items():
        w.add_tensor(name, data)
    w.write()


@pytest.mark.parametrize(
    "metadata, tensors, message",
    [
        ({"llama.block_count": 1}, {}, "no general.architecture"),
        ({"general.architecture": "llama"}, {}, "no llama.block_count"),
        (
            {"general.architecture": "llama", "llama.block_count": "one"},
            {},
            "llama.block_count is not an integer",
        ),
        (
            {"general.architecture": "llama", "llama.block_count": 1},
            {"blk.0.ffn_up.weight": np.ones((4, 64), np.int32)},
            "cannot convert tensor type I32",
        ),
    ],
)
def test_refuses_models_it_cannot_plan(tmp_path, capsys, metadata, tensors, message):
    src = tmp_path / "in.gguf"
    tensors = {"blk.0.attn_q.weight": np.ones((4, 256), np.float32), **tensors}
    _tiny_gguf(src, metadata, tensors)
    assert _run(src, tmp_path / "out.gguf", "Q4_0") == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("picollama-quantize: error:") and message in err, err
    assert os.listdir(tmp_path) == ["in.gguf"]


@pytest.mark.parametrize("exc", [KeyboardInterrupt, OSError(28, "No space left on device")])
def test_no_partial_output_after_a_failure(work, tmp_path, monkeypatch, capsys, exc):
    calls = []

    def failing(x, qtype, **kw):
        calls.append(qtype)
        if len(calls) == 3:
            raise exc
        return fast.quantize_rows_reference(x, qtype)

    monkeypatch.setattr(tool, "quantize_rows", failing)
    out = tmp_path / "out.gguf"
    out.write_bytes(b"old")  # an existing file stays as it was
    rc = _run(work / "untied-f32.gguf", out, "Q4_0")
    assert rc == (130 if exc is KeyboardInterrupt else 1)
    assert out.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["out.gguf"]
    assert "error:" in capsys.readouterr().err


# ------------------------------------------------------------------ kernels and the runtime


@pytest.mark.parametrize("qtype", sorted(fast.FAST_TYPES))
def test_kernels_match_numpy_references(qtype):
    rng = np.random.default_rng(int(qtype))
    block = 256 if qtype.name.endswith("_K") or qtype == GGMLType.IQ4_XS else 32
    for n_rows, n_blocks in [(1, 1), (7, 3), (33, 2), (700, 1)]:  # 700: several tasks
        x = rng.standard_normal((n_rows, n_blocks * block)).astype(np.float32)
        x[0, : block // 2] *= 1e-3  # a small sub-block
        x[-1, -block:] = 0  # an all-zero block
        if n_rows > 3:
            x[1] = np.round(x[1] * 4) / 4  # ties between levels
            x[2] *= 1e4
        want = fast.quantize_rows_reference(x, qtype)
        for n_threads in (1, 2):
            assert np.array_equal(fast.quantize_rows(x, qtype, n_threads=n_threads), want)


TOKENS = [256, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33, 10]


def _logits(path, tokens):
    backend = get_backend("cpu", n_threads=2, arithmetic="exact")
    with GGUFReader(path) as reader:
        model = load_model(reader, backend)
        cache = model.new_cache(32)
        return model.forward(np.array(tokens), 0, cache, np.arange(len(tokens)))


def test_quantized_model_runs_in_picollama(work):
    """Our outputs, byte for byte llama-quantize's, load and run; their logits are the F32
    model's, further off as the bits go down."""
    ref = _logits(work / "untied-f32.gguf", TOKENS)
    errors = {}
    for key in ("untied/Q8_0", "untied/Q6_K", "untied/Q4_K_M", "untied/Q2_K"):
        path = _produce(work, key)
        assert sha256(path) == SYNTHETIC["cases"][key]["out"]["sha256"]  # llama.cpp's file
        got = _logits(path, TOKENS)
        errors[key] = np.abs(got - ref).max() / np.abs(ref).max()
    # random weights amplify quantization error; fewer bits, more error
    assert errors["untied/Q8_0"] < errors["untied/Q6_K"] < errors["untied/Q4_K_M"]
    assert errors["untied/Q4_K_M"] < errors["untied/Q2_K"] < 1.0, errors
