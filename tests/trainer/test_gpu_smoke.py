"""`make gpu-smoke` (examples/calc/gpu_smoke.py) where it cannot run, and its report from metrics rows.

The smoke run itself needs one CUDA GPU with vLLM (the trainer image); here it must say so and stop
before it starts anything, and its arithmetic is checked on hand-made rows."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("gpu_smoke", REPO / "examples" / "calc" / "gpu_smoke.py")
assert _spec is not None and _spec.loader is not None
gpu_smoke = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_smoke)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_without_a_gpu_it_says_what_it_needs_and_starts_nothing(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "examples" / "calc" / "gpu_smoke.py"), "--out", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "gpu-smoke: this machine cannot run it: no CUDA GPU that torch" in done.stderr
    assert "vllm is not installed" in done.stderr
    assert "make gpu-smoke GPU_PYTHON=/opt/inharness/bin/python" in done.stderr
    assert not (tmp_path / "run").exists()


def _row(step: int, tokens: int, rollout: float, update: float, **extra: object) -> dict[str, object]:
    return {
        "step": step,
        "reward_mean": 0.5 + step / 10,
        "tokens": tokens,
        "samples": 8,
        "failed_rollouts": 0,
        "time_rollout_s": rollout,
        "time_update_s": update,
        "time_publish_s": 0.5,
        "time_calls_held_s": update + 0.5,
        "time_step_s": rollout + update + 0.5,
        **extra,
    }


def test_the_report_divides_tokens_by_the_time_each_phase_took() -> None:
    rows = [_row(0, 300, 3.0, 1.0), _row(1, 500, 2.0, 4.0)]
    got = gpu_smoke.summarize(rows, steps=2, seconds=100.0, peak_mib=4096)
    assert [s["generation_tokens_per_s"] for s in got["steps"]] == [100.0, 250.0]
    assert [s["training_tokens_per_s"] for s in got["steps"]] == [300.0, 125.0]
    assert got["generated_tokens"] == 800
    assert got["generation_tokens_per_s"] == 800 / 5.0 and got["training_tokens_per_s"] == 800 / 5.0
    assert (got["peak_gpu_memory_mib"], got["ok"], got["problems"]) == (4096, True, [])


def test_the_report_fails_a_run_that_missed_steps_lost_rollouts_or_ran_over_time() -> None:
    rows = [_row(0, 300, 3.0, 1.0, failed_rollouts=2)]
    got = gpu_smoke.summarize(rows, steps=2, seconds=gpu_smoke.LIMIT_SECONDS + 1, peak_mib=0)
    assert not got["ok"]
    assert got["problems"] == [
        "steps [0], expected 0..1",
        "2 failed rollouts",
        f"took {gpu_smoke.LIMIT_SECONDS + 1} s, over the {gpu_smoke.LIMIT_SECONDS} s limit",
    ]
