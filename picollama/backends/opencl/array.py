"""``CLArray``: the OpenCL backend's array, a C-contiguous view into a device buffer.

The model files only reshape activations and slice them by rows (``k[a:b]`` per sequence of
a batch); both are views here, an offset in elements into the same buffer, and the kernels
take that offset with each array. Nothing else of numpy's interface is offered: data goes
to the host through ``OpenCLBackend.to_host``.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["CLArray"]


class CLArray:
    """``shape`` elements of ``dtype`` at element ``offset`` of the buffer ``buf``."""

    __slots__ = ("buf", "shape", "dtype", "offset")

    def __init__(self, buf, shape, dtype=np.float32, offset: int = 0):
        self.buf = buf  # pyopencl Buffer or PooledBuffer; kept alive by every view
        self.shape = tuple(int(s) for s in shape)
        self.dtype = np.dtype(dtype)
        self.offset = int(offset)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def __len__(self) -> int:
        return self.shape[0]

    def reshape(self, *shape) -> CLArray:
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        shape = [int(s) for s in shape]
        if shape.count(-1) > 1:
            raise ValueError(f"reshape {self.shape} to {tuple(shape)}: more than one -1")
        if -1 in shape:
            known = math.prod(s for s in shape if s != -1)
            if known == 0 or self.size % known:
                raise ValueError(f"cannot reshape {self.shape} to {tuple(shape)}")
            shape[shape.index(-1)] = self.size // known
        if math.prod(shape) != self.size:
            raise ValueError(f"cannot reshape {self.shape} to {tuple(shape)}")
        return CLArray(self.buf, shape, self.dtype, self.offset)

    def __getitem__(self, key) -> CLArray:
        """Rows ``a:b`` (a view); other indexing is not supported."""
        if not isinstance(key, slice) or key.step not in (None, 1) or not self.shape:
            raise TypeError(f"CLArray supports only row slices a:b, not {key!r}")
        start, stop, _ = key.indices(self.shape[0])
        stop = max(start, stop)
        row = math.prod(self.shape[1:])
        return CLArray(
            self.buf, (stop - start,) + self.shape[1:], self.dtype, self.offset + start * row
        )

    def __repr__(self) -> str:
        return f"CLArray(shape={self.shape}, dtype={self.dtype}, offset={self.offset})"
