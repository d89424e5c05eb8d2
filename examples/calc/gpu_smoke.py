"""`make gpu-smoke`: a few collocated-async steps of the calc example on one GPU, with verl training and
vLLM serving the gateway's calls on the same GPU, through the real gateway and harness subprocesses.

For a machine with one CUDA GPU and the trainer image's packages (docker/Dockerfile.trainer: CUDA torch,
vLLM, verl, inharness), no network needed: the model is made here (init-tiny + the smoke warm-up).

    make gpu-smoke GPU_PYTHON=/opt/inharness/bin/python     # in the trainer image, or any such environment

It writes `gpu-smoke.json` (under $OUT when set, else --out) with what it measured:
- per step: reward, generated tokens, the step-time split (waiting for rollouts, update, publish,
  calls held), and generation and training throughput;
- totals: generated tokens/s while rollouts ran, trained tokens/s during updates (the generated
  tokens the update learns from; its forward passes cover the prompts too), peak GPU memory
  used (nvidia-smi, sampled every 0.2 s: vLLM and the FSDP workers together), wall time;
- the verdict: every step trained, no rollout failed, within the time limit (8 minutes).
Exit 0 when the verdict is ok, 1 when not, 2 when this machine cannot run it (the message says why).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

LIMIT_SECONDS = 480
STEPS = 4
OVERRIDES: dict[str, object] = {
    "spec.trainer.engine": "verl",
    "spec.trainer.gpus": 1,
    "spec.trainer.inference": "vllm",
    # the tiny model needs little: most of the GPU stays with the FSDP workers while vLLM sleeps
    "spec.trainer.vllm.gpuMemoryUtilization": 0.3,
    "spec.trainer.vllm.maxModelLen": 2048,  # the tiny model's context
    "spec.scheduling.mode": "collocated-async",
    "spec.scheduling.maxStaleness": 1,
}


def missing() -> list[str]:
    """What this machine lacks for the smoke run, in words (empty: it can run)."""
    out = []
    try:
        import torch
    except ImportError:
        return ["torch is not installed"]
    if not torch.cuda.is_available():
        out.append(f"no CUDA GPU that torch {torch.__version__} can use")
    for package in ("vllm", "verl"):
        try:
            importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            out.append(f"{package} is not installed")
    if shutil.which("nvidia-smi") is None:
        out.append("nvidia-smi is not on PATH (peak GPU memory is read from it)")
    return out


class PeakMemory:
    """The highest GPU memory in use (MiB, summed over the GPUs) that nvidia-smi reported while running."""

    def __init__(self, interval: float = 0.2) -> None:
        self.interval = interval
        self.peak_mib = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="gpu-memory", daemon=True)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        query = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"]
        while not self._stop.is_set():
            done = subprocess.run(query, capture_output=True, text=True, check=False)
            used = [int(x) for x in done.stdout.split() if x.strip().isdigit()]
            self.peak_mib = max(self.peak_mib, sum(used))
            self._stop.wait(self.interval)


def summarize(metrics: list[dict[str, Any]], *, steps: int, seconds: float, peak_mib: int) -> dict[str, Any]:
    """The report of a finished smoke run from its metrics.jsonl rows (one per step)."""
    from inharness.trainer.report import smoke_problems

    rows = []
    for m in metrics:
        rollout, update = float(m["time_rollout_s"]), float(m["time_update_s"])
        tokens = int(m["tokens"])
        rows.append(
            {
                "step": m["step"],
                "reward_mean": m["reward_mean"],
                "generated_tokens": tokens,
                "time_rollout_s": rollout,
                "time_update_s": update,
                "time_publish_s": m["time_publish_s"],
                "time_calls_held_s": m["time_calls_held_s"],
                "time_step_s": m["time_step_s"],
                "generation_tokens_per_s": tokens / rollout if rollout > 0 else None,
                "training_tokens_per_s": tokens / update if update > 0 else None,
            }
        )
    generated = sum(r["generated_tokens"] for r in rows)
    rollout_s = sum(r["time_rollout_s"] for r in rows)
    update_s = sum(r["time_update_s"] for r in rows)
    problems = smoke_problems(metrics, steps)
    if seconds > LIMIT_SECONDS:
        problems.append(f"took {seconds:.0f} s, over the {LIMIT_SECONDS} s limit")
    return {
        "steps": rows,
        "generated_tokens": generated,
        "generation_tokens_per_s": generated / rollout_s if rollout_s > 0 else None,
        "training_tokens_per_s": generated / update_s if update_s > 0 else None,
        "peak_gpu_memory_mib": peak_mib,
        "seconds": seconds,
        "ok": not problems,
        "problems": problems,
    }


def versions() -> dict[str, str]:
    found = {}
    for package in ("torch", "vllm", "verl", "transformers", "ray", "inharness"):
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[package] = "absent"
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("runs/gpu-smoke"), help="the run's directory")
    ap.add_argument("--steps", type=int, default=STEPS, help=f"RL steps (default {STEPS})")
    args = ap.parse_args(argv)

    lacking = missing()
    if lacking:
        print(
            "gpu-smoke: this machine cannot run it: " + "; ".join(lacking) + ". It needs one CUDA GPU and "
            "the trainer image's packages (docker/Dockerfile.trainer); run it there: "
            "make gpu-smoke GPU_PYTHON=/opt/inharness/bin/python",
            file=sys.stderr,
        )
        return 2
    sys.path.insert(0, str(HERE))
    from demo import SMOKE_WARMUP, prepare_model

    from inharness.run import run_file
    from inharness.trainer.report import read_metrics

    report_dir = Path(os.environ.get("OUT") or args.out)
    started = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    prepare_model(args.out, SMOKE_WARMUP)
    run_dir = args.out / "run"
    shutil.rmtree(run_dir, ignore_errors=True)
    with PeakMemory() as memory:
        code = run_file(HERE / "trainingrun.yaml", run_dir, overrides={**OVERRIDES, "spec.steps": args.steps})
    seconds = time.monotonic() - started
    metrics = read_metrics(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").is_file() else []
    report = summarize(metrics, steps=args.steps, seconds=seconds, peak_mib=memory.peak_mib)
    report["versions"] = versions()
    report["run_exit_code"] = code
    if code != 0:
        report["ok"] = False
        report["problems"].append(f"inharness run exited with {code} (logs: {run_dir / 'logs'})")
    report_dir.mkdir(parents=True, exist_ok=True)
    (report_dir / "gpu-smoke.json").write_text(json.dumps(report, indent=2))
    for row in report["steps"]:
        print(
            f"step {row['step']}: reward {row['reward_mean']:.2f}, rollouts {row['time_rollout_s']:.1f}s, "
            f"update {row['time_update_s']:.1f}s, publish {row['time_publish_s']:.1f}s"
        )
    print(
        f"gpu-smoke: {report['generation_tokens_per_s'] or 0:.0f} generated tok/s, "
        f"{report['training_tokens_per_s'] or 0:.0f} trained tok/s, peak GPU memory "
        f"{memory.peak_mib} MiB, {seconds:.0f}s -> {'ok' if report['ok'] else '; '.join(report['problems'])}"
    )
    print(f"report: {report_dir / 'gpu-smoke.json'}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
