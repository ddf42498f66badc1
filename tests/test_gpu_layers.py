"""llama.cpp's -ngl and llama-cpp-python's n_gpu_layers: which backend they pick, on this
machine and with the GPU backends' availability made up."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest
from conftest import SMOLLM2

from picollama.backends import base
from picollama.backends.base import BackendError, gpu_layers_backend


class _Made:
    """Stands for a backend that get_backend made."""

    def __init__(self, name, options):
        self.name = name
        self.options = options


@pytest.fixture
def fake_gpus(monkeypatch):
    """get_backend and the OpenCL probe made up: ``fake_gpus["cuda"]`` /
    ``fake_gpus["opencl"]`` is None (it starts) or why it cannot."""
    state = {"cuda": "no GPU in this made-up machine", "opencl": "its device here is a CPU"}
    calls = []
    real_get_backend = base.get_backend

    def fake_get_backend(name="cpu", **options):
        if name not in base.GPU_BACKENDS:
            return real_get_backend(name, **options)
        calls.append((name, options))
        if state[name] is not None:
            raise BackendError(state[name])
        return _Made(name, options)

    monkeypatch.setattr(base, "get_backend", fake_get_backend)
    monkeypatch.setattr(base, "_opencl_gpu_missing", lambda device=None: state["opencl"])
    state["calls"] = calls
    return state


def test_no_layers_keeps_the_backend_asked_for(fake_gpus):
    assert gpu_layers_backend(0, None) == ("cpu", None)
    assert gpu_layers_backend(None, None) == ("cpu", None)
    assert gpu_layers_backend(0, "opencl") == ("opencl", None)
    assert fake_gpus["calls"] == []  # nothing is probed


def test_layers_with_a_named_backend(fake_gpus):
    assert gpu_layers_backend(99, "cuda") == ("cuda", None)
    backend, notice = gpu_layers_backend(-1, "cpu")
    assert backend == "cpu" and "ignored" in notice and "cpu backend was asked for" in notice
    assert fake_gpus["calls"] == []


def test_layers_take_cuda_first(fake_gpus):
    fake_gpus["cuda"] = None
    backend, notice = gpu_layers_backend(99, None, device=1, n_threads=3)
    assert notice is None and backend.name == "cuda"
    assert backend.options == {"n_threads": 3, "device": 1}


def test_layers_take_an_opencl_gpu_when_cuda_cannot(fake_gpus):
    fake_gpus["opencl"] = None
    backend, notice = gpu_layers_backend(20, None)
    assert notice is None and backend.name == "opencl"
    assert [name for name, _ in fake_gpus["calls"]] == ["cuda", "opencl"]


def test_layers_without_a_gpu_run_on_the_cpu_and_say_why(fake_gpus):
    backend, notice = gpu_layers_backend(99, None)
    assert backend == "cpu"
    assert notice.startswith("no usable GPU found")
    assert "cuda: no GPU in this made-up machine" in notice
    assert "opencl: its device here is a CPU" in notice
    # an OpenCL device that is only a CPU is not even built (PoCL's programs take time)
    assert [name for name, _ in fake_gpus["calls"]] == ["cuda"]


def test_layers_with_a_gpu_index_skip_an_opencl_cpu(monkeypatch):
    """-ngl 99 -mg 0 where OpenCL's device 0 is PoCL's CPU: the cpu backend and the notice,
    not OpenCL on the CPU; --device pocl names that device, and is taken as named."""
    from types import SimpleNamespace

    pytest.importorskip("pyopencl")
    from picollama.backends.opencl import device as cl_device

    real_get_backend = base.get_backend

    def no_cuda(name="cpu", **options):
        if name == "cuda":
            raise BackendError("no GPU in this made-up machine")
        if name == "opencl":
            return _Made(name, options)
        return real_get_backend(name, **options)

    picked = []

    def one_cpu_device(cl, spec=None):
        picked.append(spec)
        return SimpleNamespace(kind="CPU", label="PoCL (CPU)")

    monkeypatch.setattr(base, "get_backend", no_cuda)
    monkeypatch.setattr(cl_device, "select_device", one_cpu_device)
    backend, notice = gpu_layers_backend(99, None, device=0)
    assert backend == "cpu" and "opencl: its device here is a CPU (PoCL (CPU))" in notice
    backend, notice = gpu_layers_backend(99, None, device="pocl")
    assert notice is None and backend.name == "opencl" and backend.options["device"] == "pocl"
    assert picked == [0, "pocl"]


def test_backend_choice_reads_ngl(fake_gpus, capsys):
    from picollama.tools.cli import add_model_args, backend_choice

    p = argparse.ArgumentParser()
    add_model_args(p)
    args = p.parse_args(["-ngl", "99", "-t", "2"])
    assert backend_choice(args) == "cpu" and args.backend == "cpu"
    assert capsys.readouterr().err.startswith("warning: no usable GPU found")
    fake_gpus["cuda"] = None
    args = p.parse_args(["--n-gpu-layers", "99"])
    chosen = backend_choice(args)
    assert chosen.name == "cuda" and args.backend == "cuda"
    assert capsys.readouterr().err == ""
    with pytest.raises(BackendError, match="--no-repack is a cpu backend flag"):
        backend_choice(p.parse_args(["-ngl", "99", "-nr"]))


@pytest.mark.model
def test_llama_n_gpu_layers_without_a_gpu_warns_and_runs(fake_gpus, smollm2_path):
    from picollama import Llama

    with pytest.warns(RuntimeWarning, match="no usable GPU found"):
        llm = Llama(smollm2_path, n_ctx=64, n_threads=2, n_gpu_layers=-1, main_gpu=1)
    with llm:
        assert llm.ctx.backend.name == "cpu"
        out = llm("The capital of France is", max_tokens=3, temperature=0)
        assert "Paris" in out["choices"][0]["text"]


@pytest.mark.model
def test_cli_takes_ngl(smollm2_path):
    """`picollama-cli -ngl 99` (a llama.cpp habit) runs, on a GPU where there is one and
    with a one-line warning on the CPU where there is none; before -ngl existed argparse
    read it as -n gl."""
    r = subprocess.run(
        [sys.executable, "-m", "picollama.tools.cli", "-m", SMOLLM2, "-ngl", "99"]
        + ["-p", "The capital of France is", "-n", "4", "--temp", "0"],
        capture_output=True,
        text=True,
        timeout=600,
        stdin=subprocess.DEVNULL,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("The capital of France is Paris")
    warnings = [line for line in r.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) <= 1
    for line in warnings:
        assert "no usable GPU found" in line and "cuda:" in line


def test_server_takes_ngl(fake_gpus):
    """llama-server's -ngl: the server's flags reach the same choice."""
    from picollama.tools.cli import backend_choice
    from picollama.tools.server import build_parser

    args = build_parser().parse_args(["-ngl", "99", "-np", "2"])
    assert args.n_gpu_layers == 99 and args.parallel == 2
    fake_gpus["cuda"] = None
    assert backend_choice(args).name == "cuda"


@pytest.mark.parametrize("device", ["pocl", 1.5, True])
def test_cuda_device_is_a_gpu_index(device):
    """--device pocl meant for OpenCL reaches the CUDA backend under -ngl: a BackendError
    that names it (the next GPU backend is tried), not a TypeError from a comparison."""
    with pytest.raises(BackendError, match="device is a GPU index"):
        base.get_backend("cuda", device=device)


def test_flash_attn_flag_is_accepted(capsys):
    """llama.cpp's -fa [on|off|auto]: bare -fa once read as -f a (a prompt file "a");
    off is answered with a warning, since every backend's attention is flash-style."""
    from picollama.tools.cli import add_model_args, backend_choice

    p = argparse.ArgumentParser()
    add_model_args(p)
    for argv, value in ((["-fa"], "on"), (["-fa", "auto"], "auto"), ([], "auto")):
        args = p.parse_args(argv)
        assert args.flash_attn == value
        assert backend_choice(args) == "cpu"
        assert capsys.readouterr().err == ""
    backend_choice(p.parse_args(["--flash-attn", "off"]))
    assert "-fa off is ignored" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        p.parse_args(["-fa", "sometimes"])


def test_main_gpu_and_device_pick_the_gpu(fake_gpus, capsys):
    """-mg INDEX (llama.cpp's) and --device, in every model-loading tool's flags; a device
    asked for with -ngl where no GPU starts goes with the GPU, not into an error."""
    from picollama.tools.cli import add_model_args, backend_choice

    p = argparse.ArgumentParser()
    add_model_args(p)
    assert backend_choice(p.parse_args(["-ngl", "99", "-mg", "1"])) == "cpu"
    assert "no usable GPU" in capsys.readouterr().err
    fake_gpus["cuda"] = None
    assert backend_choice(p.parse_args(["-ngl", "99", "-mg", "1"])).options["device"] == 1
    chosen = backend_choice(p.parse_args(["--backend", "cuda", "--device", "2", "-mg", "1"]))
    assert chosen.name == "cuda" and chosen.options["device"] == 2  # --device first
    with pytest.raises(BackendError, match="cpu backend has no devices"):
        backend_choice(p.parse_args(["--backend", "cpu", "--device", "1"]))
    # -mg without -ngl or a GPU backend is ignored, as llama.cpp's is on the CPU
    assert backend_choice(p.parse_args(["-mg", "0"])) == "cpu"
    assert backend_choice(p.parse_args(["--backend", "cpu", "-mg", "1"])) == "cpu"
    assert capsys.readouterr().err == ""


@pytest.mark.model
def test_llama_takes_flash_attn_and_main_gpu(smollm2_path, recwarn):
    """llama-cpp-python's flash_attn and main_gpu keywords: accepted; flash_attn=False
    warns, since the attention is always flash-style; main_gpu alone (no GPU asked for)
    changes nothing on the CPU."""
    from picollama import Llama

    with Llama(smollm2_path, n_ctx=64, n_threads=2, flash_attn=True, main_gpu=1) as llm:
        assert llm.ctx.backend.name == "cpu"
    assert not [w for w in recwarn.list if issubclass(w.category, RuntimeWarning)]
    with pytest.warns(RuntimeWarning, match="flash_attn=False is ignored"):
        Llama(smollm2_path, n_ctx=64, n_threads=2, flash_attn=False).close()


def test_fewer_gpu_layers_than_the_model_has_get_a_note(capsys):
    """-ngl 20 of 30 layers: picollama does not split a model, and says so."""
    from types import SimpleNamespace

    from picollama.tools.cli import note_gpu_layers

    model = SimpleNamespace(args=SimpleNamespace(n_layers=30))
    note_gpu_layers(argparse.Namespace(n_gpu_layers=20, backend="cuda"), model)
    err = capsys.readouterr().err
    assert err.startswith("note: -ngl 20 of 30 layers: all 30 run on cuda")
    for n, backend in ((99, "cuda"), (-1, "cuda"), (30, "opencl"), (20, "cpu"), (None, "cuda")):
        note_gpu_layers(argparse.Namespace(n_gpu_layers=n, backend=backend), model)
        assert capsys.readouterr().err == ""
