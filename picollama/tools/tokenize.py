"""picollama-tokenize: print the tokens of a prompt, like llama.cpp's llama-tokenize.

    picollama-tokenize -m MODEL -p TEXT [--ids] [--no-bos] [--no-parse-special]
    picollama-tokenize -m MODEL -f FILE | --stdin ...

``MODEL`` is a GGUF path or a built-in model name. As llama-tokenize does, escape sequences
in the prompt (``\\n``, ``\\t``, ``\\xHH``, ...) are processed unless ``--no-escape`` is
given, BOS is added where the file asks for it unless ``--no-bos``, and special tokens
written as text are parsed unless ``--no-parse-special``. The output is one
``%6d -> 'piece'`` line per token, or with ``--ids`` a list ``[1, 2, 3]``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["main", "process_escapes"]

PROG = "picollama-tokenize"

_SIMPLE_ESCAPES = {
    ord("n"): b"\n",
    ord("r"): b"\r",
    ord("t"): b"\t",
    ord("'"): b"'",
    ord('"'): b'"',
    ord("\\"): b"\\",
}
_HEX = b"0123456789abcdefABCDEF"


def process_escapes(data: bytes) -> bytes:
    """llama.cpp's ``string_process_escapes`` on raw bytes.

    ``\\n \\r \\t \\' \\" \\\\`` and ``\\xHH`` (two hex digits) become their byte; any other
    backslash pair is kept as it is.
    """
    out = bytearray()
    i = 0
    n = len(data)
    while i < n:
        c = data[i]
        if c == 0x5C and i + 1 < n:
            e = data[i + 1]
            if e in _SIMPLE_ESCAPES:
                out += _SIMPLE_ESCAPES[e]
                i += 2
                continue
            if e == ord("x") and i + 3 < n and data[i + 2] in _HEX and data[i + 3] in _HEX:
                out.append(int(data[i + 2 : i + 4], 16))
                i += 4
                continue
            out += data[i : i + 2]
            i += 2
            continue
        out.append(c)
        i += 1
    return bytes(out)


class _ArgError(Exception):
    pass


class _ArgumentParser(argparse.ArgumentParser):
    """argparse that raises instead of printing usage and exiting with status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise _ArgError(message)


def _parser() -> argparse.ArgumentParser:
    ap = _ArgumentParser(prog=PROG, description=(__doc__ or "").splitlines()[0])
    ap.add_argument("-m", "--model", required=True, help="GGUF file or built-in model name")
    source = ap.add_mutually_exclusive_group(required=True)
    source.add_argument("-p", "--prompt", help="text to tokenize")
    source.add_argument("-f", "--file", help="read the text from this file")
    source.add_argument("--stdin", action="store_true", help="read the text from stdin")
    ap.add_argument("--ids", action="store_true", help="print only the ids, as [1, 2, 3]")
    ap.add_argument("--no-bos", action="store_true", help="do not add a BOS token")
    ap.add_argument("--no-escape", action="store_true", help="do not process \\n, \\t, ...")
    ap.add_argument(
        "--no-parse-special", action="store_true", help="treat special tokens as plain text"
    )
    ap.add_argument("--show-count", action="store_true", help="print the number of tokens")
    ap.add_argument("--log-disable", action="store_true", help="accepted for compatibility")
    return ap


def _read_text(args: argparse.Namespace) -> bytes:
    if args.prompt is not None:
        return args.prompt.encode("utf-8", "surrogateescape")
    if args.file is not None:
        try:
            return Path(args.file).read_bytes()
        except OSError as exc:
            raise _ArgError(f"cannot read {args.file}: {exc.strerror}") from None
    return sys.stdin.buffer.read()


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
        text = _read_text(args)
    except _ArgError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    except SystemExit as exc:  # --help
        return int(exc.code or 0)

    from picollama.gguf import GGUFError, GGUFReader
    from picollama.models.registry import ModelNotFoundError, resolve_model_path
    from picollama.tokenizer import Tokenizer, TokenizerError

    try:
        path = resolve_model_path(args.model)
        with GGUFReader(path) as reader:
            tokenizer = Tokenizer.from_gguf(reader)
        if not args.no_escape:
            text = process_escapes(text)
        add_bos = tokenizer.add_bos and not args.no_bos
        ids = tokenizer.encode(
            text, add_bos=None if add_bos else False, parse_special=not args.no_parse_special
        )
        out = sys.stdout.buffer
        if args.ids:
            out.write(("[" + ", ".join(map(str, ids)) + "]\n").encode())
        else:
            for tid in ids:
                out.write(f"{tid:6d} -> '".encode() + tokenizer.token_to_piece(tid) + b"'\n")
        if args.show_count:
            out.write(f"Total number of tokens: {len(ids)}\n".encode())
        out.flush()
    except (ModelNotFoundError, GGUFError, TokenizerError, OSError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
