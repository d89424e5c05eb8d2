"""RL objective pieces as plain tensor functions: outcome advantages, clipped policy loss, loss
aggregation, KL penalty, entropy.

Shapes: ``R`` rollouts, ``B`` samples (padded rows), ``T`` positions, ``V`` vocabulary. Every ``[B, T]``
input of one call shares one alignment (for samples from `inharness.trainer.samples`: position ``i`` is
token ``input_ids[i]``), and ``mask`` is 1 on generated tokens, 0 on prompt, tool and padding positions.
A sample comes from one rollout; a rollout may give several samples (see the adapter's split reasons),
which is why advantages and loss aggregation can be taken per rollout rather than per sample.

Choices are made by name from registries, in verl's manner (``register_adv_est``): the
TrainingRun's ``advantageEstimator``, ``advantageLevel``, ``lossNormalization`` and
``offPolicyCorrection`` name an entry of `ADVANTAGE_ESTIMATORS`, `ADVANTAGE_LEVELS`,
`LOSS_NORMALIZATIONS` and `OFF_POLICY_CORRECTIONS`, and `KL_ESTIMATORS` holds the KL estimates. A
new algorithm is one function registered beside the others; the registries' names are the trainer's
list of allowed values, checked against the spec's by tests/trainer/test_config.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Generic, NamedTuple, Protocol, TypeVar

import torch
from torch import Tensor

_MAX_LOG_RATIO = 20.0  # exp(20) ~ 5e8: keeps ratios finite when policies drift far apart

F = TypeVar("F", bound=Callable[..., Any])


class Registry(Generic[F]):
    """The functions of one kind, by the name a spec chooses them with.

    ``register(name)`` is a decorator (one function may take several names); ``get(name)`` returns the
    function or raises a ValueError that names the known ones; ``names()`` lists them in registration
    order."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._fns: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        def add(fn: F) -> F:
            if name in self._fns:
                raise ValueError(f"{self.kind} {name!r} is already registered ({self._fns[name].__name__})")
            self._fns[name] = fn
            return fn

        return add

    def get(self, name: str) -> F:
        try:
            return self._fns[name]
        except KeyError:
            raise ValueError(f"unknown {self.kind} {name!r}; known: {', '.join(self._fns)}") from None

    def names(self) -> tuple[str, ...]:
        return tuple(self._fns)

    def __contains__(self, name: object) -> bool:
        return name in self._fns


class AdvantageEstimatorFn(Protocol):
    """rewards ``[N]`` float and group ``[N]`` long in ``0..K-1`` (dense) -> advantages ``[N]``. A unit
    alone in its group gets 0 from the caller (`rollout_advantages`), whatever this returns for it."""

    def __call__(self, rewards: Tensor, group: Tensor, *, norm_by_std: bool, eps: float) -> Tensor: ...


class AdvantageLevelFn(Protocol):
    """rollout rewards ``[R]``, rollout group ids ``[R]``, each sample's rollout ``[B]`` (in ``0..R-1``) and
    ``estimate`` (rewards ``[N]``, group ids ``[N]`` -> advantages ``[N]``: `rollout_advantages` with the
    chosen estimator) -> one advantage per sample ``[B]``."""

    def __call__(
        self,
        rollout_rewards: Tensor,
        rollout_group_index: Tensor,
        sample_rollout_index: Tensor,
        estimate: Callable[[Tensor, Tensor], Tensor],
    ) -> Tensor: ...


class LossNormalizationFn(Protocol):
    """mask ``[B, T]`` float32 and rollout ids ``[B]`` (or None) -> token weights ``[B, T]`` (see
    `loss_weights`)."""

    def __call__(self, mask: Tensor, rollout_index: Tensor | None) -> Tensor: ...


class KLEstimatorFn(Protocol):
    """logprobs and ref_logprobs ``[B, T]`` -> per-token KL estimate ``[B, T]`` (see `kl_penalty`)."""

    def __call__(self, logprobs: Tensor, ref_logprobs: Tensor, *, max_value: float | None) -> Tensor: ...


class Correction(NamedTuple):
    """What an off-policy correction makes of a batch (see `OffPolicyCorrectionFn`)."""

    old_logprobs: Tensor
    """``[B, T]``: the log-probs the PPO ratio is taken against (`clipped_policy_loss`'s
    ``behaviour_logprobs``)."""
    is_weights: Tensor | None
    """``[B, T]`` detached, 0 off the mask: multiply each token's policy loss; None: no weights."""
    metrics: dict[str, float]
    """Token means over the batch's generated tokens."""


class OffPolicyCorrectionFn(Protocol):
    """behaviour_logprobs ``[B, T]`` (μ, recorded by the gateway from the engine that sampled; 0 off the
    mask), ``policy_logprobs`` (called at most once: the trainer's log-probs ``[B, T]`` of the weights at
    the update's start, π_θold, 0 off the mask; a correction that does not need them does not pay for
    the forward pass), mask ``[B, T]`` -> `Correction`."""

    def __call__(
        self,
        behaviour_logprobs: Tensor,
        policy_logprobs: Callable[[], Tensor],
        mask: Tensor,
        *,
        tis_cap: float,
    ) -> Correction: ...


ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimatorFn] = Registry("advantage estimator")
ADVANTAGE_LEVELS: Registry[AdvantageLevelFn] = Registry("advantage level")
LOSS_NORMALIZATIONS: Registry[LossNormalizationFn] = Registry("loss normalization")
KL_ESTIMATORS: Registry[KLEstimatorFn] = Registry("KL estimator")
OFF_POLICY_CORRECTIONS: Registry[OffPolicyCorrectionFn] = Registry("off-policy correction")

register_advantage_estimator = ADVANTAGE_ESTIMATORS.register
register_advantage_level = ADVANTAGE_LEVELS.register
register_loss_normalization = LOSS_NORMALIZATIONS.register
register_kl_estimator = KL_ESTIMATORS.register
register_off_policy_correction = OFF_POLICY_CORRECTIONS.register


def _check_1d(name: str, t: Tensor, n: int | None = None) -> None:
    if t.dim() != 1 or (n is not None and t.shape[0] != n):
        want = "[N]" if n is None else f"[{n}]"
        raise ValueError(f"{name} must have shape {want}, got {list(t.shape)}")


def _dense(index: Tensor) -> tuple[Tensor, int]:
    """Map arbitrary integer ids to 0..K-1 (so callers may pass global ids); returns (inverse, K)."""
    uniq, inverse = torch.unique(index, return_inverse=True)
    return inverse, uniq.numel()


def _group_sum(x: Tensor, group: Tensor) -> Tensor:
    """``[N]``: each unit gets the sum of ``x`` ``[N]`` over its group (``group`` ``[N]``, dense ids)."""
    n_groups = int(group.max()) + 1 if group.numel() else 0
    return torch.zeros(n_groups, dtype=x.dtype, device=x.device).index_add_(0, group, x)[group]


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``x`` over positions where ``mask`` is nonzero; 0 when there are none."""
    m = mask.to(x.dtype)
    return (x * m).sum() / m.sum().clamp(min=1)


# --- advantages --------------------------------------------------------------------------------------


@register_advantage_estimator("grpo")
def grpo_advantages(rewards: Tensor, group: Tensor, *, norm_by_std: bool = True, eps: float = 1e-6) -> Tensor:
    """``(r - mean_g) / (std_g + eps)`` with the unbiased (n - 1) std, as GRPO/verl/TRL;
    ``norm_by_std=False`` gives ``r - mean_g`` (Dr. GRPO: no per-group difficulty reweighting).
    rewards, group: ``[N]`` (dense group ids); returns ``[N]``."""
    count = _group_sum(torch.ones_like(rewards), group)
    dev = rewards - _group_sum(rewards, group) / count
    if not norm_by_std:
        return dev
    std = (_group_sum(dev.square(), group) / (count - 1).clamp(min=1)).sqrt()
    return dev / (std + eps)


@register_advantage_estimator("rloo")
def rloo_advantages(rewards: Tensor, group: Tensor, *, norm_by_std: bool = True, eps: float = 1e-6) -> Tensor:
    """``r_i - mean of the other rewards of the group`` (= ``n/(n-1) * (r_i - mean_g)``); takes no std, so
    ``norm_by_std`` and ``eps`` are unused. rewards, group: ``[N]`` (dense group ids); returns ``[N]``."""
    count = _group_sum(torch.ones_like(rewards), group)
    return rewards - (_group_sum(rewards, group) - rewards) / (count - 1).clamp(min=1)


@torch.no_grad()
def rollout_advantages(
    rewards: Tensor,
    group_index: Tensor,
    estimator: str = "grpo",
    *,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> Tensor:
    """One advantage per unit from outcome rewards, normalised within groups by the registered
    ``estimator`` (`grpo_advantages`, `rloo_advantages`).

    rewards: ``[N]`` float, one per unit (a rollout; for sample level see `sample_advantages`).
    group_index: ``[N]`` long, units sharing a value form a group (same task); any integers.
    Returns ``[N]`` in the rewards' float dtype (float32 for integer rewards).

    A group with a single unit has no baseline to compare against, so its advantage is 0 (it gives no
    learning signal rather than a raw-reward one).
    """
    estimate = ADVANTAGE_ESTIMATORS.get(estimator)
    n_units = rewards.shape[0]
    _check_1d("rewards", rewards)
    _check_1d("group_index", group_index, n_units)
    dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    r = rewards.to(dtype)
    if n_units == 0:
        return r
    group, _ = _dense(group_index.to(r.device))
    adv = estimate(r, group, norm_by_std=norm_by_std, eps=eps)
    alone = _group_sum(torch.ones_like(r), group) == 1
    return torch.where(alone, torch.zeros_like(adv), adv)


@register_advantage_level("rollout")
def rollout_level(
    rollout_rewards: Tensor,
    rollout_group_index: Tensor,
    sample_rollout_index: Tensor,
    estimate: Callable[[Tensor, Tensor], Tensor],
) -> Tensor:
    """One advantage per rollout (``estimate`` over ``[R]``), taken by each of its samples: ``[B]``."""
    return estimate(rollout_rewards, rollout_group_index)[sample_rollout_index]


@register_advantage_level("sample")
def sample_level(
    rollout_rewards: Tensor,
    rollout_group_index: Tensor,
    sample_rollout_index: Tensor,
    estimate: Callable[[Tensor, Tensor], Tensor],
) -> Tensor:
    """Every sample is its own unit with its rollout's reward, normalised over the samples of its group
    (a rollout split into 3 samples counts 3 times in its group's mean): ``[B]``."""
    return estimate(rollout_rewards[sample_rollout_index], rollout_group_index[sample_rollout_index])


def sample_advantages(
    rollout_rewards: Tensor,
    rollout_group_index: Tensor,
    sample_rollout_index: Tensor,
    estimator: str = "grpo",
    *,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> Tensor:
    """Sample-level advantages (`sample_level`) by the registered ``estimator``.

    rollout_rewards, rollout_group_index: ``[R]``; sample_rollout_index: ``[B]`` long in ``0..R-1``.
    Returns ``[B]``.
    """
    _check_1d("rollout_group_index", rollout_group_index, rollout_rewards.shape[0])
    _check_1d("sample_rollout_index", sample_rollout_index)
    estimate = partial(rollout_advantages, estimator=estimator, norm_by_std=norm_by_std, eps=eps)
    return sample_level(rollout_rewards, rollout_group_index, sample_rollout_index, estimate)


def token_advantages(
    rollout_rewards: Tensor,
    rollout_group_index: Tensor,
    sample_rollout_index: Tensor,
    mask: Tensor,
    *,
    level: str = "rollout",
    estimator: str = "grpo",
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> Tensor:
    """Per-token advantages ``[B, T]`` for a padded batch: each sample's advantage on its generated
    tokens, 0 elsewhere. ``level`` names the registered per-sample function (`rollout_level`,
    `sample_level`), ``estimator`` the registered estimator it uses. mask: ``[B, T]``.
    """
    per_level = ADVANTAGE_LEVELS.get(level)
    _check_1d("rollout_group_index", rollout_group_index, rollout_rewards.shape[0])
    _check_1d("sample_rollout_index", sample_rollout_index, mask.shape[0])
    estimate = partial(rollout_advantages, estimator=estimator, norm_by_std=norm_by_std, eps=eps)
    per_sample = per_level(rollout_rewards, rollout_group_index, sample_rollout_index, estimate)
    return per_sample[:, None] * mask.to(per_sample.dtype)


# --- loss normalisation ------------------------------------------------------------------------------


@register_loss_normalization("token")
def token_weights(mask: Tensor, rollout_index: Tensor | None = None) -> Tensor:
    """Every generated token of the batch weighs the same; long samples dominate. mask ``[B, T]``
    float32 -> ``[B, T]``; ``rollout_index`` is unused."""
    return mask / mask.sum(dim=1).sum().clamp(min=1)


@register_loss_normalization("sample")
def sample_weights(mask: Tensor, rollout_index: Tensor | None = None) -> Tensor:
    """Mean over samples (with at least one generated token) of each sample's token mean. mask ``[B, T]``
    float32 -> ``[B, T]``; ``rollout_index`` is unused."""
    per_row = mask.sum(dim=1)
    active = (per_row > 0).sum().clamp(min=1)
    return mask / per_row.clamp(min=1)[:, None] / active


@register_loss_normalization("rollout")
def rollout_weights(mask: Tensor, rollout_index: Tensor | None = None) -> Tensor:
    """Mean over rollouts of the mean over all generated tokens of that rollout's samples, so each
    rollout weighs the same however many samples and tokens it was split into. mask ``[B, T]`` float32,
    rollout_index ``[B]`` (any integers; equal values = same rollout; required) -> ``[B, T]``."""
    if rollout_index is None:
        raise ValueError("rollout aggregation needs rollout_index")
    _check_1d("rollout_index", rollout_index, mask.shape[0])
    per_row = mask.sum(dim=1)
    inverse, n_rollouts = _dense(rollout_index.to(mask.device))
    per_rollout = torch.zeros(n_rollouts, dtype=mask.dtype, device=mask.device)
    per_rollout.index_add_(0, inverse, per_row)
    active = (per_rollout > 0).sum().clamp(min=1)
    return mask / per_rollout[inverse].clamp(min=1)[:, None] / active


def loss_weights(mask: Tensor, mode: str = "token", rollout_index: Tensor | None = None) -> Tensor:
    """Per-token weights ``[B, T]`` (float32, 0 off the mask, summing to 1 when any token is on it) such
    that the aggregated loss is ``(loss_mat * weights).sum()``; ``mode`` names the registered
    normalisation (`token_weights`, `sample_weights`, `rollout_weights`, which needs ``rollout_index``).

    Computing the weights once on a whole mini-batch and slicing their rows per micro-batch makes the
    sum of micro-batch losses equal the mini-batch aggregate, which per-micro-batch means would not.
    """
    weigh = LOSS_NORMALIZATIONS.get(mode)
    if mask.dim() != 2:
        raise ValueError(f"mask must have shape [B, T], got {list(mask.shape)}")
    return weigh(mask.to(torch.float32), rollout_index)


def aggregate_loss(
    loss_mat: Tensor,
    mask: Tensor,
    mode: str = "token",
    rollout_index: Tensor | None = None,
    *,
    weights: Tensor | None = None,
) -> Tensor:
    """Scalar loss from a per-token loss matrix ``[B, T]`` (see `loss_weights` for the modes); pass
    precomputed ``weights`` to aggregate a micro-batch against its whole mini-batch."""
    if weights is None:
        weights = loss_weights(mask, mode, rollout_index)
    if weights.shape != loss_mat.shape:
        raise ValueError(f"weights {list(weights.shape)} do not match loss {list(loss_mat.shape)}")
    return (loss_mat.float() * weights).sum()


# --- policy loss -------------------------------------------------------------------------------------


def clipped_policy_loss(
    logprobs: Tensor,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    agg: str = "token",
    rollout_index: Tensor | None = None,
    weights: Tensor | None = None,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """PPO clipped surrogate, ``max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high))`` per
    token, with ``ratio = exp(logprobs - behaviour_logprobs)``, times ``is_weights`` when given,
    aggregated by `aggregate_loss`.

    logprobs (current policy, with grad), behaviour_logprobs (the ratio's reference: an off-policy
    correction's ``old_logprobs``, the gateway's behaviour log-probs in bypass mode), advantages, mask:
    ``[B, T]``. ``clip_high > clip_low`` is DAPO's clip-higher (lets unlikely tokens with positive
    advantage grow). ``dual_clip=c`` (c > 1) also caps the loss of negative-advantage tokens at
    ``-A * c`` so a huge ratio cannot blow the update up (Dual-clip PPO). Where a clip is active the
    token's gradient is zero. ``is_weights`` ``[B, T]`` (detached here): per-token importance weights
    of an off-policy correction (`tis_weights`), applied after the clip as verl applies them.

    Metrics (masked means over this batch's generated tokens): ``clip_frac`` (either clip bound active),
    ``clip_frac_low`` / ``clip_frac_high`` (ratio below / above the range), ``dual_clip_frac``,
    ``approx_kl`` (k3 estimate of KL(behaviour || current): ``ratio - 1 - log ratio``), ``ratio_mean``,
    ``ratio_max``.
    """
    if not logprobs.shape == behaviour_logprobs.shape == advantages.shape == mask.shape:
        raise ValueError("logprobs, behaviour_logprobs, advantages and mask must have one shape")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    if is_weights is not None and is_weights.shape != logprobs.shape:
        raise ValueError(f"is_weights {list(is_weights.shape)} do not match logprobs {list(logprobs.shape)}")
    log_ratio = (logprobs - behaviour_logprobs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = log_ratio.exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss_mat = torch.maximum(unclipped, clipped)
    is_clipped = clipped > unclipped
    if dual_clip is not None:
        cap = -advantages * dual_clip
        is_dual = (advantages < 0) & (loss_mat > cap)
        loss_mat = torch.where(is_dual, cap, loss_mat)
    else:
        is_dual = torch.zeros_like(is_clipped)
    if is_weights is not None:
        loss_mat = loss_mat * is_weights.detach()
    loss = aggregate_loss(loss_mat, mask, agg, rollout_index, weights=weights)

    with torch.no_grad():
        on = mask.bool()
        r = ratio.detach()
        metrics = {
            "clip_frac": masked_mean(is_clipped.float(), on).item(),
            "clip_frac_low": masked_mean((is_clipped & (r < 1.0)).float(), on).item(),
            "clip_frac_high": masked_mean((is_clipped & (r > 1.0)).float(), on).item(),
            "dual_clip_frac": masked_mean(is_dual.float(), on).item(),
            "approx_kl": masked_mean(r - 1.0 - log_ratio.detach(), on).item(),
            "ratio_mean": masked_mean(r, on).item(),
            "ratio_max": r[on].max().item() if on.any() else 0.0,
        }
    return loss, metrics


# --- off-policy correction ---------------------------------------------------------------------------


def tis_weights(
    old_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor, *, cap: float = 2.0
) -> Tensor:
    """Token-level truncated importance weights ``min(exp(old_logprobs - behaviour_logprobs), cap)``,
    0 off the mask, detached: ``[B, T]`` float32.

    old_logprobs (π_θold, the trainer's at the update's start), behaviour_logprobs (μ, the engine that
    sampled), mask: ``[B, T]``. The weight corrects the gradient for tokens drawn from μ rather than
    π_θold (another engine's numerics, or versions behind in the async modes); the cap bounds its
    variance, at the price of a bias where μ is much below π_θold. As verl's rollout correction
    ``rollout_is: token`` with threshold ``cap`` (log ratio clamped to +-20 first)."""
    if not old_logprobs.shape == behaviour_logprobs.shape == mask.shape:
        raise ValueError("old_logprobs, behaviour_logprobs and mask must have one shape")
    if cap < 1.0:
        raise ValueError(f"the TIS cap must be at least 1, got {cap}")
    log_ratio = (old_logprobs.detach().float() - behaviour_logprobs.float()).clamp(
        -_MAX_LOG_RATIO, _MAX_LOG_RATIO
    )
    return log_ratio.exp().clamp(max=cap) * mask.to(torch.float32)


@register_off_policy_correction("bypass")
def bypass_correction(
    behaviour_logprobs: Tensor, policy_logprobs: Callable[[], Tensor], mask: Tensor, *, tis_cap: float = 2.0
) -> Correction:
    """The behaviour log-probs are the PPO ratio's reference (``π_θ / μ``): no weights, no forward pass
    (verl's bypass mode). ``policy_logprobs`` and ``tis_cap`` are unused."""
    return Correction(behaviour_logprobs, None, {})


@register_off_policy_correction("tis")
def tis_correction(
    behaviour_logprobs: Tensor, policy_logprobs: Callable[[], Tensor], mask: Tensor, *, tis_cap: float = 2.0
) -> Correction:
    """Token-level TIS: the PPO ratio is ``π_θ / π_θold`` (the weights at the update's start), clipped
    as in bypass mode, and every token's loss is weighed by `tis_weights` ``min(π_θold / μ, tis_cap)``.
    Metrics: ``tis_weight_mean`` and ``tis_clip_frac`` (tokens whose ratio was above the cap),
    token means over the generated tokens."""
    old = policy_logprobs().detach()
    weights = tis_weights(old, behaviour_logprobs, mask, cap=tis_cap)
    with torch.no_grad():
        on = mask.bool()
        raw = (old - behaviour_logprobs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO).exp()
        metrics = {
            "tis_weight_mean": masked_mean(weights, on).item(),
            "tis_clip_frac": masked_mean((raw > tis_cap).float(), on).item(),
        }
    return Correction(old, weights, metrics)


def off_policy_correction(
    behaviour_logprobs: Tensor,
    policy_logprobs: Callable[[], Tensor],
    mask: Tensor,
    mode: str = "bypass",
    *,
    tis_cap: float = 2.0,
) -> Correction:
    """The registered correction ``mode`` (`bypass_correction`, `tis_correction`) of a whole update's
    batch: behaviour_logprobs, mask ``[B, T]``; ``policy_logprobs`` as `OffPolicyCorrectionFn` says.
    Computed once per update, before any optimizer step, so that θ_old is the same for every
    mini-batch and epoch."""
    correct = OFF_POLICY_CORRECTIONS.get(mode)
    if behaviour_logprobs.shape != mask.shape:
        raise ValueError("behaviour_logprobs and mask must have one shape")
    return correct(behaviour_logprobs, policy_logprobs, mask, tis_cap=tis_cap)


# --- KL ----------------------------------------------------------------------------------------------


@register_kl_estimator("k1")
def kl_k1(logprobs: Tensor, ref_logprobs: Tensor, *, max_value: float | None = None) -> Tensor:
    """``logp - ref_logp``; unbiased, high variance, can be negative per token (``max_value`` unused)."""
    return logprobs - ref_logprobs


@register_kl_estimator("k2")
def kl_k2(logprobs: Tensor, ref_logprobs: Tensor, *, max_value: float | None = None) -> Tensor:
    """``0.5 * (logp - ref_logp) ** 2``; biased, low variance (``max_value`` unused)."""
    return 0.5 * (logprobs - ref_logprobs).square()


@register_kl_estimator("low_var_kl")
@register_kl_estimator("k3")
def kl_k3(logprobs: Tensor, ref_logprobs: Tensor, *, max_value: float | None = 10.0) -> Tensor:
    """``exp(ref_logp - logp) - (ref_logp - logp) - 1``; unbiased, non-negative, low variance (verl's
    ``low_var_kl``). Its log ratio is clamped to +-20 and, with ``max_value``, the value to
    ``max_value``, so a single token where the policies disagree wildly cannot dominate the loss."""
    log_r = (ref_logprobs - logprobs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    kl = log_r.exp() - log_r - 1.0
    return kl if max_value is None else kl.clamp(max=max_value)


def kl_penalty(
    logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k3", *, max_value: float | None = 10.0
) -> Tensor:
    """Per-token estimate ``[B, T]`` of KL(current || reference) on tokens sampled from the current
    (behaviour) policy (Schulman, "Approximating KL divergence") by the registered ``estimator``
    (`kl_k1`, `kl_k2`, `kl_k3`); aggregate it like the policy loss. logprobs, ref_logprobs: ``[B, T]``.
    """
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError("logprobs and ref_logprobs must have one shape")
    return KL_ESTIMATORS.get(estimator)(logprobs, ref_logprobs, max_value=max_value)


# --- entropy -----------------------------------------------------------------------------------------


def token_entropy(logits: Tensor, mask: Tensor | None = None, *, chunk_size: int = 1024) -> Tensor:
    """Entropy of the next-token distribution at each position: logits ``[..., V]`` -> ``[...]`` float32.

    Works through ``chunk_size`` positions at a time, upcasting only those to float32, so no float32 copy
    of the full logits is made; with ``mask`` (shape ``[...]``) only masked positions are computed and the
    rest are 0. Under autograd each chunk's softmax is kept for backward, so for a metric call it inside
    ``torch.no_grad()``.
    """
    lead = logits.shape[:-1]
    flat = logits.reshape(-1, logits.shape[-1])
    if mask is None:
        idx = torch.arange(flat.shape[0], device=flat.device)
    else:
        if mask.shape != lead:
            raise ValueError(f"mask {list(mask.shape)} does not match logits {list(lead)}")
        idx = mask.reshape(-1).nonzero().squeeze(1)
    parts = []
    for chunk in idx.split(chunk_size):
        # -inf logits (masked vocabulary) would give 0 * -inf = nan below; the float32 minimum gives 0.
        x = flat.index_select(0, chunk).float().clamp(min=torch.finfo(torch.float32).min)
        lse = x.logsumexp(dim=-1)
        p = (x - lse[:, None]).exp()
        parts.append(lse - (p * x).sum(dim=-1))
    out = torch.zeros(flat.shape[0], dtype=torch.float32, device=flat.device)
    if parts:
        out = out.index_copy(0, idx, torch.cat(parts))
    return out.reshape(lead)


def split_by_rollout(
    rows: list[int], sample_rollout: Sequence[int], parts: int, generator: torch.Generator
) -> list[list[int]]:
    """``rows`` (sample indices) in up to ``parts`` mini-batches of whole rollouts, the rollouts shuffled
    by ``generator`` and dealt round-robin, each mini-batch's rows in their original order."""
    rollouts = sorted({sample_rollout[i] for i in rows})
    order = [rollouts[int(k)] for k in torch.randperm(len(rollouts), generator=generator)]
    part_of = {r: n % parts for n, r in enumerate(order)}
    split: list[list[int]] = [[] for _ in range(min(parts, len(rollouts)))]
    for i in rows:
        split[part_of[sample_rollout[i]]].append(i)
    return split
