"""vLLM servers on the training GPUs (``spec.trainer.inference: vllm``), started and fed by verl.

verl's hybrid engine puts a vLLM server beside each actor worker on the same GPUs. We drive it with
verl's own managers rather than reimplementing them:

- `LLMServerManager` (``verl/workers/rollout/llm_server.py``) starts one vLLM OpenAI server per
  ``tensorParallelSize`` GPUs inside the actor workers (``init_hybrid``) on ports it picks; their
  addresses are what the gateway dials for each version (``/v1/completions`` with token ids, as with
  inharness's engine; `inharness.gateway.engines` reads the served model name from ``/v1/models``).
- `CheckpointEngineManager` (``verl/checkpoint_engine/base.py``) moves weights: ``sleep_replicas``
  frees the servers' weights and KV cache before an update (the gateway holds calls meanwhile; none is
  in flight, the pause drained them), and ``update_weights(global_steps=v)`` with the ``naive``
  backend wakes them with the actor's new weights, copied in place inside each worker (CUDA IPC).

So an update is: pause (drain) -> `release` (sleep) -> train -> `publish` (weights in, awake) ->
register the version with the same addresses -> resume. vLLM is imported by verl inside the workers
only; this module runs without it until `VllmServers.start`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class VllmConfig:
    """``spec.trainer.vllm``: the servers' share of each GPU, GPUs per server, longest sequence."""

    gpu_memory_utilization: float = 0.5
    tensor_parallel_size: int = 1
    max_model_len: int = 8192


def rollout_settings(
    vllm: VllmConfig, *, dtype: str, seed: int, nnodes: int, gpus_per_node: int
) -> dict[str, Any]:
    """verl's ``actor_rollout_ref.rollout`` settings for hybrid vLLM servers behind the gateway.

    - ``load_format: dummy``: the servers start with random weights and get the actor's in
      `VllmServers.start`, as verl's trainer does (no second read of the checkpoint from disk).
    - ``free_cache_engine`` and sleep mode: weights and KV cache leave the GPU while the policy trains.
    - ``dtype`` the policy's, so that the behaviour log-probs the gateway records come from the same
      numerics the trainer scores (`tis` corrects what differs anyway).
    - ``logprobs_mode: processed_logprobs``: log-probs after temperature, what the gateway records from
      inharness's engine and the trainer's ``spec.generation.temperature`` scores.
    - ``max_model_len`` split evenly into prompt and response budgets, which verl requires; the
      gateway's requests set ``max_tokens`` themselves.

    The checkpoint engine stays verl's default, ``naive``: weights copied within each worker process.
    """
    response = vllm.max_model_len // 2
    return {
        "name": "vllm",
        "mode": "async",
        "load_format": "dummy",
        "free_cache_engine": True,
        "enable_sleep_mode": True,
        "dtype": dtype,
        "logprobs_mode": "processed_logprobs",
        "gpu_memory_utilization": vllm.gpu_memory_utilization,
        "tensor_model_parallel_size": vllm.tensor_parallel_size,
        "data_parallel_size": 1,
        "max_model_len": vllm.max_model_len,
        "prompt_length": vllm.max_model_len - response,
        "response_length": response,
        "nnodes": nnodes,
        "n_gpus_per_node": gpus_per_node,
        "seed": seed,
    }


def server_urls(addresses: list[str]) -> list[str]:
    """verl's ``host:port`` (``[v6]:port``) addresses as the base URLs the gateway dials."""
    return [a if a.startswith(("http://", "https://")) else f"http://{a}" for a in addresses]


class HybridWorkers(Protocol):
    """What `VllmServers.start` reads of a `VerlTrainingEngine` (the engine imports this module, not
    the other way round): its servers' settings, its verl config and its actor worker group."""

    vllm: VllmConfig | None
    config: Any
    actor: Any


class VllmServers:
    """The `inference.Inference` of a `VerlTrainingEngine` built with ``vllm``: its vLLM servers."""

    shares_devices = True

    def __init__(self, manager: Any, checkpoints: Any) -> None:
        self._manager = manager
        self._checkpoints = checkpoints

    @classmethod
    def start(cls, policy: HybridWorkers, version: int) -> VllmServers:
        """Start the servers in the policy's workers and give them its weights as `version`. Blocking
        (minutes: vLLM loads and captures its CUDA graphs): call it on a thread from async code."""
        from verl.checkpoint_engine import CheckpointEngineManager
        from verl.utils.config import omega_conf_to_dataclass
        from verl.workers.rollout.llm_server import LLMServerManager

        if policy.vllm is None:
            raise ValueError("the policy was built without vLLM servers (VerlTrainingEngine(vllm=...))")
        config = policy.config
        manager = LLMServerManager.create(config=config, worker_group=policy.actor)
        checkpoints = CheckpointEngineManager(
            config=omega_conf_to_dataclass(config.actor_rollout_ref.rollout.checkpoint_engine),
            actor_wg=policy.actor,
            replicas=manager.get_replicas(),
        )
        servers = cls(manager, checkpoints)
        checkpoints.sleep_replicas()
        checkpoints.update_weights(global_steps=version)
        return servers

    def urls(self) -> list[str]:
        return server_urls(self._manager.get_addresses())

    # verl's managers block on Ray inside their coroutines: run them on a thread of their own (its own
    # event loop), so that the caller's loop goes on renewing leases and reading the export.

    async def release(self) -> None:
        await asyncio.to_thread(self._checkpoints.sleep_replicas)

    async def publish(self, version: int) -> None:
        await asyncio.to_thread(self._checkpoints.update_weights, global_steps=version)
