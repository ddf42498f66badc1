"""BPE pre-tokenizers: how text is cut into words before merges, for each ``tokenizer.ggml.pre``.

llama.cpp maps each pre-tokenizer name to a type (``LLAMA_VOCAB_PRE_TYPE_*``) and each type
to a list of regular expressions. The expressions are applied in turn: each one splits
every piece that the previous ones left, and the text between its matches stays a piece of
its own. The patterns below are llama.cpp's own, written as the same C string literals.

To match llama.cpp exactly, patterns are not run with a Unicode-aware engine. llama.cpp
runs ``std::regex`` over a *collapsed* text in which each non-ASCII codepoint is one byte
naming its class (``unicode.collapse``) and rewrites ``\\p{L}``, ``\\p{N}``, ... into classes
of those bytes; patterns without categories run on codepoints, with non-ASCII whitespace
turned into ``\\v``. We build the same texts and the same rewritten patterns and run them
with Python's ``re`` in ASCII mode (C-locale ``\\s``, ``\\d``, ``\\w``). The hand-written
splitters llama.cpp uses for GPT-2 and Llama 3 give the same pieces as their patterns.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from picollama.tokenizer.errors import TokenizerError
from picollama.tokenizer.unicode import (
    COLLAPSED_CLASS,
    LETTER,
    MARK,
    NUMBER,
    PUNCTUATION,
    SYMBOL,
    category_flag,
    collapse,
    is_han,
    is_whitespace,
    widen,
)

__all__ = ["PreTokenizer", "PRE_TYPE_PATTERNS", "PRE_TOKENIZERS", "pre_tokenizer_for"]

_CONTRACTIONS = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)"
_LLAMA3 = (
    _CONTRACTIONS + "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
    "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
)
_QWEN2 = (
    _CONTRACTIONS + "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
    "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
)
_DEEPSEEK3_MAIN = (
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?"
    "[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"
)
_CJK_KANA = "[一-龥぀-ゟ゠-ヿ]+"
_GPT4O = (
    "[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))*((?=[\\p{L}])([^A-Z]))+" + _CONTRACTIONS + "?"
    "|[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))+((?=[\\p{L}])([^A-Z]))*" + _CONTRACTIONS + "?"
    "|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
)
_BLOOM = " ?[^(\\s|.,!?…。，、।۔،)]+"

# Regular expressions of each pre-tokenizer type (llama-vocab.cpp, ``llm_tokenizer_bpe``).
# Characters with a singleton canonical decomposition (U+1F7D, U+2126, U+212A, ...) are
# written as escapes: a Unicode-normalizing editor would silently change them. (llama.cpp's
# AFMoE range really starts at U+8C48, where U+F900 was meant: we match what it runs.)
PRE_TYPE_PATTERNS: dict[str, tuple[str, ...]] = {
    "default": (
        "[\\p{P}\\$\\+<=>\\^~\\|]+",
        _GPT2,
        "\\p{N}+",
        "[0-9][0-9][0-9]",
    ),
    "llama3": (_LLAMA3,),
    "jais2": (
        _CONTRACTIONS + "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
        "|\\s*[\\r\\n]+|\\s{512}(?!\\S)|\\s{256}(?!\\S)|\\s{128}(?!\\S)|\\s{64}(?!\\S)"
        "|\\s{32}(?!\\S)|\\s{16}(?!\\S)|\\s{8}(?!\\S)|\\s{4}(?!\\S)|\\s{1,2}(?!\\S)|\\s{1}",
    ),
    "dbrx": (_LLAMA3,),
    "smaug": (_LLAMA3,),
    "deepseek-llm": (
        "[\r\n]",
        "\\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-\u1f7dᾀ-ᾴᾶ-ᾼ\u1fbeῂ-ῄῆ-ῌῐ-\u1fd3ῖ-\u1fdbῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤ\u2126ℨ\u212a-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+",  # noqa: E501
        "\\s?[!-/:-~！-／：-～‘-‟　-。]+",
        "\\s+$",
        "[一-龥ࠀ-一가-퟿]+",
        "\\p{N}+",
    ),
    "deepseek3-llm": ("\\p{N}{1,3}", _CJK_KANA, _DEEPSEEK3_MAIN),
    "hunyuan-dense": ("\\p{N}{1,3}", _CJK_KANA, _DEEPSEEK3_MAIN),
    "joyai-llm": ("\\p{N}{1,3}", _CJK_KANA, _DEEPSEEK3_MAIN),
    "hy-v4": ("\\p{N}{1,3}", _CJK_KANA, _DEEPSEEK3_MAIN),
    "spark2_5": (
        "\\p{N}{1,3}",
        _CJK_KANA,
        "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?"
        "[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+|[\r\n]|\\s+(?!\\S)|\\s+",
        "\\p{N}",
    ),
    "youtu": (
        "[가-힣ㄱ-ㆎ]+|[！…“”‘’—：；，、-〿︰-﹏]+|[ㄅ-ㄯ]+|[一-龥぀-ゟ゠-ヿ]+",
        "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+"
        + _CONTRACTIONS
        + "?|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+"
        "[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*"
        + _CONTRACTIONS
        + "?|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    ),
    "deepseek-coder": (
        "[\r\n]",
        "\\s?\\p{L}+",
        "\\s?\\p{P}+",
        "[一-龥ࠀ-一가-퟿]+",
        "\\p{N}",
    ),
    "falcon": (
        "[\\p{P}\\$\\+<=>\\^~\\|`]+",
        _GPT2,
        "[0-9][0-9][0-9]",
    ),
    "starcoder": ("\\p{N}", _GPT2),
    "gpt2": (_GPT2,),
    "stablelm2": (_QWEN2,),
    "qwen2": (_QWEN2,),
    "qwen35": (
        _CONTRACTIONS + "|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}"
        "| ?[^\\s\\p{L}\\p{M}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    ),
    "poro": (_BLOOM,),
    "chatglm4": (_LLAMA3,),
    "viking": (_BLOOM, "\\p{N}"),
    "tekken": (
        "[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))*((?=[\\p{L}])([^A-Z]))+"
        "|[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))+((?=[\\p{L}])([^A-Z]))*"
        "|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    ),
    "chameleon": (
        "<sentinel:[0-9]+>",
        "(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
        "([\\t\\n]|    |  )",
        "\\p{N}",
        "[\\p{P}!-/:-@\\[-`{-~]",
        _GPT2,
    ),
    "gpt-4o": (_GPT4O,),
    "granite-emb-multi": (
        "[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}\\p{M}])([^a-z]))*((?=[\\p{L}\\p{M}])([^A-Z]))+"
        + _CONTRACTIONS
        + "?|[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}\\p{M}])([^a-z]))+((?=[\\p{L}\\p{M}])([^A-Z]))*"
        + _CONTRACTIONS
        + "?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    ),
    "tiny-aya": (
        "\\d{1,3}(?=(?:\\d{3})*\\b)",
        "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+"
        + _CONTRACTIONS
        + "?|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+"
        "[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*"
        + _CONTRACTIONS
        + "?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    ),
    "kimi-k2": ("\\p{Han}+",),
    "superbpe": ("\\p{N}+", "(?=(\\d{3})+(?!\\d))"),
    "bailingmoe": (
        "'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}"
        "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]|\\s+(?!\\S)|\\s+",
    ),
    "seed-coder": (
        _CONTRACTIONS + "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1}| ?[^\\s\\p{L}\\p{N}\\r\\n]+"
        "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    ),
    "ufakzeka": (
        "[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+"
        "|\\s+(?!\\S)|\\s+",
    ),
    "grok-2": (_QWEN2,),
    "afmoe": (
        "\\p{AFMoE_digits}",
        "[一-鿿㐀-䶿\u8c48-﫿぀-ゟ゠-ヿ･-ﾟ⼀-⿟เ-๿຀-໿ក-៿က-႟ꩠ-ꩿꧠ-꧿가-힯ᄀ-ᇿ]+",
        "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\\r\\n\\p{L}\\p{P}\\p{S}]?"
        "[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    ),
    "laguna": ("[^\\n]+|[\\n]+", _QWEN2),
    "exaone-moe": (
        _CONTRACTIONS + "|[^\\r\\n\\p{L}\\p{N}]?(?:\\p{L}\\p{M}*(?: \\p{L}\\p{M}*)*)+|\\p{N}"
        "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]?|\\s*[\\r\\n]|\\s+(?!\\S)|\\s+",
    ),
    "gemma4": ("[^\\n]+|[\\n]+",),
    "sarvam-moe": ("[^\\n]+|[\\n]+",),
    "minicpm5": (
        "\\p{N}{1,3}",
        _CONTRACTIONS + "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}+| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
        "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    ),
    "whitespace": ("\\S+",),
}
for _same, _as in (
    ("refact", "starcoder"),
    ("command-r", "starcoder"),
    ("smollm", "starcoder"),
    ("codeshell", "starcoder"),
    ("exaone", "starcoder"),
    ("minerva", "starcoder"),
    ("mellum2", "starcoder"),
    ("mpt", "gpt2"),
    ("olmo", "gpt2"),
    ("jais", "gpt2"),
    ("trillion", "gpt2"),
    ("granite-docling", "gpt2"),
    ("hunyuan", "qwen2"),
    ("solar-open", "qwen2"),
    ("bloom", "poro"),
    ("gpt3-finnish", "poro"),
    ("minimax-m2", "gpt-4o"),
):
    PRE_TYPE_PATTERNS[_same] = PRE_TYPE_PATTERNS[_as]

# Pre-tokenizer types whose BPE works on raw UTF-8 (SPM-style vocabularies), not on GPT-2's
# byte-to-character encoding.
_RAW_UTF8_TYPES = frozenset({"gemma4", "sarvam-moe", "whitespace"})


@dataclass(frozen=True)
class _Spec:
    """What a ``tokenizer.ggml.pre`` name implies besides its patterns (load(), BPE branch)."""

    type: str
    clean_spaces: bool = True
    ignore_merges: bool = False
    add_bos: bool = False  # default for tokenizer.ggml.add_bos_token
    force_bos: bool = False  # BOS even if the file says no (Gemma 4 workaround)
    add_sep: bool = False
    no_bos: bool = False  # no BOS id by default
    escape_whitespaces: bool = False


def _names(spec: _Spec, *names: str) -> dict[str, _Spec]:
    return dict.fromkeys(names, spec)


_KEEP_SPACES = {"clean_spaces": False}

# Every ``tokenizer.ggml.pre`` value that llama.cpp knows, with what it implies.
_PRE_NAMES: dict[str, _Spec] = {
    **_names(_Spec("default"), "default"),
    **_names(_Spec("minicpm5", ignore_merges=True), "minicpm5"),
    **_names(
        _Spec("llama3", ignore_merges=True, add_bos=True),
        "llama3",
        "llama-v3",
        "llama-bpe",
        "falcon3",
        "falcon-h1",
        "pixtral",
        "midm-2.0",
        "lfm2",
        "jina-v5-nano",
    ),
    **_names(_Spec("deepseek-llm", **_KEEP_SPACES), "deepseek-llm"),
    **_names(_Spec("deepseek-coder", **_KEEP_SPACES), "deepseek-coder"),
    **_names(_Spec("deepseek3-llm", **_KEEP_SPACES), "deepseek-v3"),
    **_names(_Spec("spark2_5", **_KEEP_SPACES), "spark2_5"),
    **_names(_Spec("youtu", clean_spaces=False, ignore_merges=True), "youtu"),
    **_names(_Spec("falcon"), "falcon"),
    **_names(_Spec("mpt"), "mpt"),
    **_names(_Spec("starcoder"), "starcoder"),
    **_names(
        _Spec("gpt2"),
        "gpt-2",
        "phi-2",
        "jina-es",
        "jina-de",
        "gigachat",
        "jina-v2-es",
        "jina-v2-de",
        "a.x-4.0",
        "mellum",
        "modern-bert",
        "exaone4",
    ),
    **_names(_Spec("jais2"), "jais-2"),
    **_names(
        _Spec("gemma4", force_bos=True, escape_whitespaces=True),
        "gemma4",
        "granite-embed-multi-311m",
    ),
    **_names(_Spec("sarvam-moe", clean_spaces=False, escape_whitespaces=True), "sarvam-moe"),
    **_names(_Spec("gpt2", add_sep=True), "jina-v1-en", "jina-v2-code", "roberta-bpe"),
    **_names(_Spec("whitespace"), "whitespace"),
    **_names(_Spec("refact"), "refact"),
    **_names(_Spec("command-r", **_KEEP_SPACES), "command-r"),
    **_names(_Spec("qwen2", **_KEEP_SPACES), "qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2"),
    **_names(_Spec("qwen35", **_KEEP_SPACES), "qwen35"),
    **_names(_Spec("stablelm2"), "stablelm2"),
    **_names(_Spec("olmo"), "olmo"),
    **_names(_Spec("dbrx"), "dbrx"),
    **_names(_Spec("smaug"), "smaug-bpe"),
    **_names(_Spec("poro", **_KEEP_SPACES), "poro-chat"),
    **_names(_Spec("chatglm4", no_bos=True), "chatglm-bpe"),
    **_names(_Spec("chatglm4", no_bos=True, ignore_merges=True), "glm4", "glm5"),
    **_names(_Spec("viking", **_KEEP_SPACES), "viking"),
    **_names(_Spec("jais"), "jais"),
    **_names(_Spec("tekken", clean_spaces=False, ignore_merges=True, add_bos=True), "tekken"),
    **_names(_Spec("smollm", **_KEEP_SPACES), "smollm"),
    **_names(_Spec("codeshell"), "codeshell"),
    **_names(_Spec("bloom"), "bloom"),
    **_names(_Spec("gpt3-finnish"), "gpt3-finnish"),
    **_names(_Spec("exaone"), "exaone"),
    **_names(_Spec("exaone-moe"), "exaone-moe"),
    **_names(_Spec("chameleon", clean_spaces=False, add_bos=True), "chameleon"),
    **_names(_Spec("minerva"), "minerva-7b"),
    **_names(_Spec("qwen2"), "megrez"),
    **_names(_Spec("gpt-4o", **_KEEP_SPACES), "gpt-4o", "llama4", "kanana2", "talkie"),
    **_names(
        _Spec("granite-emb-multi", clean_spaces=False, ignore_merges=True),
        "granite-embed-multi-97m",
    ),
    **_names(_Spec("tiny-aya", **_KEEP_SPACES), "tiny_aya", "cohere2moe"),
    **_names(_Spec("superbpe", **_KEEP_SPACES), "superbpe"),
    **_names(_Spec("trillion", **_KEEP_SPACES), "trillion"),
    **_names(_Spec("granite-docling", **_KEEP_SPACES), "granite-docling"),
    **_names(_Spec("bailingmoe", **_KEEP_SPACES), "bailingmoe", "bailingmoe2", "llada-moe"),
    **_names(_Spec("seed-coder", **_KEEP_SPACES), "seed-coder"),
    **_names(_Spec("hunyuan", **_KEEP_SPACES), "hunyuan"),
    **_names(_Spec("hunyuan-dense", **_KEEP_SPACES), "hunyuan-dense"),
    **_names(_Spec("hy-v4", **_KEEP_SPACES), "hy_v4"),
    **_names(_Spec("joyai-llm", **_KEEP_SPACES), "joyai-llm"),
    **_names(_Spec("kimi-k2", **_KEEP_SPACES), "kimi-k2"),
    **_names(_Spec("ufakzeka", **_KEEP_SPACES), "ufakzeka"),
    **_names(_Spec("grok-2", **_KEEP_SPACES), "grok-2"),
    **_names(_Spec("afmoe", **_KEEP_SPACES), "afmoe"),
    **_names(_Spec("laguna", **_KEEP_SPACES), "laguna"),
    **_names(_Spec("minimax-m2", **_KEEP_SPACES), "minimax-m2"),
    **_names(_Spec("solar-open", **_KEEP_SPACES), "solar-open"),
    **_names(_Spec("mellum2"), "mellum2"),
}

PRE_TOKENIZERS: tuple[str, ...] = tuple(sorted(_PRE_NAMES))


# -- the splitting engine -----------------------------------------------------------------

# Spans of codepoint offsets: (start, end).
_Spans = list[tuple[int, int]]

# llama.cpp's ``k_ucat_enum``: the categories it can rewrite, and the ASCII members of each.
_CATEGORY_NAMES = {
    "\\p{N}": NUMBER,
    "\\p{L}": LETTER,
    "\\p{P}": PUNCTUATION,
    "\\p{M}": MARK,
    "\\p{S}": SYMBOL,
    "\\p{Lu}": LETTER,
    "\\p{Ll}": LETTER,
    "\\p{Lt}": LETTER,
    "\\p{Lm}": LETTER,
    "\\p{Lo}": LETTER,
}
_ASCII_MEMBERS = {
    NUMBER: "0-9",
    LETTER: "A-Za-z",
    PUNCTUATION: "!-#%-*,-/:-;?-@\\[-\\]_\\{\\}",
    MARK: "",
    SYMBOL: "\\$\\+<->^`\\|",
}


def _uses_categories(pattern: str) -> bool:
    return any(name in pattern for name in _CATEGORY_NAMES)


def _rewrite_categories(pattern: str) -> str:
    """``\\p{X}`` to a class over the collapsed text, as llama.cpp's unicode_regex_split."""
    out: list[str] = []
    inside = False
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if c == "[" and (i == 0 or pattern[i - 1] != "\\"):
            out.append(c)
            inside = True
            i += 1
            continue
        if inside and c == "]" and pattern[i - 1] != "\\":
            out.append(c)
            inside = False
            i += 1
            continue
        if c == "\\" and i + 3 < len(pattern) and pattern[i + 1] == "p" and pattern[i + 2] == "{":
            close = pattern.find("}", i + 3)
            if close != -1 and close <= i + 10 and pattern[i : close + 1] in _CATEGORY_NAMES:
                flag = _CATEGORY_NAMES[pattern[i : close + 1]]
                members = COLLAPSED_CLASS[flag] + _ASCII_MEMBERS[flag]
                out.append(members if inside else f"[{members}]")
                i = close + 1
                continue
        out.append(c)
        i += 1
    return "".join(out)


def _ecmascript_to_python(pattern: str) -> str:
    """ECMAScript's ``$`` (end of input only) as Python's ``\\Z``; the rest means the same."""
    out: list[str] = []
    inside = False
    escaped = False
    for c in pattern:
        if escaped:
            escaped = False
        elif c == "\\":
            escaped = True
        elif c == "[" and not inside:
            inside = True
        elif c == "]" and inside:
            inside = False
        elif c == "$" and not inside:
            out.append("\\Z")
            continue
        out.append(c)
    return "".join(out)


@dataclass(frozen=True)
class _Step:
    """One pattern of a pre-tokenizer, ready to split spans."""

    source: str
    regex: re.Pattern[str] | None = None
    collapsed: bool = False  # run on ``collapse(text)``, else on ``widen(text)``
    custom: Callable[[str, _Spans], _Spans] | None = None


def _compile_step(pattern: str) -> _Step:
    custom = _CUSTOM_SPLITTERS.get(pattern)
    if custom is not None:
        return _Step(pattern, custom=custom)
    collapsed = _uses_categories(pattern)
    if collapsed:
        if any(ord(c) >= 128 for c in pattern):
            raise TokenizerError(
                f"pre-tokenizer pattern {pattern!r} mixes Unicode categories and non-ASCII "
                "characters, which llama.cpp does not support"
            )
        translated = _rewrite_categories(pattern)
    else:
        translated = pattern
    try:
        regex = re.compile(_ecmascript_to_python(translated), re.ASCII)
    except re.error as exc:
        raise TokenizerError(f"pre-tokenizer pattern {pattern!r} does not compile: {exc}") from exc
    return _Step(pattern, regex=regex, collapsed=collapsed)


def _split_by_regex(regex: re.Pattern[str], source: str, spans: _Spans) -> _Spans:
    """Cut each span at the matches of ``regex``; text between matches stays a span too."""
    out: _Spans = []
    append = out.append
    whole = len(spans) == 1 and spans[0] == (0, len(source))
    for start, end in spans:
        if end <= start:
            continue
        sub = source if whole else source[start:end]
        last = 0
        for m in regex.finditer(sub):
            s, e = m.span()
            if s > last:
                append((start + last, start + s))
            append((start + s, start + e))
            last = e
        if last < end - start:
            append((start + last, end))
    return out


@dataclass(frozen=True)
class PreTokenizer:
    """The pre-tokenizer of one ``tokenizer.ggml.pre`` name, with the flags it implies."""

    name: str
    type: str
    patterns: tuple[str, ...]
    byte_encode: bool
    clean_spaces: bool
    ignore_merges: bool
    add_bos: bool
    force_bos: bool
    add_sep: bool
    no_bos: bool
    escape_whitespaces: bool
    steps: tuple[_Step, ...] = field(repr=False, compare=False, default=())

    def split(self, text: str) -> list[str]:
        """The words of ``text``, in order; joined they give ``text`` back."""
        if not text:
            return []
        spans: _Spans = [(0, len(text))]
        collapsed_text = widened_text = None
        for step in self.steps:
            if step.custom is not None:
                spans = step.custom(text, spans)
            elif step.collapsed:
                if collapsed_text is None:
                    collapsed_text = collapse(text)
                spans = _split_by_regex(step.regex, collapsed_text, spans)
            else:
                if widened_text is None:
                    widened_text = widen(text)
                spans = _split_by_regex(step.regex, widened_text, spans)
        return [text[s:e] for s, e in spans if e > s]


def pre_tokenizer_for(name: str) -> PreTokenizer:
    """The pre-tokenizer llama.cpp uses for ``tokenizer.ggml.pre = name``.

    A missing name (``""``) falls back to ``default``, as llama.cpp does (with a warning
    there: such files tokenize worse than their original tokenizer). An unknown name is a
    ``TokenizerError`` naming it.
    """
    spec = _PRE_NAMES.get(name or "default")
    if spec is None:
        raise TokenizerError(
            f"unknown pre-tokenizer tokenizer.ggml.pre = {name!r}; llama.cpp knows "
            f"{len(PRE_TOKENIZERS)} names ({', '.join(PRE_TOKENIZERS[:8])}, ...)"
        )
    patterns = PRE_TYPE_PATTERNS[spec.type]
    return PreTokenizer(
        name=name,
        type=spec.type,
        patterns=patterns,
        byte_encode=spec.type not in _RAW_UTF8_TYPES,
        clean_spaces=spec.clean_spaces,
        ignore_merges=spec.ignore_merges,
        add_bos=spec.add_bos,
        force_bos=spec.force_bos,
        add_sep=spec.add_sep,
        no_bos=spec.no_bos,
        escape_whitespaces=spec.escape_whitespaces,
        steps=_compiled_steps(patterns),
    )


_STEP_CACHE: dict[tuple[str, ...], tuple[_Step, ...]] = {}


def _compiled_steps(patterns: Sequence[str]) -> tuple[_Step, ...]:
    key = tuple(patterns)
    steps = _STEP_CACHE.get(key)
    if steps is None:
        steps = _STEP_CACHE[key] = tuple(_compile_step(p) for p in patterns)
    return steps


# -- hand-written splitters (llama.cpp unicode.cpp) ---------------------------------------


def _is_letter(cp: int) -> bool:
    return category_flag(cp) == LETTER


def _is_number(cp: int) -> bool:
    return category_flag(cp) == NUMBER


_APOSTROPHE_SUFFIXES = ("s", "t", "m", "d")
_APOSTROPHE_SUFFIXES2 = ("re", "ve", "ll")


def _split_kimi_k2(text: str, spans: _Spans) -> _Spans:
    """Kimi-K2's pre-tokenizer (``unicode_regex_split_custom_kimi_k2``), Han runs apart."""
    cps = [ord(c) for c in text]
    out: _Spans = []
    for start, end in spans:

        def cp_at(pos: int, start: int = start, end: int = end) -> int:
            return cps[pos] if start <= pos < end else -1

        def letter(pos: int) -> bool:
            c = cp_at(pos)
            return c >= 0 and _is_letter(c)

        def kletter(pos: int) -> bool:  # a letter that is not Han
            c = cp_at(pos)
            return c >= 0 and _is_letter(c) and not is_han(c)

        def space(pos: int) -> bool:
            c = cp_at(pos)
            return c >= 0 and is_whitespace(c)

        def number(pos: int) -> bool:
            c = cp_at(pos)
            return c >= 0 and _is_number(c)

        prev = start

        def add(pos: int) -> None:
            nonlocal prev
            if pos > prev:
                out.append((prev, pos))
            prev = pos

        pos = start
        while pos < end:
            cp = cps[pos]
            if is_han(cp):
                while cp_at(pos) >= 0 and is_han(cp_at(pos)):
                    pos += 1
                add(pos)
                continue
            lead = not (cp in (0x0D, 0x0A) or letter(pos) or number(pos))
            if kletter(pos) or (lead and kletter(pos + 1)):
                if lead:
                    pos += 1
                while kletter(pos):
                    pos += 1
                if cp_at(pos) == 0x27 and pos + 1 < end:  # optional contraction
                    c1 = chr(cp_at(pos + 1)).lower()
                    if c1 in _APOSTROPHE_SUFFIXES:
                        pos += 2
                    elif pos + 2 < end and (c1 + chr(cp_at(pos + 2)).lower()) in (
                        _APOSTROPHE_SUFFIXES2
                    ):
                        pos += 3
                add(pos)
                continue
            if number(pos):
                ini = pos
                while number(pos):
                    pos += 1
                    if pos - ini >= 3:
                        add(pos)
                        ini = pos
                add(pos)
                continue
            p2 = pos + 1 if cp == 0x20 else pos
            if cp_at(p2) >= 0 and not (space(p2) or letter(p2) or number(p2)):
                pos = p2
                while cp_at(pos) >= 0 and not (space(pos) or letter(pos) or number(pos)):
                    pos += 1
                while cp_at(pos) in (0x0D, 0x0A):
                    pos += 1
                add(pos)
                continue
            n_ws = 0
            last_rn = 0
            while space(pos + n_ws):
                if cp_at(pos + n_ws) in (0x0D, 0x0A):
                    last_rn = pos + n_ws + 1
                n_ws += 1
            if last_rn > 0:
                pos = last_rn
            elif n_ws > 1 and cp_at(pos + n_ws) >= 0:
                pos += n_ws - 1
            elif n_ws > 0:
                pos += n_ws
            else:
                pos += 1
            add(pos)
    return out


def _split_afmoe_digits(text: str, spans: _Spans) -> _Spans:
    """AFMoE's digit grouping (``unicode_regex_split_custom_afmoe``).

    A digit run splits into its 1-2 leading digits, then threes; as in llama.cpp, the
    text before a run joins the run's first group (later patterns split it off again).
    """
    out: _Spans = []
    for start, end in spans:
        prev = start

        def add(pos: int) -> None:
            nonlocal prev
            if pos > prev:
                out.append((prev, pos))
            prev = pos

        pos = start
        while pos < end:
            if not _is_number(ord(text[pos])):
                pos += 1
                continue
            run_start = pos
            while pos < end and _is_number(ord(text[pos])):
                pos += 1
            cut = run_start + (pos - run_start) % 3
            if cut > run_start:
                add(cut)
            while cut < pos:
                cut += 3
                add(cut)
        add(end)
    return out


_CUSTOM_SPLITTERS: dict[str, Callable[[str, _Spans], _Spans]] = {
    "\\p{Han}+": _split_kimi_k2,
    "\\p{AFMoE_digits}": _split_afmoe_digits,
}
