"""The training loop: enqueue groups of rollouts, wait for them, train, publish the next version.

It talks only to the gateway (rollout queue, export, model versions, serving pause) and to the
inference servers through `inference.Inference`, so the same loop drives rollouts that run as local
processes or as pods, answered by inharness's engine or by vLLM. What to create, train or drop is
decided by `scheduler.Scheduler` (sync, async with a staleness bound K, collocated-async); the loop
carries its decisions out and feeds it events.

Nothing lost across restarts. The journal (`journal.jsonl`) gets one line per group created (its
slot and rollout ids), per stale drop and per trained step, each written once the gateway has
done it; a checkpoint records the step, the model version, the export cursor and the schedule
(the open groups and their rollouts). A resumed run replays the journal lines written after its
checkpoint: groups created since are adopted (never re-created), drops stay dropped, and groups
trained in steps after the checkpoint are trained again (those updates were lost with the process).
Groups a resumed run adopts beyond the window are held in the gateway (not claimable) until the
window reaches them, so a resume never serves a group from an older version than a run would.

A step needs samples: a batch in which no rollout produced a trainable sample ends the run with
`NoTrainableSamples` rather than publishing a version trained on nothing.
"""

import asyncio
import itertools
import json
import logging
import math
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx

from inharness.gateway.client import GatewayClient, GatewayError
from inharness.gateway.schema import ExportedRollout, ProgressReport, ProgressState
from inharness.trainer.config import LoopConfig, UpdateConfig
from inharness.trainer.inference import Inference
from inharness.trainer.report import append_metrics, root_reasons, truncate_metrics
from inharness.trainer.samples import Sample, build_batch
from inharness.trainer.scheduler import Decision, Scheduler, ScheduleState, scheduling_policy, slot_tasks

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
    """The groups of step `batch` finished without a single trainable sample: every rollout failed
    (or none called the model). Training on them would publish an unchanged model as a new version."""

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
    """What a checkpoint stores besides the policy; `journal` maps each open group (the keys of
    `schedule.open`) to its rollout ids."""

    step: int = 0  # next step to train
    version: int = 0  # model version being served
    cursor: int = 0  # export cursor: every finished rollout at or before it has been seen
    journal: dict[int, list[str]] = field(default_factory=dict)
    wall_seconds: float = 0.0  # training time up to this state, over every process of the run
    schedule: ScheduleState = field(default_factory=ScheduleState)

    def to_json(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "journal": {str(k): v for k, v in self.journal.items()},
            "schedule": self.schedule.to_json(),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "LoopState":
        if "schedule" not in data:
            raise ValueError(
                "this checkpoint was written by an inharness that journalled batches, not groups; "
                "it cannot be resumed by this version: start a new run (another --out)"
            )
        return cls(
            step=data["step"],
            version=data["version"],
            cursor=data["cursor"],
            journal={int(k): v for k, v in data["journal"].items()},
            wall_seconds=data.get("wall_seconds", 0.0),
            schedule=ScheduleState.from_json(data["schedule"]),
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
    """Batch k's tasks (slots k*batch_size onwards): consecutive slices of one seeded shuffle per epoch."""
    return slot_tasks(tasks, range(batch * batch_size, (batch + 1) * batch_size), seed)


class _CallHold:
    """A serving pause of the gateway around (part of) an update: harness calls wait in the gateway,
    none fails. Started at most once, ended in a `finally`; `seconds` is how long calls were held."""

    def __init__(self, gateway: GatewayClient) -> None:
        self._gw = gateway
        self._since: float | None = None
        self.seconds = 0.0

    async def start(self) -> None:
        if self._since is None:
            began = time.monotonic()
            await self._gw.pause(drain_seconds=60)
            self._since = began

    async def end(self) -> None:
        if self._since is not None:
            try:
                await self._gw.resume()
            finally:
                self.seconds, self._since = time.monotonic() - self._since, None


def _oldest_version(rollouts: list[ExportedRollout]) -> int | None:
    """The oldest model version that answered a call of these rollouts (None: they made no call)."""
    return min((c.model_version for r in rollouts for c in r.calls), default=None)


class TrainingLoop:
    def __init__(
        self,
        *,
        gateway: GatewayClient,
        inference: Inference,
        policy: Policy,
        tasks: list[Any],
        config: LoopConfig,
        run_dir: RunDir,
        state: LoopState,
        on_progress: Callable[[str, dict[str, Any]], None] | None = None,
    ) -> None:
        self.gw = gateway
        self.inference = inference
        self.policy = policy
        self.tasks = tasks
        self.cfg = config
        self.dir = run_dir
        self.state = state
        self.sched = Scheduler(
            scheduling_policy(config.scheduling_mode),
            batch_size=config.batch_size,
            max_staleness=config.max_staleness,
            steps=config.steps,
            state=state.schedule,
            version=state.version,
        )
        self._progress = on_progress or (lambda _event, _data: None)
        self._finished: dict[str, ExportedRollout] = {}  # finished rollouts of open groups
        self._read_cursor = state.cursor
        self._dropped = 0  # stale groups dropped since the last step's metrics
        self._run_start, self._wall_before = time.monotonic(), state.wall_seconds
        self.write_errors: list[str] = []  # outputs that could not be written; training went on
        self._replay_journal()
        self._group_of = {i: g for g, ids in state.journal.items() for i in ids}  # rollout -> open group

    def _replay_journal(self) -> None:
        """Adopt what the journal says happened after the checkpoint: groups created (never re-create
        them) and groups dropped (never train them). Trained lines are not replayed: a step after the
        checkpoint is trained again, as its update was lost with the process."""
        if not self.dir.journal.exists():
            return
        for line in self.dir.journal.read_text().splitlines():
            entry = json.loads(line)
            if "group" in entry and self.sched.replay_created(entry["group"], entry["slot"]):
                self.state.journal[entry["group"]] = entry["rollouts"]
            for group in entry.get("dropped", []):
                if self.sched.replay_dropped(group):  # dropped before the step the resumed run redoes
                    del self.state.journal[group]
                    self._dropped += 1

    async def hold_adopted(self) -> None:
        """Hold the adopted groups that lie beyond the window (a sync run's next batch, created by a
        run that died after its checkpoint): call it before rollouts are claimed."""
        ids = self._rollouts(self.sched.hold_beyond_window())
        if ids:
            await self.gw.hold(ids)

    async def run(self, stop: asyncio.Event) -> None:
        """Carry out the scheduler's decisions, reading finished rollouts in between, to the last step."""
        truncate_metrics(self.dir.metrics, before_step=self.state.step)
        self._run_start, self._wall_before = time.monotonic(), self.state.wall_seconds
        step_start, delay = time.monotonic(), 0.05
        while self.state.step < self.cfg.steps and not stop.is_set():
            decision = self.sched.decide()
            await self._carry_out(decision)
            if decision.update:
                await self._train(decision.update, step_start)
                step_start, delay = time.monotonic(), 0.05
            elif not await self._read_export():
                try:
                    await asyncio.wait_for(stop.wait(), delay)
                except TimeoutError:
                    delay = min(delay * 1.5, 0.5)

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

    # -- groups ------------------------------------------------------------------------------

    async def _carry_out(self, decision: Decision) -> None:
        """Drops first (journalled before their slots' new groups, as a replay needs them), then
        releases and creations; the update is `_train`'s."""
        if decision.drop:
            self._forget(decision.drop)
            self._dropped += len(decision.drop)
            self._journal({"dropped": list(decision.drop), "step": self.state.step, "reason": "stale"})
            log.info("dropped %d stale groups before step %d", len(decision.drop), self.state.step)
        if decision.release:
            await self.gw.unhold(self._rollouts(decision.release))
        by_batch = itertools.groupby(decision.create, key=lambda gs: gs[1] // self.cfg.batch_size)
        for batch, groups in by_batch:
            await self._create(batch, list(groups))

    async def _create(self, batch: int, groups: list[tuple[int, int]]) -> None:
        """Create `groups` ((group, slot) pairs of one batch, labelled with it) in one request, then
        journal each: a group is journalled only once the gateway holds it."""
        created = await self.gw.create_rollouts(
            slot_tasks(self.tasks, [slot for _, slot in groups], self.cfg.seed),
            group_size=self.cfg.group_size,
            labels={"run": self.cfg.run_name, "batch": str(batch)},
            pool=self.cfg.pool,
            max_attempts=self.cfg.max_attempts,
        )
        ids: dict[str, list[str]] = {}
        for r in created:  # task order, a group's rollouts together
            ids.setdefault(r.group_id, []).append(r.id)
        for (group, slot), rollouts in zip(groups, ids.values(), strict=True):
            self.state.journal[group] = rollouts
            self._group_of.update(dict.fromkeys(rollouts, group))
            self._journal({"group": group, "slot": slot, "rollouts": rollouts})
        self._progress("enqueued", {"batch": batch, "rollouts": len(created)})

    def _journal(self, entry: dict[str, Any]) -> None:
        with self.dir.journal.open("a") as f:
            f.write(json.dumps(entry) + "\n")

    def _rollouts(self, groups: Sequence[int]) -> list[str]:
        return [i for g in groups for i in self.state.journal[g]]

    def _forget(self, groups: Sequence[int]) -> None:
        """Trained or dropped groups: no longer waited for, nor kept in the next checkpoint."""
        for rollout in self._rollouts(groups):
            self._finished.pop(rollout, None)
            self._group_of.pop(rollout, None)
        for group in groups:
            del self.state.journal[group]

    async def _read_export(self) -> bool:
        """Read the rollouts finished since the last read and tell the scheduler of each group now
        complete; returns whether one is (then decide again at once)."""
        touched: set[int] = set()
        try:
            async for item in self.gw.export(after=self._read_cursor):
                self._read_cursor = item.cursor
                group = self._group_of.get(item.rollout.id)
                if group is not None:
                    self._finished[item.rollout.id] = item
                    touched.add(group)
        except httpx.TransportError as exc:  # a gateway that died mid-stream: read on once it is back
            log.warning("export before step %d interrupted, reading on: %r", self.state.step, exc)
        complete = [g for g in sorted(touched) if all(i in self._finished for i in self.state.journal[g])]
        for group in complete:
            finished = [self._finished[i] for i in self.state.journal[group]]
            self.sched.group_finished(group, _oldest_version(finished))
        self._progress("rollouts", {"batch": self.state.step, **self._rollout_progress()})
        return bool(complete)

    def _rollout_progress(self) -> dict[str, int]:
        """Finished rollouts of the batch_size groups nearest to complete among those the next update
        may take (in order: the oldest batch_size groups)."""
        done = sorted(
            (sum(i in self._finished for i in self.state.journal[g]) for g in self.sched.candidates()),
            reverse=True,
        )
        return {"done": sum(done[: self.cfg.batch_size]), "total": self.cfg.batch_size * self.cfg.group_size}

    def _safe_cursor(self) -> int:
        """The export cursor a resumed run may start from without missing a rollout it still needs."""
        waiting = [r.cursor for r in self._finished.values()]
        return min(waiting) - 1 if waiting else self._read_cursor

    # -- steps -------------------------------------------------------------------------------

    async def _train(self, groups: tuple[int, ...], started: float) -> None:
        """One step: train on `groups` (their samples whole: the engine packs micro-batches by its
        token budget), publish the next version, record the step."""
        step = self.state.step
        rollouts = [self._finished[i] for i in self._rollouts(groups)]
        t1 = time.monotonic()
        samples, stats = build_batch(rollouts, max_tokens=self.cfg.max_tokens_per_sample)
        trainable = [s for s in samples if s.reward is not None]
        if not trainable:
            raise NoTrainableSamples(step, rollouts)
        update, t2, held = await self._update_and_publish(trainable)
        t3 = time.monotonic()
        self.sched.update_done()
        self._forget(groups)
        self._journal({"trained": list(groups), "step": step})
        self.state.step += 1
        self.state.cursor = self._safe_cursor()
        self.state.wall_seconds = self._wall_before + (t3 - self._run_start)
        times = (started, t1, t2, t3)
        metrics = self._metrics(
            step, rollouts, trainable, stats, update, times, dropped=self._dropped, held_s=held
        )
        self._dropped = 0
        await self._record(step, metrics)

    async def _record(self, step: int, metrics: dict[str, Any]) -> None:
        self._write(f"metrics of step {step}", append_metrics, self.dir.metrics, metrics)
        self._progress("step", metrics)
        last = self.state.step == self.cfg.steps
        if last or self.state.step % self.cfg.checkpoint_interval == 0:
            await asyncio.to_thread(self._write, f"checkpoint step-{self.state.step}", self.checkpoint)
        await self.report("complete" if last else "running", reward_mean=metrics["reward_mean"])

    # -- versions ----------------------------------------------------------------------------

    async def _update_and_publish(self, samples: list[Sample]) -> tuple[dict[str, float], float, float]:
        """Train on `samples` and serve the result as the next version; returns the update's metrics,
        when the update ended, and how long harness calls were held: while the servers take the
        weights, and, where inference and training share devices, while the update trains too."""
        version = self.state.version + 1
        hold = _CallHold(self.gw)
        shared = self.inference.shares_devices
        try:
            if shared or self.sched.policy.hold_calls_during_update:
                await hold.start()
            if shared:
                await self.inference.release()
            update = await asyncio.to_thread(self.policy.update, samples, self.cfg.update)
            updated_at = time.monotonic()
            await hold.start()
            await self.inference.publish(version)
            await self.gw.register_version(version, self.inference.urls(), activate=True)
        finally:
            await hold.end()
        self.state.version = version
        stale = self.dir.weights / f"v{version - 2}"
        if stale.exists():
            shutil.rmtree(stale)
        return update, updated_at, hold.seconds

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
        *,
        dropped: int = 0,
        held_s: float = 0.0,
    ) -> dict[str, Any]:
        """The step's row of metrics.jsonl. `times`: when the step began (after the last publish),
        when its groups were ready, when the update ended, when the version was served. `dropped`:
        stale groups dropped since the last step; `held_s`: how long calls were held in the gateway."""
        ok = [
            r.rollout.reward
            for r in rollouts
            if r.rollout.status == "succeeded" and r.rollout.reward is not None
        ]
        mean = sum(ok) / len(ok) if ok else math.nan
        std = math.sqrt(sum((x - mean) ** 2 for x in ok) / len(ok)) if ok else math.nan
        calls = [c for r in rollouts for c in r.calls]
        trained_on = self.state.version - 1  # the update just published `version`
        lags = [trained_on - v for s in samples for v in s.model_versions]
        t0, t1, t2, t3 = times
        return {
            **{f"update_{k}" if k in _OWN_KEYS else k: update[k] for k in sorted(update)},
            "step": step,
            "version": self.state.version,
            "reward_mean": mean,
            "reward_std": std,
            "accuracy": sum(1 for x in ok if x >= 1.0) / len(ok) if ok else math.nan,
            "rollouts": len(rollouts),
            "groups_trained": len({r.rollout.group_id for r in rollouts}),
            "dropped_stale": dropped,
            "failed_rollouts": sum(1 for r in rollouts if r.rollout.status == "failed"),
            "calls": len(calls),
            "samples": len(samples),
            "tokens": sum(s.num_generated_tokens for s in samples),
            "merged_turn_ratio": stats.merged_turn_ratio,
            "splits": dict(stats.splits),
            "prefix_mismatches": sum(1 for c in calls if c.prefix_mismatch),
            "root_reasons": root_reasons(calls),
            "staleness_max": max(lags, default=0),
            "staleness_mean": sum(lags) / len(lags) if lags else 0.0,
            "time_rollout_s": t1 - t0,
            "time_update_s": t2 - t1,
            "time_publish_s": t3 - t2,
            "time_calls_held_s": held_s,
            "time_step_s": t3 - t0,
            "wall_s": self.state.wall_seconds,
        }
