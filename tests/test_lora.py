"""LoRA adapters: PEFT conversion, run-time application, stacking, scales, errors, server.

The oracle is transformers + peft on the tiny random llama checkpoint of tests/data/convert
(tests/gen_lora_fixtures.py made two random PEFT adapters for it and froze their logits in
tests/data/lora/logits.npz). Here both adapters go through ``picollama-convert --lora`` and
our engine; the base model through ``picollama-convert``.
"""

from __future__ import annotations

import http.client
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("safetensors")

from picollama.api import Llama  # noqa: E402
from picollama.backends.base import get_backend  # noqa: E402
from picollama.convert import ConvertError, convert_hf_to_gguf  # noqa: E402
from picollama.convert.lora import convert_lora_to_gguf  # noqa: E402
from picollama.generation import Context, Engine  # noqa: E402
from picollama.gguf import GGUFReader, GGUFWriter  # noqa: E402
from picollama.lora import LoraError, LoraSet, with_adapters, write_random_adapter  # noqa: E402
from picollama.models.base import Segment  # noqa: E402
from picollama.tools import cli, convert  # noqa: E402

DATA = Path(__file__).parent / "data"
BASE_HF = DATA / "convert" / "llama"
PEFT = DATA / "lora"
REFS = np.load(PEFT / "logits.npz")

# Logit error bounds relative to the largest |logit|, as tests/test_convert.py argues them:
# with F32 adapters our float32 forward only reorders transformers' float32 sums (measured
# 1.1e-6); the other types round each adapter weight once (F16 unit roundoff 4.9e-4, BF16
# 3.9e-3, Q8_0 about 1e-2 of a weight; Q8_0 files keep lora_b, rows of r < 32, in F16), which
# these random 2-layer models amplify a few times (measured: f16 1.4e-3, bf16 9.4e-3, q8_0
# 3.2e-2). The bounds are those of test_convert; all but q8_0's are an order of magnitude
# below what a wrong alpha/rank, an unpermuted lora_b or a transposed pair gives (the logits
# move by more than 0.1: see test_adapters_move_the_logits).
REL_ERROR = {"f32": 1e-4, "f16": 5e-3, "bf16": 4e-2, "q8_0": 1e-1}
# GPU backends: F32 matmuls whose sums run in another order, F16 adapter a1 (5e-3 above)
GPU_REL_ERROR = 1e-2
# scales of (a1, a2) for each frozen reference
CASES = {"base": (0.0, 0.0), "a1": (1.0, 0.0), "a2": (0.0, 1.0), "both": (1.0, 1.0)}
CASES["a1_half"] = (0.5, 0.0)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora")
    out = {"base": convert_hf_to_gguf(BASE_HF, d / "base.gguf", outtype="f32")}
    # Q8_0 matrices: a type the compiled decode step takes (F32 ones run op by op)
    out["base-q8_0"] = convert_hf_to_gguf(BASE_HF, d / "base-q8_0.gguf", outtype="q8_0")
    for name in ("a1", "a2"):
        for outtype in REL_ERROR:
            # a2 from the GGUF base, a1 from the HF folder: both ways of naming the base
            base = out["base"] if name == "a2" else BASE_HF
            out[f"{name}-{outtype}"] = convert_lora_to_gguf(
                PEFT / name, base, d / f"{name}-{outtype}.gguf", outtype=outtype
            )
    return out


def _ctx(path, arithmetic="exact", n_ctx=64):
    return Context(
        path, n_ctx=n_ctx, backend=get_backend("cpu", n_threads=2, arithmetic=arithmetic)
    )


def _logits(ctx, model, ids):
    ctx.model = model
    ctx.reset()
    return ctx.eval(ids, all_logits=True)


def _rel(got, expected):
    return float(np.abs(got - expected).max() / np.abs(expected).max())


# -- the converted files --------------------------------------------------------------------


def test_converted_adapter_layout(files):
    """llama.cpp's layout: metadata, lora_a (k, r) and lora_b (r, m) per adapted weight."""
    with GGUFReader(files["a2-f32"]) as r:
        assert r.get("general.type") == "adapter"
        assert r.get("adapter.type") == "lora"
        assert r.get("general.architecture") == "llama"
        # rsLoRA: alpha 4 / sqrt(8) written as alpha' with alpha' / 8 == 4 / sqrt(8)
        assert r.get("adapter.lora.alpha") == pytest.approx(4 * np.sqrt(8), rel=1e-6)
        names = sorted(t.name for t in r.tensors)
        assert len(names) == 2 * 3 * 2  # 2 layers x (q, v, down) x (a, b)
        a = r.tensor("blk.0.attn_q.weight.lora_a")
        b = r.tensor("blk.0.attn_q.weight.lora_b")
        assert tuple(a.shape) == (32, 8) and tuple(b.shape) == (8, 32)
        d = r.tensor("blk.1.ffn_down.weight.lora_a")
        assert tuple(d.shape) == (64, 8)


def test_convert_cli(files, tmp_path, capsys):
    out = tmp_path / "a1.gguf"
    assert convert.main(["--lora", str(PEFT / "a1"), "--base", str(BASE_HF), "-o", str(out)]) == 0
    with GGUFReader(out) as r, GGUFReader(files["a1-f32"]) as ref:
        assert [t.name for t in r.tensors] == [t.name for t in ref.tensors]
        for t in r.tensors:
            assert np.array_equal(t.array(), ref.tensor(t.name).array())
    assert convert.main(["--lora", str(PEFT / "a1"), "-o", str(out)]) == 2
    assert "--base" in capsys.readouterr().err


def test_convert_errors(tmp_path):
    bad = tmp_path / "peft"
    bad.mkdir()
    with pytest.raises(ConvertError, match="adapter_config.json"):
        convert_lora_to_gguf(bad, BASE_HF, tmp_path / "x.gguf")
    config = json.loads((PEFT / "a1" / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps(config))
    (bad / "adapter_model.bin").write_bytes(b"pickle")
    with pytest.raises(ConvertError, match="pickled"):
        convert_lora_to_gguf(bad, BASE_HF, tmp_path / "x.gguf")
    (bad / "adapter_model.safetensors").write_bytes(
        (PEFT / "a1" / "adapter_model.safetensors").read_bytes()
    )
    (bad / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(ConvertError, match="DoRA"):
        convert_lora_to_gguf(bad, BASE_HF, tmp_path / "x.gguf")
    (bad / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": None}))
    with pytest.raises(ConvertError, match="lora_alpha"):
        convert_lora_to_gguf(bad, BASE_HF, tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()


# -- numerics against transformers + peft ---------------------------------------------------


@pytest.mark.parametrize("outtype", list(REL_ERROR))
@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_peft(files, case, outtype):
    ctx = _ctx(files["base"])
    try:
        adapters = LoraSet(
            ctx.model, [(files[f"a1-{outtype}"], 1.0), (files[f"a2-{outtype}"], 1.0)]
        )
        got = _logits(ctx, adapters.model_for(CASES[case]), REFS["ids"].tolist())
        adapters.close()
    finally:
        ctx.close()
    assert _rel(got, REFS[case]) < REL_ERROR[outtype], case


def test_adapters_move_the_logits():
    """The references differ by O(1): the bounds above can tell a wrong adapter from a right one."""
    for case in ("a1", "a2", "both", "a1_half"):
        assert _rel(REFS[case], REFS["base"]) > 0.1, case
    assert _rel(REFS["both"], REFS["a1"]) > 0.1 and _rel(REFS["a1_half"], REFS["a1"]) > 0.1


def test_scale_zero_is_the_base_model(files):
    ctx = _ctx(files["base"])
    try:
        base = ctx.model
        adapters = LoraSet(base, [(files["a1-f32"], 0.0), (files["a2-f32"], 0.0)])
        assert adapters.model_for() is base  # no adapter term at all, not a zero-scaled one
        ids = REFS["ids"].tolist()
        expected = _logits(ctx, base, ids)
        # and a view at scale 0 for one adapter equals the view without that adapter
        only_a1 = with_adapters(base, [(adapters.adapters[0], 1.0)])
        a1_and_zero = adapters.model_for((1.0, 0.0))
        assert np.array_equal(_logits(ctx, only_a1, ids), _logits(ctx, a1_and_zero, ids))
        assert np.array_equal(_logits(ctx, base, ids), expected)
        adapters.close()
    finally:
        ctx.close()


def test_two_adapters_are_the_sum_of_their_terms(files):
    """On every adapted projection: (W + d1 + d2) x == W x + (d1 x) + (d2 x)."""
    ctx = _ctx(files["base"])
    try:
        adapters = LoraSet(ctx.model, [(files["a1-f32"], 0.7), (files["a2-f32"], -1.3)])
        both = adapters.model_for().backend
        one = adapters.model_for((0.7, 0.0)).backend
        two = adapters.model_for((0.0, -1.3)).backend
        be = ctx.backend
        rng = np.random.default_rng(0)
        weights = {**adapters.adapters[0].pairs, **adapters.adapters[1].pairs}
        assert len(weights) == 14  # a1 on all 7 projections of 2 layers; a2 a subset
        for name, pair in weights.items():
            x = rng.standard_normal((3, pair.base.k)).astype(np.float32)
            y = be.matmul(x, pair.base)
            expected = y + (one.matmul(x, pair.base) - y) + (two.matmul(x, pair.base) - y)
            got = both.matmul(x, pair.base)
            # float32 sums in another order: a few ulps of the largest term
            np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5 * np.abs(y).max())
            if name in adapters.adapters[1].pairs and name in adapters.adapters[0].pairs:
                assert np.abs(got - one.matmul(x, pair.base)).max() > 1e-3
        adapters.close()
    finally:
        ctx.close()


def test_compiled_decode_step_with_adapters(files):
    """ggml arithmetic: the compiled single-token step of a LoRA view is trusted (its logits
    equal the op-by-op pass bit for bit) and its answers follow the adapters."""
    ctx = _ctx(files["base-q8_0"], arithmetic="ggml")
    try:
        base = ctx.model
        adapters = LoraSet(base, [(files["a1-f16"], 1.0), (files["a2-bf16"], 0.5)])
        view = adapters.model_for()
        ids = REFS["ids"].tolist()
        ctx.model = view
        ctx.reset()
        ctx.eval(ids[:4])
        steps = []
        for tok in ids[4:]:
            steps.append(ctx.eval([tok]))
        program = ctx.backend._steps.program(view)
        assert program is not False and program is not None and program.trusted
        assert sum(row[0] == 12 for row in program.code) == 14 + 6  # one LoRA op per term
        # terms on one input run side by side, a run ending where a term reads an earlier
        # one's output: per layer [Q a1], [Q a2 (reads Q a1), K a1, V a1], [V a2], [O a1],
        # [gate a1, up a1], [down a1], [down a2]
        runs = sorted(int(row[8]) for row in program.code if row[0] == 12 and row[8] > 1)
        assert runs == [2, 2, 3, 3], runs
        # a fresh op-by-op pass over the same tokens
        cache = view.new_cache(64)
        seg = [Segment(np.array(ids), 0, cache, np.arange(len(ids)))]
        full = view.forward_batch(seg)[0]
        # prefill (many rows) and single steps sum in different orders: float32 noise only
        np.testing.assert_allclose(
            np.array(steps), full[4:], rtol=0, atol=1e-4 * np.abs(full).max()
        )
        assert _rel(full, REFS["both"]) > 0.05  # a2 at 0.5 is not a2 at 1
        # the base model's own program is another one, untouched by the adapters
        ctx.model = base
        ctx.reset()
        plain = [ctx.eval([tok]) for tok in ids[:3]]
        assert ctx.backend._steps.program(base) is not view
        assert _rel(np.array(plain), full[:3]) > 0.05
        adapters.close()
    finally:
        ctx.close()


# -- errors at load -------------------------------------------------------------------------


def _write_adapter(path, arch="llama", alpha=4.0, tensors=None, kind="adapter"):
    w = GGUFWriter(path, arch=arch)
    w.add_string("general.type", kind)
    w.add_string("adapter.type", "lora")
    if alpha is not None:
        w.add_float32("adapter.lora.alpha", alpha)
    rng = np.random.default_rng(0)
    if tensors is None:
        tensors = {"blk.0.attn_q.weight.lora_a": (4, 32), "blk.0.attn_q.weight.lora_b": (32, 4)}
    for name, np_shape in tensors.items():
        w.add_tensor(name, rng.standard_normal(np_shape).astype(np.float32))
    w.write()
    return path


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"arch": "gemma3"}, "architecture 'gemma3' does not match the model's 'llama'"),
        ({"alpha": None}, "adapter.lora.alpha is missing"),
        ({"kind": "model"}, "not 'adapter'"),
        ({"tensors": {"blk.0.attn_q.weight.lora_a": (4, 32)}}, "lora_b' is missing"),
        (
            {
                "tensors": {
                    "blk.9.attn_q.weight.lora_a": (4, 32),
                    "blk.9.attn_q.weight.lora_b": (32, 4),
                }
            },
            "'blk.9.attn_q.weight' is not a weight of the model",
        ),
        ({"tensors": {"blk.0.attn_norm.weight": (32,)}}, "not a .lora_a/.lora_b tensor"),
        (
            {
                "tensors": {
                    "blk.0.attn_q.weight.lora_a": (32, 4),
                    "blk.0.attn_q.weight.lora_b": (4, 32),
                }
            },
            "do not fit the weight's shape",
        ),
        (
            {
                "tensors": {
                    "blk.0.attn_k.weight.lora_a": (4, 32),
                    "blk.0.attn_k.weight.lora_b": (32, 4),
                }
            },
            "do not fit the weight's shape",  # attn_k has 16 outputs (2 KV heads of 8)
        ),
        (
            {
                "tensors": {
                    "blk.0.attn_q.weight.lora_a": (4, 32),
                    "blk.0.attn_q.weight.lora_b": (32, 8),
                }
            },
            "has rank 4 but lora_b",
        ),
    ],
)
def test_bad_adapters_are_clear_errors(files, tmp_path, kwargs, message):
    path = _write_adapter(tmp_path / "bad.gguf", **kwargs)
    llm = Llama(str(files["base"]), n_ctx=64, n_threads=2)
    try:
        with pytest.raises(LoraError, match=message.replace("(", r"\(").replace(".", r"\.")):
            LoraSet(llm.ctx.model, [(path, 1.0)])
        # the base model keeps serving
        out = llm.create_completion(REFS["ids"].tolist()[:5], max_tokens=3, temperature=0)
        assert out["usage"]["completion_tokens"] == 3
    finally:
        llm.close()


def test_model_file_as_adapter(files):
    engine = Engine(files["base"])
    try:
        with pytest.raises(LoraError, match="general.type is 'model'"):
            LoraSet(engine.model, [(files["base"], 1.0)])
    finally:
        engine.close()


def test_cli_errors_are_one_line(files, tmp_path, capsys):
    bad = _write_adapter(tmp_path / "bad.gguf", arch="gemma3")
    args = ["-m", str(files["base"]), "-p", "x", "-n", "2", "--temp", "0", "-c", "64"]
    assert cli.main([*args, "--lora", str(bad)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not match the model's 'llama'" in err[0]
    assert cli.main([*args, "--lora-scaled", str(files["a1-f32"]), "big"]) == 1
    assert "is not a number" in capsys.readouterr().err


# -- the API --------------------------------------------------------------------------------


def test_api_adapters_and_switching(files):
    ids = REFS["ids"].tolist()
    llm = Llama(
        str(files["base"]),
        n_ctx=64,
        n_threads=2,
        lora_adapters=[(str(files["a1-f32"]), 1.0)],
        lora_path=str(files["a2-f32"]),  # llama-cpp-python's spelling adds one more
        lora_scale=1.0,
    )
    try:
        assert [a["scale"] for a in llm.lora_adapters()] == [1.0, 1.0]
        # ggml arithmetic (the default) rounds activations to Q8/F16 as llama.cpp does; the
        # exact-arithmetic tests above pin the numerics, here only which adapters are active
        both = llm.ctx.eval(ids, all_logits=True)
        assert _rel(both, REFS["both"]) < 5e-2
        weights = llm.ctx.model._lora_base.layers[0].wq
        llm.set_lora_adapters([{"id": 0, "scale": 1.0}])  # a2 -> 0, no reload
        assert llm.ctx.model._lora_base.layers[0].wq is weights
        assert _rel(llm.ctx.eval(ids, all_logits=True), REFS["a1"]) < 5e-2
        llm.set_lora_adapters([])
        assert _rel(llm.ctx.eval(ids, all_logits=True), REFS["base"]) < 5e-2
        with pytest.raises(LoraError, match="id 2"):
            llm.set_lora_adapters([{"id": 2, "scale": 1.0}])
    finally:
        llm.close()


def test_random_adapter_writer(files, tmp_path):
    engine = Engine(files["base"])
    try:
        path = tmp_path / "r.gguf"
        write_random_adapter(engine.model, path, rank=3)
        adapters = LoraSet(engine.model, [(path, 1.0)])
        assert len(adapters.adapters[0].pairs) == 14
        assert all(p.rank == 3 for p in adapters.adapters[0].pairs.values())
        adapters.close()
    finally:
        engine.close()


# -- the server -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lora_server(files):
    from picollama.server import App, ServerConfig, make_server

    engine = Engine(files["base"], n_threads=2)
    config = ServerConfig(
        n_slots=4,
        n_ctx=4 * 64,
        lora_adapters=[(str(files["a1-f32"]), 1.0), (str(files["a2-f32"]), 1.0)],
    )
    app = App(engine, config)
    app.start()
    httpd = make_server(app, "127.0.0.1", 0, log=False)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield app, httpd.server_address[1]
    httpd.shutdown()
    httpd.server_close()
    app.stop()
    engine.close()


def _request(port, method, path, body=None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    data = json.dumps(body).encode() if body is not None else None
    conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    out = json.loads(resp.read())
    conn.close()
    return resp.status, out


def _complete(port, lora=None, prompt=None):
    body = {"prompt": prompt or REFS["ids"].tolist()[:6], "n_predict": 12, "temperature": 0}
    if lora is not None:
        body["lora"] = lora
    status, out = _request(port, "POST", "/completion", body)
    assert status == 200, out
    return out["content"]


LORA_SETS = {
    "none": [],
    "a1": [{"id": 0, "scale": 1.0}],
    "a2": [{"id": 1, "scale": 1.0}],
    "both": [{"id": 0, "scale": 1.0}, {"id": 1, "scale": 1.0}],
}


def test_server_lists_and_sets_adapters(lora_server):
    app, port = lora_server
    status, listed = _request(port, "GET", "/lora-adapters")
    assert status == 200
    assert [(a["id"], a["scale"]) for a in listed] == [(0, 1.0), (1, 1.0)]
    assert listed[0]["path"].endswith("a1-f32.gguf")
    model = app.engine.model
    both = _complete(port)  # the global scales: both adapters
    assert both == _complete(port, LORA_SETS["both"])
    status, out = _request(port, "POST", "/lora-adapters", [{"id": 1, "scale": 1.0}])
    assert status == 200 and out == {"success": True}
    assert [a["scale"] for a in _request(port, "GET", "/lora-adapters")[1]] == [0.0, 1.0]
    assert _complete(port) == _complete(port, LORA_SETS["a2"]) != both
    assert app.engine.model is model  # nothing reloaded
    _request(port, "POST", "/lora-adapters", [{"id": 0, "scale": 1.0}, {"id": 1, "scale": 1.0}])
    status, out = _request(
        port, "POST", "/completion", {"prompt": "x", "lora": [{"id": 7, "scale": 1}]}
    )
    assert status == 400 and "id 7" in out["error"]["message"]
    status, out = _request(port, "POST", "/lora-adapters", [{"id": 0, "scale": "big"}])
    assert status == 400 and "not a number" in out["error"]["message"]


def test_server_no_cross_talk_between_adapters(lora_server):
    """Concurrent requests with different adapters (4 slots, batched steps) get exactly the
    answers each gets alone."""
    _, port = lora_server
    prompts = [REFS["ids"].tolist()[:6], REFS["ids"].tolist()[3:9]]
    lone = {
        (k, i): _complete(port, v, p) for k, v in LORA_SETS.items() for i, p in enumerate(prompts)
    }
    assert len(set(lone.values())) == len(lone), "every adapter set must answer differently"
    jobs = list(lone) * 2
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda j: _complete(port, LORA_SETS[j[0]], prompts[j[1]]), jobs))
    for job, answer in zip(jobs, answers, strict=True):
        assert answer == lone[job], job


# -- GPU backends ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["cuda", "opencl"])
def test_gpu_backends_apply_adapters(files, name):
    """The backend's default lora_add (two matmuls, a scale, an add) on a GPU: prefill and
    single-token steps (CUDA replays recorded steps) follow the adapters."""
    from picollama.backends.base import BackendError

    try:
        backend = get_backend(name)
    except BackendError as err:
        pytest.skip(f"{name} backend unavailable here: {err}")
    ctx = Context(files["base"], n_ctx=64, backend=backend)
    try:
        adapters = LoraSet(ctx.model, [(files["a1-f16"], 1.0), (files["a2-f32"], 1.0)])
        ids = REFS["ids"].tolist()
        for case in ("both", "a1", "base"):
            got = _logits(ctx, adapters.model_for(CASES[case]), ids)
            assert _rel(got, REFS[case]) < GPU_REL_ERROR, case
            ctx.reset()
            ctx.eval(ids[:4])
            steps = np.array([ctx.eval([tok]) for tok in ids[4:]])
            assert _rel(steps, REFS[case][4:]) < GPU_REL_ERROR, case
        adapters.close()
    finally:
        ctx.close()


# -- every architecture: the adapter equals its merged weights -------------------------------


def _merged_copy(base_path, adapter_path, scale, out):
    """llama-export-lora's merge, in float64: each adapted W becomes W + scale * alpha / r *
    B A (F32); every other tensor and key is copied as is."""
    from picollama.gguf.constants import GGUFValueType
    from picollama.quant import dequantize

    with GGUFReader(base_path) as base, GGUFReader(adapter_path) as ad:
        alpha = ad.get("adapter.lora.alpha")
        w = GGUFWriter(out)
        for key, value in base.metadata.items():
            if key == "general.alignment":
                continue
            vtype = base.value_type(key)
            if vtype == GGUFValueType.ARRAY:
                w.add_array(key, value, base.array_type(key))
            else:
                w.add_value(key, value, vtype)
        for t in base.tensors:
            data = dequantize(t.data, t.type).reshape(t.shape[::-1]).astype(np.float64)
            if t.name + ".lora_a" in ad:
                info_a, info_b = ad.tensor(t.name + ".lora_a"), ad.tensor(t.name + ".lora_b")
                a = dequantize(info_a.data, info_a.type).reshape(info_a.shape[::-1])
                b = dequantize(info_b.data, info_b.type).reshape(info_b.shape[::-1])
                data = data + scale * alpha / a.shape[0] * (b.astype(np.float64) @ a)
            w.add_tensor(t.name, data.astype(np.float32))
        w.write()
    return out


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen2", "qwen3", "phi3", "gemma2"])
def test_adapter_equals_merged_weights(tmp_path, arch):
    """A random adapter on every projection (SwiGLU and GeGLU blocks, tied embeddings) gives
    the logits of the model with the adapter merged into its weights."""
    base = convert_hf_to_gguf(DATA / "convert" / arch, tmp_path / "base.gguf", outtype="f32")
    ids = json.loads((DATA / "convert" / arch / "refs.json").read_text())["prompts"][0]["ids"]
    ctx = _ctx(base)
    try:
        adapter = tmp_path / "random.gguf"
        write_random_adapter(ctx.model, adapter, rank=5, alpha=10.0, ggml_type=0, seed=3)
        lora = LoraSet(ctx.model, [(adapter, 0.7)])
        got = _logits(ctx, lora.model_for(), ids)
        plain = _logits(ctx, lora.model, ids)
        lora.close()
    finally:
        ctx.close()
    merged_ctx = _ctx(_merged_copy(base, adapter, 0.7, tmp_path / "merged.gguf"))
    try:
        expected = merged_ctx.eval(ids, all_logits=True)
    finally:
        merged_ctx.close()
    # float32 sums in two orders (W x + B (A x) against (W + B A) x): REL_ERROR["f32"]
    # (measured at most 1.5e-6, gemma2; without the adapter at least 0.31, gemma3)
    assert _rel(got, expected) < REL_ERROR["f32"]
    assert _rel(plain, expected) > 100 * REL_ERROR["f32"]  # the adapter matters


def test_server_and_perplexity_flags(files, tmp_path, capsys):
    from picollama.tools import perplexity, server

    bad = _write_adapter(tmp_path / "bad.gguf", alpha=None)
    assert server.main(["-m", str(files["base"]), "--port", "0", "--lora", str(bad)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "adapter.lora.alpha is missing" in err[0]

    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 8)
    ppl = {}
    for name, flags in [("base", []), ("a1", ["--lora", str(files["a1-f32"])])]:
        args = ["-m", str(files["base"]), "-f", str(text), "-c", "32", "-t", "2", *flags]
        assert perplexity.main(args) == 0
        out = capsys.readouterr().out
        ppl[name] = float(out.split("PPL = ")[1].split()[0])
    assert ppl["base"] != ppl["a1"]
