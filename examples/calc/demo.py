"""`make demo`: RL of a tiny model inside the unmodified calculator agent (harness.py), on the CPU.

1. init-tiny + a short supervised warm-up on synthetic traces, so that tool calls parse;
2. `inharness run trainingrun.yaml`: engine, gateway, harness subprocesses and trainer on 127.0.0.1;
3. the reward curve, the time, and the goal: mean reward over the last fifth of steps at least
   0.3 above the first fifth.

`--ablation` then trains again with sample-level instead of rollout-level advantages and loss
normalisation (same seed, same budget) and plots both curves in one figure.

`--engine verl` (`make demo-verl`) trains through verl's FSDP workers on a local Ray instead of the
built-in torch engine: same spec, same goal.

`--smoke` is the same path in about a minute, for `make test`: a short warm-up, then `--steps` (2)
steps of the same spec, the same relative default paths; it checks that the run trains (every step
has samples, no rollout failed) instead of judging the goal.
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
LIMIT_SECONDS = 600
SMOKE_WARMUP = {"conversations": 64, "short_steps": 20, "steps": 20}


def prepare_model(work: Path, warmup: dict[str, int]) -> float:
    from inharness.engine.tiny import init_tiny

    t = time.monotonic()
    base = init_tiny(work / "tiny", seed=0)
    target = HERE / "model"
    shutil.rmtree(target, ignore_errors=True)
    stats = calc_tasks.warm_up(base, target, **warmup)
    took = time.monotonic() - t
    print(f"warm-up: loss {stats['loss_first']:.2f} -> {stats['loss_last']:.2f} in {took:.0f}s ({target})")
    return took


def train(out: Path, overrides: dict[str, object]) -> list[dict[str, object]]:
    from inharness.run import run_file
    from inharness.trainer.report import read_metrics

    shutil.rmtree(out, ignore_errors=True)
    code = run_file(SPEC, out, overrides=overrides)
    if code != 0:
        print(f"\ndemo: inharness run exited with code {code}; the goal is not met", file=sys.stderr)
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
    ap.add_argument("--out", type=Path, default=None, help="default: runs/calc-demo[-verl]")
    ap.add_argument(
        "--engine",
        choices=("torch", "verl"),
        default="torch",
        help="the trainer engine (spec.trainer.engine); verl: FSDP workers on a local Ray (make demo-verl)",
    )
    ap.add_argument("--ablation", action="store_true", help="also train with sample-level normalisation")
    ap.add_argument("--smoke", action="store_true", help="a short warm-up and --steps steps; no goal")
    ap.add_argument("--steps", type=int, default=None, help="RL steps (default: the spec's; --smoke: 2)")
    args = ap.parse_args(argv)

    if args.out is None:
        args.out = Path("runs/calc-demo" if args.engine == "torch" else "runs/calc-demo-verl")
    started = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    warm = prepare_model(args.out, SMOKE_WARMUP if args.smoke else {})
    steps = args.steps if args.steps is not None else 2 if args.smoke else None
    overrides: dict[str, object] = {} if steps is None else {"spec.steps": steps}
    if args.engine != "torch":
        overrides["spec.trainer.engine"] = args.engine
    t = time.monotonic()
    main_metrics = train(args.out / "rollout-level", overrides)
    gain = report("rollout-level", main_metrics, time.monotonic() - t)
    total = time.monotonic() - started
    print(f"curve: {args.out / 'rollout-level' / 'reward.png'}")
    if args.smoke:
        return smoke_verdict(main_metrics, steps or 0)
    # The time limit is the torch engine's: on 2 cores the verl engine's two worker processes, gloo and
    # Ray's dispatch take longer (docs/results.md states both times); the learning goal is the same.
    limit = LIMIT_SECONDS if args.engine == "torch" else None
    ok = gain >= GOAL and (limit is None or total <= limit)
    within = f" within {limit // 60} minutes" if limit else ""
    print(
        f"\ngoal: gain >= {GOAL}{within}: gain {gain:+.3f} in {total:.0f}s "
        f"(warm-up {warm:.0f}s) -> {'met' if ok else 'NOT met'}"
    )
    results = {"rollout_level": {"gain": gain, "seconds": total, "met": ok}}

    if args.ablation:
        from inharness.trainer.report import plot_rewards

        t = time.monotonic()
        ablation = {"spec.algorithm.advantageLevel": "sample", "spec.algorithm.lossNormalization": "sample"}
        sample_metrics = train(args.out / "sample-level", {**overrides, **ablation})
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


def smoke_verdict(metrics: list[dict[str, object]], steps: int) -> int:
    """A smoke run passes when every step trained on samples and no rollout failed."""
    from inharness.trainer.report import smoke_problems

    problems = smoke_problems(metrics, steps)
    print(f"\nsmoke: {'; '.join(problems) if problems else 'every step trained, no rollout failed'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
