"""Hugging Face checkpoint -> GGUF, the way llama.cpp's ``convert_hf_to_gguf.py`` does it.

The output is declared in full first (metadata, then each tensor's name, type and shape),
then written by ``GGUFWriter`` to a temporary file beside the destination, each tensor read,
transformed and encoded only when its turn comes, and renamed into place at the end. An
error or an interrupt anywhere leaves no file at the output path.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from picollama.convert.archs import (
    ArchSpec,
    Metadata,
    arch_for,
    llama3_rope_factors,
    permute_qk,
    phi3_rope_factors,
)
from picollama.convert.checkpoint import Checkpoint, TensorRef
from picollama.convert.errors import ConvertError
from picollama.convert.vocab import vocab_metadata
from picollama.gguf.constants import GGMLType, GGUFValueType
from picollama.gguf.writer import GGUFWriter
from picollama.quant import quantize

__all__ = ["OUTTYPES", "FILE_TYPES", "convert_hf_to_gguf", "default_output_path"]

OUTTYPES = ("f32", "f16", "bf16", "q8_0", "auto")
_OUT_GGML = {
    "f32": GGMLType.F32,
    "f16": GGMLType.F16,
    "bf16": GGMLType.BF16,
    "q8_0": GGMLType.Q8_0,
}
# general.file_type (llama.h ``llama_ftype``)
FILE_TYPES = {"f32": 0, "f16": 1, "q8_0": 7, "bf16": 32}
QUANTIZATION_VERSION = 2  # GGML_QNT_VERSION


def resolve_outtype(outtype: str, checkpoint: Checkpoint) -> str:
    """``auto``: llama.cpp's guess from the first matrix (bf16 -> bf16, else f16)."""
    if outtype not in OUTTYPES:
        raise ConvertError(f"unknown output type {outtype!r} (choose from {', '.join(OUTTYPES)})")
    if outtype != "auto":
        return outtype
    return "bf16" if checkpoint.first_matrix_dtype() == "BF16" else "f16"


def default_output_path(folder: Path, outtype: str) -> Path:
    return folder / f"{folder.resolve().name}-{outtype.upper()}.gguf"


def _check_output(out: Path, inputs: list[Path]) -> None:
    """Refuse an output that is one of the inputs, through any link."""
    real_out = os.path.realpath(out)
    for path in inputs:
        same = os.path.realpath(path) == real_out
        if not same and out.exists():
            try:
                same = os.path.samefile(out, path)
            except OSError:
                same = False
        if same:
            raise ConvertError(f"output {out} is the input file {path.name}; choose another path")
    if out.is_dir():
        raise ConvertError(f"output {out} is a folder")
    if not out.parent.is_dir():
        raise ConvertError(f"output folder {out.parent} does not exist")


def _tensor_type(gguf_name: str, shape: tuple[int, ...], outtype: str) -> GGMLType:
    """llama.cpp's choice: 1-D tensors and norms F32; Q8_0 rows not a multiple of 32: F16."""
    if len(shape) <= 1 or gguf_name.endswith("_norm.weight"):
        return GGMLType.F32
    ggml_type = _OUT_GGML[outtype]
    if ggml_type == GGMLType.Q8_0 and shape[-1] % 32:
        return GGMLType.F16
    return ggml_type


def _encode(data: np.ndarray, ggml_type: GGMLType) -> np.ndarray:
    if ggml_type == GGMLType.F32:
        return np.ascontiguousarray(data, dtype=np.float32)
    return quantize(data.astype(np.float32, copy=False), ggml_type)


class _Plan:
    """What one GGUF tensor is and how to make it from the checkpoint."""

    def __init__(self, name: str, ggml_type: GGMLType, shape: tuple[int, ...], make: Callable):
        self.name = name
        self.ggml_type = ggml_type
        self.shape = shape  # PyTorch order (rows first)
        self.make = make


def _plans(checkpoint: Checkpoint, spec: ArchSpec, outtype: str, n_tokens: int) -> list[_Plan]:
    config = checkpoint.config
    n_heads = config["num_attention_heads"]
    n_kv_heads = config.get("num_key_value_heads", n_heads)
    plans: list[_Plan] = []
    factors = llama3_rope_factors(config) if spec.gguf_arch == "llama" else None
    if factors is not None:
        plans.append(_Plan("rope_freqs.weight", GGMLType.F32, factors.shape, lambda: factors))
    if spec.gguf_arch == "phi3":
        for name, data in phi3_rope_factors(config):
            plans.append(_Plan(name, GGMLType.F32, data.shape, lambda data=data: data))
    for ref in checkpoint:
        name = spec.gguf_name(ref.name)
        if name is None:
            continue
        shape = ref.shape
        if name == "token_embd.weight" and spec.gguf_arch == "gemma3":
            shape = (min(shape[0], n_tokens), *shape[1:])  # llama.cpp drops rows past the vocab
        ggml_type = _tensor_type(name, shape, outtype)
        plans.append(
            _Plan(name, ggml_type, shape, _maker(checkpoint, spec, ref, shape, n_heads, n_kv_heads))
        )
    return plans


def _maker(
    checkpoint: Checkpoint,
    spec: ArchSpec,
    ref: TensorRef,
    shape: tuple[int, ...],
    n_heads: int,
    n_kv_heads: int,
) -> Callable[[], np.ndarray]:
    def make() -> np.ndarray:
        data = checkpoint.load(ref.name)
        if shape != ref.shape:
            data = data[: shape[0]]
        if spec.permute_qk:
            if ref.name.endswith(("q_proj.weight", "q_proj.bias")):
                data = permute_qk(data, n_heads)
            elif ref.name.endswith(("k_proj.weight", "k_proj.bias")):
                data = permute_qk(data, n_kv_heads)
        if spec.norm_shift and ref.name.endswith("norm.weight"):
            # in the checkpoint's own precision when it is F16, as llama.cpp adds in torch
            data = data + data.dtype.type(spec.norm_shift)
        return data

    return make


def convert_hf_to_gguf(
    hf_dir: str | os.PathLike[str],
    out_path: str | os.PathLike[str] | None = None,
    outtype: str = "auto",
    progress: bool = False,
) -> Path:
    """Convert the HF checkpoint folder ``hf_dir`` to a GGUF file; returns the output path.

    ``outtype``: f32, f16, bf16, q8_0, or auto (bf16 for a bf16 checkpoint, else f16).
    ``out_path`` (optional, default: ``HF_DIR/<folder>-<TYPE>.gguf``; a folder: that name
    inside it). ``progress`` shows a tqdm bar over the tensors on stderr.
    """
    folder = Path(hf_dir)
    checkpoint = Checkpoint(folder)
    hf_arch, spec = arch_for(checkpoint.config)
    outtype = resolve_outtype(outtype, checkpoint)
    if out_path is None:
        out = default_output_path(folder, outtype)
    else:
        out = Path(out_path)
        if out.is_dir():
            out = out / default_output_path(folder, outtype).name
    _check_output(out, checkpoint.inputs())

    config = checkpoint.config
    arch = spec.gguf_arch
    tokenizer_md, n_tokens = vocab_metadata(folder, config, arch)
    plans = _plans(checkpoint, spec, outtype, n_tokens)

    metadata: Metadata = [
        ("general.type", "model", GGUFValueType.STRING),
        ("general.name", folder.resolve().name, GGUFValueType.STRING),
    ]
    metadata += spec.metadata(config, arch)
    metadata.append(("general.file_type", FILE_TYPES[outtype], GGUFValueType.UINT32))
    metadata.append(("general.quantization_version", QUANTIZATION_VERSION, GGUFValueType.UINT32))
    metadata += tokenizer_md

    writer = GGUFWriter(out, arch=arch)
    merged: dict[str, tuple] = {}
    for key, value, vtype in metadata:  # a later value for a key replaces the earlier one
        merged.pop(key, None)
        merged[key] = (value, vtype)
    try:
        for key, (value, vtype) in merged.items():
            if vtype == GGUFValueType.ARRAY:
                is_text = len(value) and isinstance(value[0], (str, bytes))
                elem = GGUFValueType.STRING if is_text else None
                writer.add_array(key, value, elem)
            else:
                writer.add_value(key, value, vtype)
    except (TypeError, ValueError) as exc:
        raise ConvertError(f"config value cannot be written: {exc}") from None

    bar = _progress_bar(len(plans), progress)
    for plan in plans:
        writer.add_tensor_lazy(plan.name, plan.ggml_type, plan.shape[::-1], _encoded(plan, bar))
    try:
        writer.write()
    finally:
        if bar is not None:
            bar.close()
    return out


def _encoded(plan: _Plan, bar) -> Callable[[], np.ndarray]:
    def load() -> np.ndarray:
        data = _encode(plan.make(), plan.ggml_type)
        if bar is not None:
            bar.set_postfix_str(f"{plan.name} {plan.ggml_type.name}", refresh=False)
            bar.update(1)
        return data

    return load


def _progress_bar(total: int, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="tensor", desc="converting", leave=True)
