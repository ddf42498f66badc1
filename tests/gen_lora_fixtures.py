"""Make two random PEFT LoRA adapters for tests/data/convert/llama and freeze their logits.

Needs torch, transformers and peft (CI does not: it only reads what this wrote). Run from the
repository root, after tests/gen_convert_fixtures.py made the llama checkpoint:

    python tests/gen_lora_fixtures.py

Writes tests/data/lora/:

- a1/, a2/: PEFT adapter folders (adapter_config.json, adapter_model.safetensors).
  a1: rank 4, alpha 8, on all seven projections. a2: rank 8, alpha 4 with rsLoRA (scale
  alpha / sqrt(r)), on q_proj, v_proj and down_proj only. Random A and B (PEFT starts B at
  zero, which would make the adapters do nothing), of a size that moves the logits by O(1).
- logits.npz: transformers + peft logits (float32, every position of prompt 0 of the llama
  fixture) for: "base" (no adapter), "a1" (a1 at scale 1), "a1_half" (a1 at scale 0.5),
  "a2", and "both" (a1 and a2 active together).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
import transformers
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer

BASE = Path(__file__).parent / "data" / "convert" / "llama"
OUT = Path(__file__).parent / "data" / "lora"

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {
    "a1": dict(r=4, lora_alpha=8, target_modules=ALL, seed=1),
    "a2": dict(
        r=8, lora_alpha=4, use_rslora=True, target_modules=["q_proj", "v_proj", "down_proj"], seed=2
    ),
}


def base_model():
    return transformers.AutoModelForCausalLM.from_pretrained(BASE, dtype=torch.float32).eval()


def make_adapter(name: str, spec: dict) -> None:
    spec = dict(spec)
    seed = spec.pop("seed")
    model = get_peft_model(base_model(), LoraConfig(task_type="CAUSAL_LM", **spec))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "lora_A" in pname or "lora_B" in pname:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    folder = OUT / name
    shutil.rmtree(folder, ignore_errors=True)
    model.save_pretrained(folder)
    config_path = folder / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config["base_model_name_or_path"] = "tests/data/convert/llama"  # not this machine's path
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    readme = folder / "README.md"
    if readme.exists():
        readme.unlink()


def logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    for name, spec in ADAPTERS.items():
        make_adapter(name, spec)
    ids = json.loads((BASE / "refs.json").read_text())["prompts"][0]["ids"]
    out = {"ids": np.array(ids, np.int64), "base": logits(base_model(), ids)}

    model = PeftModel.from_pretrained(base_model(), OUT / "a1", adapter_name="a1").eval()
    model.load_adapter(OUT / "a2", adapter_name="a2")
    model.set_adapter("a1")
    out["a1"] = logits(model, ids)
    model.set_adapter("a2")
    out["a2"] = logits(model, ids)
    # both at once: every LoRA layer sums the active adapters' terms
    model.base_model.set_adapter(["a1", "a2"])
    out["both"] = logits(model, ids)
    model.base_model.set_adapter("a1")
    for module in model.modules():
        if isinstance(module, LoraLayer) and "a1" in module.scaling:
            module.scaling["a1"] *= 0.5
    out["a1_half"] = logits(model, ids)
    np.savez(OUT / "logits.npz", **out)
    for key, value in out.items():
        if key != "ids":
            print(key, value.shape, float(np.abs(value - out["base"]).max()))


if __name__ == "__main__":
    main()
