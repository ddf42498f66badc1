"""Architectures: one module per family, picked by ``general.architecture``.

Also home of the built-in model registry (``picollama.models.registry``).
"""

from __future__ import annotations

import importlib

__all__ = ["ARCHITECTURES", "supported_architectures", "load_model"]

# general.architecture -> module; aliases point at the module whose graph they share
ARCHITECTURES: dict[str, str] = {
    "llama": "picollama.models.llama",
    "mistral": "picollama.models.llama",
    "qwen2": "picollama.models.qwen2",
    "qwen3": "picollama.models.qwen3",
    "phi3": "picollama.models.phi3",
    "gemma2": "picollama.models.gemma2",
    "gemma3": "picollama.models.gemma3",
}


def supported_architectures() -> list[str]:
    return sorted(ARCHITECTURES)


def load_model(reader, backend):
    """Build the model described by ``reader`` (a GGUFReader) on ``backend``."""
    from picollama.models.base import ModelLoadError

    arch = reader.get("general.architecture")
    if not isinstance(arch, str):
        raise ModelLoadError("the model file has no general.architecture string")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(
            f"unknown architecture '{arch}' (supported: {', '.join(supported_architectures())})"
        )
    module = importlib.import_module(ARCHITECTURES[arch])
    return module.Model(reader, backend, arch)
