"""The CPU training engine: RL updates on recorded samples with plain PyTorch + transformers.

The interface is kept narrow (load, logprobs, update, export weights, checkpoint) so that a GPU engine
can implement the same methods and the training loop need not know which one it drives.

Alignment: causal-LM logits at position ``j`` score token ``input_ids[j + 1]``, so every per-token tensor
here lives in *target space* of ``len(input_ids) - 1`` columns: column ``j`` is token ``input_ids[j + 1]``
with ``loss_mask[j + 1]`` and ``behaviour_logprobs[j + 1]`` (position 0 is a prompt token and is never
scored). Shapes: ``B`` samples, ``W`` padded sequence length, ``V`` vocabulary.

Batches are right-padded and fed without an attention mask: under causal attention a real token never
attends to the padding after it, so its logits are those of the unpadded sequence, and the forward pass
takes the same path as the inference engine's (which also runs without a mask).

Shared prefix: agent samples mostly start with the same system prompt, tool schema and chat markup, so
the rows of a micro-batch often share a long prefix of ``P`` tokens. Under causal attention the hidden
states, keys and values at positions ``< P`` depend only on those tokens, so they are the same in every row:
the forward pass runs the prefix once (batch 1, filling a KV cache), broadcasts its keys/values to the
``b`` rows and runs only the suffixes ``ids[:, P:]`` on top, at positions ``P..W-1`` (as the inference
engine extends a prompt). The suffix pass gets an explicit causal mask offset by ``P`` (transformers builds
it when a cache is present) and still needs no padding mask. Prefix logits are computed once, ``[P, V]``,
and broadcast to the rows. This is the same computation as the plain pass up to float rounding, and
gradients flow through the cache into the prefix, so they are those of the plain pass too; only micro-batches
where it saves enough work take it (`_MIN_SHARED_TOKENS`).

Dropout is never active (the model stays in eval mode): the PPO ratio must be exactly 1 on freshly served
weights, and the inference engine samples without dropout.

Precision: weights and AdamW state are always float32. ``dtype="bfloat16"`` runs the forward passes under
``torch.autocast`` in bfloat16 (fp32 master weights, since updates of ``lr * ~1`` on bfloat16 weights would
mostly round away); logprobs, losses and entropies are computed from logits upcast to float32 either way.
``save_pretrained`` exports the float32 weights.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

import numpy as np
import torch
from torch import Tensor
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, PreTrainedModel

from inharness.trainer.algorithms import (
    aggregate_loss,
    clipped_policy_loss,
    kl_penalty,
    loss_weights,
    off_policy_correction,
    split_by_rollout,
    token_advantages,
    token_entropy,
)
from inharness.trainer.config import KL_ESTIMATOR, UpdateConfig
from inharness.trainer.samples import Sample, index_rollouts

Dtype = Literal["float32", "bfloat16"]

_CHECKPOINT_FORMAT = 1
_STATE_FILE = "trainer_state.json"  # written last: its presence marks a complete checkpoint
_PAD_ID = 0  # any valid id: right padding is never attended to by real tokens and never scored
# Sharing a prefix of P tokens among b rows saves (b - 1) * P token positions of forward and backward, and
# costs a second model call, a copy of the prefix keys/values into each row and a masked suffix attention:
# on the tiny CPU model that overhead is worth 64-96 positions (b=2 breaks even near P=96, b=16 near P=8).
_MIN_SHARED_TOKENS = 96


def pack_by_token_budget(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Group indices of ``lengths`` into micro-batches whose padded size (rows x longest row) is at most
    ``budget``. Longest first, so rows of a micro-batch have similar lengths (little padding) and the
    largest forward pass (peak memory) comes first; a row longer than the budget gets a micro-batch alone.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        if current and (len(current) + 1) * lengths[current[0]] > budget:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def _check_samples(samples: Sequence[Sample]) -> None:
    for k, s in enumerate(samples):
        n = len(s.input_ids)
        if n == 0:
            raise ValueError(f"sample {k} ({s.rollout_id}) has no tokens")
        if len(s.loss_mask) != n or len(s.behaviour_logprobs) != n:
            raise ValueError(
                f"sample {k} ({s.rollout_id}): {n} input ids but {len(s.loss_mask)} mask entries and "
                f"{len(s.behaviour_logprobs)} behaviour logprobs"
            )
        if s.loss_mask[0]:
            raise ValueError(f"sample {k} ({s.rollout_id}): position 0 has no prefix and cannot be trained")


def _pad_ids(samples: Sequence[Sample]) -> tuple[Tensor, Tensor]:
    """(right-padded ``input_ids`` ``[b, W]``, lengths ``[b]``), both long, ``W`` the longest sample."""
    lengths = torch.tensor([len(s.input_ids) for s in samples], dtype=torch.long)
    ids = torch.full((len(samples), int(lengths.max())), _PAD_ID, dtype=torch.long)
    for row, s in enumerate(samples):
        ids[row, : len(s.input_ids)] = torch.tensor(s.input_ids, dtype=torch.long)
    return ids, lengths


def _common_prefix(ids: Tensor, lengths: Tensor) -> int:
    """Length of the longest prefix that the rows of ``ids`` ``[b, W]`` share, capped at ``min(lengths) - 1``
    so that it holds only real tokens and every row keeps at least one after it (the prefix's last logits
    then score a real token in each row)."""
    differs = (ids != ids[:1]).any(dim=0).nonzero()
    shared = int(differs[0]) if len(differs) else ids.shape[1]
    return min(shared, int(lengths.min()) - 1)


def _logits(model: PreTrainedModel, ids: Tensor, prefix: int) -> tuple[Tensor | None, Tensor]:
    """Raw logits of ``ids`` ``[b, W]`` as (``[prefix, V]`` at positions ``0..prefix-1``, shared by all rows,
    or None when ``prefix`` is 0; ``[b, W - prefix, V]`` at positions ``prefix..W-1``).

    The prefix runs once as batch 1; its cached keys/values are expanded (not copied) to ``b`` rows, and the
    suffix pass concatenates its own onto them, so autograd carries the suffix's gradient back into the
    prefix computation. Positions continue from the cache length."""
    if prefix == 0:
        return None, model(input_ids=ids, use_cache=False).logits
    b = ids.shape[0]
    # `past_key_values=`: transformers 5.10 (verl's bound) ignores `cache=` silently; newer accept both.
    cache = DynamicCache(config=model.config)
    head = model(input_ids=ids[:1, :prefix], past_key_values=cache, use_cache=True).logits[0]
    for layer in cache.layers:
        layer.keys = layer.keys.expand(b, -1, -1, -1)
        layer.values = layer.values.expand(b, -1, -1, -1)
    return head, model(input_ids=ids[:, prefix:], past_key_values=cache, use_cache=True).logits


def _logits_after_frozen_context(model: PreTrainedModel, ids: Tensor, start: int) -> Tensor:
    """Raw logits ``[b, W - start, V]`` of ``ids[:, start:]``, with the context ``ids[:, :start]`` run
    without gradient into a KV cache and only ``ids[:, start:]`` in the graph.

    The values are those of the plain pass (the same causal computation, cut in two as the inference
    engine extends a prompt); the gradient is not: it reaches the weights only through the positions
    from ``start`` on, never through the context's hidden states, keys and values."""
    cache = DynamicCache(config=model.config)
    if start > 0:
        with torch.no_grad():
            model(input_ids=ids[:, :start], past_key_values=cache, use_cache=True)
    return model(input_ids=ids[:, start:], past_key_values=cache, use_cache=True).logits


def _first_learnt(mask: Tensor) -> int:
    """The first target column of ``mask`` ``[b, W - 1]`` that some row learns (the last when none does):
    where a frozen context ends."""
    learnt = mask.any(dim=0).nonzero()
    return int(learnt[0]) if len(learnt) else mask.shape[1] - 1


def _scaled(logits: Tensor, temperature: float) -> Tensor:
    """float32 ``logits / temperature``; temperature 0 (greedy) and 1 leave the logits as they are."""
    x = logits.float()
    return x if temperature in (0.0, 1.0) else x / temperature


def _scores(
    head: Tensor | None, tail: Tensor, ids: Tensor, temperature: float, entropy_mask: Tensor
) -> tuple[Tensor, Tensor]:
    """`_logits` output -> (logprobs ``[b, W - 1]``, entropies ``[b, W - 1]`` where ``entropy_mask`` (bool,
    same shape) is set, else 0), float32 in target space.

    The shared ``head`` is normalised once and broadcast: its first ``P - 1`` columns score the same tokens
    in every row, its last scores each row's own token ``ids[:, P]``. Entropies are a metric, without
    gradient, computed only where some row needs them."""
    b, prefix = ids.shape[0], 0 if head is None else head.shape[0]
    x = _scaled(tail[:, :-1], temperature)  # [b, W - P - 1, V]
    lp = x.gather(-1, ids[:, prefix + 1 :].unsqueeze(-1)).squeeze(-1) - x.logsumexp(dim=-1)
    ent = token_entropy(x.detach(), entropy_mask[:, prefix:])
    if head is None:
        return lp, ent
    xh = _scaled(head, temperature)  # [P, V]
    lse = xh.logsumexp(dim=-1)
    shared = xh[:-1].gather(-1, ids[0, 1:prefix].unsqueeze(-1)).squeeze(-1) - lse[:-1]  # [P - 1]
    last = xh[-1, ids[:, prefix]] - lse[-1]  # [b]
    lp = torch.cat([shared.expand(b, -1), last.unsqueeze(1), lp], dim=1)
    head_mask = entropy_mask[:, :prefix]
    head_ent = token_entropy(xh.detach(), head_mask.any(dim=0))  # [P]
    ent = torch.cat([torch.where(head_mask, head_ent, 0.0), ent], dim=1)
    return lp, ent


def _target_space(samples: Sequence[Sample]) -> tuple[Tensor, Tensor]:
    """(mask, behaviour) ``[B, W - 1]`` float32 in target space. Behaviour logprobs off the mask are set
    to 0, so whatever a sample stores at prompt or tool positions cannot reach the loss or the metrics."""
    cols = max(len(s.input_ids) for s in samples) - 1
    mask = torch.zeros((len(samples), cols), dtype=torch.float32)
    behaviour = torch.zeros((len(samples), cols), dtype=torch.float32)
    for row, s in enumerate(samples):
        n = len(s.input_ids) - 1
        if n > 0:
            m = torch.tensor(s.loss_mask[1:], dtype=torch.float32)
            mask[row, :n] = m
            behaviour[row, :n] = torch.tensor(s.behaviour_logprobs[1:], dtype=torch.float32) * m
    return mask, behaviour


_TOKEN_MEANS = ("clip_frac", "clip_frac_low", "clip_frac_high", "approx_kl", "ratio_mean")


@dataclass(frozen=True)
class _Batch:
    """One update's samples with their target-space tensors (``[B, W - 1]``), computed once: ``old`` is
    the PPO ratio's reference and ``is_weights`` the per-token loss weights (or None) of the off-policy
    correction (`algorithms.off_policy_correction`)."""

    samples: Sequence[Sample]
    mask: Tensor
    behaviour: Tensor
    advantages: Tensor
    sample_rollout: Tensor
    old: Tensor
    is_weights: Tensor | None


def _atomic_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _rng_state() -> dict[str, Any]:
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class TorchTrainingEngine:
    """A policy (and optional frozen reference) with AdamW, trained by PPO-style outcome-reward updates.

    ``model`` is public for inspection; after `update` its ``.grad`` holds that step's (clipped) gradient
    until the next update. ``step`` counts optimizer steps. ``seed`` seeds the process-wide torch, Python
    and NumPy RNGs, which the engine treats as its own (checkpoints save and restore them);
    ``torch.set_num_threads`` is left to the caller.
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        learning_rate: float,
        dtype: Dtype = "float32",
        seed: int = 0,
        weight_decay: float = 0.0,
        kl_reference: bool = False,
    ) -> None:
        if dtype not in get_args(Dtype):
            raise ValueError(f"dtype must be one of {get_args(Dtype)}, got {dtype!r}")
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed)
        self.model_dir = Path(model_dir)
        self.dtype: Dtype = dtype
        self.step = 0
        self.model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.eval()
        self.device = next(self.model.parameters()).device
        # The reference is the weights of model_dir as loaded, so a resumed run rebuilds it from there.
        self.reference: PreTrainedModel | None = None
        if kl_reference:
            self.reference = copy.deepcopy(self.model).requires_grad_(False).eval()
        self.learning_rate = learning_rate
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=learning_rate, weight_decay=weight_decay
        )

    def _autocast(self) -> contextlib.AbstractContextManager[None]:
        if self.dtype == "bfloat16":
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _forward(
        self,
        model: PreTrainedModel,
        ids: Tensor,
        lengths: Tensor,
        temperature: float,
        entropy_mask: Tensor | None = None,
        frozen_before: int | None = None,
    ) -> tuple[Tensor, Tensor]:
        """ids ``[b, W]`` (row lengths ``[b]``) -> (logprobs ``[b, W - 1]`` of ``ids[:, 1:]``, entropies
        ``[b, W - 1]`` where ``entropy_mask`` (``[b, W - 1]``) is nonzero, else 0), both float32, of
        ``log_softmax(logits.float() / temperature)`` at each next token, the inference engine's
        convention (temperature 0 = greedy = temperature 1). The rows' common prefix is computed once
        when that saves at least `_MIN_SHARED_TOKENS` token positions (see the module docstring).

        ``frozen_before`` (a target column): the context ``ids[:, :frozen_before]`` runs without gradient
        (`_logits_after_frozen_context`) and the columns before it are 0; the others have the same values."""
        ids = ids.to(self.device)
        if entropy_mask is None:
            entropy_mask = torch.zeros((ids.shape[0], ids.shape[1] - 1), dtype=torch.bool)
        entropy_mask = entropy_mask.to(self.device).bool()
        if frozen_before is not None:
            with self._autocast():
                tail = _logits_after_frozen_context(model, ids, frozen_before)
            lp, ent = _scores(
                None, tail, ids[:, frozen_before:], temperature, entropy_mask[:, frozen_before:]
            )
            pad = lp.new_zeros((ids.shape[0], frozen_before))
            return torch.cat([pad, lp], dim=1), torch.cat([pad, ent], dim=1)
        prefix = _common_prefix(ids, lengths)
        if (ids.shape[0] - 1) * prefix < _MIN_SHARED_TOKENS:
            prefix = 0
        with self._autocast():
            head, tail = _logits(model, ids, prefix)
        return _scores(head, tail, ids, temperature, entropy_mask)

    def _microbatches(
        self, samples: Sequence[Sample], budget: int
    ) -> Iterator[tuple[list[int], Tensor, Tensor]]:
        """(rows, ids ``[b, W]``, lengths ``[b]``) per micro-batch of ``samples`` within ``budget``."""
        for rows in pack_by_token_budget([len(s.input_ids) for s in samples], budget):
            yield rows, *_pad_ids([samples[i] for i in rows])

    @torch.no_grad()
    def logprobs(
        self, samples: Sequence[Sample], *, temperature: float, max_tokens_per_microbatch: int = 4096
    ) -> list[Tensor]:
        """Current-policy logprobs of every sample's ``input_ids[1:]`` given its prefix: one float32
        tensor ``[len(input_ids) - 1]`` per sample, in order. Compared with the behaviour logprobs this
        measures the train/inference mismatch."""
        _check_samples(samples)
        out: list[Tensor] = [torch.empty(0)] * len(samples)
        for rows, ids, lengths in self._microbatches(samples, max_tokens_per_microbatch):
            lp, _ = self._forward(self.model, ids, lengths, temperature)
            for r, i in enumerate(rows):
                out[i] = lp[r, : len(samples[i].input_ids) - 1].cpu().clone()
        return out

    def update(self, samples: Sequence[Sample], config: UpdateConfig) -> dict[str, float]:
        """``ppo_epochs * ppo_mini_batches`` optimizer steps on the batch; returns metrics (below).

        Advantages are computed once over the whole batch (groups stay whole whatever the split), and
        mini-batches hold whole rollouts, so rollout-level normalisation sees every rollout entire. Loss
        weights are computed per mini-batch; each micro-batch then adds ``sum(token_loss * weight)`` over
        its rows, so the accumulated gradient is the mini-batch loss gradient whatever the token budget.
        Samples without generated tokens still count in advantage group statistics but are not run
        forward.

        Metrics: ``loss`` = ``pg_loss + kl_coef * kl`` (``kl``: aggregated k3 KL to the reference, only
        with one) and ``grad_norm`` (before clipping), means over the optimizer steps; token means over
        every generated token of every mini-batch pass, each measured just before its step:
        ``entropy`` (of the temperature-scaled next-token distribution), ``clip_frac``
        (``_low``/``_high``), ``approx_kl`` (ratio reference vs current), ``ratio_mean``, and ``ratio_max``,
        ``logprob_mismatch`` (mean abs difference between current and behaviour logprobs: ~0 on freshly
        served weights with one step per batch, growing with policy lag and with later mini-batches).
        With ``off_policy_correction`` ``tis`` the ratio is to the weights at the update's start (their
        log-probs computed once, before the first step) and ``tis_weight_mean`` / ``tis_clip_frac`` are
        token means over the batch (see `algorithms.tis_correction`).
        ``advantage_mean`` / ``advantage_std`` are over samples with generated tokens; ``tokens``,
        ``samples``, ``microbatches``, ``optimizer_steps``, ``step`` are counts; ``lr`` is the learning
        rate of the last optimizer step (see ``lr_warmup_steps``). A batch without any
        learning signal (all advantages zero, no KL term) is measured but takes no step.

        Long because the epochs and mini-batches share the batch's tensors and the metric sums; the
        step itself is `_optimizer_step`.
        """
        if not samples:
            raise ValueError("update needs at least one sample")
        _check_samples(samples)
        if config.kl_coef > 0 and self.reference is None:
            raise ValueError("kl_coef > 0 needs an engine built with kl_reference=True")
        index = index_rollouts(samples)
        sample_rollout = torch.tensor(index.sample_rollout, dtype=torch.long)
        mask, behaviour = _target_space(samples)
        total_tokens = int(mask.sum().item())
        if total_tokens == 0:
            raise ValueError("the batch has no generated tokens to train on")
        advantages = token_advantages(
            torch.tensor(index.rewards, dtype=torch.float32),
            torch.tensor(index.group_index, dtype=torch.long),
            sample_rollout,
            mask,
            level=config.advantage_level,
            estimator=config.advantage_estimator,
            norm_by_std=config.normalize_by_std,
        )
        active = [i for i in range(len(samples)) if mask[i].any()]
        per_sample_adv = advantages[active].sum(dim=1) / mask[active].sum(dim=1)
        correction = off_policy_correction(
            behaviour,
            lambda: self._old_logprobs(samples, active, mask, config),
            mask,
            config.off_policy_correction,
            tis_cap=config.tis_cap,
        )
        batch = _Batch(
            samples,
            mask,
            behaviour,
            advantages,
            sample_rollout,
            old=correction.old_logprobs,
            is_weights=correction.is_weights,
        )

        sums = dict.fromkeys(
            ("pg_loss", "kl", "grad_norm", "entropy", "logprob_mismatch", *_TOKEN_MEANS), 0.0
        )
        ratio_max, n_micro, n_steps, scored = 0.0, 0, 0, 0.0
        shuffle = torch.Generator().manual_seed(self.step)
        # No advantage anywhere (every group's rewards equal) and no KL term: the loss gradient is zero, but
        # an AdamW step would still move the weights along its momentum, so the batch is only measured.
        learn = config.kl_coef > 0 or bool(advantages.abs().max() > 0)
        passes = (
            [
                split_by_rollout(active, index.sample_rollout, config.ppo_mini_batches, shuffle)
                for _ in range(config.ppo_epochs)
            ]
            if learn
            else [[active]]
        )
        for mini_batches in passes:
            for rows in mini_batches:
                step = self._optimizer_step(batch, rows, config, apply=learn)
                for key in sums:
                    sums[key] += step.pop(key)
                ratio_max = max(ratio_max, step["ratio_max"])
                n_micro += int(step["microbatches"])
                scored += step["tokens"]
                n_steps += 1
        n_steps_taken = n_steps if learn else 0

        metrics = {
            "loss": (sums["pg_loss"] + config.kl_coef * sums["kl"]) / n_steps,
            "pg_loss": sums["pg_loss"] / n_steps,
            "grad_norm": sums["grad_norm"] / n_steps,
            "ratio_max": ratio_max,
            "advantage_mean": float(per_sample_adv.mean()),
            "advantage_std": float(per_sample_adv.std(unbiased=False)),
            "tokens": float(total_tokens),
            "samples": float(len(samples)),
            "microbatches": float(n_micro),
            "optimizer_steps": float(n_steps_taken),
            "step": float(self.step),
            "lr": self.lr_at(max(self.step - 1, 0), config),
            **correction.metrics,
        }
        for key in ("entropy", "logprob_mismatch", *_TOKEN_MEANS):
            metrics[key] = sums[key] / scored
        if self.reference is not None:
            metrics["kl"] = sums["kl"] / n_steps
        return metrics

    def _old_logprobs(
        self, samples: Sequence[Sample], rows: list[int], mask: Tensor, config: UpdateConfig
    ) -> Tensor:
        """The current policy's logprobs ``[B, W - 1]`` in target space (0 off ``mask``), of the samples
        ``rows`` (the others, without generated tokens, are not run), without gradient."""
        old = torch.zeros_like(mask)
        lps = self.logprobs(
            [samples[i] for i in rows],
            temperature=config.temperature,
            max_tokens_per_microbatch=config.max_tokens_per_microbatch,
        )
        for i, lp in zip(rows, lps, strict=True):
            old[i, : lp.shape[0]] = lp
        return old * mask

    def _optimizer_step(
        self, batch: _Batch, rows: list[int], config: UpdateConfig, *, apply: bool = True
    ) -> dict[str, float]:
        """One AdamW step on the samples ``rows`` of ``batch`` (gradient accumulated over micro-batches by
        token budget); returns the step's loss terms and token *sums* of the token-mean metrics.
        ``apply=False`` only measures: forward passes without gradients, no step.

        Long because the micro-batch loop accumulates the loss terms and the metric sums together;
        split, every part would carry the same running totals."""
        sel = torch.tensor(rows, dtype=torch.long)
        weights = torch.zeros_like(batch.mask, dtype=torch.float32)
        weights[sel] = loss_weights(batch.mask[sel], config.loss_normalization, batch.sample_rollout[sel])
        sums = dict.fromkeys(("pg_loss", "kl", "entropy", "logprob_mismatch", *_TOKEN_MEANS), 0.0)
        ratio_max, n_micro, n_scored = 0.0, 0, 0.0

        self.optimizer.zero_grad(set_to_none=True)
        for local_rows, ids, lengths in self._microbatches(
            [batch.samples[i] for i in rows], config.max_tokens_per_microbatch
        ):
            idx = torch.tensor([rows[r] for r in local_rows], dtype=torch.long)
            cols = ids.shape[1] - 1
            m, beh, old, adv, w = (
                t[idx, :cols].to(self.device)
                for t in (batch.mask, batch.behaviour, batch.old, batch.advantages, weights)
            )
            is_w = None if batch.is_weights is None else batch.is_weights[idx, :cols].to(self.device)
            n_tok = float(m.sum().item())
            frozen = None if config.context_gradient else _first_learnt(m)
            with torch.set_grad_enabled(apply):
                lp, entropy = self._forward(
                    self.model, ids, lengths, config.temperature, m.bool(), frozen_before=frozen
                )
            pg, pg_metrics = clipped_policy_loss(
                lp,
                old,
                adv,
                m,
                clip_low=config.clip_ratio_low,
                clip_high=config.clip_ratio_high,
                weights=w,
                is_weights=is_w,
            )
            loss = pg
            if self.reference is not None:
                with torch.no_grad():
                    ref_lp, _ = self._forward(self.reference, ids, lengths, config.temperature)
                kl = aggregate_loss(kl_penalty(lp, ref_lp, KL_ESTIMATOR), m, weights=w)
                if config.kl_coef > 0:
                    loss = loss + config.kl_coef * kl
                sums["kl"] += float(kl.detach())
            if apply:
                loss.backward()

            with torch.no_grad():
                sums["pg_loss"] += float(pg.detach())
                sums["entropy"] += float(entropy.sum())
                sums["logprob_mismatch"] += float(((lp.detach() - beh).abs() * m).sum())
                for key in _TOKEN_MEANS:
                    sums[key] += pg_metrics[key] * n_tok
                ratio_max = max(ratio_max, pg_metrics["ratio_max"])
            n_micro += 1
            n_scored += n_tok

        if not apply:
            return {
                **sums,
                "grad_norm": 0.0,
                "ratio_max": ratio_max,
                "microbatches": float(n_micro),
                "tokens": n_scored,
            }
        params = [p for p in self.model.parameters() if p.grad is not None]
        if config.grad_clip is not None:
            grad_norm = torch.nn.utils.clip_grad_norm_(params, config.grad_clip)
        else:
            grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        lr = self.lr_at(self.step, config)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.step += 1
        return {
            **sums,
            "grad_norm": float(grad_norm),
            "ratio_max": ratio_max,
            "microbatches": float(n_micro),
            "tokens": n_scored,
        }

    def sft_step(
        self,
        samples: Sequence[Sample],
        *,
        learning_rate: float,
        max_tokens_per_microbatch: int = 4096,
        grad_clip: float | None = 1.0,
        context_gradient: bool = True,
    ) -> dict[str, float]:
        """One supervised AdamW step on ``samples``: the token mean over every ``loss_mask`` token of
        ``-log p(token | prefix)`` (temperature 1), the gradient accumulated over micro-batches by token
        budget with the shared prefix of a micro-batch's rows computed once, as in `update`. What
        `inharness sft` trains a recorded warm-up with. Returns ``loss`` (before the step), ``tokens``,
        ``grad_norm`` (before clipping) and ``microbatches``.

        ``context_gradient=False`` runs each micro-batch's context up to its first learnt token without
        gradient (`_logits_after_frozen_context`): the same loss, a gradient through the learnt turns
        and what follows them only. A harness's prompt is most of a sample (mini-SWE-agent: 1.8k of 1.9k
        tokens), so a step costs about a forward pass of the prompt instead of a forward and backward."""
        if not samples:
            raise ValueError("sft_step needs at least one sample")
        _check_samples(samples)
        mask, _ = _target_space(samples)
        total = float(mask.sum().item())
        if total == 0:
            raise ValueError("the samples have no tokens to train on (every loss_mask is 0)")
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum, n_micro = 0.0, 0
        for rows, ids, lengths in self._microbatches(samples, max_tokens_per_microbatch):
            m = mask[torch.tensor(rows, dtype=torch.long), : ids.shape[1] - 1].to(self.device)
            frozen = None if context_gradient else _first_learnt(m)
            lp, _ = self._forward(self.model, ids, lengths, 1.0, frozen_before=frozen)
            loss = -(lp * m).sum() / total
            loss.backward()
            loss_sum += float(loss.detach())
            n_micro += 1
        params = [p for p in self.model.parameters() if p.grad is not None]
        if grad_clip is not None:
            grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
        else:
            grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate
        self.optimizer.step()
        self.step += 1
        return {
            "loss": loss_sum,
            "tokens": total,
            "grad_norm": float(grad_norm),
            "microbatches": float(n_micro),
        }

    def lr_at(self, step: int, config: UpdateConfig) -> float:
        """The learning rate of optimizer step ``step`` (0-based): a function of the step counter alone,
        so a resumed run continues the warm-up where the checkpoint left it."""
        if config.lr_warmup_steps == 0:
            return self.learning_rate
        return self.learning_rate * min(1.0, (step + 1) / config.lr_warmup_steps)

    def save_pretrained(self, out_dir: str | Path) -> Path:
        """Write the current policy as a Hugging Face model directory (float32 weights, config,
        generation config, tokenizer of ``model_dir``) that the inference engine loads with
        ``from_pretrained``."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(out)
        AutoTokenizer.from_pretrained(self.model_dir).save_pretrained(out)
        return out

    def save_checkpoint(self, ckpt_dir: str | Path) -> Path:
        """Save what a resumed run needs to continue identically: policy weights, AdamW state, RNG states
        and the step counter (the reference model is rebuilt from ``model_dir``). Each file is replaced
        atomically and the state file goes last, so an interrupted save is detected on load."""
        d = Path(ckpt_dir)
        d.mkdir(parents=True, exist_ok=True)
        (d / _STATE_FILE).unlink(missing_ok=True)
        _atomic_save(self.model.state_dict(), d / "model.pt")
        _atomic_save(self.optimizer.state_dict(), d / "optimizer.pt")
        _atomic_save(_rng_state(), d / "rng.pt")
        state = {"format": _CHECKPOINT_FORMAT, "step": self.step, "dtype": self.dtype}
        tmp = d / (_STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(state, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, d / _STATE_FILE)
        return d

    def load_checkpoint(self, ckpt_dir: str | Path) -> None:
        """Restore a `save_checkpoint` directory into this engine (built from the same ``model_dir``)."""
        d = Path(ckpt_dir)
        if not (d / _STATE_FILE).is_file():
            raise FileNotFoundError(f"{d} is not a complete checkpoint (no {_STATE_FILE})")
        state = json.loads((d / _STATE_FILE).read_text(encoding="utf-8"))
        if state.get("format") != _CHECKPOINT_FORMAT:
            raise ValueError(f"unsupported checkpoint format {state.get('format')!r}")
        self.model.load_state_dict(torch.load(d / "model.pt", map_location=self.device, weights_only=True))
        self.optimizer.load_state_dict(
            torch.load(d / "optimizer.pt", map_location=self.device, weights_only=True)
        )
        _set_rng_state(torch.load(d / "rng.pt", weights_only=True))
        self.step = int(state["step"])
