"""Error bodies of both protocols, and the exception that carries one.

Native: `{"error_msg", "error_code"}` with error_code = the HTTP status.
OpenAI: `{"error": {"message", "type", "param", "code"}}`.
Before the protocol is known (auth, body size, non-JSON on the shared route)
the body holds both shapes, so either kind of client reads it.
"""

from __future__ import annotations

from typing import Literal

from fastapi.responses import JSONResponse

Style = Literal["native", "openai", "both"]

OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable_error",
}
OPENAI_CODES = {
    400: "invalid_value",
    401: "invalid_api_key",
    404: "not_found",
    405: "method_not_allowed",
    408: "timeout",
    409: "duplicate_request_id",
    413: "request_too_large",
    415: "unsupported_media_type",
    429: "queue_full",
    500: "internal_error",
    503: "not_ready",
}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def openai_error(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {
        "error": {
            "message": message,
            "type": OPENAI_TYPES.get(status, "internal_error" if status >= 500 else "invalid_request_error"),
            "param": param,
            "code": code or OPENAI_CODES.get(status, str(status)),
        }
    }


def native_error(status: int, message: str, req_id: str | None = None) -> dict:
    body: dict = {"error_msg": message, "error_code": status}
    if req_id is not None:
        body["req_id"] = req_id
    return body


def error_body(style: Style, status: int, message: str, param: str | None = None) -> dict:
    if style == "native":
        return native_error(status, message)
    if style == "openai":
        return openai_error(status, message, param)
    return {**native_error(status, message), **openai_error(status, message, param)}


def error_response(style: Style, status: int, message: str, param: str | None = None) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(error_body(style, status, message, param), status_code=status, headers=headers)


def status_of(error_code: int) -> int:
    """HTTP status for an engine error code (they coincide; anything odd is a 500)."""
    return error_code if 400 <= error_code <= 599 else 500
