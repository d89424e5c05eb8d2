"""Running a real harness's example (examples/<harness>/trainingrun.yaml) under `inharness run`, and
reading back what the gateway recorded. The harness binaries come from `make harnesses` (into
.cache/harnesses); a test without them skips and names the make target."""

from __future__ import annotations

import asyncio
import json
import math
import os
import sqlite3
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from inharness.engine.script import SCRIPT_ENV
from inharness.engine.tiny import init_tiny
from inharness.gateway.store import Store

REPO = Path(__file__).resolve().parents[2]
HARNESSES = REPO / ".cache" / "harnesses"
CONTEXT = 65536  # a real harness's first request is 10-30k tokens of the tiny tokenizer


def require(binary: Path, stamp: str) -> Path:
    """The installed harness, or a skip naming the make target that installs it."""
    if not binary.exists():
        pytest.skip(f"{binary.relative_to(REPO)} is not installed: run `make {stamp}` (or `make harnesses`)")
    return binary


def run_installed(
    example: str,
    binary: Path,
    stamp: str,
    factory: pytest.TempPathFactory,
    *,
    harness_env: dict[str, str] | None = None,
    training: dict[str, Any] | None = None,
    scripted: bool = True,
    timeout: float = 240,
) -> Run:
    """The example's run (a tiny model with a large context, the example's engine script unless not
    ``scripted``), or a skip when its harness is not installed."""
    require(binary, stamp)
    tmp = factory.mktemp(example)
    model = init_tiny(tmp / "model", seed=0, context=CONTEXT)
    return run_example(
        example, tmp, model, harness_env=harness_env, training=training, scripted=scripted, timeout=timeout
    )


def check_task_done(attempt: Path) -> None:
    """The examples' task: the harness's tool call wrote hello.txt, and the reward says so."""
    assert (attempt / "workspace" / "hello.txt").read_text() == "hi\n"
    assert json.loads((attempt / "result.json").read_text())["reward"] == 1


@dataclass
class Call:
    attempt_id: str
    protocol: str
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    parent_call_id: str | None
    id: str
    prefix_mismatch: str | None
    finish_reason: str
    request: dict[str, Any]
    response: Any


@dataclass
class Run:
    out: Path
    proc: subprocess.CompletedProcess[str]
    calls: list[Call]
    metrics: list[dict[str, Any]]

    def attempts(self) -> dict[str, list[Call]]:
        by: dict[str, list[Call]] = {}
        for call in self.calls:
            by.setdefault(call.attempt_id, []).append(call)
        return by

    def attempt_dirs(self) -> list[Path]:
        return sorted(p for p in (self.out / "attempts").iterdir() if p.is_dir())


def run_example(
    example: str,
    tmp: Path,
    model: Path,
    *,
    harness_env: dict[str, str] | None = None,
    training: dict[str, Any] | None = None,
    scripted: bool = True,
    timeout: float = 300,
) -> Run:
    """`inharness run` on a copy of examples/<example>/trainingrun.yaml whose model is `model` and whose
    harness runs in the example's folder, with the example's engine script (none, so the model samples,
    when not ``scripted``); ``harness_env`` replaces or
    adds variables of the HarnessSpec's env, ``training`` fields of the TrainingRun's spec (a dataset
    path in it is taken as it is)."""
    folder = REPO / "examples" / example
    docs = list(yaml.safe_load_all((folder / "trainingrun.yaml").read_text()))
    for doc in docs:
        if doc["kind"] == "HarnessSpec":
            doc["spec"]["workingDir"] = str(folder)
            env = {e["name"]: e["value"] for e in doc["spec"].get("env", [])} | (harness_env or {})
            doc["spec"]["env"] = [{"name": k, "value": v} for k, v in env.items()]
        if doc["kind"] == "TrainingRun":
            doc["spec"]["model"]["path"] = str(model)
            doc["spec"]["dataset"]["path"] = str(folder / doc["spec"]["dataset"]["path"])
            doc["spec"].update(training or {})
    spec = tmp / "run.yaml"
    spec.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    out = tmp / "out"
    argv = [sys.executable, "-m", "inharness.cli", "run", spec.name, "--out", "out"]
    run_env = {**os.environ, "TQDM_DISABLE": "1"}
    run_env.pop(SCRIPT_ENV, None)
    if scripted:
        run_env[SCRIPT_ENV] = str(folder / "script.json")
    proc = subprocess.run(argv, cwd=tmp, capture_output=True, text=True, timeout=timeout, env=run_env)
    calls = read_calls(out / "gateway.db") if (out / "gateway.db").exists() else []
    metrics_file = out / "metrics.jsonl"
    metrics = [json.loads(x) for x in metrics_file.read_text().splitlines()] if metrics_file.exists() else []
    return Run(out, proc, calls, metrics)


def read_calls(db: Path) -> list[Call]:
    """Every recorded call, read through the store (a continuation is stored as its new ids only; the
    store gives its whole prompt back), in the order they started."""

    async def read() -> list[Any]:
        store = await Store.open(f"sqlite:///{db}")
        try:
            with sqlite3.connect(db) as conn:
                ids = [r[0] for r in conn.execute("select id from attempts")]
            return [c for attempt_id in ids for c in await store.list_calls(attempt_id)]
        finally:
            await store.close()

    return [
        Call(
            attempt_id=c.attempt_id,
            protocol=c.protocol,
            prompt_ids=c.prompt_ids,
            response_ids=c.response_ids,
            logprobs=c.response_logprobs,
            parent_call_id=c.parent_call_id,
            id=c.id,
            prefix_mismatch=c.prefix_mismatch,
            finish_reason=c.finish_reason,
            request=c.request or {},
            response=c.response,
        )
        for c in sorted(asyncio.run(read()), key=lambda c: c.started_at)
    ]


def check_recorded(run: Run, protocol: str, *, attempts: int) -> None:
    """Every model call of every attempt recorded under it, in the harness's protocol, with prompt and
    response ids and a finite logprob per response token."""
    assert run.proc.returncode == 0, run.proc.stdout[-3000:] + run.proc.stderr[-3000:]
    assert len(run.attempts()) == attempts, [c.attempt_id for c in run.calls]
    for call in run.calls:
        assert call.protocol == protocol
        assert call.prompt_ids and call.response_ids
        assert len(call.logprobs) == len(call.response_ids)
        assert all(math.isfinite(x) and x <= 0 for x in call.logprobs)


def check_merged(run: Run, *, turns: int) -> None:
    """A multi-turn attempt is one chain: each turn's prompt starts with the previous turn's prompt and
    response ids exactly (the gateway reused them, no mismatch), and the trainer merged each rollout's
    calls into one sample."""
    for attempt_id, calls in run.attempts().items():
        chain = [c for c in calls if c.parent_call_id is not None or c is calls[0]]
        assert len(chain) >= turns, (attempt_id, len(calls))
        by_id = {c.id: c for c in calls}
        for call in chain[1:]:
            parent = by_id[call.parent_call_id]  # type: ignore[index]
            assert call.prefix_mismatch is None
            assert call.prompt_ids[: len(parent.prompt_ids) + len(parent.response_ids)] == (
                parent.prompt_ids + parent.response_ids
            )
    (step,) = run.metrics
    assert step["prefix_mismatches"] == 0, step
    assert step["logprob_mismatch"] < 1e-3, step  # the recorded logprobs are the trained model's
