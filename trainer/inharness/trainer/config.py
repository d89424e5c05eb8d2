"""The trainer's configuration in the spec's vocabulary, and the one translation from a spec to it.

A field of the trainer's configuration that a TrainingRun sets is named as the spec names it, in snake
case (``spec.algorithm.clipRatioHigh`` is `UpdateConfig.clip_ratio_high`), and has the spec's default.
The values a choice may take are the names registered in `inharness.trainer.algorithms`
(`ADVANTAGE_ESTIMATORS`, `ADVANTAGE_LEVELS`, `LOSS_NORMALIZATIONS`, `OFF_POLICY_CORRECTIONS`).
tests/trainer/test_config.py checks all four against operator/spec.py, so the vocabularies cannot
drift apart again.

A leaf: it imports no other trainer module but `algorithms`, so every module may import it. Building
the policy a spec names is `inharness.trainer.build`'s; `inharness run` (one machine) and `inharness
train` (the cluster's trainer pod) call `loop_config` and `build.load_policy`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from inharness.trainer.algorithms import (
    ADVANTAGE_ESTIMATORS,
    ADVANTAGE_LEVELS,
    LOSS_NORMALIZATIONS,
    OFF_POLICY_CORRECTIONS,
)

if TYPE_CHECKING:
    from inharness.operator.spec import TrainingRunSpec
    from inharness.operator.specfile import Specs

KL_ESTIMATOR = "k3"
"""The KL estimate that ``kl_coef`` weighs (a name in `KL_ESTIMATORS`); the spec has no field for it."""

_CHOICES = {
    "advantage_estimator": ADVANTAGE_ESTIMATORS,
    "advantage_level": ADVANTAGE_LEVELS,
    "loss_normalization": LOSS_NORMALIZATIONS,
    "off_policy_correction": OFF_POLICY_CORRECTIONS,
}


@dataclass(frozen=True)
class UpdateConfig:
    """How one engine update turns a batch of samples into optimizer steps. Every field but the last two
    is the TrainingRun's ``spec.algorithm`` field of the same name, with its default.

    ``advantage_estimator``, ``advantage_level``, ``normalize_by_std``: outcome advantages (see
    `algorithms.token_advantages`). ``loss_normalization``: how token losses are weighed against each
    other over the whole batch (see `algorithms.loss_weights`). ``clip_ratio_low`` /
    ``clip_ratio_high``: PPO ratio clip range. ``kl_coef``: weight of the `KL_ESTIMATOR` KL to the
    reference model (needs an engine built with a reference). ``grad_clip``: max global gradient norm,
    None for no clipping. ``ppo_mini_batches`` / ``ppo_epochs``: PPO's reuse of one batch: the rollouts
    are shuffled into ``ppo_mini_batches`` parts, one optimizer step each, and the whole pass repeats
    ``ppo_epochs`` times. With one of each the importance ratio is exactly 1 (fresh weights), so the
    clip never acts and the update is REINFORCE with a baseline; more steps per batch are what the clip
    is for. ``lr_warmup_steps``: the learning rate rises linearly over this many optimizer steps, from
    ``lr / lr_warmup_steps`` at the first to the engine's ``learning_rate``; 0: the full rate at once.
    AdamW's first steps move every weight by about the learning rate whatever its gradient's size (the
    second-moment estimate has seen a few gradients only), which can break a small policy's format in one
    update; the ramp lets that estimate fill before the steps get large. ``off_policy_correction``: what
    the PPO ratio is taken against (`algorithms.OFF_POLICY_CORRECTIONS`): ``bypass``, the gateway's
    behaviour log-probs; ``tis``, the trainer's log-probs at the update's start, each token's loss
    weighed by their ratio to the behaviour log-probs truncated at ``tis_cap`` (`algorithms.tis_weights`).
    ``context_gradient``: False runs each micro-batch's context before its first generated token without
    gradient (the torch engine only): the same loss and ratios, a gradient through the generated turns and
    what follows them only, so a harness's long prompt costs a forward pass instead of a forward and a
    backward.

    ``temperature``: ``spec.generation.temperature``, the *sampling* temperature, so that training
    logprobs are the behaviour logprobs' quantity (0, greedy, means temperature-1 logits, as in the
    inference engine). ``max_tokens_per_microbatch``: the engine's own, padded tokens per forward pass
    (gradient accumulation bounds memory, not the result); not in the spec.
    """

    advantage_estimator: str = "grpo"
    advantage_level: str = "rollout"
    loss_normalization: str = "rollout"
    normalize_by_std: bool = True
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.28
    kl_coef: float = 0.0
    grad_clip: float | None = 1.0
    ppo_mini_batches: int = 1
    ppo_epochs: int = 1
    lr_warmup_steps: int = 0
    off_policy_correction: str = "bypass"
    tis_cap: float = 2.0
    context_gradient: bool = True
    temperature: float = 1.0
    max_tokens_per_microbatch: int = 4096

    def __post_init__(self) -> None:
        for name, registry in _CHOICES.items():
            try:
                registry.get(getattr(self, name))
            except ValueError as exc:
                raise ValueError(f"{name}: {exc}") from None
        if self.clip_ratio_low < 0 or self.clip_ratio_high < 0:
            raise ValueError("clip_ratio_low and clip_ratio_high must be non-negative")
        if self.kl_coef < 0:
            raise ValueError("kl_coef must be non-negative")
        if self.temperature < 0:
            raise ValueError("temperature must be non-negative")
        if self.max_tokens_per_microbatch < 1:
            raise ValueError("max_tokens_per_microbatch must be at least 1")
        if self.grad_clip is not None and self.grad_clip <= 0:
            raise ValueError("grad_clip must be positive or None")
        if self.ppo_mini_batches < 1 or self.ppo_epochs < 1:
            raise ValueError("ppo_mini_batches and ppo_epochs must be at least 1")
        if self.lr_warmup_steps < 0:
            raise ValueError("lr_warmup_steps must be non-negative")
        if not self.tis_cap >= 1:
            raise ValueError(f"tis_cap must be at least 1, got {self.tis_cap}")


_NOT_ALGORITHM = ("temperature", "max_tokens_per_microbatch")
SPEC_ALGORITHM_FIELDS = tuple(
    f.name for f in dataclasses.fields(UpdateConfig) if f.name not in _NOT_ALGORITHM
)
"""The `UpdateConfig` fields that are ``spec.algorithm`` fields of the same name."""


@dataclass(frozen=True)
class LoopConfig:
    """What the training loop needs of the TrainingRun and its RolloutPool (see `loop_config`)."""

    run_name: str
    pool: str
    steps: int
    batch_size: int
    group_size: int
    max_attempts: int
    max_staleness: int
    checkpoint_interval: int
    checkpoint_keep: int
    seed: int
    max_tokens_per_sample: int | None
    update: UpdateConfig  # passed to the policy's update
    config_sha256: str | None = None  # of the run config, echoed in progress reports (cluster runs)
    scheduling_mode: str = "sync"  # spec.scheduling.mode, a name in `scheduler.SCHEDULING_MODES`


def update_config(spec: TrainingRunSpec) -> UpdateConfig:
    """The update configuration of a TrainingRun's spec: its algorithm's fields, copied by name."""
    algorithm = {name: getattr(spec.algorithm, name) for name in SPEC_ALGORITHM_FIELDS}
    return UpdateConfig(**algorithm, temperature=spec.generation.temperature)


def loop_config(specs: Specs, *, config_sha256: str | None = None) -> LoopConfig:
    """The training loop's configuration, from the spec documents (TrainingRun and RolloutPool)."""
    run, pool = specs.training_run, specs.rollout_pool
    spec = run.spec
    return LoopConfig(
        run_name=run.metadata.name,
        pool=pool.metadata.name,
        steps=spec.steps,
        batch_size=spec.batch_size,
        group_size=spec.algorithm.group_size,
        max_attempts=pool.spec.max_attempts_per_rollout,
        max_staleness=spec.scheduling.max_staleness,
        scheduling_mode=spec.scheduling.mode,
        checkpoint_interval=spec.checkpoint.interval,
        checkpoint_keep=spec.checkpoint.keep,
        seed=spec.seed,
        max_tokens_per_sample=spec.algorithm.max_tokens_per_sample,
        update=update_config(spec),
        config_sha256=config_sha256,
    )
