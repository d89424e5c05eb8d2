"""Real servers for integration tests (`inharness` subprocesses on 127.0.0.1), and bounded polling."""

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from inharness.procs import ServerProcess, free_port

Server = ServerProcess

__all__ = ["Server", "free_port", "gateway_server", "start_engine"]


def start_engine(model_dir: Path, log_dir: Path) -> ServerProcess:
    port = free_port()
    args = ["engine", "--model", str(model_dir), "--port", str(port)]
    return ServerProcess.inharness(
        args, port=port, log=log_dir / f"engine-{port}.log", health="/health"
    ).start()


def gateway_server(
    model_dir: Path,
    engines: list[str],
    db: Path,
    log_dir: Path,
    *,
    admin_token: str,
    extra: list[str] | None = None,
) -> ServerProcess:
    port = free_port()
    args = ["gateway", "--model", str(model_dir), "--store", f"sqlite:///{db}", "--port", str(port)]
    args += [f"--admin-token={admin_token}"]  # "=": a random token may start with "-"
    for e in engines:
        args += ["--engine", e]
    return ServerProcess.inharness(
        args + (extra or []), port=port, log=log_dir / f"gateway-{port}.log", health="/healthz"
    )


async def eventually(check: Callable[[], Any], what: str, within: float = 30.0) -> Any:
    """Poll `check` (sync or async) until it returns something truthy, and return that; fail after
    `within` seconds naming `what` and the last value."""
    deadline = time.monotonic() + within
    last: Any = None
    while time.monotonic() < deadline:
        result = check()
        if isinstance(result, Awaitable):
            result = await result
        if result:
            return result
        last = result
        await asyncio.sleep(0.05)
    pytest.fail(f"not within {within:.0f}s: {what} (last: {last!r})")
