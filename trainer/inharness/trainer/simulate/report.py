"""What a simulation leaves: one row of figures per mode, the side-by-side table, timeline PNGs and
`summary.json` (the parameters and every figure, to diff two plans)."""

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from inharness.trainer.simulate.engine import Sim
from inharness.trainer.simulate.params import Params

if TYPE_CHECKING:
    from matplotlib.axes import Axes


@dataclass(frozen=True)
class ModeResult:
    """Busy fractions are of all the run's GPUs over the whole run: generation counts the decode
    capacity used (a GPU decoding one call of a possible `max_batch` is 1/max_batch busy)."""

    mode: str
    steps: int
    seconds: float
    steps_per_hour: float
    gen_gpus: int
    train_gpus: int
    rollouts_at_once: int
    gen_busy: float
    train_busy: float
    held: float  # share of the time new calls were held (drain, training on shared GPUs, sync)
    staleness_mean: float
    staleness_max: int
    dropped_stale: int
    groups_started: int
    calls_per_trained_rollout: float
    calls_per_dropped_rollout: float | None


def summarize(sim: Sim) -> ModeResult:
    assert sim.end is not None
    gpus, end = sim.params.shape.gpus, sim.end
    stale = [s for _, s in sim.trained]
    return ModeResult(
        mode=sim.mode,
        steps=sim.steps_done,
        seconds=end,
        steps_per_hour=3600 * sim.steps_done / end,
        gen_gpus=len(sim.gen_gpus),
        train_gpus=len(sim.train_gpus),
        rollouts_at_once=sim.concurrency,
        gen_busy=sum(g.busy for g in sim.gen_gpus) / (gpus * end),
        train_busy=sum(b - a for a, b in sim.train_spans) * len(sim.train_gpus) / (gpus * end),
        held=sum(b - a for a, b in sim.hold_spans) / end,
        staleness_mean=sum(stale) / len(stale),
        staleness_max=max(stale),
        dropped_stale=sim.dropped_stale,
        groups_started=sim.groups_started,
        calls_per_trained_rollout=sum(sim.trained_calls) / len(sim.trained_calls),
        calls_per_dropped_rollout=sum(sim.dropped_calls) / len(sim.dropped_calls)
        if sim.dropped_calls
        else None,
    )


def headline(params: Params, seed: int) -> str:
    s = params.shape
    return (
        f"{params.name}: {s.gpus} GPUs, {s.steps} steps of {s.batch_size} groups x {s.group_size}, "
        f"max staleness {s.max_staleness}, seed {seed}"
    )


def table(results: list[ModeResult]) -> str:
    """Modes side by side; ratios against sync when sync was simulated."""
    base = next((r for r in results if r.mode == "sync"), None)
    rows: list[tuple[str, list[str]]] = [
        ("steps/hour", [f"{r.steps_per_hour:.2f}" for r in results]),
    ]
    if base is not None:
        rows.append(("vs sync", [f"{r.steps_per_hour / base.steps_per_hour:.2f}x" for r in results]))
    rows += [
        ("step time (s)", [f"{r.seconds / r.steps:.1f}" for r in results]),
        (
            "GPUs gen/train",
            [f"{r.gen_gpus}/{r.train_gpus}" + (" shared" if r.mode != "async" else "") for r in results],
        ),
        ("rollouts at once", [str(r.rollouts_at_once) for r in results]),
        ("GPU busy: generation", [f"{100 * r.gen_busy:.1f}%" for r in results]),
        ("GPU busy: training", [f"{100 * r.train_busy:.1f}%" for r in results]),
        ("calls held", [f"{100 * r.held:.1f}%" for r in results]),
        ("staleness mean / max", [f"{r.staleness_mean:.2f} / {r.staleness_max}" for r in results]),
        ("dropped groups (stale)", [str(r.dropped_stale) for r in results]),
        ("calls per trained rollout", [f"{r.calls_per_trained_rollout:.1f}" for r in results]),
        ("groups started", [str(r.groups_started) for r in results]),
    ]
    head = ["", *(r.mode for r in results)]
    width = [max(len(row[0]) for row in rows)] + [
        max(len(head[i + 1]), *(len(row[1][i]) for row in rows)) for i in range(len(results))
    ]
    lines = [
        "  ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip(head, width, strict=True)))
    ]
    for name, cells in rows:
        lines.append(
            "  ".join([name.ljust(width[0]), *(c.rjust(w) for c, w in zip(cells, width[1:], strict=True))])
        )
    return "\n".join(lines)


def _binned(segments: list[tuple[float, float, float]], edges: np.ndarray) -> np.ndarray:
    """Mean share of capacity used in each bin, from a GPU's sorted, disjoint busy segments."""
    if not segments:
        return np.zeros(len(edges) - 1)
    s0, s1, used = np.asarray(segments, dtype=float).T
    cum = np.concatenate([[0.0], np.cumsum(used * (s1 - s0))])
    k = np.searchsorted(s0, edges, "right") - 1
    inside = np.where(k >= 0, used[k] * np.clip(np.minimum(edges, s1[k]) - s0[k], 0, None), 0.0)
    total = cum[np.maximum(k, 0)] * (k >= 0) + inside
    return np.diff(total) / np.diff(edges)


def _lanes(ax: "Axes", sim: Sim, start: float, stop: float, bins: int) -> None:
    minutes = 60.0
    edges = np.linspace(start, stop, bins + 1)
    x = edges / minutes
    for gpu in sim.gen_gpus:
        y = _binned(gpu.segments, edges)
        ax.fill_between(x[:-1], gpu.index, gpu.index + 0.8 * y, step="post", color="tab:blue", lw=0)
    lanes = sorted(sim.train_gpus)
    for spans, color, label in (
        (sim.train_spans, "tab:red", "training"),
        (sim.sync_spans, "0.55", "weight sync"),
    ):
        bars = [(a / minutes, (b - a) / minutes) for a, b in spans if b > start and a < stop]
        for lane in lanes:
            ax.broken_barh(bars, (lane, 0.8), color=color, lw=0, label=label if lane == lanes[0] else None)
    gpus = sim.params.shape.gpus
    ax.set_xlim(start / minutes, stop / minutes)
    ax.set_ylim(-0.1, gpus)
    ax.set_yticks([i + 0.4 for i in range(gpus)], [f"GPU {i}" for i in range(gpus)])


def plot_timeline(sim: Sim, path: Path, *, until: float, zoom: float, bins: int = 1200) -> None:
    """One lane per GPU: generation as the share of decode capacity used, training and weight sync
    as bars over the GPUs they take. Top: the whole run, on the same time axis for every mode
    (`until`); bottom: its first `zoom` seconds, where single steps can be told apart."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gpus = sim.params.shape.gpus
    fig, axes = plt.subplots(2, 1, figsize=(12, 2.8 + 0.8 * gpus), dpi=110)
    _lanes(axes[0], sim, 0.0, until, bins)
    _lanes(axes[1], sim, 0.0, min(zoom, until), bins)
    axes[1].fill_between([], [], color="tab:blue", label="generation (share of decode capacity)")
    axes[1].set_xlabel("minutes")
    r = summarize(sim)
    axes[0].set_title(
        f"{sim.params.name}, {sim.mode}: {r.steps_per_hour:.2f} steps/hour, "
        f"GPU busy {100 * r.gen_busy:.0f}% generating + {100 * r.train_busy:.0f}% training"
    )
    shown = min(zoom, until) / 60
    axes[1].set_title(f"the first {shown:.{0 if shown >= 10 else 2}f} minutes", fontsize=9)
    handles, labels = axes[1].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", fontsize=8, ncols=3)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path)
    plt.close(fig)


def write_summary(path: Path, params: Params, seed: int, sims: list[Sim], extra: dict[str, object]) -> None:
    data = {
        "params": params.model_dump(mode="json"),
        "seed": seed,
        "modes": {s.mode: {**asdict(summarize(s)), "step_ends": s.step_ends} for s in sims},
        **extra,
    }
    path.write_text(json.dumps(data, indent=1) + "\n")
