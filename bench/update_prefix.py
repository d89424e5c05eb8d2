"""What sharing the common prompt prefix saves in `TorchTrainingEngine.update`, on calc-shaped samples.

The calc example's update: 32 samples (8 tasks x 4 rollouts) of a 218-token shared prefix (system prompt,
tool schema, chat markup) and a ~60-token suffix (question, generated tool call, tool result, generated
answer; ~30 generated tokens), 2 PPO mini-batches x 4 epochs = 8 optimizer steps, rollout loss
normalisation, on the tiny model (`init_tiny`). Sharing on (the engine's default) and off (the
threshold `_MIN_SHARED_TOKENS` set out of reach, i.e. the plain forward pass) are timed in one run,
interleaved, and the median update times compared. A first untimed update of each checks that both give
the same loss, entropy and gradient norm.

Run: make bench-update   (or: .venv/bin/python bench/update_prefix.py [--repeats 5] [--threads 1])
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from inharness.engine.tiny import init_tiny
from inharness.trainer import torch_engine
from inharness.trainer.samples import Sample
from inharness.trainer.torch_engine import TorchTrainingEngine, UpdateConfig

PREFIX = 218
VOCAB = 3000  # below the tiny tokenizer's special and markup ids
CONFIG = UpdateConfig(ppo_mini_batches=2, ppo_epochs=4, loss_normalization="rollout", clip_ratio_high=0.28)
SHARED = torch_engine._MIN_SHARED_TOKENS
OFF = 10**9


def calc_samples(rng: random.Random, groups: int = 8, group_size: int = 4) -> list[Sample]:
    """One sample per rollout: the shared prefix, then question (prompt), tool call (generated), tool
    result (prompt), answer (generated); rewards mixed within each group so every group has advantages."""
    prefix = [rng.randrange(VOCAB) for _ in range(PREFIX)]
    out = []
    for g in range(groups):
        for k in range(group_size):
            ids, mask = list(prefix), [0] * PREFIX
            for lo, hi, generated in ((12, 18, 0), (12, 18, 1), (8, 12, 0), (10, 16, 1)):
                n = rng.randint(lo, hi)
                ids += [rng.randrange(VOCAB) for _ in range(n)]
                mask += [generated] * n
            reward = float(k % 2) if g % 2 else float(k == 0)
            out.append(
                Sample(f"r{g}.{k}", f"g{g}", [0], ids, mask, [0.0] * len(ids), [0], reward, PREFIX + 15)
            )
    return out


def on_policy(engine: TorchTrainingEngine, samples: list[Sample]) -> None:
    """Behaviour logprobs = the engine's current ones on the generated tokens, as if just sampled."""
    for s, lp in zip(samples, engine.logprobs(samples, temperature=1.0), strict=True):
        s.behaviour_logprobs = [0.0] + [
            v if m else 0.0 for v, m in zip(lp.tolist(), s.loss_mask[1:], strict=True)
        ]


def timed_update(engine: TorchTrainingEngine, samples: list[Sample], threshold: int) -> tuple[float, dict]:
    torch_engine._MIN_SHARED_TOKENS = threshold
    start = time.perf_counter()
    metrics = engine.update(samples, CONFIG)
    return time.perf_counter() - start, metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = init_tiny(Path(tmp) / "tiny", seed=0)
        samples = calc_samples(random.Random(0))
        engines = {mode: TorchTrainingEngine(model_dir, learning_rate=1e-4) for mode in ("shared", "plain")}
        on_policy(engines["shared"], samples)
        lengths = [len(s.input_ids) for s in samples]
        generated = [s.num_generated_tokens for s in samples]
        print(
            f"{len(samples)} samples: {PREFIX}-token shared prefix, lengths {min(lengths)}-{max(lengths)}"
            f" (mean {statistics.mean(lengths):.0f}), generated tokens {min(generated)}-{max(generated)}"
            f" (mean {statistics.mean(generated):.0f}); {CONFIG.ppo_mini_batches} mini-batches x"
            f" {CONFIG.ppo_epochs} epochs; {args.threads} thread(s)"
        )

        # Same weights, same samples: the first update of each must agree (sharing is exact).
        _, shared = timed_update(engines["shared"], samples, SHARED)
        _, plain = timed_update(engines["plain"], samples, OFF)
        for key in ("loss", "entropy", "grad_norm", "clip_frac"):
            print(f"first update {key:>10}: shared {shared[key]:.7g}  plain {plain[key]:.7g}")

        times: dict[str, list[float]] = {"shared": [], "plain": []}
        for r in range(args.repeats):
            order = ("shared", "plain") if r % 2 == 0 else ("plain", "shared")
            for mode in order:
                seconds, _ = timed_update(engines[mode], samples, SHARED if mode == "shared" else OFF)
                times[mode].append(seconds)
        torch_engine._MIN_SHARED_TOKENS = SHARED
        for mode, ts in times.items():
            print(f"{mode:>6}: median {statistics.median(ts):6.2f} s  ({', '.join(f'{t:.2f}' for t in ts)})")
        ratio = statistics.median(times["plain"]) / statistics.median(times["shared"])
        print(f"plain / shared: {ratio:.2f}x")


if __name__ == "__main__":
    main()
