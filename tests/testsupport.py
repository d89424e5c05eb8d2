"""Real servers for integration tests: `inharness` subprocesses on 127.0.0.1."""

from pathlib import Path

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
    args += ["--admin-token", admin_token]
    for e in engines:
        args += ["--engine", e]
    return ServerProcess.inharness(
        args + (extra or []), port=port, log=log_dir / f"gateway-{port}.log", health="/healthz"
    )
