"""Freeze llama.cpp's answers for the runtime tests: greedy tokens and perplexity.

    python tests/data/runtime/gen_llama_cpp_refs.py LLAMA_CPP_BIN_DIR

Runs llama.cpp's own server (greedy /completion with the generated token ids and the top-5
probabilities at each step) and llama-perplexity on both built-in models, and writes
tests/data/runtime/llama_cpp_refs.json. The tests read only that file.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from picollama.models.registry import resolve_model_path  # noqa: E402

HERE = Path(__file__).resolve().parent
PORT = 18431

PROMPTS = {
    "smollm2-135m-instruct-q4_1": [
        "The capital of France is",
        "def fibonacci(n):\n",
        "Once upon a time, in a small village,",
        "The three primary colors are",
        "<|im_start|>user\nWhat is the tallest mountain on Earth?<|im_end|>\n"
        "<|im_start|>assistant\n",
        "Water is made of hydrogen and",
    ],
    "gemma3-270m-q4_k_m": [
        "The capital of France is",
        "import numpy as np\n",
        "Once upon a time",
        "The quick brown fox",
        "Water boils at",
        "List of prime numbers: 2, 3, 5,",
    ],
}
N_PREDICT = 32
PPL_CTX = 512  # llama-perplexity's default context, the one the acceptance names
# 7 chunks of 512 for SmolLM2, 6 for Gemma 3: fewer chunks leave the estimate at the mercy
# of a few tokens (llama.cpp's own two attention paths differ by 0.5% on 2 chunks)
PPL_TEXT = "python-license.txt"


def _post(path: str, body: dict) -> dict:
    req = urllib.request.Request(
        f"http://127.0.0.1:{PORT}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=600) as resp:
        return json.loads(resp.read())


def greedy(bin_dir: Path, model: Path, prompts: list[str]) -> list[dict]:
    server = subprocess.Popen(
        [
            str(bin_dir / "llama-server"),
            "-m",
            str(model),
            "--port",
            str(PORT),
            "-c",
            "2048",
            "-np",
            "1",
            "-t",
            "2",
            "--host",
            "127.0.0.1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(300):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{PORT}/health", timeout=1)
                break
            except OSError:
                time.sleep(0.5)
        out = []
        for prompt in prompts:
            prompt_ids = _post(
                "/tokenize", {"content": prompt, "add_special": True, "parse_special": True}
            )["tokens"]
            r = _post(
                "/completion",
                {
                    "prompt": prompt,
                    "n_predict": N_PREDICT,
                    "temperature": 0.0,
                    "top_k": 1,
                    "return_tokens": True,
                    "n_probs": 5,
                    "cache_prompt": False,
                    "ignore_eos": False,
                },
            )
            # top-5 log-probabilities before sampling, to tell near-ties from real differences
            probs = [
                [[p["id"], p["logprob"]] for p in step["top_logprobs"]]
                for step in r.get("completion_probabilities", [])
            ]
            out.append(
                {
                    "prompt": prompt,
                    "prompt_ids": prompt_ids,
                    "tokens": r["tokens"],
                    "content": r["content"],
                    "top": probs,
                }
            )
        return out
    finally:
        server.terminate()
        server.wait()


def perplexity(bin_dir: Path, model: Path, text_file: Path) -> dict:
    proc = subprocess.run(
        [
            str(bin_dir / "llama-perplexity"),
            "-m",
            str(model),
            "-f",
            str(text_file),
            "-c",
            str(PPL_CTX),
            "-b",
            str(PPL_CTX),
            "-t",
            "2",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    m = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", proc.stdout + proc.stderr)
    return {
        "file": text_file.name,
        "n_ctx": PPL_CTX,
        "ppl": float(m.group(1)),
        "error": float(m.group(2)),
    }


def main() -> None:
    bin_dir = Path(sys.argv[1])
    os.environ.setdefault("LD_LIBRARY_PATH", str(bin_dir))
    refs = {}
    for name, prompts in PROMPTS.items():
        model = resolve_model_path(name)
        refs[name] = {
            "greedy": greedy(bin_dir, model, prompts),
            "perplexity": perplexity(bin_dir, model, HERE / PPL_TEXT),
        }
        print(name, refs[name]["perplexity"])
    (HERE / "llama_cpp_refs.json").write_text(json.dumps(refs, indent=1, ensure_ascii=False))


if __name__ == "__main__":
    main()
