"""GGUF reader on valid files: round trips, API, zero copy, alignment, PyPI gguf interop."""

from __future__ import annotations

import json
import mmap
import re
import subprocess
import sys
from pathlib import Path

import gguf as pypi_gguf
import numpy as np
import pytest
from gguf_factory import (
    SCALARS,
    build,
    every_type_writer,
    every_value_writer,
    kv,
    kv_scalar,
    random_tensor_bytes,
    small_valid_writer,
    tensor_info,
    u32,
    u64,
)

from picollama.gguf import (
    GGML_TYPES,
    GGMLType,
    GGUFError,
    GGUFKeyError,
    GGUFReader,
    GGUFValueType,
    GGUFWriter,
)
from picollama.gguf.reader import ARRAY_DTYPES, MAX_ARRAY_DEPTH
from picollama.tools import gguf_dump

VT = GGUFValueType


def _write(tmp_path, data: bytes, name: str = "f.gguf"):
    path = tmp_path / name
    path.write_bytes(data)
    return path


def _assert_same_value(got, want, vtype: VT, elem_type: VT | None = None):
    if vtype == VT.ARRAY:
        if elem_type in ARRAY_DTYPES:
            assert isinstance(got, np.ndarray)
            assert got.dtype == ARRAY_DTYPES[elem_type]
            np.testing.assert_array_equal(got, np.asarray(want).astype(got.dtype))
        else:
            assert isinstance(got, list) and len(got) == len(want)
    elif vtype == VT.FLOAT32:
        assert got == float(np.float32(want))
    else:
        assert got == want and type(got) is type(want)


# -- round trips ---------------------------------------------------------------------------


def test_every_value_type_round_trips(tmp_path):
    path = tmp_path / "values.gguf"
    every_value_writer(path).write()
    with GGUFReader(path) as r:
        assert r.version == 3 and r.alignment == 32
        assert list(r.metadata)[0] == "general.architecture"
        assert r.get_str("general.architecture") == "llama"
        for vtype, value in SCALARS.items():
            key = f"test.scalar.{vtype.name.lower()}"
            assert r.value_type(key) == vtype
            assert r.array_type(key) is None
            _assert_same_value(r.metadata[key], value, vtype)
        for vtype in SCALARS:
            key = f"test.array.{vtype.name.lower()}"
            assert r.value_type(key) == VT.ARRAY and r.array_type(key) == vtype
            value = r.metadata[key]
            if vtype == VT.STRING:
                assert value == ["a", "", "\udcff", "日本"]
            elif vtype == VT.BOOL:
                assert value.dtype == np.bool_ and value.tolist() == [True, False, True]
            elif vtype not in (VT.FLOAT32, VT.FLOAT64):
                assert value.dtype == ARRAY_DTYPES[vtype] and value.tolist() == [0, 1, 2, 3]
            assert not getattr(value, "flags", None) or not value.flags.writeable
        empty = r.metadata["test.array.empty"]
        assert empty.dtype == np.int32 and empty.size == 0
        nested = r.metadata["test.array.nested"]
        assert r.array_type("test.array.nested") == VT.ARRAY
        assert nested[0].tolist() == [1, 2] and nested[1] == ["x", "y"]
        assert nested[2][0].tolist() == [True]


def test_non_utf8_strings_round_trip_byte_exact(tmp_path):
    raw_tokens = [b"\xff", b"\xe6\xad", b"ok", bytes(range(256))]
    w = GGUFWriter(tmp_path / "t.gguf")
    w.add_array("tokenizer.ggml.tokens", raw_tokens, VT.STRING)
    w.write()
    with GGUFReader(tmp_path / "t.gguf") as r:
        tokens = r.get_array("tokenizer.ggml.tokens", elem_type=VT.STRING)
        assert [t.encode("utf-8", "surrogateescape") for t in tokens] == raw_tokens


def test_every_tensor_type_round_trips(tmp_path):
    path = tmp_path / "types.gguf"
    every_type_writer(path, seed=3).write()
    rng = np.random.default_rng(3)
    with GGUFReader(path) as r:
        assert [t.name for t in r.tensors] == [f"t.{t.name}" for t in GGML_TYPES]
        for ggml_type, info in GGML_TYPES.items():
            shape = (info.block_size * 2, 3)
            want = random_tensor_bytes(rng, ggml_type, shape)
            t = r.tensor(f"t.{ggml_type.name}")
            assert t.type == ggml_type and t.shape == shape
            assert t.n_elements == shape[0] * shape[1]
            assert t.nbytes == want.nbytes == t.data.nbytes
            assert t.data.dtype == np.uint8 and t.data.ndim == 1
            assert t.offset % r.alignment == 0
            np.testing.assert_array_equal(t.data, want.reshape(-1))
            arr = t.array()
            if t.is_quantized:
                assert arr.dtype == np.uint8 and arr.shape == want.shape
            else:
                assert arr.shape == shape[::-1]
                np.testing.assert_array_equal(arr.view(np.uint8).reshape(want.shape), want)


def test_typed_tensor_views(tmp_path):
    rng = np.random.default_rng(5)
    tensors = {
        "f32": rng.standard_normal((3, 5, 2)).astype(np.float32),
        "f16": rng.standard_normal((4, 3)).astype(np.float16),
        "f64": rng.standard_normal(7),
        "i8": rng.integers(-128, 127, (2, 2, 2, 2), dtype=np.int8),
        "i16": rng.integers(-(2**15), 2**15, 9, dtype=np.int16),
        "i32": rng.integers(-(2**31), 2**31, (3, 1), dtype=np.int32),
        "i64": rng.integers(-(2**63), 2**63 - 1, 2, dtype=np.int64),
    }
    bf16 = rng.integers(0, 2**16, (2, 3), dtype=np.uint16)
    w = GGUFWriter(tmp_path / "v.gguf")
    for name, data in tensors.items():
        w.add_tensor(name, data)
    w.add_tensor("bf16", bf16, GGMLType.BF16)
    w.add_tensor("scalar", np.array(2.5, np.float32))
    w.write()
    with GGUFReader(tmp_path / "v.gguf") as r:
        for name, data in tensors.items():
            t = r.tensor(name)
            assert t.shape == data.shape[::-1]
            got = t.array()
            assert got.dtype == data.dtype.newbyteorder("<") and got.shape == data.shape
            np.testing.assert_array_equal(got, data)
        assert r.tensor("bf16").type == GGMLType.BF16
        np.testing.assert_array_equal(r.tensor("bf16").array(), bf16)
        scalar = r.tensor("scalar")  # n_dims 0: one element, as in llama.cpp
        assert scalar.shape == () and scalar.n_elements == 1 and scalar.array() == 2.5


def test_zero_dim_is_an_empty_tensor(tmp_path):
    w = GGUFWriter(tmp_path / "e.gguf")
    w.add_tensor("a", np.zeros((2, 0, 3), np.float32))
    w.add_tensor("q", np.zeros((0, 34), np.uint8), GGMLType.Q8_0, shape=(32, 0))
    w.add_tensor("b", np.ones(4, np.float32))
    w.write()
    with GGUFReader(tmp_path / "e.gguf") as r:
        a, q, b = r.tensors
        assert a.nbytes == 0 and a.n_elements == 0 and a.array().shape == (2, 0, 3)
        assert q.nbytes == 0 and q.array().shape == (0, 34)
        assert b.offset == a.offset == q.offset  # empty tensors take no room
        assert b.array().tolist() == [1, 1, 1, 1]


def test_version_2_reads_like_3(tmp_path):
    data = bytearray(small_valid_writer().to_bytes())
    data[4:8] = u32(2)
    with (
        GGUFReader(_write(tmp_path, bytes(data))) as r2,
        GGUFReader(_write(tmp_path, small_valid_writer().to_bytes(), "v3.gguf")) as r3,
    ):
        assert r2.version == 2
        assert list(r2.metadata) == list(r3.metadata)
        assert [(t.name, t.shape, t.type, t.offset) for t in r2.tensors] == [
            (t.name, t.shape, t.type, t.offset) for t in r3.tensors
        ]


def test_name_of_63_bytes_is_accepted(tmp_path):
    name = "n" * 63
    data = build([], [tensor_info(name, (1,), GGMLType.F32, 0)], b"\0" * 32)
    with GGUFReader(_write(tmp_path, data)) as r:
        assert name in r and r.tensor(name).nbytes == 4


def test_empty_file_without_tensors_or_padding(tmp_path):
    data = build([kv_scalar("k", VT.UINT8, 1)], alignment=1)
    with GGUFReader(_write(tmp_path, data)) as r:
        assert r.metadata == {"k": 1} and r.tensors == []
        # The data section would start at the next multiple of 32, past the end of the file:
        # harmless, since there is no data to read there.
        assert r.data_offset == 64 > len(data)


# -- API -----------------------------------------------------------------------------------


def test_typed_accessors(tmp_path):
    path = tmp_path / "values.gguf"
    every_value_writer(path).write()
    with GGUFReader(path) as r:
        assert r.get_int("test.scalar.uint64") == 2**64 - 1
        assert r.get_float("test.scalar.float64") == -1.5e300
        assert r.get_float("test.scalar.int8") == -128.0  # integers convert to float
        assert r.get_bool("test.scalar.bool") is True
        assert r.get("nope") is None and r.get("nope", 7) == 7
        assert r.get_int("nope", 3) == 3 and r.get_str("nope", None) is None
        assert r.get_array("test.array.int32", elem_type=VT.INT32).tolist() == [0, 1, 2, 3]
        assert r.get_array("test.array.int32", elem_type=(VT.INT32, VT.UINT32)).size == 4

        at = r.key_offset("test.scalar.string")
        with pytest.raises(GGUFError, match=rf"key 'test.scalar.string' at offset {at}: .*int"):
            r.get_int("test.scalar.string")
        with pytest.raises(GGUFError, match="BOOL"):
            r.get_int("test.scalar.bool")
        with pytest.raises(GGUFError, match="found ARRAY of STRING"):
            r.get_str("test.array.string")
        with pytest.raises(GGUFError, match="found FLOAT32"):
            r.get_bool("test.scalar.float32")
        with pytest.raises(GGUFError, match="expected an ARRAY of INT32, found ARRAY of UINT8"):
            r.get_array("test.array.uint8", elem_type=VT.INT32)
        with pytest.raises(GGUFError, match="found STRING"):
            r.get_array("test.scalar.string")
        for call in (r.get_int, r.get_float, r.get_str, r.get_bool, r.get_array, r.value_type):
            with pytest.raises(GGUFKeyError, match="key 'nope': missing key") as e:
                call("nope")
            assert isinstance(e.value, KeyError) and e.value.offset is None


def test_tensor_lookup(tmp_path):
    with GGUFReader(_write(tmp_path, small_valid_writer().to_bytes())) as r:
        assert "q.weight" in r and "nope" not in r
        assert r.tensor("q.weight").type == GGMLType.Q8_0
        assert r.tensor("q.weight").index == 1
        with pytest.raises(KeyError, match="tensor 'nope'") as e:
            r.tensor("nope")
        assert isinstance(e.value, GGUFError)


def test_zero_copy_views_into_the_mmap(tmp_path):
    path = _write(tmp_path, small_valid_writer().to_bytes())
    r = GGUFReader(path)
    raw = np.frombuffer(path.read_bytes(), np.uint8)
    for t in r.tensors:
        assert not t.data.flags.writeable and not t.array().flags.writeable
        assert np.shares_memory(t.data, t.array()) or t.nbytes == 0
        np.testing.assert_array_equal(t.data, raw[t.offset : t.offset + t.nbytes])
        base = t.data.base
        while not isinstance(base, mmap.mmap):
            base = base.obj if isinstance(base, memoryview) else base.base
        assert base is r._mmap
    scores = r.metadata["tokenizer.ggml.scores"]
    assert isinstance(scores.base, memoryview) and scores.base.obj is r._mmap
    tok = r.tensor("tok.weight").array().copy()
    r.close()
    r.close()  # idempotent
    # Views stay valid after close: the mapping lives until they are freed.
    np.testing.assert_array_equal(r.tensor("tok.weight").array(), tok)


def test_custom_alignment_64(tmp_path):
    w2 = GGUFWriter(tmp_path / "a64.gguf", alignment=64)
    w2.add_tensor("a", np.ones(3, np.float32))
    w2.add_tensor("b", np.ones(5, np.float32))
    w2.write()
    with GGUFReader(tmp_path / "a64.gguf") as r:
        assert r.alignment == 64 and r.get_int("general.alignment") == 64
        assert r.value_type("general.alignment") == VT.UINT32
        assert r.data_offset % 64 == 0
        assert [t.offset - r.data_offset for t in r.tensors] == [0, 64]


def test_misaligned_offset_rejected(tmp_path):
    infos = [
        tensor_info("a", (3,), GGMLType.F32, 0),
        tensor_info("b", (1,), GGMLType.F32, 12),
    ]
    data = build([], infos, b"\0" * 64)
    with pytest.raises(GGUFError, match="tensor 'b' \\(#1\\) at offset .*not a multiple of"):
        GGUFReader(_write(tmp_path, data))


def test_reader_errors_on_missing_or_special_files(tmp_path):
    with pytest.raises(FileNotFoundError):
        GGUFReader(tmp_path / "missing.gguf")
    with pytest.raises(GGUFError, match="not a regular file"):
        GGUFReader(tmp_path)
    with pytest.raises(GGUFError, match="magic at offset 0: truncated at offset 0"):
        GGUFReader(_write(tmp_path, b""))


# -- interop with PyPI gguf (valid files only: it is not safe on hostile ones) ---------------


# Types whose block layout the installed gguf package knows as we do: not the types newer than
# it, nor Q8_1, which gguf-py still gives as 40 bytes (f32 d, s) where ggml's block_q8_1 has
# 36 (f16 d, s).
_PYPI_SAME_LAYOUT = {
    t
    for t, info in GGML_TYPES.items()
    if pypi_gguf.GGML_QUANT_SIZES.get(t.value) == (info.block_size, info.type_size)
}


def test_our_writer_to_pypi_reader(tmp_path):
    path = tmp_path / "ours.gguf"
    w = every_type_writer(path, seed=7, types=_PYPI_SAME_LAYOUT)
    w.add_uint32("k.u32", 7)
    w.add_float32("k.f32", 0.5)
    w.add_bool("k.bool", False)
    w.add_string("k.str", "héllo")
    w.add_array("k.ints", np.array([1, -2], np.int64))
    w.add_array("k.strs", ["a", "bc"])
    w.write()
    ref = pypi_gguf.GGUFReader(path)
    assert ref.fields["k.u32"].contents() == 7
    assert ref.fields["k.f32"].contents() == 0.5
    assert ref.fields["k.bool"].contents() is False or ref.fields["k.bool"].contents() == 0
    assert ref.fields["k.str"].contents() == "héllo"
    assert ref.fields["k.ints"].contents() == [1, -2]
    assert ref.fields["k.strs"].contents() == ["a", "bc"]
    assert ref.fields["k.ints"].types == [VT.ARRAY, VT.INT64]
    with GGUFReader(path) as r:
        assert len(ref.tensors) == len(r.tensors)
        for theirs, ours in zip(ref.tensors, r.tensors, strict=True):
            assert theirs.name == ours.name
            assert int(theirs.tensor_type) == int(ours.type)
            assert tuple(int(d) for d in theirs.shape) == ours.shape
            assert theirs.data_offset == ours.offset
            assert int(theirs.n_bytes) == ours.nbytes
            np.testing.assert_array_equal(theirs.data.reshape(-1).view(np.uint8), ours.data)


def test_pypi_writer_to_our_reader(tmp_path):
    path = tmp_path / "theirs.gguf"
    ref = pypi_gguf.GGUFWriter(path, arch="llama")
    ref.add_custom_alignment(64)
    ref.add_uint8("k.u8", 200)
    ref.add_int8("k.i8", -5)
    ref.add_uint16("k.u16", 60000)
    ref.add_int16("k.i16", -30000)
    ref.add_uint32("k.u32", 4_000_000_000)
    ref.add_int32("k.i32", -2_000_000_000)
    ref.add_float32("k.f32", 1.25)
    ref.add_uint64("k.u64", 2**64 - 1)
    ref.add_int64("k.i64", -(2**63))
    ref.add_float64("k.f64", 2.5e-300)
    ref.add_bool("k.bool", True)
    ref.add_string("k.str", "日本")
    ref.add_array("k.arr_i", [1, 2, 3])
    ref.add_array("k.arr_f", [1.5, 2.5])
    ref.add_array("k.arr_s", ["x", "yz"])
    ref.add_array("k.arr_nested", [[1, 2], [3]])
    rng = np.random.default_rng(11)
    want = {}
    for ggml_type, info in GGML_TYPES.items():
        if ggml_type not in _PYPI_SAME_LAYOUT:
            continue
        shape = (info.block_size * 2, 3)
        raw = random_tensor_bytes(rng, ggml_type, shape)
        qtype = pypi_gguf.GGMLQuantizationType(ggml_type.value)
        ref.add_tensor(f"t.{ggml_type.name}", raw, raw_dtype=qtype)
        want[f"t.{ggml_type.name}"] = (ggml_type, shape, raw)
    f32 = rng.standard_normal((2, 3)).astype(np.float32)
    ref.add_tensor("t.plain", f32)
    ref.write_header_to_file()
    ref.write_kv_data_to_file()
    ref.write_tensors_to_file()
    ref.close()

    with GGUFReader(path) as r:
        assert r.alignment == 64
        expect = {
            "general.architecture": (VT.STRING, "llama"),
            "general.alignment": (VT.UINT32, 64),
            "k.u8": (VT.UINT8, 200),
            "k.i8": (VT.INT8, -5),
            "k.u16": (VT.UINT16, 60000),
            "k.i16": (VT.INT16, -30000),
            "k.u32": (VT.UINT32, 4_000_000_000),
            "k.i32": (VT.INT32, -2_000_000_000),
            "k.f32": (VT.FLOAT32, 1.25),
            "k.u64": (VT.UINT64, 2**64 - 1),
            "k.i64": (VT.INT64, -(2**63)),
            "k.f64": (VT.FLOAT64, 2.5e-300),
            "k.bool": (VT.BOOL, True),
            "k.str": (VT.STRING, "日本"),
        }
        for key, (vtype, value) in expect.items():
            assert r.value_type(key) == vtype, key
            assert r.metadata[key] == value, key
        assert r.array_type("k.arr_i") == VT.INT32 and r.metadata["k.arr_i"].tolist() == [1, 2, 3]
        assert r.array_type("k.arr_f") == VT.FLOAT32
        assert r.metadata["k.arr_f"].tolist() == [1.5, 2.5]
        assert r.metadata["k.arr_s"] == ["x", "yz"]
        assert [a.tolist() for a in r.metadata["k.arr_nested"]] == [[1, 2], [3]]
        for name, (ggml_type, shape, raw) in want.items():
            t = r.tensor(name)
            assert (t.type, t.shape) == (ggml_type, shape)
            assert t.offset % 64 == 0
            np.testing.assert_array_equal(t.data, raw.reshape(-1))
        assert r.tensor("t.plain").type == GGMLType.F32
        np.testing.assert_array_equal(r.tensor("t.plain").array(), f32)


def test_arrays_nested_to_the_limit_parse(tmp_path):
    payload = (u32(VT.ARRAY) + u64(1)) * (MAX_ARRAY_DEPTH - 1) + u32(VT.UINT8) + u64(1) + b"\7"
    with GGUFReader(_write(tmp_path, build([kv("k", VT.ARRAY, payload)]))) as r:
        value = r.metadata["k"]
        for _ in range(MAX_ARRAY_DEPTH - 1):
            value = value[0]
        assert value.tolist() == [7]


# -- the picollama-gguf tool ---------------------------------------------------------------


def test_dump_prints_metadata_and_tensors(tmp_path, capsys):
    path = tmp_path / "small.gguf"
    w = small_valid_writer(path)
    w.add_array("long", np.arange(1000, dtype=np.int32))
    w.add_string("evil\x1b[2J", "line\nbreak\x9b")
    w.write()
    assert gguf_dump.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "GGUF version 3, alignment 32" in out
    assert "22 key/value pairs, 4 tensors" in out
    assert "general.architecture = 'llama'" in out
    assert "[STRING]" in out and "tokenizer.ggml.tokens = ['<s>', 'a', '\\udcff']" in out
    assert "long = [0, 1, 2, 3, 4, 5, ... (1000 items)]" in out
    assert "s.float32 = 0.1" in out
    assert re.search(r"2: q\.weight\s+\| Q8_0\s+\| 32 x 1\s+\|\s+\d+ \|\s+34", out)
    assert "\x1b" not in out and "\x9b" not in out and "evil\\x1b[2J" in out
    assert "* total: 4 tensors, " in out

    assert gguf_dump.main([str(path), "--no-tensors", "--max-items", "2"]) == 0
    out = capsys.readouterr().out
    assert "q.weight" not in out and "long = [0, 1, ... (1000 items)]" in out


def test_dump_json(tmp_path, capsys):
    path = tmp_path / "small.gguf"
    small_valid_writer(path).write()
    assert gguf_dump.main([str(path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["version"] == 3 and doc["n_tensors"] == 4 and doc["n_kv"] == 20
    meta = {m["key"]: m for m in doc["metadata"]}
    assert meta["tokenizer.ggml.tokens"]["value"] == ["<s>", "a", "\\xff"]
    assert meta["tokenizer.ggml.tokens"]["elem_type"] == "STRING"
    assert meta["s.uint64"] == {
        "key": "s.uint64",
        "type": "UINT64",
        "elem_type": None,
        "count": 1,
        "value": 2**64 - 1,
    }
    assert meta["a.nested"]["value"] == [[1], ["z"]]
    q = doc["tensors"][1]
    assert (q["name"], q["type"], q["shape"], q["nbytes"]) == ("q.weight", "Q8_0", [32, 1], 34)
    assert doc["total_bytes"] == sum(t["nbytes"] for t in doc["tensors"])


def test_dump_errors_are_one_line(tmp_path, capsys):
    path = _write(tmp_path, small_valid_writer().to_bytes()[:100])
    assert gguf_dump.main([str(path)]) == 1
    captured = capsys.readouterr()
    assert captured.err.startswith("picollama-gguf: error: ")
    assert captured.err.count("\n") == 1 and "offset" in captured.err
    assert gguf_dump.main([str(tmp_path / "missing.gguf")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("picollama-gguf: error: ") and err.count("\n") == 1


def test_dump_console_entry_point_has_no_traceback(tmp_path):
    path = _write(tmp_path, build([kv("k\x1b", 13, b"\0" * 8)]))
    proc = subprocess.run(
        [sys.executable, "-m", "picollama.tools.gguf_dump", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.startswith("picollama-gguf: error: ") and "Traceback" not in proc.stderr
    assert "invalid type 13 for key 'k\\x1b'" in proc.stderr and "\x1b" not in proc.stderr
