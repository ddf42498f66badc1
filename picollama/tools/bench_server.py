"""Aggregate generation throughput of picollama-server and llama-server, 1 to 8 streams at once.

    python -m picollama.tools.bench_server -m MODEL --peer LLAMA_CPP_BIN_DIR/llama-server -t 2

Starts ``picollama-server`` and (with ``--peer``) llama-server side by side, each with the
same ``-np`` (the largest concurrency), ``-c``, ``-t`` and ``-tb``. At each level N, N
clients post /completion at once, each its own prompt (the same prompts for both servers),
asking for ``-n`` tokens with ``ignore_eos`` and ``cache_prompt: false``; the figure is the
tokens all streams generated per wall-clock second. The servers take turns, level by level,
for ``-r`` rounds, and the table gives medians: each level's ratio to one stream and ours to
the peer's. The goals are 8 streams >= 3x one stream and >= llama-server at 8 streams.
``--profile STEPS`` instead splits an engine step's time op by op, in process.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

__all__ = ["main", "measure", "warm_up", "profile_steps"]

PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a rainbow forms, step by step.",
    "Describe a busy market in a coastal town at dawn.",
    "Write a letter from a lighthouse keeper to his sister.",
    "List the things a traveller should pack for a week in the mountains.",
    "Tell the story of a cat who becomes the mayor of a small village.",
    "Explain why the sea is salty to a curious child.",
    "Write a poem about autumn leaves falling in a city park.",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(port: int, path: str, body: dict, timeout: float = 3600) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        out = json.loads(resp.read())
    finally:
        conn.close()
    if resp.status != 200:
        raise RuntimeError(f"{path}: HTTP {resp.status}: {out}")
    return out


def _wait_health(port: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server did not answer /health within {timeout:.0f} s")


def _stream_body(i: int, n_predict: int) -> dict:
    return {
        "prompt": PROMPTS[i % len(PROMPTS)] + f" (Version {i + 1}.)",
        "n_predict": n_predict,
        "ignore_eos": True,
        "temperature": 0.8,
        "seed": 1000 + i,
        "cache_prompt": False,
    }


def warm_up(port: int, n_streams: int) -> None:
    """Run every path once: one stream, then all slots together (a batched step)."""
    _post(port, "/completion", _stream_body(0, 4))
    with ThreadPoolExecutor(n_streams) as pool:
        list(pool.map(lambda i: _post(port, "/completion", _stream_body(i, 4)), range(n_streams)))


def measure(port: int, n: int, n_predict: int) -> float:
    """Aggregate generated tokens/s of ``n`` streams at once."""

    def one(i: int) -> int:
        r = _post(port, "/completion", _stream_body(i, n_predict))
        return int(r.get("tokens_predicted", 0))

    t0 = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        total = sum(pool.map(one, range(n)))
    rate = total / (time.perf_counter() - t0)
    if total != n * n_predict:
        print(f"  warning: {total} tokens generated, {n * n_predict} asked", flush=True)
    return rate


# the backend ops a model's forward calls (exclusive time each: an op's inner ops are not
# counted twice)
_OPS = (
    "get_rows",
    "rms_norm",
    "matmul",
    "matmul_many",
    "gated_ffn",
    "rope",
    "store_kv",
    "attention",
    "concat",
    "add",
    "take_rows",
)


def profile_steps(
    model: str, levels: list[int], threads: int, n_steps: int, backend: str = "cpu"
) -> None:
    """Where one engine step's time goes, in process (no HTTP): for each number of slots,
    the scheduler's step (sampling, detokenizing, streaming) around the batched forward, and
    inside the forward each backend op's exclusive time, per step; on the CPU, inside its
    compiled step each kind of op's share (``step.kind_times``)."""
    import numba

    from picollama.generation import Engine
    from picollama.sampling.samplers import Sampler, SamplingParams
    from picollama.server import scheduler as sched

    engine = Engine(model, backend=backend, n_threads=threads)
    be = engine.backend
    times: dict[str, float] = {}
    stack: list[list] = []  # [name, child time]

    def short(w) -> str:  # "blk.3.ffn_up.weight" -> "ffn_up"
        parts = getattr(w, "name", "?").split(".")
        return parts[2] if parts[0] == "blk" and len(parts) > 2 else parts[0]

    def timed(op, fn):
        def wrapper(*a, **kw):
            name = op
            if op == "matmul":
                name = f"matmul {short(a[1])}"
            elif op == "matmul_many":
                name = "matmul " + "+".join(short(w) for w in a[1])
            stack.append([name, 0.0])
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                dt = time.perf_counter() - t0
                _, child = stack.pop()
                times[name] = times.get(name, 0.0) + dt - child
                if stack:
                    stack[-1][1] += dt
                else:
                    times["(ops total)"] = times.get("(ops total)", 0.0) + dt

        return wrapper

    for name in _OPS:
        if callable(getattr(be, name, None)):
            setattr(be, name, timed(name, getattr(be, name)))  # shadows the bound method
    steps = getattr(be, "_steps", None)  # the CPU's compiled steps: keep the last run's
    if steps is not None:
        steps.keep_last = True
    engine_step = sched.engine_step
    sched.engine_step = timed("(forward)", engine_step)
    print(f"threads {numba.get_num_threads()}, {n_steps} decode steps per level")
    runs = [(n, True) for n in levels]
    if hasattr(be, "compiled_steps"):  # each level op by op too, beside its compiled step
        runs = [(n, c) for n in levels for c in (True, False)]
    try:
        for n, compiled in runs:
            if hasattr(be, "compiled_steps"):
                be.compiled_steps = compiled
            s = sched.Scheduler(engine, n, 512, max_queue=n)
            reqs = [
                sched.GenRequest(
                    prompt=engine.tokenizer.encode(_stream_body(i, 0)["prompt"]),
                    sampler=Sampler(SamplingParams(seed=1000 + i), engine.n_vocab),
                    max_tokens=n_steps + 8,
                    ignore_eos=True,
                    cache_prompt=False,
                )
                for i in range(n)
            ]
            s.submit(reqs)
            for slot, req in s._admit_locked():
                s._start(slot, req)
            for _ in range(3):  # the prefill, and two warm decode steps
                s.step()
            times.clear()
            t0 = time.perf_counter()
            for _ in range(n_steps):
                s.step()
            wall = (time.perf_counter() - t0) / n_steps * 1000
            per = {k: v / n_steps * 1000 for k, v in times.items()}
            glue = per.pop("(forward)", 0.0)  # the forward's own time, outside any op
            fwd = per.pop("(ops total)", 0.0)  # the whole forward
            how = "" if compiled else " (op by op, not the compiled step)"
            print(f"\n{n} slots{how}: {wall:.2f} ms a step, {n * 1000 / wall:.1f} tokens/s")
            print(f"  scheduler outside the forward (sampling, text): {wall - fwd:7.3f} ms")
            print(f"  forward, outside the backend ops:               {glue:7.3f} ms")
            for k, v in sorted(per.items(), key=lambda kv: -kv[1]):
                print(f"  {k:<14} {v:7.3f} ms")
            last = steps.last if steps is not None else None
            if compiled and last is not None:
                from picollama.backends.cpu.step import kind_times

                rows = kind_times(*last)
                print(
                    f"  inside the compiled forward ({rows[0][2]:.2f} ms), each kind of op "
                    f"alone (together {sum(r[2] for r in rows[1:]):.2f} ms):"
                )
                for kind, count, t in rows[1:]:
                    print(f"    {kind:<14} {t:7.3f} ms  {count:4d} rows")
                steps.last = None
            for r in reqs:
                r.cancel()
            s.step()
    finally:
        sched.engine_step = engine_step
        if steps is not None:
            steps.keep_last, steps.last = False, None
        if hasattr(be, "compiled_steps"):
            be.compiled_steps = True
        for name in _OPS:
            be.__dict__.pop(name, None)


def _table(results: dict[str, dict[int, float]], levels: list[int]) -> str:
    names = list(results)
    head = ["streams"] + [f"{name} t/s" for name in names] + [f"{name} vs 1" for name in names]
    if len(names) == 2:
        head.append(f"{names[0]}/{names[1]}")
    rows = []
    for n in levels:
        row = [str(n)] + [f"{results[name][n]:.1f}" for name in names]
        row += [f"{results[name][n] / results[name][levels[0]]:.2f}x" for name in names]
        if len(names) == 2:
            row.append(f"{results[names[0]][n] / results[names[1]][n]:.2f}x")
        rows.append(row)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="picollama-bench-server", description=__doc__.split("\n")[0])
    p.add_argument("-m", "--model", required=True, help="GGUF file (both servers load it)")
    p.add_argument("--peer", default=None, help="llama-server binary to run the same way")
    p.add_argument("-n", "--n-predict", type=int, default=64, help="tokens per stream")
    p.add_argument(
        "-t", "--threads", type=int, default=os.cpu_count(), help="threads, both servers"
    )
    p.add_argument("--levels", default="1,2,4,8", help="concurrent streams, comma-separated")
    p.add_argument("--backend", default="cpu", help="picollama's backend (cpu, cuda, opencl)")
    p.add_argument("-r", "--repetitions", type=int, default=1, help="runs per level (median)")
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="STEPS",
        help="instead: time STEPS engine steps in process at each level, op by op",
    )
    args = p.parse_args(argv)
    try:
        levels = sorted({int(x) for x in args.levels.split(",")})
    except ValueError:
        print(f"error: --levels must be integers, got {args.levels!r}", file=sys.stderr)
        return 2
    if not levels or levels[0] <= 0 or args.n_predict <= 0 or args.repetitions <= 0:
        print("error: --levels, -n and -r must be positive", file=sys.stderr)
        return 2
    if not os.path.isfile(args.model):
        from picollama.models.registry import ModelNotFoundError, resolve_model_path

        try:
            args.model = str(resolve_model_path(args.model))
        except ModelNotFoundError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    if args.peer and not os.access(args.peer, os.X_OK):
        print(f"error: --peer {args.peer!r} is not an executable file", file=sys.stderr)
        return 2
    if args.profile > 0:
        profile_steps(args.model, levels, args.threads, args.profile, args.backend)
        return 0
    n_slots = max(levels)
    n_ctx = n_slots * (args.n_predict + 128)  # a prompt of < 64 tokens and the answer, per slot
    common = ["-np", str(n_slots), "-c", str(n_ctx), "-t", str(args.threads)]
    ours = [sys.executable, "-m", "picollama.tools.server", "--log-disable", *common]
    servers = [("picollama", [*ours, "--backend", args.backend])]
    if args.peer:
        servers.append(("llama-server", [args.peer, "--log-disable", *common]))
        servers[-1][1].extend(["-tb", str(args.threads)])
    print(
        f"model {os.path.basename(args.model)}, {args.n_predict} tokens per stream, "
        f"-np {n_slots} -c {n_ctx} -t {args.threads}, picollama on {args.backend}",
        flush=True,
    )
    procs: dict[str, tuple[subprocess.Popen, int]] = {}
    rates: dict[str, dict[int, list[float]]] = {name: {} for name, _ in servers}
    try:
        for name, cmd in servers:  # all up at once, so that their runs can alternate
            port = _free_port()
            full = [*cmd, "-m", args.model, "--port", str(port)]
            proc = subprocess.Popen(full, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            procs[name] = (proc, port)
            _wait_health(port, proc)
            warm_up(port, n_slots)
        # round by round, each level on each server in turn: a load spike on a shared
        # machine then hits both engines alike
        for rep in range(args.repetitions):
            for n in levels:
                for name, (_, port) in procs.items():
                    time.sleep(0.5)  # let the other server's threads go idle
                    rates[name].setdefault(n, []).append(measure(port, n, args.n_predict))
                    print(
                        f"  round {rep + 1}, {n} streams, {name}: "
                        f"{rates[name][n][-1]:8.2f} tokens/s aggregate",
                        flush=True,
                    )
    finally:
        for proc, _ in procs.values():
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    results = {name: {n: statistics.median(r[n]) for n in levels} for name, r in rates.items()}
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"\nmedians of {args.repetitions} rounds; load average at the end {load:.2f}")
    print(_table(results, levels))
    return 0


if __name__ == "__main__":
    sys.exit(main())
