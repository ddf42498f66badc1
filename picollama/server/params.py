"""Reading request fields: each check names the field and the value it got (HTTP 400)."""

from __future__ import annotations

import math
from typing import Any

from picollama.server.errors import bad_request

__all__ = ["get_int", "get_float", "get_bool", "get_str", "get_stop", "get_logit_bias"]

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1000


def _present(body: dict, name: str) -> bool:
    return name in body and body[name] is not None


def get_int(
    body: dict, name: str, default: int | None, lo: int | None = None, hi: int | None = None
):
    if not _present(body, name):
        return default
    v = body[name]
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise bad_request(f"'{name}' must be an integer, got {v!r}", name)
    if isinstance(v, float):
        if not v.is_integer():
            raise bad_request(f"'{name}' must be an integer, got {v!r}", name)
        v = int(v)
    if lo is not None and v < lo:
        raise bad_request(f"'{name}' must be >= {lo}, got {v}", name)
    if hi is not None and v > hi:
        raise bad_request(f"'{name}' must be <= {hi}, got {v}", name)
    return v


def get_float(
    body: dict, name: str, default: float | None, lo: float | None = None, hi: float | None = None
):
    if not _present(body, name):
        return default
    v = body[name]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise bad_request(f"'{name}' must be a finite number, got {v!r}", name)
    if lo is not None and v < lo:
        raise bad_request(f"'{name}' must be >= {lo}, got {v}", name)
    if hi is not None and v > hi:
        raise bad_request(f"'{name}' must be <= {hi}, got {v}", name)
    return float(v)


def get_bool(body: dict, name: str, default: bool) -> bool:
    if not _present(body, name):
        return default
    v = body[name]
    if not isinstance(v, bool):
        raise bad_request(f"'{name}' must be true or false, got {v!r}", name)
    return v


def get_str(body: dict, name: str, default: str | None) -> Any:
    if not _present(body, name):
        return default
    v = body[name]
    if not isinstance(v, str):
        raise bad_request(f"'{name}' must be a string, got {type(v).__name__}", name)
    return v


def get_stop(body: dict) -> list[str]:
    if not _present(body, "stop"):
        return []
    v = body["stop"]
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise bad_request("'stop' must be a string or a list of strings", "stop")
    if len(v) > MAX_STOP_STRINGS:
        raise bad_request(f"'stop' has {len(v)} strings, at most {MAX_STOP_STRINGS}", "stop")
    if any(len(s) > MAX_STOP_CHARS for s in v):
        raise bad_request(f"a 'stop' string is over {MAX_STOP_CHARS} characters", "stop")
    return [s for s in v if s]


def get_logit_bias(body: dict, n_vocab: int, tokenize) -> dict[int, float]:
    """OpenAI's ``{"token id": bias}`` or llama.cpp's ``[[id or text, bias or false], ...]``."""
    if not _present(body, "logit_bias"):
        return {}
    raw = body["logit_bias"]
    pairs: list[tuple[Any, Any]]
    if isinstance(raw, dict):
        pairs = list(raw.items())
    elif isinstance(raw, list) and all(isinstance(p, list) and len(p) == 2 for p in raw):
        pairs = [(p[0], p[1]) for p in raw]
    else:
        raise bad_request("'logit_bias' must be an object of token id -> bias", "logit_bias")
    if len(pairs) > n_vocab:
        raise bad_request("'logit_bias' has more entries than the vocabulary", "logit_bias")
    out: dict[int, float] = {}
    for key, bias in pairs:
        if bias is False:
            bias = -math.inf
        elif isinstance(bias, bool) or not isinstance(bias, (int, float)) or math.isnan(bias):
            raise bad_request(f"'logit_bias' value for {key!r} must be a number", "logit_bias")
        if isinstance(key, str) and not key.lstrip("-").isdigit():
            ids = tokenize(key)  # llama.cpp: a string applies to each of its tokens
        else:
            try:
                ids = [int(key)]
            except (TypeError, ValueError):
                raise bad_request(
                    f"'logit_bias' key {key!r} is not a token id", "logit_bias"
                ) from None
        for tid in ids:
            if not 0 <= tid < n_vocab:
                raise bad_request(
                    f"'logit_bias' token {tid} is outside the vocabulary (0..{n_vocab - 1})",
                    "logit_bias",
                )
            out[tid] = float(bias)
    return out
