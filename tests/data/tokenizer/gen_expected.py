"""Freeze llama.cpp's answers for the tokenizer tests (run by hand; tests only read the JSON).

    python tests/data/tokenizer/gen_expected.py LLAMA_CPP_BIN_DIR

For each built-in model (found through ``picollama.models.registry``) and each text of the
corpus below, runs ``llama-tokenize`` three ways (the file's BOS and specials parsed; no BOS;
no BOS and specials as text) and records the ids, plus the bytes of every token as
``llama-tokenize`` prints it. From ``llama-completion``'s load log it records the special
ids and the end-of-generation set, for the models and for the vocab fixtures in
``tests/data/vocab``. Writes ``expected_<model>.json`` and ``vocab_facts.json`` beside
this script. Texts go through files with ``--no-escape``, so they reach llama.cpp verbatim.

For chat templates it writes ``chat_expected.json``: each conversation of ``CONVERSATIONS``
rendered by ``transformers``' ``apply_chat_template`` (tokenizers loaded from the GGUF
files, which needs the ``transformers`` and ``gguf`` packages), by llama.cpp's own Jinja
engine (``llama-server --jinja``, ``/apply-template``) for SmolLM2, and by each of
llama.cpp's built-in formats (``llama-server --no-jinja --chat-template NAME``).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
sys.path.insert(0, str(REPO))

from picollama.models.registry import resolve_model_path  # noqa: E402
from picollama.tokenizer import BUILTIN_TEMPLATES  # noqa: E402

MODELS = ("smollm2-135m-instruct-q4_1", "gemma3-270m-q4_k_m")

VARIANTS = {
    "default": [],
    "no_bos": ["--no-bos"],
    "no_bos_no_special": ["--no-bos", "--no-parse-special"],
}

_CODE_PY = '''import os


def walk(root: str, *, depth: int = 0) -> list[str]:
    """List files under root."""
    out = []
    for name in sorted(os.listdir(root)):
\tpath = os.path.join(root, name)  # tab-indented on purpose
        if os.path.isdir(path) and depth < 3:
            out += walk(path, depth=depth + 1)
        elif name.endswith((".py", ".txt")):
            out.append(path)
    return out  # noqa: E501


if __name__ == "__main__":
    print(walk("."), file=sys.stderr)
'''

_CODE_C = """#include <stdio.h>
#define MAX(a, b) ((a) > (b) ? (a) : (b))

static int count_bits(unsigned long long x) {
    int n = 0;
    while (x) { n += x & 1u; x >>= 1; }
    return n;   /* popcount */
}

int main(int argc, char **argv) {
    for (int i = 0; i < argc; ++i) printf("%s -> %d\\n", argv[i], count_bits(i) != 0);
    return argc <= 1 ? -1 : 0;
}
"""

_ENGLISH = (
    "The quick brown fox jumps over the lazy dog. It's 3:45pm, isn't it? We'll see; "
    "they'd've known. I'M SURE YOU'LL LIKE IT, DON'T YOU? Mr. O'Neil's cat's toys.\n"
    'In 1969, Apollo 11 landed on the Moon: a "giant leap" (as Armstrong said) for all '
    "mankind -- and a hard-won success after years of work, testing & setbacks..."
)

# name -> text. Everything a tokenizer can trip on, and ordinary text too.
CORPUS: dict[str, str] = {
    "english": _ENGLISH,
    "contractions": "don't DON'T we've WE'VE 's 'S 't 'Re 'vE 'll 'LL 'd rock 'n' roll l'été",
    "code_python": _CODE_PY,
    "code_c": _CODE_C,
    "json": '{"name": "picollama", "ids": [1, 22, 333], "ok": true, "pi": 3.14159, '
    '"nested": {"x": null, "tab": "a\\tb", "quote": "\\"q\\""}}',
    "markdown": "# Title\n\n- item 1\n- item **2**\n\n```python\nprint('hi')\n```\n"
    "> quote\n\n| a | b |\n|---|---|\n| 1 | 2 |\n",
    "chinese": "我想在apple工作1314151天～ 你好，世界！这是一个测试。中文分词很难吗？",
    "japanese": "こんにちは、世界。カタカナとひらがな、漢字を使います。ｶﾀｶﾅ（半角）",
    "korean": "안녕하세요 세계! 한국어 텍스트입니다. 가나다라마바사",
    "emoji": "🚀 (normal) 😶‍🌫️ (zwj) 👨‍👩‍👧‍👦 family 🏳️‍🌈 ✅ 🦙.cpp 👍🏽 🇫🇷🇯🇵 🩷🫎 ❤️‍🔥",
    "arabic": "مرحبا بالعالم! هذا نص عربي ١٢٣٤٥ مع أرقام، وعلامات ترقيم؟",
    "hebrew": "שלום עולם, זה טקסט בעברית עם ניקוד: שָׁלוֹם וּבְרָכָה.",
    "bidi_mixed": "English مع العربية and עברית mixed: 123 ٤٥٦ (parens) «quotes».",
    "devanagari_thai": "नमस्ते दुनिया, यह हिंदी है। สวัสดีชาวโลก ภาษาไทย",
    "cyrillic_greek": "Привет, мир! Ελληνικά κείμενα: αβγδ ΑΒΓΔ. нещо на Български",
    "khmer": "កាន់តែពិសេសអាចខលចេញ",
    "whitespace_runs": "a  b   c    d\t\te\n\nf\n\n\ng     \n   \r\n h\u00a0i\u2003j\u3000k\u0085l",
    "unicode_spaces": "x\u2028y\u2029z\u1680w\u202fv\u205fu\u2000t\u200as \u00a0 \u3000",
    "leading_trailing": "   leading and trailing   ",
    "spaces_only": "        ",
    "newlines_only": "\n\n\n\n\n",
    "crlf": "line1\r\nline2\rline3\n \n  \n\t\n",
    "tabs": "\t\tindented\n\t\t\tmore\t\ttabs\t",
    "numbers": "0 1 12 123 1234 12345 123456 1234567 3.14159 -42 1e10 0x1F 1,000,000 "
    "007 2024-01-31 ١٢٣ ٣.١٤ Ⅻ ½ ² ①②③ ９８７",
    "math_symbols": "∑_{i=1}^{n} x² ≤ ∞ ≠ ∅; α+β=γ → ∀x∃y ⊂ ∈ ±×÷ €£¥ ©®™ °§¶ <=> ^~|`$+",
    "punctuation_runs": "!!!!!!.... ??? ,,,,, ;;;; :::: ---- ____ ==== **** ''' \"\"\" ```",
    "urls": "https://example.com/path/to?q=1&r=two#frag user.name+tag@example.org "
    "ftp://10.0.0.1:21/",
    "combining": "e\u0301 a\u0308 n\u0303 Z\u0334\u0321\u0322a\u0338l\u0337g\u0336o\u0335 "
    "Cửa Việt Äpfel",
    "zero_width": "zero\u200bwidth\u200cnon\u200djoiner\u2060wj soft\u00adhyphen \ufeffbom",
    "bom_start": "\ufeffBOM at the start",
    "fullwidth": "ＡＢＣ１２３！？ｈｅｌｌｏ",
    "control_chars": "tab\there\x0bvt\x0cff\x01\x02\x1b[31m\x1f\x7f end",
    "newer_unicode": "Kawi 𑼄𑼅 CJK-H 𱍐𱍑 CJK-I 𮯰 IDS ⿼⿽ stroke ㇯ unassigned \u0378 "
    "private \ue000 last \U0010fffd",
    "long_words": "pneumonoultramicroscopicsilicovolcanoconiosis Antidisestablishmentarianism "
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "specials_chatml": "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\n"
    "Hi!<|im_end|>\n<|im_start|>assistant\n",
    "specials_gemma": "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\nHello<eos>",
    "specials_misc": "<bos><eos><unk><pad><|endoftext|><unused0><mask> <|im_start <start_of_turn "
    "<<|im_end|>> <|im_end|><|im_end|> x<|endoftext|>y [multimodal] <jupyter_code>",
    "specials_spaces": " <|im_start|> user <end_of_turn> \n<eos>  text  ",
    "single_char": "a",
    "single_space": " ",
    "single_newline": "\n",
    "empty": "",
    "apostrophes": "'s 's' ' ' quote's '' '''",
    "html": '<div class="a"><p>Hello &amp; <b>world</b></p><br/><!-- c --></div>',
    "newer_unicode_adjacent": "a\U00011f04b c\U00031350d e\u2ffcf g\U0001fa77h i\u31efj "
    "k\u0cf3l m\u0378n",
}


CONVERSATIONS = [
    {
        "messages": [
            {"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "Hi! What's 2+2?"},
            {"role": "assistant", "content": "4."},
            {"role": "user", "content": "And 3+3?"},
        ],
        "add_generation_prompt": True,
    },
    {
        "messages": [
            {"role": "user", "content": "Write a haiku about llamas."},
            {
                "role": "assistant",
                "content": "Soft wool on the hill\nchewing grass in the cold wind\n",
            },
            {"role": "user", "content": "  Now one in Chinese: 骆驼 🦙  "},
        ],
        "add_generation_prompt": False,
    },
    {
        "messages": [
            {"role": "system", "content": "  Be kind.\n"},
            {"role": "user", "content": "Tell me a joke."},
        ],
        "add_generation_prompt": True,
    },
    {
        "messages": [
            {"role": "system", "content": "sys"},
            {"role": "user", "content": "u1"},
            {"role": "assistant", "content": " a1 "},
            {"role": "user", "content": "u2"},
            {"role": "assistant", "content": "a2"},
        ],
        "add_generation_prompt": False,
    },
]

# GGUF files whose own template we render with transformers (vocab fixtures carry some too).
TEMPLATE_FILES = {
    "smollm2-135m-instruct-q4_1": None,  # resolved through the registry
    "ggml-vocab-phi-3.gguf": HERE.parent / "vocab" / "ggml-vocab-phi-3.gguf",
    "ggml-vocab-qwen2.gguf": HERE.parent / "vocab" / "ggml-vocab-qwen2.gguf",
}


def transformers_renders() -> dict:
    from transformers import AutoTokenizer

    out = {}
    for name, path in TEMPLATE_FILES.items():
        path = Path(path or resolve_model_path(name))
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        cases = []
        for conv in CONVERSATIONS:
            text = tok.apply_chat_template(
                conv["messages"],
                tokenize=False,
                add_generation_prompt=conv["add_generation_prompt"],
            )
            cases.append({**conv, "expected": text})
        out[name] = {"special_tokens": tok.special_tokens_map, "cases": cases}
        print(f"transformers: {name}")
    return out


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def server_renders(bin_dir: Path, model: Path, flags: list[str], port: int = 8099) -> list[dict]:
    """Each conversation through a llama-server started with ``flags``."""
    proc = subprocess.Popen(
        [str(bin_dir / "llama-server"), "-m", str(model), "--port", str(port), "-c", "256", *flags],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(240):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            time.sleep(0.25)
        else:
            raise RuntimeError(f"llama-server {flags} did not come up")
        cases = []
        for conv in CONVERSATIONS:
            reply = _post(f"http://127.0.0.1:{port}/apply-template", conv)
            cases.append({**conv, "expected": reply["prompt"]})
        return cases
    finally:
        proc.terminate()
        proc.wait(timeout=30)


# Random strings from these pieces, joined by a special token of each vocabulary, make a
# regression set of many small texts per llama.cpp call (fragments between specials are
# tokenized independently).
FUZZ_PIECES = [
    *"abcxyzABCXYZ0123456789 .,;:!?'\"-_/\\()[]{}<>@#$%^&*+=|~`",
    *[" ", "  ", "\t", "\n", "\r", "\r\n", "\x0b", "\x0c", "\x85", "\xa0", "\u2003", "\u3000"],
    *["\u2028", "\u1680", "\u202f", "\x1c", "\x1f", "\x00", "\x7f"],
    *["'s", "'S", "'t", "'re", "'RE", "'ve", "'m", "'ll", "'LL", "'d", "'D"],
    *"éßΩжЖאבहि्กั中文日本あアｱ한ㄱ",
    *["\u0301", "\u0308", "\u20dd", "٣", "४", "๕", "Ⅻ", "½", "²", "①", "９", "€", "©", "∑"],
    *["😀", "🚀", "👍🏽", "\u200d", "\ufe0f", "🇫", "\U0001fa77", "\U0001fae8", "\U00011f04"],
    *["\U00031350", "\u2ffc", "\u31ef", "\u0378", "\ue000", "\U0010fffd", "\ufeff", "\u200b"],
    *["\xad", "«", "»", "“", "”", "‘", "’", "…", "—", "·", "、", "。", "，", "！", "～", "ー"],
    *["µ", "ª", "ǅ", "ʰ", "ℂ", "ﬁ", "Ａ", "𝐀", "𝟘", "→"],
    *["<|im_start|>", "<|im_end|>", "<start_of_turn>", "<end_of_turn>", "<unused5>", "<s>"],
    *["</s>", "<unk>", "<|end|>", "<|user|>", "<|endoftext|>", "<|eot_id|>", "<|im_start"],
    *["<bos>", "<pad>", "\n\n\n", "    ", "\t\t"],
]
FUZZ_SEPARATORS = {
    "ggml-vocab-gpt-2.gguf": "<|endoftext|>",
    "ggml-vocab-llama-bpe.gguf": "<|end_of_text|>",
    "ggml-vocab-qwen2.gguf": "<|endoftext|>",
    "ggml-vocab-llama-spm.gguf": "</s>",
    "ggml-vocab-phi-3.gguf": "<|endoftext|>",
    "ggml-vocab-bert-bge.gguf": "[SEP]",
    "ggml-vocab-deepseek-coder.gguf": "<｜end▁of▁sentence｜>",
    "ggml-vocab-deepseek-llm.gguf": "<｜end▁of▁sentence｜>",
    "ggml-vocab-falcon.gguf": "<|endoftext|>",
    "ggml-vocab-qwen35.gguf": "<|endoftext|>",
    "ggml-vocab-gemma-4.gguf": "<eos>",
    "smollm2-135m-instruct-q4_1": "<|endoftext|>",
    "gemma3-270m-q4_k_m": "<eos>",
}


def fuzz_texts(seed: int = 1234, count: int = 300) -> list[str]:
    rng = random.Random(seed)
    return [
        "".join(rng.choice(FUZZ_PIECES) for _ in range(rng.randint(1, 30))) for _ in range(count)
    ]


def fuzz_expected(bin_dir: Path, tmp: str) -> dict:
    texts = fuzz_texts()
    out: dict = {"texts": texts, "vocabs": {}}
    for name, sep in FUZZ_SEPARATORS.items():
        path = Path(
            HERE.parent / "vocab" / name if name.endswith(".gguf") else resolve_model_path(name)
        )
        joined = sep.join(t.replace(sep, "") for t in texts)
        file = Path(tmp) / "fuzz.txt"
        file.write_bytes(joined.encode("utf-8"))
        out["vocabs"][name] = {
            "separator": sep,
            "parse_special": tokenize_ids(bin_dir, path, file, ["--no-bos"]),
            "no_parse_special": tokenize_ids(
                bin_dir, path, file, ["--no-bos", "--no-parse-special"]
            ),
        }
        print(f"fuzz: {name}")
    return out


def run(cmd: list[str], stdin: bytes | None = None) -> bytes:
    proc = subprocess.run(cmd, input=stdin, capture_output=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd} failed ({proc.returncode}): {proc.stderr.decode()[-2000:]}")
    return proc.stdout


def tokenize_ids(bin_dir: Path, model: Path, path: Path, flags: list[str]) -> list[int]:
    out = run(
        [
            str(bin_dir / "llama-tokenize"),
            "-m",
            str(model),
            "-f",
            str(path),
            "--ids",
            "--log-disable",
            "--no-escape",
            *flags,
        ]
    )
    line = out.decode().strip().splitlines()[-1]
    return json.loads(line)


def tokenize_pieces(bin_dir: Path, model: Path, path: Path, ids: list[int]) -> list[bytes]:
    """The bytes llama-tokenize prints for each token (``%6d -> '%s'`` lines)."""
    out = run(
        [
            str(bin_dir / "llama-tokenize"),
            "-m",
            str(model),
            "-f",
            str(path),
            "--log-disable",
            "--no-escape",
        ]
    )
    pieces = []
    pos = 0
    for i, tid in enumerate(ids):
        head = f"{tid:6d} -> '".encode()
        assert out.startswith(head, pos), (out[pos : pos + 40], head)
        pos += len(head)
        if i + 1 < len(ids):
            end = out.index(f"'\n{ids[i + 1]:6d} -> '".encode(), pos)
        else:
            end = out.rindex(b"'\n")
        pieces.append(out[pos:end])
        pos = end + 2
    return pieces


_INFO = re.compile(r"print_info: (BOS|EOS|EOT|EOM|UNK|PAD|LF|EOG) token +=\s+(\d+) ")
_VOCAB = re.compile(r"print_info: (vocab type|n_vocab) += (\S+)")


def vocab_facts(bin_dir: Path, model: Path) -> dict:
    """Special ids and the EOG set from llama.cpp's load log."""
    proc = subprocess.run(
        [
            str(bin_dir / "llama-completion"),
            "-m",
            str(model),
            "-p",
            "hi",
            "-n",
            "1",
            "-no-cnv",
            "-lv",
            "4",
            "--temp",
            "0",
        ],
        capture_output=True,
        check=False,
        stdin=subprocess.DEVNULL,
        timeout=300,
    )
    log = proc.stdout.decode(errors="replace") + proc.stderr.decode(errors="replace")
    facts: dict = {"eog": []}
    for kind, value in _INFO.findall(log):
        if kind == "EOG":
            facts["eog"].append(int(value))
        else:
            facts[kind.lower()] = int(value)
    for kind, value in _VOCAB.findall(log):
        facts[kind.replace(" ", "_")] = value
    if "n_vocab" not in facts:
        raise RuntimeError(f"no vocabulary info in the log of {model}:\n{log[-3000:]}")
    facts["n_vocab"] = int(facts["n_vocab"])
    return facts


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("bin_dir", type=Path, help="folder with llama-tokenize, llama-server, ...")
    ap.add_argument("--skip", action="append", default=[], choices=["corpus", "fuzz", "chat"])
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        if "corpus" not in args.skip:
            write_corpus_expected(args.bin_dir, tmp)
        if "fuzz" not in args.skip:
            (HERE / "fuzz_expected.json").write_text(
                json.dumps(fuzz_expected(args.bin_dir, tmp), ensure_ascii=False) + "\n",
                encoding="utf-8",
            )
    if "chat" not in args.skip:
        write_chat_expected(args.bin_dir)
    return 0


def write_corpus_expected(bin_dir: Path, tmp: str) -> None:
    facts = {}
    for vocab in sorted((HERE.parent / "vocab").glob("*.gguf")):
        facts[vocab.name] = vocab_facts(bin_dir, vocab)
    for name in MODELS:
        model = Path(resolve_model_path(name))
        facts[name] = vocab_facts(bin_dir, model)
        cases = []
        pieces: dict[int, str] = {}
        for key, text in CORPUS.items():
            path = Path(tmp) / f"{key}.txt"
            path.write_bytes(text.encode("utf-8"))
            case: dict = {"name": key, "text": text}
            for variant, flags in VARIANTS.items():
                case[variant] = tokenize_ids(bin_dir, model, path, flags)
            printed = tokenize_pieces(bin_dir, model, path, case["default"])
            for tid, piece in zip(case["default"], printed, strict=True):
                pieces[tid] = piece.hex()
            cases.append(case)
            print(f"{name} {key}: {len(case['default'])} tokens")
        out = {
            "model": name,
            "generator": "tests/data/tokenizer/gen_expected.py (llama-tokenize --no-escape)",
            "cases": cases,
            "pieces": {str(k): v for k, v in sorted(pieces.items())},
        }
        (HERE / f"expected_{name}.json").write_text(
            json.dumps(out, ensure_ascii=False, indent=1) + "\n", encoding="utf-8"
        )
    (HERE / "vocab_facts.json").write_text(json.dumps(facts, indent=1) + "\n")


def write_chat_expected(bin_dir: Path) -> None:
    smollm = Path(resolve_model_path(MODELS[0]))
    chat: dict = {
        "transformers": transformers_renders(),
        "llama_cpp_jinja": {MODELS[0]: server_renders(bin_dir, smollm, ["--jinja"])},
        "llama_cpp_builtin": {},
    }
    for name in sorted(BUILTIN_TEMPLATES):
        chat["llama_cpp_builtin"][name] = server_renders(
            bin_dir, smollm, ["--no-jinja", "--chat-template", name]
        )
        print(f"llama.cpp built-in: {name}")
    (HERE / "chat_expected.json").write_text(
        json.dumps(chat, ensure_ascii=False, indent=1) + "\n", encoding="utf-8"
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
