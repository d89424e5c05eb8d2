"""What a training run leaves behind: `metrics.jsonl` (one object per step), `reward.png`, `summary.json`."""

import json
import math
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from inharness.gateway.schema import CallOut


def read_metrics(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def truncate_metrics(path: Path, *, before_step: int) -> None:
    """Keep only the steps a resumed run does not redo, so no step appears twice."""
    kept = [m for m in read_metrics(path) if m["step"] < before_step]
    path.write_text("".join(json.dumps(m) + "\n" for m in kept))


def append_metrics(path: Path, metrics: dict[str, Any]) -> None:
    with path.open("a") as f:
        f.write(json.dumps(metrics) + "\n")
        f.flush()


def root_reasons(calls: Iterable[CallOut]) -> dict[str, int]:
    """Calls that start a new root of their attempt's call tree, by the gateway's reason
    (`new_conversation`, `system_changed`, `history_rewritten`, `template_not_prefix`)."""
    return dict(Counter(c.prefix_mismatch for c in calls if c.prefix_mismatch))


def fifth_means(rewards: list[float]) -> tuple[float, float]:
    """Mean reward over the first and the last fifth of the steps (at least one step each)."""
    k = max(1, len(rewards) // 5)
    return sum(rewards[:k]) / k, sum(rewards[-k:]) / k


def smoke_problems(metrics: list[dict[str, Any]], steps: int) -> list[str]:
    """What keeps a short run from counting as trained: a missing step, a step without samples, a
    failed rollout (empty when there is none)."""
    problems = []
    if [m["step"] for m in metrics] != list(range(steps)):
        problems.append(f"steps {[m['step'] for m in metrics]}, expected 0..{steps - 1}")
    if any(not m["samples"] for m in metrics):
        problems.append("a step without samples")
    failed = sum(int(m["failed_rollouts"]) for m in metrics)
    if failed:
        problems.append(f"{failed} failed rollouts")
    return problems


def plot_rewards(path: Path, runs: dict[str, list[dict[str, Any]]], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    for label, metrics in runs.items():
        steps = [m["step"] for m in metrics]
        mean = [m["reward_mean"] for m in metrics]
        std = [m.get("reward_std", 0.0) for m in metrics]
        (line,) = ax.plot(steps, mean, marker="o", markersize=3, label=label)
        ax.fill_between(
            steps,
            [a - b for a, b in zip(mean, std, strict=True)],
            [a + b for a, b in zip(mean, std, strict=True)],
            color=line.get_color(),
            alpha=0.12,
        )
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward (± std over rollouts)")
    ax.set_title(title)
    ax.set_ylim(-0.05, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def summarize(metrics: list[dict[str, Any]], *, wall_seconds: float) -> dict[str, Any]:
    rewards = [m["reward_mean"] for m in metrics if not math.isnan(m["reward_mean"])]
    first, last = fifth_means(rewards) if rewards else (math.nan, math.nan)
    return {
        "steps": len(metrics),
        "reward_first_fifth": first,
        "reward_last_fifth": last,
        "reward_gain": last - first,
        "wall_seconds": wall_seconds,
        "rollouts": sum(m["rollouts"] for m in metrics),
        "failed_rollouts": sum(m["failed_rollouts"] for m in metrics),
        "dropped_stale": sum(m.get("dropped_stale", 0) for m in metrics),
        "samples": sum(m["samples"] for m in metrics),
        "tokens": sum(m["tokens"] for m in metrics),
        "prefix_mismatches": sum(m["prefix_mismatches"] for m in metrics),
        "root_reasons": dict(sum((Counter(m.get("root_reasons", {})) for m in metrics), Counter())),
        "time_rollout_s": sum(m["time_rollout_s"] for m in metrics),
        "time_update_s": sum(m["time_update_s"] for m in metrics),
        "final_version": metrics[-1]["version"] if metrics else 0,
    }


def summary_table(summary: dict[str, Any]) -> str:
    rows = [
        ("steps", f"{summary['steps']}"),
        ("reward, first fifth of steps", f"{summary['reward_first_fifth']:.3f}"),
        ("reward, last fifth of steps", f"{summary['reward_last_fifth']:.3f}"),
        ("gain", f"{summary['reward_gain']:+.3f}"),
        ("rollouts (failed)", f"{summary['rollouts']} ({summary['failed_rollouts']})"),
        ("samples / trained tokens", f"{summary['samples']} / {summary['tokens']}"),
        ("new roots (by reason)", _by_reason(summary["prefix_mismatches"], summary.get("root_reasons", {}))),
        ("time in rollouts / updates", f"{summary['time_rollout_s']:.0f}s / {summary['time_update_s']:.0f}s"),
        ("wall time", f"{summary['wall_seconds']:.0f}s"),
        ("final model version", f"{summary['final_version']}"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def _by_reason(total: int, reasons: dict[str, int]) -> str:
    parts = ", ".join(f"{k} {v}" for k, v in sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0])))
    return f"{total} ({parts})" if parts else f"{total}"
