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

Engine verl on a cluster (`--ray-nodes`): every trainer pod runs this same command, and the pod's
ordinal decides its part. Pod 0 starts the Ray head (`ray start --head`, GCS on 6379, the pod's
CPUs, GPUs and an object store within its /dev/shm), connects with `ray.init(address="auto")`
before the policy is loaded (verl's engine then finds Ray initialised and uses this cluster), and
waits, bounded and reporting "k of n nodes joined" to the gateway (`ProgressReport` state
`starting`), until every node has joined with its GPUs; then it trains as above. The other pods join
the head and block (`ray_worker`), joining again whenever the head goes away (it restarted, or it
was not up yet), and answer the pod's probes on the engine port meanwhile.

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
import json
import logging
import shutil
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from inharness.procs import ServerProcess
from inharness.trainer import raycluster
from inharness.trainer.inference import EngineServers, Inference

if TYPE_CHECKING:
    from inharness.gateway.client import GatewayClient
    from inharness.operator.specfile import Specs
    from inharness.trainer.loop import LoopState, RunDir
    from inharness.trainer.torch_engine import TorchTrainingEngine

log = logging.getLogger("inharness.train")

GATEWAY_WAIT_SECONDS = 300.0


@dataclasses.dataclass(frozen=True)
class RayCluster:
    """This pod's part in the trainer's Ray cluster (engine verl): head (pod 0) or a node that joins."""

    nodes: int
    head: bool
    head_address: str | None
    resources: raycluster.NodeResources
    wait_seconds: float = raycluster.NODES_WAIT_SECONDS

    @classmethod
    def from_flags(
        cls,
        *,
        nodes: int,
        head_address: str | None,
        node_ip: str | None,
        gpus: int,
        cpus: int,
        object_store_memory: int | None,
        pod_index: int | None,
        pod_index_label: str | None,
        pod_name: str | None,
        wait_seconds: float | None = None,
    ) -> "RayCluster":
        """ValueError when the pod's ordinal cannot be known, or a joining pod has no head address.
        Without an object store size, a share of this machine's /dev/shm."""
        index = pod_index if pod_index is not None else raycluster.pod_index(pod_index_label, pod_name)
        if index > 0 and not head_address:
            raise ValueError(f"pod {index} joins the Ray head but has no --ray-head-address")
        if object_store_memory is None:
            try:
                shm = shutil.disk_usage("/dev/shm").total
            except OSError:  # no /dev/shm (not Linux): Ray's minimum, as Ray would spill anyway
                shm = 0
            object_store_memory = raycluster.object_store_memory(shm)
        resources = raycluster.NodeResources(
            num_cpus=cpus, num_gpus=gpus, object_store_memory=object_store_memory, node_ip=node_ip or None
        )
        wait = raycluster.NODES_WAIT_SECONDS if wait_seconds is None else wait_seconds
        return cls(nodes, index == 0, head_address, resources, wait)


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
    ray: RayCluster | None = None,
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
            if ray is not None and not await wait_for_ray_nodes(ray, gw, _steps(config), sha, stop):
                return 143 if stop.is_set() else 1
            loaded = await _load(config, out, gw, sha)
            if loaded is None:
                return 1
            if loaded.specs.training_run.spec.trainer.inference == "vllm":
                return await _run_on_vllm(loaded, gw, sha, stop, health=(engine_host, engine_port))
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
                inference = EngineServers(
                    loaded.policy, [engine_url], loaded.rd.weights, api_key=engine_api_key
                )
                return await _run(loaded, gw, inference, sha, stop)
            finally:
                await asyncio.to_thread(engine.stop)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


async def wait_for_ray_nodes(
    ray: RayCluster, gw: "GatewayClient", total_steps: int, sha: str, stop: asyncio.Event
) -> bool:
    """Wait until every Ray node joined with its GPUs, posting each change to the gateway (the
    operator's RayClusterReady condition); False when they did not in time (the pod restarts and the
    nodes join its new head) or on SIGTERM."""
    from inharness.gateway.schema import ProgressReport

    loop = asyncio.get_running_loop()

    def report(joined: int, wanted: int) -> None:
        body = ProgressReport(
            step=0,
            total_steps=total_steps,
            state="starting",
            config_sha256=sha,
            ray_nodes=joined,
            ray_nodes_wanted=wanted,
        )
        try:
            asyncio.run_coroutine_threadsafe(gw.report_progress(body), loop).result(timeout=30)
        except Exception as exc:  # the status lags; the wait goes on
            log.warning("cannot report %d of %d Ray nodes to the gateway: %s", joined, wanted, exc)

    try:
        await asyncio.to_thread(
            raycluster.wait_for_nodes,
            ray.nodes,
            ray.resources.num_gpus,
            ray.wait_seconds,
            report,
            cancelled=stop.is_set,
        )
    except TimeoutError as exc:
        print(f"inharness train: {exc}", file=sys.stderr)
        return False
    except InterruptedError:
        return False
    return True


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
    from inharness.trainer.build import load_policy
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


async def _run_on_vllm(
    loaded: _Loaded,
    gw: "GatewayClient",
    sha: str,
    stop: asyncio.Event,
    *,
    health: tuple[str, int],
) -> int:
    """`_run` with verl's vLLM servers in the policy's workers (`spec.trainer.inference: vllm`): no
    engine process, so this process answers the pod's probes on the engine port itself (`/health`, as
    a Ray node does); the gateway dials the servers at their own addresses and ports."""
    from inharness.trainer.verl_engine.servers import VllmServers

    server = ThreadingHTTPServer(health, _HealthHandler)
    threading.Thread(target=server.serve_forever, name="health", daemon=True).start()
    try:
        inference = await asyncio.to_thread(VllmServers.start, loaded.policy, loaded.state.version)  # type: ignore[arg-type]
        return await _run(loaded, gw, inference, sha, stop)
    finally:
        server.shutdown()
        server.server_close()


async def _run(
    loaded: _Loaded,
    gw: "GatewayClient",
    inference: Inference,
    sha: str,
    stop: asyncio.Event,
) -> int:
    """Serve the first version, train to the last step, then wait to be scaled down."""
    from inharness.trainer.config import loop_config
    from inharness.trainer.loop import NoTrainableSamples, TrainingLoop

    state, steps = loaded.state, loaded.specs.training_run.spec.steps
    await gw.register_version(state.version, inference.urls(), activate=True)
    training = TrainingLoop(
        gateway=gw,
        inference=inference,
        policy=loaded.policy,
        tasks=loaded.tasks,
        config=loop_config(loaded.specs, config_sha256=sha),
        run_dir=loaded.rd,
        state=state,
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
    ray: RayCluster | None = None,
) -> int:
    """Train (see the module's docstring); with `ray`, as the Ray head: start it and connect first."""
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
    head = None
    if ray is not None:
        try:
            head = _start_ray_head(ray)
        except (RuntimeError, TimeoutError, OSError, ConnectionError) as exc:
            print(f"inharness train: the Ray head did not start: {exc}", file=sys.stderr)
            return 1
    try:
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
                ray=ray,
            )
        )
    finally:
        if head is not None:
            import ray as ray_api

            ray_api.shutdown()
            head.stop()


def _start_ray_head(ray: RayCluster) -> raycluster.RayNode:
    """The head of this pod's Ray cluster, and this process connected to it as the driver: before
    the policy is loaded, so that verl's engine finds Ray initialised and uses this cluster."""
    import ray as ray_api

    head = raycluster.start_head(ray.resources)
    try:
        ray_api.init(address="auto", logging_level=logging.WARNING)
    except BaseException:
        head.stop()
        raise
    return head


class _HealthHandler(BaseHTTPRequestHandler):
    """/health of a trainer pod without an engine process (a Ray node that is not the head, or the head
    when vLLM answers the calls): 200 while the process runs, joined or waiting for the head, so that
    the pod's probes (the engine's, one pod template) never kill it while the head or vLLM starts; a
    wedged process stops answering and the liveness probe restarts it."""

    def do_GET(self) -> None:
        found = self.path.split("?")[0] == "/health"
        body = json.dumps({"status": "ok", "role": "ray-node"} if found else {"detail": "Not Found"}).encode()
        self.send_response(200 if found else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # probes every 10 s: not worth a log line each


def ray_worker(ray: RayCluster, *, health_host: str, health_port: int) -> int:
    """A trainer pod other than pod 0 (engine verl): join the head and stay joined until SIGTERM."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    assert ray.head_address is not None  # RayCluster.from_flags refuses a joining pod without one
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    server = ThreadingHTTPServer((health_host, health_port), _HealthHandler)
    threading.Thread(target=server.serve_forever, name="health", daemon=True).start()
    try:
        return raycluster.join_forever(ray.head_address, ray.resources, stop)
    finally:
        server.shutdown()
        server.server_close()
