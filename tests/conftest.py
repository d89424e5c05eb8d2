"""Session fixtures: a tiny model made here (nothing from a hub), warmed up to call a tool, and a
real engine serving it on 127.0.0.1."""

from collections.abc import Iterator
from pathlib import Path

import pytest
from testsupport import Server, start_engine

from inharness.demo import CALC_CONVERSATION, WARMUP_STEPS

ADMIN = "test-admin-token"
TOOL_ARGS = {"expression": "2+3"}


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from inharness.engine.tiny import init_tiny

    return init_tiny(tmp_path_factory.mktemp("models") / "tiny", seed=0)


@pytest.fixture(scope="session")
def tool_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from inharness.trainer.sft import sft

    out = tmp_path_factory.mktemp("models") / "tiny-calc"
    sft(tiny_model, [CALC_CONVERSATION], out_dir=out, steps=WARMUP_STEPS)
    return out


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="session")
def engine(tool_model: Path, log_dir: Path) -> Iterator[Server]:
    server = start_engine(tool_model, log_dir)
    yield server
    server.stop()
