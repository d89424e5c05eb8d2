"""The spec's algorithms inside verl's workers, so that a spec means the same under both engines.

- `policy_loss`: the loss function the verl engine hands its workers (``set_loss_fn``) in place of
  verl's ``ppo_loss``. It is `algorithms.clipped_policy_loss` plus ``kl_coef`` times the
  `config.KL_ESTIMATOR` KL, both weighed by the ``loss_weights`` the driver computed for the whole
  mini-batch (`algorithms.loss_weights`: token, sample or rollout normalisation), exactly as the torch
  engine weighs them. verl's own aggregation modes cannot express rollout normalisation, and its
  ``ppo_loss`` reads no per-token weights, hence our function rather than a ``loss_agg_mode``. The
  ratio is to ``old_log_probs``, and a batch with ``rollout_is_weights`` (an off-policy correction's,
  `algorithms.tis_weights`) has every token's policy loss multiplied by them, as in the torch engine.
- `register_estimators`: the advantage estimators of `algorithms.ADVANTAGE_ESTIMATORS` in verl's
  ``register_adv_est`` under ``inharness_<name>``, so a verl trainer configured with them computes
  what ours does (the driver computes advantages itself and needs no lookup).

Both are module-level functions: Ray pickles them by reference, and every worker process imports this
module through the ``verl.plugins`` entry point.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from inharness.trainer.algorithms import (
    ADVANTAGE_ESTIMATORS,
    aggregate_loss,
    clipped_policy_loss,
    kl_penalty,
    rollout_advantages,
)
from inharness.trainer.config import KL_ESTIMATOR

METRICS = ("clip_frac", "clip_frac_low", "clip_frac_high", "approx_kl", "ratio_mean")
"""Token means of `clipped_policy_loss` reported per micro-batch (weighted by its generated tokens)."""


def policy_loss(
    model_output: dict[str, Any],
    data: TensorDict,
    dp_group: Any = None,
    *,
    clip_low: float,
    clip_high: float,
    kl_coef: float,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """One micro-batch's share of the mini-batch loss, ``sum(weights * token_loss)`` over its tokens,
    times the data-parallel size (FSDP averages gradients over ranks; the sum over the mini-batch is
    what the torch engine differentiates)."""
    from verl.utils.metric import AggregationType, Metric
    from verl.workers.utils.padding import no_padding_2_padding

    log_prob = no_padding_2_padding(model_output["log_probs"], data)
    fields = ["response_mask", "old_log_probs", "advantages", "loss_weights"]
    if kl_coef > 0:
        fields.append("ref_log_prob")
    if "rollout_is_weights" in data:
        fields.append("rollout_is_weights")
    dp_size = int(data["dp_size"])
    padded = data.select(*fields).to_padded_tensor()
    mask = padded["response_mask"].to(log_prob.dtype)
    old = padded["old_log_probs"] * mask
    weights = padded["loss_weights"]
    loss, pg_metrics = clipped_policy_loss(
        log_prob,
        old,
        padded["advantages"],
        mask,
        clip_low=clip_low,
        clip_high=clip_high,
        weights=weights,
        is_weights=padded["rollout_is_weights"] if "rollout_is_weights" in fields else None,
    )
    terms = {"pg_loss": loss.detach()}
    if kl_coef > 0:
        kl = aggregate_loss(kl_penalty(log_prob, padded["ref_log_prob"], KL_ESTIMATOR), mask, weights=weights)
        loss = loss + kl_coef * kl
        terms["kl"] = kl.detach()
    tokens = float(mask.sum())
    terms["tokens"] = tokens
    for key in METRICS:
        terms[f"{key}_sum"] = pg_metrics[key] * tokens
    # verl reduces a SUM metric as the mean over ranks of each rank's sum: scaled, it is the sum.
    metrics: dict[str, Any] = {
        key: Metric(value=value * dp_size, aggregation=AggregationType.SUM) for key, value in terms.items()
    }
    metrics["ratio_max"] = Metric(value=pg_metrics["ratio_max"], aggregation=AggregationType.MAX)
    return loss * dp_size, metrics


def _verl_estimator(name: str) -> Any:
    def estimate(
        token_level_rewards: torch.Tensor,
        response_mask: torch.Tensor,
        index: np.ndarray,
        config: Any = None,
        **_kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """verl's signature: token rewards and mask ``[B, R]``, group ids ``[B]`` -> (advantages,
        returns) ``[B, R]``, each response's advantage on its generated tokens."""
        rewards = token_level_rewards.sum(dim=-1)
        _, group = np.unique(np.asarray(index), return_inverse=True)
        norm = True if config is None else bool(getattr(config, "norm_adv_by_std_in_grpo", True))
        adv = rollout_advantages(rewards, torch.as_tensor(group), estimator=name, norm_by_std=norm)
        scores = adv.unsqueeze(-1) * response_mask
        return scores, scores

    estimate.__name__ = f"inharness_{name}"
    return estimate


def register_estimators() -> None:
    from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY, register_adv_est

    for name in ADVANTAGE_ESTIMATORS.names():
        key = f"inharness_{name}"
        if key not in ADV_ESTIMATOR_REGISTRY:
            register_adv_est(key)(_verl_estimator(name))
