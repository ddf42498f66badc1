"""picollama-bench-dequant: time the numpy reference dequantizing every tensor of a model.

    picollama-bench-dequant [-m MODEL] [-r 3]

Prints per-type throughput (weights/s and GB/s of quantized bytes) and the median wall time
of a whole-model pass over -r repetitions. This measures the readable reference in
picollama.quant, not the fused kernels the backends run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="picollama-bench-dequant", description=__doc__.split("\n")[0])
    p.add_argument(
        "-m",
        "--model",
        default="gemma3-270m-q4_k_m",
        help="GGUF file or built-in name (default: gemma3-270m-q4_k_m)",
    )
    p.add_argument("-r", "--repetitions", type=int, default=3)
    args = p.parse_args(argv)

    from picollama.gguf import GGUFError, GGUFReader
    from picollama.models.registry import ModelNotFoundError, resolve_model_path
    from picollama.quant import UnsupportedTypeError, dequantize

    try:
        reader = GGUFReader(resolve_model_path(args.model))
    except (GGUFError, ModelNotFoundError, OSError) as err:
        print(f"picollama-bench-dequant: error: {err}", file=sys.stderr)
        return 1
    with reader:
        per_type: dict[str, list[float]] = {}
        totals = []
        for _ in range(max(args.repetitions, 1)):
            t_all = time.perf_counter()
            for t in reader.tensors:
                t0 = time.perf_counter()
                try:
                    dequantize(t.data, t.type, what=t.name)
                except UnsupportedTypeError as err:
                    print(f"picollama-bench-dequant: error: {err}", file=sys.stderr)
                    return 1
                per_type.setdefault(t.type.name, []).append(time.perf_counter() - t0)
            totals.append(time.perf_counter() - t_all)
        reps = max(args.repetitions, 1)
        print(f"model: {reader.path}")
        print("| type | tensors | MB | seconds/pass | Mweights/s | GB/s |")
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
        for name in sorted(per_type):
            tensors = [t for t in reader.tensors if t.type.name == name]
            n_bytes = sum(t.nbytes for t in tensors)
            n_weights = sum(t.n_elements for t in tensors)
            secs = sum(per_type[name]) / reps
            print(
                f"| {name} | {len(tensors)} | {n_bytes / 1e6:.1f} | {secs:.3f} | "
                f"{n_weights / secs / 1e6:.0f} | {n_bytes / secs / 1e9:.2f} |"
            )
        total_bytes = sum(t.nbytes for t in reader.tensors)
        med = statistics.median(totals)
        print(
            f"\nall {len(reader.tensors)} tensors ({total_bytes / 1e6:.1f} MB): median "
            f"{med:.2f} s over {reps} passes (min {min(totals):.2f} s, max {max(totals):.2f} s)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
