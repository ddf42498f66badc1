"""Freeze llama-quantize's output as test data for picollama-quantize.

Usage::

    python tests/gen_quantize_refs.py PATH/TO/llama-quantize [--real F32.gguf ...]

Writes ``tests/data/quantize/synthetic.json``: for each synthetic model (built here, from a
fixed seed, with picollama's own GGUF writer) the sha256 of the input file, and for each
case (a TYPE and options) the sha256 of the file llama-quantize wrote and its tensor type
table, or ``null`` where llama-quantize refused. With ``--real``, it also writes
``tests/data/quantize/real_mixes.json``: the tensors (names, shapes) and hyper-parameters of
each F32 model given, and the type llama-quantize's ``--dry-run`` chose for each tensor and
each TYPE. (F32 files of the real models come from ``llama-quantize --allow-requantize
MODEL.gguf OUT.gguf F32``.) The tests read only these files.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from picollama.gguf import GGUFReader, GGUFWriter
from picollama.quant.mixes import SUPPORTED_FTYPES, llama_tensor_order

DATA = Path(__file__).parent / "data" / "quantize"

TYPES = [f.label for f in SUPPORTED_FTYPES]


# The synthetic models: llama-shaped, loadable by llama.cpp and picollama.
# - untied: 8 layers (so use_more_bits and the attn_v counters pick several layers), rows
#   of 256 but ffn_down rows of 288 (k-quants fall back), 4 query heads per KV head.
# - tied: token_embd doubles as the output, rows of 96 and 160.
# - odd: ffn_down rows of 40, which no block of 32 divides: every quantized type falls back
#   to F16 there.
@dataclass(frozen=True)
class Spec:
    n_layers: int
    n_embd: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_ff: int
    tied: bool
    seed: int


MODELS: dict[str, Spec] = {
    "untied": Spec(8, 256, 4, 1, 64, 288, tied=False, seed=11),
    "tied": Spec(2, 96, 2, 2, 48, 160, tied=True, seed=12),
    "odd": Spec(1, 64, 2, 1, 32, 40, tied=True, seed=13),
}


def _byte_vocab() -> list[str]:
    """GPT-2's printable stand-ins for the 256 byte values, then BOS and EOS."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 256))
    chars, n = [], 0
    for b in range(256):
        if b in keep:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + n))
            n += 1
    return chars + ["<s>", "</s>"]


def write_model(name: str, path) -> None:
    """A llama model with random F32 weights and a byte-level BPE vocabulary, written by our
    GGUF writer: the same bytes on every run (the tests check its sha256)."""
    s = MODELS[name]
    rng = np.random.default_rng(s.seed)
    w = GGUFWriter(path, arch="llama")
    for key, value in [
        ("block_count", s.n_layers),
        ("context_length", 256),
        ("embedding_length", s.n_embd),
        ("feed_forward_length", s.n_ff),
        ("attention.head_count", s.n_heads),
        ("attention.head_count_kv", s.n_kv_heads),
        ("attention.key_length", s.head_dim),
        ("attention.value_length", s.head_dim),
        ("rope.dimension_count", s.head_dim),
    ]:
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "default")
    w.add_array("tokenizer.ggml.tokens", _byte_vocab())
    w.add_array("tokenizer.ggml.token_type", np.array([1] * 256 + [3, 3], dtype=np.int32))
    w.add_array("tokenizer.ggml.merges", ["\u0120 \u0120"])
    w.add_uint32("tokenizer.ggml.bos_token_id", 256)
    w.add_uint32("tokenizer.ggml.eos_token_id", 257)
    w.add_bool("tokenizer.ggml.add_bos_token", True)

    d, q, kv = s.n_embd, s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim
    shapes = {"token_embd.weight": (d, 258), "output_norm.weight": (d,)}
    if not s.tied:
        shapes["output.weight"] = (d, 258)
    for i in range(s.n_layers):
        p = f"blk.{i}."
        shapes[p + "attn_norm.weight"] = (d,)
        shapes[p + "attn_q.weight"] = (d, q)
        shapes[p + "attn_k.weight"] = (d, kv)
        shapes[p + "attn_v.weight"] = (d, kv)
        shapes[p + "attn_output.weight"] = (q, d)
        shapes[p + "ffn_norm.weight"] = (d,)
        shapes[p + "ffn_gate.weight"] = (d, s.n_ff)
        shapes[p + "ffn_up.weight"] = (d, s.n_ff)
        shapes[p + "ffn_down.weight"] = (s.n_ff, d)
    for tensor, shape in shapes.items():
        numpy_shape = shape[::-1]
        if len(shape) == 1:  # norms near 1
            data = 1.0 + 0.1 * rng.standard_normal(numpy_shape)
        else:
            data = rng.standard_normal(numpy_shape) / np.sqrt(shape[0])
        w.add_tensor(tensor, data.astype(np.float32))
    w.write()


# (model, case name, llama-quantize arguments before IN OUT TYPE, TYPE, input)
# input: "f32" is the synthetic file; another case's name is that case's output.
CASES: list[tuple[str, str, list[str], str, str]] = [
    *[("untied", t, [], t, "f32") for t in TYPES],
    *[("tied", t, [], t, "f32") for t in TYPES],
    ("odd", "Q4_K_M", [], "Q4_K_M", "f32"),
    ("odd", "Q5_K_S", [], "Q5_K_S", "f32"),
    *[("odd", t, [], t, "f32") for t in ("Q8_0", "Q4_0", "Q2_K", "IQ4_NL", "IQ4_XS", "F16")],
    ("untied", "pure-Q4_K_M", ["--pure"], "Q4_K_M", "f32"),
    ("untied", "leave-output-Q4_K_M", ["--leave-output-tensor"], "Q4_K_M", "f32"),
    (
        "untied",
        "types-Q4_K_M",
        ["--output-tensor-type", "q8_0", "--token-embedding-type", "q4_0"],
        "Q4_K_M",
        "f32",
    ),
    ("tied", "output-type-Q4_K_S", ["--output-tensor-type", "q5_0"], "Q4_K_S", "f32"),
    ("tied", "embd-type-Q3_K_M", ["--token-embedding-type", "q5_1"], "Q3_K_M", "f32"),
    # requantizing: from F16 (allowed as is) and from Q8_0 (needs --allow-requantize)
    ("untied", "F16-to-Q4_K_M", [], "Q4_K_M", "F16"),
    ("untied", "BF16-to-Q6_K", [], "Q6_K", "BF16"),
    ("untied", "Q8_0-to-Q4_0", ["--allow-requantize"], "Q4_0", "Q8_0"),
    ("untied", "Q8_0-to-Q4_0-refused", [], "Q4_0", "Q8_0"),
    ("untied", "Q4_K_M-to-Q5_K_M", ["--allow-requantize"], "Q5_K_M", "Q4_K_M"),
]


def sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def type_table(path) -> list[list[str]]:
    with GGUFReader(path) as r:
        return [[t.name, t.type.name] for t in r.tensors]


def run_cases(quantize: str, work: Path) -> dict:
    out: dict = {"models": {}, "cases": {}}
    for name in MODELS:
        path = work / f"{name}-f32.gguf"
        write_model(name, path)
        out["models"][name] = {"sha256": sha256(path)}
    for model, case, options, qtype, source in CASES:
        src = work / (f"{model}-f32.gguf" if source == "f32" else f"{model}-{source}.gguf")
        dst = work / f"{model}-{case}.gguf"
        proc = subprocess.run(
            [quantize, *options, str(src), str(dst), qtype, "2"], capture_output=True, text=True
        )
        if proc.returncode == 0:
            result = {"sha256": sha256(dst), "types": type_table(dst)}
        else:
            result = None
            if dst.exists():
                dst.unlink()
        key = f"{model}/{case}"
        out["cases"][key] = {"options": options, "type": qtype, "input": source, "out": result}
        print(key, "refused" if result is None else result["sha256"][:16])
    return out


_DRY_LINE = re.compile(r"^\[\s*\d+/\s*\d+\]\s+(\S+)\s+- \[.*\], type =\s+(\w+), size = .*$")


def dry_run(quantize: str, path: Path, qtype: str) -> dict[str, str]:
    proc = subprocess.run(
        [quantize, "--dry-run", str(path), qtype, "2"], capture_output=True, text=True
    )
    proc.check_returncode()
    types = {}
    for line in (proc.stdout + proc.stderr).splitlines():
        m = _DRY_LINE.match(line)
        if m:
            new = re.search(r"\((\w+)\)$", line)
            types[m.group(1)] = (new.group(1) if new else m.group(2)).upper()
    return types


def run_real(quantize: str, paths: list[str]) -> dict:
    out = {}
    for path in paths:
        with GGUFReader(path) as r:
            arch = r.metadata["general.architecture"]
            keys = ["general.architecture"] + [
                f"{arch}.{k}"
                for k in (
                    "block_count",
                    "attention.head_count",
                    "attention.head_count_kv",
                    "expert_count",
                )
            ]
            meta = {
                k: int(r.metadata[k]) if k != keys[0] else arch for k in keys if k in r.metadata
            }
            by_name = {t.name: t for t in r.tensors}
            names = llama_tensor_order(by_name)
            tensors = [[n, list(by_name[n].shape), by_name[n].type.name] for n in names]
        mixes = {}
        for qtype in TYPES:
            types = dry_run(quantize, Path(path), qtype)
            mixes[qtype] = [types[n] for n in names]
        out[arch] = {"metadata": meta, "tensors": tensors, "mixes": mixes}
        print(arch, len(tensors), "tensors")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("llama_quantize")
    parser.add_argument("--real", nargs="*", default=[], help="F32 GGUF files of real models")
    args = parser.parse_args()
    DATA.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        result = run_cases(os.path.abspath(args.llama_quantize), Path(tmp))
    (DATA / "synthetic.json").write_text(json.dumps(result, indent=1) + "\n")
    if args.real:
        real = run_real(os.path.abspath(args.llama_quantize), args.real)
        (DATA / "real_mixes.json").write_text(json.dumps(real, separators=(",", ":")) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
