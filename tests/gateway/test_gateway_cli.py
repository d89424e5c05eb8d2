"""`inharness gateway`'s flags are generated from `GatewaySettings`: every setting has a flag and an
env var, a flag wins over its env var, and what is given neither way keeps the model's default."""

import argparse

import pytest

from inharness import cli
from inharness.gateway.settings import GatewaySettings


def parse(*argv: str) -> argparse.Namespace:
    return cli.parser().parse_args(["gateway", *argv])


def test_every_setting_is_a_flag() -> None:
    args = parse()
    assert set(GatewaySettings.model_fields) <= set(vars(args))
    assert all(getattr(args, name) is None for name in GatewaySettings.model_fields), "no flag sets a default"


def test_flags_win_over_env_vars_and_the_rest_keep_their_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INHARNESS_GATEWAY_PORT", "9100")
    monkeypatch.setenv("INHARNESS_GATEWAY_ENGINE_RETRIES", "7")
    monkeypatch.setenv("INHARNESS_GATEWAY_ENGINES", "http://a:1,http://b:2")
    args = parse("--model", "m", "--port", "9200", "--admin-token", "t" * 8, "--sqlite-synchronous", "full")
    settings = GatewaySettings.model_validate(cli.gateway_values(args))
    assert (settings.port, settings.engine_retries, settings.sqlite_synchronous) == (9200, 7, "full")
    assert settings.engines == ["http://a:1", "http://b:2"]
    assert settings.hold_seconds == GatewaySettings.model_fields["hold_seconds"].default

    repeated = cli.gateway_values(parse("--engine", "http://c:3", "--engine", "http://d:4"))
    assert repeated["engines"] == ["http://c:3", "http://d:4"], "a flag wins over the env var"


def test_a_bad_value_names_its_flag_and_env_var(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["gateway", "--model", "m", "--admin-token", "t" * 8, "--max-attempts", "0"]) == 2
    err = capsys.readouterr().err
    expected = "--max-attempts (INHARNESS_GATEWAY_MAX_ATTEMPTS): Input should be greater than or equal to 1"
    assert expected in err
