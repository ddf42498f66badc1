"""``stream_bench``: the cases it times, and (on a GPU) that each case reads the buffer.

Without CuPy or a GPU the timed test skips with the reason."""

from __future__ import annotations

import math

import pytest

from picollama.backends.cuda.stream_bench import bulk_cases, stream_bench


def test_bulk_cases_fit_a_multiprocessors_shared_memory_and_copy_whole_pieces():
    cases = bulk_cases()
    assert cases and len(bulk_cases(quick=True)) < len(cases)
    for c in cases:
        stage = c["stage_kb"] * 1024
        assert c["blocks"] * c["stages"] * c["stage_kb"] <= 200
        assert stage % c["pieces"] == 0 and (stage // c["pieces"]) % 16 == 0  # bulk copy rule
        assert 1 <= c["issuers"] <= min(32, c["pieces"])
    # both ways of freeing a slot, and one copy a stage beside many from far apart
    assert {c["consumers"] for c in cases} == {0, 8}
    assert {(c["pieces"], c["scatter"]) for c in cases} >= {(1, 0), (32, 1)}


def _gpu():
    """Skip (with the reason) without CuPy or a CUDA device."""
    cp = pytest.importorskip("cupy", reason="stream_bench needs CuPy")
    try:
        cp.cuda.runtime.getDeviceCount()
    except cp.cuda.runtime.CUDARuntimeError as err:
        pytest.skip(f"no CUDA device here: {err}")


def test_every_case_streams_the_buffer_on_a_gpu():
    _gpu()
    rows = list(stream_bench(mib=64, reps=1, quick=True))
    labels = [label for label, _, _ in rows]
    assert labels[0].startswith("device copy") and any(x.startswith("ldg") for x in labels)
    assert sum(x.startswith("bulk") for x in labels) == len(bulk_cases(quick=True))
    for label, rate, _ in rows:
        assert math.isfinite(rate) and rate > 1, label  # GB/s: a hung ring would not return


def test_phase_plan_lays_whole_stages_of_every_phase_within_the_buffer():
    from picollama.backends.cuda.stream_bench import layer_8b, phase_cases, phase_plan

    stage, region = 32 * 1024, 1 << 30
    base, chunks, widths = phase_plan(4, stage, region)
    phases = [ph for i in range(4) for ph in layer_8b(i)]
    assert len(base) == len(chunks) == len(widths) == len(phases) == 20
    for (nbytes, width), b, n, w in zip(phases, base, chunks, widths, strict=True):
        b, n = int(b), int(n)
        assert n * stage >= nbytes > (n - 1) * stage or nbytes == n == 0
        assert b % stage == 0 and b + n * stage <= region and w == width <= 16384
    assert {c["mode"] for c in phase_cases()} == {0, 1, 2}
    for c in phase_cases():  # the ring and x's codes fit one block's shared memory (227 KB)
        assert c["stages"] * c["stage_kb"] + 16 + 1 <= 227


def test_phase_ring_streams_and_every_flag_comes_on_a_gpu():
    _gpu()
    from picollama.backends.cuda.stream_bench import phase_bench, phase_cases

    rows = list(phase_bench(mib=256, layers=2, reps=1, quick=True))
    assert len(rows) == len(phase_cases(quick=True)) + 1
    for label, rate, timeouts in rows:
        assert math.isfinite(rate) and rate > 1 and timeouts == 0, label


def test_burst_cases_time_a_launchs_first_units_and_later_ones():
    from picollama.backends.cuda.stream_bench import burst_cases

    cases = burst_cases()
    assert {c["steady"] for c in cases} == {0, 8}  # at the start, and after a stream
    assert {c["warps"] for c in cases} == {4, 8, 16}  # the burst's size an SM grows
    assert {c["units"] for c in cases} == {1, 2}
    assert len({tuple(sorted(c.items())) for c in cases}) == len(cases)


def test_burst_bench_times_every_case_on_a_gpu():
    _gpu()
    from picollama.backends.cuda.stream_bench import burst_bench, burst_cases

    rows = list(burst_bench(mib=256))
    assert len(rows) == len(burst_cases())
    for label, med, p90 in rows:
        assert 0 < med <= p90 < 1e4, label  # microseconds: a load takes some, none hangs


def test_x_push_cases_compare_x_loaded_with_x_brought_by_a_neighbour():
    from picollama.backends.cuda.stream_bench import x_push_cases

    cases = x_push_cases()
    assert {c["mode"] for c in cases} == {0, 1, 2}  # itself, an idle neighbour, a busy one
    assert all(1 <= c["units"] <= 4 for c in cases)  # the kernel's XB_UNITS registers
    assert {c["delay"] for c in cases if c["mode"] == 0} > {0}  # x behind units in flight
    assert len({tuple(sorted(c.items())) for c in cases}) == len(cases)


def test_x_push_bench_times_both_blocks_of_every_case_on_a_gpu():
    _gpu()
    from picollama.backends.cuda.stream_bench import x_push_bench, x_push_cases

    rows = list(x_push_bench(mib=256))
    assert len(rows) == 2 * len(x_push_cases())  # rank 1's figure, then rank 0's
    for label, med, p90 in rows:
        assert 0 < med <= p90 < 1e8, label  # cycles: every wait ended (a lost push traps)


def test_x_bcast_cases_read_x_three_ways_at_both_widths():
    from picollama.backends.cuda.stream_bench import x_bcast_cases

    cases = x_bcast_cases()
    assert {c["mode"] for c in cases} == {0, 1, 2}  # shared, own copies, multicast
    for c in cases:  # a quarter of x a multicast copy: whole 16-byte pieces
        assert (c["xw"] * 4 // 4) % 16 == 0 and c["xw"] * 4 <= 227 * 1024


def test_x_bcast_bench_times_every_case_on_a_gpu():
    _gpu()
    from picollama.backends.cuda.stream_bench import x_bcast_bench, x_bcast_cases

    rows = list(x_bcast_bench(mib=256))
    assert len(rows) == len(x_bcast_cases())
    for label, med, p90 in rows:
        assert 0 < med <= p90 < 1e4, label  # microseconds: every copy landed


def test_x_fresh_cases_set_old_x_beside_each_way_the_launch_before_writes_it():
    from picollama.backends.cuda.stream_bench import x_fresh_cases

    cases = x_fresh_cases()
    assert {c["how"] for c in cases} == {0, 1, 2}  # float4 stores, a row a warp, after weights
    assert any(c["sync"] for c in cases) and any(not c["sync"] for c in cases)
    assert all((c["units"] > 0) == (c["how"] == 2) for c in cases)


def test_x_fresh_bench_checks_x_and_times_every_case_on_a_gpu():
    _gpu()
    from picollama.backends.cuda.stream_bench import x_fresh_bench, x_fresh_cases

    rows = list(x_fresh_bench(mib=256))  # raises where the writer left x other than stamped
    assert len(rows) == len(x_fresh_cases())
    for label, med, p90 in rows:
        assert 0 < med <= p90 < 1e4, label


def test_x_pdl_cases_set_each_wait_beside_a_plain_launch():
    from picollama.backends.cuda.stream_bench import x_pdl_cases

    cases = x_pdl_cases()
    assert {c["wait"] for c in cases} == {"plain", "pdl", "count"}
    assert all(c["units"] or not c["landed"] for c in cases)  # only a unit sent can land
    assert {(c["units"], c["landed"]) for c in cases if c["wait"] == "pdl"} == {
        (0, 0),
        (1, 0),
        (1, 1),
    }  # nothing ahead, a unit in flight, a unit landed
    assert len({tuple(sorted(c.items())) for c in cases}) == len(cases)


def test_x_pdl_bench_checks_x_and_times_every_case_on_a_gpu():
    _gpu()
    from picollama.backends.cuda.stream_bench import x_pdl_bench, x_pdl_cases

    rows = list(x_pdl_bench(mib=256, reps=2))  # raises where a reader saw x before the writer's
    assert len(rows) == len(x_pdl_cases())
    for label, med, p90 in rows:
        assert 0 < med <= p90 < 1e4, label


def test_ksplit_bench_times_the_column_split_and_its_reference_on_a_gpu():
    _gpu()
    from picollama.backends.cuda.stream_bench import ksplit_bench

    rows = list(ksplit_bench(mib=256, reps=1))
    assert len(rows) == 3 and rows[0][0].startswith("the weight streamed whole")
    for label, us, rate in rows:
        assert us > 0 and math.isfinite(rate) and rate > 1, label


def test_main_prints_the_sections_asked_for_and_every_one_without_a_flag(monkeypatch, capsys):
    """The section flags select (``--burst`` prints only the burst), with no GPU needed:
    each bench is replaced by one row naming it, and CuPy by an empty module."""
    import sys
    import types

    import picollama.backends.cuda.stream_bench as sb

    monkeypatch.setitem(sys.modules, "cupy", types.ModuleType("cupy"))
    names = ["x_pdl_bench", "x_fresh_bench", "ksplit_bench", "x_bcast_bench", "x_push_bench",
             "burst_bench", "phase_bench", "x_behind_bench", "stream_bench"]  # fmt: skip
    for name in names:
        third = 0 if name == "phase_bench" else 1.0
        monkeypatch.setattr(sb, name, lambda *a, _n=name, _t=third, **k: iter([(_n, 1.0, _t)]))

    def printed(argv):
        assert sb.main(argv) == 0
        out = capsys.readouterr().out  # read once: a second read is empty
        return [n for n in names if n in out]

    assert printed(["--burst"]) == ["burst_bench"]
    assert printed(["--push", "--phases"]) == ["x_push_bench", "phase_bench"]
    assert printed(["--fresh"]) == ["x_fresh_bench"]
    assert printed(["--pdl"]) == ["x_pdl_bench"]
    assert printed([]) == names
