"""`make demo`: RL of a tiny model inside the unmodified calculator agent (harness.py), on the CPU.

1. init-tiny + a short supervised warm-up on synthetic traces, so that tool calls parse;
2. `inharness run trainingrun.yaml`: engine, gateway, harness subprocesses and trainer on 127.0.0.1;
3. the reward curve, the time, and the goal: mean reward over the last fifth of steps at least
   0.3 above the first fifth.

`--ablation` then trains again with sample-level instead of rollout-level advantages and loss
normalisation (same seed, same budget) and plots both curves in one figure.
"""

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import tasks as calc_tasks  # noqa: E402

SPEC = HERE / "trainingrun.yaml"
GOAL = 0.3


def prepare_model(work: Path) -> float:
    from inharness.engine.tiny import init_tiny

    t = time.monotonic()
    base = init_tiny(work / "tiny", seed=0)
    target = HERE / "model"
    shutil.rmtree(target, ignore_errors=True)
    stats = calc_tasks.warm_up(base, target)
    took = time.monotonic() - t
    print(f"warm-up: loss {stats['loss_first']:.2f} -> {stats['loss_last']:.2f} in {took:.0f}s ({target})")
    return took


def train(out: Path, overrides: dict[str, object]) -> list[dict[str, object]]:
    from inharness.run import run_file
    from inharness.trainer.report import read_metrics

    shutil.rmtree(out, ignore_errors=True)
    code = run_file(SPEC, out, overrides=overrides)
    if code != 0:
        raise SystemExit(code)
    return read_metrics(out / "metrics.jsonl")


def report(label: str, metrics: list[dict[str, object]], seconds: float) -> float:
    from inharness.trainer.report import fifth_means

    rewards = [float(m["reward_mean"]) for m in metrics]  # type: ignore[arg-type]
    first, last = fifth_means(rewards)
    print(f"\n{label}: reward per step: " + " ".join(f"{r:.2f}" for r in rewards))
    print(
        f"{label}: first fifth {first:.3f}, last fifth {last:.3f}, gain {last - first:+.3f} in {seconds:.0f}s"
    )
    return last - first


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("runs/calc-demo"))
    ap.add_argument("--ablation", action="store_true", help="also train with sample-level normalisation")
    args = ap.parse_args(argv)

    started = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    warm = prepare_model(args.out)
    t = time.monotonic()
    main_metrics = train(args.out / "rollout-level", {})
    gain = report("rollout-level", main_metrics, time.monotonic() - t)
    total = time.monotonic() - started
    ok = gain >= GOAL
    print(
        f"\ngoal: gain >= {GOAL} within 10 minutes: gain {gain:+.3f} in {total:.0f}s "
        f"(warm-up {warm:.0f}s) -> {'met' if ok and total <= 600 else 'NOT met'}"
    )
    print(f"curve: {args.out / 'rollout-level' / 'reward.png'}")
    results = {"rollout_level": {"gain": gain, "seconds": total}}

    if args.ablation:
        from inharness.trainer.report import plot_rewards

        t = time.monotonic()
        overrides = {"spec.algorithm.advantageLevel": "sample", "spec.algorithm.lossNormalization": "sample"}
        sample_metrics = train(args.out / "sample-level", overrides)
        results["sample_level"] = {
            "gain": report("sample-level", sample_metrics, time.monotonic() - t),
            "seconds": time.monotonic() - t,
        }
        plot_rewards(
            args.out / "ablation.png",
            {"rollout-level": main_metrics, "sample-level": sample_metrics},
            "calc: rollout- vs sample-level normalisation (same seed, same budget)",
        )
        print(f"ablation curve: {args.out / 'ablation.png'}")
    (args.out / "demo.json").write_text(json.dumps(results, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
