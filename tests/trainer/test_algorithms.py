"""Advantages, clipped loss, aggregation, KL and entropy pinned against hand-computed values."""

import math

import pytest
import torch

from inharness.trainer.algorithms import (
    aggregate_loss,
    clipped_policy_loss,
    kl_penalty,
    loss_weights,
    masked_mean,
    off_policy_correction,
    rollout_advantages,
    sample_advantages,
    tis_weights,
    token_advantages,
    token_entropy,
)


def close(actual: torch.Tensor, expected: list[float] | float, tol: float = 1e-5) -> None:
    torch.testing.assert_close(
        actual.float(), torch.tensor(expected, dtype=torch.float32), atol=tol, rtol=tol
    )


# Groups of unequal sizes, interleaved: g0 = rewards [1, 0, 0] (rollouts 0, 2, 4),
# g1 = [1, 3] (rollouts 1, 5), g2 = [5] alone (rollout 3).
REWARDS = torch.tensor([1.0, 1.0, 0.0, 5.0, 0.0, 3.0])
GROUPS = torch.tensor([0, 1, 0, 2, 0, 1])


def test_grpo_rollout_level() -> None:
    # g0: mean 1/3, deviations [2/3, -1/3, -1/3], unbiased var (4/9 + 1/9 + 1/9) / 2 = 1/3,
    #     std 0.577350 -> [1.154701, -0.577350, -0.577350].
    # g1: mean 2, deviations [-1, 1], var 2 / 1, std 1.414214 -> [-0.707107, 0.707107].
    # g2: a single rollout has no baseline -> 0.
    adv = rollout_advantages(REWARDS, GROUPS, "grpo", eps=0.0)
    close(adv, [1.154701, -0.707107, -0.577350, 0.0, -0.577350, 0.707107])
    # Group ids need not be dense.
    close(rollout_advantages(REWARDS, GROUPS * 7 + 40, "grpo", eps=0.0), adv.tolist())


def test_dr_grpo_does_not_divide_by_std() -> None:
    adv = rollout_advantages(REWARDS, GROUPS, "grpo", norm_by_std=False)
    close(adv, [2 / 3, -1.0, -1 / 3, 0.0, -1 / 3, 1.0])


def test_rloo_rollout_level() -> None:
    # g0: 1 - mean(0, 0) = 1; 0 - mean(1, 0) = -0.5 (twice). g1: 1 - 3 = -2, 3 - 1 = 2. g2: 0.
    adv = rollout_advantages(REWARDS, GROUPS, "rloo")
    close(adv, [1.0, -2.0, -0.5, 0.0, -0.5, 2.0])


def test_equal_rewards_give_zero_not_nan() -> None:
    adv = rollout_advantages(torch.tensor([1.0, 1.0, 1.0]), torch.tensor([0, 0, 0]), "grpo")
    close(adv, [0.0, 0.0, 0.0])
    assert rollout_advantages(torch.tensor([]), torch.tensor([], dtype=torch.long)).numel() == 0


def test_sample_level_differs_from_rollout_level() -> None:
    # One group: rollout 0 (reward 1) was split into 3 samples, rollout 1 (reward 0) is 1 sample.
    rewards, groups = torch.tensor([1.0, 0.0]), torch.tensor([0, 0])
    sample_rollout = torch.tensor([0, 0, 0, 1])
    # Rollout level GRPO: [1, 0] -> mean 0.5, std sqrt(0.5) -> +-0.707107, broadcast to samples.
    # Sample level GRPO: [1, 1, 1, 0] -> mean 0.75, unbiased var (3 * 0.0625 + 0.5625) / 3 = 0.25,
    #     std 0.5 -> [0.5, 0.5, 0.5, -1.5]: the split rollout counts three times.
    # Rollout level RLOO: [1, -1]; sample level RLOO: 1 - mean(1, 1, 0) = 1/3, 0 - 1 = -1.
    roll = rollout_advantages(rewards, groups, "grpo", eps=0.0)[sample_rollout]
    close(roll, [0.707107, 0.707107, 0.707107, -0.707107])
    close(sample_advantages(rewards, groups, sample_rollout, "grpo", eps=0.0), [0.5, 0.5, 0.5, -1.5])
    close(rollout_advantages(rewards, groups, "rloo")[sample_rollout], [1.0, 1.0, 1.0, -1.0])
    close(sample_advantages(rewards, groups, sample_rollout, "rloo"), [1 / 3, 1 / 3, 1 / 3, -1.0])

    mask = torch.tensor([[0, 1, 1], [0, 0, 1], [1, 0, 0], [0, 1, 0]])
    tok = token_advantages(rewards, groups, sample_rollout, mask, level="sample", estimator="rloo")
    third = 1 / 3
    close(tok, [[0.0, third, third], [0.0, 0.0, third], [third, 0.0, 0.0], [0.0, -1.0, 0.0]])
    tok = token_advantages(rewards, groups, sample_rollout, mask, level="rollout", estimator="rloo")
    close(tok, [[0.0, 1.0, 1.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0], [0.0, -1.0, 0.0]])


# Row 0 (rollout 0): 8 generated tokens with loss 1. Rows 1 and 2 (rollout 1): 1 token with loss 2 and
# 3 tokens with loss 0. Row 3: padding only (rollout 2, no generated tokens).
LOSS = torch.tensor([[1.0] * 8, [2.0] + [9.0] * 7, [0.0] * 3 + [9.0] * 5, [9.0] * 8])
MASK = torch.tensor([[1] * 8, [1] + [0] * 7, [1] * 3 + [0] * 5, [0] * 8])
ROLLOUT = torch.tensor([0, 1, 1, 2])


def test_aggregation_modes() -> None:
    # token:   (8 * 1 + 2 + 0) / 12 tokens = 0.833333
    # sample:  mean(1, 2, 0) over the 3 samples with tokens = 1.0
    # rollout: mean(1, (2 + 0) / 4) over the 2 rollouts with tokens = 0.75
    close(aggregate_loss(LOSS, MASK, "token"), 10 / 12)
    close(aggregate_loss(LOSS, MASK, "sample"), 1.0)
    close(aggregate_loss(LOSS, MASK, "rollout", ROLLOUT), 0.75)
    with pytest.raises(ValueError, match="rollout_index"):
        aggregate_loss(LOSS, MASK, "rollout")


def test_rollout_aggregation_weighs_rollouts_equally() -> None:
    w = loss_weights(MASK, "rollout", ROLLOUT)
    close(w[0].sum(), 0.5)  # 8 tokens
    close(w[1:3].sum(), 0.5)  # 4 tokens in 2 samples
    close(w[3].sum(), 0.0)
    close(w[1, 0], 0.125)  # each of rollout 1's tokens: 0.5 / 4
    tok = loss_weights(MASK, "token")
    close(tok[0].sum(), 8 / 12)  # token level lets the long rollout dominate
    assert bool(((w > 0) == MASK.bool()).all())


def test_precomputed_weights_make_micro_batches_add_up() -> None:
    w = loss_weights(MASK, "rollout", ROLLOUT)
    parts = [aggregate_loss(LOSS[i : i + 2], MASK[i : i + 2], weights=w[i : i + 2]) for i in (0, 2)]
    close(sum(parts), 0.75)


def _policy_inputs(ratios: list[float], adv: list[float]) -> tuple[torch.Tensor, ...]:
    behaviour = torch.full((1, len(ratios)), -1.0)
    logprobs = (behaviour + torch.tensor([ratios]).log()).requires_grad_(True)
    return logprobs, behaviour, torch.tensor([adv]), torch.ones(1, len(ratios))


def test_clipped_loss_values_gradients_and_metrics() -> None:
    # clip range [0.8, 1.28]. Per token (loss = max(-A r, -A clip(r))):
    #   A=+1 r=1.5: max(-1.5, -1.28) = -1.28, clipped -> grad 0
    #   A=+1 r=0.5: max(-0.5, -0.8) = -0.5, unclipped -> d/dlogp = -A r = -0.5
    #   A=-1 r=0.5: max(0.5, 0.8) = 0.8, clipped -> grad 0
    #   A=-1 r=1.5: max(1.5, 1.28) = 1.5, unclipped -> grad 1.5
    #   A=+2 r=1.1: inside the range: -2.2, grad -2.2
    # token mean: (-1.28 - 0.5 + 0.8 + 1.5 - 2.2) / 5 = -0.336; gradients / 5.
    ratios, adv = [1.5, 0.5, 0.5, 1.5, 1.1], [1.0, 1.0, -1.0, -1.0, 2.0]
    logprobs, behaviour, advantages, mask = _policy_inputs(ratios, adv)
    loss, metrics = clipped_policy_loss(logprobs, behaviour, advantages, mask, clip_low=0.2, clip_high=0.28)
    close(loss, -0.336)
    loss.backward()
    assert logprobs.grad is not None
    close(logprobs.grad, [[0.0, -0.1, 0.0, 0.3, -0.44]])
    assert metrics["clip_frac"] == pytest.approx(0.4)
    assert metrics["clip_frac_low"] == pytest.approx(0.2)
    assert metrics["clip_frac_high"] == pytest.approx(0.2)
    assert metrics["dual_clip_frac"] == 0.0
    assert metrics["ratio_mean"] == pytest.approx(5.1 / 5)
    assert metrics["ratio_max"] == pytest.approx(1.5)
    k3 = [r - 1 - math.log(r) for r in ratios]  # 0.094535, 0.193147, 0.193147, 0.094535, 0.004690
    assert metrics["approx_kl"] == pytest.approx(sum(k3) / 5, rel=1e-5)


def test_dual_clip_caps_negative_advantage_loss() -> None:
    # A=-1, r=4: plain PPO loss max(4, 1.2) = 4 with grad 4; dual clip c=3 caps it at 3 with grad 0.
    # A=+1, r=4: clipped at -1.2 either way (dual clip acts on negative advantages only).
    logprobs, behaviour, advantages, mask = _policy_inputs([4.0, 4.0], [-1.0, 1.0])
    loss, metrics = clipped_policy_loss(logprobs, behaviour, advantages, mask)
    close(loss, (4.0 - 1.2) / 2)
    loss.backward()
    assert logprobs.grad is not None
    close(logprobs.grad, [[2.0, 0.0]])
    logprobs.grad = None
    loss, metrics = clipped_policy_loss(logprobs, behaviour, advantages, mask, dual_clip=3.0)
    close(loss, (3.0 - 1.2) / 2)
    loss.backward()
    close(logprobs.grad, [[0.0, 0.0]])
    assert metrics["dual_clip_frac"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="dual_clip"):
        clipped_policy_loss(logprobs, behaviour, advantages, mask, dual_clip=1.0)


def test_clipped_loss_ignores_masked_positions_and_aggregates_per_rollout() -> None:
    # Row 0: one token, A=1, r=1 -> -1. Row 1 (same rollout): masked token with a wild ratio.
    # Row 2 (rollout 1): two tokens A=-1, r=1 -> 1 each. Rollout mean: (-1 + 1) / 2 = 0; token mean 1/3.
    behaviour = torch.zeros(3, 2)
    logprobs = torch.tensor([[0.0, 0.0], [30.0, 0.0], [0.0, 0.0]], requires_grad=True)
    adv = torch.tensor([[1.0, 0.0], [5.0, 0.0], [-1.0, -1.0]])
    mask = torch.tensor([[1, 0], [0, 0], [1, 1]])
    rollout = torch.tensor([0, 0, 1])
    loss, metrics = clipped_policy_loss(logprobs, behaviour, adv, mask, agg="rollout", rollout_index=rollout)
    close(loss, 0.0)
    loss, metrics = clipped_policy_loss(logprobs, behaviour, adv, mask)
    close(loss, 1 / 3)
    assert metrics["ratio_max"] == pytest.approx(1.0)
    assert metrics["clip_frac"] == 0.0


def test_tis_weights_are_truncated_masked_and_detached() -> None:
    # old - behaviour = [0, 0.5, -1, 2, 3]: exp -> [1, 1.648721, 0.367879, 7.389056 -> 2, 20.09 (masked)]
    old = torch.tensor([[-1.0, -0.5, -2.0, -0.1, -0.2]], requires_grad=True)
    behaviour = torch.tensor([[-1.0, -1.0, -1.0, -2.1, -3.2]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    w = tis_weights(old, behaviour, mask, cap=2.0)
    close(w, [[1.0, 1.648721, 0.367879, 2.0, 0.0]])
    assert not w.requires_grad and w.dtype == torch.float32
    close(tis_weights(old, behaviour, mask, cap=1.0), [[1.0, 1.0, 0.367879, 1.0, 0.0]])
    # A far-off token: the log ratio is clamped to 20 before exp, then the cap applies.
    close(
        tis_weights(torch.zeros(1, 1), torch.full((1, 1), -1e4), torch.ones(1, 1), cap=1e9), [[math.exp(20)]]
    )
    with pytest.raises(ValueError, match="at least 1"):
        tis_weights(old, behaviour, mask, cap=0.5)
    with pytest.raises(ValueError, match="one shape"):
        tis_weights(old, behaviour[:, :3], mask)


def test_off_policy_corrections_by_name() -> None:
    behaviour = torch.tensor([[-1.0, -1.0, -1.0, 0.0]])
    old = torch.tensor([[-1.0, 0.0, -1.5, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    calls: list[int] = []

    def policy() -> torch.Tensor:
        calls.append(1)
        return old

    bypass = off_policy_correction(behaviour, policy, mask, "bypass")
    assert bypass.old_logprobs is behaviour and bypass.is_weights is None and bypass.metrics == {}
    assert calls == []  # bypass runs no forward pass
    tis = off_policy_correction(behaviour, policy, mask, "tis", tis_cap=2.0)
    assert calls == [1] and tis.old_logprobs.equal(old)
    assert tis.is_weights is not None
    close(tis.is_weights, [[1.0, 2.0, 0.606531, 0.0]])  # e^1 = 2.718 truncated to 2
    # token means over the three generated tokens; one of them was truncated
    assert tis.metrics["tis_weight_mean"] == pytest.approx((1.0 + 2.0 + 0.606531) / 3, rel=1e-5)
    assert tis.metrics["tis_clip_frac"] == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="unknown off-policy correction 'is'; known: bypass, tis"):
        off_policy_correction(behaviour, policy, mask, "is")


def test_is_weights_multiply_each_tokens_clipped_loss() -> None:
    # The per-token losses of test_clipped_loss_values_gradients_and_metrics, weighed after the clip:
    # [-1.28, -0.5, 0.8, 1.5, -2.2] * [1, 2, 0.5, 2, 1] = [-1.28, -1, 0.4, 3, -2.2] -> mean -0.216.
    ratios, adv = [1.5, 0.5, 0.5, 1.5, 1.1], [1.0, 1.0, -1.0, -1.0, 2.0]
    logprobs, behaviour, advantages, mask = _policy_inputs(ratios, adv)
    is_weights = torch.tensor([[1.0, 2.0, 0.5, 2.0, 1.0]])
    loss, metrics = clipped_policy_loss(
        logprobs, behaviour, advantages, mask, clip_low=0.2, clip_high=0.28, is_weights=is_weights
    )
    close(loss, -0.216)
    loss.backward()
    assert logprobs.grad is not None
    close(logprobs.grad, [[0.0, -0.2, 0.0, 0.6, -0.44]])
    assert metrics["clip_frac"] == pytest.approx(0.4)  # of the ratio; the weights do not change it
    with pytest.raises(ValueError, match="is_weights"):
        clipped_policy_loss(logprobs, behaviour, advantages, mask, is_weights=is_weights[:, :2])


def test_kl_estimators() -> None:
    logp, ref = torch.tensor([[-1.0, -2.0, -3.0]]), torch.tensor([[-1.5, -1.0, -3.0]])
    # diff = logp - ref = [0.5, -1, 0]
    close(kl_penalty(logp, ref, "k1"), [[0.5, -1.0, 0.0]])
    close(kl_penalty(logp, ref, "k2"), [[0.125, 0.5, 0.0]])
    # k3 with log r = ref - logp = [-0.5, 1, 0]: e^-0.5 + 0.5 - 1 = 0.106531; e - 2 = 0.718282; 0.
    close(kl_penalty(logp, ref, "k3"), [[0.106531, 0.718282, 0.0]])
    close(kl_penalty(logp, ref, "low_var_kl"), [[0.106531, 0.718282, 0.0]])
    # A token the reference finds far likelier: e^20 - 21 is capped at max_value.
    far = kl_penalty(torch.tensor([-25.0]), torch.tensor([0.0]), "k3")
    close(far, [10.0])
    assert kl_penalty(torch.tensor([-25.0]), torch.tensor([0.0]), "k3", max_value=None).item() > 1e8
    with pytest.raises(ValueError, match="estimator"):
        kl_penalty(logp, ref, "k4")  # type: ignore[arg-type]


def test_masked_mean() -> None:
    close(masked_mean(torch.tensor([1.0, 2.0, 30.0]), torch.tensor([1, 1, 0])), 1.5)
    close(masked_mean(torch.tensor([1.0]), torch.tensor([0])), 0.0)


def test_token_entropy() -> None:
    # Uniform over 4 -> ln 4 = 1.386294; p = [1/4, 3/4] (logits ln 1, ln 3) -> 0.562335.
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3.0), -math.inf, -math.inf]]])
    close(token_entropy(logits), [[1.386294, 0.562335]])
    close(token_entropy(logits, torch.tensor([[0, 1]])), [[0.0, 0.562335]])

    torch.manual_seed(0)
    x = torch.randn(3, 5, 11, requires_grad=True)
    ent = token_entropy(x, chunk_size=4)
    ref = torch.distributions.Categorical(logits=x).entropy()
    torch.testing.assert_close(ent, ref)
    (g,) = torch.autograd.grad(ent.sum(), x)
    (g_ref,) = torch.autograd.grad(ref.sum(), x)
    torch.testing.assert_close(g, g_ref)
    half = token_entropy(x.detach().bfloat16(), chunk_size=2)
    assert half.dtype == torch.float32 and half.shape == (3, 5)
