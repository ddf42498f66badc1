"""picollama-convert: a Hugging Face checkpoint folder to one GGUF file.

    picollama-convert HF_DIR [-o OUT.gguf] [--outtype f32|f16|bf16|q8_0|auto]
    picollama-convert --lora PEFT_DIR --base HF_DIR_OR_GGUF [-o ADAPTER.gguf] [--outtype f32]

The second form converts a PEFT LoRA adapter as llama.cpp's ``convert_lora_to_gguf.py`` does
(its ``--outtype`` defaults to f32 there too).

Flags follow llama.cpp's ``convert_hf_to_gguf.py`` (``--outfile`` is ``-o``). Errors are one
line on stderr and exit status 1; an interrupt exits with 130. Either way no file is left at
the output path.
"""

from __future__ import annotations

import argparse
import sys

PROG = "picollama-convert"


def build_parser() -> argparse.ArgumentParser:
    from picollama.convert import OUTTYPES

    p = argparse.ArgumentParser(
        prog=PROG,
        description="Convert a Hugging Face model folder (safetensors) to GGUF.",
    )
    p.add_argument(
        "model", metavar="HF_DIR", nargs="?", help="folder with config.json, weights, tokenizer"
    )
    p.add_argument(
        "--lora",
        metavar="PEFT_DIR",
        default=None,
        help="convert this PEFT LoRA adapter (adapter_config.json, adapter_model.safetensors)",
    )
    p.add_argument(
        "--base",
        metavar="HF_DIR_OR_GGUF",
        default=None,
        help="with --lora: the base model (its HF folder or its GGUF file)",
    )
    p.add_argument(
        "-o",
        "--outfile",
        metavar="OUT",
        help="output file or folder (default: HF_DIR/<name>-<TYPE>.gguf)",
    )
    p.add_argument(
        "--outtype",
        choices=OUTTYPES,
        default=None,
        help="tensor type of the matrices (default: auto: bf16 for a bf16 checkpoint, else "
        "f16; with --lora: f32); 1-D tensors and norms stay f32",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error argparse already printed
        return int(exc.code or 0)

    from picollama.convert import ConvertError, convert_hf_to_gguf
    from picollama.convert.lora import convert_lora_to_gguf

    if (args.lora is None) == (args.model is None):
        print(f"{PROG}: error: give either HF_DIR or --lora PEFT_DIR", file=sys.stderr)
        return 2
    if args.lora is not None and args.base is None:
        print(f"{PROG}: error: --lora needs --base (the base model)", file=sys.stderr)
        return 2
    try:
        if args.lora is not None:
            out = convert_lora_to_gguf(
                args.lora, args.base, args.outfile, outtype=args.outtype or "f32"
            )
        else:
            out = convert_hf_to_gguf(
                args.model, args.outfile, outtype=args.outtype or "auto", progress=not args.quiet
            )
    except ConvertError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # a full disk, a folder we may not write to, ...
        print(
            f"{PROG}: error: {exc.strerror or exc}: {exc.filename or ''}".rstrip(": "),
            file=sys.stderr,
        )
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; nothing was written", file=sys.stderr)
        return 130
    print(f"{PROG}: wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
