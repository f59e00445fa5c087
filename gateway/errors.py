"""OpenAI-style errors: one exception type that carries the HTTP status and the error body's fields."""
from __future__ import annotations

from typing import Any

from aiohttp import web


class ApiError(Exception):
    """An error answered to the client as `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def rate_limited(message: str, wait_s: float) -> ApiError:
    """A 429 advising a wait, in whole seconds (Retry-After) and in milliseconds (retry-after-ms, as OpenAI's API
    sends it), the seconds rounded up from the same milliseconds so that the two never disagree."""
    wait_ms = round(wait_s * 1000)
    return ApiError(429, f"{message}; retry in {wait_ms / 1000:.1f} s", type="rate_limit_error",
                    code="too_many_requests",
                    headers={"Retry-After": str(-(-wait_ms // 1000)), "retry-after-ms": str(wait_ms)})
