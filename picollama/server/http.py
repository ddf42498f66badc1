"""The HTTP layer: the standard library's threading server in front of ``App``.

Each connection gets a thread that parses the request, checks host, origin, key and size,
and calls the endpoint; generation runs on the engine thread and comes back through a
queue, so a handler thread never touches the model. Every error is OpenAI-shaped JSON.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import select
import socket
import sys
import threading
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from picollama.server.app import App, Stream
from picollama.server.errors import APIError

__all__ = ["PicoHTTPServer", "make_server"]

_LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1", "[::1]"}
_PUBLIC = {"/health", "/v1/health"}  # reachable without the API key, as llama-server


def _escape(text: str) -> str:
    """Log-safe text: control characters (CR, LF, ESC...) as escapes."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class PicoHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address, app: App, log: bool = True, allowed_hosts=()):
        self.app = app
        self.log = log
        self.allowed_hosts = {h.lower() for h in allowed_hosts}
        self.counter_lock = threading.Lock()
        host = address[0]
        try:
            self.loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
        except ValueError:
            self.loopback = False
        if ":" in host:
            self.address_family = socket.AF_INET6
        super().__init__(address, Handler)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "picollama"
    sys_version = ""
    timeout = 120  # seconds a connection may sit idle or stall mid-request
    server: PicoHTTPServer

    # -- stdlib hooks -----------------------------------------------------------------------

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - the stdlib's name
        if self.server.log:
            sys.stderr.write(_escape(f"{self.address_string()} - {format % args}") + "\n")

    def send_error(self, code: int, message: str | None = None, explain: str | None = None):
        # the stdlib's own errors (a malformed request line, a header too long) as JSON too
        self.close_connection = True
        try:
            self._send_json(code, APIError(code, message or "bad request").body())
        except OSError:
            pass

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's names
        self._dispatch("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._dispatch("POST")

    def do_OPTIONS(self) -> None:  # noqa: N802
        self._dispatch("OPTIONS")

    def do_PUT(self) -> None:  # noqa: N802
        self._dispatch("PUT")

    def do_DELETE(self) -> None:  # noqa: N802
        self._dispatch("DELETE")

    def do_PATCH(self) -> None:  # noqa: N802
        self._dispatch("PATCH")

    # -- dispatch ---------------------------------------------------------------------------

    @property
    def app(self) -> App:
        return self.server.app

    def _routes(self):
        a = self.app
        get = {
            "/health": a.health,
            "/v1/health": a.health,
            "/v1/models": a.models,
            "/models": a.models,
            "/props": a.props,
            "/slots": a.slots,
            "/metrics": a.metrics,
            "/lora-adapters": a.lora_adapters,
        }
        post = {
            "/v1/chat/completions": a.chat_completions,
            "/chat/completions": a.chat_completions,
            "/v1/completions": a.completions,
            "/completions": a.completions,
            "/completion": a.completion,
            "/tokenize": a.tokenize,
            "/detokenize": a.detokenize,
            "/apply-template": a.apply_template,
            "/lora-adapters": a.set_lora_adapters,
        }
        return get, post

    def _dispatch(self, method: str) -> None:
        with self.server.counter_lock:
            self.app.n_http_requests += 1
        try:
            self._handle(method)
        except APIError as err:
            with self.server.counter_lock:
                self.app.n_http_errors += 1
            self._send_json(err.status, err.body(), err.headers)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as exc:  # a bug: answer 500, keep serving
            with self.server.counter_lock:
                self.app.n_http_errors += 1
            traceback.print_exc()
            try:
                self._send_json(500, APIError(500, f"internal error: {type(exc).__name__}").body())
            except OSError:
                self.close_connection = True

    def _handle(self, method: str) -> None:
        path = urlsplit(self.path).path
        self._check_host()
        origin = self.headers.get("Origin")
        self._cors = None
        if origin is not None:
            allowed = self.server.app.config.cors_origin
            if allowed and (allowed == "*" or origin == allowed):
                self._cors = origin if allowed != "*" else "*"
            elif method == "OPTIONS" or not _same_origin(origin, self.headers.get("Host")):
                raise APIError(403, f"cross-origin requests from {origin!r} are not allowed")
        if method == "OPTIONS":
            if self._cors is None:
                raise APIError(403, "cross-origin requests are not enabled (--cors-origin)")
            self.send_response(204)
            self._cors_headers()
            self.send_header("Access-Control-Allow-Methods", "GET, POST, OPTIONS")
            self.send_header("Access-Control-Allow-Headers", "Authorization, Content-Type")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if path not in _PUBLIC:
            self._check_key()
        get, post = self._routes()
        if method == "GET" and path in get:
            self._drain_body()
            result = get[path]()
        elif method == "POST" and path in post:
            body = self._read_json(list_ok=path == "/lora-adapters")
            fn = post[path]
            if fn in (self.app.chat_completions, self.app.completions, self.app.completion):
                result = fn(body, self._disconnected)
            else:
                result = fn(body)
        elif path in get or path in post:
            raise APIError(405, f"method {method} is not allowed on {path}")
        else:
            raise APIError(404, f"no endpoint {path!r}")
        if isinstance(result, Stream):
            self._send_stream(result)
        elif isinstance(result, str):
            self._send(200, result.encode("utf-8"), "text/plain; version=0.0.4; charset=utf-8")
        else:
            self._send_json(200, result)

    # -- checks -----------------------------------------------------------------------------

    def _check_host(self) -> None:
        """Bound to loopback, only loopback Host names are served (DNS rebinding)."""
        host = self.headers.get("Host")
        if host is None or not self.server.loopback:
            return
        name = host.strip().lower()
        if name.startswith("["):
            name = name[: name.find("]") + 1] if "]" in name else name
        elif ":" in name:
            name = name.rsplit(":", 1)[0]
        if name not in _LOOPBACK_NAMES and name not in self.server.allowed_hosts:
            raise APIError(403, f"host {_escape(host)!r} is not allowed")

    def _check_key(self) -> None:
        key = self.app.config.api_key
        if not key:
            return
        auth = self.headers.get("Authorization", "")
        given = (
            auth[7:].strip() if auth[:7].lower() == "bearer " else self.headers.get("X-Api-Key", "")
        )
        if not hmac.compare_digest(given.encode("utf-8", "replace"), key.encode("utf-8")):
            raise APIError(
                401,
                "invalid api key" if given else "missing api key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    def _body_length(self) -> int:
        if self.headers.get("Transfer-Encoding"):
            self.close_connection = True
            raise APIError(411, "chunked request bodies are not supported; send Content-Length")
        raw = self.headers.get("Content-Length", "0")
        try:
            n = int(raw)
        except ValueError:
            self.close_connection = True
            raise APIError(400, "Content-Length is not a number") from None
        if n < 0:
            self.close_connection = True
            raise APIError(400, "Content-Length is negative")
        limit = self.app.config.max_body_bytes
        if n > limit:
            self.close_connection = True  # the body stays unread
            raise APIError(413, f"the request body is {n} bytes, over the limit of {limit}")
        return n

    def _drain_body(self) -> None:
        n = self._body_length()
        if n:
            self.rfile.read(n)

    def _read_json(self, list_ok: bool = False) -> dict:
        n = self._body_length()
        data = self.rfile.read(n) if n else b""
        if len(data) < n:
            self.close_connection = True
            raise APIError(400, f"the request body ended after {len(data)} of {n} bytes")
        if not data.strip():
            raise APIError(400, "the request body is empty; a JSON object is expected")
        try:
            body = json.loads(data.decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise APIError(400, f"the request body is not UTF-8 (byte {exc.start})") from None
        except json.JSONDecodeError as exc:
            raise APIError(400, f"the request body is not valid JSON: {exc}") from None
        except RecursionError:
            raise APIError(400, "the request body nests too deeply") from None
        if not isinstance(body, dict) and not (list_ok and isinstance(body, list)):
            raise APIError(400, "the request body must be a JSON object")
        return body

    def _disconnected(self) -> bool:
        """True once the client has closed its end (a read would return EOF)."""
        sock = self.connection
        try:
            readable, _, _ = select.select([sock], [], [], 0)
            if not readable:
                return False
            return sock.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    # -- responses --------------------------------------------------------------------------

    def _cors_headers(self) -> None:
        if self._cors_value():
            self.send_header("Access-Control-Allow-Origin", self._cors_value())
            self.send_header("Vary", "Origin")

    def _cors_value(self):
        return getattr(self, "_cors", None)

    def _send(self, status: int, data: bytes, ctype: str, headers: dict | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self._cors_headers()
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()

    def _send_json(self, status: int, obj, headers: dict | None = None) -> None:
        data = json.dumps(obj, ensure_ascii=False).encode("utf-8")
        self._send(status, data, "application/json; charset=utf-8", headers)

    def _send_stream(self, stream: Stream) -> None:
        chunks = stream.chunks
        self.close_connection = True  # the stream ends when the connection closes
        try:
            first = next(chunks, None)  # errors before the first event are still HTTP errors
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self._cors_headers()
            self.end_headers()
            if first is not None:
                self.wfile.write(first)
                self.wfile.flush()
            for chunk in chunks:
                self.wfile.write(chunk)
                self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            pass  # the client went away: closing the generator cancels its requests
        finally:
            chunks.close()


def _same_origin(origin: str, host: str | None) -> bool:
    """A browser's same-origin request (its Origin names this server) needs no CORS."""
    if not host:
        return False
    try:
        return urlsplit(origin).netloc.lower() == host.strip().lower()
    except ValueError:
        return False


def make_server(
    app: App, host: str = "127.0.0.1", port: int = 8080, log: bool = True, allowed_hosts=()
) -> PicoHTTPServer:
    return PicoHTTPServer((host, port), app, log=log, allowed_hosts=allowed_hosts)
