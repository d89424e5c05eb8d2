"""Samples -> verl's padded batch and back: nothing lost, the layout verl's trainer builds."""

import random

import pytest
import torch

from inharness.trainer.samples import Sample
from inharness.trainer.verl_engine import data


def _samples(n: int, seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p, m = rng.randint(1, 9), rng.randint(0, 12)
        mask = [0] * p + [rng.randint(0, 1) for _ in range(m)]
        out.append(
            Sample(
                rollout_id=f"r{i}",
                group_id=f"g{i // 2}",
                call_ids=[i],
                input_ids=[rng.randint(1, 500) for _ in range(p + m)],
                loss_mask=mask,
                behaviour_logprobs=[0.0] * p + [-rng.random() * 5 for _ in range(m)],
                model_versions=[0],
                reward=float(i % 2),
                num_prompt_tokens=p,
            )
        )
    return out


def test_round_trip_returns_every_sample_exactly() -> None:
    samples = _samples(9)
    back = data.to_samples(data.to_batch(samples), samples)
    for a, b in zip(samples, back, strict=True):
        assert b.input_ids == a.input_ids
        assert b.loss_mask == a.loss_mask
        assert b.num_prompt_tokens == a.num_prompt_tokens
        assert torch.tensor(b.behaviour_logprobs[b.num_prompt_tokens :]).equal(
            torch.tensor(a.behaviour_logprobs[a.num_prompt_tokens :], dtype=torch.float32)
        )


def test_prompts_are_left_padded_and_responses_right_padded() -> None:
    samples = _samples(5, seed=3)
    batch = data.to_batch(samples)
    p = batch["prompts"].shape[1]
    for i, s in enumerate(samples):
        n, m = s.num_prompt_tokens, len(s.input_ids) - s.num_prompt_tokens
        row = batch["attention_mask"][i]
        assert row[: p - n].sum() == 0 and row[p - n : p + m].all() and row[p + m :].sum() == 0
        assert batch["prompts"][i, p - n :].tolist() == s.input_ids[:n]
        assert batch["responses"][i, :m].tolist() == s.input_ids[n:]
        real = batch["position_ids"][i][row.bool()]
        assert real.tolist() == list(range(n + m))


def test_response_space_takes_the_positions_after_each_prompt() -> None:
    samples = _samples(4, seed=1)
    width = max(len(s.input_ids) for s in samples)
    per_position = torch.arange(len(samples) * width, dtype=torch.float32).reshape(len(samples), width)
    out = data.response_space(per_position, samples)
    for i, s in enumerate(samples):
        m = len(s.input_ids) - s.num_prompt_tokens
        assert out[i, :m].tolist() == per_position[i, s.num_prompt_tokens : len(s.input_ids)].tolist()
        assert out[i, m:].abs().sum() == 0


def test_an_off_policy_correction_replaces_old_log_probs_and_adds_weights() -> None:
    samples = _samples(4, seed=2)
    plain = data.to_batch(samples)
    assert "rollout_is_weights" not in plain
    r = plain["responses"].shape[1]
    old, weights = -torch.rand(4, r), torch.rand(4, r) * 2
    batch = data.to_batch(samples, old_log_probs=old, rollout_is_weights=weights)
    assert batch["old_log_probs"].equal(old) and batch["rollout_is_weights"].equal(weights)
    assert batch["input_ids"].equal(plain["input_ids"])


def test_tensors_of_the_wrong_shape_are_refused() -> None:
    samples = _samples(3)
    with pytest.raises(ValueError, match="advantages must have shape"):
        data.to_batch(samples, advantages=torch.zeros(3, 1000))
    with pytest.raises(ValueError, match="rollout_is_weights must have shape"):
        data.to_batch(samples, rollout_is_weights=torch.zeros(2, 1))
    with pytest.raises(ValueError, match="at least one sample"):
        data.to_batch([])
