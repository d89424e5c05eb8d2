"""The engine's API key and weights root (`inharness.engine.auth`), against a real `inharness engine`
process on 127.0.0.1: every route but /health needs the key, and weights load only from under the root."""

import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from inharness.engine.tiny import init_tiny
from inharness.procs import ServerProcess, free_port

KEY = "engine-key-0123456789"
COMPLETION = {"prompt": [300, 75, 417], "max_tokens": 2, "temperature": 0}


@dataclass(frozen=True)
class Engine:
    url: str
    model: Path
    root: Path  # the weights root


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    tmp = tmp_path_factory.mktemp("engine-auth")
    model = init_tiny(tmp / "tiny", seed=0)
    root = tmp / "work" / "weights"
    shutil.copytree(model, root / "v1")
    (tmp / "key").write_text(KEY + "\n")  # a Secret's file may end with a newline
    port = free_port()
    argv = ["engine", "--model", str(model), "--port", str(port), "--threads", "1"]
    argv += ["--api-key-file", str(tmp / "key"), "--weights-root", str(root)]
    proc = ServerProcess.inharness(argv, port=port, log=tmp / "engine.log", health="/health").start()
    try:
        yield Engine(proc.url, model, root)
    finally:
        proc.stop()


def auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_health_is_open(engine: Engine) -> None:
    assert httpx.get(f"{engine.url}/health").status_code == 200


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("GET", "/v1/models", None),
        ("POST", "/v1/completions", COMPLETION),
        ("POST", "/v1/inharness/load_weights", {"path": "/anything"}),
        ("GET", "/docs", None),
        ("GET", "/no/such/route", None),
    ],
)
@pytest.mark.parametrize("headers", [{}, auth("wrong-key"), {"Authorization": KEY}])
def test_every_other_route_needs_the_key(
    engine: Engine, method: str, path: str, body: object, headers: dict[str, str]
) -> None:
    r = httpx.request(method, engine.url + path, json=body, headers=headers)
    assert r.status_code == 401
    assert r.headers["www-authenticate"] == "Bearer"
    assert r.json()["error"]["type"] == "AuthenticationError"


def test_with_the_key_the_engine_serves(engine: Engine) -> None:
    assert httpx.get(f"{engine.url}/v1/models", headers=auth()).json()["data"][0]["id"] == "tiny"
    r = httpx.post(f"{engine.url}/v1/completions", json=COMPLETION, headers=auth(), timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("where", ["model", "escape", "sibling"])
def test_weights_outside_the_root_are_refused(engine: Engine, where: str) -> None:
    path = {
        "model": str(engine.model),  # real weights, outside the root
        "escape": f"{engine.root}/../../tiny",  # the same, through the root
        "sibling": f"{engine.root}-other/v1",  # a name that merely starts like the root
    }[where]
    r = httpx.post(f"{engine.url}/v1/inharness/load_weights", json={"path": path}, headers=auth(), timeout=30)
    assert r.status_code == 403, r.text
    assert r.json()["error"]["type"] == "PermissionDeniedError"


def test_weights_under_the_root_load(engine: Engine) -> None:
    path = str(engine.root / "v1")
    r = httpx.post(f"{engine.url}/v1/inharness/load_weights", json={"path": path}, headers=auth(), timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["loaded"] == path


def test_a_missing_key_file_stops_the_engine(tmp_path: Path) -> None:
    port = free_port()
    argv = ["engine", "--model", str(tmp_path), "--port", str(port), "--api-key-file", str(tmp_path / "none")]
    proc = ServerProcess.inharness(argv, port=port, log=tmp_path / "engine.log", health="/health").spawn()
    assert proc.proc is not None
    assert proc.proc.wait(timeout=120) == 2
    assert "cannot read the key file" in (tmp_path / "engine.log").read_text()
