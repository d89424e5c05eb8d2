"""`inharness sft`: a supervised warm-up from what a harness really sent, read back from a gateway store.

A run (scripted by a teacher, or the policy's own) leaves in its store every call of every attempt,
token-exact: the harness's system prompt, its tools, its tool-output format, the assistant turns. The
warm-up reads the finished rollouts' final attempts (the export), keeps those whose reward is at least
`min_reward` (rejection sampling), merges each into samples with the adapter the RL loop uses
(`samples.build_samples`: the loss on the model's own tokens only; prompts, tool results and user turns
are context), and trains on them with the torch engine's token-budget micro-batches
(`TorchTrainingEngine.sft_step`), by default with the prompt before a micro-batch's first learnt token
run without gradient: a harness's prompt is most of every sample, and the warm-up teaches the turns.
The result is a model directory that `spec.model.path` names, with `sft_summary.json` and
`sft_loss.png` beside the weights.
"""

import asyncio
import json
import math
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # at run time imported where used: the CLI reads WarmupConfig's defaults for --help
    from inharness.gateway.schema import ExportedRollout
    from inharness.trainer.samples import Sample

EXPORT_PAGE = 200
SUMMARY_FILE = "sft_summary.json"
LOSS_PLOT = "sft_loss.png"


class NoWarmupData(ValueError):
    """The source holds no attempt to learn from (said in one line, with what was skipped and why)."""


def store_url_of(source: str) -> str:
    """A store URL from what a user names: a URL as it is, a run directory (its `gateway.db`), or a
    SQLite file. A path that holds no store is refused rather than opened (which would create one)."""
    if "://" in source:
        return source
    path = Path(source)
    db = path / "gateway.db" if path.is_dir() else path
    if not db.is_file():
        where = f"{path} has no gateway.db" if path.is_dir() else f"{path} does not exist"
        raise NoWarmupData(
            f"no gateway store at {source}: {where} (name a run directory, a .db file or a URL)"
        )
    return f"sqlite:///{db.resolve()}"


async def read_rollouts(url: str) -> list["ExportedRollout"]:
    """Every finished rollout of the store with the calls of its final attempt, in finishing order."""
    from inharness.gateway.store import Store

    store = await Store.open(url)
    try:
        out: list[ExportedRollout] = []
        cursor = 0
        while page := await store.export(after=cursor, limit=EXPORT_PAGE, bodies=False):
            out += page
            cursor = page[-1].cursor
        return out
    finally:
        await store.close()


@dataclass
class Selection:
    """What the warm-up keeps of a store: the samples, and the rollouts skipped by reason."""

    samples: list["Sample"] = field(default_factory=list)
    rollouts: int = 0
    kept: int = 0
    skipped: Counter[str] = field(default_factory=Counter)

    def said(self) -> str:
        why = ", ".join(f"{n} {reason}" for reason, n in sorted(self.skipped.items())) or "none"
        kept = f"{self.kept} of {self.rollouts} rollouts kept ({self.samples_tokens} tokens to learn)"
        return f"{kept}; skipped: {why}"

    @property
    def samples_tokens(self) -> int:
        return sum(s.num_generated_tokens for s in self.samples)


def select(rollouts: list["ExportedRollout"], min_reward: float | None) -> Selection:
    """The samples of the succeeded rollouts whose reward is at least `min_reward` (any reward when None).
    Failed rollouts and those without a reward are skipped: nothing says their turns are worth copying."""
    from inharness.trainer.samples import build_samples

    sel = Selection(rollouts=len(rollouts))
    for exported in rollouts:
        ro = exported.rollout
        if ro.status != "succeeded":
            sel.skipped["failed"] += 1
        elif ro.reward is None:
            sel.skipped["without a reward"] += 1
        elif min_reward is not None and ro.reward < min_reward:
            sel.skipped[f"reward below {min_reward:g}"] += 1
        else:
            samples, _ = build_samples(exported)
            samples = [s for s in samples if s.num_generated_tokens > 0]
            if not samples:
                sel.skipped["without model calls"] += 1
                continue
            sel.samples += samples
            sel.kept += 1
    return sel


@dataclass(frozen=True)
class WarmupConfig:
    steps: int = 60
    learning_rate: float = 3e-3
    batch_size: int = 8  # samples per optimizer step
    max_tokens_per_microbatch: int = 16384
    seed: int = 0
    # False: the prompt up to the first learnt token runs without gradient (TorchTrainingEngine.sft_step).
    # On mini-SWE-agent's recordings that was 3.5x cheaper a step and reached a loss of 0.02 in 150 steps.
    context_gradient: bool = False


def warm_up(
    model_dir: Path,
    selection: Selection,
    out: Path,
    config: WarmupConfig,
    *,
    source: str,
    progress: Callable[[int, dict[str, float]], None] | None = None,
) -> dict[str, Any]:
    """Train `model_dir` on the selection's samples for `config.steps` AdamW steps (mini-batches of
    `batch_size` samples from a seeded shuffle, the learning rate cosine-decayed to a tenth so that a
    short run settles), save the model to `out` with its summary and loss curve; returns the summary."""
    from inharness.trainer.torch_engine import TorchTrainingEngine

    if not selection.samples:
        raise NoWarmupData(f"nothing to learn from in {source}: {selection.said()}")
    began = time.monotonic()
    engine = TorchTrainingEngine(model_dir, learning_rate=config.learning_rate, seed=config.seed)
    rng = random.Random(config.seed)
    order: list[int] = []
    losses: list[float] = []
    for step in range(config.steps):
        if len(order) < config.batch_size:
            order += rng.sample(range(len(selection.samples)), len(selection.samples))
        rows, order = order[: config.batch_size], order[config.batch_size :]
        lr = config.learning_rate * (0.1 + 0.45 * (1 + math.cos(math.pi * step / config.steps)))
        metrics = engine.sft_step(
            [selection.samples[i] for i in rows],
            learning_rate=lr,
            max_tokens_per_microbatch=config.max_tokens_per_microbatch,
            context_gradient=config.context_gradient,
        )
        losses.append(metrics["loss"])
        if progress is not None:
            progress(step + 1, {**metrics, "lr": lr})
    engine.save_pretrained(out)
    summary = {
        "source": source,
        "model": str(model_dir),
        "rollouts": selection.rollouts,
        "rollouts_kept": selection.kept,
        "skipped": dict(selection.skipped),
        "samples": len(selection.samples),
        "tokens_to_learn": selection.samples_tokens,
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "losses": losses,
        "seconds": round(time.monotonic() - began, 1),
        "config": asdict(config),
    }
    (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    _plot_loss(out / LOSS_PLOT, losses, title=f"inharness sft: {selection.kept} rollouts of {source}")
    return summary


def _plot_loss(path: Path, losses: list[float], *, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot(range(1, len(losses) + 1), losses, marker="o", markersize=2)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (mean NLL of the model's tokens)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def sft_from(
    source: str,
    model_dir: Path,
    out: Path,
    config: WarmupConfig,
    *,
    min_reward: float | None,
    log: Callable[[str], None],
    progress: Callable[[int, dict[str, float]], None] | None = None,
) -> dict[str, Any]:
    """`inharness sft` end to end: read the source's store, select, train, save."""
    url = store_url_of(source)
    selection = select(asyncio.run(read_rollouts(url)), min_reward)
    log(f"inharness sft: {source}: {selection.said()}")
    return warm_up(model_dir, selection, out, config, source=source, progress=progress)
