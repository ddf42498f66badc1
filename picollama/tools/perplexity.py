"""picollama-perplexity: perplexity of a model on a text, computed as llama.cpp's tool does.

The text is tokenized once (with BOS if the model adds one) and cut into chunks of n_ctx
tokens; each chunk starts from an empty cache with its first token replaced by BOS, and the
second half of each chunk is scored (every token there has at least n_ctx/2 of context).
The final line matches llama-perplexity's: ``Final estimate: PPL = X +/- Y``.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass

import numpy as np

from picollama.tools.cli import add_model_args, backend_choice, note_gpu_layers

__all__ = ["main", "PerplexityResult", "perplexity"]


@dataclass
class PerplexityResult:
    ppl: float
    ppl_error: float
    n_chunks: int
    n_scored: int
    chunk_ppls: list[float]


def _nll_rows(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Negative log-likelihood of ``targets`` under each row of logits (float64 sums)."""
    z = logits.astype(np.float64)
    top = z.max(axis=1, keepdims=True)
    log_sum = np.log(np.exp(z - top).sum(axis=1)) + top[:, 0]
    return log_sum - z[np.arange(len(targets)), targets]


def perplexity(
    ctx, tokens: list[int], n_ctx: int, n_chunks: int = -1, score_batch: int = 128, progress=None
) -> PerplexityResult:
    """Perplexity over ``tokens`` in chunks of ``n_ctx`` (llama.cpp's method)."""
    if len(tokens) < 2 * n_ctx:
        raise ValueError(
            f"you need at least {2 * n_ctx} tokens to evaluate perplexity with a context of "
            f"{n_ctx} (the text has {len(tokens)})"
        )
    n_max = len(tokens) // n_ctx
    n_chunks = n_max if n_chunks is None or n_chunks < 0 else min(n_chunks, n_max)
    first = n_ctx // 2
    add_bos = ctx.tokenizer.add_bos
    nll = nll2 = 0.0
    count = 0
    chunk_ppls = []
    for i in range(n_chunks):
        chunk = list(tokens[i * n_ctx : (i + 1) * n_ctx])
        targets = np.array(chunk[first + 1 :], dtype=np.int64)
        if add_bos:
            chunk[0] = ctx.tokenizer.bos_id
        ctx.reset()
        # the unscored first half fills the cache; the scored half comes in small batches so
        # no more than score_batch rows of vocabulary-wide logits exist at once
        ctx.eval(chunk[:first])
        losses = []
        for s in range(first, n_ctx - 1, score_batch):
            e = min(s + score_batch, n_ctx - 1)
            logits = ctx.eval(chunk[s:e], all_logits=True)
            losses.append(_nll_rows(logits, targets[s - first : e - first]))
        losses = np.concatenate(losses)
        nll += float(losses.sum())
        nll2 += float((losses**2).sum())
        count += len(losses)
        chunk_ppls.append(math.exp(nll / count))
        if progress:
            progress(i, chunk_ppls[-1])
    mean = nll / count
    var = nll2 / count - mean * mean
    err = math.sqrt(var / (count - 1)) if var > 0 and count > 1 else 0.0
    ppl = math.exp(mean)
    return PerplexityResult(ppl, ppl * err, n_chunks, count, chunk_ppls)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="picollama-perplexity", description=__doc__.split("\n")[0])
    add_model_args(p)
    p.set_defaults(ctx_size=512)
    p.add_argument("-f", "--file", required=True, help="text file to score")
    p.add_argument("--chunks", type=int, default=-1, help="at most this many chunks (-1: all)")
    args = p.parse_args(argv)

    from picollama.errors import USER_ERRORS
    from picollama.generation import Context
    from picollama.lora import LoraSet
    from picollama.tools.cli import lora_specs

    try:
        with open(args.file, encoding="utf-8") as f:
            text = f.read()
        n_ctx = args.ctx_size
        if n_ctx <= 0:
            raise ValueError("-c must be positive for perplexity")
        ctx = Context(
            args.model,
            n_ctx=n_ctx,
            n_batch=args.batch_size,
            n_threads=args.threads,
            backend=backend_choice(args),
        )
        note_gpu_layers(args, ctx.model)
        adapters = lora_specs(args)
        if adapters:
            ctx.model = LoraSet(ctx.model, adapters).model_for()
        t0 = time.perf_counter()
        tokens = ctx.tokenizer.encode(text, parse_special=True)
        print(
            f"perplexity: tokenized {len(tokens)} tokens in "
            f"{(time.perf_counter() - t0) * 1000:.0f} ms",
            file=sys.stderr,
        )
        print(
            f"perplexity: calculating perplexity over {len(tokens) // n_ctx} chunks, n_ctx={n_ctx}",
            file=sys.stderr,
        )

        def progress(i, ppl):
            print(f"[{i + 1}]{ppl:.4f},", end="", flush=True)

        t0 = time.perf_counter()
        result = perplexity(ctx, tokens, n_ctx, args.chunks, progress=progress)
        print()
        print(
            f"perplexity: {time.perf_counter() - t0:.2f} seconds for {result.n_chunks} chunks",
            file=sys.stderr,
        )
        print(f"Final estimate: PPL = {result.ppl:.4f} +/- {result.ppl_error:.5f}")
        return 0
    except (ValueError, *USER_ERRORS) as err:
        print(f"picollama-perplexity: error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
