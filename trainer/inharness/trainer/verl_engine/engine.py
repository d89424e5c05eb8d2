"""`VerlTrainingEngine`: the loop's `Policy` on verl's FSDP workers in a Ray cluster.

Our driver around verl's workers, not verl's dataset-driven ``RayPPOTrainer``: the loop already owns
what that trainer would (batches of gateway-recorded rollouts, versions, checkpoints of the run), so
the engine keeps verl for what it is good at, sharded training on many devices. Per update:

1. advantages over the whole batch and loss weights per mini-batch, by the spec's registered
   algorithms (`inharness.trainer.algorithms`), exactly as the torch engine computes them;
2. the samples as verl's padded batch (`data.to_batch`), unpadded by verl's ``left_right_2_no_padding``
   as its trainer does, with the off-policy correction's reference as ``old_log_probs``: the gateway's
   behaviour log-probs (``bypass``) or the actor's own log-probs at the update's start (``tis``, by
   ``compute_log_prob``, once per update), and with ``tis`` its token weights as
   ``rollout_is_weights`` (`algorithms.off_policy_correction`);
3. the reference model's log-probs (``kl_coef > 0``) from a second worker group, once per update;
4. one ``update_actor`` call per mini-batch of whole rollouts (`samples.split_by_rollout`), the
   loss being `losses.policy_loss`; micro-batches packed by token budget (verl's dynamic batch size).

Weights go out through verl's checkpoint engine. With inharness's inference engine, `checkpoint_files`
writes a model directory per version that the engine loads. With ``vllm`` (`servers.VllmConfig`) the
workers have the role ``actor_rollout``: each also holds a vLLM server on its GPU (verl's hybrid
engine), which `servers.VllmServers` starts, puts to sleep during updates and hands each version's
weights in place (the checkpoint engine ``naive``, CUDA IPC inside the worker).

On CPU (``gpus_per_node == 0``) the workers run on the `cpu_platform`: fp32, sdpa attention, no
remove-padding kernels, no torch.compile, gloo.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
from collections.abc import Callable
from functools import partial
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from inharness.trainer.algorithms import (
    Correction,
    loss_weights,
    off_policy_correction,
    split_by_rollout,
    token_advantages,
)
from inharness.trainer.config import UpdateConfig
from inharness.trainer.samples import RolloutIndex, Sample, index_rollouts
from inharness.trainer.verl_engine import checkpoint_files, cpu_platform, data, losses
from inharness.trainer.verl_engine.servers import VllmConfig, rollout_settings

log = logging.getLogger("inharness.trainer.verl")

_NO_CLIP = 1e30

CPU_ENV = {
    "VERL_PLATFORM": cpu_platform.NAME,
    # verl registers its FSDP engine for device "cuda"; on the CPU platform it is the same engine.
    "VERL_ENGINE_DEVICE": "cuda",
}


def _base_config() -> Any:
    from omegaconf import OmegaConf

    path = resources.files("verl.trainer.config").joinpath("_generated_ppo_trainer.yaml")
    return OmegaConf.create(OmegaConf.to_yaml(OmegaConf.load(str(path))))


def worker_config(
    model_dir: Path,
    *,
    learning_rate: float,
    dtype: str,
    seed: int,
    weights_root: Path,
    cpu: bool,
    update: UpdateConfig,
    weight_decay: float = 0.0,
    vllm: VllmConfig | None = None,
    nnodes: int = 1,
    gpus_per_node: int = 0,
) -> Any:
    """verl's configuration (the whole tree; the workers take its ``actor_rollout_ref``): the model,
    AdamW, gradient clipping and the learning-rate warm-up as the torch engine applies them, the token
    budget per micro-batch (``update.max_tokens_per_microbatch``), the checkpoint backend, and with
    `vllm` the vLLM servers that share the GPUs (`servers.rollout_settings`).

    The warm-up is verl's cosine schedule with no cycles, counted from 1: ``lr * min(1, (s + 1) / W)``
    at optimizer step ``s``, the torch engine's ramp (verl's constant schedule starts at 0 instead).
    Long because it is one flat list of settings, each beside the reason it has that value."""
    from omegaconf import OmegaConf, open_dict

    root = _base_config()
    cfg = root.actor_rollout_ref
    with open_dict(cfg):
        cfg.model.path = str(model_dir)
        cfg.model.use_remove_padding = not cpu
        cfg.model.enable_gradient_checkpointing = False
        cfg.model.override_config = {"attn_implementation": "sdpa"} if cpu else {}
        actor = cfg.actor
        actor.strategy = "fsdp2"
        actor.use_torch_compile = not cpu
        actor.fsdp_config.use_torch_compile = not cpu
        precision = "fp32" if dtype == "float32" else "bf16"
        actor.fsdp_config.dtype = "float32" if dtype == "float32" else "bfloat16"
        actor.fsdp_config.model_dtype = "fp32"  # weights and AdamW state, as in the torch engine
        # FSDP's compute dtype: verl's default is bf16 whatever `dtype` says.
        actor.fsdp_config.mixed_precision = {
            "param_dtype": precision,
            "reduce_dtype": "fp32",
            "buffer_dtype": "fp32",
        }
        actor.fsdp_config.seed = seed
        actor.optim.lr = learning_rate
        actor.optim.weight_decay = weight_decay
        actor.optim.lr_scheduler_type = "cosine"
        actor.optim.num_cycles = 0.0
        actor.optim.zero_indexed_step = False
        actor.optim.lr_warmup_steps = update.lr_warmup_steps
        actor.optim.lr_warmup_steps_ratio = 0.0
        actor.optim.total_training_steps = 2**31
        # No clipping is a clip no gradient reaches (verl always clips; the norm is still reported).
        actor.grad_clip = actor.optim.clip_grad = update.grad_clip or _NO_CLIP
        actor.use_dynamic_bsz = True
        actor.ppo_max_token_len_per_gpu = update.max_tokens_per_microbatch
        actor.use_kl_loss = False  # `losses.policy_loss` adds the KL term itself
        actor.entropy_coeff = 0.0
        cfg.rollout.log_prob_use_dynamic_bsz = True
        cfg.rollout.log_prob_max_token_len_per_gpu = update.max_tokens_per_microbatch
        if vllm is None:
            cfg.rollout.checkpoint_engine.backend = checkpoint_files.BACKEND
            cfg.rollout.checkpoint_engine.engine_kwargs = {
                checkpoint_files.BACKEND: {"root": str(weights_root), "model_dir": str(model_dir)}
            }
        else:
            cfg.rollout.update(
                rollout_settings(vllm, dtype=dtype, seed=seed, nnodes=nnodes, gpus_per_node=gpus_per_node)
            )
            cfg.rollout.checkpoint_engine.backend = "naive"
        ref = cfg.ref
        ref.strategy = "fsdp2"
        # verl builds a forward-only model in bf16 and offloads it to pinned memory, which needs an
        # accelerator: on CPU the reference is an fp32 model like the actor (its optimizer stays unused).
        ref.fsdp_config.forward_only = not cpu
        if cpu:
            ref.optim = OmegaConf.to_container(actor.optim)
        ref.use_torch_compile = not cpu
        ref.fsdp_config.use_torch_compile = not cpu
        ref.fsdp_config.dtype = actor.fsdp_config.dtype
        ref.fsdp_config.model_dtype = "fp32"
        ref.fsdp_config.mixed_precision = actor.fsdp_config.mixed_precision
        ref.log_prob_use_dynamic_bsz = True
        ref.log_prob_max_token_len_per_gpu = update.max_tokens_per_microbatch
    return root


class VerlTrainingEngine:
    """``nnodes * max(gpus_per_node, 1)`` workers (``cpu_workers`` per node on CPU). Ray is started
    here unless the process is already connected to a cluster (`inharness train` on a trainer
    StatefulSet connects first, see `inharness.trainer.raycluster`)."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        learning_rate: float,
        weights_root: str | Path,
        update: UpdateConfig,
        dtype: str = "float32",
        seed: int = 0,
        kl_reference: bool = False,
        nnodes: int = 1,
        gpus_per_node: int = 0,
        cpu_workers: int = 2,
        vllm: VllmConfig | None = None,
    ) -> None:
        if vllm is not None and gpus_per_node == 0:
            raise ValueError("vLLM servers need GPUs: gpus_per_node is 0")
        self.model_dir = Path(model_dir)
        self.learning_rate = learning_rate
        self.weights_root = Path(weights_root)
        self.cpu = gpus_per_node == 0
        self.step = 0  # optimizer steps taken, as the torch engine counts them
        self.world_size = nnodes * (cpu_workers if self.cpu else gpus_per_node)
        self._ray()
        self.config = worker_config(
            self.model_dir,
            learning_rate=learning_rate,
            dtype=dtype,
            seed=seed,
            weights_root=self.weights_root,
            cpu=self.cpu,
            update=update,
            vllm=vllm,
            nnodes=nnodes,
            gpus_per_node=gpus_per_node,
        )
        self.update_config = update
        self.vllm = vllm
        cfg = self.config.actor_rollout_ref
        pool = self._pool(nnodes, groups=2 if kl_reference else 1)
        self.actor = self._group(cfg, "actor" if vllm is None else "actor_rollout", pool)
        self.ref = self._group(cfg, "ref", pool) if kl_reference else None

    # -- set-up -------------------------------------------------------------------------------

    def _ray(self) -> None:
        import ray

        if self.cpu:
            os.environ.update(CPU_ENV)  # the driver resolves verl's platform too (placement groups)
        if not ray.is_initialized():
            # verl's bundles ask for CPUs per worker: enough logical CPUs for two groups of workers.
            ray.init(
                # a Ray of its own: without an address, ray.init joins whatever cluster this machine
                # started last (another run's, a test's), which refuses num_cpus
                address="local",
                num_cpus=max(4 * self.world_size, os.cpu_count() or 1),
                include_dashboard=False,
                log_to_driver=False,  # worker errors still reach the driver, as exceptions
            )

    def _worker_env(self) -> dict[str, str]:
        """Set per worker (not per `ray.init`), so that it holds on a cluster `inharness train` joined."""
        env = {"TOKENIZERS_PARALLELISM": "false"}
        if self.cpu:
            env.update(CPU_ENV)
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // self.world_size))
        return env

    def _pool(self, nnodes: int, *, groups: int) -> Any:
        """One placement group per node for every worker group: the actor's and the reference's workers
        share each GPU (each takes ``1 / groups`` of it, as in verl's colocated pools)."""
        from verl.single_controller.ray import RayResourcePool

        per_node = self.world_size // nnodes
        return RayResourcePool(
            process_on_nodes=[per_node] * nnodes, use_gpu=not self.cpu, max_colocate_count=groups
        )

    def _group(self, cfg: Any, role: str, pool: Any) -> Any:
        import ray
        from verl.single_controller.ray import RayClassWithInitArgs, RayWorkerGroup
        from verl.workers.engine_workers import ActorRolloutRefWorker

        cls = RayClassWithInitArgs(cls=ray.remote(ActorRolloutRefWorker), config=cfg, role=role)
        cls.update_options({"runtime_env": {"env_vars": self._worker_env()}})
        group = RayWorkerGroup(
            resource_pool=pool, ray_cls_with_init=cls, device_name="cpu" if self.cpu else "cuda"
        )
        group.init_model()
        return group

    # -- training -----------------------------------------------------------------------------

    def update(self, samples: list[Sample], config: UpdateConfig) -> dict[str, float]:
        """``ppo_epochs * ppo_mini_batches`` optimizer steps on the batch, as `TorchTrainingEngine.update`
        takes them (same advantages, weights, mini-batches of whole rollouts, shuffle); returns the
        metrics both engines report (``loss``, ``pg_loss``, ``grad_norm``, the clip and ratio token
        means, ``kl`` with a reference, the off-policy correction's, counts).

        Long because the mini-batch loop shares the update's whole-batch tensors and metric sums, as in
        the torch engine's `update`."""
        if not samples:
            raise ValueError("update needs at least one sample")
        built = self.update_config
        for name in ("grad_clip", "lr_warmup_steps", "max_tokens_per_microbatch"):
            if getattr(config, name) != getattr(built, name):
                raise ValueError(f"{name} is fixed when the verl workers start ({getattr(built, name)})")
        if config.kl_coef > 0 and self.ref is None:
            raise ValueError("kl_coef > 0 needs an engine built with kl_reference=True")
        if not config.context_gradient:
            raise ValueError(
                "context_gradient=False is the torch engine's; verl's actor takes the full backward"
            )
        index, mask, advantages = _outcome_advantages(samples, config)
        sample_rollout = torch.tensor(index.sample_rollout, dtype=torch.long)
        active = [i for i in range(len(samples)) if mask[i].any()]
        learn = config.kl_coef > 0 or bool(advantages.abs().max() > 0)
        self.actor.set_loss_fn(
            partial(
                losses.policy_loss,
                clip_low=config.clip_ratio_low,
                clip_high=config.clip_ratio_high,
                kl_coef=config.kl_coef,
            )
        )
        shuffle = torch.Generator().manual_seed(self.step)
        passes = (
            [
                split_by_rollout(active, index.sample_rollout, config.ppo_mini_batches, shuffle)
                for _ in range(config.ppo_epochs)
            ]
            if learn
            else []
        )
        correction = self._correction(samples, config)
        reference = None
        if learn and self.ref is not None:
            reference = self._log_probs(self.ref.compute_ref_log_prob, samples, config)
        # response-space [B, R] tensors of the whole update, each mini-batch takes its rows
        whole = {
            "old_log_probs": correction.old_logprobs,
            "rollout_is_weights": correction.is_weights,
            "ref_log_prob": reference,
        }
        sums: dict[str, float] = {}
        ratio_max, steps = 0.0, 0
        for mini_batches in passes:
            for rows in mini_batches:
                part = [samples[i] for i in rows]
                weights = loss_weights(mask[rows], config.loss_normalization, sample_rollout[rows])
                per_token = {
                    "advantages": data.response_space(advantages[rows], part),
                    "loss_weights": data.response_space(weights, part),
                    **{name: t[rows] for name, t in whole.items() if t is not None},
                }
                out = self._mini_batch(part, per_token, config)
                for key, value in out.items():
                    if key == "ratio_max":
                        ratio_max = max(ratio_max, value)
                    else:
                        sums[key] = sums.get(key, 0.0) + value
                steps += 1
                self.step += 1
        metrics = {
            **_mean_metrics(sums, steps, ratio_max, kl=self.ref is not None),
            "optimizer_steps": float(steps),
            "samples": float(len(samples)),
            "tokens": float(mask.sum()),
            "lr": self.lr_at(self.step - 1, config) if steps else 0.0,
            **correction.metrics,
        }
        metrics["loss"] = metrics["pg_loss"] + config.kl_coef * metrics.get("kl", 0.0)
        return metrics

    def lr_at(self, step: int, config: UpdateConfig) -> float:
        """The torch engine's warm-up: linear from ``lr / lr_warmup_steps`` to ``lr``."""
        if config.lr_warmup_steps == 0:
            return self.learning_rate
        return self.learning_rate * min(1.0, (step + 1) / config.lr_warmup_steps)

    def _correction(self, samples: list[Sample], config: UpdateConfig) -> Correction:
        """The spec's off-policy correction of the whole batch, in response space ``[B, R]``, once per
        update: ``tis`` runs the actor forward (``compute_log_prob``) before any optimizer step."""
        batch = data.to_batch(samples)
        mask = batch["response_mask"]

        def actor_log_probs() -> torch.Tensor:
            return self._log_probs(self.actor.compute_log_prob, samples, config) * mask

        return off_policy_correction(
            batch["old_log_probs"] * mask,
            actor_log_probs,
            mask,
            config.off_policy_correction,
            tis_cap=config.tis_cap,
        )

    def _log_probs(
        self, compute: Callable[[Any], Any], samples: list[Sample], config: UpdateConfig
    ) -> torch.Tensor:
        """Response log-probs ``[B, R]`` of the whole batch by a worker group's forward-only ``compute``
        (the reference group's ``compute_ref_log_prob``, the actor's ``compute_log_prob``), once per
        update (every mini-batch and epoch takes its rows from them)."""
        from verl.utils import tensordict_utils as tu
        from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

        pad = (-len(samples)) % self.world_size
        batch = data.to_batch(samples + [_no_loss(samples[0])] * pad)
        unpadded = left_right_2_no_padding(batch.clone())
        tu.assign_non_tensor(
            unpadded, temperature=config.temperature or 1.0, calculate_entropy=False, compute_loss=False
        )
        out = compute(unpadded)
        # log-probs of every token of each sequence, unpadded: verl cuts out the responses'
        return no_padding_2_padding(tu.get(out, "log_probs"), batch)[: len(samples)]

    def _mini_batch(
        self, rows: list[Sample], per_token: dict[str, torch.Tensor], config: UpdateConfig
    ) -> dict[str, float]:
        """One optimizer step on ``rows`` with their response-space tensors ``[len(rows), >= R]`` by
        name (`data.to_batch`'s and ``ref_log_prob``); padded with zero-weight copies of the first row
        to a multiple of the data-parallel size (verl splits a batch evenly over its ranks; such a row
        adds nothing)."""
        from verl.utils import tensordict_utils as tu
        from verl.workers.utils.padding import left_right_2_no_padding

        pad = (-len(rows)) % self.world_size
        rows = rows + [_no_loss(rows[0])] * pad
        width = max(max(data.response_length(s) for s in rows), 1)
        fitted = {name: _fit(t, len(rows), width) for name, t in per_token.items()}
        reference = fitted.pop("ref_log_prob", None)
        batch = data.to_batch(rows, **fitted)
        if reference is not None:
            batch["ref_log_prob"] = reference
        temperature = config.temperature or 1.0
        batch = left_right_2_no_padding(batch)
        tu.assign_non_tensor(
            batch,
            temperature=temperature,
            calculate_entropy=False,
            global_batch_size=len(rows),
            mini_batch_size=len(rows),
            epochs=1,
            seed=self.step,
            dataloader_kwargs={"shuffle": False},
            compute_loss=True,
        )
        out = tu.get(self.actor.update_actor(batch), "metrics")
        return _flat_metrics(out)

    # -- weights and checkpoints ----------------------------------------------------------------

    def save_pretrained(self, out_dir: str | Path) -> Path:
        """The current weights as a model directory under the weights root (``<root>/v<N>``), written by
        the workers' checkpoint engine (`checkpoint_files`)."""
        import ray

        out = Path(out_dir)
        if self.vllm is not None:
            raise RuntimeError(
                "the vLLM servers take each version's weights in place (VllmServers.publish); "
                "the trained model is in the run's checkpoints"
            )
        if out.parent != self.weights_root or not out.name.startswith("v") or not out.name[1:].isdigit():
            raise ValueError(f"weights go to {self.weights_root}/v<version>, not {out}")
        ray.get(self.actor.update_weights(global_steps=int(out.name[1:])))
        return out

    def save_checkpoint(self, ckpt_dir: str | Path) -> Path:
        """verl's sharded checkpoint of the actor (model, optimizer, RNG) plus our step counter."""
        out = Path(ckpt_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.actor.save_checkpoint(str(out / "actor"), global_step=self.step)
        (out / "step").write_text(str(self.step))
        return out

    def load_checkpoint(self, ckpt_dir: str | Path) -> None:
        src = Path(ckpt_dir)
        self.actor.load_checkpoint(str(src / "actor"))
        self.step = int((src / "step").read_text())

    def close(self) -> None:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        shutil.rmtree(self.weights_root / ".tmp", ignore_errors=True)


def _outcome_advantages(
    samples: list[Sample], config: UpdateConfig
) -> tuple[RolloutIndex, torch.Tensor, torch.Tensor]:
    """(rollout index, loss mask ``[B, T]`` over input positions, advantages ``[B, T]``) of the batch,
    by the spec's registered estimator and level, as the torch engine computes them."""
    index = index_rollouts(samples)
    width = max(len(s.input_ids) for s in samples)
    mask = torch.zeros((len(samples), width), dtype=torch.float32)
    for i, s in enumerate(samples):
        mask[i, 1 : len(s.loss_mask)] = torch.tensor(s.loss_mask[1:], dtype=torch.float32)
    if not mask.any():
        raise ValueError("the batch has no generated tokens to train on")
    advantages = token_advantages(
        torch.tensor(index.rewards, dtype=torch.float32),
        torch.tensor(index.group_index, dtype=torch.long),
        torch.tensor(index.sample_rollout, dtype=torch.long),
        mask,
        level=config.advantage_level,
        estimator=config.advantage_estimator,
        norm_by_std=config.normalize_by_std,
    )
    return index, mask, advantages


def _mean_metrics(sums: dict[str, float], steps: int, ratio_max: float, *, kl: bool) -> dict[str, float]:
    """Per optimizer step means of the loss terms, token means of `losses.METRICS` (summed by the
    workers, see `losses.policy_loss`)."""
    n, tokens = max(steps, 1), sums.get("tokens", 0.0)
    out = {
        "pg_loss": sums.get("pg_loss", 0.0) / n,
        "grad_norm": sums.get("grad_norm", 0.0) / n,
        "ratio_max": ratio_max,
    }
    for key in losses.METRICS:
        out[key] = sums.get(f"{key}_sum", 0.0) / tokens if tokens else 0.0
    if kl:
        out["kl"] = sums.get("kl", 0.0) / n
    return out


def _no_loss(sample: Sample) -> Sample:
    """A copy of ``sample`` that trains nothing: it pads a batch to a multiple of the ranks."""
    return dataclasses.replace(sample, loss_mask=[0] * len(sample.loss_mask))


def _fit(t: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """``t`` ``[n, >= width]`` (``n <= rows``) as ``[rows, width]`` float32: its first ``width`` columns
    (responses are right-padded), zero rows for the padding rows after it."""
    out = torch.zeros((rows, width), dtype=torch.float32)
    out[: t.shape[0]] = t[:, :width]
    return out


def _flat_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """verl's per-micro-batch metric lists -> one number each (sums; ``ratio_max`` the max)."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        values = value if isinstance(value, list) else [value]
        numbers = [float(v.value if hasattr(v, "value") else v) for v in values]
        name = key.removeprefix("actor/")
        out[name] = max(numbers) if name == "ratio_max" else sum(numbers)
    return out
