"""The vocabulary of a GGUF file, read from its ``tokenizer.ggml.*`` metadata.

``Vocab.from_metadata`` follows llama.cpp's ``llama_vocab::impl::load`` step by step, so
that every derived fact comes out the same: the default special ids of each tokenizer
model, the flags each pre-tokenizer implies (BOS, space cleaning, ``ignore_merges``), the
token attributes (including the control bits llama.cpp forces on tokens whose *text* looks
like an end-of-turn or fill-in-the-middle marker) and the end-of-generation set.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import IntEnum, IntFlag
from typing import Any

import numpy as np

from picollama.gguf.constants import Keys
from picollama.tokenizer.errors import TokenizerError
from picollama.tokenizer.pretokenize import PreTokenizer, pre_tokenizer_for

__all__ = ["TokenType", "TokenAttr", "VocabType", "Vocab", "TOKEN_NULL"]

TOKEN_NULL = -1  # llama.cpp's LLAMA_TOKEN_NULL: "no such token"


class TokenType(IntEnum):
    """Values of ``tokenizer.ggml.token_type`` (llama.h ``llama_token_type``)."""

    UNDEFINED = 0
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


class TokenAttr(IntFlag):
    """Per-token attribute bits (llama.h ``llama_token_attr``)."""

    UNDEFINED = 0
    UNKNOWN = 1 << 0
    UNUSED = 1 << 1
    NORMAL = 1 << 2
    CONTROL = 1 << 3
    USER_DEFINED = 1 << 4
    BYTE = 1 << 5
    NORMALIZED = 1 << 6
    LSTRIP = 1 << 7
    RSTRIP = 1 << 8
    SINGLE_WORD = 1 << 9


_TYPE_TO_ATTR = {
    TokenType.UNDEFINED: TokenAttr.UNDEFINED,
    TokenType.NORMAL: TokenAttr.NORMAL,
    TokenType.UNKNOWN: TokenAttr.UNKNOWN,
    TokenType.CONTROL: TokenAttr.CONTROL,
    TokenType.USER_DEFINED: TokenAttr.USER_DEFINED,
    TokenType.UNUSED: TokenAttr.UNUSED,
    TokenType.BYTE: TokenAttr.BYTE,
}


class VocabType(IntEnum):
    """Tokenizer algorithm (llama.h ``llama_vocab_type``); we implement SPM and BPE."""

    NONE = 0
    SPM = 1
    BPE = 2
    WPM = 3
    UGM = 4
    RWKV = 5
    PLAMO2 = 6


class _K:
    """Tokenizer keys that ``picollama.gguf.constants.Keys`` does not name."""

    EOT_ID = "tokenizer.ggml.eot_token_id"
    EOM_ID = "tokenizer.ggml.eom_token_id"
    SEP_ID = "tokenizer.ggml.seperator_token_id"  # sic: llama.cpp's spelling
    MASK_ID = "tokenizer.ggml.mask_token_id"
    FIM_PRE_ID = "tokenizer.ggml.fim_pre_token_id"
    FIM_SUF_ID = "tokenizer.ggml.fim_suf_token_id"
    FIM_MID_ID = "tokenizer.ggml.fim_mid_token_id"
    FIM_PAD_ID = "tokenizer.ggml.fim_pad_token_id"
    FIM_REP_ID = "tokenizer.ggml.fim_rep_token_id"
    FIM_SEP_ID = "tokenizer.ggml.fim_sep_token_id"
    PREFIX_ID = "tokenizer.ggml.prefix_token_id"  # deprecated FIM spellings
    SUFFIX_ID = "tokenizer.ggml.suffix_token_id"
    MIDDLE_ID = "tokenizer.ggml.middle_token_id"
    ADD_SEP = "tokenizer.ggml.add_sep_token"
    LOWERCASE = "tokenizer.ggml.normalizer.lowercase"
    STRIP_ACCENTS = "tokenizer.ggml.normalizer.strip_accents"
    REMOVE_EXTRA_WS = "tokenizer.ggml.remove_extra_whitespaces"


# Tokenizer models we can run, and the special ids each starts from before the file's keys.
_MODEL_DEFAULTS: dict[str, tuple[VocabType, dict[str, int]]] = {
    "llama": (VocabType.SPM, {"bos": 1, "eos": 2, "unk": 0}),
    "gpt2": (VocabType.BPE, {"bos": 11, "eos": 11}),
    "gemma4": (VocabType.BPE, {}),
    "bert": (VocabType.WPM, {"bos": 101, "unk": 100, "sep": 102, "pad": 0, "mask": 103}),
}
# Known to llama.cpp but not implemented here: a clear error names them.
_UNSUPPORTED_MODELS = {
    "t5": "UGM",
    "rwkv": "RWKV",
    "plamo2": "PLaMo-2",
    "hybriddna": "HybridDNA BPE",
    "whitespace": "whitespace BPE",
    "no_vocab": "no vocabulary",
    "none": "no vocabulary",
}

# Special-token slots in llama.cpp's order; the deprecated FIM keys come last and win.
_SPECIAL_KEYS = (
    ("bos", Keys.TOKENIZER_BOS_ID),
    ("eos", Keys.TOKENIZER_EOS_ID),
    ("eot", _K.EOT_ID),
    ("eom", _K.EOM_ID),
    ("unk", Keys.TOKENIZER_UNK_ID),
    ("sep", _K.SEP_ID),
    ("pad", Keys.TOKENIZER_PAD_ID),
    ("mask", _K.MASK_ID),
    ("fim_pre", _K.FIM_PRE_ID),
    ("fim_suf", _K.FIM_SUF_ID),
    ("fim_mid", _K.FIM_MID_ID),
    ("fim_pad", _K.FIM_PAD_ID),
    ("fim_rep", _K.FIM_REP_ID),
    ("fim_sep", _K.FIM_SEP_ID),
    ("fim_pre", _K.PREFIX_ID),
    ("fim_suf", _K.SUFFIX_ID),
    ("fim_mid", _K.MIDDLE_ID),
)

# Token texts that llama.cpp recognizes when the file does not name the id (load(): "auto-
# detect special tokens by text"). Among several candidates the first in this order wins;
# llama.cpp takes whichever its hash map yields first (see ``Vocab`` notes).
_TEXT_CANDIDATES = {
    "eot": (
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "<|end_of_text|>",
        "<EOT>",
        "_<EOT>",
        "[EOT]",
        "<｜end▁of▁sentence｜>",
        "<end_of_utterance>",
    ),
    "eom": ("<|eom_id|>",),
    "fim_pre": (
        "<|fim_prefix|>",
        "<fim-prefix>",
        "<fim_prefix>",
        "<｜fim▁begin｜>",
        "<PRE>",
        "▁<PRE>",
        "<|code_prefix|>",
        "<|prefix|>",
    ),
    "fim_suf": (
        "<|fim_suffix|>",
        "<fim-suffix>",
        "<fim_suffix>",
        "<｜fim▁hole｜>",
        "<SUF>",
        "▁<SUF>",
        "<|code_suffix|>",
        "<|suffix|>",
    ),
    "fim_mid": (
        "<|fim_middle|>",
        "<fim-middle>",
        "<fim_middle>",
        "<｜fim▁end｜>",
        "<MID>",
        "▁<MID>",
        "<|code_middle|>",
        "<|middle|>",
    ),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}

# Token texts that end generation wherever they appear in a vocabulary.
_EOG_TEXTS = frozenset(
    (
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<|return|>",
        "<|call|>",
        "<|flush|>",
        "<|calls|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "</s>",
        "<|eom_id|>",
        "<EOT>",
        "_<EOT>",
        "[EOT]",
        "[EOS]",
        "<|end_of_text|>",
        "<end_of_utterance>",
        "<eos>",
        "<turn|>",
        "<|tool_response>",
        "<｜end▁of▁sentence｜>",
        "[e~[",
    )
)

# gpt-oss: tokens llama.cpp always renders as text (user-defined).
_ALWAYS_RENDERED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


@dataclass
class Vocab:
    """Tokens, scores, attributes, merges, special ids and flags of one vocabulary.

    Differences from llama.cpp that cannot matter for valid files, noted for honesty:
    where several tokens look like the same special (say both ``<|im_end|>`` and
    ``<|endoftext|>`` for EOT), llama.cpp's pick depends on ``std::unordered_map``
    iteration order and we take the first in its candidate list; special tokens of equal
    length are matched in id order (llama.cpp's ``std::sort`` is not stable).
    """

    model: str
    type: VocabType
    pre: PreTokenizer | None
    tokens: list[str]
    scores: list[float]
    attrs: list[int]
    token_to_id: dict[str, int]
    bpe_ranks: dict[tuple[str, str], int] = field(repr=False)
    special: dict[str, int]
    add_bos: bool
    add_eos: bool
    add_sep: bool
    add_space_prefix: bool
    remove_extra_whitespaces: bool
    escape_whitespaces: bool
    clean_spaces: bool
    ignore_merges: bool
    eog_ids: frozenset[int]
    special_tokens: tuple[int, ...]
    lowercase: bool = True  # WPM normalizer
    strip_accents: bool = True  # WPM normalizer

    # -- construction ----------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, reader: Any) -> Vocab:
        """The vocabulary of an open ``picollama.gguf.GGUFReader``."""
        return cls.from_metadata(reader.metadata)

    @classmethod
    def from_metadata(cls, md: Mapping[str, Any]) -> Vocab:
        """Build from GGUF metadata (``{key: value}`` as ``GGUFReader.metadata`` has it)."""
        model = _get_str(md, Keys.TOKENIZER_MODEL)
        if model is None:
            raise TokenizerError(f"no tokenizer in this file: {Keys.TOKENIZER_MODEL} is missing")
        if model in _UNSUPPORTED_MODELS:
            raise TokenizerError(
                f"{Keys.TOKENIZER_MODEL} = {model!r} ({_UNSUPPORTED_MODELS[model]}) is not "
                "supported: picollama implements 'llama' (SPM), 'gpt2' (BPE) and 'bert' (WPM)"
            )
        if model not in _MODEL_DEFAULTS:
            raise TokenizerError(f"unknown tokenizer model {Keys.TOKENIZER_MODEL} = {model!r}")
        vtype, defaults = _MODEL_DEFAULTS[model]
        special = {name: TOKEN_NULL for name, _ in _SPECIAL_KEYS}
        special.update(defaults)

        pre_name = _get_str(md, Keys.TOKENIZER_PRE)
        pre: PreTokenizer | None = None
        add_bos = add_eos = add_sep = False
        add_space_prefix = clean_spaces = ignore_merges = False
        escape_whitespaces = True
        if vtype == VocabType.BPE:
            if model == "gemma4":
                pre_name = "gemma4"
            # raises TokenizerError naming an unknown pre-tokenizer
            pre = pre_tokenizer_for(pre_name or "")
            escape_whitespaces = pre.escape_whitespaces
            clean_spaces = pre.clean_spaces
            ignore_merges = pre.ignore_merges
            add_bos = pre.add_bos
            add_sep = pre.add_sep
            if pre.no_bos:
                special["bos"] = TOKEN_NULL
        elif vtype == VocabType.SPM:
            add_space_prefix = True
            add_bos = True
        else:  # WPM
            clean_spaces = True
            add_bos = True
            add_sep = True
        add_space_prefix = _get_bool(md, Keys.TOKENIZER_ADD_SPACE_PREFIX, add_space_prefix)
        remove_extra_ws = _get_bool(md, _K.REMOVE_EXTRA_WS, False)
        lowercase = _get_bool(md, _K.LOWERCASE, True)
        strip_accents = _get_bool(md, _K.STRIP_ACCENTS, lowercase)

        tokens = _get_tokens(md)
        n_tokens = len(tokens)
        scores = _get_numeric_array(md, Keys.TOKENIZER_SCORES, n_tokens, float)
        types = _get_numeric_array(md, Keys.TOKENIZER_TOKEN_TYPE, n_tokens, int)

        token_to_id: dict[str, int] = {}
        for i, text in enumerate(tokens):
            if not text:
                text = tokens[i] = f"[EMPTY_{i}]"
            if token_to_id.setdefault(text, i) != i:
                raise TokenizerError(
                    f"duplicate token in {Keys.TOKENIZER_TOKENS}: {text!r} has ids "
                    f"{token_to_id[text]} and {i}"
                )
        if types is None:
            attrs = [int(TokenAttr.NORMAL)] * n_tokens
        else:
            lut = {int(t): int(a) for t, a in _TYPE_TO_ATTR.items()}
            attrs = [lut.get(t, 0) for t in types]
        if scores is None:
            scores = [0.0] * n_tokens

        bpe_ranks: dict[tuple[str, str], int] = {}
        if vtype == VocabType.BPE:
            bpe_ranks = _get_merges(md)

        vocab = cls(
            model=model,
            type=vtype,
            pre=pre,
            tokens=tokens,
            scores=scores,
            attrs=attrs,
            token_to_id=token_to_id,
            bpe_ranks=bpe_ranks,
            special=special,
            add_bos=add_bos,
            add_eos=add_eos,
            add_sep=add_sep,
            add_space_prefix=add_space_prefix,
            remove_extra_whitespaces=remove_extra_ws,
            escape_whitespaces=escape_whitespaces,
            clean_spaces=clean_spaces,
            ignore_merges=ignore_merges,
            eog_ids=frozenset(),
            special_tokens=(),
            lowercase=lowercase,
            strip_accents=strip_accents,
        )
        vocab._load_specials(md)
        return vocab

    def _load_specials(self, md: Mapping[str, Any]) -> None:
        n = len(self.tokens)
        special = self.special
        for name, key in _SPECIAL_KEYS:
            if special[name] >= n:  # a default past the vocabulary is disabled
                special[name] = TOKEN_NULL
            value = md.get(key)
            if value is None:
                continue
            if not _is_int(value):
                raise TokenizerError(f"{key} must be an integer, found {value!r}")
            if 0 <= int(value) < n:
                special[name] = int(value)
            # else: llama.cpp warns "bad special token" and keeps the default

        self.add_bos = _get_bool(md, Keys.TOKENIZER_ADD_BOS, self.add_bos)
        self.add_eos = _get_bool(md, Keys.TOKENIZER_ADD_EOS, self.add_eos)
        self.add_sep = _get_bool(md, _K.ADD_SEP, self.add_sep)
        if self.pre is not None and self.pre.force_bos:
            self.add_bos = True
        for flag, slot in (("add_bos", "bos"), ("add_eos", "eos"), ("add_sep", "sep")):
            if getattr(self, flag) and special[slot] == TOKEN_NULL:
                raise TokenizerError(
                    f"tokenizer.ggml.{flag}_token is true, but no {slot} id is set"
                )

        attrs = self.attrs
        control = int(TokenAttr.CONTROL)

        # Specials the file does not name, found by their text; their type becomes control.
        for name, texts in _TEXT_CANDIDATES.items():
            if special[name] != TOKEN_NULL:
                continue
            for text in texts:
                tid = self.token_to_id.get(text)
                if tid is not None:
                    special[name] = tid
                    attrs[tid] |= control
                    break

        # Control tokens whose text says "unused" are unused.
        for tid, text in enumerate(self.tokens):
            if attrs[tid] & control and "unused" in text:
                attrs[tid] |= int(TokenAttr.UNUSED)

        eog: set[int] = set()
        for name in ("fim_pad", "fim_rep", "fim_sep"):
            if special[name] != TOKEN_NULL:
                eog.add(special[name])
        for text in _EOG_TEXTS:
            tid = self.token_to_id.get(text)
            if tid is not None:
                eog.add(tid)
                attrs[tid] |= control
        for text in _ALWAYS_RENDERED:
            tid = self.token_to_id.get(text)
            if tid is not None:
                attrs[tid] = int(TokenAttr.USER_DEFINED)
        for name in ("eos", "eot", "eom"):
            if special[name] != TOKEN_NULL:
                eog.add(special[name])
        # o200k_harmony / solar-open: "<|end|>" is not an end of generation there.
        texts = {self.tokens[t] for t in eog}
        if "<|end|>" in texts and (
            {"<|return|>", "<|call|>"} <= texts or {"<|calls|>", "<|flush|>"} <= texts
        ):
            end = self.token_to_id["<|end|>"]
            eog.discard(end)
            attrs[end] = int(TokenAttr.USER_DEFINED)
        # gemma4 and plamo have a normal "</s>" (paddleocr's ends generation).
        if ("<|tool_response>" in texts or "<|plamo:eos|>" in texts) and "</s>" in texts:
            s = self.token_to_id["</s>"]
            eog.discard(s)
            attrs[s] = int(TokenAttr.NORMAL)
        self.eog_ids = frozenset(eog)

        # Tokens the partitioner looks for in raw text, longest first.
        matchable = int(TokenAttr.CONTROL | TokenAttr.USER_DEFINED | TokenAttr.UNKNOWN)
        ids = [tid for tid in range(n) if attrs[tid] & matchable]
        ids.sort(key=lambda tid: (-len(self.tokens[tid].encode("utf-8", "surrogateescape")), tid))
        self.special_tokens = tuple(ids)

        self._set_strip_attrs(md)

    def _set_strip_attrs(self, md: Mapping[str, Any]) -> None:
        """Per-model lstrip/rstrip flags that llama.cpp sets by name (load(), last block)."""
        name = (_get_str(md, Keys.GENERAL_NAME) or "").lower()
        pre = _get_str(md, Keys.TOKENIZER_PRE) or ""
        arch = _get_str(md, Keys.GENERAL_ARCHITECTURE) or ""
        lstrip, rstrip = int(TokenAttr.LSTRIP), int(TokenAttr.RSTRIP)
        attrs = self.attrs

        def set_attr(text: str, bit: int, on: bool) -> None:
            tid = self.token_to_id.get(text)
            if tid is None:
                raise TokenizerError(f"token {text!r} is missing from the vocabulary of {name!r}")
            attrs[tid] = attrs[tid] | bit if on else attrs[tid] & ~bit

        if any(s in pre for s in ("jina-v2-de", "jina-v2-es", "jina-v2-code")) or any(
            s in arch for s in ("nomic-bert-moe", "jina-bert-v3")
        ):
            if "<mask>" in self.token_to_id:
                set_attr("<mask>", lstrip, True)
        elif "phi-3" in name or "phi3" in name:
            for tid in self.special_tokens:
                attrs[tid] |= rstrip
            set_attr("</s>", rstrip, True)
            for text in ("<unk>", "<s>", "<|endoftext|>"):
                set_attr(text, rstrip, False)
        elif "modern-bert" in name and "[MASK]" in self.token_to_id:
            set_attr("[MASK]", lstrip, True)

    # -- queries ---------------------------------------------------------------------------

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    def text_to_token(self, text: str) -> int:
        return self.token_to_id.get(text, TOKEN_NULL)

    def byte_to_token(self, byte: int) -> int:
        """The token for one raw byte (SPM: ``<0xXX>``, else the byte itself as a token)."""
        tid = self.token_to_id.get(f"<0x{byte:02X}>")
        if tid is None:
            tid = self.token_to_id.get(bytes([byte]).decode("utf-8", "surrogateescape"))
        if tid is None:
            raise TokenizerError(f"the vocabulary has no token for byte 0x{byte:02X}")
        return tid

    def is_control(self, tid: int) -> bool:
        return bool(self.attrs[tid] & TokenAttr.CONTROL)

    def is_byte(self, tid: int) -> bool:
        return bool(self.attrs[tid] & TokenAttr.BYTE)


# -- metadata access -------------------------------------------------------------------------


def _get_str(md: Mapping[str, Any], key: str) -> str | None:
    value = md.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise TokenizerError(f"{key} must be a string, found {type(value).__name__}")
    return value


def _get_bool(md: Mapping[str, Any], key: str, default: bool) -> bool:
    value = md.get(key)
    if value is None:
        return default
    if not isinstance(value, (bool, np.bool_)):
        raise TokenizerError(f"{key} must be a bool, found {value!r}")
    return bool(value)


def _get_tokens(md: Mapping[str, Any]) -> list[str]:
    key = Keys.TOKENIZER_TOKENS
    tokens = md.get(key)
    if tokens is None:
        raise TokenizerError(f"cannot find the tokenizer vocabulary: {key} is missing")
    if not isinstance(tokens, (list, tuple)) or not all(isinstance(t, str) for t in tokens):
        raise TokenizerError(f"{key} must be an array of strings")
    if not tokens:
        raise TokenizerError(f"{key} is empty")
    return list(tokens)


def _get_numeric_array(md: Mapping[str, Any], key: str, n_tokens: int, kind: type) -> list | None:
    value = md.get(key)
    if value is None:
        return None
    arr = np.asarray(value)
    ok = arr.ndim == 1 and (
        np.issubdtype(arr.dtype, np.integer)
        or (kind is float and np.issubdtype(arr.dtype, np.floating))
    )
    if not ok:
        want = "a numeric array" if kind is float else "an integer array"
        raise TokenizerError(f"{key} must be {want}, found {arr.dtype} of shape {arr.shape}")
    if kind is float and arr.dtype not in (np.float32, np.int32):
        # llama.cpp reads INT32 or FLOAT32 scores only
        raise TokenizerError(f"{key} must be FLOAT32 or INT32, found {arr.dtype}")
    if kind is int and arr.dtype != np.int32:
        raise TokenizerError(f"{key} must be INT32, found {arr.dtype}")
    if len(arr) < n_tokens:
        raise TokenizerError(f"{key} has {len(arr)} entries for {n_tokens} tokens")
    if kind is float:
        return arr[:n_tokens].astype(np.float32).astype(np.float64).tolist()
    return arr[:n_tokens].tolist()


def _get_merges(md: Mapping[str, Any]) -> dict[tuple[str, str], int]:
    key = Keys.TOKENIZER_MERGES
    merges = md.get(key)
    if merges is None:
        raise TokenizerError(f"cannot find the tokenizer merges: {key} is missing")
    if not isinstance(merges, (list, tuple)):
        raise TokenizerError(f"{key} must be an array of strings")
    ranks: dict[tuple[str, str], int] = {}
    for rank, merge in enumerate(merges):
        if not isinstance(merge, str):
            raise TokenizerError(f"{key}[{rank}] must be a string")
        # split at the first space after the first character, as llama.cpp does
        pos = merge.find(" ", 1)
        pair = (merge[:pos], merge[pos + 1 :]) if pos >= 0 else ("", "")
        ranks.setdefault(pair, rank)
    return ranks
