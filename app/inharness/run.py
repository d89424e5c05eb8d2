"""`inharness run FILE.yaml`: the whole system on one machine, from the same spec a cluster takes.

Starts the engine (or, with `spec.trainer.inference: vllm`, verl's vLLM servers on the GPUs) and the
gateway (SQLite store in the output directory) on 127.0.0.1, the local rollout controller (one harness
subprocess per attempt, whatever the RolloutPool's backend: a pool with backend kubernetes, as the
operator runs it, runs here as local processes and its harness's image is not used), and the training
loop.

What a user can rely on: every path is absolute before a child sees it; the output directory is
locked for one run, and the children die with it (even under SIGKILL); a child that dies is
restarted (supervisor.py) and the attempts it failed are not charged; a run whose rollouts cannot
work stops with one message that says why; Ctrl-C stops cleanly (harnesses killed with their
process groups, in-flight attempts released, everything finished in the store and the last
checkpoint) and `--resume` continues from there.
"""

import asyncio
import json
import os
import secrets
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from inharness.procs import ServerProcess, free_port

if TYPE_CHECKING:
    from inharness.gateway.client import GatewayClient
    from inharness.operator.rollouts import ClaimingController
    from inharness.runlock import RunLock
    from inharness.supervisor import Supervisor
    from inharness.trainer.inference import Inference
    from inharness.trainer.loop import LoopState, NoTrainableSamples, RunDir, TrainingLoop


class _Progress:
    """Two progress bars (steps; rollouts of the batch being waited for) and one line per step."""

    def __init__(self, steps: int, done: int, controller: Any) -> None:
        from tqdm import tqdm

        self._tqdm = tqdm
        self.steps = tqdm(total=steps, initial=done, desc="steps", position=0, dynamic_ncols=True)
        self.rollouts = tqdm(total=0, desc="rollouts", position=1, dynamic_ncols=True, leave=False)
        self._controller = controller
        self._batch = -1

    def __call__(self, event: str, data: dict[str, Any]) -> None:
        if event == "rollouts":
            if data["batch"] != self._batch:
                self._batch = data["batch"]
                self.rollouts.reset(total=data["total"])
                self.rollouts.set_description(f"rollouts of batch {data['batch']}")
            self.rollouts.n = data["done"]
            c = self._controller
            counts = {"running": c.running, "failed": c.failed}
            if c.released:  # requeued uncharged: stopped, or the engine or gateway was down
                counts["released"] = c.released
            self.rollouts.set_postfix(counts, refresh=False)
            self.rollouts.refresh()
        elif event == "step":
            self.steps.update(1)
            self.steps.set_postfix(reward=f"{data['reward_mean']:.3f}", version=data["version"])
            self._tqdm.write(
                f"step {data['step']:>3}  reward {data['reward_mean']:.3f} ± {data['reward_std']:.3f}  "
                f"samples {data['samples']:>3}  tokens {data['tokens']:>5}  "
                f"loss {data.get('loss', float('nan')):+.4f}  "
                f"rollout {data['time_rollout_s']:.1f}s  update {data['time_update_s']:.1f}s"
            )

    def close(self) -> None:
        self.rollouts.close()
        self.steps.close()


def with_overrides(specs: Any, overrides: dict[str, Any]) -> Any:
    """The specs with TrainingRun fields replaced, by camelCase dotted path as written in YAML
    (e.g. {"spec.algorithm.advantageLevel": "sample"}), validated again like the file itself."""
    import dataclasses

    from inharness.operator.spec import TrainingRun

    if not overrides:
        return specs
    doc = specs.training_run.model_dump(by_alias=True, exclude_none=True)
    for dotted, value in overrides.items():
        node = doc
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return dataclasses.replace(specs, training_run=TrainingRun.model_validate(doc))


DEFAULT_MAX_CONSECUTIVE_FAILURES = 10
"""Attempts in a row that fail the same way before any model call, after which a run stops."""


RECONNECT_SECONDS = 120.0
"""How long the trainer and the rollout controller wait for a restarted engine or gateway."""


async def _train(
    file: Path, out: Path, *, specs: Any, tasks: list[Any], resume: bool, max_consecutive_failures: int
) -> int:
    from inharness.runlock import RunDirBusy, RunLock
    from inharness.trainer.loop import RunDir

    spec = specs.training_run.spec
    model = specs.resolve(spec.model.path)
    if not (model / "config.json").is_file():
        print(
            f"inharness run: {file}: spec.model.path: no model directory (with config.json) at {model}; "
            "a local run loads the policy from there (`inharness model init-tiny DIR` makes a tiny one; "
            "`make demo` makes the calc example's)",
            file=sys.stderr,
        )
        return 2
    rd = RunDir(out, checkpoints=specs.resolve(spec.checkpoint.dir) if spec.checkpoint.dir else None)
    lock = RunLock(rd.root)
    try:
        # A run killed a moment ago may still have children on its way out: give them time to go.
        lock.acquire(wait_seconds=15)
    except RunDirBusy as exc:
        print(f"inharness run: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"inharness run: cannot use {rd.root} as the output directory: {exc}", file=sys.stderr)
        return 2
    try:
        ckpt = rd.latest_checkpoint()
        if ckpt is not None and not resume:
            print(
                f"inharness run: {out} already holds a run (checkpoint {ckpt.name}); pass --resume to "
                "continue it or --out to start a new one",
                file=sys.stderr,
            )
            return 2
        return await _train_locked(
            file, specs, tasks, rd, lock, resume=resume, max_consecutive_failures=max_consecutive_failures
        )
    finally:
        lock.release()


async def _train_locked(
    file: Path,
    specs: Any,
    tasks: list[Any],
    rd: "RunDir",
    lock: "RunLock",
    *,
    resume: bool,
    max_consecutive_failures: int,
) -> int:
    try:
        run = _LocalRun(
            file, specs, tasks, rd, resume=resume, max_consecutive_failures=max_consecutive_failures
        )
    except ValueError as exc:  # a spec this machine cannot run, e.g. vLLM without a GPU
        print(f"inharness run: {exc}", file=sys.stderr)
        return 2
    failure = await run.run(lock)
    return run.finish(failure)


class _LocalRun:
    """One `inharness run` in its locked output directory: the engine and gateway children under a
    supervisor, the rollout controller and the training loop; `run` returns why it failed (None when
    it did not) and `finish` reports and picks the exit code."""

    def __init__(
        self,
        file: Path,
        specs: Any,
        tasks: list[Any],
        rd: "RunDir",
        *,
        resume: bool,
        max_consecutive_failures: int,
    ) -> None:
        from inharness.trainer.build import load_policy

        self.file, self.specs, self.tasks, self.rd = file, specs, tasks, rd
        self.resume, self.max_consecutive_failures = resume, max_consecutive_failures
        self.policy, self.state, self.serve_path = load_policy(specs, rd, resume=resume)
        self.vllm = specs.training_run.spec.trainer.inference == "vllm"
        self.progress: _Progress | None = None
        self.training: TrainingLoop | None = None

    async def _inference(self) -> "Inference":
        """What answers the calls: inharness's engine (a child, on a port of its own; its URL is known
        before it starts), or the vLLM servers that verl starts in the policy's workers (minutes)."""
        from inharness.trainer.inference import EngineServers
        from inharness.trainer.verl_engine.servers import VllmServers

        if self.vllm:
            _say("starting the vLLM servers on the training GPUs (verl's hybrid engine)")
            return await asyncio.to_thread(VllmServers.start, self.policy, self.state.version)  # type: ignore[arg-type]
        url = f"http://127.0.0.1:{free_port()}"
        return EngineServers(self.policy, [url], self.rd.weights, wait_seconds=RECONNECT_SECONDS)

    def _children(
        self, lock: "RunLock", inference: "Inference"
    ) -> tuple[ServerProcess | None, ServerProcess, "Supervisor", str]:
        """The engine (none with vLLM) and the gateway (not started yet), the supervisor that restarts
        them, and the gateway's admin token."""
        from inharness.supervisor import Supervisor

        rd, state, pool = self.rd, self.state, self.specs.rollout_pool
        model_path = self.specs.resolve(self.specs.training_run.spec.model.path)
        admin = secrets.token_hex(24)
        urls, gport = inference.urls(), free_port()
        eport = int(urls[0].rsplit(":", 1)[1])
        keep_lock = (lock.fd,)  # the run directory stays locked until these children are gone too

        def engine_on(weights: Path) -> ServerProcess:
            # One intra-op thread: the engine shares the cores with the harnesses and the gateway, and
            # torch's threads wait on each other when a core is taken (13x slower per request measured
            # on 2 busy cores).
            argv = ["engine", "--model", str(weights), "--port", str(eport), "--threads", "1"]
            return ServerProcess.inharness(
                argv, port=eport, log=rd.logs / "engine.log", health="/health", pass_fds=keep_lock
            )

        def gateway_at(version: int) -> ServerProcess:
            argv = ["gateway", "--model", str(model_path)]
            argv += [arg for url in urls for arg in ("--engine", url)]
            argv += ["--model-version", str(version), "--store", f"sqlite:///{rd.root / 'gateway.db'}"]
            argv += ["--port", str(gport), "--admin-token", admin]
            argv += ["--max-attempts", str(pool.spec.max_attempts_per_rollout)]
            argv += ["--bodies", self.specs.training_run.spec.gateway.store.bodies]
            generation = self.specs.training_run.spec.generation  # the trainer scores samples at it
            argv += ["--temperature", str(generation.temperature), "--max-tokens", str(generation.max_tokens)]
            return ServerProcess.inharness(
                argv, port=gport, log=rd.logs / "gateway.log", health="/healthz", pass_fds=keep_lock
            )

        def served_weights() -> Path:
            current = rd.weights / f"v{state.version}"
            return current if current.is_dir() else self.serve_path

        gateway = gateway_at(state.version)
        supervisor = Supervisor(_say)
        engine = None if self.vllm else engine_on(self.serve_path)
        if engine is not None:
            supervisor.add("engine", engine, lambda: engine_on(served_weights()))
        supervisor.add("gateway", gateway, lambda: gateway_at(state.version))
        return engine, gateway, supervisor, admin

    async def run(self, lock: "RunLock") -> str | None:
        """Start the children, train until the last step or a stop, and stop everything again."""
        from inharness.gateway.client import GatewayClient, GatewayError

        # Harness commands such as `python harness.py` resolve to this environment's interpreter first.
        os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
        try:
            inference = await self._inference()
        except (ImportError, RuntimeError) as exc:  # vLLM missing, or its servers did not start
            return f"the inference servers did not start: {exc!r}"
        engine, gateway, supervisor, admin = self._children(lock, inference)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            for proc in (engine, gateway):
                if proc is None:
                    continue
                proc.spawn()  # from the event loop's thread, so that the child dies with this process
                await asyncio.to_thread(proc.wait_healthy, 120.0)
            async with GatewayClient(gateway.url, admin, connect_retry_seconds=RECONNECT_SECONDS) as gw:
                await gw.register_version(self.state.version, inference.urls(), activate=True)
                return await self._train(gw, gateway.url, inference, supervisor, stop)
        except (GatewayError, httpx.HTTPError) as exc:
            return f"the gateway failed: {exc!r} (log: {self.rd.logs / 'gateway.log'})"
        except RuntimeError as exc:  # a child that would not start, an engine that refused weights
            return str(exc)
        except OSError as exc:  # what the run cannot go on without: weights to serve, the batch journal
            return f"cannot write: {exc}"
        finally:
            if self.progress is not None:
                self.progress.close()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
            supervisor.stop_all()

    async def _train(
        self,
        gw: "GatewayClient",
        gateway_url: str,
        inference: "Inference",
        supervisor: "Supervisor",
        stop: asyncio.Event,
    ) -> str | None:
        """The rollout controller and the training loop side by side, until either stops the run."""
        from inharness.operator.rollouts.local import LocalRolloutController
        from inharness.trainer.config import loop_config
        from inharness.trainer.loop import NoTrainableSamples, TrainingLoop

        pool, harness = self.specs.rollout_pool, self.specs.harness
        if self.resume:
            # Attempts that were running when the last process died: requeued now, uncharged.
            released = await gw.release_running(pool.metadata.name, reason="its run stopped")
            if released:
                print(f"requeued {released} attempts that were running when the run stopped")
        controller = LocalRolloutController(
            gw,
            gateway_url,
            pool.metadata.name,
            pool.spec,
            harness.spec,
            self.specs.base_dir,
            self.rd.attempts,
            log=_say,  # e.g. why spec.local.preload is not used; lost leases
            max_consecutive_failures=self.max_consecutive_failures,
            outage=supervisor.outage_since,
        )
        self.progress = _Progress(self.specs.training_run.spec.steps, self.state.step, controller)
        self.training = training = TrainingLoop(
            gateway=gw,
            inference=inference,
            policy=self.policy,
            tasks=self.tasks,
            config=loop_config(self.specs),
            run_dir=self.rd,
            state=self.state,
            on_progress=self.progress,
        )
        await training.hold_adopted()
        rollouts = asyncio.create_task(controller.run(stop), name="rollouts")
        watching = asyncio.create_task(supervisor.watch(stop), name="supervisor")
        halts = [asyncio.create_task(e.wait()) for e in (controller.halted, supervisor.halted)]
        for halted in halts:
            halted.add_done_callback(lambda _: stop.set())
        failure = None
        try:
            await training.run(stop)
        except NoTrainableSamples as exc:
            failure = _explain_empty_batch(exc, controller)
        finally:
            stop.set()
            await rollouts
            await watching
            for halted in halts:
                halted.cancel()
        return failure or supervisor.fatal or controller.fatal

    def finish(self, failure: str | None) -> int:
        """Write the results, say what could not be written and why the run stopped; the exit code."""
        run, rd, state = self.specs.training_run, self.rd, self.state
        steps = run.spec.steps
        unwritten = _write_results(run.metadata.name, rd, state)
        unwritten += self.training.write_errors if self.training else []
        for line in unwritten:
            print(f"inharness run: {line}", file=sys.stderr)
        if failure is not None:
            print(f"\ninharness run: stopped at step {state.step} of {steps}: {failure}", file=sys.stderr)
            return 1
        if state.step < steps:
            print(
                f"stopped at step {state.step} of {steps}; "
                f"continue with: inharness run {self.file} --out {rd.root} --resume"
            )
            return 130
        return 1 if unwritten else 0


def _explain_empty_batch(exc: "NoTrainableSamples", controller: "ClaimingController") -> str:
    """Why a batch gave nothing to train on, with the failure reasons counted and where to look."""
    from inharness.operator.rollouts import fix_for

    lines = [str(exc)]
    if controller.failed_by_reason:
        counts = ", ".join(f"{k} (x{n})" for k, n in controller.failed_by_reason.most_common())
        lines.append(f"  failed attempts by reason: {counts}")
    last = controller.last_failure
    if last is not None:
        attempt_id, reason = last
        lines.append(f"  last failure: {reason}")
        lines.append(f"  its logs: {controller.logs_of(attempt_id)}")
        fix = fix_for(reason)
        if fix:
            lines.append(f"  fix: {fix}")
    return "\n".join(lines)


def _write_results(name: str, rd: "RunDir", state: "LoopState") -> list[str]:
    """reward.png, summary.json and the summary table, each written if it can be: what could not
    be written is returned, and the rest is kept."""
    from inharness.trainer.report import plot_rewards, read_metrics, summarize, summary_table

    try:
        metrics = read_metrics(rd.metrics)
    except OSError as exc:
        return [f"could not read {rd.metrics}: {exc}"]
    if not metrics:
        return []
    errors = []
    try:
        plot_rewards(rd.reward_png, {name: metrics}, f"{name}: reward per step")
    except OSError as exc:
        errors.append(f"could not write {rd.reward_png}: {exc}")
    summary = summarize(metrics, wall_seconds=state.wall_seconds)
    try:
        rd.summary.write_text(json.dumps(summary, indent=2))
    except OSError as exc:
        errors.append(f"could not write {rd.summary}: {exc}")
    print(f"\n{name}: {rd.root}\n{summary_table(summary)}")
    return errors


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def backend_note(specs: Any) -> str | None:
    """The line `inharness run` prints for a pool with backend kubernetes: the file is meant for the
    operator too, and here its harness runs as local processes all the same."""
    pool = specs.rollout_pool
    if pool.spec.backend != "kubernetes":
        return None
    return (
        f'RolloutPool "{pool.metadata.name}": backend kubernetes runs as local processes under '
        f"inharness run (image {specs.harness.spec.image} ignored)"
    )


def run_file(
    file: Path,
    out: Path | None,
    *,
    resume: bool = False,
    overrides: dict[str, Any] | None = None,
    max_consecutive_failures: int = DEFAULT_MAX_CONSECUTIVE_FAILURES,
) -> int:
    """`inharness run`: every path (the file, `out`, and through them the spec's relative paths)
    is made absolute here, against the directory the command was started in, before any child
    process sees one."""
    from inharness.operator.specfile import SpecError, load_specs, load_tasks

    try:
        specs = with_overrides(load_specs(file), overrides or {})
        tasks = load_tasks(specs)
    except (SpecError, ValueError) as exc:
        print(f"inharness run: {exc}", file=sys.stderr)
        return 2
    name = specs.training_run.metadata.name
    note = backend_note(specs)
    if note is not None:
        print(note, flush=True)
    out = Path(os.path.abspath(out if out is not None else Path("runs") / name))
    return asyncio.run(
        _train(
            Path(os.path.abspath(file)),
            out,
            specs=specs,
            tasks=tasks,
            resume=resume,
            max_consecutive_failures=max_consecutive_failures,
        )
    )
