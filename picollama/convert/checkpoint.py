"""A Hugging Face checkpoint folder: config.json and lazily read safetensors weights.

Tensors are indexed (name, dtype, shape) when the folder is opened and read one at a time
when asked for. Pickled checkpoints (``pytorch_model.bin``, ``*.pt``, ``*.pth``, ``*.ckpt``)
are refused without being opened: unpickling runs code from the file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from picollama.convert.errors import ConvertError

__all__ = ["Checkpoint", "TensorRef", "PICKLE_SUFFIXES"]

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")

# safetensors dtype -> numpy dtype we decode to (BF16 through ml_dtypes' bfloat16)
_FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")


@dataclass(frozen=True)
class TensorRef:
    """One tensor of the checkpoint: where it lives and what it is, not its data."""

    name: str
    file: Path
    dtype: str  # safetensors spelling: F32, F16, BF16, ...
    shape: tuple[int, ...]  # PyTorch order (rows first)


def _read_json(path: Path) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as exc:
        raise ConvertError(f"{path.name}: not valid JSON ({exc})") from None


class Checkpoint:
    """The weights and config of one HF model folder."""

    def __init__(self, folder: str | os.PathLike[str]):
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise ConvertError(f"{self.folder} is not a folder (expected a Hugging Face model)")
        config_path = self.folder / "config.json"
        if not config_path.is_file():
            raise ConvertError(f"{self.folder} has no config.json")
        self.config: dict[str, Any] = _read_json(config_path)
        if not isinstance(self.config, dict):
            raise ConvertError("config.json does not hold a JSON object")
        self.files = self._weight_files()
        self.tensors: dict[str, TensorRef] = {}
        self._index_tensors()

    # -- files ---------------------------------------------------------------------------

    def _weight_files(self) -> list[Path]:
        index = self.folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = _read_json(index).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ConvertError(f"{index.name} has no weight_map")
            names = sorted(set(weight_map.values()))
            self._expected = weight_map
        else:
            names = sorted(
                p.name
                for p in self.folder.iterdir()
                if p.name.startswith("model") and p.name.endswith(".safetensors")
            )
            self._expected = None
        if not names:
            pickled = sorted(
                p.name for p in self.folder.iterdir() if p.name.endswith(PICKLE_SUFFIXES)
            )
            if pickled:
                raise ConvertError(
                    f"{pickled[0]} is a pickled PyTorch checkpoint, which can run code when "
                    "loaded; picollama reads only safetensors (re-save the model with "
                    "save_pretrained(..., safe_serialization=True))"
                )
            raise ConvertError(f"{self.folder} has no model*.safetensors weights")
        files = []
        for name in names:
            path = self.folder / name
            if Path(name).name != name or not path.is_file():
                raise ConvertError(f"weight file {name!r} is missing from {self.folder}")
            files.append(path)
        return files

    def _index_tensors(self) -> None:
        safe_open = _safe_open()
        for path in self.files:
            try:
                with safe_open(path, framework="numpy") as f:
                    for name in f.keys():
                        piece = f.get_slice(name)
                        if name in self.tensors:
                            raise ConvertError(f"tensor {name} is in two weight files")
                        self.tensors[name] = TensorRef(
                            name, path, piece.get_dtype(), tuple(piece.get_shape())
                        )
            except ConvertError:
                raise
            except Exception as exc:  # safetensors raises its own error types
                raise ConvertError(
                    f"{path.name}: not a readable safetensors file ({exc})"
                ) from None
        if self._expected is not None:
            missing = sorted(set(self._expected) - set(self.tensors))
            if missing:
                raise ConvertError(
                    f"tensor {missing[0]} is listed in model.safetensors.index.json but is in "
                    f"no weight file ({len(missing)} missing)"
                )

    def inputs(self) -> list[Path]:
        """Every file the conversion reads (the output must be none of them)."""
        paths = [self.folder / "config.json", *self.files]
        for name in (
            "model.safetensors.index.json",
            "tokenizer.json",
            "tokenizer.model",
            "tokenizer_config.json",
            "added_tokens.json",
            "chat_template.jinja",
            "chat_template.json",
        ):
            if (self.folder / name).is_file():
                paths.append(self.folder / name)
        return paths

    # -- tensors -------------------------------------------------------------------------

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def __iter__(self) -> Iterator[TensorRef]:
        return iter(self.tensors.values())

    def first_matrix_dtype(self) -> str | None:
        """The dtype of the first tensor with two or more axes (``--outtype auto``)."""
        for ref in self.tensors.values():
            if len(ref.shape) >= 2:
                return ref.dtype
        return None

    def load(self, name: str) -> np.ndarray:
        """The tensor ``name``: float16 as stored, any other float type as float32."""
        ref = self.tensors[name]
        if ref.dtype not in _FLOAT_DTYPES:
            raise ConvertError(
                f"tensor {name} has dtype {ref.dtype}; only F32, F16, BF16 and F64 weights "
                "can be converted"
            )
        if ref.dtype == "BF16":
            import ml_dtypes  # noqa: F401  (lets numpy, and so safetensors, decode bfloat16)
        safe_open = _safe_open()
        try:
            with safe_open(ref.file, framework="numpy") as f:
                data = f.get_tensor(name)
        except Exception as exc:
            raise ConvertError(f"{ref.file.name}: cannot read tensor {name} ({exc})") from None
        if tuple(data.shape) != ref.shape:
            raise ConvertError(f"tensor {name}: read shape {data.shape}, indexed {ref.shape}")
        return data if data.dtype == np.float16 else data.astype(np.float32)


def _safe_open():
    try:
        from safetensors import safe_open
    except ImportError:
        raise ConvertError(
            "converting needs the safetensors package: pip install 'picollama[convert]'"
        ) from None
    return safe_open
