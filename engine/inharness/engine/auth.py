"""Who may use the engine, and from where it may load weights.

On a cluster the engine listens on a pod address that every pod could dial: without these checks
any pod could generate with the policy or make the engine load weights from a path it names. So:

- **An API key** (`--api-key-file`, or `INHARNESS_ENGINE_API_KEY_FILE`): every route but `/health`
  (what kubelet probes and `ServerProcess.wait_healthy` poll) needs `Authorization: Bearer <key>`,
  else 401. This is the scheme of vLLM's own `--api-key`, so the gateway's engine client and the
  trainer's weight-load request send the same header to either engine. The operator puts a
  run-scoped key in the run's Secret (`engine-api-key`) and mounts it into the gateway and the
  trainer; `inharness run` keeps its engine on 127.0.0.1 without a key.
- **A weights root** (`--weights-root`, or `INHARNESS_ENGINE_WEIGHTS_ROOT`): `load_weights` takes
  only paths under it (after resolving symlinks and `..`), else 403. `inharness train` sets it to
  its work directory, where the loop saves each version.

Without a key (or root) the engine is open (loads from any path), as it was: for loopback use.
The key check is a plain ASGI middleware, not FastAPI's `@app.middleware`, which wraps every
streamed body in an extra task and queue.
"""

import argparse
import hmac
import os
from pathlib import Path
from typing import Any

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

API_KEY_FILE_ENV = "INHARNESS_ENGINE_API_KEY_FILE"
WEIGHTS_ROOT_ENV = "INHARNESS_ENGINE_WEIGHTS_ROOT"
OPEN_PATHS = frozenset({"/health"})
"""Routes that need no key: the health check (no data, no effect)."""


class AuthError(Exception):
    """A key file that cannot be used; the message says why."""


def read_key_file(path: str | os.PathLike[str]) -> str:
    """The key in a file (a mounted Secret's item): its content without surrounding whitespace."""
    try:
        key = Path(path).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise AuthError(f"cannot read the key file {path}: {exc}") from exc
    if not key:
        raise AuthError(f"the key file {path} is empty")
    return key


def _error(message: str, status: int, kind: str) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(body, status_code=status, headers=headers)


class BearerAuth:
    """ASGI middleware: HTTP requests to any path but `OPEN_PATHS` need `Authorization: Bearer <key>`."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        if hmac.compare_digest(given, self._expected):
            await self.app(scope, receive, send)
            return
        reason = "a wrong API key" if given else "no API key"
        response = _error(
            f"the engine needs 'Authorization: Bearer <API key>' (got {reason})", 401, "AuthenticationError"
        )
        await response(scope, receive, send)


class WeightsForbidden(Exception):
    """A weight load from outside the weights root."""


def protect(app: Any, *, api_key: str | None, weights_root: str | None) -> None:
    """Install the key check (when there is a key) and the 403 answer of `check_weights_path`."""
    if api_key is not None:
        app.add_middleware(BearerAuth, api_key=api_key)

    async def _forbidden(request: Any, exc: Exception) -> JSONResponse:
        return _error(str(exc), 403, "PermissionDeniedError")

    app.add_exception_handler(WeightsForbidden, _forbidden)


def check_weights_path(path: str, weights_root: str | None) -> None:
    """Raise `WeightsForbidden` unless `path` lies under `weights_root` (None: any path)."""
    if weights_root is None:
        return
    root = Path(weights_root).resolve()
    if not Path(path).resolve().is_relative_to(root):
        raise WeightsForbidden(f"weights are loaded only from under {root}; {path} is outside it")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`--api-key-file` and `--weights-root` of `inharness engine` (and of the server module run as main)."""
    parser.add_argument(
        "--api-key-file",
        default=None,
        help=f"file with the bearer key every route but /health needs (default: ${API_KEY_FILE_ENV}; "
        "none: no key)",
    )
    parser.add_argument(
        "--weights-root",
        default=None,
        help=f"load_weights only from under this directory (default: ${WEIGHTS_ROOT_ENV}; none: any path)",
    )


def settings_from_env(
    api_key_file: str | None, weights_root: str | None, env: Any = os.environ
) -> tuple[str | None, str | None]:
    """(the API key, the weights root) from the flags, else their env vars; (None, None): open."""
    key_file = api_key_file or env.get(API_KEY_FILE_ENV) or None
    root = weights_root or env.get(WEIGHTS_ROOT_ENV) or None
    return (read_key_file(key_file) if key_file else None), root
