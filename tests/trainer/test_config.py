"""The trainer's configuration against the spec it comes from: one vocabulary (the spec's names in snake
case), the spec's defaults, the spec's allowed values as the registries' names, and the one translation
pinned on the example."""

import inspect
from dataclasses import fields
from pathlib import Path
from typing import Any, get_args

import pytest
import torch

from inharness.operator.spec import Algorithm, Generation, TrainingRunSpec
from inharness.operator.specfile import load_specs
from inharness.run import with_overrides
from inharness.trainer.algorithms import (
    ADVANTAGE_ESTIMATORS,
    ADVANTAGE_LEVELS,
    KL_ESTIMATORS,
    LOSS_NORMALIZATIONS,
    OFF_POLICY_CORRECTIONS,
    Registry,
    kl_penalty,
    loss_weights,
    rollout_advantages,
    token_advantages,
)
from inharness.trainer.config import (
    KL_ESTIMATOR,
    SPEC_ALGORITHM_FIELDS,
    LoopConfig,
    UpdateConfig,
    loop_config,
    update_config,
)
from inharness.trainer.torch_engine import TorchTrainingEngine

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "calc" / "trainingrun.yaml"
CHOICES = [
    ("advantage_estimator", ADVANTAGE_ESTIMATORS),
    ("advantage_level", ADVANTAGE_LEVELS),
    ("loss_normalization", LOSS_NORMALIZATIONS),
    ("off_policy_correction", OFF_POLICY_CORRECTIONS),
]


@pytest.mark.parametrize(("field", "registry"), CHOICES)
def test_the_specs_allowed_values_are_the_registrys_names(field: str, registry: Registry[Any]) -> None:
    assert set(get_args(Algorithm.model_fields[field].annotation)) == set(registry.names())


def test_the_kl_estimators_and_the_one_kl_coef_weighs() -> None:
    assert KL_ESTIMATORS.names() == ("k1", "k2", "k3", "low_var_kl")
    assert KL_ESTIMATORS.get("k3") is KL_ESTIMATORS.get("low_var_kl")
    assert KL_ESTIMATOR in KL_ESTIMATORS


def test_defaults_are_the_specs() -> None:
    defaults = {f.name: f.default for f in fields(UpdateConfig)}
    spec = Algorithm()
    assert {name: defaults[name] for name in SPEC_ALGORITHM_FIELDS} == {
        name: getattr(spec, name) for name in SPEC_ALGORITHM_FIELDS
    }
    assert defaults["temperature"] == Generation().temperature
    # A spec that sets nothing gives the trainer's defaults.
    bare = TrainingRunSpec.model_validate(
        {"model": {"path": "m"}, "dataset": {"path": "t.jsonl"}, "rolloutPoolRef": {"name": "p"}}
    )
    assert update_config(bare) == UpdateConfig()


def test_every_algorithm_field_of_the_spec_reaches_the_trainer_by_its_name() -> None:
    loop = {f.name for f in fields(LoopConfig)}
    engine = set(inspect.signature(TorchTrainingEngine).parameters)
    carried = {name for name in Algorithm.model_fields if name in loop or name in engine}
    assert set(Algorithm.model_fields) == set(SPEC_ALGORITHM_FIELDS) | carried
    assert carried == {"group_size", "max_tokens_per_sample", "learning_rate"}


def test_the_example_translates_as_before() -> None:
    """examples/calc/trainingrun.yaml (the demo's spec, with `spec.steps` its only override) gives the
    values that run.py's field-by-field translation gave before the trainer took the spec's names
    (estimator, norm_by_std, clip_low, clip_high, mini_batches, epochs there)."""
    specs = load_specs(EXAMPLE, check_files=False)
    assert loop_config(specs) == LoopConfig(
        run_name="calc",
        pool="calc-pool",
        steps=40,
        batch_size=8,
        group_size=4,
        max_attempts=2,
        max_staleness=0,
        checkpoint_interval=5,
        checkpoint_keep=3,
        seed=0,
        max_tokens_per_sample=None,
        update=UpdateConfig(
            advantage_estimator="grpo",
            advantage_level="rollout",
            loss_normalization="rollout",
            normalize_by_std=True,
            clip_ratio_low=0.2,
            clip_ratio_high=0.28,
            kl_coef=0.1,
            grad_clip=0.2,
            ppo_mini_batches=2,
            ppo_epochs=4,
            lr_warmup_steps=40,
            temperature=1.0,
            max_tokens_per_microbatch=4096,
        ),
    )
    smoke = loop_config(with_overrides(specs, {"spec.steps": 2}), config_sha256="abc")
    assert (smoke.steps, smoke.config_sha256, smoke.update) == (2, "abc", loop_config(specs).update)


def test_unknown_names_are_refused_naming_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"^unknown advantage estimator 'ppo'; known: grpo, rloo$"):
        ADVANTAGE_ESTIMATORS.get("ppo")
    with pytest.raises(ValueError, match=r"^loss_normalization: unknown loss normalization 'batch'; known: "):
        UpdateConfig(loss_normalization="batch")
    with pytest.raises(ValueError, match="advantage_level: unknown advantage level 'task'"):
        UpdateConfig(advantage_level="task")
    with pytest.raises(
        ValueError, match=r"^off_policy_correction: unknown off-policy correction 'is'; known: "
    ):
        UpdateConfig(off_policy_correction="is")
    with pytest.raises(ValueError, match=r"tis_cap must be at least 1, got 0\.5"):
        UpdateConfig(off_policy_correction="tis", tis_cap=0.5)
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'"):
        rollout_advantages(torch.tensor([1.0]), torch.tensor([0]), "ppo")
    with pytest.raises(ValueError, match="unknown advantage level 'task'"):
        token_advantages(
            torch.tensor([1.0]), torch.tensor([0]), torch.tensor([0]), torch.ones(1, 2), level="task"
        )
    with pytest.raises(ValueError, match="unknown loss normalization 'batch'"):
        loss_weights(torch.ones(1, 2), "batch")
    with pytest.raises(ValueError, match=r"unknown KL estimator 'k4'; known: k1, k2, k3, low_var_kl"):
        kl_penalty(torch.zeros(1, 2), torch.zeros(1, 2), "k4")


def test_a_registry_registers_by_name_once() -> None:
    registry: Registry[Any] = Registry("widget")

    @registry.register("b")
    @registry.register("a")
    def widget() -> int:
        return 1

    assert registry.names() == ("a", "b") and registry.get("b") is widget and "a" in registry
    with pytest.raises(ValueError, match="widget 'a' is already registered"):
        registry.register("a")(lambda: 2)
    assert registry.get("a") is widget


def test_registered_estimators_take_dense_groups() -> None:
    """The registered functions themselves, as another engine calls them: dense group ids, no zeroing
    of lone units (rollout_advantages does that)."""
    rewards, group = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0]), torch.tensor([0, 0, 0, 1, 1])
    grpo = ADVANTAGE_ESTIMATORS.get("grpo")(rewards, group, norm_by_std=True, eps=0.0)
    torch.testing.assert_close(grpo, torch.tensor([1.154701, -0.577350, -0.577350, -0.707107, 0.707107]))
    rloo = ADVANTAGE_ESTIMATORS.get("rloo")(rewards, group, norm_by_std=True, eps=0.0)
    torch.testing.assert_close(rloo, torch.tensor([1.0, -0.5, -0.5, -2.0, 2.0]))
