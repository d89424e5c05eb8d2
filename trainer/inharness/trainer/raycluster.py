"""The trainer's Ray cluster on Kubernetes: pod 0 of the trainer StatefulSet is the Ray head and the
driver (`inharness train`), pods 1..N-1 join it and hold their GPUs for verl's workers.

Why `ray start` inside the run's own StatefulSet rather than a KubeRay RayCluster: the StatefulSet
already gives what Ray needs (stable DNS names through the headless Service, one claim per pod,
scale to zero on suspend and when the run ends), and the cluster lives and dies with its one driver,
so a second controller (KubeRay, installed cluster-wide) would add a CRD to install and a second
owner of the pods' lifetime for nothing a run uses. Ray's autoscaler is not wanted either: the run
asks for a fixed number of nodes.

Why fixed and explicit settings: the GCS listens on `GCS_PORT` so that workers find the head at
`<run>-trainer-0.<run>-trainer:6379` before it is Ready; CPUs and GPUs are the container's, not
the node's (Ray would otherwise see every core of the machine); the object store stays below the
pod's /dev/shm (`object_store_memory`), or Ray falls back to disk, and leaves room for NCCL and vLLM,
which use /dev/shm too. The dashboard, when on, binds to 127.0.0.1 only: it runs jobs for whoever
reaches it, so it is for `kubectl port-forward`, never for the network.

Every `ray start` here runs with `--block` in its own process group: the node lives exactly as long
as that process, and `RayNode.stop` ends the group by its id (never `ray stop`, which kills every
Ray process on the machine by name).

Pure parts (argument builders, sizing, node counting) first; then the processes.
"""

import logging
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

log = logging.getLogger("inharness.trainer.raycluster")

GCS_PORT = 6379
DASHBOARD_PORT = 8265
OBJECT_STORE_SHARE = Decimal("0.5")  # of /dev/shm: the rest is NCCL's, vLLM's and PyTorch's
OBJECT_STORE_MINIMUM = 75 * 1024**2  # Ray refuses a smaller object store
NODES_WAIT_SECONDS = 1800.0  # pods of a GPU node pool may need an autoscaled node and a large image
HEAD_START_SECONDS = 120.0
LOG_EVERY_SECONDS = 30.0


@dataclass(frozen=True)
class NodeResources:
    """What one Ray node offers: the pod's share, never the machine's."""

    num_cpus: int
    num_gpus: int
    object_store_memory: int  # bytes
    node_ip: str | None = None  # None: Ray picks (the pod IP on a cluster, where it is given)


# --- pure parts ----------------------------------------------------------------------------------------


def num_cpus(cores: Decimal | float | int) -> int:
    """Ray's CPU count for a container of `cores` (a request or limit): whole CPUs, rounded up as
    KubeRay does, and at least 1 so that the driver's tasks can be placed."""
    return max(1, math.ceil(Decimal(str(cores))))


def object_store_memory(shm_bytes: int) -> int:
    """The object store for a /dev/shm of `shm_bytes`: `OBJECT_STORE_SHARE` of it, rounded down to
    whole MiB, but never below Ray's minimum (then Ray spills to disk: give shmSize 256Mi or more)."""
    share = int(Decimal(shm_bytes) * OBJECT_STORE_SHARE) // 1024**2 * 1024**2
    return max(OBJECT_STORE_MINIMUM, share)


def _common(resources: NodeResources, temp_dir: str | None) -> list[str]:
    out = [
        f"--num-cpus={resources.num_cpus}",
        f"--num-gpus={resources.num_gpus}",
        f"--object-store-memory={resources.object_store_memory}",
    ]
    if resources.node_ip:
        out.append(f"--node-ip-address={resources.node_ip}")
    if temp_dir is not None:
        out.append(f"--temp-dir={temp_dir}")
    return [*out, "--disable-usage-stats", "--block"]


def head_args(
    resources: NodeResources,
    *,
    port: int = GCS_PORT,
    dashboard_host: str | None = "127.0.0.1",
    temp_dir: str | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """`ray start` arguments of the head: the GCS on `port`; the dashboard on `dashboard_host`
    (None: no dashboard)."""
    dashboard = (
        ["--include-dashboard=false"]
        if dashboard_host is None
        else [
            "--include-dashboard=true",
            f"--dashboard-host={dashboard_host}",
            f"--dashboard-port={DASHBOARD_PORT}",
        ]
    )
    return ["start", "--head", f"--port={port}", *dashboard, *_common(resources, temp_dir), *extra]


def worker_args(
    address: str, resources: NodeResources, *, temp_dir: str | None = None, extra: Sequence[str] = ()
) -> list[str]:
    """`ray start` arguments of a node that joins the head at `address` (host:port)."""
    return ["start", f"--address={address}", *_common(resources, temp_dir), *extra]


def nodes_joined(nodes: Iterable[Mapping[str, Any]], gpus_per_node: int) -> int:
    """How many of `ray.nodes()` are alive with at least `gpus_per_node` GPUs: a node that joined
    without its GPUs (no device plugin, wrong node pool) is not one the engine can use."""
    return sum(
        1
        for n in nodes
        if n.get("Alive") and Decimal(str((n.get("Resources") or {}).get("GPU", 0))) >= gpus_per_node
    )


def pod_index(label: str | None, pod_name: str | None) -> int:
    """This pod's ordinal in its StatefulSet: the `apps.kubernetes.io/pod-index` label (Kubernetes
    1.28+, through the downward API) or else the suffix of the pod's name (`<set>-<ordinal>`)."""
    for text in (label, (pod_name or "").rpartition("-")[2]):
        if text and text.isdigit():
            return int(text)
    raise ValueError(
        f"no pod ordinal: POD_INDEX is {label!r} and the pod name {pod_name!r} has no -<ordinal>"
    )


# --- processes -----------------------------------------------------------------------------------------


def ray_executable() -> str:
    """The `ray` script of this interpreter's environment (the image's venv), else the one on PATH."""
    beside = Path(sys.executable).with_name("ray")
    return str(beside) if beside.exists() else "ray"


class RayNode:
    """One `ray start --block` process and the Ray daemons it started, in a process group of their own."""

    def __init__(
        self, args: Sequence[str], *, log_file: Path | None = None, env: Mapping[str, str] | None = None
    ) -> None:
        self.args = [ray_executable(), *args]
        # No log file: Ray's own output goes to this process's (the pod's log).
        out = open(log_file, "ab") if log_file is not None else None  # noqa: SIM115
        try:
            self.process = subprocess.Popen(
                self.args,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env=None if env is None else dict(env),
            )
        finally:
            if out is not None:
                out.close()  # the child holds its own descriptor

    def alive(self) -> bool:
        return self.process.poll() is None

    def wait(self, timeout: float | None = None) -> int | None:
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM to the node's process group, SIGKILL to what is left after `timeout`."""
        group = self.process.pid
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(group, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and _group_alive(group):
                self.process.poll()  # reap the leader, so that only the daemons keep the group alive
                time.sleep(0.2)
            if not _group_alive(group):
                break
        self.process.poll()


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def start_head(
    resources: NodeResources,
    *,
    port: int = GCS_PORT,
    dashboard_host: str | None = "127.0.0.1",
    temp_dir: str | None = None,
    extra: Sequence[str] = (),
    log_file: Path | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = HEAD_START_SECONDS,
) -> RayNode:
    """Start the head and wait until its GCS accepts connections; sets RAY_ADDRESS, so that
    `ray.init(address="auto")` (ours and verl's) and child processes find this cluster."""
    node = RayNode(
        head_args(resources, port=port, dashboard_host=dashboard_host, temp_dir=temp_dir, extra=extra),
        log_file=log_file,
        env=env,
    )
    host = resources.node_ip or "127.0.0.1"
    deadline = time.monotonic() + timeout
    while not _port_open(host, port):
        if not node.alive():
            raise RuntimeError(f"ray start --head exited with {node.process.returncode} (log: {log_file})")
        if time.monotonic() > deadline:
            node.stop()
            raise TimeoutError(f"the Ray head's GCS did not listen on {host}:{port} within {timeout:.0f} s")
        time.sleep(0.5)
    os.environ["RAY_ADDRESS"] = f"{host}:{port}"
    log.info("Ray head up at %s:%d (%s)", host, port, _shown(resources))
    return node


def join(
    address: str,
    resources: NodeResources,
    *,
    temp_dir: str | None = None,
    extra: Sequence[str] = (),
    log_file: Path | None = None,
    env: Mapping[str, str] | None = None,
) -> RayNode:
    """Start a node that joins the head at `address`; it runs until the node or the head goes away."""
    return RayNode(
        worker_args(address, resources, temp_dir=temp_dir, extra=extra), log_file=log_file, env=env
    )


def join_forever(
    address: str,
    resources: NodeResources,
    stop: threading.Event,
    *,
    retry_seconds: float = 5.0,
    log_file: Path | None = None,
) -> int:
    """A worker pod's life: join the head, and join again whenever the node ends (the head restarted,
    or is not up yet: pod 0 may start after this pod), until `stop` is set. Returns 0."""
    failures = 0
    while not stop.is_set():
        started = time.monotonic()
        node = join(address, resources, log_file=log_file)
        log.info("joining the Ray head at %s (%s)", address, _shown(resources))
        while node.alive() and not stop.is_set():
            node.wait(1.0)
        code = node.process.returncode
        node.stop()
        if stop.is_set():
            break
        failures = 1 if time.monotonic() - started > 60 else failures + 1
        log.warning("the Ray node ended (exit %s): the head is gone or not up yet; joining again", code)
        stop.wait(min(retry_seconds * failures, 60.0))
    return 0


def _shown(resources: NodeResources) -> str:
    return (
        f"{resources.num_cpus} CPUs, {resources.num_gpus} GPUs, "
        f"object store {resources.object_store_memory // 1024**2} MiB"
    )


def wait_for_nodes(
    nodes: int,
    gpus_per_node: int,
    timeout: float = NODES_WAIT_SECONDS,
    on_progress: Callable[[int, int], None] = lambda joined, wanted: None,
    *,
    poll_seconds: float = 2.0,
    cancelled: Callable[[], bool] = lambda: False,
) -> int:
    """Poll `ray.nodes()` (ray.init must have run) until `nodes` nodes with `gpus_per_node` GPUs each
    are alive; returns how many are. `on_progress(joined, nodes)` is called on every change and with
    each progress log line. TimeoutError after `timeout` seconds, InterruptedError once `cancelled()`."""
    import ray

    deadline = time.monotonic() + timeout
    last, logged = -1, 0.0
    while True:
        joined = nodes_joined(ray.nodes(), gpus_per_node)
        now = time.monotonic()
        due = now - logged >= LOG_EVERY_SECONDS
        if joined != last or due:
            on_progress(joined, nodes)
        if joined >= nodes:
            log.info("%d of %d Ray nodes joined", joined, nodes)
            return joined
        if due:
            left = max(0.0, deadline - now)
            log.info(
                "%d of %d Ray nodes (%d GPUs each) joined; waiting up to %.0f s more",
                joined,
                nodes,
                gpus_per_node,
                left,
            )
            logged = now
        last = joined
        if now > deadline:
            raise TimeoutError(
                f"only {joined} of {nodes} Ray nodes with {gpus_per_node} GPUs each joined "
                f"within {timeout:.0f} s"
            )
        if cancelled():
            raise InterruptedError("stopped while waiting for Ray nodes")
        time.sleep(poll_seconds)
