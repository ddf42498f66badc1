"""GGUF writer: misuse raises, atomic writes, value inference, byte order and layout."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest
from gguf_factory import every_value_writer, small_valid_writer

from picollama.gguf import GGMLType, GGUFReader, GGUFValueType, GGUFWriter
from picollama.gguf.reader import MAX_ARRAY_DEPTH

VT = GGUFValueType


def _read(tmp_path, w: GGUFWriter) -> GGUFReader:
    path = tmp_path / "w.gguf"
    w.write(path)
    return GGUFReader(path)


def test_to_bytes_matches_the_written_file(tmp_path):
    w = small_valid_writer(tmp_path / "a.gguf")
    data = w.to_bytes()
    w.write()
    assert (tmp_path / "a.gguf").read_bytes() == data
    assert data[:4] == b"GGUF" and int.from_bytes(data[4:8], "little") == 3


def test_layout_header_kv_infos_then_aligned_data(tmp_path):
    w = GGUFWriter(arch="llama")
    w.add_tensor("a", np.arange(3, dtype=np.float32))
    w.add_tensor("b", np.arange(2, dtype=np.float16))
    data = w.to_bytes()
    n_tensors, n_kv = np.frombuffer(data, "<u8", 2, 8)
    assert (n_tensors, n_kv) == (2, 1)
    path = tmp_path / "l.gguf"
    path.write_bytes(data)
    with GGUFReader(path) as r:
        assert r.data_offset % 32 == 0
        assert [t.offset - r.data_offset for t in r.tensors] == [0, 32]
        assert len(data) == r.data_offset + 64  # the last tensor is padded too
        assert data[r.data_offset + 12 : r.data_offset + 32] == b"\0" * 20


def test_value_inference(tmp_path):
    w = GGUFWriter()
    w.add_array("ints", [1, -2])
    w.add_array("big", [1, 2**40])
    w.add_array("huge", [0, 2**64 - 1])
    w.add_array("floats", [1, 2.5])
    w.add_array("bools", [True, False])
    w.add_array("strs", ["a", b"\xff"])
    w.add_array("u16", np.array([1, 2], np.uint16))
    w.add_array("f64", np.array([1.5], ">f8"))  # big-endian input is written little-endian
    w.add_array("nested", [[1], [[2.5]]])
    with _read(tmp_path, w) as r:
        types = {k: r.array_type(k) for k in r.metadata}
        assert types == {
            "ints": VT.INT32,
            "big": VT.INT64,
            "huge": VT.UINT64,
            "floats": VT.FLOAT32,
            "bools": VT.BOOL,
            "strs": VT.STRING,
            "u16": VT.UINT16,
            "f64": VT.FLOAT64,
            "nested": VT.ARRAY,
        }
        assert r.metadata["huge"].tolist() == [0, 2**64 - 1]
        assert r.metadata["strs"] == ["a", "\udcff"]
        assert r.metadata["f64"].tolist() == [1.5]
        assert r.metadata["nested"][1][0].tolist() == [2.5]


def test_every_value_type_via_add_value(tmp_path):
    with _read(tmp_path, every_value_writer()) as r:
        assert r.value_type("test.scalar.uint16") == VT.UINT16
        assert r.metadata["test.scalar.int64"] == -(2**63)


def test_tensor_dtypes_and_byte_order(tmp_path):
    big = np.arange(6, dtype=">f4").reshape(2, 3)
    w = GGUFWriter()
    w.add_tensor("big_endian", big)
    w.add_tensor("transposed", np.arange(6, dtype=np.int32).reshape(2, 3).T)
    w.add_tensor("raw_f32", np.arange(2, dtype=np.float32).view(np.uint8), GGMLType.F32)
    w.add_tensor("flat", np.arange(6, dtype=np.float32), shape=(3, 2))
    w.add_tensor("q", np.zeros((3, 2 * 34), np.uint8), GGMLType.Q8_0)  # shape inferred
    with _read(tmp_path, w) as r:
        np.testing.assert_array_equal(r.tensor("big_endian").array(), big)
        t = r.tensor("transposed")
        assert t.shape == (2, 3)
        np.testing.assert_array_equal(t.array(), np.arange(6).reshape(2, 3).T)
        assert r.tensor("raw_f32").shape == (2,)
        assert r.tensor("raw_f32").array().tolist() == [0.0, 1.0]
        assert r.tensor("flat").array().shape == (2, 3)
        assert r.tensor("q").shape == (64, 3)


@pytest.mark.parametrize(
    "call, error",
    [
        (lambda w: w.add_uint8("k", 256), ValueError),
        (lambda w: w.add_int8("k", -129), ValueError),
        (lambda w: w.add_uint64("k", -1), ValueError),
        (lambda w: w.add_int32("k", True), TypeError),
        (lambda w: w.add_int32("k", 1.0), TypeError),
        (lambda w: w.add_float32("k", 1e39), ValueError),
        (lambda w: w.add_float32("k", "1"), TypeError),
        (lambda w: w.add_bool("k", 1), TypeError),
        (lambda w: w.add_string("k", 5), TypeError),
        (lambda w: w.add_value("", 1, VT.UINT8), ValueError),
        (lambda w: w.add_value("k", 1, 13), ValueError),
        (lambda w: w.add_value("k", 1, VT.UINT8, VT.UINT8), ValueError),
        (lambda w: w.add_array("k", []), ValueError),
        (lambda w: w.add_array("k", "abc"), TypeError),
        (lambda w: w.add_array("k", [1, "a"]), TypeError),
        (lambda w: w.add_array("k", [1, 2**64]), ValueError),
        (lambda w: w.add_array("k", [300], VT.UINT8), ValueError),
        (lambda w: w.add_array("k", np.array([300]), VT.UINT8), ValueError),
        (lambda w: w.add_array("k", np.array([1.5]), VT.INT32), TypeError),
        (lambda w: w.add_array("k", np.array([1]), VT.BOOL), TypeError),
        (lambda w: w.add_array("k", np.zeros((2, 2))), ValueError),
        (lambda w: w.add_array("k", np.array(["a"])), TypeError),
        (lambda w: w.add_int32("general.alignment", 32), ValueError),
        (lambda w: w.add_uint32("general.alignment", 48), ValueError),
        (lambda w: w.add_tensor("", np.zeros(1, np.float32)), ValueError),
        (lambda w: w.add_tensor("n" * 64, np.zeros(1, np.float32)), ValueError),
        (lambda w: w.add_tensor("t", [1.0]), TypeError),
        (lambda w: w.add_tensor("t", np.zeros(2, np.uint16)), TypeError),
        (lambda w: w.add_tensor("t", np.zeros(2, np.int32), GGMLType.F32), TypeError),
        (lambda w: w.add_tensor("t", np.zeros(2, np.float16), GGMLType.BF16), TypeError),
        (lambda w: w.add_tensor("t", np.zeros(3, np.float32), shape=(2,)), ValueError),
        (lambda w: w.add_tensor("t", np.zeros((1, 1, 1, 1, 1), np.float32)), ValueError),
        (lambda w: w.add_tensor("t", np.zeros(4, np.float32), shape=(-4,)), ValueError),
        (lambda w: w.add_tensor("t", np.zeros((2, 33), np.uint8), GGMLType.Q8_0), ValueError),
        (lambda w: w.add_tensor("t", np.zeros(34, np.uint8), GGMLType.Q8_0, (33,)), ValueError),
        (lambda w: w.add_tensor("t", np.zeros(34, np.uint8), GGMLType.Q8_0, (64,)), ValueError),
        (lambda w: w.add_tensor("t", np.zeros(4, np.float32), 99), ValueError),
    ],
)
def test_misuse_raises(call, error):
    w = GGUFWriter()
    with pytest.raises(error):
        call(w)


def test_duplicates_and_nesting_limit(tmp_path):
    w = GGUFWriter(arch="llama")
    with pytest.raises(ValueError, match="duplicate key"):
        w.add_string("general.architecture", "x")
    w.add_tensor("t", np.zeros(1, np.float32))
    with pytest.raises(ValueError, match="duplicate tensor"):
        w.add_tensor("t", np.zeros(1, np.float32))
    nested: list = [1]
    for _ in range(MAX_ARRAY_DEPTH - 1):
        nested = [nested]
    w.add_array("deepest", nested)
    with pytest.raises(ValueError, match="nested more than"):
        w.add_array("too_deep", [nested])
    with _read(tmp_path, w) as r:
        value = r.metadata["deepest"]
        for _ in range(MAX_ARRAY_DEPTH - 1):
            value = value[0]
        assert value.tolist() == [1]


def test_alignment(tmp_path):
    with pytest.raises(ValueError):
        GGUFWriter(alignment=3)
    with pytest.raises(ValueError):
        GGUFWriter(alignment=0)
    w = GGUFWriter(alignment=1)
    w.add_tensor("a", np.zeros(3, np.int8))
    w.add_tensor("b", np.zeros(1, np.int8))
    with _read(tmp_path, w) as r:
        assert r.alignment == 1 and [t.offset - r.data_offset for t in r.tensors] == [0, 3]


def test_no_changes_after_write(tmp_path):
    w = GGUFWriter(tmp_path / "done.gguf")
    w.write()
    for call in (
        lambda: w.add_uint8("k", 1),
        lambda: w.add_tensor("t", np.zeros(1, np.float32)),
        lambda: w.write(),
    ):
        with pytest.raises(RuntimeError, match="already written"):
            call()
    with pytest.raises(ValueError, match="no path"):
        GGUFWriter().write()


def test_atomic_write_keeps_old_file_on_failure(tmp_path, monkeypatch):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"old contents")
    os.chmod(path, 0o640)

    def broken_write(self, out):
        out.write(b"GGUF partial")
        raise OSError(28, "No space left on device")

    w = small_valid_writer(path)
    monkeypatch.setattr(GGUFWriter, "_write_to", broken_write)
    with pytest.raises(OSError, match="No space"):
        w.write()
    assert path.read_bytes() == b"old contents"
    assert os.listdir(tmp_path) == ["model.gguf"]  # no temporary file left behind
    monkeypatch.undo()

    w.write()
    assert stat.S_IMODE(path.stat().st_mode) == 0o640  # the replaced file's mode is kept
    assert os.listdir(tmp_path) == ["model.gguf"]
    with GGUFReader(path) as r:
        assert "q.weight" in r


def test_new_file_is_world_readable(tmp_path):
    path = tmp_path / "new.gguf"
    GGUFWriter(path, arch="llama").write()
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
