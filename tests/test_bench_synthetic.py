"""The synthetic models of ``bench_synthetic``: the files other hosts benchmark stand in for
the real ones there, so their tensor types and shapes must be the real files' (the weights
are random bytes with small finite scales: only the byte format matters for speed)."""

from __future__ import annotations

import numpy as np

from picollama.backends.cuda.bench_synthetic import main
from picollama.generation import Context
from picollama.gguf import GGMLType, GGUFReader


def test_the_135m_q4_1_file_has_smollm2_q4_1s_layout_and_decodes_on_the_cpu(tmp_path, capsys):
    """``--write-only`` writes it with no GPU, and the CPU backend runs it."""
    assert main(["--models", "135m-q4_1", "--write-only", "--dir", str(tmp_path)]) == 0
    path = tmp_path / "synth-135m-q4_1.gguf"
    assert capsys.readouterr().out.splitlines()[-1] == str(path)
    with GGUFReader(path) as reader:
        assert reader.get("general.file_type") == 3  # LLAMA_FTYPE_MOSTLY_Q4_1
        types = {t.name: t.type for t in reader.tensors}
        shapes = {t.name: tuple(t.shape) for t in reader.tensors}
    # SmolLM2-135M-Instruct's Q4_1 file: Q4_1 matrices, Q8_0 tied embeddings, F32 norms
    assert types.pop("token_embd.weight") == GGMLType.Q8_0
    assert shapes["token_embd.weight"] == (576, 49152)
    assert "output.weight" not in types
    assert len([n for n in types if n.endswith("_norm.weight")]) == 61
    assert {t for n, t in types.items() if not n.endswith("_norm.weight")} == {GGMLType.Q4_1}
    assert shapes["blk.29.ffn_down.weight"] == (1536, 576)
    assert shapes["blk.0.attn_k.weight"] == (576, 192)
    ctx = Context(str(path), n_ctx=32)
    logits = ctx.eval([256, 72, 101, 108])
    assert logits.shape[-1] == 49152 and np.isfinite(logits).all()


def test_trace_report_orders_launches_and_takes_each_kinds_medians():
    """``--trace``'s report (no GPU: records as mmvq.cu's MVQ_TRACE build writes them)."""
    from picollama.backends.cuda.bench_synthetic import trace_report

    def launch(ptr, start, n_warps, wait, quantized, first, done):
        rows = []
        for w in range(n_warps):  # warp w enters w ns late and finishes w ns late
            t = [start + w, start + wait, start + quantized, start + first, start + done + w]
            rows.append([ptr, w << 16] + [1_000_000 + v for v in t])
        return rows

    ns = 1000  # a microsecond
    rec = launch(0xA000, 0, 4, 1 * ns, 5 * ns, 7 * ns, 20 * ns)
    rec += launch(0xB000, 21 * ns, 4, 2 * ns, 4 * ns, 6 * ns, 12 * ns)
    rec += launch(0xC000, 40 * ns, 4, 1 * ns, 5 * ns, 7 * ns, 24 * ns)
    rec[-1][5] = 0  # a warp without a unit: no first-unit time
    rec = np.array(rec[::-1], dtype=np.uint64)  # records come in any order
    kinds = {0xA000: "gate+up", 0xB000: "down", 0xC000: "gate+up"}
    lines = trace_report(rec, kinds, show=3)
    rows = [line for line in lines if line[:3].strip().isdigit()]
    assert [r.split()[1] for r in rows] == ["gate+up", "down", "gate+up"]
    summary = {line.split(" | ")[0]: line.split(" | ") for line in lines if " | " in line}
    gate = [float(v) for v in summary["gate+up"][1:]]
    assert gate[0] == 2  # two launches of that kind
    # entry -> wait done 1 us, wait -> x quantized 4, -> first unit 2, x quantized -> done
    # 15 and 19 (median 17)
    assert np.allclose(gate[1:5], [1.0, 4.0, 2.0, 17.0], atol=0.01)
    down = [float(v) for v in summary["down"][1:]]
    assert np.allclose(down[1:5], [2.0, 2.0, 2.0, 8.0], atol=0.01)
    # the down launch's wait is done at 23 us; the launch before it finished at 20.003
    assert abs(down[7] - (23.0 - 20.003)) < 0.01


def test_prologue_report_splits_each_kinds_prologue_in_five():
    """``--trace``'s prologue table: mmvq.cu's three inner times between the wait and the
    first unit, medians by kind; a time not taken (0) counts for nothing."""
    from picollama.backends.cuda.bench_synthetic import prologue_report

    ns = 1000
    rows = []  # (first weight, ids, entry, wait, x quantized, first unit, done, x1, issued,
    # x's first loads in)
    for w, extra in enumerate((0, 1, 2)):  # three warps, the middle one the median
        wait, xl, x1, xq, issued = 10, 11 + extra, 12 + extra, 15 + extra, 16 + extra
        first = 19 + 2 * extra
        rows.append(
            [0xA0, w << 16, 0, wait * ns, xq * ns, first * ns, 30 * ns, x1 * ns, issued * ns,
             xl * ns]
        )  # fmt: skip
    rows.append([0xB0, 0, 0, 5 * ns, 8 * ns, 0, 9 * ns, 6 * ns, 0, 0])  # no next unit, no first
    lines = prologue_report(np.array(rows, dtype=np.uint64), {0xA0: "gate+up", 0xB0: "small"})
    table = {line.split(" | ")[0]: line.split(" | ")[1:] for line in lines[1:]}
    assert np.allclose([float(v) for v in table["gate+up"]], [2.0, 1.0, 3.0, 1.0, 4.0])
    small = [float(v) for v in table["small"]]
    assert np.isnan(small[0]) and np.isnan(small[1])  # its loads' time not taken
    assert np.allclose(small[2], 2.0) and np.isnan(small[3]) and np.isnan(small[4])


def test_ring_wait_report_takes_each_kinds_medians_over_blocks_and_phases():
    """The ring's two wait columns (ring.cu's MVQ_TRACE records), by kind of phase."""
    from picollama.backends.cuda.bench_synthetic import ring_wait_report

    ns = 1000
    rows = []  # (first weight, block | SM << 24, 5 times, bytes waited, slots waited)
    for layer, ptr in enumerate((0xA0, 0xB0)):  # two layers' phases of one kind
        for block in range(3):
            done = (10 + block) * ns  # x quantized at 0: 10, 11, 12 us
            sm = (block + layer) << 24  # a block's SM may differ between launches
            rows.append([ptr, block | sm, 0, 0, 0, 1, done, (1 + block) * ns, 7 * ns])
    rows.append([0xC0, 0, 0, 0, 0, 1, 30 * ns, 0, 25 * ns])
    lines = ring_wait_report(np.array(rows, dtype=np.uint64), {0xA0: "up", 0xB0: "up"})
    table = {line.split(" | ")[0]: line.split(" | ")[1:] for line in lines[1:]}
    assert [int(table["up"][0])] + [float(v) for v in table["up"][1:]] == [2, 11.0, 2.0, 7.0]
    assert [float(v) for v in table["0xc0"][1:]] == [30.0, 0.0, 25.0]


def test_ab_takes_turns_and_reports_each_builds_median_and_ratio(tmp_path, capsys, monkeypatch):
    """``--ab`` (no GPU: each file's timing made up from the build it was asked for): the
    default and the variant take turns round by round, and the table holds every figure in
    the order it ran, the medians and each variant's median over the default's."""
    from picollama.backends.cuda import bench_synthetic as bs

    calls = []
    speed = {(): 400.0, ("MVQ_XREG=1",): 440.0, ("MVQ_XREG=1", "PDL_TRIGGER=1"): 300.0}

    def fake(args, spec, path, defines):
        calls.append((spec, tuple(defines)))
        tg = speed[tuple(defines)] / (1 if spec == "8b-q4_k_m" else 0.25) + len(calls)
        return {"tg128": [tg, 0.1, tg], "device": "made up", "bandwidth": 4.2e12}

    monkeypatch.setattr(bs, "_bench_file", fake)
    monkeypatch.setattr(bs, "_model_path", lambda d, spec: str(tmp_path / spec))
    argv = ["--models", "135m-q4_k_m,8b-q4_k_m", "--dir", str(tmp_path), "--rounds", "2"]
    bs.main(argv + ["--ab", "MVQ_XREG=1", "--ab", "MVQ_XREG=1,PDL_TRIGGER=1"])
    builds = [(), ("MVQ_XREG=1",), ("MVQ_XREG=1", "PDL_TRIGGER=1")]
    order = [(s, b) for _ in range(2) for b in builds for s in ("135m-q4_k_m", "8b-q4_k_m")]
    assert calls == order
    rows = {ln.split(" | ")[0][2:]: ln.split(" | ") for ln in capsys.readouterr().out.splitlines()}
    big = rows["8b-q4_k_m"]
    # default: calls 2 and 8 -> 402.0 / 408.0; the first variant: calls 4 and 10
    assert big[1] == "402.0 / 408.0" and big[2] == "405.0"
    assert big[3] == "444.0 / 450.0" and big[4] == "447.0"
    assert abs(float(big[7]) - 447.0 / 405.0) < 1e-3
    assert abs(float(big[8].rstrip(" |")) - 309.0 / 405.0) < 1e-3
    assert rows["135m-q4_k_m"][1] == "1601.0 / 1607.0"
