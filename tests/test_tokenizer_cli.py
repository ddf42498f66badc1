"""picollama-tokenize prints what llama-tokenize prints (frozen), and fails in one line."""

from __future__ import annotations

import functools
import io
import json
import re
import sys
from pathlib import Path

import pytest

from picollama.gguf import GGUFReader
from picollama.tokenizer import Tokenizer
from picollama.tools import bench_tokenize
from picollama.tools.tokenize import main, process_escapes

DATA = Path(__file__).parent / "data"
VOCAB = DATA / "vocab" / "ggml-vocab-qwen2.gguf"
MODELS = ("smollm2-135m-instruct-q4_1", "gemma3-270m-q4_k_m")


@functools.cache
def _expected(model: str) -> dict:
    return json.loads((DATA / "tokenizer" / f"expected_{model}.json").read_text("utf-8"))


def _model_path(name: str) -> Path:
    from picollama.models.registry import ModelNotFoundError, resolve_model_path

    try:
        return resolve_model_path(name)
    except ModelNotFoundError:
        pytest.skip(f"model {name} is not installed: picollama-models pull {name}")


def _run(capsysbinary, *argv: str) -> tuple[int, bytes, bytes]:
    rc = main(list(argv))
    out = capsysbinary.readouterr()
    return rc, out.out, out.err


_CASES = ("english", "emoji", "specials_chatml", "whitespace_runs")


@pytest.mark.model
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("case_name", _CASES)
def test_output_matches_llama_tokenize(model, case_name, tmp_path, capsysbinary):
    expected = _expected(model)
    case = next(c for c in expected["cases"] if c["name"] == case_name)
    file = tmp_path / "prompt.txt"
    file.write_bytes(case["text"].encode("utf-8"))
    path = str(_model_path(model))

    rc, out, err = _run(capsysbinary, "-m", path, "-f", str(file), "--ids", "--no-escape")
    assert (rc, err) == (0, b"")
    assert out == ("[" + ", ".join(map(str, case["default"])) + "]\n").encode()

    flags = ("--no-bos", "--no-parse-special")
    rc, out, _ = _run(capsysbinary, "-m", path, "-f", str(file), "--ids", "--no-escape", *flags)
    assert rc == 0 and json.loads(out) == case["no_bos_no_special"]

    # the default listing: "%6d -> 'piece'" per token, the piece's raw bytes
    rc, out, _ = _run(capsysbinary, "-m", path, "-f", str(file), "--no-escape")
    pieces = expected["pieces"]
    listing = b"".join(
        f"{t:6d} -> '".encode() + bytes.fromhex(pieces[str(t)]) + b"'\n" for t in case["default"]
    )
    assert rc == 0 and out == listing


def test_prompt_escapes_are_processed_like_llama_tokenize(capsysbinary):
    rc, escaped, _ = _run(capsysbinary, "-m", str(VOCAB), "-p", "a\\nb\\t\\x41\\\\", "--ids")
    assert rc == 0
    rc, literal, _ = _run(capsysbinary, "-m", str(VOCAB), "-p", "a\\nb", "--ids", "--no-escape")
    assert rc == 0
    with GGUFReader(VOCAB) as reader:
        tok = Tokenizer.from_gguf(reader)
    assert json.loads(escaped) == tok.encode("a\nb\tA\\")
    assert json.loads(literal) == tok.encode("a\\nb")


def test_process_escapes():
    assert process_escapes(rb"\n\r\t\'\"\\") == b"\n\r\t'\"\\"
    assert process_escapes(rb"\x41\x4g\q\\") == b"A\\x4g\\q\\"
    assert process_escapes(b"end\\") == b"end\\"


def test_stdin_and_show_count(monkeypatch, capsysbinary):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"hello world")))
    rc, out, _ = _run(capsysbinary, "-m", str(VOCAB), "--stdin", "--ids", "--show-count")
    assert rc == 0
    ids_line, count_line = out.decode().splitlines()
    assert count_line == f"Total number of tokens: {len(json.loads(ids_line))}"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["-m", "no-such-model", "-p", "x"], "no model file 'no-such-model'"),
        (["-p", "x"], "required: -m/--model"),
        (["-m", str(VOCAB)], "one of the arguments"),
        (["-m", str(VOCAB), "-p", "x", "-f", "y"], "not allowed with"),
        (["-m", str(VOCAB), "-f", "/no/such/file"], "cannot read /no/such/file"),
        (["-m", str(VOCAB), "-p", "a\\xe6\\xadb"], "not valid UTF-8: byte 0xe6 at offset 1"),
        (["-m", str(DATA / "vocab" / "ggml-vocab-qwen2.gguf.inp"), "-p", "x"], "GGUF|magic"),
    ],
)
def test_errors_are_one_line_and_exit_1(argv, message, capsysbinary):
    rc, out, err = _run(capsysbinary, *argv)
    assert rc == 1
    assert out == b""
    lines = err.decode().splitlines()
    assert len(lines) == 1 and lines[0].startswith("picollama-tokenize: error: ")
    assert re.search(message, lines[0]), lines[0]


def test_bench_tool_runs_and_reports_mb_per_s(tmp_path, capsys):
    file = tmp_path / "text.txt"
    file.write_text("The quick brown fox jumps over the lazy dog.\n" * 200, encoding="utf-8")
    rc = bench_tokenize.main(["-m", str(VOCAB), "-f", str(file), "-r", "2"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "MB/s" in out and "load" in out
