"""picollama-server against a live process on 127.0.0.1 with SmolLM2.

Endpoints, the official ``openai`` client, the server items of RELIABILITY.md (33-43),
cancellation, the queue, prompt reuse, and a load test with no cross-talk between slots
(8 clients x 10 requests). Generation is kept short (a few tokens) so the file runs in a
few minutes on a small CPU.
"""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

KEY = "sk-test-key"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model, *args: str):
        self.port = _free_port()
        cmd = [
            sys.executable,
            "-m",
            "picollama.tools.server",
            "-m",
            str(model),
            "--port",
            str(self.port),
            "--log-disable",
            *args,
        ]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(self.proc.stderr.read().decode())
            try:
                if self.request("GET", "/health")[0] == 200:
                    return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError("server did not start")

    def request(self, method, path, body=None, headers=None, key=KEY, raw=None, timeout=120):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        h = {"Content-Type": "application/json"}
        if key:
            h["Authorization"] = f"Bearer {key}"
        h.update(headers or {})
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        conn.request(method, path, body=data, headers=h)
        resp = conn.getresponse()
        payload = resp.read()
        conn.close()
        try:
            parsed = json.loads(payload) if payload else None
        except ValueError:
            parsed = payload.decode("utf-8", "replace")
        return resp.status, parsed, resp

    def post(self, path, body, **kw):
        return self.request("POST", path, body, **kw)

    def metric(self, name: str) -> float:
        _, text, _ = self.request("GET", "/metrics")
        for line in text.splitlines():
            if line.startswith(f"llamacpp:{name} "):
                return float(line.split()[1])
        raise KeyError(name)

    def wait_idle(self, timeout=30.0) -> bool:
        deadline = time.time() + timeout
        while time.time() < deadline:
            _, slots, _ = self.request("GET", "/slots")
            if not any(s["is_processing"] for s in slots) and self.metric("requests_deferred") == 0:
                return True
            time.sleep(0.1)
        return False

    def close(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture(scope="module")
def server(smollm2_path):
    srv = Server(smollm2_path, "-np", "4", "-c", "2048", "--api-key", KEY, "--queue-size", "16")
    # warm up (compiles the kernels) so the tests below time only themselves
    srv.post("/completion", {"prompt": "Hi", "n_predict": 2, "temperature": 0})
    yield srv
    srv.close()


def _is_error(status, body, code):
    assert status == code, body
    assert set(body["error"]) >= {"message", "type", "code"}, body
    assert body["error"]["code"] == code


CHAT = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, "temperature": 0}


# -- endpoints --------------------------------------------------------------------------------


def test_simple_endpoints(server):
    assert server.request("GET", "/health", key=None)[:2] == (200, {"status": "ok"})
    status, models, _ = server.request("GET", "/v1/models")
    assert status == 200 and models["data"][0]["id"].startswith("smollm2")
    status, props, _ = server.request("GET", "/props")
    assert props["total_slots"] == 4 and props["default_generation_settings"]["n_ctx"] == 512
    status, text, resp = server.request("GET", "/metrics")
    assert status == 200 and "llamacpp:requests_processing" in text
    assert resp.getheader("Content-Type").startswith("text/plain")
    status, tok, _ = server.post("/tokenize", {"content": "Hello world", "with_pieces": True})
    ids = [t["id"] for t in tok["tokens"]]
    assert "".join(t["piece"] for t in tok["tokens"]) == "Hello world"
    assert server.post("/detokenize", {"tokens": ids})[1] == {"content": "Hello world"}
    status, tpl, _ = server.post(
        "/apply-template", {"messages": [{"role": "user", "content": "X"}]}
    )
    assert status == 200 and "<|im_start|>user\nX<|im_end|>" in tpl["prompt"]


def test_native_completion(server):
    status, out, _ = server.post(
        "/completion",
        {
            "prompt": "The capital of France is",
            "n_predict": 3,
            "temperature": 0,
            "n_probs": 2,
            "cache_prompt": True,
        },
    )
    assert status == 200, out
    assert out["stop"] is True and out["tokens_predicted"] == 3 and out["stop_type"] == "limit"
    assert {"prompt_n", "predicted_n", "predicted_per_second"} <= set(out["timings"])
    assert len(out["completion_probabilities"]) == 3
    assert len(out["completion_probabilities"][0]["top_logprobs"]) == 2
    # streamed: data: events, the last with stop=true, and no [DONE]
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request(
        "POST",
        "/completion",
        json.dumps(
            {"prompt": "The capital of France is", "n_predict": 3, "temperature": 0, "stream": True}
        ),
        {"Authorization": f"Bearer {KEY}"},
    )
    body = conn.getresponse().read().decode()
    events = [json.loads(e[6:]) for e in body.split("\n\n") if e.startswith("data: ")]
    assert "[DONE]" not in body and events[-1]["stop"] is True
    assert "".join(e["content"] for e in events) == out["content"]
    # the same prompt again reuses the cached prefix
    assert events[-1]["timings"]["cache_n"] >= 4


def test_prefix_reuse_across_slots(server):
    prompt = "Once upon a time, in a land far away, there lived a curious little fox. " * 4
    a = server.post("/completion", {"prompt": prompt + "A", "n_predict": 1, "id_slot": 0})[1]
    b = server.post("/completion", {"prompt": prompt + "B", "n_predict": 1, "id_slot": 1})[1]
    assert a["id_slot"] == 0 and b["id_slot"] == 1
    # slot 1 never saw this prompt: the shared prefix was copied from slot 0's cache
    assert b["timings"]["cache_n"] >= len(prompt) // 8
    assert b["timings"]["prompt_n"] <= 4


def test_prefix_tree_outlives_its_slot(server):
    """A prefix stays shared after the slot that computed it has moved on to another prompt,
    and an answer built on it equals the one computed from scratch."""
    prompt = "In a quiet harbour town, an old sailor mends his nets and tells stories. "
    first = {"prompt": prompt + "One", "n_predict": 6, "temperature": 0, "id_slot": 2}
    assert server.post("/completion", first)[0] == 200
    other = {"prompt": "Something else entirely.", "n_predict": 1, "id_slot": 2}
    assert server.post("/completion", other)[0] == 200  # slot 2 no longer holds the prefix
    body = {"prompt": prompt + "Two", "n_predict": 6, "temperature": 0, "id_slot": 3}
    status, reused, _ = server.post("/completion", body)
    assert status == 200 and reused["id_slot"] == 3
    assert reused["timings"]["cache_n"] >= 10 and reused["timings"]["prompt_n"] <= 3
    assert server.metric("prefix_cache_tokens") >= reused["timings"]["cache_n"]
    # under 64 prompt tokens the reused prefix gives the same logits as a whole prefill
    fresh = server.post("/completion", {**body, "cache_prompt": False, "id_slot": 1})[1]
    assert fresh["timings"]["cache_n"] == 0
    assert reused["content"] == fresh["content"]


@pytest.mark.parametrize("tree_tokens", [-1, 0], ids=["tree", "slot-copy"])
def test_scheduler_prefix_sources(smollm2_path, tree_tokens):
    """In process: with the tree, a prefix outlives its slot; without it (device caches,
    or --prefix-cache-tokens 0), a slot copies from another slot that still holds it."""
    from picollama.generation import Engine
    from picollama.sampling.samplers import Sampler, SamplingParams
    from picollama.server.scheduler import GenRequest, Scheduler

    engine = Engine(smollm2_path)
    sched = Scheduler(engine, 2, 128, prefix_cache_tokens=tree_tokens)
    assert (sched.tree is None) == (tree_tokens == 0)
    shared = engine.tokenizer.encode("A long shared beginning of a prompt, word after word,")

    def run(prompt, slot):
        req = GenRequest(prompt, Sampler(SamplingParams(temperature=0)), 2, id_slot=slot)
        sched.submit([req])
        while (ev := req.out.get(timeout=120)).kind == "token":
            pass
        assert ev.kind == "done", ev.message
        return ev.stats

    sched.start()
    try:
        assert run(shared + [11], 0)["prompt_cached"] == 0
        assert run(shared + [12], 1)["prompt_cached"] == len(shared)  # from slot 0 or the tree
        run([5, 6, 7], 0)
        run([8, 9], 1)  # neither slot holds the shared part any more
        n = run(shared + [13], 0)["prompt_cached"]
        assert n == (len(shared) if tree_tokens else 0)
    finally:
        sched.stop()


def test_scheduler_survives_a_request_that_cannot_start(smollm2_path):
    from picollama.generation import Engine
    from picollama.sampling.samplers import Sampler, SamplingParams
    from picollama.server.scheduler import GenRequest, Scheduler

    sched = Scheduler(Engine(smollm2_path), 1, 64)

    def boom(*args):
        raise RuntimeError("no copy")

    sched._copy_prefix = boom
    sched.start()
    try:
        req = GenRequest([1, 2, 3], Sampler(SamplingParams(temperature=0)), 2)
        sched.submit([req])
        ev = req.out.get(timeout=60)
        assert ev.kind == "error" and "no copy" in ev.message
        del sched._copy_prefix  # the next request is served normally
        req = GenRequest([1, 2, 3], Sampler(SamplingParams(temperature=0)), 2)
        sched.submit([req])
        while (ev := req.out.get(timeout=60)).kind == "token":
            pass
        assert ev.kind == "done" and ev.finish_reason == "length"
    finally:
        sched.stop()


def test_a_request_that_does_not_stream_gets_its_events_at_the_end(smollm2_path):
    """A non-streamed request's token events wait in the scheduler and reach its queue with
    the last one (its handler thread wakes once, not once a token), the same events, in the
    same order, as a streamed request with the same seed gets one by one."""
    from picollama.generation import Engine
    from picollama.sampling.samplers import Sampler, SamplingParams
    from picollama.server.scheduler import GenRequest, Scheduler

    sched = Scheduler(Engine(smollm2_path), 2, 128)
    prompt = [1, 504, 3458, 314]

    def request(stream):
        params = SamplingParams(temperature=0.8, seed=7)
        return GenRequest(prompt, Sampler(params), 12, ignore_eos=True, stream=stream)

    sched.start()
    try:
        held, streamed = request(False), request(True)
        sched.submit([held, streamed])
        first = streamed.out.get(timeout=120)
        assert first.kind == "token"
        assert held.out.empty()  # the other slot has decoded its first token too
        events = {}
        for req in (held, streamed):
            got = [] if req is held else [first]
            while not got or got[-1].kind == "token":
                got.append(req.out.get(timeout=120))
            events[req.stream] = [(e.kind, e.text, e.token, e.finish_reason) for e in got]
        assert events[False] == events[True]
        assert len(events[True]) == 13 and events[True][-1][3] == "length"
    finally:
        sched.stop()


class _Cache:
    """A KV cache's shape as the prefix tree sees it: per-layer arrays indexed by position."""

    def __init__(self, n_layers=2, n_ctx=16):
        self.n_ctx = n_ctx
        self.k = [np.zeros((n_ctx, 2, 3), np.uint16) for _ in range(n_layers)]
        self.v = [np.zeros((n_ctx, 2, 3), np.uint16) for _ in range(n_layers)]

    def fill(self, tokens):  # rows that depend on the whole prefix, as real KV does
        for pos in range(len(tokens)):
            code = (hash(tuple(tokens[: pos + 1])) % 60000) + 1
            for layer, (k, v) in enumerate(zip(self.k, self.v, strict=True)):
                k[pos] = code + layer
                v[pos] = code + 7 * layer
        return self


def test_prefix_tree_unit():
    from picollama.server.prefix_tree import PrefixTree

    a, b, c = [1, 2, 3, 4, 5], [1, 2, 3, 9, 9, 9], [7, 7, 7]
    tree = PrefixTree(capacity=10)
    assert tree.insert("m", a, _Cache().fill(a)) == 5
    assert tree.match("m", [1, 2, 3, 8]) == 3 and tree.match("other view", a) == 0
    assert tree.insert("m", b, _Cache().fill(b)) == 3  # splits the edge after [1, 2, 3]
    assert tree.n_tokens == 8 and tree.match("m", a) == 5 and tree.match("m", b) == 6
    assert tree.insert("m", a, _Cache().fill(a)) == 0  # nothing new
    # restore copies exactly positions start..reached, from both edges of b's path
    dst, want = _Cache(), _Cache().fill(b)
    assert tree.restore("m", b, dst, 1, 5) == 5
    for layer in range(2):
        assert np.array_equal(dst.k[layer][1:5], want.k[layer][1:5])
        assert np.array_equal(dst.v[layer][1:5], want.v[layer][1:5])
        assert not dst.k[layer][0].any() and not dst.k[layer][5:].any()
    assert tree.restore("m", [6, 6], dst, 0, 2) == 0
    # full: the least recently used leaf goes ([4, 5]: b was restored after a's last use)
    assert tree.insert("m", c, _Cache().fill(c)) == 3
    assert tree.n_tokens == 9 and tree.match("m", a) == 3 and tree.match("m", b) == 6
    assert tree.match("m", c) == 3
    # a sequence longer than the whole tree keeps its first `capacity` tokens
    big = list(range(100, 120))
    assert tree.insert("m", big, _Cache(n_ctx=20).fill(big)) == 10
    assert tree.n_tokens == 10 and tree.match("m", big) == 10
    assert PrefixTree(0).insert("m", a, _Cache().fill(a)) == 0
    with pytest.raises(ValueError, match="capacity"):
        PrefixTree(-1)


def test_prefix_tree_against_brute_force():
    """Random sequences over a small alphabet (many shared prefixes, many splits): the tree
    matches as the longest common prefix with any inserted sequence, and restores the rows
    that sequence's cache had."""
    from picollama.server.prefix_tree import PrefixTree

    rng = np.random.default_rng(7)
    tree, seqs = PrefixTree(capacity=10_000), []
    for _ in range(60):
        seq = rng.integers(0, 3, rng.integers(1, 12)).tolist()
        tree.insert("m", seq, _Cache(n_ctx=12).fill(seq))
        seqs.append(seq)
        probe = rng.integers(0, 3, rng.integers(1, 12)).tolist()
        want = max(_common(probe, s) for s in seqs)
        assert tree.match("m", probe) == want, (probe, seqs)
        dst, ref = _Cache(n_ctx=12), _Cache(n_ctx=12).fill(probe)
        assert tree.restore("m", probe, dst, 0, len(probe)) == want
        for layer in range(2):
            assert np.array_equal(dst.k[layer][:want], ref.k[layer][:want])
    assert tree.n_tokens == len(set(_prefixes(seqs)))


def _common(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _prefixes(seqs):
    return [tuple(s[: i + 1]) for s in seqs for i in range(len(s))]


def test_logprobs_and_n(server):
    body = {**CHAT, "logprobs": True, "top_logprobs": 3, "n": 2}
    status, out, _ = server.post("/v1/chat/completions", body)
    assert status == 200, out
    assert len(out["choices"]) == 2
    assert out["choices"][0]["message"]["content"] == out["choices"][1]["message"]["content"]
    lp = out["choices"][0]["logprobs"]["content"]
    assert len(lp) == 4 and len(lp[0]["top_logprobs"]) == 3
    assert lp[0]["logprob"] == pytest.approx(lp[0]["top_logprobs"][0]["logprob"])


# -- the openai client ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key=KEY, max_retries=0)


def test_openai_chat(client):
    r = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Say hi."}],
        max_tokens=4,
        temperature=0,
        seed=1,
    )
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content
    assert r.usage.completion_tokens == 4 and r.choices[0].finish_reason == "length"
    stream = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Say hi."}],
        max_tokens=4,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 4
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_openai_completions(client):
    r = client.completions.create(
        model="smollm2", prompt="One, two, three,", max_tokens=4, temperature=0, stop=["\n\n\n"]
    )
    assert r.choices[0].text and r.usage.completion_tokens <= 4
    chunks = list(
        client.completions.create(
            model="smollm2", prompt="One, two, three,", max_tokens=4, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text


def test_openai_json_schema(client):
    jsonschema = pytest.importorskip("jsonschema")
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}},
        "required": ["name"],
        "additionalProperties": False,
    }
    r = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Invent a person."}],
        max_tokens=40,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}},
    )
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_openai_tool_call(client):
    # SmolLM2's template knows no tools: llama.cpp's generic format (a schema-constrained
    # JSON reply) makes the tool call parsable
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather in a city",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 12}},
                    "required": ["city"],
                },
            },
        }
    ]
    r = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=tools,
        tool_choice="required",
        max_tokens=40,
        temperature=0,
    )
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments)["city"], str)


def test_openai_bad_key(server):
    openai = pytest.importorskip("openai")
    bad = openai.OpenAI(
        base_url=f"http://127.0.0.1:{server.port}/v1", api_key="nope", max_retries=0
    )
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


# -- RELIABILITY 33-43 ------------------------------------------------------------------------


def test_bad_bodies(server):  # 33
    for raw in (
        b"{bad",
        b"",
        b"[1, 2]",
        '{"prompt": "\u4f60\u597d"}'.encode("gbk"),
        b"\xff\xfe{}",
        b"{" * 100000,
    ):
        status, body, _ = server.post("/v1/completions", None, raw=raw)
        _is_error(status, body, 400)
    # a huge body is refused from its Content-Length, unread
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.putrequest("POST", "/v1/completions")
    conn.putheader("Authorization", f"Bearer {KEY}")
    conn.putheader("Content-Length", str(100 * 1024 * 1024))
    conn.endheaders()
    conn.send(b"{" + b" " * 65536)
    resp = conn.getresponse()
    _is_error(resp.status, json.loads(resp.read()), 413)
    conn.close()
    assert server.request("GET", "/health")[0] == 200


def test_prompt_over_context(server):  # 34
    status, body, _ = server.post("/v1/completions", {"prompt": "word " * 600, "max_tokens": 4})
    _is_error(status, body, 400)
    assert body["error"]["n_ctx"] == 512 and body["error"]["n_prompt_tokens"] > 512
    status, body, _ = server.post(
        "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "x " * 600}]}
    )
    _is_error(status, body, 400)
    assert body["error"]["type"] == "exceed_context_size_error"


BAD_PARAMS = [
    ("/v1/completions", {"max_tokens": 0}),
    ("/v1/completions", {"max_tokens": -1}),
    ("/v1/completions", {"max_tokens": 10**9}),
    ("/v1/chat/completions", {"max_completion_tokens": 10**9}),
    ("/v1/completions", {"temperature": -1}),
    ("/v1/completions", {"temperature": "hot"}),
    ("/v1/completions", {"top_p": 1.1}),
    ("/v1/completions", {"min_p": -0.1}),
    ("/v1/completions", {"top_k": -5}),
    ("/v1/completions", {"n_keep": -2}),
    ("/v1/completions", {"n_discard": -1}),
    ("/v1/completions", {"logit_bias": {"999999": 1}}),
    ("/v1/completions", {"logit_bias": {"-1": 1}}),
    ("/v1/completions", {"logprobs": 1000}),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}),
    ("/v1/completions", {"n": 1000}),
    ("/v1/completions", {"stop": [1, 2]}),
    ("/v1/completions", {"seed": "x"}),
    ("/v1/completions", {"prompt": [999999]}),
    ("/v1/completions", {"prompt": {"a": 1}}),
    ("/v1/completions", {"grammar": 'root ::= "unterminated'}),
    ("/v1/completions", {"json_schema": {"$ref": "#/definitions/nope"}}),
    ("/v1/completions", {"response_format": {"type": "xml"}}),
    ("/completion", {"n_predict": -5}),
    ("/completion", {"n_probs": 1000}),
    ("/v1/chat/completions", {"messages": "hi"}),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}]}),
    ("/v1/chat/completions", {"chat_template_kwargs": {"x": 1}}),
    ("/v1/chat/completions", {"tools": [{"type": "function"}]}),
    (
        "/v1/chat/completions",
        {
            "tool_choice": {"type": "function", "function": {"name": "z"}},
            "tools": [{"type": "function", "function": {"name": "a"}}],
        },
    ),
    ("/detokenize", {"tokens": [-1]}),
    ("/detokenize", {"tokens": [49152]}),
    ("/detokenize", {"tokens": [2**31]}),
    ("/tokenize", {"content": 5}),
]


@pytest.mark.parametrize("path,fields", BAD_PARAMS, ids=[json.dumps(f) for _, f in BAD_PARAMS])
def test_bad_parameters(server, path, fields):  # 35, 36, 24, 21, 27, 32
    base = {"prompt": "Hi", "max_tokens": 2} if "completion" in path else {}
    if path == "/v1/chat/completions":
        base = dict(CHAT)
    status, body, _ = server.post(path, {**base, **fields})
    _is_error(status, body, 400)


def test_api_key_on_every_route(server):  # 39
    routes = [
        ("GET", "/v1/models"),
        ("GET", "/props"),
        ("GET", "/slots"),
        ("GET", "/metrics"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/completions"),
        ("POST", "/completion"),
        ("POST", "/tokenize"),
        ("POST", "/detokenize"),
        ("POST", "/apply-template"),
        ("GET", "/nope"),
    ]
    for method, path in routes:
        for key in (None, "wrong", KEY + "x", KEY[:-1]):
            status, body, resp = server.request(
                method, path, {} if method == "POST" else None, key=key
            )
            _is_error(status, body, 401)
            assert body["error"]["type"] == "authentication_error"
    assert server.request("GET", "/health", key=None)[0] == 200
    _is_error(*server.request("GET", "/nope")[:2], 404)
    _is_error(*server.request("GET", "/v1/chat/completions")[:2], 405)


def test_cors_and_host(server):  # 40
    status, body, resp = server.request(
        "OPTIONS",
        "/v1/chat/completions",
        key=None,
        headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"},
    )
    assert status == 403 and resp.getheader("Access-Control-Allow-Origin") is None
    status, body, resp = server.post(
        "/tokenize", {"content": "x"}, headers={"Origin": "https://evil.example"}
    )
    assert status == 403 and resp.getheader("Access-Control-Allow-Origin") is None
    status, body, _ = server.request("GET", "/v1/models", headers={"Host": "evil.example"})
    _is_error(status, body, 403)
    assert server.request("GET", "/v1/models", headers={"Host": "localhost:1"})[0] == 200


def test_log_escaping():  # 41
    from picollama.server.http import _escape

    assert _escape("GET /x\r\n\x1b[31mred") == "GET /x\\r\\n\\x1b[31mred"


def test_cli_flag_errors(capsys):
    from picollama.tools.server import main

    assert main(["-m", "unused.gguf", "--prefix-cache-tokens", "-2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--prefix-cache-tokens" in err


def test_many_invalid_then_valid(server):  # 43
    health = []
    stop = threading.Event()

    def poll():
        while not stop.is_set():
            health.append(server.request("GET", "/health", key=None)[0])
            time.sleep(0.02)

    t = threading.Thread(target=poll)
    t.start()
    try:
        for i in range(100):
            bad = [b"{", b"null", json.dumps({"prompt": "x", "max_tokens": -i}).encode()][i % 3]
            status, body, _ = server.post("/v1/completions", None, raw=bad)
            assert 400 <= status < 500
    finally:
        stop.set()
        t.join()
    assert health and set(health) == {200}
    assert server.post("/completion", {"prompt": "Hi", "n_predict": 1})[0] == 200


def _open_stream(server, path, body):
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    data = json.dumps(body).encode()
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return sock


def test_disconnect_mid_stream_frees_slot(server):  # 37
    assert server.wait_idle()
    cancelled = server.metric("requests_cancelled_total")
    sock = _open_stream(server, "/v1/chat/completions", {**CHAT, "max_tokens": 400, "stream": True})
    got = b""
    while b"data: {" not in got.split(b"\r\n\r\n", 1)[-1] or got.count(b"data: ") < 3:
        got += sock.recv(4096)
    sock.close()
    assert server.wait_idle(timeout=10), "the slot was not freed after the client left"
    assert server.metric("requests_cancelled_total") == cancelled + 1


def test_disconnect_mid_prefill_frees_slot(server):  # 37
    assert server.wait_idle()
    cancelled = server.metric("requests_cancelled_total")
    prompt = "apple " * 250  # a few hundred tokens of prefill
    sock = _open_stream(
        server, "/completion", {"prompt": prompt, "n_predict": 100, "cache_prompt": False}
    )
    time.sleep(0.3)
    sock.close()
    assert server.wait_idle(timeout=15)
    assert server.metric("requests_cancelled_total") == cancelled + 1


def test_full_queue(smollm2_path):  # 38
    srv = Server(smollm2_path, "-np", "1", "-c", "512", "--queue-size", "1", "--api-key", KEY)
    try:
        # long enough that the slot and the queue stay taken while the third request comes
        long = {
            "prompt": "Count: 1, 2, 3,",
            "n_predict": 160,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        first = _open_stream(srv, "/completion", long)  # takes the slot
        time.sleep(0.5)
        second = _open_stream(srv, "/completion", long)  # waits in the queue
        time.sleep(0.3)
        status, body, resp = srv.post("/completion", {**long, "stream": False})
        _is_error(status, body, 503)
        assert resp.getheader("Retry-After")
        assert srv.metric("requests_rejected_total") >= 1
        # the refused request cancelled nobody: both others finish normally
        for sock in (first, second):
            data = b""
            while not data.rstrip().endswith(b"}") or b'"stop": true' not in data:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                data += chunk
            sock.close()
            assert b'"stop": true' in data and b'"stop_type": "limit"' in data
    finally:
        srv.close()


# -- load: concurrency without cross-talk -----------------------------------------------------

# Sixteen prompts, so that the eight clients ask different things at the same moment and an
# answer that crossed to another slot would show. Each chat prompt stays under 64 tokens: every
# prefill then takes the same attention path whether it runs whole or after a cached prefix
# (from 64 query rows on, attention switches to a float32 tiled path, as llama.cpp's does, so
# a prompt whose prefix was reused could get other logits than one run whole).
PROMPTS = [
    "Write a word about the sea.",
    "Name a color.",
    "What is two plus two?",
    "Say something about cats.",
    "Give me a fruit.",
    "Tell me a city.",
    "Name a planet.",
    "Describe rain in one word.",
    "What do bees make?",
    "Name a musical instrument.",
    "How many legs does a spider have?",
    "Say hello in French.",
    "What is the opposite of hot?",
    "Name a famous painter.",
    "What colour is the sky at night?",
    "Tell me a joke about computers.",
]


def test_batched_step_equals_lone(smollm2_path):
    """What the load test rests on, checked directly: a sequence's logits in a batched step
    are bit for bit the ones it gets alone (the lone decode step runs the compiled program,
    proven equal to the op-by-op pass), whatever else is in the batch: other decode tokens
    or another sequence's prompt chunk."""
    from picollama.generation import Engine, eval_batch

    engine = Engine(smollm2_path)
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS[:8]]
    steps = 4

    def lone(prompt):
        ctx = engine.new_sequence(128)
        out = [eval_batch([(ctx, prompt)])[0]]
        for _ in range(steps):
            out.append(eval_batch([(ctx, [int(np.argmax(out[-1]))])])[0])
        return out

    want = [lone(p) for p in prompts]
    ctxs = [engine.new_sequence(128) for _ in prompts]
    got = [[x] for x in eval_batch(list(zip(ctxs[:6], prompts[:6], strict=True)))]
    for step in range(steps):
        # the batch changes every step: 6 decoding, then 5 with a prompt joining, then fewer
        work = [(i, [int(np.argmax(got[i][-1]))]) for i in range(len(got)) if (i + step) % 4]
        if step == 0:
            work.append((6, prompts[6]))
            got.append([])
        if step == 1:
            work.append((7, prompts[7]))
            got.append([])
        outs = eval_batch([(ctxs[i], toks) for i, toks in work])
        for (i, _), logits in zip(work, outs, strict=True):
            got[i].append(logits)
        for i in range(len(got)):  # the ones left out catch up alone
            if all(i != j for j, _ in work) and len(got[i]) < steps + 1:
                got[i].append(eval_batch([(ctxs[i], [int(np.argmax(got[i][-1]))])])[0])
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        for j, (a, b) in enumerate(zip(g, w, strict=False)):
            assert np.array_equal(a, b), f"sequence {i}, step {j}: {np.abs(a - b).max()}"
        assert len(g) >= 3


@pytest.fixture(scope="module")
def server8(smollm2_path):
    """Eight slots: the eight clients' requests share one batch."""
    srv = Server(smollm2_path, "-np", "8", "-c", "4096", "--api-key", KEY, "--queue-size", "32")
    srv.post("/completion", {"prompt": "Hi", "n_predict": 2, "temperature": 0})
    yield srv
    srv.close()


def test_load_no_cross_talk(server8):
    """8 concurrent clients x 10 requests at temperature 0: every one completes, and each
    answer equals the one a lone client gets (the issue's load acceptance, at full size)."""
    n_clients, n_each, n_tokens = 8, 10, 16

    def ask(prompt):
        body = {
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": n_tokens,
            "temperature": 0,
        }
        status, out, _ = server8.post("/v1/chat/completions", body, timeout=600)
        assert status == 200, out
        assert out["usage"]["prompt_tokens"] < 64
        return out["choices"][0]["message"]["content"], out["usage"]["completion_tokens"]

    lone = {p: ask(p) for p in PROMPTS}  # one client at a time
    assert len({text for text, _ in lone.values()}) == len(PROMPTS), "answers must differ"
    steps0 = server8.metric("n_decode_total")
    slot_steps0 = steps0 * server8.metric("n_busy_slots_per_decode")

    def client(i):
        # client i starts at prompt 2i: at any moment the clients ask different prompts
        order = [PROMPTS[(2 * i + j) % len(PROMPTS)] for j in range(n_each)]
        return [(p, ask(p)) for p in order]

    with ThreadPoolExecutor(n_clients) as pool:
        results = [r for rs in pool.map(client, range(n_clients)) for r in rs]
    assert len(results) == n_clients * n_each
    for prompt, answer in results:
        assert answer == lone[prompt], prompt
    assert server8.wait_idle()
    # the requests really ran side by side: on average well over one slot per step
    steps1 = server8.metric("n_decode_total")
    slot_steps1 = steps1 * server8.metric("n_busy_slots_per_decode")
    occupancy = (slot_steps1 - slot_steps0) / (steps1 - steps0)
    assert occupancy > 3, f"{occupancy:.2f} slots per step"


def test_rows_largest_give_the_tokens_of_whole_rows(smollm2_path):
    """Samplers that need only a row's largest logits get only those from a backend that
    reads back less (as the CUDA one does, ``Backend.to_host_top``; here the CPU backend
    made to, op by op): the generation loop and the server's slots draw the same tokens as
    from whole rows, seeded, with ``ignore_eos`` (banned tokens) and penalties; a request
    that asks for log probabilities still gets whole rows."""
    from picollama.backends.base import top_logits
    from picollama.backends.cpu.backend import CPUBackend
    from picollama.generation import Engine
    from picollama.sampling.samplers import Sampler, SamplingParams
    from picollama.server.scheduler import GenRequest, Scheduler

    class TopBackend(CPUBackend):
        asked: list[int] = []

        def forward_step(self, model, segments):
            return model.forward_batch(segments)  # op by op: through to_host_top

        def to_host_top(self, x, k):
            self.asked.append(k)
            return top_logits(self.to_host(x), k)

    def params(i):
        return SamplingParams(temperature=0.9, seed=100 + i, repeat_penalty=1.2)

    prompts = [[1, 504, 3458, 282, 5248], [1, 18, 19, 20], [1, 2524, 314]]
    runs = {}
    for name, backend in (("whole", CPUBackend()), ("top", TopBackend())):
        engine = Engine(smollm2_path, backend=backend)
        ctx = engine.new_sequence(64)
        lone = list(ctx.generate(prompts[0], Sampler(params(0)), 8, ignore_eos=True))
        n_lone = len(TopBackend.asked)
        sched = Scheduler(engine, 3, 192)
        # the third asks for log probabilities: whole rows while it runs (3 tokens)
        reqs = [
            GenRequest(list(p), Sampler(params(i)), 8 - 5 * (i == 2), ignore_eos=True)
            for i, p in enumerate(prompts)
        ]
        reqs[2].n_probs = 2
        sched.start()
        try:
            sched.submit(reqs)
            served = []
            for r in reqs:
                tokens = []
                while (ev := r.out.get(timeout=300)).kind == "token":
                    tokens.append(ev.token)
                assert ev.kind == "done", ev.message
                served.append(tokens)
        finally:
            sched.stop()
        runs[name] = (lone, served)
    assert runs["top"] == runs["whole"], runs
    assert len(runs["top"][0]) == 8 and [len(t) for t in runs["top"][1]] == [8, 8, 3]
    # the top-k, the penalty window and the bans; the slots' steps after the third request
    assert n_lone >= 8 and min(TopBackend.asked) > 40
    assert len(TopBackend.asked) >= n_lone + 5
