"""Make the tiny HF checkpoints of tests/data/convert/ and freeze transformers' answers.

Needs torch, transformers, tokenizers, sentencepiece and protobuf (CI does not: it only reads what
this wrote). Run from the repository root:

    python tests/gen_convert_fixtures.py

Each tests/data/convert/<name>/ holds a float32 safetensors checkpoint with random weights
(fixed seeds; norms and biases randomized too, so the +1 of Gemma's norms, the Q/K
permutation and the biases all matter), its tokenizer files, and:

- logits_<i>.npy: transformers' logits for prompt i (all positions, float32)
- refs.json: the prompts' ids, and the HF tokenizer's ids for each line of the corpus; for
  the architectures of tests/test_archs.py also transformers' 32 greedy tokens after each
  prompt and the HF tokenizer's ids of a rendered chat

Names on the command line regenerate only those fixtures (default: all).
"""

from __future__ import annotations

import io
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import sentencepiece as spm
import torch
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

OUT = Path(__file__).parent / "data" / "convert"

TRAIN_TEXT = """\
The quick brown fox jumps over the lazy dog. A tiny model reads tiny text.
Hello world! How are you today? I'm fine, thanks; we'll see what they've done.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 123 2024 3.14159 1,000,000.
Converting checkpoints to GGUF keeps the weights and the tokenizer together.
Llamas, Qwens and Gemmas all have attention, feed-forward layers and norms.
Café, naïve, résumé; 你好世界; Привет мир; emoji 🦙 and tabs\tand newlines.
def main():\n    return 0  # code has spaces, brackets [1, 2] and {braces}.
"""

# Lines the tokenizer tests compare on (unseen words, byte fallback, spaces, digits).
CORPUS = [
    "Hello world",
    " leading space and  double  spaces",
    "The quick brown fox jumps over the lazy dog.",
    "numbers 12345 and 3.14, dates 2024-01-02",
    "I'm sure they'll say we've won't",
    "Café naïve 你好 Привет 🦙🦙",
    "tabs\tand\nnewlines\n\n  indented",
    "def f(x):\n    return x * 2",
    "zebra quixotic xylophone",
]
PROMPTS = ["The quick brown fox", "Hello world! Numbers 42 and 3.14, you?"]
# A third prompt for the architectures with a sliding window: longer than their window (16)
LONG_PROMPT = (
    "Converting checkpoints to GGUF keeps the weights and the tokenizer together. Llamas, "
    "Qwens and Gemmas all have attention, feed-forward layers and norms; a tiny model reads "
    "tiny text."
)
N_GREEDY = 32
CHAT = [
    {"role": "user", "content": "Hello world! How are you today?"},
    {"role": "assistant", "content": "I'm fine, thanks."},
    {"role": "user", "content": "Numbers: 42 and 3.14"},
]

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

SMALL = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.2,
)


def train_spm(folder: Path, vocab_size: int, dummy_prefix: bool, **specials) -> None:
    """A tiny SentencePiece BPE with byte fallback; ``specials``: Gemma's ids and pieces."""
    specials = specials or dict(unk_id=0, bos_id=1, eos_id=2, pad_id=-1)
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TRAIN_TEXT.splitlines() * 4),
        model_writer=buf,
        vocab_size=vocab_size,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=0.995,
        add_dummy_prefix=dummy_prefix,
        remove_extra_whitespaces=False,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        num_threads=1,
        minloglevel=2,
        normalization_rule_name="identity",
        **specials,
    )
    (folder / "tokenizer.model").write_bytes(buf.getvalue())


def train_bpe(vocab_size: int, specials: list[str]) -> Tokenizer:
    split = (
        "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+"
        "[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
    )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TRAIN_TEXT.splitlines() * 4, trainer)
    return tok


def randomize_small_params(model: torch.nn.Module, seed: int) -> None:
    """Norm weights and biases start as constants; make them random so they are tested."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(torch.randn(p.shape, generator=gen) * 0.3)


def greedy(model, ids: list[int]) -> list[int]:
    """transformers' greedy continuation, N_GREEDY tokens, never stopping at an EOS.

    Fails when a step's top two logits are within 1e-4 of each other (relative to the
    largest |logit|): 100x the float32 logit error the engine shows on these models (~1e-6),
    a tie that could go either way under reordering would not be a fair test.
    """
    out = list(ids)
    with torch.no_grad():
        for _ in range(N_GREEDY):
            logits = model(torch.tensor([out])).logits[0, -1].double()
            top2 = torch.topk(logits, 2).values
            assert top2[0] - top2[1] > 1e-4 * logits.abs().max(), "near tie in greedy decoding"
            out.append(int(logits.argmax()))
    return out[len(ids) :]


def freeze(folder: Path, model, tokenizer, prompts=PROMPTS, extended: bool = False) -> None:
    """Logits and ids; ``extended``: also greedy continuations and a rendered chat's ids."""
    model.eval()
    refs = {"prompts": [], "corpus": []}
    for i, prompt in enumerate(prompts):
        ids = tokenizer(prompt)["input_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float().numpy()
        np.save(folder / f"logits_{i}.npy", logits.astype(np.float32))
        entry = {"text": prompt, "ids": ids}
        if extended:
            entry["greedy"] = greedy(model, ids)
        refs["prompts"].append(entry)
    for line in CORPUS:
        refs["corpus"].append(
            {
                "text": line,
                "ids": tokenizer(line)["input_ids"],
                "ids_no_special": tokenizer(line, add_special_tokens=False)["input_ids"],
            }
        )
    lines = [json.dumps(entry, ensure_ascii=False) for entry in refs["prompts"] + refs["corpus"]]
    n = len(refs["prompts"])
    text = '{\n"prompts": [\n' + ",\n".join(lines[:n]) + '\n],\n"corpus": [\n'
    text += ",\n".join(lines[n:]) + "\n]"
    if extended:
        # what apply_chat_template(tokenize=True) does: render, then encode without specials
        rendered = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
        ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
        chat = {"messages": CHAT, "text": rendered, "ids": ids}
        text += ',\n"chat": ' + json.dumps(chat, ensure_ascii=False)
    (folder / "refs.json").write_text(text + "\n}\n")


def save_tokenizer(tokenizer, folder: Path) -> None:
    """save_pretrained, minus the keys that record where the files were made."""
    tokenizer.save_pretrained(folder)
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    for key in ("vocab_file", "is_local", "local_files_only"):
        config.pop(key, None)
    path.write_text(json.dumps(config, ensure_ascii=False, indent=2) + "\n")


def fresh(name: str) -> Path:
    folder = OUT / name
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    return folder


def make_llama() -> None:
    """Llama with a SentencePiece tokenizer.model, untied output, GQA."""
    folder = fresh("llama")
    train_spm(folder, 400, dummy_prefix=True)
    tokenizer = transformers.LlamaTokenizer.from_pretrained(folder, add_bos_token=True)
    save_tokenizer(tokenizer, folder)
    config = transformers.LlamaConfig(
        vocab_size=400, rms_norm_eps=1e-5, tie_word_embeddings=False, **SMALL
    )
    torch.manual_seed(1)
    model = transformers.LlamaForCausalLM(config)
    randomize_small_params(model, 1)
    model.save_pretrained(folder)
    freeze(folder, model, transformers.AutoTokenizer.from_pretrained(folder))


def make_qwen(name: str, seed: int) -> None:
    """Qwen2 (q/k/v biases, untied, sharded weights) or Qwen3 (q/k norms, head_dim 16,
    tied embeddings), both with a byte-level BPE tokenizer.json and a chat template."""
    folder = fresh(name)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = train_bpe(300, specials)
    n_vocab = tok.get_vocab_size()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )
    save_tokenizer(fast, folder)
    if name == "qwen2":
        config = transformers.Qwen2Config(
            vocab_size=n_vocab + 4,  # padded, as real Qwen vocabularies are
            tie_word_embeddings=False,
            rms_norm_eps=1e-6,
            rope_theta=1_000_000.0,
            eos_token_id=fast.convert_tokens_to_ids("<|im_end|>"),
            **SMALL,
        )
        cls = transformers.Qwen2ForCausalLM
    else:
        config = transformers.Qwen3Config(
            vocab_size=n_vocab,
            head_dim=16,
            tie_word_embeddings=True,
            rms_norm_eps=1e-6,
            eos_token_id=fast.convert_tokens_to_ids("<|im_end|>"),
            **SMALL,
        )
        cls = transformers.Qwen3ForCausalLM
    torch.manual_seed(seed)
    model = cls(config)
    randomize_small_params(model, seed)
    model.save_pretrained(folder, max_shard_size="60KB" if name == "qwen2" else "50MB")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    freeze(folder, model, tokenizer, [*PROMPTS, LONG_PROMPT], extended=True)


def make_gemma3() -> None:
    """Gemma 3 text with a SentencePiece tokenizer.model (no dummy prefix), tied output."""
    folder = fresh("gemma3")
    train_spm(
        folder,
        400,
        dummy_prefix=False,
        pad_id=0,
        eos_id=1,
        bos_id=2,
        unk_id=3,
        pad_piece="<pad>",
        eos_piece="<eos>",
        bos_piece="<bos>",
        unk_piece="<unk>",
    )
    tokenizer = transformers.GemmaTokenizer.from_pretrained(folder, add_bos_token=True)
    save_tokenizer(tokenizer, folder)
    config = transformers.Gemma3TextConfig(
        vocab_size=400,
        head_dim=16,
        query_pre_attn_scalar=16,  # llama.cpp scales by 1/sqrt(head_dim)
        sliding_window=64,
        rms_norm_eps=1e-6,
        **SMALL,
    )
    torch.manual_seed(3)
    model = transformers.Gemma3ForCausalLM(config)
    randomize_small_params(model, 3)
    model.save_pretrained(folder)
    freeze(folder, model, transformers.AutoTokenizer.from_pretrained(folder))


MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}"
    "[INST] {{ m['content'] }} [/INST]{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}"
    "{% endfor %}"
)
PHI3_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>' + '\\n' + m['content'] + '<|end|>' }}"
    "{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' + '\\n' }}{% endif %}"
)
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' "
    "else m['role'] %}{{ '<start_of_turn>' + role + '\\n' + m['content'] | trim + "
    "'<end_of_turn>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}"
    "{% endif %}"
)
WINDOW = 16  # sliding window of the tiny Mistral, Phi-3 and Gemma 2: the long prompt exceeds it


def make_mistral() -> None:
    """Mistral (llama graph) with a sliding window, SentencePiece tokenizer, untied output."""
    folder = fresh("mistral")
    train_spm(folder, 400, dummy_prefix=True)
    tokenizer = transformers.LlamaTokenizer.from_pretrained(
        folder, add_bos_token=True, chat_template=MISTRAL_TEMPLATE
    )
    save_tokenizer(tokenizer, folder)
    config = transformers.MistralConfig(
        vocab_size=400,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        sliding_window=WINDOW,
        attn_implementation="eager",
        **SMALL,
    )
    torch.manual_seed(5)
    model = transformers.MistralForCausalLM(config)
    randomize_small_params(model, 5)
    model.save_pretrained(folder)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    freeze(folder, model, tokenizer, [*PROMPTS, LONG_PROMPT], extended=True)


def make_phi3() -> None:
    """Phi-3: fused qkv and gate_up, partial rotary (half of each head), a sliding window,
    SentencePiece tokenizer with Phi-3's added chat tokens, no BOS added."""
    folder = fresh("phi3")
    train_spm(folder, 400, dummy_prefix=True)
    tokenizer = transformers.LlamaTokenizer.from_pretrained(
        folder, add_bos_token=False, chat_template=PHI3_TEMPLATE
    )
    tokenizer.add_special_tokens(
        {
            "additional_special_tokens": [
                "<|endoftext|>",  # llama.cpp's tokenizer expects it in a model named Phi-3
                "<|assistant|>",
                "<|end|>",
                "<|user|>",
                "<|system|>",
            ]
        }
    )
    tokenizer.eos_token = "<|end|>"
    save_tokenizer(tokenizer, folder)
    # as Phi-3's own tokenizer_config.json says (transformers 5 no longer writes the flags)
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config.update(add_bos_token=False, add_eos_token=False)
    path.write_text(json.dumps(config, ensure_ascii=False, indent=2) + "\n")
    config = transformers.Phi3Config(
        vocab_size=len(tokenizer),
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        sliding_window=WINDOW,
        original_max_position_embeddings=SMALL["max_position_embeddings"],
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
        },
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|end|>"),
        attn_implementation="eager",
        **SMALL,
    )
    torch.manual_seed(8)
    model = transformers.Phi3ForCausalLM(config)
    randomize_small_params(model, 8)
    model.save_pretrained(folder)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    freeze(folder, model, tokenizer, [*PROMPTS, LONG_PROMPT], extended=True)


def make_phi3_longrope() -> None:
    """Phi-3 with LongRoPE (the 128k-context configuration, shrunk): short factors up to the
    original context of 32 positions, long factors past it, and the attention factor
    sqrt(1 + ln(4) / ln(32)) of a 4x longer context. transformers picks the long factors
    when a forward's sequence is longer than 32: the long prompt and its greedy steps."""
    folder = fresh("phi3_longrope")
    shutil.copy(OUT / "phi3" / "tokenizer.model", folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (OUT / "phi3" / name).is_file():
            shutil.copy(OUT / "phi3" / name, folder)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    config = transformers.Phi3Config(
        vocab_size=len(tokenizer),
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        **{**SMALL, "max_position_embeddings": 128},
        original_max_position_embeddings=32,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "original_max_position_embeddings": 32,
            "short_factor": [1.0, 1.2, 1.6, 2.5],
            "long_factor": [1.0, 2.0, 5.0, 12.0],
        },
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|end|>"),
        attn_implementation="eager",
    )
    torch.manual_seed(9)
    model = transformers.Phi3ForCausalLM(config)
    randomize_small_params(model, 9)
    model.save_pretrained(folder)
    freeze(folder, model, tokenizer, [*PROMPTS, LONG_PROMPT], extended=True)


def make_gemma2() -> None:
    """Gemma 2: attention and final logit softcapping (small caps, so they bite), alternating
    sliding window, sandwich norms, SentencePiece tokenizer with the turn tokens."""
    folder = fresh("gemma2")
    train_spm(
        folder,
        400,
        dummy_prefix=False,
        pad_id=0,
        eos_id=1,
        bos_id=2,
        unk_id=3,
        pad_piece="<pad>",
        eos_piece="<eos>",
        bos_piece="<bos>",
        unk_piece="<unk>",
        user_defined_symbols=["<start_of_turn>", "<end_of_turn>"],
    )
    tokenizer = transformers.GemmaTokenizer.from_pretrained(
        folder, add_bos_token=True, chat_template=GEMMA_TEMPLATE
    )
    save_tokenizer(tokenizer, folder)
    # Gemma's own tokenizer_config.json lists its turn tokens as special added tokens
    # (transformers 5 no longer writes added_tokens_decoder)
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["added_tokens_decoder"] = {
        str(tokenizer.convert_tokens_to_ids(text)): {"content": text, "special": True}
        for text in ("<start_of_turn>", "<end_of_turn>")
    }
    path.write_text(json.dumps(config, ensure_ascii=False, indent=2) + "\n")
    config = transformers.Gemma2Config(
        vocab_size=400,
        head_dim=16,
        query_pre_attn_scalar=16,  # llama.cpp scales by 1/sqrt(head_dim)
        sliding_window=WINDOW,
        attn_logit_softcapping=2.0,
        final_logit_softcapping=3.0,
        rms_norm_eps=1e-6,
        attn_implementation="eager",
        **SMALL,
    )
    torch.manual_seed(7)
    model = transformers.Gemma2ForCausalLM(config)
    randomize_small_params(model, 7)
    model.save_pretrained(folder)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    freeze(folder, model, tokenizer, [*PROMPTS, LONG_PROMPT], extended=True)


MAKERS = {
    "llama": make_llama,
    "qwen2": lambda: make_qwen("qwen2", 2),
    "qwen3": lambda: make_qwen("qwen3", 4),
    "gemma3": make_gemma3,
    "mistral": make_mistral,
    "phi3": make_phi3,
    "phi3_longrope": make_phi3_longrope,
    "gemma2": make_gemma2,
}


if __name__ == "__main__":
    torch.set_num_threads(1)
    for name in sys.argv[1:] or MAKERS:
        MAKERS[name]()
    total = sum(p.stat().st_size for p in OUT.rglob("*") if p.is_file())
    print(f"wrote {OUT} ({total // 1024} KiB)")
