"""picollama-gguf: print a GGUF file's metadata and tensor table (like llama.cpp's gguf dump).

picollama-gguf model.gguf
picollama-gguf smollm2-135m-instruct-q4_1 --no-tensors
picollama-gguf model.gguf --json > model.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any

import numpy as np

from picollama.gguf import GGUFError, GGUFReader, GGUFValueType
from picollama.models.registry import resolve_model_path

__all__ = ["main"]

VT = GGUFValueType

# Array items shown per array in the text output unless --max-items says otherwise.
_TEXT_MAX_ITEMS = 6


def _show_str(s: str) -> str:
    """A quoted literal with control characters and non-UTF-8 bytes escaped."""
    return repr(s)


def _show_name(s: str) -> str:
    """A key or tensor name, escaped but unquoted."""
    return repr(s)[1:-1]


def _show_scalar(value: Any, vtype: VT) -> str:
    if vtype == VT.STRING:
        return _show_str(value)
    if vtype == VT.FLOAT32:
        return str(np.float32(value))
    return str(value)


def _show_array(value: Any, max_items: int | None) -> str:
    """``[a, b, c, ... (n items)]``; nested arrays (at most 8 deep) recurse."""
    n = len(value)
    shown = value if max_items is None else value[:max_items]
    if isinstance(shown, np.ndarray):
        # float32 items print as float32 (0.1, not 0.10000000149011612)
        items = [str(x) for x in (shown if shown.dtype == np.float32 else shown.tolist())]
    else:
        items = [_show_str(v) if isinstance(v, str) else _show_array(v, max_items) for v in shown]
    more = "" if len(shown) == n else f", ... ({n} items)"
    return "[" + ", ".join(items) + more + "]"


def _print_text(r: GGUFReader, show_tensors: bool, max_items: int | None) -> None:
    print(f"* file: {r.path}")
    print(
        f"* GGUF version {r.version}, alignment {r.alignment}, data offset {r.data_offset}, "
        f"file size {r.file_size}"
    )
    print(f"* {len(r.metadata)} key/value pairs, {len(r.tensors)} tensors")
    print("* metadata:")
    for i, (key, value) in enumerate(r.metadata.items(), 1):
        vtype = r.value_type(key)
        if vtype == VT.ARRAY:
            elem_type = r.array_type(key)
            type_name = f"[{elem_type.name}]"
            count = len(value)
            shown = _show_array(value, max_items)
        else:
            type_name, count, shown = vtype.name, 1, _show_scalar(value, vtype)
        print(f"  {i:5}: {type_name:<10} | {count:8} | {_show_name(key)} = {shown}")
    if show_tensors:
        print("* tensors:")
        width = max((len(_show_name(t.name)) for t in r.tensors), default=4)
        print(
            f"  {'#':>5}  {'name':<{width}} | {'type':<7} | {'shape':<24} | "
            f"{'offset':>12} | {'bytes':>12}"
        )
        for t in r.tensors:
            shape = " x ".join(str(d) for d in t.shape) or "(scalar)"
            print(
                f"  {t.index + 1:5}: {_show_name(t.name):<{width}} | {t.type.name:<7} | "
                f"{shape:<24} | {t.offset:12} | {t.nbytes:12}"
            )
    total = sum(t.nbytes for t in r.tensors)
    print(f"* total: {len(r.tensors)} tensors, {total} bytes ({total / 2**20:.2f} MiB)")


def _json_str(s: str) -> str:
    # Bytes that are not UTF-8 (kept as surrogates by the reader) become \\xNN escapes.
    return s.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def _json_value(value: Any, max_items: int | None) -> Any:
    if isinstance(value, str):
        return _json_str(value)
    if isinstance(value, bool) or isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, list):
        shown = value if max_items is None else value[:max_items]
        return [_json_value(v, max_items) for v in shown]
    return str(value)


def _print_json(r: GGUFReader, show_tensors: bool, max_items: int | None) -> None:
    metadata = []
    for key, value in r.metadata.items():
        vtype = r.value_type(key)
        elem_type = r.array_type(key)
        metadata.append(
            {
                "key": _json_str(key),
                "type": vtype.name,
                "elem_type": elem_type.name if elem_type is not None else None,
                "count": len(value) if vtype == VT.ARRAY else 1,
                "value": _json_value(value, max_items),
            }
        )
    doc: dict[str, Any] = {
        "path": r.path,
        "version": r.version,
        "alignment": r.alignment,
        "data_offset": r.data_offset,
        "file_size": r.file_size,
        "n_kv": len(r.metadata),
        "n_tensors": len(r.tensors),
        "metadata": metadata,
        "total_bytes": sum(t.nbytes for t in r.tensors),
    }
    if show_tensors:
        doc["tensors"] = [
            {
                "index": t.index,
                "name": _json_str(t.name),
                "type": t.type.name,
                "shape": list(t.shape),
                "offset": t.offset,
                "nbytes": t.nbytes,
            }
            for t in r.tensors
        ]
    json.dump(doc, sys.stdout, indent=1)
    print()


def _error(message: str) -> None:
    one_line = message.replace("\r", "\\r").replace("\n", "\\n")
    print(f"picollama-gguf: error: {one_line}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="picollama-gguf", description=__doc__.split("\n")[0])
    parser.add_argument("model", help="GGUF file, or a built-in model name")
    parser.add_argument("--no-tensors", action="store_true", help="leave out the tensor table")
    parser.add_argument("--json", action="store_true", help="machine-readable JSON output")
    parser.add_argument(
        "--max-items",
        type=int,
        default=None,
        metavar="N",
        help=f"array items shown per array (default: {_TEXT_MAX_ITEMS} in text, all in JSON; "
        "-1: all)",
    )
    args = parser.parse_args(argv)
    max_items = args.max_items
    if max_items is None:
        max_items = None if args.json else _TEXT_MAX_ITEMS
    elif max_items < 0:
        max_items = None

    try:
        path = resolve_model_path(args.model)
        with GGUFReader(path) as reader:
            if args.json:
                _print_json(reader, not args.no_tensors, max_items)
            else:
                _print_text(reader, not args.no_tensors, max_items)
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader of our output went away (| head): stop quietly.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except GGUFError as err:
        _error(f"{args.model}: {err}")
        return 1
    except OSError as err:  # a missing file or built-in model, a directory, ...
        _error(str(err))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
