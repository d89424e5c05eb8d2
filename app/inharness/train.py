"""`inharness train --config RUN.yaml --out DIR`: the trainer of a TrainingRun on a cluster.

What the operator's trainer StatefulSet runs. The gateway is the run's own (another pod, reached
at INHARNESS_GATEWAY_URL with the admin token from its Secret) and the harnesses are the
RolloutPool controller's pods; this process runs the engine beside the training loop, publishes
each version under INHARNESS_ENGINE_URL (its address as the gateway dials it) and posts progress
after every step, which the operator shows in the TrainingRun's status.

The engine is started with the run's engine API key (`--engine-api-key-file`, the run Secret's
`engine-api-key` as mounted by the operator; the gateway holds the same key) and with its weights
root at the directory the loop saves each version to, so that no other pod can generate with the
policy or make the engine load weights from elsewhere (`inharness.engine.auth`).

The same pieces as `inharness run` (run.py): the spec file (the ConfigMap's run.yaml), the policy
and the loop. A restarted pod always resumes from the last checkpoint in --out. Relative paths of
the spec resolve against the working directory (/workspace in the pod).

Exit and failure:
- a config that cannot run (dataset or model missing, bad spec) is reported to the gateway as a
  failure of this config (the run becomes Failed) and exits 1;
- a failure during training exits 1 without that report: the pod restarts and resumes;
- when every step is done, the process reports completion and then waits for SIGTERM, so the pod
  does not restart in a loop before the operator scales the finished trainer to zero.
"""

import asyncio
import dataclasses
import hashlib
import logging
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from inharness.procs import ServerProcess

if TYPE_CHECKING:
    from inharness.gateway.client import GatewayClient
    from inharness.operator.specfile import Specs
    from inharness.trainer.loop import LoopState, RunDir
    from inharness.trainer.torch_engine import TorchTrainingEngine

log = logging.getLogger("inharness.train")

GATEWAY_WAIT_SECONDS = 300.0


def _steps(config: Path) -> int:
    """The run's steps for a failure report, even when the rest of the file cannot be used."""
    from inharness.operator.specfile import SpecError, load_specs

    try:
        return load_specs(config, check_files=False).training_run.spec.steps
    except SpecError:
        return 1


async def _wait_for_gateway(url: str, stop: asyncio.Event) -> bool:
    """The gateway pod may start after this one: wait (bounded) until it answers /healthz."""
    deadline, delay = time.monotonic() + GATEWAY_WAIT_SECONDS, 0.2
    async with httpx.AsyncClient(timeout=5) as http:
        while time.monotonic() < deadline and not stop.is_set():
            try:
                if (await http.get(f"{url.rstrip('/')}/healthz")).status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            try:
                await asyncio.wait_for(stop.wait(), delay)
            except TimeoutError:
                delay = min(delay * 2, 5.0)
    return False


async def _train(
    config: Path,
    out: Path,
    *,
    gateway_url: str,
    admin_token: str,
    engine_url: str,
    engine_host: str,
    engine_port: int,
    sha: str,
    engine_api_key_file: Path | None,
) -> int:
    from inharness.gateway.client import GatewayClient

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    from inharness.engine.auth import read_key_file

    engine_api_key = None if engine_api_key_file is None else read_key_file(engine_api_key_file)
    try:
        if not await _wait_for_gateway(gateway_url, stop):
            print(f"inharness train: the gateway at {gateway_url} did not answer", file=sys.stderr)
            return 1
        async with GatewayClient(gateway_url, admin_token) as gw:
            loaded = await _load(config, out, gw, sha)
            if loaded is None:
                return 1
            argv = ["engine", "--model", str(loaded.serve_path), "--host", engine_host]
            argv += ["--port", str(engine_port), "--weights-root", str(loaded.rd.weights)]
            if engine_api_key_file is not None:
                argv += ["--api-key-file", str(engine_api_key_file)]
            engine = ServerProcess.inharness(
                argv, port=engine_port, log=loaded.rd.logs / "engine.log", health="/health"
            )
            try:
                engine.spawn()  # from the event loop's thread: the engine dies with this process
                await asyncio.to_thread(engine.wait_healthy)
                return await _run(loaded, gw, engine_url, sha, stop, engine_api_key)
            finally:
                await asyncio.to_thread(engine.stop)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


@dataclasses.dataclass
class _Loaded:
    """What the config file gives the trainer: the specs, their tasks, the run directory, and the
    policy with its loop state and the weights to serve first."""

    specs: "Specs"
    tasks: list[Any]
    rd: "RunDir"
    policy: "TorchTrainingEngine"
    state: "LoopState"
    serve_path: Path


async def _load(config: Path, out: Path, gw: "GatewayClient", sha: str) -> _Loaded | None:
    """The config loaded and the policy resumed from --out; None (reported to the gateway as a failure
    of this config, so the run becomes Failed) when it cannot run."""
    from inharness.gateway.schema import ProgressReport
    from inharness.operator.specfile import SpecError, load_specs, load_tasks
    from inharness.trainer.config import load_policy
    from inharness.trainer.loop import RunDir

    try:
        specs = dataclasses.replace(load_specs(config, check_files=False), base_dir=Path.cwd())
        tasks = load_tasks(specs)
        spec = specs.training_run.spec
        rd = RunDir(out, checkpoints=specs.resolve(spec.checkpoint.dir) if spec.checkpoint.dir else None)
        rd.root.mkdir(parents=True, exist_ok=True)
        policy, state, serve_path = load_policy(specs, rd, resume=True)
    except (SpecError, OSError, ValueError) as exc:
        await gw.report_progress(
            ProgressReport(
                step=0,
                total_steps=_steps(config),
                state="failed",
                message=str(exc)[:4000],
                config_sha256=sha,
            )
        )
        print(f"inharness train: {exc}", file=sys.stderr)
        return None
    return _Loaded(specs, tasks, rd, policy, state, serve_path)


async def _run(
    loaded: _Loaded,
    gw: "GatewayClient",
    engine_url: str,
    sha: str,
    stop: asyncio.Event,
    engine_api_key: str | None,
) -> int:
    """Serve the first version, train to the last step, then wait to be scaled down."""
    from inharness.trainer.config import loop_config
    from inharness.trainer.loop import NoTrainableSamples, TrainingLoop

    state, steps = loaded.state, loaded.specs.training_run.spec.steps
    await gw.register_version(state.version, [engine_url], activate=True)
    training = TrainingLoop(
        gateway=gw,
        engine_urls=[engine_url],
        policy=loaded.policy,
        tasks=loaded.tasks,
        config=loop_config(loaded.specs, config_sha256=sha),
        run_dir=loaded.rd,
        state=state,
        engine_api_key=engine_api_key,
    )
    if state.step >= steps:
        await training.report("complete")
    else:
        try:
            await training.run(stop)
        except NoTrainableSamples as exc:
            await training.report("failed", message=str(exc))
            print(f"inharness train: {exc}", file=sys.stderr)
            return 1
    if state.step >= steps:
        name = loaded.specs.training_run.metadata.name
        print(f"{name}: all {steps} steps done; waiting to be scaled down", flush=True)
        await stop.wait()
        return 0
    return 143  # stopped by a signal before the last step; the next pod resumes


def train_file(
    config: Path,
    out: Path,
    *,
    gateway_url: str,
    admin_token: str,
    engine_url: str,
    engine_host: str,
    engine_port: int,
    engine_api_key_file: Path | None = None,
) -> int:
    from inharness.engine.auth import AuthError, read_key_file

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        sha = hashlib.sha256(config.read_bytes()).hexdigest()
    except OSError as exc:
        print(f"inharness train: cannot read {config}: {exc}", file=sys.stderr)
        return 2
    if engine_api_key_file is not None:
        try:
            read_key_file(engine_api_key_file)  # fail here, not once the engine starts
        except AuthError as exc:
            print(f"inharness train: {exc}", file=sys.stderr)
            return 2
    return asyncio.run(
        _train(
            config,
            out,
            gateway_url=gateway_url,
            admin_token=admin_token,
            engine_url=engine_url,
            engine_host=engine_host,
            engine_port=engine_port,
            sha=sha,
            engine_api_key_file=engine_api_key_file,
        )
    )
