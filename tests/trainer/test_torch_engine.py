"""CPU training engine: on-policy start, the sign of the update, exact gradient accumulation, masking,
checkpoint/resume, export, KL to the reference."""

from __future__ import annotations

import copy
import math
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from inharness.engine.sampling import SamplingParams, generate
from inharness.engine.tiny import init_tiny
from inharness.trainer import torch_engine
from inharness.trainer.algorithms import split_by_rollout
from inharness.trainer.samples import Sample
from inharness.trainer.torch_engine import (
    TorchTrainingEngine,
    UpdateConfig,
    _common_prefix,
    pack_by_token_budget,
)

VOCAB = 3000  # below the tiny tokenizer's special and markup ids


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    """The tiny model gains nothing from intra-op threads, and two threads on a shared 2-core machine
    spin against other processes and run ~10x slower; restored afterwards for other modules."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_tiny(tmp_path_factory.mktemp("torch_engine") / "base", seed=0)


def _sample(
    rollout: str, group: str, reward: float, parts: list[tuple[int, bool]], rng: random.Random
) -> Sample:
    """Random tokens in spans of (length, generated); the first span must be prompt."""
    ids: list[int] = []
    mask: list[int] = []
    for length, generated in parts:
        ids.extend(rng.randrange(VOCAB) for _ in range(length))
        mask.extend([int(generated)] * length)
    return Sample(
        rollout_id=rollout,
        group_id=group,
        call_ids=[0],
        input_ids=ids,
        loss_mask=mask,
        behaviour_logprobs=[0.0] * len(ids),
        model_versions=[0],
        reward=reward,
        num_prompt_tokens=parts[0][0],
    )


def _with_behaviour(engine: TorchTrainingEngine, samples: list[Sample], temperature: float) -> list[Sample]:
    """Copies of ``samples`` whose behaviour logprobs are the engine's current ones (0 off the mask, as
    the adapter stores them), i.e. as if just sampled from the served weights."""
    out = copy.deepcopy(samples)
    for s, lp in zip(out, engine.logprobs(out, temperature=temperature), strict=True):
        s.behaviour_logprobs = [0.0] + [
            v if m else 0.0 for v, m in zip(lp.tolist(), s.loss_mask[1:], strict=True)
        ]
    return out


@pytest.fixture(scope="module")
def raw_samples() -> list[Sample]:
    """2 groups x 2 rollouts; rollout b0 was split into 2 samples, one of them multi-turn (a tool result
    between two generated spans)."""
    rng = random.Random(0)
    return [
        _sample("a0", "ga", 1.0, [(12, False), (20, True)], rng),
        _sample("a1", "ga", 0.0, [(12, False), (26, True)], rng),
        _sample("b0", "gb", 1.0, [(9, False), (10, True), (6, False), (14, True)], rng),
        _sample("b0", "gb", 1.0, [(30, False), (9, True)], rng),
        _sample("b1", "gb", 0.0, [(9, False), (18, True)], rng),
    ]


@pytest.fixture(scope="module")
def samples(model_dir: Path, raw_samples: list[Sample]) -> list[Sample]:
    return _with_behaviour(TorchTrainingEngine(model_dir, learning_rate=0.0), raw_samples, 1.0)


def _grads(engine: TorchTrainingEngine) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in engine.model.named_parameters() if p.grad is not None}


def _params(engine: TorchTrainingEngine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.model.named_parameters()}


def _mean_generated_logprob(engine: TorchTrainingEngine, s: Sample) -> float:
    (lp,) = engine.logprobs([s], temperature=1.0)
    m = torch.tensor(s.loss_mask[1:], dtype=torch.bool)
    return float(lp[m].mean())


def test_pack_by_token_budget_bounds_padded_size() -> None:
    lengths = [5, 30, 10, 40, 70]
    batches = pack_by_token_budget(lengths, 64)
    assert batches == [[4], [3], [1, 2], [0]]
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    assert pack_by_token_budget(lengths, 10_000) == [[4, 3, 1, 2, 0]]


def test_logprobs_match_the_inference_engines_sampling_logprobs(model_dir: Path) -> None:
    """The quantity trained on is the one the engine reports: log_softmax(logits / T) at each token."""
    engine = TorchTrainingEngine(model_dir, learning_rate=0.0)
    rng = random.Random(1)
    for temperature, n_prompt in ((0.7, 15), (0.0, 40)):
        prompt = [rng.randrange(VOCAB) for _ in range(n_prompt)]
        params = SamplingParams(max_tokens=12, temperature=temperature, seed=3, n=2)
        completions = generate(engine.model, prompt, params)
        batch = [
            Sample("r", "g", [0], prompt + c.token_ids, [0] * n_prompt + [1] * len(c.token_ids),
                   [0.0] * n_prompt + c.logprobs, [0], 1.0, n_prompt)
            for c in completions
        ]  # fmt: skip
        for s, lp in zip(batch, engine.logprobs(batch, temperature=temperature), strict=True):
            assert lp.dtype == torch.float32 and lp.shape == (len(s.input_ids) - 1,)
            torch.testing.assert_close(lp[n_prompt - 1 :], torch.tensor(s.behaviour_logprobs[n_prompt:]))


def test_right_padding_does_not_change_logprobs(model_dir: Path, raw_samples: list[Sample]) -> None:
    """Batches are right-padded without an attention mask; each row must score as if alone."""
    engine = TorchTrainingEngine(model_dir, learning_rate=0.0)
    batched = engine.logprobs(raw_samples, temperature=0.7)
    for s, lp in zip(raw_samples, batched, strict=True):
        (alone,) = engine.logprobs([s], temperature=0.7)
        torch.testing.assert_close(lp, alone, rtol=0, atol=1e-5)


def test_first_update_is_on_policy(model_dir: Path, samples: list[Sample]) -> None:
    engine = TorchTrainingEngine(model_dir, learning_rate=1e-3)
    m = engine.update(samples, UpdateConfig())
    assert m["logprob_mismatch"] < 1e-5
    assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert m["approx_kl"] == pytest.approx(0.0, abs=1e-6)
    assert m["clip_frac"] == 0.0
    assert m["tokens"] == sum(s.num_generated_tokens for s in samples)
    assert m["samples"] == len(samples) and m["microbatches"] == 1 and m["step"] == 1 == engine.step
    assert m["loss"] == m["pg_loss"] and "kl" not in m
    assert 0 < m["entropy"] <= math.log(engine.model.config.vocab_size) + 1e-4
    assert m["advantage_std"] > 0 and m["grad_norm"] > 0
    assert all(math.isfinite(v) for v in m.values())
    # The step changed the policy, so the same samples now lag behind it.
    assert engine.update(samples, UpdateConfig())["logprob_mismatch"] > 1e-4
    # Training logprobs use the sampling temperature, so samples drawn at 0.7 are on-policy at 0.7 too.
    hot = _with_behaviour(engine, samples, 0.7)
    assert engine.update(hot, UpdateConfig(temperature=0.7))["logprob_mismatch"] < 1e-5


def test_updates_raise_positive_and_lower_negative_advantage_samples(
    model_dir: Path, raw_samples: list[Sample]
) -> None:
    engine = TorchTrainingEngine(model_dir, learning_rate=1e-3)
    before = [_mean_generated_logprob(engine, s) for s in raw_samples]
    for _ in range(3):
        engine.update(_with_behaviour(engine, raw_samples, 1.0), UpdateConfig())
    after = [_mean_generated_logprob(engine, s) for s in raw_samples]
    for s, b, a in zip(raw_samples, before, after, strict=True):
        assert (a > b + 1e-3) if s.reward == 1.0 else (a < b - 1e-3), (s.rollout_id, b, a)


@pytest.mark.parametrize(
    ("normalization", "level", "estimator"),
    [("token", "rollout", "grpo"), ("sample", "sample", "rloo"), ("rollout", "rollout", "grpo")],
)
def test_token_budget_accumulation_equals_full_batch_gradient(
    model_dir: Path, samples: list[Sample], normalization: str, level: str, estimator: str
) -> None:
    engine = TorchTrainingEngine(model_dir, learning_rate=0.0, kl_reference=True)
    # Off-policy behaviour logprobs, so ratios differ from 1 and some tokens clip.
    shifted = copy.deepcopy(samples)
    rng = random.Random(2)
    for s in shifted:
        s.behaviour_logprobs = [
            v + rng.uniform(-0.3, 0.3) if m else 0.0
            for v, m in zip(s.behaviour_logprobs, s.loss_mask, strict=True)
        ]

    def run(budget: int) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
        config = UpdateConfig(
            advantage_estimator=estimator,
            advantage_level=level,
            loss_normalization=normalization,
            kl_coef=0.1,
            max_tokens_per_microbatch=budget,
            grad_clip=None,
        )
        return engine.update(shifted, config), _grads(engine)

    full_metrics, full = run(100_000)
    micro_metrics, micro = run(64)
    assert full_metrics["microbatches"] == 1 and micro_metrics["microbatches"] == 4
    assert full_metrics["clip_frac"] > 0
    assert full.keys() == micro.keys()
    for name in full:
        torch.testing.assert_close(micro[name], full[name], rtol=0, atol=1e-5, msg=name)
    for key in ("loss", "pg_loss", "kl", "entropy", "clip_frac", "approx_kl", "ratio_mean", "grad_norm"):
        assert micro_metrics[key] == pytest.approx(full_metrics[key], rel=1e-5, abs=1e-7), key


def test_mini_batches_hold_whole_rollouts_dealt_evenly() -> None:
    sample_rollout = [0, 1, 1, 2, 3, 3, 3, 4]
    split = split_by_rollout(list(range(8)), sample_rollout, 2, torch.Generator().manual_seed(0))
    assert sorted(i for part in split for i in part) == list(range(8))
    assert all(part == sorted(part) for part in split)
    rollouts = [{sample_rollout[i] for i in part} for part in split]
    assert rollouts[0].isdisjoint(rollouts[1]) and sorted(map(len, rollouts)) == [2, 3]
    # More parts than rollouts: one rollout each, no empty mini-batch.
    assert len(split_by_rollout([0, 1, 2], [0, 0, 1], 5, torch.Generator())) == 2


def test_ppo_epochs_and_mini_batches_take_several_clipped_steps(
    model_dir: Path, samples: list[Sample]
) -> None:
    engine = TorchTrainingEngine(model_dir, learning_rate=3e-3)
    m = engine.update(samples, UpdateConfig(ppo_mini_batches=2, ppo_epochs=2))
    assert m["optimizer_steps"] == 4 == engine.step == m["step"]
    assert m["tokens"] == sum(s.num_generated_tokens for s in samples)
    # The first step is on fresh weights; the later ones see a moved policy, which is what the clip bounds.
    assert m["logprob_mismatch"] > 1e-4 and m["ratio_max"] > 1.0
    assert all(math.isfinite(v) for v in m.values())
    # The same direction as single-step updates: rewarded samples gain probability.
    before = TorchTrainingEngine(model_dir, learning_rate=0.0)
    for s in samples:
        delta = _mean_generated_logprob(engine, s) - _mean_generated_logprob(before, s)
        assert delta > 0 if s.reward == 1.0 else delta < 0, (s.rollout_id, delta)


TIS = UpdateConfig(off_policy_correction="tis", tis_cap=2.0)


def test_tis_on_policy_is_bypass_exactly(model_dir: Path, samples: list[Sample]) -> None:
    """Behaviour log-probs that are the current policy's: θ_old is the behaviour, every weight is 1,
    and four steps (two mini-batches, two epochs) move the weights exactly as bypass mode does. θ_old
    costs one forward pass per update, before the first step."""
    steps = {"ppo_mini_batches": 2, "ppo_epochs": 2, "kl_coef": 0.0}
    runs = {}
    for mode in ("bypass", "tis"):
        engine = TorchTrainingEngine(model_dir, learning_rate=3e-3)
        calls = _model_calls(engine)
        config = UpdateConfig(off_policy_correction=mode, **steps)  # type: ignore[arg-type]
        runs[mode] = (engine.update(samples, config), _params(engine), len(calls))
    (bypass, bypass_params, bypass_calls), (tis, tis_params, tis_calls) = runs["bypass"], runs["tis"]
    assert tis.pop("tis_weight_mean") == 1.0 and tis.pop("tis_clip_frac") == 0.0
    assert tis == bypass and "tis_weight_mean" not in bypass
    assert all(torch.equal(tis_params[n], bypass_params[n]) for n in bypass_params)
    assert (bypass_calls, tis_calls) == (4, 5)


def test_tis_weighs_tokens_by_the_truncated_ratio_to_the_behaviour(
    model_dir: Path, samples: list[Sample]
) -> None:
    """Behaviour log-probs below the policy's by a known Δ per token: the weights are min(exp(Δ), cap),
    and the PPO ratio is to the trainer's own log-probs, so one step on fresh weights clips nothing."""
    shifted = copy.deepcopy(samples)
    deltas = (-0.5, 0.2, 1.0)  # exp: 0.607, 1.221, 2.718 (truncated to 2)
    ratios: list[float] = []  # exp(Δ) per generated token
    for s in shifted:
        k = 0
        for i, m in enumerate(s.loss_mask):
            if m:
                s.behaviour_logprobs[i] -= deltas[k % 3]
                ratios.append(math.exp(deltas[k % 3]))
                k += 1
    expected = [min(r, TIS.tis_cap) for r in ratios]
    engine = TorchTrainingEngine(model_dir, learning_rate=1e-3)
    m = engine.update(shifted, TIS)
    assert m["tis_weight_mean"] == pytest.approx(sum(expected) / len(expected), rel=1e-4)
    assert m["tis_clip_frac"] == pytest.approx(expected.count(2.0) / len(expected))
    assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-5) and m["clip_frac"] == 0.0
    assert m["logprob_mismatch"] == pytest.approx(sum(abs(math.log(r)) for r in ratios) / len(ratios))
    # Bypass takes the ratio to the behaviour instead: exp(Δ), some of it clipped.
    bypass = TorchTrainingEngine(model_dir, learning_rate=1e-3).update(shifted, UpdateConfig())
    assert bypass["ratio_mean"] == pytest.approx(sum(ratios) / len(ratios), rel=1e-4)
    assert bypass["clip_frac"] > 0 and "tis_weight_mean" not in bypass


def test_lr_warmup_ramps_the_rate_by_optimizer_step_and_survives_resume(
    model_dir: Path, samples: list[Sample], tmp_path: Path
) -> None:
    config = UpdateConfig(ppo_mini_batches=2, lr_warmup_steps=4)
    engine = TorchTrainingEngine(model_dir, learning_rate=1e-3)
    assert engine.update(samples, config)["lr"] == pytest.approx(2e-3 / 4)  # steps 1 and 2 of 4
    assert engine.optimizer.param_groups[0]["lr"] == pytest.approx(2e-3 / 4)
    engine.save_checkpoint(tmp_path / "ckpt")
    resumed = TorchTrainingEngine(model_dir, learning_rate=1e-3)
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert resumed.update(samples, config)["lr"] == pytest.approx(1e-3)  # step 4 of 4
    assert resumed.update(samples, config)["lr"] == pytest.approx(1e-3)  # and no further
    # AdamW's first step moves weights by about the learning rate whatever the gradient: a tenth of it.
    ramped, full = (TorchTrainingEngine(model_dir, learning_rate=1e-3) for _ in range(2))
    before = _params(ramped)
    ramped.update(samples, UpdateConfig(lr_warmup_steps=10))
    full.update(samples, UpdateConfig())

    def largest_move(engine: TorchTrainingEngine) -> float:
        return max(float((p - before[n]).abs().max()) for n, p in _params(engine).items())

    assert largest_move(ramped) == pytest.approx(largest_move(full) / 10, rel=0.05)


def test_batch_without_learning_signal_takes_no_step(model_dir: Path, samples: list[Sample]) -> None:
    engine = TorchTrainingEngine(model_dir, learning_rate=1e-3)
    engine.update(samples, UpdateConfig())  # AdamW now has momentum that a zero-gradient step would apply
    before = _params(engine)
    flat = copy.deepcopy(samples)
    for s in flat:
        s.reward = 1.0
    m = engine.update(_with_behaviour(engine, flat, 1.0), UpdateConfig(ppo_mini_batches=2))
    assert m["optimizer_steps"] == 0 and m["grad_norm"] == 0 and engine.step == 1
    assert m["tokens"] == sum(s.num_generated_tokens for s in samples) and m["entropy"] > 0
    after = _params(engine)
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_masked_tokens_have_no_influence(model_dir: Path, samples: list[Sample]) -> None:
    engine = TorchTrainingEngine(model_dir, learning_rate=0.0)
    config = UpdateConfig(grad_clip=None)
    metrics, grads = engine.update(samples, config), _grads(engine)
    changed = copy.deepcopy(samples)
    for s in changed:
        s.behaviour_logprobs = [
            v if m else -50.0 for v, m in zip(s.behaviour_logprobs, s.loss_mask, strict=True)
        ]
    again = engine.update(changed, config)
    assert {k: v for k, v in again.items() if k != "step"} == {
        k: v for k, v in metrics.items() if k != "step"
    }
    for name, g in _grads(engine).items():
        assert torch.equal(g, grads[name]), name


def test_samples_without_generated_tokens_are_skipped(model_dir: Path, samples: list[Sample]) -> None:
    """A prompt-only sample of an existing rollout changes neither advantages nor weights, so nothing."""
    engine = TorchTrainingEngine(model_dir, learning_rate=0.0)
    config = UpdateConfig(grad_clip=None)
    metrics, grads = engine.update(samples, config), _grads(engine)
    prompt_only = copy.deepcopy(samples[0])
    prompt_only.loss_mask = [0] * len(prompt_only.input_ids)
    again = engine.update([*samples, prompt_only], config)
    assert again["samples"] == len(samples) + 1 and again["tokens"] == metrics["tokens"]
    assert again["pg_loss"] == metrics["pg_loss"] and again["microbatches"] == metrics["microbatches"]
    for name, g in _grads(engine).items():
        assert torch.equal(g, grads[name]), name


def test_checkpoint_resume_continues_identically(
    model_dir: Path, samples: list[Sample], tmp_path: Path
) -> None:
    config = UpdateConfig(kl_coef=0.05)
    first = TorchTrainingEngine(model_dir, learning_rate=1e-3, weight_decay=0.01, kl_reference=True)
    first.update(samples, config)
    first.save_checkpoint(tmp_path / "ckpt")
    rng_at_save = torch.get_rng_state()
    expected_metrics = first.update(samples, config)

    torch.manual_seed(123)
    resumed = TorchTrainingEngine(model_dir, learning_rate=1e-3, weight_decay=0.01, kl_reference=True, seed=5)
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert resumed.step == 1 and torch.equal(torch.get_rng_state(), rng_at_save)
    metrics = resumed.update(samples, config)
    assert metrics == pytest.approx(expected_metrics, rel=1e-6, abs=1e-6)
    expected = _params(first)
    for name, p in _params(resumed).items():
        torch.testing.assert_close(p, expected[name], rtol=0, atol=1e-6, msg=name)


def test_incomplete_checkpoint_is_refused(model_dir: Path, tmp_path: Path) -> None:
    engine = TorchTrainingEngine(model_dir, learning_rate=1e-3)
    engine.save_checkpoint(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "trainer_state.json").unlink()
    with pytest.raises(FileNotFoundError):
        engine.load_checkpoint(tmp_path / "ckpt")


def test_save_pretrained_loads_with_same_logits(
    model_dir: Path, samples: list[Sample], tmp_path: Path
) -> None:
    engine = TorchTrainingEngine(model_dir, learning_rate=1e-3)
    engine.update(samples, UpdateConfig())
    out = engine.save_pretrained(tmp_path / "export")
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([samples[0].input_ids])
    with torch.no_grad():
        got, want, old = (m(input_ids=ids).logits for m in (loaded, engine.model, base))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert not torch.allclose(got, old, atol=1e-4)
    assert AutoTokenizer.from_pretrained(out).encode("hello world") == AutoTokenizer.from_pretrained(
        model_dir
    ).encode("hello world")
    assert (
        GenerationConfig.from_pretrained(out).eos_token_id
        == GenerationConfig.from_pretrained(model_dir).eos_token_id
    )


def test_kl_to_reference_starts_at_zero_and_grows(model_dir: Path, raw_samples: list[Sample]) -> None:
    engine = TorchTrainingEngine(model_dir, learning_rate=1e-3, kl_reference=True)
    config = UpdateConfig(kl_coef=0.5)
    kls = []
    for _ in range(3):
        m = engine.update(_with_behaviour(engine, raw_samples, 1.0), config)
        assert m["kl"] >= 0 and m["loss"] == pytest.approx(m["pg_loss"] + 0.5 * m["kl"], abs=1e-7)
        assert m["logprob_mismatch"] < 1e-5
        kls.append(m["kl"])
    assert kls[0] == pytest.approx(0.0, abs=1e-7)
    assert kls[2] > kls[1] > 1e-6


def test_bfloat16_update_runs_with_float32_master_weights(model_dir: Path, samples: list[Sample]) -> None:
    engine = TorchTrainingEngine(model_dir, learning_rate=1e-3, dtype="bfloat16")
    m = engine.update(samples, UpdateConfig())
    assert all(math.isfinite(v) for v in m.values())
    assert m["logprob_mismatch"] < 0.1  # bf16 forward vs the fp32 behaviour logprobs
    assert all(p.dtype == torch.float32 for p in engine.model.parameters())


def test_invalid_inputs_are_rejected(model_dir: Path, samples: list[Sample]) -> None:
    engine = TorchTrainingEngine(model_dir, learning_rate=1e-3)
    with pytest.raises(ValueError, match="kl_reference"):
        engine.update(samples, UpdateConfig(kl_coef=0.1))
    bad = copy.deepcopy(samples[:1])
    bad[0].loss_mask[0] = 1
    with pytest.raises(ValueError, match="position 0"):
        engine.update(bad, UpdateConfig())
    prompt_only = copy.deepcopy(samples[:1])
    prompt_only[0].loss_mask = [0] * len(prompt_only[0].input_ids)
    with pytest.raises(ValueError, match="no generated tokens"):
        engine.update(prompt_only, UpdateConfig())
    with pytest.raises(ValueError, match="loss_normalization"):
        UpdateConfig(loss_normalization="batch")
    with pytest.raises(ValueError, match="ppo_mini_batches and ppo_epochs"):
        UpdateConfig(ppo_mini_batches=0)
    with pytest.raises(ValueError, match="lr_warmup_steps"):
        UpdateConfig(lr_warmup_steps=-1)
    assert engine.step == 0


def _model_calls(engine: TorchTrainingEngine) -> list[tuple[int, ...]]:
    """The input_ids shape of every policy forward call from now on."""
    calls: list[tuple[int, ...]] = []
    engine.model.register_forward_pre_hook(
        lambda _m, _a, kwargs: calls.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    return calls


def _prefixed_samples(prefix_len: int, rng: random.Random) -> list[Sample]:
    """2 groups x 2 rollouts behind one common prompt of ``prefix_len`` tokens, as agent samples (system
    prompt + tool schema) are; suffix lengths differ (right padding), one sample is multi-turn, and one
    generated span starts right after the prefix."""
    prefix = [rng.randrange(VOCAB) for _ in range(prefix_len)]
    out = []
    for rollout, group, reward, parts in (
        ("a0", "ga", 1.0, [(3, False), (20, True)]),
        ("a1", "ga", 0.0, [(1, False), (31, True)]),
        ("b0", "gb", 1.0, [(4, False), (8, True), (6, False), (12, True)]),
        ("b1", "gb", 0.0, [(0, False), (9, True)]),
    ):
        s = _sample(rollout, group, reward, [(prefix_len, False), *parts], rng)
        s.input_ids[:prefix_len] = prefix
        out.append(s)
    return out


def test_common_prefix_respects_row_lengths() -> None:
    ids = torch.tensor([[5, 6, 7, 0, 0], [5, 6, 7, 0, 9], [5, 6, 7, 0, 9]])
    # Row 0's padding equals row 1's real token 0: the prefix stops before row 0's last real token.
    assert _common_prefix(ids, torch.tensor([3, 5, 5])) == 2
    assert _common_prefix(ids[1:], torch.tensor([5, 5])) == 4
    assert _common_prefix(ids, torch.tensor([5, 5, 5])) == 4
    assert _common_prefix(torch.tensor([[1, 2], [3, 2]]), torch.tensor([2, 2])) == 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_shared_prefix_logprobs_equal_plain_ones(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, dtype: str
) -> None:
    rng = random.Random(3)
    rows = _prefixed_samples(120, rng)
    just_after = copy.deepcopy(rows[0])  # the prefix and one token
    just_after.input_ids, just_after.loss_mask = rows[0].input_ids[:121], rows[0].loss_mask[:121]
    just_after.behaviour_logprobs = rows[0].behaviour_logprobs[:121]
    rows.append(just_after)
    engine = TorchTrainingEngine(model_dir, learning_rate=0.0, dtype=dtype)  # type: ignore[arg-type]
    calls = _model_calls(engine)
    shared = engine.logprobs(rows, temperature=0.7)
    assert calls == [(1, 120), (5, max(len(s.input_ids) for s in rows) - 120)]
    monkeypatch.setattr(torch_engine, "_MIN_SHARED_TOKENS", 10**9)
    plain = engine.logprobs(rows, temperature=0.7)
    assert len(calls) == 3
    for a, b in zip(shared, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5 if dtype == "float32" else 0.02)


def test_shared_prefix_below_threshold_takes_plain_path(model_dir: Path) -> None:
    """(b - 1) * P saved positions must reach the threshold: 2 rows sharing 60 tokens do not, 4 do."""
    rows = _prefixed_samples(60, random.Random(4))
    engine = TorchTrainingEngine(model_dir, learning_rate=0.0)
    calls = _model_calls(engine)
    engine.logprobs(rows[:2], temperature=1.0)
    assert calls == [(2, 92)]
    calls.clear()
    engine.logprobs(rows, temperature=1.0)
    assert calls == [(1, 60), (4, 32)]


@pytest.mark.parametrize("normalization", ["token", "sample", "rollout"])
def test_shared_prefix_gradient_equals_plain_gradient(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, normalization: str
) -> None:
    """One step's gradient, loss terms and metrics, with a KL term (reference model through the same path)
    and off-policy behaviour so that some tokens clip."""
    rows = _prefixed_samples(120, random.Random(5))
    engine = TorchTrainingEngine(model_dir, learning_rate=0.0, kl_reference=True)
    rows = _with_behaviour(engine, rows, 1.0)
    rng = random.Random(6)
    for s in rows:
        s.behaviour_logprobs = [
            v + rng.uniform(-0.3, 0.3) if m else 0.0
            for v, m in zip(s.behaviour_logprobs, s.loss_mask, strict=True)
        ]
    config = UpdateConfig(loss_normalization=normalization, kl_coef=0.1, grad_clip=None)
    calls = _model_calls(engine)
    shared_metrics, shared = engine.update(rows, config), _grads(engine)
    assert calls == [(1, 120), (4, 32)]
    monkeypatch.setattr(torch_engine, "_MIN_SHARED_TOKENS", 10**9)
    plain_metrics, plain = engine.update(rows, config), _grads(engine)
    assert calls[2:] == [(4, 152)]
    assert shared_metrics["clip_frac"] > 0
    assert shared.keys() == plain.keys()
    for name, g in plain.items():  # the random tiny model's gradients are ~1e-5: tolerances relative to them
        atol = 1e-5 * float(g.abs().max())
        torch.testing.assert_close(shared[name], g, rtol=1e-4, atol=atol, msg=name)
    for key in ("loss", "pg_loss", "kl", "entropy", "clip_frac", "approx_kl", "ratio_mean", "grad_norm"):
        assert shared_metrics[key] == pytest.approx(plain_metrics[key], rel=1e-5, abs=1e-7), key


def test_shared_prefix_bfloat16_gradient_is_close_to_plain(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows = _prefixed_samples(120, random.Random(7))
    engine = TorchTrainingEngine(model_dir, learning_rate=0.0, dtype="bfloat16")
    config = UpdateConfig(grad_clip=None)
    calls = _model_calls(engine)
    shared_metrics, shared = engine.update(rows, config), _grads(engine)
    assert len(calls) == 2
    monkeypatch.setattr(torch_engine, "_MIN_SHARED_TOKENS", 10**9)
    plain_metrics, plain = engine.update(rows, config), _grads(engine)
    assert len(calls) == 3
    diff = torch.cat([(shared[n] - plain[n]).flatten() for n in plain]).norm()
    assert diff < 0.02 * torch.cat([g.flatten() for g in plain.values()]).norm()
    assert shared_metrics["entropy"] == pytest.approx(plain_metrics["entropy"], rel=1e-2)


def test_a_frozen_context_update_has_the_full_updates_loss_with_the_prompt_outside_the_graph(
    model_dir: Path, samples: list[Sample]
) -> None:
    """``context_gradient=False``: the same loss, ratios and KL as the full backward (one step, so both
    start from the same weights), with the positions before the micro-batch's first generated token run
    without gradient; the step still moves the policy."""
    metrics, graphs = {}, {}
    for context_gradient in (True, False):
        engine = TorchTrainingEngine(model_dir, learning_rate=1e-3, kl_reference=True)
        before = _params(engine)
        seen = graphs[context_gradient] = []
        engine.model.get_input_embeddings().register_forward_hook(
            lambda _m, _i, out, seen=seen: seen.append((out.shape[1], out.requires_grad))
        )
        config = UpdateConfig(kl_coef=0.1, context_gradient=context_gradient)
        metrics[context_gradient] = engine.update(samples, config)
        assert any(not torch.equal(p, before[n]) for n, p in _params(engine).items())
    for key in ("loss", "pg_loss", "kl", "entropy", "ratio_mean", "logprob_mismatch"):
        assert metrics[False][key] == pytest.approx(metrics[True][key], rel=1e-5, abs=1e-6), key
    first = min(s.loss_mask.index(1) for s in samples) - 1  # the logits there score the first one
    width = max(len(s.input_ids) for s in samples)
    assert graphs[False] == [(first, False), (width - first, True)]
    assert all(tracked for _, tracked in graphs[True])
