"""Errors as the server answers them: OpenAI's ``{"error": {"message", "type", "code"}}``.

The types are llama.cpp's server error types; ``code`` is the HTTP status, as llama.cpp.
"""

from __future__ import annotations

__all__ = ["APIError", "bad_request"]

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    411: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    500: "server_error",
    501: "not_supported_error",
    503: "unavailable_error",
}


class APIError(Exception):
    """An error answered to one client; the server keeps serving."""

    def __init__(
        self,
        status: int,
        message: str,
        err_type: str | None = None,
        headers: dict | None = None,
        **extra,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = err_type or _TYPES.get(status, "invalid_request_error")
        self.headers = headers or {}
        self.extra = extra  # more fields for the error object (n_prompt_tokens, n_ctx, param)

    def body(self) -> dict:
        return {
            "error": {"code": self.status, "message": self.message, "type": self.type, **self.extra}
        }


def bad_request(message: str, param: str | None = None) -> APIError:
    extra = {"param": param} if param else {}
    return APIError(400, message, **extra)
