"""The tokenizer of an HF checkpoint as GGUF ``tokenizer.*`` metadata, as llama.cpp writes it.

- ``tokenizer.model`` (SentencePiece, read with the ``sentencepiece`` package): tokenizer
  model ``llama``, pieces, scores and token types, then the added tokens of
  ``added_tokens.json`` and ``tokenizer_config.json`` on top (``_create_vocab_sentencepiece``).
- otherwise ``tokenizer.json`` (byte-level BPE): model ``gpt2``, tokens (padded with
  ``[PAD{i}]`` up to the config's vocab_size), token types, merges, and the pre-tokenizer
  name. llama.cpp names the pre-tokenizer by hashing the ids its tokenizer gives for a
  check text (``get_vocab_base_pre``); we compute the same hash with the ``tokenizers``
  package and look it up in the same table. Tokenizers that table does not know (a tiny
  test vocabulary, a new model) are named from their ``pre_tokenizer`` definition when it
  is one of a few well-known ones; anything else is an error, as in llama.cpp.
- special token ids, add_bos/add_eos and the chat template follow gguf-py's
  ``SpecialVocab``: tokenizer_config.json, tokenizer.json's post-processor, config.json.
"""

from __future__ import annotations

import json
from hashlib import sha256
from pathlib import Path
from typing import Any

import numpy as np

from picollama.convert.archs import Metadata
from picollama.convert.errors import ConvertError
from picollama.gguf.constants import GGUFValueType
from picollama.tokenizer.vocab import TokenType

__all__ = ["vocab_metadata", "CHECK_TEXT", "CHKHSH_PRE", "check_hash", "pre_from_definition"]

VT = GGUFValueType

# llama.cpp's check text (convert_hf_to_gguf.py, get_vocab_base_pre), verbatim.
CHECK_TEXT = (
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis "
    "concatenated) ✅ 🦙🦙 3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 "
    "កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ ------======= нещо на Български "
    "''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, 'RE you sure? 'M not "
    "sure I'll make it, 'D you like some tea? We'Ve a'lL"
)

# sha256 of str(ids of CHECK_TEXT) -> tokenizer.ggml.pre, from llama.cpp's table (the
# entries whose names picollama's pre-tokenizers implement).
CHKHSH_PRE: dict[str, str] = {
    "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": "llama-bpe",
    "049ecf7629871e3041641907f3de7c733e4dbfdc736f57d882ba0b0845599754": "deepseek-llm",
    "347715f544604f9118bb75ed199f68779f423cabb20db6de6f31b908d04d7821": "deepseek-coder",
    "8aeee3860c56296a157a1fe2fad249ec40aa59b1bb5709f4ade11c4e6fe652ed": "falcon",
    "9d032fcbd5501f4a38150912590928bfb36091efb5df11b8e2124b0390e3fb1e": "falcon3",
    "b6dc8df998e1cfbdc4eac8243701a65afe638679230920b50d6f17d81c098166": "olmo",
    "35d91631860c815f952d711435f48d356ebac988362536bed955d43bfa436e34": "starcoder",
    "3ce83efda5659b07b1ad37ca97ca5797ea4285d9b9ab0dc679e4a720c9da7454": "gpt-2",
    "0fe1cf6eda062318a1af7270f3331a85c539a01778ff948e24388e949c5282f4": "gpt-2",
    "32d85c31273f8019248f2559fed492d929ea28b17e51d81d3bb36fff23ca72b3": "stablelm2",
    "6221ad2852e85ce96f791f476e0b390cf9b474c9e3d1362f53a24a06dc8220ff": "refact",
    "9c2227e4dd922002fb81bde4fc02b0483ca4f12911410dee2255e4987644e3f8": "command-r",
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": "qwen2",
    "d4540891389ea895b53b399da6ac824becc30f2fba0e9ddbb98f92e55ca0e97c": "qwen2",
    "a8594e3edff7c29c003940395316294b2c623e09894deebbc65f33f1515df79e": "dbrx",
    "c136ed14d01c2745d4f60a9596ae66800e2b61fa45643e72436041855ad4089d": "smaug-bpe",
    "c7ea5862a53e4272c035c8238367063e2b270d51faa48c0f09e9d5b54746c360": "poro-chat",
    "7fc505bd3104ca1083b150b17d088b59534ede9bde81f0dd2090967d7fe52cee": "viking",
    "b53802fb28e26d645c3a310b34bfe07da813026ec7c7716883404d5e0f8b1901": "jais",
    "7b3e7548e4308f52a76e8229e4e6cc831195d0d1df43aed21ac6c93da05fec5f": "codeshell",
    "63b97e4253352e6f357cc59ea5b583e3a680eaeaf2632188c2b952de2588485e": "tekken",
    "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249": "smollm",
    "3c30d3ad1d6b64202cd222813e7736c2db6e1bd6d67197090fc1211fbc612ae7": "bloom",
    "bc01ce58980e1db43859146dc51b1758b3b88729b217a74792e9f8d43e479d21": "gpt3-finnish",
    "4e2b24cc4770243d65a2c9ec19770a72f08cffc161adbb73fcbb6b7dd45a0aae": "exaone",
    "fcace8b9cac38ce847670c970cd5892031a753a1ef381abd1d9af00f713da085": "phi-2",
    "60824e3c0d9401f89943cbb2fff727f0e2d4c545ba4df2d6e4f09a6db0f5b450": "chameleon",
    "877081d19cf6996e2c4ff0e1236341e9b7bde288f5311a56a937f0afbbb3aeb5": "deepseek-v3",
    "b3f499bb4255f8ca19fccd664443283318f2fd2414d5e0b040fbdd0cc195d6c5": "deepseek-r1-qwen",
    "ccc2ef013c104be7bae2965776d611e1d7a8a2a9c547dd93a682c9a9fc80352e": "gpt-4o",
    "7dec86086fcc38b66b7bc1575a160ae21cf705be7718b9d5598190d7c12db76f": "superbpe",
    "1994ffd01900cfb37395608534236ecd63f2bd5995d6cb1004dda1af50240f15": "trillion",
    "96a5f08be6259352137b512d4157e333e21df7edd3fcd152990608735a65b224": "bailingmoe",
    "d353350c764d8c3b39c763113960e4fb4919bea5fbf208a0e3b22e8469dc7406": "llama4",
    "0e9433cbbb161f89e264eb32e8e64bfe69e834973ffca5d41d3948a604a3e2a3": "pixtral",
    "d5f1dd6f980fec569fb218a81a7658ac45fc56b38c5a0adeb1c232fbe04ef5ec": "seed-coder",
    "a1e163ecab2e718a4c829d1148b6e86824ec36163bb71941c3dca9cd5ac25756": "mellum",
    "f4f37b6c8eb9ea29b3eac6bb8c8487c5ab7885f8d8022e67edc1c68ce8403e95": "minimax-m2",
    "7e57df22b1fe23a7b1e1c7f3dc4e3f96d43a4eb0836d0c6bdc3436d7b2f1c664": "hunyuan",
    "81212dc7cdb7e0c1074ca62c5aeab0d43c9f52b8a737be7b12a777c953027890": "kimi-k2",
    "66b8d4e19ab16c3bfd89bce5d785fb7e0155e8648708a1f42077cb9fe002c273": "grok-2",
    "d30d75d9059f1aa2c19359de71047b3ae408c70875e8a3ccf8c5fba56c9d8af4": "qwen35",
}

# tokenizer.json split patterns of well-known pre-tokenizers (HF spelling).
_QWEN2_SPLIT = (
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+"
    "[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
)
_LLAMA3_SPLIT = (
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+"
    "[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
)
# pre_tokenizer signature (see _signature) -> tokenizer.ggml.pre
_DEFINITION_PRE: dict[tuple, str] = {
    (("Split", _QWEN2_SPLIT), ("ByteLevel", False)): "qwen2",
    (("Split", _LLAMA3_SPLIT), ("ByteLevel", False)): "llama-bpe",
    (("ByteLevel", True),): "gpt-2",
    (("Digits", True), ("ByteLevel", True)): "smollm",
}

_SPECIAL_TYPES = ("bos", "eos", "unk", "sep", "pad", "cls", "mask")
_SPECIAL_ID_KEYS = {
    "bos": "tokenizer.ggml.bos_token_id",
    "eos": "tokenizer.ggml.eos_token_id",
    "unk": "tokenizer.ggml.unknown_token_id",
    "sep": "tokenizer.ggml.seperator_token_id",  # sic: llama.cpp's spelling
    "pad": "tokenizer.ggml.padding_token_id",
    "cls": "tokenizer.ggml.cls_token_id",
    "mask": "tokenizer.ggml.mask_token_id",
}


def _read_json(path: Path) -> Any:
    if not path.is_file():
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as exc:
        raise ConvertError(f"{path.name}: not valid JSON ({exc})") from None


def _looks_special(text: str) -> bool:
    """llama.cpp's does_token_look_special: added tokens that are control tokens in spirit."""
    return (
        text in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
        or (text.startswith("<|") and text.endswith("|>"))
        or (text.startswith("<｜") and text.endswith("｜>"))
        or (text.startswith("<unused") and text.endswith(">"))
    )


# -- BPE (tokenizer.json) ----------------------------------------------------------------


def check_hash(tokenizer_json: Path) -> str:
    """llama.cpp's chkhsh: sha256 of ``str(ids)`` of CHECK_TEXT, special tokens added."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ConvertError(
            "converting a tokenizer.json needs the tokenizers package: "
            "pip install 'picollama[convert]'"
        ) from None
    try:
        tok = Tokenizer.from_file(str(tokenizer_json))
    except Exception as exc:
        raise ConvertError(f"{tokenizer_json.name}: cannot be loaded ({exc})") from None
    ids = tok.encode(CHECK_TEXT, add_special_tokens=True).ids
    return sha256(str(ids).encode()).hexdigest()


def _signature(pre: Any) -> tuple:
    if not isinstance(pre, dict):
        return ()
    if pre.get("type") == "Sequence":
        return tuple(s for p in pre.get("pretokenizers", []) for s in _signature(p))
    kind = pre.get("type")
    if kind == "Split":
        pattern = pre.get("pattern", {})
        return (("Split", pattern.get("Regex", pattern.get("String"))),)
    if kind == "ByteLevel":
        return (("ByteLevel", bool(pre.get("use_regex", True))),)
    if kind == "Digits":
        return (("Digits", bool(pre.get("individual_digits", False))),)
    return ((kind,),)


def pre_from_definition(tokenizer: dict[str, Any]) -> str | None:
    """The pre-tokenizer name for a well-known tokenizer.json pre_tokenizer, else None."""
    return _DEFINITION_PRE.get(_signature(tokenizer.get("pre_tokenizer")))


def _bpe_metadata(folder: Path, config: dict[str, Any]) -> tuple[Metadata, int]:
    path = folder / "tokenizer.json"
    tokenizer = _read_json(path)
    model = tokenizer.get("model") if isinstance(tokenizer, dict) else None
    if not isinstance(model, dict) or model.get("type") != "BPE":
        kind = model.get("type") if isinstance(model, dict) else None
        raise ConvertError(f"tokenizer.json holds a {kind} model; only byte-level BPE converts")
    if model.get("byte_fallback"):
        raise ConvertError(
            "tokenizer.json is a SentencePiece-style BPE (byte_fallback) and there is no "
            "tokenizer.model to read it from"
        )
    vocab: dict[str, int] = dict(model.get("vocab", {}))
    added = {t["id"]: t for t in tokenizer.get("added_tokens", [])}
    for tid, t in added.items():
        vocab[t["content"]] = tid
    n_vocab = config.get("vocab_size", len(vocab))
    if vocab and max(vocab.values()) >= n_vocab:
        raise ConvertError(f"tokenizer has ids up to {max(vocab.values())}, vocab_size {n_vocab}")
    reverse = {tid: text for text, tid in vocab.items()}
    tokens: list[str] = []
    types: list[int] = []
    for i in range(n_vocab):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(TokenType.UNUSED)
            continue
        text = reverse[i]
        if i in added:
            if added[i].get("special") or _looks_special(text):
                types.append(TokenType.CONTROL)
            else:
                text = text.replace("\u2581", " ")  # pre-normalize user-defined spaces
                types.append(TokenType.USER_DEFINED)
        else:
            types.append(TokenType.NORMAL)
        tokens.append(text)

    chkhsh = check_hash(path)
    pre = CHKHSH_PRE.get(chkhsh) or pre_from_definition(tokenizer)
    if pre is None:
        raise ConvertError(
            f"the BPE pre-tokenizer of tokenizer.json is not recognized (llama.cpp's check "
            f"hash {chkhsh} is not in its table, and its pre_tokenizer is not a known one)"
        )
    merges = model.get("merges", [])
    if merges and not isinstance(merges[0], str):
        # transformers >= 4.45 writes pairs; GGUF wants "a b" with spaces as U+0120
        merges = [
            " ".join("".join("\u0120" if c == " " else c for c in part) for part in pair)
            for pair in merges
        ]
    md: Metadata = [
        ("tokenizer.ggml.model", "gpt2", VT.STRING),
        ("tokenizer.ggml.pre", pre, VT.STRING),
        ("tokenizer.ggml.tokens", tokens, VT.ARRAY),
        ("tokenizer.ggml.token_type", np.array(types, dtype=np.int32), VT.ARRAY),
    ]
    if merges:
        md.append(("tokenizer.ggml.merges", list(merges), VT.ARRAY))
    md += _special_metadata(folder, n_vocab=None)
    return md, n_vocab


# -- SentencePiece (tokenizer.model) -----------------------------------------------------


def _spm_vocab(folder: Path, config: dict[str, Any]) -> tuple[list[bytes], list[float], list[int]]:
    try:
        from sentencepiece import SentencePieceProcessor
    except ImportError:
        raise ConvertError(
            "converting a tokenizer.model needs the sentencepiece package: "
            "pip install 'picollama[convert]'"
        ) from None
    sp = SentencePieceProcessor()
    try:
        sp.LoadFromFile(str(folder / "tokenizer.model"))
    except Exception as exc:
        raise ConvertError(f"tokenizer.model: not a SentencePiece model ({exc})") from None
    n_vocab = config.get("vocab_size") or sp.vocab_size()
    tokens = [f"[PAD{i}]".encode() for i in range(n_vocab)]
    scores = [-10000.0] * n_vocab
    types = [int(TokenType.UNUSED)] * n_vocab
    for tid in range(min(sp.vocab_size(), n_vocab)):
        kind = TokenType.NORMAL
        if sp.IsUnknown(tid):
            kind = TokenType.UNKNOWN
        elif sp.IsControl(tid):
            kind = TokenType.CONTROL
        elif sp.IsUnused(tid):
            kind = TokenType.UNUSED
        elif sp.IsByte(tid):
            kind = TokenType.BYTE
        tokens[tid] = sp.IdToPiece(tid).encode("utf-8")
        scores[tid] = sp.GetScore(tid)
        types[tid] = int(kind)
    added = _read_json(folder / "added_tokens.json") or {}
    for text, tid in added.items():
        if 0 <= tid < n_vocab:
            tokens[tid] = text.encode("utf-8")
            scores[tid] = -1000.0
            types[tid] = int(TokenType.USER_DEFINED)
    # tokens added past the SentencePiece model (Phi-3's chat tokens), as llama.cpp's Phi-3
    # converter reads them from tokenizer.json; the model's own pieces stay as they are
    tokenizer_json = _read_json(folder / "tokenizer.json") or {}
    for data in tokenizer_json.get("added_tokens") or []:
        tid, text = data.get("id"), data.get("content")
        if not isinstance(tid, int) or not isinstance(text, str):
            continue
        if sp.vocab_size() <= tid < n_vocab:
            tokens[tid] = text.encode("utf-8")
            scores[tid] = -1000.0
            special = data.get("special")
            types[tid] = int(TokenType.CONTROL if special else TokenType.USER_DEFINED)
    tok_config = _read_json(folder / "tokenizer_config.json") or {}
    for key, data in (tok_config.get("added_tokens_decoder") or {}).items():
        tid, text = int(key), data["content"]
        if not 0 <= tid < n_vocab:
            continue
        if data.get("special") or _looks_special(text):
            types[tid] = int(TokenType.CONTROL)
        else:
            text = text.replace("\u2581", " ")
            types[tid] = int(TokenType.USER_DEFINED)
        scores[tid] = -1000.0
        tokens[tid] = text.encode("utf-8")
    return tokens, scores, types


def _spm_metadata(folder: Path, config: dict[str, Any]) -> tuple[Metadata, int]:
    tokens, scores, types = _spm_vocab(folder, config)
    md: Metadata = [
        ("tokenizer.ggml.model", "llama", VT.STRING),
        ("tokenizer.ggml.pre", "default", VT.STRING),
        ("tokenizer.ggml.tokens", tokens, VT.ARRAY),
        ("tokenizer.ggml.scores", np.array(scores, dtype=np.float32), VT.ARRAY),
        ("tokenizer.ggml.token_type", np.array(types, dtype=np.int32), VT.ARRAY),
    ]
    md += _special_metadata(folder, n_vocab=len(tokens))
    return md, len(tokens)


# -- special tokens and chat template (gguf-py's SpecialVocab) ----------------------------


def _token_content(entry: Any) -> str | None:
    if isinstance(entry, str):
        return entry
    if isinstance(entry, dict) and isinstance(entry.get("content"), str):
        return entry["content"]
    return None


def _special_metadata(folder: Path, n_vocab: int | None) -> Metadata:
    tokenizer = _read_json(folder / "tokenizer.json")
    tok_config = _read_json(folder / "tokenizer_config.json")
    config = _read_json(folder / "config.json") or {}
    ids: dict[str, int] = {}
    add: dict[str, bool] = {}

    def set_id(kind: str, tid: Any) -> None:
        if isinstance(tid, bool) or not isinstance(tid, int) or kind in ids:
            return
        if tid < 0:
            raise ConvertError(f"special token {kind} has the invalid id {tid}")
        if n_vocab is None or tid < n_vocab:
            ids[kind] = tid

    added_tokens = (tokenizer or {}).get("added_tokens", []) if tokenizer else []
    if tokenizer:
        bos = _token_content((tok_config or {}).get("bos_token"))
        eos = _token_content((tok_config or {}).get("eos_token"))
        post = tokenizer.get("post_processor") or {}
        for proc in post.get("processors", [post]):
            if proc.get("type") != "TemplateProcessing":
                continue
            single = proc.get("single", [])
            if len(single) > 1:
                first = single[0].get("SpecialToken", {}).get("id")
                last = single[-1].get("SpecialToken", {}).get("id")
                if first:
                    add["bos"] = first == (bos if tok_config else first)
                if last:
                    add["eos"] = last == (eos if tok_config else last)
    chat_template = None
    if tok_config:
        chat_template = tok_config.get("chat_template")
        if chat_template is None and (folder / "chat_template.jinja").is_file():
            chat_template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
        elif chat_template is None and (folder / "chat_template.json").is_file():
            chat_template = (_read_json(folder / "chat_template.json") or {}).get("chat_template")
        for kind in _SPECIAL_TYPES:
            flag = tok_config.get(f"add_{kind}_token")
            if isinstance(flag, bool):
                add[kind] = flag
            content = _token_content(tok_config.get(f"{kind}_token"))
            if content is None:
                continue
            tid = next((t.get("id") for t in added_tokens if t.get("content") == content), None)
            set_id(kind, tid)
    for kind in _SPECIAL_TYPES:
        set_id(kind, config.get(f"{kind}_token_id"))

    md: Metadata = [(_SPECIAL_ID_KEYS[kind], tid, VT.UINT32) for kind, tid in ids.items()]
    for kind, flag in add.items():
        if kind in ("bos", "eos", "sep"):
            md.append((f"tokenizer.ggml.add_{kind}_token", flag, VT.BOOL))
    if isinstance(chat_template, str):
        md.append(("tokenizer.chat_template", chat_template, VT.STRING))
    elif isinstance(chat_template, list):
        for entry in chat_template:
            name, text = entry.get("name"), entry.get("template")
            if not isinstance(name, str) or not isinstance(text, str):
                continue
            key = (
                "tokenizer.chat_template"
                if name == "default"
                else f"tokenizer.chat_template.{name}"
            )
            md.append((key, text, VT.STRING))
    return md


# -- entry point -------------------------------------------------------------------------


def vocab_metadata(folder: Path, config: dict[str, Any], gguf_arch: str) -> tuple[Metadata, int]:
    """The tokenizer.* metadata of the checkpoint in ``folder`` and its number of tokens."""
    tok_config = _read_json(folder / "tokenizer_config.json") or {}
    md: Metadata = []
    if gguf_arch == "llama" and isinstance(tok_config.get("add_prefix_space"), bool):
        md.append(("tokenizer.ggml.add_space_prefix", tok_config["add_prefix_space"], VT.BOOL))
    if (folder / "tokenizer.model").is_file():
        vocab_md, n_tokens = _spm_metadata(folder, config)
        md += vocab_md
        if gguf_arch in ("gemma2", "gemma3"):
            md.append(("tokenizer.ggml.add_space_prefix", False, VT.BOOL))
    elif (folder / "tokenizer.json").is_file():
        vocab_md, n_tokens = _bpe_metadata(folder, config)
        md += vocab_md
    else:
        raise ConvertError(f"{folder} has neither tokenizer.model nor tokenizer.json")
    return md, n_tokens
