"""Every tensor of both real models dequantizes bit for bit as PyPI's gguf package does."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from picollama.gguf import GGUFReader  # noqa: E402
from picollama.quant import dequantize  # noqa: E402

pytestmark = pytest.mark.model


@pytest.mark.parametrize("fixture", ["smollm2_path", "gemma3_path"])
def test_every_tensor_matches_gguf_py(fixture, request):
    path = request.getfixturevalue(fixture)
    theirs = {t.name: t for t in gguf.GGUFReader(path).tensors}
    with GGUFReader(path) as reader:
        assert [t.name for t in reader.tensors] == list(theirs)
        for t in reader.tensors:
            ref = theirs[t.name]
            assert int(t.type) == int(ref.tensor_type)
            ours = dequantize(t.data, t.type, what=t.name).reshape(-1)
            expected = gguf.quants.dequantize(ref.data, ref.tensor_type).reshape(-1)
            assert ours.dtype == np.float32
            # bit for bit, NaNs included
            assert np.array_equal(
                ours.view(np.uint32), expected.astype(np.float32).view(np.uint32)
            ), t.name
