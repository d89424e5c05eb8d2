"""Errors in each harness protocol's own format, mapped from one `APIError` in one place.

The gateway's own APIs and the OpenAI protocols answer `{"error": {"message", "type", "param", "code"}}`
(the app's exception handlers); the Anthropic Messages routes answer
`{"type": "error", "error": {"type", "message"}}` through `protocol_route(anthropic_error_response)`.
"""

import re
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import orjson
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
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

# Anthropic's error types by status (docs.anthropic.com, "Errors"); a gateway 503 (no engine answers,
# no model version active) is Anthropic's 529 overloaded_error, which its SDK and Claude Code retry.
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    529: "overloaded_error",
}
_ANTHROPIC_STATUS = {503: 529}


class APIError(Exception):
    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


class ErrorFormat(Protocol):
    def __call__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> Response: ...


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


def anthropic_error_body(status: int, message: str) -> tuple[int, dict[str, Any]]:
    """(status, body) of an error as Anthropic's API answers it."""
    status = _ANTHROPIC_STATUS.get(status, status)
    kind = _ANTHROPIC_TYPES.get(status, "api_error")
    return status, {"type": "error", "error": {"type": kind, "message": message}}


def anthropic_error_response(
    status: int, message: str, *, param: str | None = None, code: str | None = None
) -> Response:
    status, body = anthropic_error_body(status, message)
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")


def describe_validation_error(exc: RequestValidationError) -> tuple[str, str | None, str]:
    """Pydantic's first complaint, phrased for a person: (message, field, code)."""
    errors = exc.errors()
    if not errors:
        return "invalid request body", None, "invalid_value"
    if any(e.get("type") == "json_invalid" for e in errors):
        return "the request body is not valid JSON", None, "invalid_json"
    # A value that fits no member of a union fails once per member; the deepest complaint is the
    # one about what the client meant (a bad content part, not "input is not a string").
    located = [(_field_path(e.get("loc", ())), e) for e in errors]
    loc, first = max(located, key=lambda le: len(le[0]))
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None, "invalid_json"
    msg = first.get("msg", "invalid value")
    text = f"{param}: {msg}" if param else msg
    if len(errors) > 1:
        text += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return text, param, "invalid_value"


_TYPE_LABEL = re.compile(r"^(str|int|float|bool|none|list\[.*|dict\[.*|tagged-union\[.*|function-.*)$")


def _field_path(loc: tuple[Any, ...]) -> list[str]:
    """A validation error's location as the client's field path: without `body` and without the
    labels pydantic gives union members (`str`, `list[...]`, ...)."""
    return [str(p) for p in loc if p != "body" and not (isinstance(p, str) and _TYPE_LABEL.match(p))]


async def api_error_handler(_req: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return error_response(exc.status, exc.message, param=exc.param, code=exc.code)


async def validation_error_handler(_req: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    message, param, code = describe_validation_error(exc)
    return error_response(400, message, param=param, code=code)


async def http_error_handler(_req: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    return error_response(exc.status_code, str(exc.detail))


def protocol_route(fmt: ErrorFormat) -> type[APIRoute]:
    """A route class whose errors (bad bodies included, which fail before the endpoint runs) are
    answered in `fmt` instead of the app-wide OpenAI format: `APIRouter(route_class=...)`."""

    class _Route(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
            handler = super().get_route_handler()

            async def handle(request: Request) -> Response:
                try:
                    return await handler(request)
                except APIError as exc:
                    return fmt(exc.status, exc.message, param=exc.param, code=exc.code)
                except RequestValidationError as exc:
                    message, param, code = describe_validation_error(exc)
                    return fmt(400, message, param=param, code=code)

            return handle

    return _Route
