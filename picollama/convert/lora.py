"""A Hugging Face PEFT LoRA adapter -> a GGUF adapter, as llama.cpp's ``convert_lora_to_gguf``.

Input: a PEFT folder (``adapter_config.json``, ``adapter_model.safetensors``) and the base
model (its HF folder, for config.json, or its GGUF file). Output: ``general.type =
"adapter"``, ``adapter.type = "lora"``, ``adapter.lora.alpha`` and for each adapted weight
``<gguf name>.lora_a`` and ``.lora_b``:

- PEFT's ``lora_A.weight`` is (r, in) in PyTorch order, GGUF shape (in, r): r rows of the
  base weight's inputs; ``lora_B.weight`` is (out, r), GGUF (r, out).
- The base converter permutes the rows of llama's Q and K (``permute_qk``); ``B A`` must
  follow, so B's rows are permuted the same way (A's rows are the rank, untouched).
- PEFT scales each term by ``lora_alpha / r`` (``/ sqrt(r)`` with ``use_rslora``, which
  llama.cpp's converter ignores; here it becomes an alpha of ``lora_alpha * sqrt(r)``).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from picollama.convert.archs import ARCHS, ArchSpec, arch_for, permute_qk
from picollama.convert.errors import ConvertError
from picollama.gguf.constants import GGMLType, GGUFValueType
from picollama.gguf.writer import GGUFWriter
from picollama.quant import quantize

__all__ = ["LORA_OUTTYPES", "convert_lora_to_gguf"]

LORA_OUTTYPES = ("f32", "f16", "bf16", "q8_0")
_OUT_GGML = {
    "f32": GGMLType.F32,
    "f16": GGMLType.F16,
    "bf16": GGMLType.BF16,
    "q8_0": GGMLType.Q8_0,
}
_FLOAT_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": None, "F64": np.float64}


def _read_json(path: Path) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as exc:
        raise ConvertError(f"{path.name}: not valid JSON ({exc})") from None


class _Base:
    """What the conversion needs of the base model: its spec and head counts."""

    def __init__(self, base: Path):
        if base.is_dir():
            config_path = base / "config.json"
            if not config_path.is_file():
                raise ConvertError(f"base model folder {base} has no config.json")
            config = _read_json(config_path)
            if not isinstance(config, dict):
                raise ConvertError("config.json does not hold a JSON object")
            _, self.spec = arch_for(config)
            self.n_heads = int(config["num_attention_heads"])
            self.n_kv_heads = int(config.get("num_key_value_heads", self.n_heads))
        elif base.is_file():
            from picollama.gguf import GGUFError, GGUFReader

            try:
                with GGUFReader(base) as reader:
                    arch = reader.get("general.architecture")
                    n_heads = reader.get(f"{arch}.attention.head_count")
                    n_kv_heads = reader.get(f"{arch}.attention.head_count_kv", n_heads)
            except GGUFError as exc:
                raise ConvertError(f"base model {base}: {exc}") from None
            specs = {s.gguf_arch: s for s in ARCHS.values()}
            if arch not in specs:
                raise ConvertError(f"base model architecture {arch!r} is not supported")
            if not isinstance(n_heads, int) or not isinstance(n_kv_heads, int):
                raise ConvertError(f"base model {base} has no integer {arch}.attention.head_count")
            self.spec = specs[arch]
            self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        else:
            raise ConvertError(f"base model {base} is neither a folder nor a GGUF file")


def _alpha(config: dict[str, Any]) -> float:
    for key in ("lora_alpha", "r"):
        if not isinstance(config.get(key), (int, float)) or isinstance(config.get(key), bool):
            raise ConvertError(f"adapter_config.json has no numeric {key!r}")
    if config.get("peft_type", "LORA") != "LORA":
        raise ConvertError(f"PEFT type {config['peft_type']!r} is not a LoRA")
    if config.get("use_dora"):
        raise ConvertError("DoRA adapters (use_dora) are not supported")
    if config.get("alpha_pattern") or config.get("rank_pattern"):
        raise ConvertError("per-module alpha_pattern/rank_pattern are not supported")
    if config.get("lora_bias"):
        raise ConvertError("adapters with a lora_B bias (lora_bias) are not supported")
    if config.get("fan_in_fan_out"):
        raise ConvertError("fan_in_fan_out adapters (GPT-2 Conv1D) are not supported")
    if config.get("bias", "none") != "none":
        raise ConvertError(
            f"adapters that train biases (bias={config['bias']!r}) are not supported"
        )
    alpha = float(config["lora_alpha"])
    if config.get("use_rslora"):
        alpha *= math.sqrt(float(config["r"]))  # alpha' / r == alpha / sqrt(r)
    return alpha


def _load_tensors(path: Path) -> dict[str, np.ndarray]:
    try:
        from safetensors import safe_open
    except ImportError:
        raise ConvertError(
            "converting needs the safetensors package: pip install 'picollama[convert]'"
        ) from None
    out = {}
    try:
        with safe_open(path, framework="numpy") as f:
            for name in f.keys():
                dtype = f.get_slice(name).get_dtype()
                if dtype not in _FLOAT_DTYPES:
                    raise ConvertError(f"tensor {name} has dtype {dtype}; LoRA weights are floats")
                if dtype == "BF16":
                    import ml_dtypes  # noqa: F401  (lets numpy, and so safetensors, read bfloat16)
                out[name] = np.asarray(f.get_tensor(name), dtype=np.float32)
    except ConvertError:
        raise
    except Exception as exc:  # safetensors raises its own error types
        raise ConvertError(f"{path.name}: not a readable safetensors file ({exc})") from None
    return out


def _hf_name(name: str) -> tuple[str, str]:
    """``base_model.model.X.lora_A.weight`` -> (``X.weight``, "a")."""
    base = name.removeprefix("base_model.model.")
    for suffix, half in ((".lora_A.weight", "a"), (".lora_B.weight", "b")):
        if base.endswith(suffix):
            return base[: -len(suffix)] + ".weight", half
    if ".lora_embedding_" in name or name.endswith(("embed_tokens.weight", "lm_head.weight")):
        raise ConvertError(
            f"tensor {name}: the adapter trains the embeddings (new tokens?), which GGUF LoRA "
            "adapters cannot carry"
        )
    raise ConvertError(f"tensor {name} is not a lora_A/lora_B weight")


def _tensor_type(shape_gguf_ne0: int, outtype: str) -> GGMLType:
    ggml_type = _OUT_GGML[outtype]
    if ggml_type == GGMLType.Q8_0 and shape_gguf_ne0 % 32:
        return GGMLType.F16  # llama.cpp's fallback for rows that are not whole Q8_0 blocks
    return ggml_type


def convert_lora_to_gguf(
    peft_dir: str | os.PathLike[str],
    base: str | os.PathLike[str],
    out_path: str | os.PathLike[str] | None = None,
    outtype: str = "f32",
) -> Path:
    """Convert the PEFT LoRA folder ``peft_dir`` for the model ``base`` (HF folder or GGUF);
    returns the output path (default: ``PEFT_DIR/<folder>-<TYPE>-LoRA.gguf``)."""
    folder = Path(peft_dir)
    if outtype not in LORA_OUTTYPES:
        raise ConvertError(f"unknown output type {outtype!r} (choose from f32, f16, bf16, q8_0)")
    if not folder.is_dir():
        raise ConvertError(f"{folder} is not a folder (expected a PEFT adapter)")
    config_path = folder / "adapter_config.json"
    weights_path = folder / "adapter_model.safetensors"
    if not config_path.is_file():
        raise ConvertError(f"{folder} has no adapter_config.json")
    if not weights_path.is_file():
        if (folder / "adapter_model.bin").is_file():
            raise ConvertError(
                "adapter_model.bin is a pickled PyTorch file, which can run code when loaded; "
                "picollama reads only adapter_model.safetensors"
            )
        raise ConvertError(f"{folder} has no adapter_model.safetensors")
    config = _read_json(config_path)
    if not isinstance(config, dict):
        raise ConvertError("adapter_config.json does not hold a JSON object")
    alpha = _alpha(config)
    info = _Base(Path(base))
    spec: ArchSpec = info.spec

    if out_path is None:
        out = folder / f"{folder.resolve().name}-{outtype.upper()}-LoRA.gguf"
    else:
        out = Path(out_path)
        if out.is_dir():
            out = out / f"{folder.resolve().name}-{outtype.upper()}-LoRA.gguf"
    if not out.parent.is_dir():
        raise ConvertError(f"output folder {out.parent} does not exist")

    pairs: dict[str, dict[str, np.ndarray]] = {}
    for name, data in _load_tensors(weights_path).items():
        hf_name, half = _hf_name(name)
        gguf_name = spec.gguf_name(hf_name)
        if gguf_name is None:
            raise ConvertError(f"tensor {name}: its base weight {hf_name} is not in the GGUF model")
        if data.ndim != 2:
            raise ConvertError(f"tensor {name} has shape {list(data.shape)}; expected a matrix")
        if spec.permute_qk and half == "b":
            if hf_name.endswith("q_proj.weight"):
                data = permute_qk(data, info.n_heads)
            elif hf_name.endswith("k_proj.weight"):
                data = permute_qk(data, info.n_kv_heads)
        pairs.setdefault(gguf_name, {})[half] = data

    writer = GGUFWriter(out, arch=spec.gguf_arch)
    writer.add_string("general.type", "adapter")
    writer.add_string("general.name", folder.resolve().name)
    writer.add_string("adapter.type", "lora")
    writer.add_value("adapter.lora.alpha", alpha, GGUFValueType.FLOAT32)
    if not pairs:
        raise ConvertError(f"{weights_path.name} holds no LoRA tensors")
    for gguf_name, half in pairs.items():
        if set(half) != {"a", "b"}:
            missing = "lora_A" if "a" not in half else "lora_B"
            raise ConvertError(f"the {missing} half of {gguf_name} is missing")
        a, b = half["a"], half["b"]
        if a.shape[0] != b.shape[1]:
            raise ConvertError(
                f"{gguf_name}: lora_A {list(a.shape)} and lora_B {list(b.shape)} ranks differ"
            )
        for suffix, data in ((".lora_a", a), (".lora_b", b)):
            ggml_type = _tensor_type(data.shape[1], outtype)
            if ggml_type == GGMLType.F32:
                writer.add_tensor(gguf_name + suffix, np.ascontiguousarray(data, np.float32))
            else:
                q = quantize(np.ascontiguousarray(data, np.float32), ggml_type)
                writer.add_tensor(gguf_name + suffix, q, ggml_type, data.shape[::-1])
    writer.write()
    return out
