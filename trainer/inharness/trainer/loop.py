"""The training loop: enqueue batches of tasks, wait for their groups, train, publish the next version.

It talks only to the gateway (rollout queue, export, model versions, serving pause) and to the
engines' weight-load endpoint, so the same loop drives rollouts that run as local processes or as
pods. Every batch it creates is journalled before it waits for it, and a checkpoint records the
step, the model version and the export cursor: a resumed run re-creates nothing and loses nothing.

Scheduling: `max_staleness` K = 0 is synchronous (batch k is created after version k is served);
K ≥ 1 keeps up to K later batches running while batch k trains, so a sample may come from a
version up to K behind the one it updates (each sample records its versions; `staleness_max`).
Batches a resumed run adopts beyond that window are held in the gateway (not claimable) until the
window reaches them, so a resume never serves a batch from an older version than a run would.

A step needs samples: a batch in which no rollout produced a trainable sample ends the run with
`NoTrainableSamples` rather than publishing a version trained on nothing.
"""

import asyncio
import json
import logging
import math
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import aiohttp
import httpx

from inharness.gateway.client import GatewayClient, GatewayError
from inharness.gateway.schema import ExportedRollout, ProgressReport, ProgressState
from inharness.trainer.config import LoopConfig, UpdateConfig
from inharness.trainer.report import append_metrics, root_reasons, truncate_metrics
from inharness.trainer.samples import Sample, build_batch

log = logging.getLogger("inharness.trainer")

# Keys of the loop's own metrics; the policy's metrics of the same name are kept with a prefix.
_OWN_KEYS = {"step", "version", "samples", "tokens", "rollouts", "calls"}


class Policy(Protocol):
    """The training engine as the loop sees it (`torch_engine.TorchTrainingEngine` on the CPU)."""

    def update(self, samples: list[Sample], config: UpdateConfig) -> dict[str, float]: ...
    def save_pretrained(self, out_dir: Path) -> Path: ...
    def save_checkpoint(self, out_dir: Path) -> None: ...
    def load_checkpoint(self, in_dir: Path) -> None: ...


class NoTrainableSamples(Exception):
    """Batch `batch` finished without a single trainable sample: every rollout failed (or none
    called the model). Training on it would publish an unchanged model as a new version."""

    def __init__(self, batch: int, rollouts: list[ExportedRollout]) -> None:
        failed = sum(1 for r in rollouts if r.rollout.status == "failed")
        calls = sum(len(r.calls) for r in rollouts)
        super().__init__(
            f"batch {batch}: no trainable sample: {failed} of {len(rollouts)} rollouts failed, "
            f"{calls} model calls recorded"
        )
        self.batch = batch


@dataclass
class LoopState:
    """What a checkpoint stores besides the policy; `journal` maps batch -> its rollout ids."""

    step: int = 0  # next step to train
    version: int = 0  # model version being served
    cursor: int = 0  # export cursor: every finished rollout at or before it has been seen
    journal: dict[int, list[str]] = field(default_factory=dict)
    wall_seconds: float = 0.0  # training time up to this state, over every process of the run

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "journal": {str(k): v for k, v in self.journal.items()}}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "LoopState":
        return cls(
            step=data["step"],
            version=data["version"],
            cursor=data["cursor"],
            journal={int(k): v for k, v in data["journal"].items()},
            wall_seconds=data.get("wall_seconds", 0.0),
        )


class RunDir:
    """The layout of a run's output directory."""

    def __init__(self, root: Path, *, checkpoints: Path | None = None) -> None:
        self.root = root
        self.metrics = root / "metrics.jsonl"
        self.reward_png = root / "reward.png"
        self.summary = root / "summary.json"
        self.checkpoints = checkpoints or root / "checkpoints"
        self.weights = root / "weights"
        self.journal = root / "journal.jsonl"
        self.logs = root / "logs"
        self.attempts = root / "attempts"

    def latest_checkpoint(self) -> Path | None:
        done = sorted(
            (p for p in self.checkpoints.glob("step-*") if (p / "state.json").exists()),
            key=lambda p: int(p.name.split("-")[1]),
        )
        return done[-1] if done else None


def batch_tasks(tasks: list[Any], batch: int, batch_size: int, seed: int) -> list[Any]:
    """Batch k's tasks: consecutive slices of one seeded shuffle per epoch, the same on every run."""
    out: list[Any] = []
    start = batch * batch_size
    while len(out) < batch_size:
        epoch, offset = divmod(start + len(out), len(tasks))
        order = list(range(len(tasks)))
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
        out.append(tasks[order[offset]])
    return out


class TrainingLoop:
    def __init__(
        self,
        *,
        gateway: GatewayClient,
        engine_urls: list[str],
        policy: Policy,
        tasks: list[Any],
        config: LoopConfig,
        run_dir: RunDir,
        state: LoopState,
        on_progress: Callable[[str, dict[str, Any]], None] | None = None,
        engine_wait_seconds: float = 0.0,
        engine_api_key: str | None = None,
    ) -> None:
        self.gw = gateway
        self._engine_auth = {} if engine_api_key is None else {"Authorization": f"Bearer {engine_api_key}"}
        self.engine_wait_seconds = engine_wait_seconds
        self.engine_urls = engine_urls
        self.policy = policy
        self.tasks = tasks
        self.cfg = config
        self.dir = run_dir
        self.state = state
        self._progress = on_progress or (lambda _event, _data: None)
        self._finished: dict[str, ExportedRollout] = {}  # finished rollouts of batches not yet trained
        self._read_cursor = state.cursor
        self._held: set[int] = set()  # adopted batches beyond the staleness window, held in the gateway
        self.write_errors: list[str] = []  # outputs that could not be written; training went on
        # Batches created after the last checkpoint are in the journal file: adopt them, never re-create.
        if run_dir.journal.exists():
            for line in run_dir.journal.read_text().splitlines():
                entry = json.loads(line)
                if entry["batch"] >= state.step:
                    state.journal.setdefault(entry["batch"], entry["rollouts"])

    async def hold_adopted(self) -> None:
        """Hold the adopted batches that lie beyond the staleness window (a sync run's next batch,
        created by a run that died after its checkpoint): call it before rollouts are claimed."""
        window = self.state.step + self.cfg.max_staleness
        self._held = {b for b in self.state.journal if b > window}
        ids = [i for b in sorted(self._held) for i in self.state.journal[b]]
        if ids:
            await self.gw.hold(ids)

    async def run(self, stop: asyncio.Event) -> None:
        truncate_metrics(self.dir.metrics, before_step=self.state.step)
        start, wall_before = time.monotonic(), self.state.wall_seconds
        while self.state.step < self.cfg.steps and not stop.is_set():
            step = self.state.step
            t0 = time.monotonic()
            await self._enqueue_up_to(min(step + self.cfg.max_staleness, self.cfg.steps - 1))
            rollouts = await self._wait_for_batch(step, stop)
            if rollouts is None:
                return
            t1 = time.monotonic()
            samples, stats = build_batch(rollouts, max_tokens=self.cfg.max_tokens_per_sample)
            trainable = [s for s in samples if s.reward is not None]
            if not trainable:
                raise NoTrainableSamples(step, rollouts)
            update = await asyncio.to_thread(self.policy.update, trainable, self.cfg.update)
            t2 = time.monotonic()
            await self._publish(self.state.version + 1)
            t3 = time.monotonic()
            for r in rollouts:
                self._finished.pop(r.rollout.id, None)
            self.state.step += 1
            self.state.cursor = self._safe_cursor()
            self.state.wall_seconds = wall_before + (t3 - start)
            metrics = self._metrics(step, rollouts, trainable, stats, update, (t0, t1, t2, t3))
            self._write(f"metrics of step {step}", append_metrics, self.dir.metrics, metrics)
            self._progress("step", metrics)
            last = self.state.step == self.cfg.steps
            if last or self.state.step % self.cfg.checkpoint_interval == 0:
                await asyncio.to_thread(self._write, f"checkpoint step-{self.state.step}", self.checkpoint)
            await self.report("complete" if last else "running", reward_mean=metrics["reward_mean"])

    def _write(self, what: str, write: Callable[..., Any], *args: Any) -> None:
        """An output write that must not end the run (a full or read-only disk): say what was not
        written and go on. Weights are not written this way: without them nothing can be served."""
        try:
            write(*args)
        except OSError as exc:
            message = f"could not write {what}: {exc}"
            self.write_errors.append(message)
            log.error(message)

    async def report(
        self, state: ProgressState, *, reward_mean: float | None = None, message: str | None = None
    ) -> None:
        """Tell the gateway where training stands (the operator shows it in the run's status). A
        report that does not get through is logged and training goes on: it is for watching only."""
        report = ProgressReport(
            step=self.state.step,
            total_steps=self.cfg.steps,
            state=state,
            reward_mean=None if reward_mean is None or math.isnan(reward_mean) else reward_mean,
            message=message,
            config_sha256=self.cfg.config_sha256,
        )
        try:
            await self.gw.report_progress(report)
        except (GatewayError, httpx.HTTPError) as exc:
            log.warning("progress report for step %d not delivered: %s", self.state.step, exc)

    # -- rollouts ----------------------------------------------------------------------------

    async def _enqueue_up_to(self, last_batch: int) -> None:
        for batch in range(self.state.step, last_batch + 1):
            if batch in self._held:
                await self.gw.unhold(self.state.journal[batch])
                self._held.discard(batch)
            if batch in self.state.journal:
                continue
            tasks = batch_tasks(self.tasks, batch, self.cfg.batch_size, self.cfg.seed)
            created = await self.gw.create_rollouts(
                tasks,
                group_size=self.cfg.group_size,
                labels={"run": self.cfg.run_name, "batch": str(batch)},
                pool=self.cfg.pool,
                max_attempts=self.cfg.max_attempts,
            )
            self.state.journal[batch] = [r.id for r in created]
            with self.dir.journal.open("a") as f:
                f.write(json.dumps({"batch": batch, "rollouts": self.state.journal[batch]}) + "\n")
            self._progress("enqueued", {"batch": batch, "rollouts": len(created)})

    async def _wait_for_batch(self, batch: int, stop: asyncio.Event) -> list[ExportedRollout] | None:
        wanted = self.state.journal[batch]
        wanted_set = set(wanted)
        pending = {b: set(ids) for b, ids in self.state.journal.items() if b >= self.state.step}
        delay = 0.05
        while not stop.is_set():
            try:
                async for item in self.gw.export(after=self._read_cursor):
                    self._read_cursor = item.cursor
                    if any(item.rollout.id in ids for ids in pending.values()):
                        self._finished[item.rollout.id] = item
            except httpx.TransportError as exc:  # a gateway that died mid-stream: read on once it is back
                log.warning("export of batch %d interrupted, reading on: %r", batch, exc)
            done = sum(1 for i in wanted if i in self._finished)
            self._progress("rollouts", {"batch": batch, "done": done, "total": len(wanted)})
            if wanted_set <= self._finished.keys():
                return [self._finished[i] for i in wanted]
            try:
                await asyncio.wait_for(stop.wait(), delay)
            except TimeoutError:
                delay = min(delay * 1.5, 0.5)
        return None

    def _safe_cursor(self) -> int:
        """The export cursor a resumed run may start from without missing a rollout it still needs."""
        waiting = [r.cursor for r in self._finished.values()]
        return min(waiting) - 1 if waiting else self._read_cursor

    # -- versions ----------------------------------------------------------------------------

    async def _publish(self, version: int) -> None:
        """Serve the updated weights as `version`; harness calls wait in the gateway meanwhile."""
        path = await asyncio.to_thread(self.policy.save_pretrained, self.dir.weights / f"v{version}")
        await self.gw.pause(drain_seconds=60)
        try:
            for url in self.engine_urls:
                await self._load_weights(url, path, version)
            await self.gw.register_version(version, self.engine_urls, activate=True)
        finally:
            await self.gw.resume()
        self.state.version = version
        stale = self.dir.weights / f"v{version - 2}"
        if stale.exists():
            shutil.rmtree(stale)

    async def _load_weights(self, url: str, path: Path, version: int) -> None:
        """Load `path` into the engine at `url`; an engine that cannot be reached is waited for (up
        to `engine_wait_seconds`: a supervisor may be restarting it), one that refuses is an error. With
        an engine API key the request carries it (`inharness.engine.auth`); the engine takes only paths
        under its weights root, which `inharness train` sets to the directory `path` is in."""
        deadline = time.monotonic() + self.engine_wait_seconds
        delay = 0.2
        load = {"path": str(path)}
        while True:
            try:
                async with (
                    aiohttp.ClientSession() as session,
                    session.post(
                        f"{url}/v1/inharness/load_weights", json=load, headers=self._engine_auth
                    ) as r,
                ):
                    if r.status != 200:
                        raise RuntimeError(
                            f"engine {url} refused the weights of version {version}: {await r.text()}"
                        )
                    return
            except aiohttp.ClientConnectionError as exc:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"engine {url} unreachable while loading version {version}: {exc}"
                    ) from exc
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)

    # -- checkpoints -------------------------------------------------------------------------

    def checkpoint(self) -> Path:
        target = self.dir.checkpoints / f"step-{self.state.step}"
        tmp = target.with_name(target.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        self.policy.save_checkpoint(tmp / "policy")
        (tmp / "state.json").write_text(json.dumps(self.state.to_json()))
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)  # a checkpoint is complete or absent, never half-written
        kept = sorted(
            self.dir.checkpoints.glob("step-*"), key=lambda p: int(p.name.split("-")[1].split(".")[0])
        )
        for old in kept[: -self.cfg.checkpoint_keep]:
            shutil.rmtree(old, ignore_errors=True)
        return target

    # -- metrics -----------------------------------------------------------------------------

    def _metrics(
        self,
        step: int,
        rollouts: list[ExportedRollout],
        samples: list[Sample],
        stats: Any,
        update: dict[str, float],
        times: tuple[float, float, float, float],
    ) -> dict[str, Any]:
        ok = [
            r.rollout.reward
            for r in rollouts
            if r.rollout.status == "succeeded" and r.rollout.reward is not None
        ]
        mean = sum(ok) / len(ok) if ok else math.nan
        std = math.sqrt(sum((x - mean) ** 2 for x in ok) / len(ok)) if ok else math.nan
        calls = [c for r in rollouts for c in r.calls]
        versions = [v for s in samples for v in s.model_versions]
        t0, t1, t2, t3 = times
        return {
            **{f"update_{k}" if k in _OWN_KEYS else k: update[k] for k in sorted(update)},
            "step": step,
            "version": self.state.version,
            "reward_mean": mean,
            "reward_std": std,
            "accuracy": sum(1 for x in ok if x >= 1.0) / len(ok) if ok else math.nan,
            "rollouts": len(rollouts),
            "failed_rollouts": sum(1 for r in rollouts if r.rollout.status == "failed"),
            "calls": len(calls),
            "samples": len(samples),
            "tokens": sum(s.num_generated_tokens for s in samples),
            "merged_turn_ratio": stats.merged_turn_ratio,
            "splits": dict(stats.splits),
            "prefix_mismatches": sum(1 for c in calls if c.prefix_mismatch),
            "root_reasons": root_reasons(calls),
            # trained on version - 1 (the update just published `version`)
            "staleness_max": (self.state.version - 1 - min(versions)) if versions else 0,
            "time_rollout_s": t1 - t0,
            "time_update_s": t2 - t1,
            "time_publish_s": t3 - t2,
            "time_step_s": t3 - t0,
            "wall_s": self.state.wall_seconds,
        }
