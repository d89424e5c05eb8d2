"""A spec becomes a trainer: the policy engine ``spec.trainer.engine`` names (torch, or verl's workers,
with their vLLM servers when ``spec.trainer.inference`` is vllm), its loop state, and the weights to
serve first.

Kept apart from `config` so that the configuration stays a leaf every trainer module imports, while
this module imports the engines; only `app/` (`inharness run`, `inharness train`) calls it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from inharness.trainer.config import update_config
from inharness.trainer.loop import LoopState

if TYPE_CHECKING:
    from inharness.operator.spec import TrainingRunSpec
    from inharness.operator.specfile import Specs
    from inharness.trainer.loop import Policy, RunDir


def load_policy(specs: Specs, rd: RunDir, *, resume: bool) -> tuple[Policy, LoopState, Path]:
    """The policy (``spec.trainer.engine``: torch, or verl's workers), the loop state and the weights to
    serve first: from the spec's model, or from the run directory's last checkpoint when resuming."""
    spec = specs.training_run.spec
    model_path = specs.resolve(spec.model.path)
    torch.manual_seed(spec.seed)
    policy = _engine(spec, model_path, rd)
    ckpt = rd.latest_checkpoint()
    if not resume or ckpt is None:
        return policy, LoopState(), model_path
    policy.load_checkpoint(ckpt / "policy")
    state = LoopState.from_json(json.loads((ckpt / "state.json").read_text()))
    # vLLM servers take the restored weights from the workers (VllmServers.start), not from a directory
    vllm = spec.trainer.engine == "verl" and spec.trainer.inference == "vllm"
    serve_path = model_path if vllm else policy.save_pretrained(rd.weights / f"v{state.version}")
    print(f"resuming {specs.training_run.metadata.name} at step {state.step} (model version {state.version})")
    return policy, state, serve_path


def _engine(spec: TrainingRunSpec, model_path: Path, rd: RunDir) -> Policy:
    if spec.trainer.engine == "verl":
        from inharness.trainer.verl_engine.engine import VerlTrainingEngine
        from inharness.trainer.verl_engine.servers import VllmConfig

        gpus = spec.trainer.gpus
        vllm = None
        if spec.trainer.inference == "vllm":
            if not torch.cuda.is_available():
                raise ValueError(
                    "spec.trainer.inference is vllm, but this machine has no GPU that torch can use: "
                    "vLLM runs on CUDA GPUs only (set inference: engine to train here)"
                )
            vllm = VllmConfig(**spec.trainer.vllm.model_dump())
        elif gpus and not torch.cuda.is_available():
            # Ray would wait for GPUs that never come: train on the CPU cores instead, and say so.
            print(f"spec.trainer.gpus is {gpus} but this machine has no GPU: verl trains on the CPU")
            gpus = 0

        return VerlTrainingEngine(
            model_path,
            learning_rate=spec.algorithm.learning_rate,
            weights_root=rd.weights,
            update=update_config(spec),
            dtype=spec.model.dtype,
            seed=spec.seed,
            kl_reference=spec.algorithm.kl_coef > 0,
            nnodes=spec.trainer.nodes,
            gpus_per_node=gpus,
            vllm=vllm,
        )
    from inharness.trainer.torch_engine import TorchTrainingEngine

    return TorchTrainingEngine(
        model_path,
        learning_rate=spec.algorithm.learning_rate,
        dtype=spec.model.dtype,
        seed=spec.seed,
        kl_reference=spec.algorithm.kl_coef > 0,
    )
