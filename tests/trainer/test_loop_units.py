"""Pure parts of the training loop and its report: task batching, checkpoint state, metrics files."""

import json
from pathlib import Path
from types import SimpleNamespace

from test_samples import call, rollout

from inharness.trainer.loop import LoopState, RunDir, TrainingLoop, batch_tasks
from inharness.trainer.report import (
    append_metrics,
    fifth_means,
    plot_rewards,
    read_metrics,
    summarize,
    summary_table,
    truncate_metrics,
)
from inharness.trainer.samples import build_batch


def test_batches_are_deterministic_and_cover_each_epoch_once() -> None:
    tasks = list(range(10))
    first = [batch_tasks(tasks, b, 4, seed=3) for b in range(5)]
    assert first == [batch_tasks(tasks, b, 4, seed=3) for b in range(5)]
    flat = [t for b in first for t in b]
    assert sorted(flat[:10]) == tasks and sorted(flat[10:20]) == tasks
    assert batch_tasks(tasks, 0, 4, seed=4) != first[0]


def test_loop_state_round_trips_through_json() -> None:
    state = LoopState(step=3, version=3, cursor=17, journal={0: ["a"], 3: ["b", "c"]})
    assert LoopState.from_json(json.loads(json.dumps(state.to_json()))) == state


def test_latest_checkpoint_ignores_incomplete_ones(tmp_path: Path) -> None:
    rd = RunDir(tmp_path)
    for n in (2, 10):
        (rd.checkpoints / f"step-{n}").mkdir(parents=True)
        (rd.checkpoints / f"step-{n}" / "state.json").write_text("{}")
    (rd.checkpoints / "step-12.tmp").mkdir()
    (rd.checkpoints / "step-11").mkdir()
    assert rd.latest_checkpoint() == rd.checkpoints / "step-10"


def test_resume_truncates_metrics_of_redone_steps(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    for step in range(5):
        append_metrics(path, {"step": step, "reward_mean": step / 4, "reward_std": 0.1})
    truncate_metrics(path, before_step=3)
    assert [m["step"] for m in read_metrics(path)] == [0, 1, 2]
    plot_rewards(tmp_path / "r.png", {"run": read_metrics(path)}, "t")
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_fifth_means_use_at_least_one_step() -> None:
    assert fifth_means([0.0, 1.0]) == (0.0, 1.0)
    assert fifth_means([0.0] * 5 + [1.0] * 5) == (0.0, 1.0)


def test_loop_config_carries_every_algorithm_field_of_the_spec() -> None:
    from inharness.operator.specfile import load_specs
    from inharness.run import with_overrides
    from inharness.trainer.config import loop_config

    example = Path(__file__).resolve().parents[2] / "examples" / "calc" / "trainingrun.yaml"
    overrides = {
        "spec.algorithm.advantageEstimator": "rloo",
        "spec.algorithm.advantageLevel": "sample",
        "spec.algorithm.lossNormalization": "token",
        "spec.algorithm.normalizeByStd": False,
        "spec.algorithm.clipRatioLow": 0.1,
        "spec.algorithm.clipRatioHigh": 0.3,
        "spec.algorithm.klCoef": 0.5,
        "spec.algorithm.ppoMiniBatches": 3,
        "spec.algorithm.ppoEpochs": 5,
        "spec.algorithm.lrWarmupSteps": 7,
        "spec.algorithm.gradClip": 0.25,
        "spec.generation.temperature": 0.7,
    }
    update = loop_config(with_overrides(load_specs(example), overrides)).update
    assert (update.advantage_estimator, update.advantage_level, update.loss_normalization) == (
        "rloo",
        "sample",
        "token",
    )
    assert (update.normalize_by_std, update.clip_ratio_low, update.clip_ratio_high, update.kl_coef) == (
        False,
        0.1,
        0.3,
        0.5,
    )
    assert (update.ppo_mini_batches, update.ppo_epochs, update.lr_warmup_steps, update.temperature) == (
        3,
        5,
        7,
        0.7,
    )
    assert update.grad_clip == 0.25


def test_root_reasons_reach_the_metrics_row_and_the_summary(tmp_path: Path) -> None:
    rollouts = [
        rollout([call(1, [1, 2], [3]), call(2, [5], [6], mismatch="new_conversation")], rid="a"),
        rollout([call(3, [1, 2], [3]), call(4, [1, 9, 3, 7], [8], mismatch="history_rewritten")], rid="b"),
        rollout([call(5, [1, 2], [3]), call(6, [4], [6], mismatch="new_conversation")], rid="c"),
    ]
    samples, stats = build_batch(rollouts)
    loop = SimpleNamespace(state=LoopState(version=1))  # _metrics reads only the loop's state
    row = TrainingLoop._metrics(loop, 0, rollouts, samples, stats, {}, (0.0, 1.0, 2.0, 3.0))  # type: ignore[arg-type]
    assert row["root_reasons"] == {"new_conversation": 2, "history_rewritten": 1}
    assert row["prefix_mismatches"] == 3
    assert row["splits"] == {"prefix_mismatch:new_conversation": 2, "prefix_mismatch:history_rewritten": 1}

    path = tmp_path / "metrics.jsonl"
    append_metrics(path, row)
    append_metrics(path, {**row, "step": 1, "root_reasons": {"system_changed": 1}, "prefix_mismatches": 1})
    summary = summarize(read_metrics(path), wall_seconds=1.0)
    assert summary["root_reasons"] == {"new_conversation": 2, "history_rewritten": 1, "system_changed": 1}
    (line,) = [x for x in summary_table(summary).splitlines() if "new roots (by reason)" in x]
    assert line.endswith(" 4 (new_conversation 2, history_rewritten 1, system_changed 1)")
