"""Freeze transformers' teacher-forced predictions on the built-in models.

    python tests/data/runtime/gen_transformers_refs.py LLAMA_CPP_BIN_DIR

transformers loads each GGUF file itself (``gguf_file=``: it dequantizes the weights to
float32 and runs its PyTorch forward), so it is an implementation independent of ours and
of llama.cpp. The token ids of the text come from llama.cpp's tokenizer (llama-tokenize),
so all three engines see the same input. Writes transformers_refs.json: for 512 tokens,
the argmax next token at each position and the gap between its top-2 logits.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from picollama.models.registry import resolve_model_path  # noqa: E402

HERE = Path(__file__).resolve().parent
N_TOKENS = 512


def llama_tokenize(bin_dir: Path, model: Path, text_file: Path) -> list[int]:
    out = subprocess.run(
        [
            str(bin_dir / "llama-tokenize"),
            "-m",
            str(model),
            "-f",
            str(text_file),
            "--ids",
            "--log-disable",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    bin_dir = Path(sys.argv[1])
    refs = {}
    for name in ("smollm2-135m-instruct-q4_1", "gemma3-270m-q4_k_m"):
        path = resolve_model_path(name)
        ids = llama_tokenize(bin_dir, path, HERE / "python-license.txt")[:N_TOKENS]
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, torch_dtype=torch.float32
        )
        model.eval()
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].numpy()
        top2 = np.sort(logits, axis=1)[:, -2:]
        refs[name] = {
            "ids": ids,
            "argmax": logits.argmax(axis=1).tolist(),
            "top2_gap": (top2[:, 1] - top2[:, 0]).round(5).tolist(),
        }
        agree = np.mean(np.array(ids[1:]) == logits.argmax(axis=1)[:-1])
        print(name, len(ids), f"transformers top-1 matches the text at {agree:.1%}")
    (HERE / "transformers_refs.json").write_text(json.dumps(refs))


if __name__ == "__main__":
    main()
