"""picollama-server: an OpenAI-compatible HTTP server, with llama-server's flags.

    picollama-server -m MODEL [--host 127.0.0.1] [--port 8080] [-c 4096] [-np 4] [--api-key K]

Endpoints: GET /health /v1/models /props /slots /metrics /lora-adapters; POST
/v1/chat/completions /v1/completions /completion /tokenize /detokenize /apply-template
/lora-adapters.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from picollama.tools.cli import (
    add_backend_args,
    add_lora_args,
    add_repack_arg,
    backend_choice,
    lora_specs,
    note_gpu_layers,
)

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="picollama-server", description=__doc__.split("\n")[0])
    p.add_argument("-m", "--model", default=None, help="GGUF file or built-in model name")
    p.add_argument("-a", "--alias", default=None, help="model name reported by the API")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument(
        "-c",
        "--ctx-size",
        type=int,
        default=4096,
        help="context size, split across the slots (0: the model's)",
    )
    p.add_argument("-np", "--parallel", type=int, default=1, help="number of slots")
    p.add_argument(
        "-n",
        "--n-predict",
        type=int,
        default=-1,
        help="default cap on generated tokens per request (-1: up to the context)",
    )
    p.add_argument("-b", "--batch-size", type=int, default=512, help="prompt chunk per step")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads")
    add_backend_args(p)
    add_repack_arg(p)
    p.add_argument(
        "--queue-size",
        type=int,
        default=64,
        help="requests waiting for a slot before 503 (default: 64)",
    )
    p.add_argument("--api-key", default=None, help="require this key (Bearer) on all but /health")
    p.add_argument("--api-key-file", default=None, help="read the API key from a file")
    p.add_argument("--cors-origin", default=None, help="allow cross-origin requests from it")
    p.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        help="another Host name to serve when bound to loopback",
    )
    p.add_argument("--chat-template", default=None, help="built-in template name or Jinja text")
    p.add_argument(
        "--allow-chat-template-kwargs",
        action="store_true",
        help="accept chat_template_kwargs in requests",
    )
    p.add_argument("--max-body", type=int, default=8 * 1024 * 1024, help="request body limit")
    p.add_argument("--log-disable", action="store_true", help="don't log requests")
    p.add_argument(
        "--prefix-cache-tokens",
        type=int,
        default=-1,
        help="tokens of KV the prefix tree shared by the slots keeps (-1: -c; 0: off)",
    )
    add_lora_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from picollama.errors import USER_ERRORS
    from picollama.generation import Engine
    from picollama.server import App, ServerConfig, make_server

    if args.parallel <= 0 or args.queue_size < 0 or args.ctx_size < 0:
        print("error: -np must be positive, --queue-size and -c not negative", file=sys.stderr)
        return 2
    if args.prefix_cache_tokens < -1:
        print("error: --prefix-cache-tokens must be -1 (as -c), 0 (off) or more", file=sys.stderr)
        return 2
    key = args.api_key
    if args.api_key_file:
        with open(args.api_key_file, encoding="utf-8") as f:
            key = f.read().strip()
    key = key or os.environ.get("LLAMA_API_KEY") or None
    try:
        engine = Engine(
            args.model,
            n_batch=args.batch_size,
            n_threads=args.threads,
            backend=backend_choice(args),
        )
        note_gpu_layers(args, engine.model)
        if hasattr(engine.backend, "compile_in_background"):
            # requests are served op by op while the CPU's step program compiles
            engine.backend.compile_in_background = True
        config = ServerConfig(
            n_slots=args.parallel,
            n_ctx=args.ctx_size,
            n_predict=args.n_predict,
            max_queue=args.queue_size,
            api_key=key,
            cors_origin=args.cors_origin,
            alias=args.alias,
            chat_template=args.chat_template,
            max_body_bytes=args.max_body,
            allow_template_kwargs=args.allow_chat_template_kwargs,
            lora_adapters=lora_specs(args),
            prefix_cache_tokens=args.prefix_cache_tokens,
        )
        app = App(engine, config)
        httpd = make_server(
            app, args.host, args.port, log=not args.log_disable, allowed_hosts=args.allowed_host
        )
    except USER_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    app.start()
    host, port = httpd.server_address[:2]
    print(
        f"picollama-server: listening on http://{host}:{port} "
        f"({config.n_slots} slots of {app.n_ctx_slot} tokens)",
        file=sys.stderr,
        flush=True,
    )

    def shutdown(*_):
        threading.Thread(target=httpd.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, shutdown)
    try:
        httpd.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        httpd.server_close()
        app.stop()
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
