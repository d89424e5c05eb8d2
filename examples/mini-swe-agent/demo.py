"""`make demo-swe`: RL of a tiny model inside the unmodified mini-SWE-agent 2.4.6, on the CPU.

1. A teacher's recording: `inharness run trainingrun.yaml` on teacher tasks with the engine in scripted
   mode (family.teacher_script), so the real harness sends its real requests and runs a well-formed
   `echo ANSWER > answer.txt`, ANSWER cycling through the four whatever the task (family.py says why);
2. `inharness sft --from` that run's store: a random-init tiny model learns the harness's tool-call
   format and how to finish, into examples/mini-swe-agent/model (the spec's model.path);
3. `inharness run trainingrun.yaml`: RL with every completion sampled from the model being trained;
4. the reward curve, the time, and the goal: the mean reward of the last fifth of the steps at least
   0.3 above the first fifth, within 20 minutes on a 2-core machine, steps 1-3 included. The exit code
   is 0 exactly when it is met.

`--smoke` (for `make test`) is the same path, short: a smaller recording and warm-up, then `--steps` (2)
steps of the same spec; it checks that the run trains (every step has samples, no rollout failed).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import family  # noqa: E402

SPEC = HERE / "trainingrun.yaml"
MODEL = HERE / "model"
GOAL = 0.3
LIMIT_SECONDS = 20 * 60
CONTEXT = 8192  # mini's first prompt is 1.8k tokens of the tiny tokenizer; its step limit keeps it short
# 8 rows (2 per task), one recording step of 16 attempts: each word with each answer once; sft with the
# prompt outside the graph (inharness sft's default)
TEACHER = {"copies": 2, "batch": 8, "sft_steps": 200, "sft_batch": 4}
SMOKE_TEACHER = {"copies": 2, "batch": 8, "sft_steps": 4, "sft_batch": 4}
HARNESS = {"harness": "mini-SWE-agent 2.4.6", "protocol": "openai.chat (Chat Completions, via LiteLLM)"}


def record_teacher(out: Path, base: Path, copies: int, batch: int) -> Path:
    """The teacher's run: the unmodified harness on teacher tasks, the engine answering from the script."""
    from inharness.engine.script import SCRIPT_ENV
    from inharness.run import run_file

    tasks = family.write_teacher(out, copies)
    script = out / "teacher-script.json"
    run = out / "teacher"
    shutil.rmtree(run, ignore_errors=True)
    overrides = {
        "spec.model.path": str(base),
        "spec.dataset.path": str(out / "teacher-tasks.jsonl"),
        "spec.batchSize": batch,
        "spec.steps": len(tasks) // batch,
        "spec.algorithm.groupSize": 2,  # a task's two attempts get the same script: the least GRPO takes
        "spec.algorithm.ppoEpochs": 1,  # this run's own update is not used: its store is
    }
    os.environ[SCRIPT_ENV] = str(script)
    try:
        code = run_file(SPEC, run, overrides=overrides)
    finally:
        del os.environ[SCRIPT_ENV]
    if code != 0:
        raise SystemExit(f"demo: the teacher's run exited with code {code}")
    return run


def warm_up(teacher: Path, base: Path, steps: int, batch: int) -> None:
    """`inharness sft` on every succeeded attempt of the teacher's run, right or wrong: a --min-reward
    would keep only the right answers and teach the task, which is left to the reward."""
    from inharness.cli import main as cli

    shutil.rmtree(MODEL, ignore_errors=True)
    argv = ["sft", "--from", str(teacher), "--model", str(base), "--out", str(MODEL)]
    argv += ["--steps", str(steps), "--batch-size", str(batch)]
    if cli(argv) != 0:
        raise SystemExit("demo: inharness sft failed")


def train(out: Path, steps: int | None) -> list[dict[str, Any]]:
    from inharness.run import run_file
    from inharness.trainer.report import read_metrics

    shutil.rmtree(out, ignore_errors=True)
    code = run_file(SPEC, out, overrides={} if steps is None else {"spec.steps": steps})
    if code != 0:
        raise SystemExit(f"demo: inharness run exited with code {code}; the goal is not met")
    return read_metrics(out / "metrics.jsonl")


def describe(metrics: list[dict[str, Any]]) -> dict[str, Any]:
    """What the issue's reader asks of a real harness's run: its protocol, calls per rollout, new roots."""
    rollouts = sum(int(m["rollouts"]) for m in metrics)
    reasons: dict[str, int] = {}
    for m in metrics:
        for reason, n in m["root_reasons"].items():
            reasons[reason] = reasons.get(reason, 0) + n
    return {
        **HARNESS,
        "model_calls_per_rollout": sum(int(m["calls"]) for m in metrics) / max(rollouts, 1),
        "prefix_mismatches": sum(int(m["prefix_mismatches"]) for m in metrics),
        "root_reasons": reasons,
        "seconds_per_step": {
            "rollouts": sum(m["time_rollout_s"] for m in metrics) / max(len(metrics), 1),
            "update": sum(m["time_update_s"] for m in metrics) / max(len(metrics), 1),
        },
    }


def main(argv: list[str] | None = None) -> int:
    from inharness.engine.tiny import init_tiny
    from inharness.trainer.report import fifth_means

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("runs/mini-swe-agent-demo"))
    ap.add_argument(
        "--smoke", action="store_true", help="a short recording and warm-up, --steps steps; no goal"
    )
    ap.add_argument("--steps", type=int, default=None, help="RL steps (default: the spec's; --smoke: 2)")
    args = ap.parse_args(argv)
    teacher = SMOKE_TEACHER if args.smoke else TEACHER
    steps = args.steps if args.steps is not None else 2 if args.smoke else None

    started = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    args.out = args.out.resolve()  # the spec's overridden paths would resolve against the spec's folder
    base = init_tiny(args.out / "tiny", seed=0, context=CONTEXT)
    recorded = record_teacher(args.out, base, teacher["copies"], teacher["batch"])
    warm_up(recorded, base, teacher["sft_steps"], teacher["sft_batch"])
    warm = time.monotonic() - started
    print(f"\nwarm-up (recording + sft): {warm:.0f}s; model in {MODEL}\n")

    metrics = train(args.out / "rl", steps)
    total = time.monotonic() - started
    rewards = [float(m["reward_mean"]) for m in metrics]
    first, last = fifth_means(rewards)
    print("\nreward per step: " + " ".join(f"{r:.2f}" for r in rewards))
    print(f"first fifth {first:.3f}, last fifth {last:.3f}, gain {last - first:+.3f}")
    print(f"curve: {args.out / 'rl' / 'reward.png'}")
    facts = {**describe(metrics), "gain": last - first, "first_fifth": first, "last_fifth": last}
    facts |= {"seconds": total, "warmup_seconds": warm}
    if args.smoke:
        (args.out / "demo.json").write_text(json.dumps(facts, indent=2))
        return smoke_verdict(metrics, steps or 0)
    ok = last - first >= GOAL and total <= LIMIT_SECONDS
    print(
        f"\ngoal: gain >= {GOAL} within {LIMIT_SECONDS // 60} minutes: "
        f"gain {last - first:+.3f} in {total:.0f}s (warm-up {warm:.0f}s) -> {'met' if ok else 'NOT met'}"
    )
    (args.out / "demo.json").write_text(json.dumps({**facts, "met": ok}, indent=2))
    return 0 if ok else 1


def smoke_verdict(metrics: list[dict[str, Any]], steps: int) -> int:
    """A smoke run passes when every step trained on samples and no rollout failed."""
    from inharness.trainer.report import smoke_problems

    problems = smoke_problems(metrics, steps)
    print(f"\nsmoke: {'; '.join(problems) if problems else 'every step trained, no rollout failed'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
