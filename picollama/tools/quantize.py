"""picollama-quantize: quantize a GGUF model as llama.cpp's llama-quantize does.

picollama-quantize model-f32.gguf model-q4_k_m.gguf Q4_K_M
picollama-quantize --allow-requantize model-q8_0.gguf model-q4_0.gguf Q4_0 2
picollama-quantize --pure --output-tensor-type q8_0 in.gguf out.gguf Q4_K_S

Same arguments, same per-tensor types (picollama.quant.mixes), same bytes: the output is
the file llama-quantize writes for the same input and type (no importance matrix). The output
is written to a temporary file beside OUT and renamed over OUT only when complete.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import struct
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from picollama.gguf import GGUFError, GGUFReader
from picollama.gguf.constants import GGML_TYPES, GGUF_MAGIC, GGMLType, Keys, tensor_nbytes
from picollama.quant import UnsupportedTypeError, dequantize, supports
from picollama.quant.fast import quantize_rows
from picollama.quant.mixes import (
    SUPPORTED_FTYPES,
    LlamaFType,
    MixError,
    ModelParams,
    QuantizeParams,
    TensorChoice,
    is_quantized,
    llama_tensor_order,
    n_dims,
    parse_ftype,
    parse_ggml_type,
    plan_types,
)

__all__ = ["main", "quantize_file", "QuantizeError", "QuantizeSummary"]

# ggml.h GGML_QNT_VERSION: the layout version of the quantized types
GGML_QNT_VERSION = 2
# keys llama-quantize drops (a split model is written as one file)
_DROPPED_KEYS = ("split.no", "split.count", "split.tensors.count")
# weights per chunk of rows read, converted and quantized at a time (bounds memory: 4M
# weights are 16 MiB of float32)
_CHUNK_WEIGHTS = 1 << 22

MiB = 1024.0 * 1024.0


class QuantizeError(ValueError):
    """A request picollama-quantize refuses (with a message for the user)."""


@dataclass
class QuantizeSummary:
    n_tensors: int
    n_elements: int
    size_before: int  # bytes of tensor data in the input
    size_after: int  # bytes of tensor data in the output
    fallbacks: list[str]
    seconds: float


def _kv_bytes(reader: GGUFReader) -> list[tuple[str, bytes]]:
    """Each KV record of the input as its raw bytes (key, type, value), in file order."""
    keys = list(reader.metadata)
    starts = [reader.key_offset(k) for k in keys]
    end = min(t.info_offset for t in reader.tensors)  # the first tensor info follows the KVs
    with open(reader.path, "rb") as f:
        head = f.read(end)
    ends = starts[1:] + [end]
    return [(k, head[s:e]) for k, s, e in zip(keys, starts, ends, strict=True)]


def _pack_u32_kv(key: str, value: int) -> bytes:
    raw = key.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw + struct.pack("<II", 4, value)  # 4: UINT32


def _header(
    reader: GGUFReader, plan: list[TensorChoice], ftype: LlamaFType, alignment: int
) -> tuple[bytes, list[int]]:
    """Header, KVs and tensor infos of the output, padded; and each tensor's data size."""
    kvs = [
        raw
        for key, raw in _kv_bytes(reader)
        if key not in (Keys.GENERAL_QUANTIZATION_VERSION, Keys.GENERAL_FILE_TYPE, *_DROPPED_KEYS)
    ]
    # gguf_set_val_u32 removes a key and appends it: these two come last
    kvs.append(_pack_u32_kv(Keys.GENERAL_QUANTIZATION_VERSION, GGML_QNT_VERSION))
    kvs.append(_pack_u32_kv(Keys.GENERAL_FILE_TYPE, int(ftype)))
    parts = [GGUF_MAGIC, struct.pack("<IQQ", 3, len(plan), len(kvs)), *kvs]
    sizes = []
    offset = 0
    for choice in plan:
        dims = choice.shape[: n_dims(choice.shape)] if choice.shape else (1,)
        raw = choice.name.encode("utf-8", "surrogateescape")
        parts.append(struct.pack("<Q", len(raw)) + raw + struct.pack("<I", len(dims)))
        parts.append(struct.pack(f"<{len(dims)}Q", *dims))
        parts.append(struct.pack("<IQ", int(choice.new_type), offset))
        size = tensor_nbytes(choice.new_type, choice.shape)
        sizes.append(size)
        offset += -(-size // alignment) * alignment
    head = b"".join(parts)
    return head + b"\0" * (-len(head) % alignment), sizes


def _check_plan(plan: list[TensorChoice], allow_requantize: bool) -> None:
    """Refuse, before anything is written, what llama-quantize would fail on midway."""
    for c in plan:
        if not c.changes:
            continue
        if is_quantized(c.cur_type) and not allow_requantize:
            raise QuantizeError(
                f"tensor {c.name!r}: requantizing from type {c.cur_type.name} is disabled "
                "(quantizing an already quantized model loses quality; pass "
                "--allow-requantize to do it anyway)"
            )
        if c.cur_type not in (GGMLType.F32, GGMLType.F16, GGMLType.BF16) and not (
            is_quantized(c.cur_type) and supports(c.cur_type)
        ):
            raise QuantizeError(f"tensor {c.name!r}: cannot convert tensor type {c.cur_type.name}")
        if not supports(c.new_type):
            raise QuantizeError(f"tensor {c.name!r}: cannot write type {c.new_type.name}")


class _Source:
    """Reads tensor bytes from the input with plain reads into one reused buffer.

    Not through the reader's mmap: pages of a map stay in the process's resident set until
    it is unmapped, so a whole F32 model would count against peak memory; read() leaves them
    in the page cache only (llama-quantize unmaps each tensor after use for the same reason).
    """

    def __init__(self, path: str):
        self.file = open(path, "rb")  # closed by close()
        self.buf = np.empty(0, dtype=np.uint8)

    def read(self, offset: int, n: int) -> np.ndarray:
        if self.buf.size < n:
            self.buf = np.empty(n, dtype=np.uint8)
        view = memoryview(self.buf)[:n]
        self.file.seek(offset)
        got = 0
        while got < n:
            k = self.file.readinto(view[got:])
            if not k:
                raise QuantizeError(
                    f"input ended at offset {offset + got}: was it changed while reading?"
                )
            got += k
        return self.buf[:n]

    def close(self) -> None:
        self.file.close()


def _convert(
    info,
    choice: TensorChoice,
    source: _Source,
    write: Callable[[bytes], None],
    n_threads: int | None,
) -> None:
    """Write tensor ``info`` as ``choice.new_type``, a chunk of rows at a time."""
    ne0 = info.shape[0] if info.shape else 1
    n_rows = info.n_elements // ne0 if ne0 else 0
    src = GGML_TYPES[info.type]
    src_row = ne0 // src.block_size * src.type_size
    step = max(1, _CHUNK_WEIGHTS // max(ne0, 1))
    for start in range(0, n_rows, step):
        n = min(step, n_rows - start)
        chunk = source.read(info.offset + start * src_row, n * src_row).reshape(n, src_row)
        if not choice.changes:
            write(chunk)
        elif info.type == GGMLType.F32:
            write(quantize_rows(chunk.view(np.float32), choice.new_type, n_threads=n_threads))
        else:
            x = dequantize(chunk, info.type, what=choice.name)
            write(quantize_rows(x, choice.new_type, n_threads=n_threads))


def quantize_file(
    path_in: str,
    path_out: str,
    params: QuantizeParams,
    *,
    allow_requantize: bool = False,
    n_threads: int | None = None,
    progress: bool = False,
    log: Callable[[str], None] | None = None,
) -> QuantizeSummary:
    """Quantize ``path_in`` into ``path_out`` (atomically: a temporary file, then a rename).

    Raises :class:`QuantizeError`, ``GGUFError``, ``MixError`` or ``OSError``; after any
    error, nothing is left at ``path_out`` that was not there before.
    """
    t0 = time.perf_counter()
    if os.path.isdir(path_out):
        raise QuantizeError(f"output {path_out!r} is a directory")
    if os.path.exists(path_out) and os.path.exists(path_in) and os.path.samefile(path_in, path_out):
        raise QuantizeError(f"output {path_out!r} is the input file; choose another name")

    with GGUFReader(path_in) as reader:
        if not reader.tensors:
            raise QuantizeError(f"{path_in!r} has no tensors")
        model = ModelParams.from_metadata(reader.metadata)
        by_name = {t.name: t for t in reader.tensors}
        order = llama_tensor_order(by_name)
        plan = plan_types([(n, by_name[n].shape, by_name[n].type) for n in order], model, params)
        _check_plan(plan, allow_requantize)
        # the input's alignment for both offsets and padding (llama-quantize pads with the
        # default 32 whatever general.alignment says; the two agree on every usual file)
        alignment = reader.alignment
        head, sizes = _header(reader, plan, params.ftype, alignment)

        final = os.path.abspath(path_out)
        directory, base = os.path.split(final)
        fd, tmp = tempfile.mkstemp(prefix=f".{base}.", suffix=".tmp", dir=directory)
        source = bar = None
        try:
            source = _Source(path_in)
            with os.fdopen(fd, "wb") as out:
                out.write(head)
                bar = _progress(plan, progress)
                for choice, size in zip(plan, sizes, strict=True):
                    if choice.fallback and log:
                        _say(bar, log, f"warning: {choice.fallback}")
                    written = 0

                    def write(b, _out=out):
                        nonlocal written
                        b = memoryview(b).cast("B")
                        _out.write(b)
                        written += len(b)

                    _convert(by_name[choice.name], choice, source, write, n_threads)
                    assert written == size, (choice.name, written, size)
                    out.write(b"\0" * (-size % alignment))
                    if bar is not None:
                        bar.update(1)
                out.flush()
                os.fsync(out.fileno())
            os.chmod(tmp, 0o644)
            os.replace(tmp, final)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        finally:
            if bar is not None:
                bar.close()
            if source is not None:
                source.close()

        n_elements = sum(t.n_elements for t in reader.tensors)
        before = sum(t.nbytes for t in reader.tensors)
    return QuantizeSummary(
        n_tensors=len(plan),
        n_elements=n_elements,
        size_before=before,
        size_after=sum(sizes),
        fallbacks=[c.fallback for c in plan if c.fallback],
        seconds=time.perf_counter() - t0,
    )


def _progress(plan, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is optional: no bar without it
        return None
    return tqdm(total=len(plan), unit="tensor", desc="quantizing", file=sys.stderr)


def _say(bar, log: Callable[[str], None], message: str) -> None:
    if bar is not None:
        bar.write(message, file=sys.stderr)
    else:
        log(message)


def _error(message: str) -> int:
    one_line = message.replace("\r", "\\r").replace("\n", "\\n")
    print(f"picollama-quantize: error: {one_line}", file=sys.stderr)
    return 1


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise QuantizeError(f"NTHREADS must be a positive integer, not {text!r}")
    return value


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit code 1 like the other errors
        raise QuantizeError(message)


def _parser() -> argparse.ArgumentParser:
    types = ", ".join(f.label for f in SUPPORTED_FTYPES)
    p = _Parser(
        prog="picollama-quantize",
        description=__doc__.split("\n")[0],
        epilog=f"TYPE: {types} (also Q3_K, Q4_K, Q5_K for the _M mixes, or llama.cpp's "
        "file type number)",
    )
    p.add_argument("input", metavar="IN.gguf")
    p.add_argument("output", metavar="OUT.gguf")
    p.add_argument("type", metavar="TYPE")
    p.add_argument("nthreads", metavar="NTHREADS", nargs="?", default=None)
    p.add_argument(
        "--allow-requantize",
        action="store_true",
        help="allow requantizing tensors that are already quantized (loses quality)",
    )
    p.add_argument(
        "--leave-output-tensor", action="store_true", help="leave output.weight as it is"
    )
    p.add_argument("--pure", action="store_true", help="no k-quant mixture: every tensor gets TYPE")
    p.add_argument("--output-tensor-type", metavar="T", help="type of output.weight")
    p.add_argument("--token-embedding-type", metavar="T", help="type of token_embd.weight")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
        ftype = parse_ftype(args.type)
        n_threads = _positive_int(args.nthreads) if args.nthreads is not None else None
        params = QuantizeParams(
            ftype=ftype,
            output_tensor_type=(
                parse_ggml_type(args.output_tensor_type) if args.output_tensor_type else None
            ),
            token_embedding_type=(
                parse_ggml_type(args.token_embedding_type) if args.token_embedding_type else None
            ),
            pure=args.pure,
            quantize_output_tensor=not args.leave_output_tensor,
        )
        print(
            f"picollama-quantize: {args.input} -> {args.output} as {ftype.label}",
            file=sys.stderr,
        )
        summary = quantize_file(
            args.input,
            args.output,
            params,
            allow_requantize=args.allow_requantize,
            n_threads=n_threads,
            progress=not args.no_progress,
            log=lambda m: print(m, file=sys.stderr),
        )
    except KeyboardInterrupt:
        _error("interrupted; no output written")
        return 130
    except (QuantizeError, MixError, GGUFError, UnsupportedTypeError) as err:
        return _error(str(err))
    except OSError as err:  # a missing file, a full disk, a folder we may not write in
        return _error(str(err))
    except (ValueError, MemoryError) as err:  # anything else a strange file can provoke
        return _error(f"{type(err).__name__}: {err}")
    bpw = 8.0 / summary.n_elements if summary.n_elements else 0.0
    print(
        f"model size  = {summary.size_before / MiB:8.2f} MiB "
        f"({summary.size_before * bpw:.2f} BPW)\n"
        f"quant size  = {summary.size_after / MiB:8.2f} MiB "
        f"({summary.size_after * bpw:.2f} BPW)"
    )
    if summary.fallbacks:
        print(
            f"WARNING: {len(summary.fallbacks)} of {summary.n_tensors} tensor(s) required "
            "fallback quantization"
        )
    print(f"quantize time = {summary.seconds * 1000:10.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
