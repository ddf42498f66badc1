"""The CUDA backend (CuPy): quantized weights on the GPU, NVRTC kernels, decode CUDA graphs.

Importing this package needs nothing beyond numpy; CuPy is imported when a ``CUDABackend``
is created (``get_backend("cuda")``), which raises ``BackendError`` naming what is missing
(CuPy, a GPU) on machines that can't run it.
"""
