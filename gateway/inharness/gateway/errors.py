"""Errors in OpenAI's format, `{"error": {"message", "type", "param", "code"}}`, for every API."""

from typing import Any

import orjson
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    500: "server_error",
    502: "server_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class APIError(Exception):
    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def error_body(
    status: int, message: str, *, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {
        "error": {"message": message, "type": _TYPES.get(status, "api_error"), "param": param, "code": code}
    }


def error_response(
    status: int, message: str, *, param: str | None = None, code: str | None = None
) -> Response:
    return Response(
        orjson.dumps(error_body(status, message, param=param, code=code)),
        status_code=status,
        media_type="application/json",
    )


async def api_error_handler(_req: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return error_response(exc.status, exc.message, param=exc.param, code=exc.code)


async def validation_error_handler(_req: Request, exc: Exception) -> Response:
    """Pydantic's first complaint, phrased for a person: which field, what is wrong."""
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    if not errors:
        return error_response(400, "invalid request body")
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return error_response(400, "the request body is not valid JSON", code="invalid_json")
    msg = first.get("msg", "invalid value")
    text = f"{param}: {msg}" if param else msg
    if len(errors) > 1:
        text += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return error_response(400, text, param=param, code="invalid_value")


async def http_error_handler(_req: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    return error_response(exc.status_code, str(exc.detail))
