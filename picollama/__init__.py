"""picollama: portable GGUF quantized LLM inference in Python.

``import picollama`` needs only numpy and numba and loads nothing heavy; ``picollama.Llama``
(the llama-cpp-python style API) is imported on first use, and GPU backends import their
libraries only when they are asked for.
"""

from picollama import jit_cache

__version__ = "0.1.0"

jit_cache.configure()  # before any module defines a cached kernel

__all__ = ["__version__", "Llama"]


def __getattr__(name: str):
    if name == "Llama":
        from picollama.api import Llama

        return Llama
    raise AttributeError(f"module 'picollama' has no attribute '{name}'")
