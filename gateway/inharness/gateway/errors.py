"""Errors in each harness protocol's own format, mapped from one `APIError` in one place.

The gateway's own APIs and the OpenAI protocols answer `{"error": {"message", "type", "param", "code"}}`
(the app's exception handlers); the Anthropic Messages routes answer
`{"type": "error", "error": {"type", "message"}}` through `protocol_route(anthropic_error_response)`.

Every route that takes a body is a `protocol_route`, which is also where bodies are bounded: its
caller is authenticated first (`authenticate`, before a byte of the body is read), a body longer
than `--max-request-bytes` is answered 413 (by its Content-Length unread, else as soon as it
overruns), one not received within `--request-read-timeout-seconds` is answered 408, and JSON is
parsed by `parse_json`, which takes only what the store and every reader can give back unchanged.
An unexpected exception is a 500 in the same format, never a bare text page.
"""

import asyncio
import json
import logging
import re
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import orjson
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response

log = logging.getLogger("inharness.gateway")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    499: "client_closed_request",
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


# Deepest nesting of arrays and objects a body may have: the store writes it whole and the export
# nests it a few levels deeper in each line, and orjson (every reader's encoder) stops at 254.
MAX_JSON_DEPTH = 128
# Integers a body may hold anywhere: what the store's integer columns, the engines and every reader
# take (orjson writes no more than 64 bits; SQLite and PostgreSQL integers are signed 64-bit).
MIN_INT, MAX_INT = -(2**63), 2**63 - 1
# A body longer than this is parsed on a worker thread, not on the event loop.
PARSE_OFF_LOOP_BYTES = 256 * 1024


def parse_json(body: bytes) -> Any:
    """A request body as JSON that the store keeps and every reader gives back unchanged, or an
    APIError 400 (code `invalid_json`): no NaN or Infinity, no invalid UTF-8, no lone surrogate
    (orjson refuses them), nesting at most `MAX_JSON_DEPTH` deep, and no integer beyond signed 64
    bits (`MIN_INT`, `MAX_INT`; orjson reads a longer one as a float, so a float that large is
    looked at again in the text)."""
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise _invalid(f"is not valid JSON: {exc}") from None
    if _check_json(value):
        try:
            json.loads(body, parse_int=_int64)
        except ValueError as exc:
            raise _invalid(str(exc)) from None
    return value


def _check_json(value: Any) -> bool:
    """Check nesting and integers (an APIError); True when a float is large enough to have been an
    integer literal beyond 64 bits. Iterative, so that no body can exhaust the stack."""
    suspect = False
    stack: list[tuple[Any, int]] = [([value], 0)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise _invalid(f"nests deeper than {MAX_JSON_DEPTH} levels")
        for child in item.values() if isinstance(item, dict) else item:
            kind = type(child)
            if kind is dict or kind is list:
                stack.append((child, depth + 1))
            elif kind is int and not MIN_INT <= child <= MAX_INT:
                raise _invalid(f"holds the integer {child}, beyond 64 bits")
            elif kind is float and abs(child) >= 2**63:
                suspect = True
    return suspect


def _int64(text: str) -> int:
    beyond = ValueError(f"holds an integer of {len(text.lstrip('-'))} digits, beyond 64 bits")
    if len(text) > 20:
        raise beyond
    value = int(text)
    if not MIN_INT <= value <= MAX_INT:
        raise beyond
    return value


def _invalid(what: str) -> APIError:
    return APIError(400, f"the request body {what}", code="invalid_json")


class BoundedRequest(Request):
    """A request whose body is read at most `max_bytes` long and within `timeout` seconds, and whose
    JSON is parsed by `parse_json` (FastAPI reads both through these methods)."""

    max_bytes: int = 8 * 1024 * 1024
    timeout: float = 60.0

    async def body(self) -> bytes:
        if not hasattr(self, "_body"):
            chunks: list[bytes] = []
            size = 0
            try:
                async with asyncio.timeout(self.timeout):
                    async for chunk in self.stream():
                        size += len(chunk)
                        if size > self.max_bytes:
                            raise _too_large(self.max_bytes)
                        chunks.append(chunk)
            except TimeoutError:
                raise APIError(
                    408, f"the request body did not arrive within {self.timeout:g} s", code="request_timeout"
                ) from None
            except ClientDisconnect:
                raise APIError(499, "the client left before its request body arrived") from None
            self._body = b"".join(chunks)
        return self._body

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            if len(body) > PARSE_OFF_LOOP_BYTES:
                self._json = await asyncio.to_thread(parse_json, body)
            else:
                self._json = parse_json(body)
        return self._json


def _too_large(limit: int) -> APIError:
    return APIError(
        413,
        f"the request body exceeds this gateway's limit of {limit} bytes (--max-request-bytes)",
        code="request_too_large",
    )


def _is_json(content_type: str | None) -> bool:
    """Whether FastAPI reads a body of this content type as JSON (strict: none without one)."""
    if not content_type:
        return False
    kind = content_type.partition(";")[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


Authenticate = Callable[[Request], Awaitable[None]]


def protocol_route(fmt: ErrorFormat, *, authenticate: Authenticate | None = None) -> type[APIRoute]:
    """A route class that answers every error in `fmt` (bad bodies included, which fail before the
    endpoint runs): `APIRouter(route_class=...)`. A request is checked in this order, each step
    before the next costs anything: its declared length, its caller (`authenticate`), then its
    body as it arrives (size, time, JSON) before FastAPI validates it."""

    class _Route(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
            handler = super().get_route_handler()

            async def handle(plain: Request) -> Response:
                request = BoundedRequest(plain.scope, plain.receive)
                settings = request.app.state.settings
                request.max_bytes = settings.max_request_bytes
                request.timeout = settings.request_read_timeout_seconds
                try:
                    declared = request.headers.get("content-length", "")
                    if declared.isascii() and declared.isdigit() and int(declared) > request.max_bytes:
                        raise _too_large(request.max_bytes)
                    if authenticate is not None:
                        await authenticate(request)
                    body = await request.body() if request.method in ("POST", "PUT", "PATCH") else b""
                    if body and _is_json(request.headers.get("content-type")):
                        await request.json()  # here, so that its errors keep their message
                    return await handler(request)
                except APIError as exc:
                    return fmt(exc.status, exc.message, param=exc.param, code=exc.code)
                except RequestValidationError as exc:
                    message, param, code = describe_validation_error(exc)
                    return fmt(400, message, param=param, code=code)
                except StarletteHTTPException as exc:
                    return fmt(exc.status_code, str(exc.detail))
                except Exception:
                    log.exception("%s %s failed", request.method, request.url.path)
                    return fmt(500, "the gateway failed to answer this request; its log says why")

            return handle

    return _Route
