"""`inharness train`, the trainer the operator's StatefulSet runs, as a real process on 127.0.0.1
against a real gateway: this test plays the RolloutPool controller (it claims the attempts and
completes them with rewards) and reads what the operator would read, the gateway's progress."""

import asyncio
import hashlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from testsupport import Server, free_port, gateway_server

from inharness import cli
from inharness.gateway.client import GatewayClient
from inharness.operator import render
from inharness.operator.spec import HarnessSpec, RolloutPool, TrainingRun

TOKEN = "cluster-train-admin-token"
pytestmark = pytest.mark.slow


@pytest.fixture
def gateway(tiny_model: Path, tmp_path: Path) -> Iterator[Server]:
    server = gateway_server(tiny_model, [], tmp_path / "gateway.db", tmp_path, admin_token=TOKEN).start()
    yield server
    server.stop()


def run_yaml(model: Path, tmp_path: Path, *, dataset: dict[str, Any], steps: int = 2) -> Path:
    """The run's config as the operator's ConfigMap holds it."""
    meta = {"apiVersion": "inharness.dev/v1alpha1"}
    harness = HarnessSpec.model_validate(
        {
            **meta,
            "kind": "HarnessSpec",
            "metadata": {"name": "h"},
            "spec": {"image": "x", "command": ["true"]},
        }
    )
    pool = RolloutPool.model_validate(
        {**meta, "kind": "RolloutPool", "metadata": {"name": "p"}, "spec": {"harnessRef": {"name": "h"}}}
    )
    run = TrainingRun.model_validate(
        {
            **meta,
            "kind": "TrainingRun",
            "metadata": {"name": "r"},
            "spec": {
                "model": {"path": str(model)},
                "dataset": dataset,
                "rolloutPoolRef": {"name": "p"},
                "algorithm": {"groupSize": 2},
                "batchSize": 1,
                "steps": steps,
                "checkpoint": {"interval": 1},
                "trainer": {"gpus": 0},
            },
        }
    )
    path = tmp_path / "run.yaml"
    path.write_text(render.run_config(run, pool, harness, "ns"))
    return path


def tail(log: Path, chars: int = 3000) -> str:
    return log.read_text()[-chars:]


def start_trainer(config: Path, out: Path, gateway: Server, log: Path) -> subprocess.Popen[bytes]:
    port = free_port()
    argv = [sys.executable, "-m", "inharness.cli", "train", "--config", str(config), "--out", str(out)]
    argv += ["--gateway-url", gateway.url, "--engine-host", "127.0.0.1", "--engine-port", str(port)]
    env = {**os.environ, "INHARNESS_GATEWAY_ADMIN_TOKEN": TOKEN}
    with log.open("ab") as f:
        return subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)


async def play_rollout_pool(gw: GatewayClient, trainer: subprocess.Popen[bytes], log: Path) -> int:
    """Make one model call in every attempt the trainer queues, as a harness would, and complete it
    (rewards 1, 0, 1, ...) until the trainer reports completion."""
    completed, deadline = 0, time.monotonic() + 240
    while time.monotonic() < deadline:
        assert trainer.poll() is None, f"the trainer exited with {trainer.returncode}:\n{tail(log)}"
        progress = await gw.progress()
        if progress.state == "complete":
            return completed
        attempt = await gw.claim("p", lease_seconds=60)
        if attempt is None:
            await asyncio.sleep(0.1)
            continue
        await call_the_model(gw.base_url, attempt.token)
        await gw.complete(attempt.id, "succeeded", reward=float(completed % 2 == 0))
        completed += 1
    pytest.fail(f"the trainer did not report completion:\n{tail(log)}")


async def call_the_model(gateway_url: str, key: str) -> None:
    body = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    async with httpx.AsyncClient(timeout=60) as http:
        r = await http.post(
            f"{gateway_url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
        )
    assert r.status_code == 200, r.text


async def waiting_to_be_scaled_down(trainer: subprocess.Popen[bytes], log: Path, *, times: int) -> None:
    deadline = time.monotonic() + 120
    while tail(log, 10**9).count("waiting to be scaled down") < times:
        assert trainer.poll() is None, tail(log)
        assert time.monotonic() < deadline, tail(log)
        await asyncio.sleep(0.2)
    assert trainer.poll() is None


def stop(trainer: subprocess.Popen[bytes]) -> int:
    os.killpg(trainer.pid, signal.SIGTERM)
    return trainer.wait(timeout=60)


async def test_cluster_trainer_trains_reports_progress_idles_when_done_and_resumes(
    gateway: Server, tiny_model: Path, tmp_path: Path
) -> None:
    config = run_yaml(tiny_model, tmp_path, dataset={"tasks": [{"q": 1}, {"q": 2}]})
    out, log = tmp_path / "out", tmp_path / "trainer.log"
    trainer = start_trainer(config, out, gateway, log)
    try:
        async with GatewayClient(gateway.url, TOKEN) as gw:
            completed = await play_rollout_pool(gw, trainer, log)
            progress = await gw.progress()
            assert completed == 4  # 2 steps x 1 task x group of 2
            assert (progress.step, progress.total_steps, progress.state) == (2, 2, "complete")
            assert progress.config_sha256 == hashlib.sha256(config.read_bytes()).hexdigest()
            assert progress.reward_history == [0.5, 0.5] and progress.model_version == 2
            assert (out / "checkpoints" / "step-2" / "state.json").exists()
            # done: it waits to be scaled down instead of exiting (and being restarted) in a loop
            await waiting_to_be_scaled_down(trainer, log, times=1)
    finally:
        code = stop(trainer)
    assert code == 0, tail(log)

    # a restarted pod resumes from the last checkpoint: nothing to do, no new rollouts
    again = start_trainer(config, out, gateway, log)
    try:
        async with GatewayClient(gateway.url, TOKEN) as gw:
            await waiting_to_be_scaled_down(again, log, times=2)
            progress = await gw.progress()
            assert progress.state == "complete" and sum(progress.rollouts.values()) == 4
    finally:
        assert stop(again) == 0


async def test_cluster_trainer_reports_a_config_that_cannot_run_as_failed(
    gateway: Server, tiny_model: Path, tmp_path: Path
) -> None:
    config = run_yaml(tiny_model, tmp_path, dataset={"path": "no-such-tasks.jsonl"}, steps=3)
    log = tmp_path / "trainer.log"
    trainer = start_trainer(config, tmp_path / "out", gateway, log)
    assert trainer.wait(timeout=120) == 1, tail(log)
    async with GatewayClient(gateway.url, TOKEN) as gw:
        progress = await gw.progress()
    assert progress.state == "failed" and progress.total_steps == 3
    assert "no-such-tasks.jsonl" in (progress.message or "")
    assert progress.config_sha256 == hashlib.sha256(config.read_bytes()).hexdigest()


def test_the_rendered_trainer_command_is_what_inharness_train_accepts(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from inharness.operator.specfile import load_specs

    specs = load_specs(
        Path(__file__).parents[2] / "examples" / "calc" / "trainingrun.yaml", check_files=False
    )
    settings = render.RenderSettings(gateway_image="g", trainer_image="t")
    objs = render.render_children(
        specs.training_run, specs.rollout_pool, specs.harness, settings=settings, admin_token="x" * 16
    )
    (sts,) = [o for o in objs if o["kind"] == "StatefulSet"]
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["inharness"]
    monkeypatch.delenv("INHARNESS_GATEWAY_ADMIN_TOKEN", raising=False)
    monkeypatch.setenv("INHARNESS_GATEWAY_URL", "http://calc-gateway:8000")
    # argparse accepts the rendered arguments; the missing token (a Secret in the pod) is what stops it
    assert cli.main(container["args"]) == 2
    assert "INHARNESS_GATEWAY_ADMIN_TOKEN" in capsys.readouterr().err
