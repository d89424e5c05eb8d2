"""What answers the gateway's calls, and how a version reaches it (`inharness.trainer.inference`).

vLLM cannot run on this machine (CUDA only; it belongs to the GPU image, docker/Dockerfile.trainer), so
its path is pinned here where it can be: the settings verl's own config classes accept for hybrid
vLLM servers, a machine without a GPU refused with a message, and the loop's contract with an
inference that shares the training devices, run against a real gateway. `make gpu-smoke` runs the
rest on a GPU machine (docs/verl.md).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import ADMIN
from test_local_run import write_spec
from testsupport import gateway_server, start_engine

from inharness.gateway.client import GatewayClient
from inharness.trainer.config import LoopConfig, UpdateConfig
from inharness.trainer.inference import EngineServers
from inharness.trainer.loop import LoopState, RunDir
from inharness.trainer.verl_engine.servers import VllmConfig, rollout_settings, server_urls

VLLM = VllmConfig(gpu_memory_utilization=0.4, tensor_parallel_size=2, max_model_len=4096)


def _config(model: Path, tmp_path: Path, vllm: VllmConfig | None) -> Any:
    from inharness.trainer.verl_engine.engine import worker_config

    return worker_config(
        model,
        learning_rate=1e-5,
        dtype="bfloat16",
        seed=3,
        weights_root=tmp_path / "weights",
        cpu=False,
        update=UpdateConfig(),
        vllm=vllm,
        nnodes=1,
        gpus_per_node=4,
    )


def test_hybrid_vllm_settings_are_what_verl_config_classes_accept(tiny_model: Path, tmp_path: Path) -> None:
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import CheckpointEngineConfig, RolloutConfig

    cfg = _config(tiny_model, tmp_path, VLLM)
    rollout = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)
    assert isinstance(rollout, RolloutConfig)
    assert (rollout.name, rollout.mode, rollout.load_format) == ("vllm", "async", "dummy")
    assert rollout.free_cache_engine and rollout.enable_sleep_mode
    assert (rollout.gpu_memory_utilization, rollout.tensor_model_parallel_size) == (0.4, 2)
    assert rollout.max_model_len == rollout.prompt_length + rollout.response_length == 4096
    assert (rollout.dtype, rollout.logprobs_mode, rollout.seed) == ("bfloat16", "processed_logprobs", 3)
    assert (rollout.nnodes, rollout.n_gpus_per_node) == (1, 4)
    assert cfg.actor_rollout_ref.hybrid_engine  # LLMServerManager.init_hybrid puts a server in each worker
    checkpoints = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout.checkpoint_engine)
    assert isinstance(checkpoints, CheckpointEngineConfig) and checkpoints.backend == "naive"
    assert CheckpointEngineRegistry.get("naive") is not None
    # LLMServerManager's own arithmetic: one server per tensorParallelSize GPUs of the actor group
    world = 4
    assert world // (rollout.tensor_model_parallel_size * rollout.data_parallel_size) == 2


def test_without_vllm_each_version_is_a_model_directory(tiny_model: Path, tmp_path: Path) -> None:
    from inharness.trainer.verl_engine import checkpoint_files

    rollout = _config(tiny_model, tmp_path, None).actor_rollout_ref.rollout
    assert rollout.checkpoint_engine.backend == checkpoint_files.BACKEND
    assert rollout.checkpoint_engine.engine_kwargs[checkpoint_files.BACKEND]["root"] == str(
        tmp_path / "weights"
    )


def test_rollout_settings_split_the_model_length_and_keep_the_policy_dtype() -> None:
    got = rollout_settings(VllmConfig(max_model_len=1001), dtype="float32", seed=0, nnodes=2, gpus_per_node=8)
    assert (got["prompt_length"], got["response_length"], got["dtype"]) == (501, 500, "float32")
    assert (got["nnodes"], got["n_gpus_per_node"]) == (2, 8)


def test_server_addresses_become_urls_the_gateway_dials() -> None:
    assert server_urls(["10.0.0.5:41234", "[fd00::1]:8000", "http://h:1"]) == [
        "http://10.0.0.5:41234",
        "http://[fd00::1]:8000",
        "http://h:1",
    ]


def test_vllm_without_gpus_is_refused_before_ray_starts(tiny_model: Path, tmp_path: Path) -> None:
    from inharness.trainer.verl_engine.engine import VerlTrainingEngine

    with pytest.raises(ValueError, match="vLLM servers need GPUs"):
        VerlTrainingEngine(
            tiny_model, learning_rate=1e-5, weights_root=tmp_path, update=UpdateConfig(), vllm=VLLM
        )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_a_run_on_vllm_without_a_gpu_stops_with_a_message(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from inharness import run as local_run

    spec = write_spec(tmp_path / "run.yaml", tiny_model, steps=1)
    text = spec.read_text() + "  trainer: {engine: verl, gpus: 1, inference: vllm}\n"
    spec.write_text(text)
    assert local_run.run_file(spec, tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert "spec.trainer.inference is vllm, but this machine has no GPU that torch can use" in err


class _Recorded(EngineServers):
    """inharness's engine declared as sharing the training devices, recording what the gateway's
    serving state was at each of the loop's calls (the real engine answers; nothing is faked)."""

    shares_devices = True

    def __init__(self, gw: GatewayClient, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gw = gw
        self.events: list[tuple[str, bool]] = []

    async def release(self) -> None:
        self.events.append(("release", (await self.gw.serving()).paused))

    async def publish(self, version: int) -> None:
        self.events.append((f"publish v{version}", (await self.gw.serving()).paused))
        await super().publish(version)


def test_an_inference_that_shares_the_devices_is_released_and_fed_while_calls_are_held(
    tiny_model: Path, log_dir: Path, tmp_path: Path
) -> None:
    """sync mode, which otherwise holds calls only while the weights load: with shared devices the
    hold starts before `release` and ends after the version is registered with the servers' URLs."""
    from inharness.trainer.loop import TrainingLoop
    from inharness.trainer.samples import Sample
    from inharness.trainer.torch_engine import TorchTrainingEngine

    rd = RunDir(tmp_path / "run")
    engine = start_engine(tiny_model, log_dir)
    gateway = gateway_server(tiny_model, [engine.url], tmp_path / "gw.db", log_dir, admin_token=ADMIN).start()
    sample = Sample(
        rollout_id="r",
        group_id="g",
        call_ids=[1],
        input_ids=[5, 6, 7, 8],
        loss_mask=[0, 0, 1, 1],
        behaviour_logprobs=[0.0, 0.0, -1.0, -1.0],
        model_versions=[0],
        reward=1.0,
        num_prompt_tokens=2,
    )

    async def main() -> tuple[list[tuple[str, bool]], bool, list[list[str]]]:
        async with GatewayClient(gateway.url, ADMIN) as gw:
            policy = TorchTrainingEngine(tiny_model, learning_rate=1e-4)
            inference = _Recorded(gw, policy, [engine.url], rd.weights)
            training = TrainingLoop(
                gateway=gw,
                inference=inference,
                policy=policy,
                tasks=["a"],
                config=_sync_config(),
                run_dir=rd,
                state=LoopState(),
            )
            await training._update_and_publish([sample])
            versions = await gw.versions()
            active = [v.engines for v in versions.versions if v.active]
            return inference.events, (await gw.serving()).paused, active

    try:
        events, paused_after, active = asyncio.run(main())
    finally:
        gateway.stop()
        engine.stop()
    assert events == [("release", True), ("publish v1", True)]
    assert not paused_after
    assert active == [[engine.url]]
    assert (rd.weights / "v1" / "config.json").is_file()


def _sync_config() -> LoopConfig:
    return LoopConfig(
        run_name="seam",
        pool="seam-pool",
        steps=1,
        batch_size=1,
        group_size=1,
        max_attempts=1,
        max_staleness=0,
        checkpoint_interval=1,
        checkpoint_keep=1,
        seed=0,
        max_tokens_per_sample=None,
        update=UpdateConfig(),
        scheduling_mode="sync",
    )
