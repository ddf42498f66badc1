"""The OpenCL backend (PyOpenCL): quantized weights on any OpenCL device, OpenCL C kernels.

Importing this package needs nothing beyond numpy; PyOpenCL is imported when an
``OpenCLBackend`` is created (``get_backend("opencl")``), which raises ``BackendError``
naming what is missing (PyOpenCL, an OpenCL platform, a device) on machines that can't run
it. ``pip install 'picollama[opencl]'`` brings PyOpenCL and PoCL, which runs the kernels on
the CPU with no system packages.
"""
