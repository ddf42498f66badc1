"""Hugging Face checkpoints to GGUF: ``convert_hf_to_gguf`` (and ``picollama-convert``).

Needs the ``convert`` extra (safetensors, sentencepiece, tokenizers, ml_dtypes, tqdm); no
torch, no transformers, and no pickle: only safetensors weights are read.
"""

from picollama.convert.archs import ARCHS
from picollama.convert.errors import ConvertError
from picollama.convert.hf import OUTTYPES, convert_hf_to_gguf, default_output_path

__all__ = ["ARCHS", "ConvertError", "OUTTYPES", "convert_hf_to_gguf", "default_output_path"]
