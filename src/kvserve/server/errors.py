"""OpenAI-shaped errors: every refusal is ``{"error": {"message", "type", "param", "code"}}``
with a message a person can act on."""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 408: "invalid_request_error",
          409: "conflict_error", 413: "invalid_request_error", 415: "invalid_request_error",
          500: "internal_error", 503: "service_unavailable"}


MAX_SHOWN = 1000  # characters of a message or param; a client's value quoted whole (a 1 MB
# field name) came back in a 2 MB answer


def bounded(text: str) -> str:
    """``text``, its middle left out past MAX_SHOWN characters (its end usually says what
    to do)."""
    if len(text) <= MAX_SHOWN:
        return text
    keep = MAX_SHOWN // 2
    return f"{text[:keep]}... ({len(text) - 2 * keep} characters left out) ...{text[-keep:]}"


class APIError(Exception):
    """Raised anywhere in a handler; the app turns it into the JSON error response."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        message = bounded(message)
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param if param is None else bounded(param)
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.code or self.status}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)
