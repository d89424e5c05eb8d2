"""The gateway's side of the engine's API key: its engine client sends `Authorization: Bearer <key>` to a
real `inharness engine --api-key-file` on 127.0.0.1, and its settings take secrets from files."""

import asyncio
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from pydantic import ValidationError

from inharness.engine.tiny import init_tiny
from inharness.gateway.engines import EnginePool, EngineRejected
from inharness.gateway.settings import GatewaySettings
from inharness.procs import ServerProcess, free_port

KEY = "engine-key-0123456789"
BODY = {"prompt": [300, 75, 417], "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def engine_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("gateway-engine-auth")
    model = init_tiny(tmp / "tiny", seed=0)
    (tmp / "key").write_text(KEY)
    port = free_port()
    argv = ["engine", "--model", str(model), "--port", str(port), "--threads", "1"]
    argv += ["--api-key-file", str(tmp / "key")]
    proc = ServerProcess.inharness(argv, port=port, log=tmp / "engine.log", health="/health").start()
    try:
        yield proc.url
    finally:
        proc.stop()


async def _call(url: str, api_key: str | None) -> tuple[bool, str | None, list[int] | EngineRejected]:
    """(healthy, served model name, the completion's ids or the refusal) through one EnginePool."""
    async with aiohttp.ClientSession() as session:
        pool = EnginePool(session, retries=0, api_key=api_key)
        pool.set_version(0, [url])
        [engine] = pool.engines()
        await pool.check(engine)
        try:
            _, choices = await pool.complete("attempt-1", 0, BODY)
        except EngineRejected as exc:
            return engine.healthy, engine.model, exc
        return engine.healthy, engine.model, choices[0].token_ids


def test_the_engine_client_sends_the_key(engine_url: str) -> None:
    healthy, model, out = asyncio.run(_call(engine_url, KEY))
    assert healthy and model == "tiny"
    assert isinstance(out, list) and len(out) == 2


@pytest.mark.parametrize("key", [None, "wrong-key"])
def test_without_the_key_the_engine_refuses_the_gateway(engine_url: str, key: str | None) -> None:
    healthy, model, out = asyncio.run(_call(engine_url, key))
    assert not healthy and model is None  # /health answers, /v1/models does not: not usable
    assert isinstance(out, EngineRejected) and out.status == 401


def test_settings_take_the_admin_token_from_a_file(tmp_path: Path) -> None:
    (tmp_path / "admin").write_text("admin-token-123\n")
    (tmp_path / "engine").write_text(KEY)
    settings = GatewaySettings(
        model="m", admin_token_file=str(tmp_path / "admin"), engine_api_key_file=str(tmp_path / "engine")
    )
    assert settings.admin_token == "admin-token-123"
    assert settings.engine_api_key() == KEY
    assert GatewaySettings(model="m", admin_token="t" * 8).engine_api_key() is None


def test_settings_refuse_two_admin_tokens_or_unreadable_files(tmp_path: Path) -> None:
    (tmp_path / "admin").write_text("admin-token-123")
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValidationError, match="exactly one of admin_token and admin_token_file"):
        GatewaySettings(model="m", admin_token="t" * 8, admin_token_file=str(tmp_path / "admin"))
    with pytest.raises(ValidationError, match="cannot read the key file"):
        GatewaySettings(model="m", admin_token_file=str(tmp_path / "missing"))
    with pytest.raises(ValidationError, match="is empty"):
        GatewaySettings(model="m", admin_token="t" * 8, engine_api_key_file=str(tmp_path / "empty"))


def test_inharness_gateway_takes_both_files_as_flags_or_env(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from inharness import cli

    (tmp_path / "admin").write_text("admin-token-123")
    (tmp_path / "engine").write_text(KEY)
    argv = ["gateway", "--model", "m", "--admin-token-file", str(tmp_path / "admin")]
    values = cli.gateway_values(
        cli.parser().parse_args([*argv, "--engine-api-key-file", str(tmp_path / "engine")])
    )
    settings = GatewaySettings.model_validate(values)
    assert (settings.admin_token, settings.engine_api_key()) == ("admin-token-123", KEY)
    monkeypatch.setenv("INHARNESS_GATEWAY_ENGINE_API_KEY_FILE", str(tmp_path / "engine"))
    assert (
        GatewaySettings.model_validate(cli.gateway_values(cli.parser().parse_args(argv))).engine_api_key()
        == KEY
    )
