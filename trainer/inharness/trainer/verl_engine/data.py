"""Samples -> verl's batch: the left/right padded `TensorDict` that verl's `update_actor` takes.

verl splits every sequence into a prompt (left-padded to ``P``) and a response (right-padded to ``R``)
and scores the response: its ``log_probs`` ``[B, R]`` are the model's log-probabilities of
``responses`` ``[B, R]``. A `Sample`'s prompt is its first call's prompt (``num_prompt_tokens``); the
rest (every later turn: generated tokens and, masked, the tool results between them) is the response.
Per-token lists of a sample describe ``input_ids[i]`` (see `inharness.trainer.samples`), so response
position ``j`` takes entry ``num_prompt_tokens + j``: no shift.

Tensors (``B`` samples; ``P``/``R`` the longest prompt/response):
- ``prompts`` ``[B, P]`` long, left-padded; ``responses`` ``[B, R]`` long, right-padded;
- ``input_ids`` ``[B, P + R]`` = prompts ‖ responses; ``attention_mask`` ``[B, P + R]`` 1 on real
  tokens; ``position_ids`` ``[B, P + R]`` 0.. over real tokens (0 on padding);
- ``response_mask`` ``[B, R]`` float, the sample's loss mask; ``old_log_probs`` ``[B, R]``, the
  reference of the importance ratio: by default the behaviour log-probs the gateway recorded (verl's
  "bypass" mode, as in the torch engine), for training the off-policy correction's
  (`algorithms.off_policy_correction`: with ``tis``, the actor's log-probs at the update's start);
- ``advantages``, ``loss_weights`` and, with a correction that weighs tokens, ``rollout_is_weights``
  (verl's name) ``[B, R]`` float, as the torch engine computes them (`inharness.trainer.algorithms`).

`to_samples` is the inverse, so tests can check that the conversion loses nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tensordict import TensorDict

from inharness.trainer.samples import Sample

PAD = 0  # padding id: never attended, never scored


def response_length(sample: Sample) -> int:
    return len(sample.input_ids) - sample.num_prompt_tokens


def to_batch(
    samples: Sequence[Sample],
    *,
    advantages: torch.Tensor | None = None,
    loss_weights: torch.Tensor | None = None,
    old_log_probs: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> TensorDict:
    """The padded batch of ``samples``; ``advantages`` / ``loss_weights`` ``[B, R]`` in response space
    (see `response_space`) when the batch is for training, ``old_log_probs`` ``[B, R]`` in place of the
    behaviour log-probs and ``rollout_is_weights`` ``[B, R]`` when an off-policy correction gives them."""
    if not samples:
        raise ValueError("a verl batch needs at least one sample")
    b = len(samples)
    p = max(s.num_prompt_tokens for s in samples)
    r = max(max(response_length(s) for s in samples), 1)
    prompts = torch.full((b, p), PAD, dtype=torch.long)
    responses = torch.full((b, r), PAD, dtype=torch.long)
    attention = torch.zeros((b, p + r), dtype=torch.long)
    response_mask = torch.zeros((b, r), dtype=torch.float32)
    behaviour = torch.zeros((b, r), dtype=torch.float32)
    for i, s in enumerate(samples):
        n, m = s.num_prompt_tokens, response_length(s)
        if n < 1:
            raise ValueError(f"sample of rollout {s.rollout_id} has no prompt token")
        prompts[i, p - n :] = torch.tensor(s.input_ids[:n])
        responses[i, :m] = torch.tensor(s.input_ids[n:])
        attention[i, p - n : p + m] = 1
        response_mask[i, :m] = torch.tensor(s.loss_mask[n:], dtype=torch.float32)
        behaviour[i, :m] = torch.tensor(s.behaviour_logprobs[n:], dtype=torch.float32)
    position_ids = (attention.cumsum(dim=1) - 1).clamp(min=0) * attention
    tensors = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention,
        "position_ids": position_ids,
        "response_mask": response_mask,
        "old_log_probs": behaviour,
    }
    optional = {
        "advantages": advantages,
        "loss_weights": loss_weights,
        "old_log_probs": old_log_probs,
        "rollout_is_weights": rollout_is_weights,
    }
    for name, t in optional.items():
        if t is not None:
            if t.shape != (b, r):
                raise ValueError(f"{name} must have shape {[b, r]}, got {list(t.shape)}")
            tensors[name] = t.to(torch.float32)
    return TensorDict(tensors, batch_size=[b])


def response_space(per_position: torch.Tensor, samples: Sequence[Sample]) -> torch.Tensor:
    """``[B, T]`` per input position (position ``i`` describes ``input_ids[i]``, as `Sample` lists do)
    -> ``[B, R]`` per response position, as `to_batch` lays the batch out."""
    r = max(max(response_length(s) for s in samples), 1)
    out = torch.zeros((len(samples), r), dtype=per_position.dtype)
    for i, s in enumerate(samples):
        m = response_length(s)
        out[i, :m] = per_position[i, s.num_prompt_tokens : s.num_prompt_tokens + m]
    return out


def to_samples(batch: TensorDict, like: Sequence[Sample]) -> list[Sample]:
    """The samples a batch holds (ids, masks, behaviour log-probs), with the identities of ``like``
    (rollout, group, calls, versions, reward: verl's batch does not carry them)."""
    out = []
    p = batch["prompts"].shape[1]
    for i, s in enumerate(like):
        real = batch["attention_mask"][i].bool()
        n = int(real[:p].sum())
        m = int(real[p:].sum())
        ids = batch["input_ids"][i][real].tolist()
        out.append(
            Sample(
                rollout_id=s.rollout_id,
                group_id=s.group_id,
                call_ids=list(s.call_ids),
                input_ids=ids,
                loss_mask=[0] * n + [int(x) for x in batch["response_mask"][i, :m].tolist()],
                behaviour_logprobs=list(s.behaviour_logprobs[:n]) + batch["old_log_probs"][i, :m].tolist(),
                model_versions=list(s.model_versions),
                reward=s.reward,
                num_prompt_tokens=n,
            )
        )
    return out
