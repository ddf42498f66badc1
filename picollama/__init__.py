"""picollama: portable GGUF quantized LLM inference in Python.

``import picollama`` needs only numpy and numba; GPU backends import their libraries only
when they are asked for.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
