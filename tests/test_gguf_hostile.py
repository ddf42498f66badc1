"""Hostile GGUF files (RELIABILITY.md items 1-16, 18): each fails fast with a GGUFError that
names the field and the byte offset, in bounded time and memory.

Never hand these files to PyPI's gguf reader: it hangs or recurses on several of them.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
import textwrap
import time
import tracemalloc
from dataclasses import dataclass
from pathlib import Path

import pytest
from gguf_factory import (
    build,
    gstr,
    header,
    kv,
    kv_array,
    kv_scalar,
    small_valid_writer,
    tensor_info,
    u32,
    u64,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from picollama.gguf import GGMLType, GGUFError, GGUFReader, GGUFValueType

VT = GGUFValueType
F32 = GGMLType.F32
KV0 = 24  # the first KV (or tensor info) starts right after the 24-byte header
PAD = b"\0" * 64  # slack so that count-vs-bytes-left checks pass and the case under test fires

# Time and memory budget of one hostile parse.
MAX_SECONDS = 1.0
MAX_PEAK_BYTES = 4 << 20


@dataclass(frozen=True)
class Case:
    item: int  # RELIABILITY.md item
    id: str
    data: bytes
    match: str  # regex on the message
    field: str  # substring of GGUFError.field
    offset: int | None = None  # expected GGUFError.offset, when easy to state


def _t_at(name: str = "t", n_dims: int = 1) -> dict[str, int]:
    """Offsets inside the first tensor info (no KVs before it)."""
    n_dims_at = KV0 + 8 + len(name.encode())
    type_at = n_dims_at + 4 + 8 * n_dims
    return {"n_dims": n_dims_at, "dims": n_dims_at + 4, "type": type_at, "offset": type_at + 4}


def _cases() -> list[Case]:
    c: list[Case] = []
    add = c.append
    # 1. magic and version
    add(Case(1, "bad-magic", header(0, 0, magic=b"GGUX"), r"bad magic b'GGUX'", "magic", 0))
    add(Case(1, "magic-only", b"GGU", r"truncated at offset 0", "magic", 0))
    for v in (0, 1, 4, 0xFFFFFFFF):
        add(
            Case(1, f"version-{v}", header(0, 0, v), rf"unsupported GGUF version {v}", "version", 4)
        )
    add(Case(1, "version-swapped-3", header(0, 0, 3 << 24), r"big-endian", "version", 4))
    add(Case(1, "version-swapped-2", header(0, 0, 2 << 24), r"big-endian", "version", 4))
    # 2. counts
    for name, at in (("n_tensors", 8), ("n_kv", 16)):
        for v, msg in ((-1, "-1 is negative"), (2**63, "-9223372036854775808 is negative")):
            counts = {"n_tensors": 0, "n_kv": 0, name: v}
            add(Case(2, f"{name}-{v}", header(**counts) + PAD, msg, name, at))
        counts = {"n_tensors": 0, "n_kv": 0, name: 2**40}
        add(Case(2, f"{name}-2^40", header(**counts) + PAD, "needs at least", name, at))
    add(Case(2, "counts-together", header(3, 3) + b"\0" * 100, "cannot fit", "n_kv", 8))
    # 4. keys
    add(
        Case(
            4,
            "key-length-2^64-1",
            header(0, 1) + u64(2**64 - 1) + PAD,
            r"key length 18446744073709551615 exceeds the 64 bytes left",
            "key #0",
            KV0,
        )
    )
    add(
        Case(
            4,
            "key-length-past-eof",
            header(0, 1) + gstr(b"abc" + PAD, 1000),
            r"key length 1000",
            "key #0",
            KV0,
        )
    )
    add(Case(4, "empty-key", build([kv("", VT.UINT8, b"\1")]) + PAD, r"empty key", "key #0", KV0))
    add(
        Case(
            4,
            "second-key-bad",
            build([kv_scalar("a", VT.UINT8, 1), u64(2**63) + PAD]),
            r"key length 9223372036854775808",
            "key #1",
            KV0 + 14,
        )
    )
    # 5. string values
    for n in (2**63, 2**30 + 1, 2**64 - 1):
        add(
            Case(
                5,
                f"string-length-{n}",
                build([kv("k", VT.STRING, u64(n) + b"abc")]) + PAD,
                rf"string value length {n} exceeds the \d+ bytes left",
                "key 'k' (#0)",
                KV0 + 9 + 4,
            )
        )
    add(
        Case(
            5,
            "string-array-element-length",
            build([kv("k", VT.ARRAY, u32(VT.STRING) + u64(2) + gstr("a") + u64(2**62))]) + PAD,
            r"string array element length 4611686018427387904",
            "key 'k' (#0)",
        )
    )
    # 6. array counts
    for elem in (VT.UINT8, VT.FLOAT64, VT.STRING, VT.ARRAY):
        add(
            Case(
                6,
                f"array-count-2^63-{elem.name}",
                header(0, 1) + gstr("k") + u32(VT.ARRAY) + u32(elem) + u64(2**63),
                rf"array count 9223372036854775808 of {elem.name}",
                "key 'k' (#0)",
                KV0 + 9 + 4 + 4,
            )
        )
    add(
        Case(
            6,
            "array-count-one-too-many",
            build([kv("k", VT.ARRAY, u32(VT.UINT32) + u64(5) + b"\0" * 16)], alignment=1),
            r"array count 5 of UINT32 needs at least 5 x 4 bytes",
            "key 'k' (#0)",
        )
    )
    # 7. nesting
    deep = (u32(VT.ARRAY) + u64(1)) * 10**4 + u32(VT.UINT8) + u64(0)
    add(
        Case(
            7,
            "nesting-10^4",
            build([kv("k", VT.ARRAY, deep)]),
            r"nested more than 8 deep",
            "key 'k'",
            KV0 + 13 + 12 * 7,
        )
    )
    wide = u32(VT.ARRAY) + u64(3) + (u32(VT.ARRAY) + u64(2**40)) * 3
    add(
        Case(
            7,
            "nested-count",
            build([kv("k", VT.ARRAY, wide)]),
            r"array count 1099511627776",
            "key 'k'",
        )
    )
    # 8. value types
    for v in (13, 0xFFFFFFFF, 2**31):
        add(
            Case(
                8,
                f"value-type-{v}",
                build([kv("k", v, b"\0" * 8)]),
                rf"invalid type {v} for key 'k'",
                "key 'k' (#0)",
                KV0 + 9,
            )
        )
        add(
            Case(
                8,
                f"array-elem-type-{v}",
                build([kv("k", VT.ARRAY, u32(v) + u64(1) + b"\0" * 8)]),
                rf"invalid type {v} for key 'k'",
                "key 'k' (#0)",
                KV0 + 13,
            )
        )
    add(
        Case(
            8,
            "bool-2",
            build([kv("k", VT.BOOL, b"\2")]) + PAD,
            r"BOOL value 2",
            "key 'k'",
            KV0 + 13,
        )
    )
    add(
        Case(
            8,
            "bool-array-7",
            build([kv("k", VT.ARRAY, u32(VT.BOOL) + u64(3) + b"\1\7\0")]) + PAD,
            r"BOOL array element 1 is 7",
            "key 'k'",
            KV0 + 13 + 12 + 1,
        )
    )
    # 9. duplicates and names
    dup = build([kv_scalar("k", VT.UINT8, 1), kv_scalar("k", VT.UINT8, 2)])
    add(
        Case(
            9,
            "duplicate-key",
            dup,
            r"duplicate key 'k' \(first at offset 24\)",
            "key 'k' (#1)",
            KV0 + 14,
        )
    )
    infos = [tensor_info("t", (1,), F32, 0), tensor_info("t", (1,), F32, 32)]
    add(
        Case(
            9,
            "duplicate-tensor",
            build([], infos, b"\0" * 64),
            r"duplicate tensor name 't'",
            "tensor 't' (#1)",
            KV0 + 33,
        )
    )
    for n in (64, 100):
        name = "n" * n
        add(
            Case(
                9,
                f"name-{n}-bytes",
                build([], [tensor_info(name, (1,), F32, 0)], PAD),
                rf"tensor name length {n} exceeds the limit of 63",
                "tensor #0",
                KV0,
            )
        )
    add(
        Case(
            9,
            "name-length-2^64-1",
            header(1, 0) + u64(2**64 - 1) + PAD,
            r"tensor name length 18446744073709551615",
            "tensor #0",
            KV0,
        )
    )
    add(
        Case(
            9,
            "empty-tensor-name",
            build([], [tensor_info("", (1,), F32, 0)], PAD),
            r"empty tensor name",
            "tensor #0",
            KV0,
        )
    )
    # 10. alignment
    align_cases = (
        ("i32", kv_scalar("general.alignment", VT.INT32, 32), r"must be UINT32, found INT32"),
        ("i32-2^31", kv_scalar("general.alignment", VT.INT32, -(2**31)), r"must be UINT32"),
        ("u64", kv_scalar("general.alignment", VT.UINT64, 32), r"must be UINT32, found UINT64"),
        ("str", kv_scalar("general.alignment", VT.STRING, "32"), r"found STRING"),
        ("0", kv_scalar("general.alignment", VT.UINT32, 0), r"alignment 0 is not a power of two"),
        ("3", kv_scalar("general.alignment", VT.UINT32, 3), r"alignment 3 is not a power of two"),
        ("2^31", kv_scalar("general.alignment", VT.UINT32, 2**31), r"alignment 2147483648 exceeds"),
    )
    for label, record, msg in align_cases:
        add(
            Case(
                10,
                f"alignment-{label}",
                build([kv_scalar("a", VT.UINT8, 1), record]),
                msg,
                "key 'general.alignment'",
                KV0 + 14,
            )
        )
    # 11. n_dims
    add(
        Case(
            11,
            "n_dims-5",
            build([], [tensor_info("t", (1,) * 5, F32, 0)], PAD),
            r"n_dims 5 exceeds 4",
            "tensor 't' (#0)",
            _t_at()["n_dims"],
        )
    )
    add(
        Case(
            11,
            "n_dims-2^32-1",
            header(1, 0) + gstr("t") + u32(2**32 - 1) + PAD,
            r"n_dims 4294967295 exceeds 4",
            "tensor 't' (#0)",
            _t_at()["n_dims"],
        )
    )
    # 12. dims
    dims_cases = (
        ("negative", (4, -1), r"dimension 1 is negative \(-1\)"),
        ("int64-min", (-(2**63),), r"dimension 0 is negative"),
        ("2^63-1-x2", (2**63 - 1, 2), r"more than 2\^63-1 elements"),
        ("2^32-x-2^32", (2**32, 2**32), r"more than 2\^63-1 elements"),
        ("zero-with-huge", (0, 2**62, 2**62), r"more than 2\^63-1 elements"),
        ("bytes-overflow", (2**62,), r"takes more than 2\^63-1 bytes"),
    )
    for label, shape, msg in dims_cases:
        add(
            Case(
                12,
                f"dims-{label}",
                build([], [tensor_info("t", shape, F32, 0)], PAD),
                msg,
                "tensor 't' (#0)",
            )
        )
    # 13. block size
    block_cases = (
        ("q4_0-33", GGMLType.Q4_0, (33, 2)),
        ("q4_k-32", GGMLType.Q4_K, (32,)),
        ("q8_0-scalar", GGMLType.Q8_0, ()),
    )
    for label, gtype, shape in block_cases:
        add(
            Case(
                13,
                f"block-{label}",
                build([], [tensor_info("t", shape, gtype, 0)], PAD),
                r"not a multiple of the block size",
                "tensor 't' (#0)",
                _t_at(n_dims=len(shape))["type"],
            )
        )
    # 14. type ids
    for v, shown in ((0xFFFFFFFF, -1), (4, 4), (31, 31), (43, 43), (2**31, -(2**31))):
        add(
            Case(
                14,
                f"type-{v}",
                build([], [tensor_info("t", (1,), v, 0)], PAD),
                rf"invalid ggml type {shown}\b",
                "tensor 't' (#0)",
                _t_at()["type"],
            )
        )
    # 15. offsets and sizes
    at = _t_at()["offset"]
    add(
        Case(
            15,
            "offset-not-running",
            build([], [tensor_info("t", (4,), F32, 32)], b"\0" * 64),
            r"data offset 32, expected 0",
            "tensor 't' (#0)",
            at,
        )
    )
    add(
        Case(
            15,
            "offset-misaligned",
            build([], [tensor_info("t", (4,), F32, 5)], b"\0" * 64),
            r"not a multiple of the alignment 32",
            "tensor 't' (#0)",
            at,
        )
    )
    two = [tensor_info("a", (4,), F32, 0), tensor_info("b", (4,), F32, 64)]
    add(
        Case(
            15,
            "second-offset-not-running",
            build([], two, b"\0" * 128),
            r"data offset 64, expected 32",
            "tensor 'b' (#1)",
        )
    )
    add(
        Case(
            15,
            "data-past-eof",
            build([], [tensor_info("t", (16,), F32, 0)], b"\0" * 32),
            r"extends past the end of the file",
            "tensor 't' (#0)",
            at,
        )
    )
    add(
        Case(
            15,
            "no-data-at-all",
            build([], [tensor_info("t", (1,), F32, 0)]),
            r"extends past the end of the file",
            "tensor 't' (#0)",
            at,
        )
    )
    huge = [tensor_info(f"t{i}", (2**60,), F32, i * 2**62) for i in range(5)]
    add(
        Case(
            15,
            "sizes-past-2^64",
            build([], huge, PAD),
            r"extends past the end of the file",
            "tensor 't0' (#0)",
        )
    )
    # 16. tokenizer arrays
    tokens = kv_array("tokenizer.ggml.tokens", VT.STRING, ["a", "b", "c"])
    tok_cases = (
        (
            "scores-int8",
            [tokens, kv_array("tokenizer.ggml.scores", VT.INT8, [0, 0, 0])],
            r"must be an ARRAY of FLOAT32, found ARRAY of INT8",
            "tokenizer.ggml.scores",
        ),
        (
            "tokens-int32",
            [kv_array("tokenizer.ggml.tokens", VT.INT32, [1])],
            r"ARRAY of STRING, found ARRAY of INT32",
            "tokenizer.ggml.tokens",
        ),
        (
            "tokens-string",
            [kv_scalar("tokenizer.ggml.tokens", VT.STRING, "a")],
            r"found STRING",
            "tokenizer.ggml.tokens",
        ),
        (
            "types-f32",
            [tokens, kv_array("tokenizer.ggml.token_type", VT.FLOAT32, [1, 1, 1])],
            r"ARRAY of INT32, found ARRAY of FLOAT32",
            "token_type",
        ),
        (
            "merges-u8",
            [kv_array("tokenizer.ggml.merges", VT.UINT8, [1])],
            r"ARRAY of STRING",
            "merges",
        ),
        (
            "scores-short",
            [tokens, kv_array("tokenizer.ggml.scores", VT.FLOAT32, [0, 0])],
            r"has 2 entries but tokenizer.ggml.tokens has 3",
            "tokenizer.ggml.scores",
        ),
        (
            "types-long",
            [tokens, kv_array("tokenizer.ggml.token_type", VT.INT32, [1] * 4)],
            r"has 4 entries but tokenizer.ggml.tokens has 3",
            "token_type",
        ),
    )
    for label, kvs, msg, fld in tok_cases:
        add(Case(16, f"tokenizer-{label}", build(kvs), msg, fld))
    return c


CASES = _cases()


def _parse_file(path: Path) -> tuple[GGUFError, float, int]:
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(GGUFError) as info:
            GGUFReader(path)
        elapsed = time.perf_counter() - t0
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return info.value, elapsed, peak


@pytest.mark.parametrize("case", CASES, ids=[f"item{c.item:02d}-{c.id}" for c in CASES])
def test_hostile_file_rejected(case: Case, tmp_path):
    path = tmp_path / "hostile.gguf"
    path.write_bytes(case.data)
    err, elapsed, peak = _parse_file(path)
    message = str(err)
    assert re.search(case.match, message), message
    assert err.field is not None and case.field in err.field, message
    assert message.startswith(err.field), message
    assert err.offset is not None and f"at offset {err.offset}" in message, message
    assert 0 <= err.offset <= len(case.data)
    if case.offset is not None:
        assert err.offset == case.offset, message
    assert "\n" not in message and "\x1b" not in message
    assert elapsed < MAX_SECONDS, f"{elapsed:.3f} s"
    assert peak < MAX_PEAK_BYTES, f"peak {peak} bytes"


def test_every_reliability_item_has_a_case():
    # Item 3 (truncation) is test_truncated_at_every_offset below.
    assert {c.item for c in CASES} == set(range(1, 17)) - {3}


def test_hostile_names_are_escaped_in_messages(tmp_path):
    name = "\x1b[31mred\n" + "x" * 500
    path = tmp_path / "evil.gguf"
    path.write_bytes(build([kv(name, 99, b"\0" * 8)]))
    err, _, _ = _parse_file(path)
    assert "\x1b" not in str(err) and "\n" not in str(err)
    assert "\\x1b[31mred\\n" in str(err) and len(str(err)) < 400


def test_hostile_files_under_a_memory_cap(tmp_path):
    """All cases again in a child process whose address space is capped."""
    for i, case in enumerate(CASES):
        (tmp_path / f"{i:03d}.gguf").write_bytes(case.data)
    child = textwrap.dedent(
        """
        import json, resource, sys, time
        from pathlib import Path
        from picollama.gguf import GGUFError, GGUFReader

        def vm_size():
            for line in open("/proc/self/status"):
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
        cap = vm_size() + (256 << 20)  # everything already imported, 256 MiB of headroom
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
        results = []
        for path in sorted(Path(sys.argv[1]).glob("*.gguf")):
            t0 = time.perf_counter()
            try:
                GGUFReader(path)
                kind = "parsed"
            except GGUFError:
                kind = "GGUFError"
            except BaseException as e:
                kind = type(e).__name__
            results.append((path.name, kind, time.perf_counter() - t0))
        print(json.dumps(results))
        """
    )
    if not Path("/proc/self/status").exists():
        pytest.skip("needs /proc for the address-space size")
    proc = subprocess.run(
        [sys.executable, "-c", child, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parent.parent,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)},
    )
    assert proc.returncode == 0, proc.stderr
    results = json.loads(proc.stdout)
    assert len(results) == len(CASES)
    for name, kind, elapsed in results:
        assert kind == "GGUFError", (name, kind)
        assert elapsed < MAX_SECONDS, (name, elapsed)


# -- item 3: truncation at every byte offset -----------------------------------------------


def test_truncated_at_every_offset(tmp_path):
    data = small_valid_writer().to_bytes()
    full = tmp_path / "full.gguf"
    full.write_bytes(data)
    with GGUFReader(full) as r:
        last = r.tensors[-1]
        assert last.offset + last.nbytes == len(data)  # the file ends with tensor data
        assert len(r.metadata) == 20 and len(r.tensors) == 4
    path = tmp_path / "cut.gguf"
    t0 = time.perf_counter()
    for n in range(len(data)):
        # A fresh file each time: never truncate a file that an mmap may still map.
        path.unlink(missing_ok=True)
        path.write_bytes(data[:n])
        with pytest.raises(GGUFError) as info:
            GGUFReader(path)
        err = info.value
        assert err.offset is not None and 0 <= err.offset <= n, (n, str(err))
        assert f"at offset {err.offset}" in str(err)
    assert time.perf_counter() - t0 < 20


# -- item 18: random mutations of a valid file ---------------------------------------------

_BASE = small_valid_writer().to_bytes()
_INTERESTING = [
    u64(2**64 - 1),
    u64(2**63),
    u64(2**63 - 1),
    u64(2**32),
    u64(2**30 + 1),
    u64(0),
    u32(0xFFFFFFFF),
    u32(2**31),
    u32(13),
    u32(VT.ARRAY),
    u32(5),
    u32(64),
]


@st.composite
def _mutated(draw) -> bytes:
    data = bytearray(_BASE)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "byte", "word", "insert", "delete", "truncate"]))
        pos = draw(st.integers(0, max(len(data) - 1, 0)))
        if op == "flip" and data:
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "byte" and data:
            data[pos] = draw(st.sampled_from([0x00, 0x01, 0x7F, 0x80, 0xFF]))
        elif op == "word":
            word = draw(st.sampled_from(_INTERESTING))
            data[pos : pos + len(word)] = word
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=16))
        elif op == "delete":
            del data[pos : pos + draw(st.integers(1, 16))]
        elif op == "truncate":
            del data[pos:]
    return bytes(data)


_counter = itertools.count()


@settings(
    max_examples=2000,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(data=_mutated())
def test_mutated_files_fail_only_with_gguf_error(data, tmp_path):
    path = tmp_path / f"m{next(_counter)}.gguf"
    path.write_bytes(data)
    t0 = time.perf_counter()
    try:
        r = GGUFReader(path)
    except GGUFError as err:
        assert err.offset is None or 0 <= err.offset <= len(data)
        assert time.perf_counter() - t0 < MAX_SECONDS
        return
    with r:
        # A file that parses is fully usable: every view is in bounds.
        for t in r.tensors:
            assert t.offset + t.nbytes <= len(data)
            t.array()
            bytes(t.data)
        for key in r.metadata:
            r.value_type(key)
            r.array_type(key)
    path.unlink()
