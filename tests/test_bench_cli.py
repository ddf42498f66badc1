"""picollama-bench: llama-bench's tests and names, on a tiny synthetic model."""

from __future__ import annotations

import re

import pytest
from model_factory import TinySpec, write_tiny_model

from picollama.tools import bench


def test_bench_runs_at_a_depth_with_llama_bench_names(tmp_path, capsys):
    """``-d N`` runs each test after N tokens already in the context (untimed), named as
    llama-bench names it ("tg4 @ d40"); the context is made large enough for both."""
    path = tmp_path / "tiny.gguf"
    write_tiny_model(path, TinySpec())
    assert bench.main(["-m", str(path), "-p", "8", "-n", "4", "-d", "40", "-r", "2"]) == 0
    out = capsys.readouterr().out
    found = re.finditer(r"\| (\w+ @ d\d+) \| ([\d.]+) ±", out)
    rows = {m.group(1): float(m.group(2)) for m in found}
    assert set(rows) == {"pp8 @ d40", "tg4 @ d40"}
    assert all(rate > 0 for rate in rows.values())


def test_bench_refuses_a_negative_count(tmp_path, capsys):
    path = tmp_path / "tiny.gguf"
    write_tiny_model(path, TinySpec())
    assert bench.main(["-m", str(path), "-d", "-1"]) == 1
    assert "-p, -n and -d take counts >= 0" in capsys.readouterr().err


def test_bench_takes_llama_bench_lists(tmp_path, capsys):
    """-p, -n and -d take comma lists, as llama-bench's: every prompt and generation test
    at every depth, named as llama-bench names them."""
    path = tmp_path / "tiny.gguf"
    write_tiny_model(path, TinySpec())
    argv = ["-m", str(path), "-p", "4,8", "-n", "2,3", "-d", "0,20", "-r", "1"]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    found = re.finditer(r"\| ((?:pp|tg)\d+(?: @ d\d+)?) \| ([\d.]+) ±", out)
    rows = {m.group(1): float(m.group(2)) for m in found}
    names = {"pp4", "pp8", "tg2", "tg3"}
    assert set(rows) == names | {f"{name} @ d20" for name in names}
    assert all(rate > 0 for rate in rows.values())
    with pytest.raises(SystemExit):
        bench.main(["-m", str(path), "-p", "4,x"])
    assert "is not a count or a list of them" in capsys.readouterr().err
