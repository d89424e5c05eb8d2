"""The verl engine on CPU: verl 0.9.1's own FSDP workers on a local Ray, through our platform module.

One engine (two gloo ranks, a reference group for the KL term) serves the module; building it takes
about half a minute, most of it Ray and the workers' start. The seams in verl that `cpu_platform`
relies on are pinned here, so a verl upgrade that moves one fails by name.
"""

from __future__ import annotations

import importlib.metadata
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from inharness.trainer.algorithms import rollout_advantages
from inharness.trainer.config import UpdateConfig
from inharness.trainer.samples import Sample
from inharness.trainer.torch_engine import TorchTrainingEngine

pytestmark = pytest.mark.slow

LR = 1e-2  # large, so that the weights move far and a mismatch would show


def _samples(model: Path) -> list[Sample]:
    """Seven rollouts in three groups, some responses with masked (tool) tokens; behaviour log-probs
    just below the current policy's, so that ratios are not all one."""
    rng = random.Random(0)
    samples = []
    for i in range(7):
        p, n = rng.randint(5, 12), rng.randint(4, 10)
        mask = [0] * p + [1] * n
        if n > 6:
            mask[p + 3] = 0
        samples.append(
            Sample(
                rollout_id=f"r{i}",
                group_id=f"g{i // 3}",
                call_ids=[i],
                input_ids=[rng.randint(3, 200) for _ in range(p + n)],
                loss_mask=mask,
                behaviour_logprobs=[0.0] * (p + n),
                model_versions=[0],
                reward=rng.random(),
                num_prompt_tokens=p,
            )
        )
    current = TorchTrainingEngine(model, learning_rate=LR).logprobs(samples, temperature=1.0)
    for s, lp in zip(samples, current, strict=True):
        s.behaviour_logprobs = [0.0] + [float(x) - 0.01 for x in lp]
    return samples


FIRST = UpdateConfig(kl_coef=0.1, lr_warmup_steps=3, grad_clip=0.5)
SECOND = UpdateConfig(
    kl_coef=0.1,
    lr_warmup_steps=3,
    grad_clip=0.5,
    ppo_mini_batches=2,
    ppo_epochs=2,
    loss_normalization="sample",
)
THIRD = UpdateConfig(
    kl_coef=0.1,
    lr_warmup_steps=3,
    grad_clip=0.5,
    ppo_mini_batches=2,
    loss_normalization="token",
    off_policy_correction="tis",
    tis_cap=2.0,
)


@pytest.fixture(scope="module")
def verl_engine(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    from inharness.trainer.verl_engine.engine import VerlTrainingEngine

    engine = VerlTrainingEngine(
        tiny_model,
        learning_rate=LR,
        weights_root=tmp_path_factory.mktemp("verl") / "weights",
        update=FIRST,
        kl_reference=True,
    )
    yield engine
    engine.close()


def test_the_cpu_platform_is_registered_and_verl_seams_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    from verl.plugin.platform.platform_manager import PlatformRegistry
    from verl.workers.engine.base import EngineRegistry

    from inharness.trainer.verl_engine import cpu_platform

    plugins = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="verl.plugins")}
    assert plugins["inharness"] == "inharness.trainer.verl_engine.plugin:load"
    platform = PlatformRegistry.get(cpu_platform.NAME)()
    assert platform.device_name == "cpu" and platform.communication_backend_name() == "gloo"
    assert not platform.is_platform_available(use_smi_check=True)  # only VERL_PLATFORM selects it
    device = platform.device_module
    assert device.max_memory_allocated() == 0 and device.get_device_name() == "CPU"
    assert device.mem_get_info()[1] > 0
    assert cpu_platform.gloo_backend("cpu:gloo,cpu:gloo") == "gloo"
    assert cpu_platform.gloo_backend("cpu:gloo,cuda:nccl") == "cpu:gloo,cuda:nccl"
    # verl registers its FSDP engine for "cuda"; VERL_ENGINE_DEVICE is how CPU workers reach it.
    monkeypatch.setenv("VERL_ENGINE_DEVICE", "cuda")
    assert EngineRegistry.get_engine_cls("language_model", "fsdp").__name__ == "FSDPEngineWithLMHead"


def test_registered_estimators_equal_the_reference() -> None:
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn

    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0, 1.0, 1.0, 0.25])
    index = ["a", "a", "a", "b", "b", "c", "c"]
    mask = torch.ones(7, 5)
    mask[0, 3:] = 0
    token_rewards = torch.zeros(7, 5)
    token_rewards[:, 0] = rewards
    group = torch.tensor([0, 0, 0, 1, 1, 2, 2])
    for name in ("grpo", "rloo"):
        adv, _ = get_adv_estimator_fn(f"inharness_{name}")(token_rewards, mask, index)
        expected = rollout_advantages(rewards, group, estimator=name)
        assert torch.allclose(adv, expected.unsqueeze(-1) * mask, atol=1e-6)


def test_one_batch_trains_the_same_under_both_engines(verl_engine: object, tiny_model: Path) -> None:
    """fp32: the same losses and metrics, and the same policy after each update (log-probs of every
    sample from the weights verl's checkpoint backend wrote), to 1e-5 after a single step. The
    second update takes four steps (two mini-batches of whole rollouts, two epochs) with warm-up,
    gradient clipping, KL and sample normalisation. The third corrects off-policy samples by TIS:
    the behaviour log-probs are now two updates behind the policy, so the weights spread on both
    sides of 1 and some reach the cap; θ_old is the actor's own forward pass in verl. It starts from
    policies up to 1e-4 apart (the second update's difference), so its metrics agree to 1e-4 absolute
    rather than 1e-6."""
    samples = _samples(tiny_model)
    reference = TorchTrainingEngine(tiny_model, learning_rate=LR, kl_reference=True)
    before = reference.logprobs(samples, temperature=1.0)
    common = ("loss", "pg_loss", "kl", "clip_frac", "approx_kl", "ratio_mean", "ratio_max")
    tis = ("tis_weight_mean", "tis_clip_frac")
    for version, config, tol, near in (
        (1, FIRST, 1e-5, 1e-6),
        (2, SECOND, 3e-4, 1e-6),
        (3, THIRD, 6e-4, 1e-4),
    ):
        expected = reference.update(samples, config)
        got = verl_engine.update(samples, config)  # type: ignore[attr-defined]
        for key in common + (tis if config.off_policy_correction == "tis" else ()):
            assert got[key] == pytest.approx(expected[key], rel=1e-4, abs=near), key
        # a norm over shards summed on two ranks: the same gradient, added up in another order
        assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-3)
        assert got["optimizer_steps"] == expected["optimizer_steps"]
        assert got["lr"] == pytest.approx(expected["lr"])
        weights = verl_engine.save_pretrained(verl_engine.weights_root / f"v{version}")  # type: ignore[attr-defined]
        served = TorchTrainingEngine(weights, learning_rate=LR).logprobs(samples, temperature=1.0)
        want = reference.logprobs(samples, temperature=1.0)
        diff = max(float((a - b).abs().max()) for a, b in zip(want, served, strict=True))
        moved = max(float((a - b).abs().max()) for a, b in zip(want, before, strict=True))
        print(f"update {version}: max log-prob difference {diff:.2e}, moved {moved:.2f}")
        assert diff < tol < moved, (version, diff, moved)
    assert 0 < expected["tis_clip_frac"] < 1 and expected["tis_weight_mean"] != pytest.approx(1.0, abs=0.05)


def test_a_checkpoint_restores_the_policy(verl_engine: object, tiny_model: Path, tmp_path: Path) -> None:
    samples = _samples(tiny_model)
    verl_engine.save_checkpoint(tmp_path / "ckpt")  # type: ignore[attr-defined]
    saved = verl_engine.save_pretrained(verl_engine.weights_root / "v10")  # type: ignore[attr-defined]
    step = verl_engine.step  # type: ignore[attr-defined]
    verl_engine.update(samples, FIRST)  # type: ignore[attr-defined]
    verl_engine.load_checkpoint(tmp_path / "ckpt")  # type: ignore[attr-defined]
    restored = verl_engine.save_pretrained(verl_engine.weights_root / "v11")  # type: ignore[attr-defined]
    assert verl_engine.step == step  # type: ignore[attr-defined]
    a = TorchTrainingEngine(saved, learning_rate=LR).logprobs(samples, temperature=1.0)
    b = TorchTrainingEngine(restored, learning_rate=LR).logprobs(samples, temperature=1.0)
    assert max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True)) == 0.0


def test_fixed_settings_cannot_change_between_updates(verl_engine: object, tiny_model: Path) -> None:
    with pytest.raises(ValueError, match="grad_clip is fixed"):
        verl_engine.update(_samples(tiny_model), UpdateConfig(kl_coef=0.1, grad_clip=2.0, lr_warmup_steps=3))  # type: ignore[attr-defined]
