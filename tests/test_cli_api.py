"""The user surfaces on the default model: picollama-cli and the Llama Python API."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import SMOLLM2

from picollama.generation import ContextOverflowError

pytestmark = pytest.mark.model


def _cli(*args, timeout=600):
    return subprocess.run(
        [sys.executable, "-m", "picollama.tools.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


@pytest.fixture(scope="module")
def llm(smollm2_path):
    from picollama import Llama

    with Llama(smollm2_path, n_ctx=512, n_threads=2, seed=1) as model:
        yield model


def test_cli_completion_greedy(smollm2_path):
    r = _cli("-m", SMOLLM2, "-p", "The capital of France is", "-n", "4", "--temp", "0")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("The capital of France is Paris")
    assert "tokens per second" in r.stderr  # timings go to stderr


def test_cli_no_repack_flag(smollm2_path):
    """-nr / --no-repack (llama.cpp's flag): the CPU backend keeps the file's layout, and
    with another backend the flag is refused in one line."""
    r = _cli("-m", SMOLLM2, "-nr", "-p", "The capital of France is", "-n", "4", "--temp", "0")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("The capital of France is Paris")
    r = _cli("-m", SMOLLM2, "--no-repack", "--backend", "opencl", "-p", "hi", "-n", "1")
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "--no-repack is a cpu backend flag" in lines[0], r.stderr


def test_cli_no_repack_makes_a_plain_cpu_backend():
    import argparse

    from picollama.tools.cli import add_model_args, backend_choice

    p = argparse.ArgumentParser()
    add_model_args(p)
    assert backend_choice(p.parse_args([])) == "cpu"
    be = backend_choice(p.parse_args(["-nr", "-t", "2"]))
    assert be.name == "cpu" and be.repack is False and be.n_threads == 2


def test_cli_prompt_longer_than_context(smollm2_path):
    r = _cli("-m", SMOLLM2, "-c", "16", "-p", "word " * 40, "-n", "4")
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("picollama-cli: error:")
    assert "16" in lines[0] and "tokens" in lines[0]


def test_cli_missing_model_is_one_line():
    r = _cli("-m", "/nonexistent/model.gguf", "-p", "hi")
    assert r.returncode == 1
    assert r.stderr.strip().count("\n") == 0 and "no model file" in r.stderr


def test_cli_chat_turns_from_stdin(smollm2_path, llm):
    question = "What is the capital of France?"
    args = ["-m", SMOLLM2, "-cnv", "--temp", "0", "-n", "12", "-c", "512"]
    proc = subprocess.run(
        [sys.executable, "-m", "picollama.tools.cli", *args],
        input=f"{question}\nAnd of Italy?\n",
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    # the first answer is what the API gives for the same conversation
    first = llm.create_chat_completion(
        [{"role": "user", "content": question}], max_tokens=12, temperature=0
    )["choices"][0]["message"]["content"]
    assert first and first in proc.stdout
    # a second turn was answered too: two prompts, each followed by generated text
    answers = [a.strip() for a in proc.stdout.split("\n> ")[1:]]
    assert len([a for a in answers if a]) >= 2, proc.stdout


def test_chat_completion_shape(llm):
    out = llm.create_chat_completion(
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "What is the capital of France?"},
        ],
        max_tokens=8,
        temperature=0,
    )
    assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-")
    choice = out["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["message"]["content"]
    assert choice["finish_reason"] in ("stop", "length")
    usage = out["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert 0 < usage["completion_tokens"] <= 8


def test_chat_completion_stream(llm):
    chunks = list(
        llm.create_chat_completion(
            [{"role": "user", "content": "Say hello."}], max_tokens=6, temperature=0, stream=True
        )
    )
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    whole = llm.create_chat_completion(
        [{"role": "user", "content": "Say hello."}], max_tokens=6, temperature=0
    )
    assert text == whole["choices"][0]["message"]["content"]


def test_completion_stop_string_and_echo(llm):
    out = llm.create_completion("1, 2, 3, 4,", max_tokens=16, temperature=0, stop=[" 7"])
    assert out["object"] == "text_completion"
    assert out["choices"][0]["finish_reason"] == "stop"
    assert " 7" not in out["choices"][0]["text"] and "5" in out["choices"][0]["text"]
    echoed = llm("1, 2,", max_tokens=2, temperature=0, echo=True)
    assert echoed["choices"][0]["text"].startswith("1, 2,")


def test_prompt_longer_than_context_raises(llm):
    with pytest.raises(ContextOverflowError) as err:
        llm.create_completion("word " * 600, max_tokens=4)
    assert err.value.n_ctx == 512 and err.value.n_prompt_tokens > 512


def test_tokenize_roundtrip(llm):
    ids = llm.tokenize(b"Hello world")
    assert llm.detokenize(ids) == b"Hello world"
