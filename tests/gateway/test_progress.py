"""The trainer's progress reports, kept by a real gateway on 127.0.0.1 and read back by whoever
watches the run (the operator maps them into the TrainingRun's status)."""

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import ADMIN
from testsupport import Server, free_port, gateway_server

from inharness.gateway.client import GatewayClient
from inharness.gateway.progress import HISTORY, ProgressBoard
from inharness.gateway.schema import ProgressReport
from inharness.trainer.loop import LoopConfig, LoopState, RunDir, TrainingLoop


@pytest.fixture(scope="module")
def gateway(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, log_dir: Path) -> Iterator[Server]:
    db = tmp_path_factory.mktemp("gw-progress") / "gateway.db"
    server = gateway_server(tiny_model, [], db, log_dir, admin_token=ADMIN).start()
    yield server
    server.stop()


async def test_reports_are_read_back_with_history_version_and_rollout_counts(gateway: Server) -> None:
    async with GatewayClient(gateway.url, ADMIN) as gw:
        before = await gw.progress()
        assert not before.reported and before.step == 0 and before.reward_history == []

        created = await gw.create_rollouts([{"q": 1}, {"q": 2}], pool="progress-pool")
        assert await gw.hold([created[0].id]) == 1
        await gw.register_version(3, ["http://127.0.0.1:9"], activate=True)
        for step, reward in [(1, 0.25), (2, 0.5)]:
            await gw.report_progress(
                ProgressReport(step=step, total_steps=4, reward_mean=reward, config_sha256="abc")
            )
        out = await gw.report_progress(ProgressReport(step=3, total_steps=4, reward_mean=None))

    assert out.reported and out.step == 3 and out.total_steps == 4 and out.state == "running"
    assert out.reward_history == [0.25, 0.5]  # a step without a reward adds none
    assert out.reward_mean is None and out.config_sha256 is None
    assert out.model_version == 3
    assert set(out.rollouts) == {"queued", "held", "running", "succeeded", "failed"}, "every status counted"
    assert out.rollouts["queued"] >= 1 and out.rollouts["held"] == 1


def test_progress_needs_the_admin_token_and_a_valid_report(gateway: Server) -> None:
    assert httpx.get(f"{gateway.url}/api/v1/progress").status_code == 401
    bad = httpx.post(
        f"{gateway.url}/api/v1/progress",
        json={"step": -1, "total_steps": 4},
        headers={"Authorization": f"Bearer {ADMIN}"},
    )
    assert bad.status_code == 400, bad.text
    assert bad.json()["error"]["param"] == "step"


def test_a_resumed_trainer_reporting_an_earlier_step_drops_the_later_history() -> None:
    board = ProgressBoard()
    for step in range(1, 8):
        board.record(ProgressReport(step=step, total_steps=10, reward_mean=step / 10))
    board.record(ProgressReport(step=5, total_steps=10, reward_mean=0.9))
    assert board.history() == [0.1, 0.2, 0.3, 0.4, 0.9]


def test_history_keeps_the_last_hundred_steps() -> None:
    board = ProgressBoard()
    for step in range(1, HISTORY + 21):
        board.record(ProgressReport(step=step, total_steps=1000, reward_mean=float(step)))
    assert board.history() == [float(s) for s in range(21, HISTORY + 21)]


def _loop(gw: GatewayClient, tmp_path: Path, step: int) -> TrainingLoop:
    config = LoopConfig(
        run_name="r",
        pool="p",
        steps=10,
        batch_size=1,
        group_size=2,
        max_attempts=1,
        max_staleness=0,
        checkpoint_interval=5,
        checkpoint_keep=1,
        seed=0,
        max_tokens_per_sample=None,
        update=None,
        config_sha256="f" * 64,
    )
    return TrainingLoop(
        gateway=gw,
        inference=None,  # type: ignore[arg-type]  # reporting never touches inference or the policy
        policy=None,  # type: ignore[arg-type]
        tasks=[],
        config=config,
        run_dir=RunDir(tmp_path),
        state=LoopState(step=step),
    )


async def test_the_training_loop_reports_its_step_state_and_config(gateway: Server, tmp_path: Path) -> None:
    async with GatewayClient(gateway.url, ADMIN) as gw:
        await _loop(gw, tmp_path, step=7).report("failed", reward_mean=float("nan"), message="dataset gone")
        out = await gw.progress()
    assert (out.step, out.total_steps, out.state) == (7, 10, "failed")
    assert out.message == "dataset gone" and out.reward_mean is None and out.config_sha256 == "f" * 64


async def test_an_undelivered_report_does_not_stop_training(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """No gateway listens: the report returns (it would raise otherwise) and says it was not delivered."""
    async with GatewayClient(f"http://127.0.0.1:{free_port()}", ADMIN, timeout=2) as gw:
        with caplog.at_level("WARNING", logger="inharness.trainer"):
            await _loop(gw, tmp_path, step=1).report("running", reward_mean=0.5)
    [record] = [r for r in caplog.records if "not delivered" in r.getMessage()]
    assert "step 1" in record.getMessage()


async def test_a_starting_trainer_reports_its_ray_nodes_without_touching_its_step(gateway: Server) -> None:
    """Engine verl: the Ray head posts "k of n nodes joined" before it knows its step (it has not
    loaded its checkpoint yet); the last step report and the reward history stay as they were."""
    async with GatewayClient(gateway.url, ADMIN) as gw:
        before = await gw.report_progress(ProgressReport(step=2, total_steps=4, reward_mean=0.5))
        starting = ProgressReport(step=0, total_steps=4, state="starting", ray_nodes=1, ray_nodes_wanted=2)
        waiting = await gw.report_progress(starting)
        joined = await gw.report_progress(starting.model_copy(update={"ray_nodes": 2}))
        after = await gw.report_progress(ProgressReport(step=3, total_steps=4, reward_mean=0.75))
    assert (waiting.ray_nodes, waiting.ray_nodes_wanted) == (1, 2)
    assert (waiting.step, waiting.state, waiting.reward_history) == (2, "running", before.reward_history)
    assert (joined.ray_nodes, after.ray_nodes, after.ray_nodes_wanted) == (2, 2, 2)  # kept by step reports
    assert after.step == 3 and after.reward_history[-1] == 0.75
