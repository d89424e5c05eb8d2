"""The trainer's Ray cluster (engine verl): the `ray start` arguments and sizing as pure functions, a
joining pod's life under `inharness train` (answering its probes while the head is away), and one
real cluster: a head and a joining node on 127.0.0.1, awaited by the head's `wait_for_ray_nodes`
from a driver, which reports what it sees as the head reports it to the gateway.

Every Ray process here is started in a process group of its own and ended by that group's id: never
`ray stop`, which kills every Ray process of the machine, other people's included."""

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from testsupport import free_port

from inharness.train import RayCluster
from inharness.trainer import raycluster as rc

ONE_CPU = rc.NodeResources(
    num_cpus=1, num_gpus=0, object_store_memory=rc.OBJECT_STORE_MINIMUM, node_ip="127.0.0.1"
)


# --- pure parts ----------------------------------------------------------------------------------------


def test_head_and_worker_arguments_pin_ports_resources_and_blocking() -> None:
    res = rc.NodeResources(num_cpus=32, num_gpus=8, object_store_memory=4 * 1024**3, node_ip="10.0.0.5")
    head = rc.head_args(res)
    assert head[:3] == ["start", "--head", "--port=6379"]
    assert {"--num-cpus=32", "--num-gpus=8", f"--object-store-memory={4 * 1024**3}"} <= set(head)
    assert {"--node-ip-address=10.0.0.5", "--disable-usage-stats", "--block"} <= set(head)
    # the dashboard runs jobs for whoever reaches it: loopback only, for kubectl port-forward
    assert {"--include-dashboard=true", "--dashboard-host=127.0.0.1", "--dashboard-port=8265"} <= set(head)
    assert "--include-dashboard=false" in rc.head_args(res, dashboard_host=None)
    worker = rc.worker_args("run-trainer-0.run-trainer:6379", res, temp_dir="/tmp/r")
    assert worker[:2] == ["start", "--address=run-trainer-0.run-trainer:6379"]
    assert {"--num-gpus=8", "--block", "--temp-dir=/tmp/r"} <= set(worker) and "--head" not in worker


def test_sizing_follows_the_container_not_the_machine() -> None:
    assert [rc.num_cpus(c) for c in ("0.5", 1, "6.5", 32)] == [1, 1, 7, 32]
    assert rc.object_store_memory(8 * 1024**3) == 4 * 1024**3  # half of /dev/shm
    assert rc.object_store_memory(64 * 1024**2) == rc.OBJECT_STORE_MINIMUM  # Ray refuses less


def test_only_live_nodes_with_their_gpus_count_as_joined() -> None:
    nodes = [
        {"Alive": True, "Resources": {"CPU": 8.0, "GPU": 8.0}},
        {"Alive": True, "Resources": {"CPU": 8.0}},  # joined without its GPUs (no device plugin)
        {"Alive": False, "Resources": {"CPU": 8.0, "GPU": 8.0}},  # a head or node that went away
    ]
    assert rc.nodes_joined(nodes, 8) == 1
    assert rc.nodes_joined(nodes, 0) == 2


def test_the_pod_ordinal_comes_from_the_label_else_the_pod_name() -> None:
    assert rc.pod_index("2", "run-trainer-0") == 2
    assert rc.pod_index("", "run-trainer-3") == 3  # a cluster older than the pod-index label
    with pytest.raises(ValueError, match="no pod ordinal"):
        rc.pod_index(None, "laptop")


def test_pod_zero_is_the_head_and_a_joining_pod_needs_the_head_address() -> None:
    flags = {"nodes": 2, "node_ip": None, "gpus": 0, "cpus": 1, "object_store_memory": 10**8}
    head = RayCluster.from_flags(
        **flags, head_address=None, pod_index=None, pod_index_label="", pod_name="r-0"
    )
    assert head.head and head.wait_seconds == rc.NODES_WAIT_SECONDS
    with pytest.raises(ValueError, match="no --ray-head-address"):
        RayCluster.from_flags(**flags, head_address=None, pod_index=1, pod_index_label=None, pod_name=None)


def test_the_wait_for_nodes_is_bounded_reports_progress_and_stops_on_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import ray

    alive = {"Alive": True, "Resources": {"CPU": 1.0, "GPU": 1.0}}
    monkeypatch.setattr(ray, "nodes", lambda: [alive])
    seen: list[tuple[int, int]] = []
    with pytest.raises(TimeoutError, match="only 1 of 2 Ray nodes with 1 GPUs each joined within 0 s"):
        rc.wait_for_nodes(2, 1, 0.2, lambda j, w: seen.append((j, w)), poll_seconds=0.05)
    assert seen[0] == (1, 2)
    with pytest.raises(InterruptedError):
        rc.wait_for_nodes(2, 1, 60, cancelled=lambda: True, poll_seconds=0.05)
    assert rc.wait_for_nodes(1, 1, 1, lambda j, w: seen.append((j, w))) == 1 and seen[-1] == (1, 1)


# --- processes -----------------------------------------------------------------------------------------


@pytest.fixture
def ray_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """An environment of Ray's own: a short temp dir (Ray's socket paths must stay under 108
    characters), token authentication with a token of its own, and no HOME token of anyone else's."""
    temp = Path(tempfile.mkdtemp(prefix="ihray-", dir="/tmp"))
    token = temp / "token"
    token.write_text("inharness-test-ray-token-0123456789abcdef")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # start_head sets it; restored afterwards
    env = {**os.environ, "HOME": str(temp), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
    env["RAY_TMPDIR"] = str(temp)
    yield env
    subprocess.run(["rm", "-rf", str(temp)], check=False, timeout=60)


def _ports() -> list[str]:
    """The ports Ray would otherwise take at fixed defaults, free ones here (others may run Ray too)."""
    return [
        f"--dashboard-agent-listen-port={free_port()}",
        f"--metrics-export-port={free_port()}",
        f"--runtime-env-agent-port={free_port()}",
        f"--dashboard-agent-grpc-port={free_port()}",
    ]


DRIVER = """
import asyncio, json, logging
import ray
from inharness.train import RayCluster, wait_for_ray_nodes

ray.init(address="auto", logging_level=logging.WARNING)  # RAY_ADDRESS, as start_head sets it


class Gateway:  # what the head posts to the run's gateway while it waits
    reports = []

    async def report_progress(self, body):
        self.reports.append(body.model_dump(mode="json", exclude_none=True))


cluster = RayCluster.from_flags(
    nodes=2, head_address=None, node_ip="127.0.0.1", gpus=0, cpus=1, object_store_memory=None,
    pod_index=0, pod_index_label=None, pod_name=None, wait_seconds=45,
)
ok = asyncio.run(wait_for_ray_nodes(cluster, Gateway(), 4, "cfg", asyncio.Event()))
print(json.dumps({"ok": ok, "reports": Gateway.reports}))
ray.shutdown()
"""


def test_a_head_and_a_joining_node_form_one_cluster(ray_env: dict[str, str]) -> None:
    """Both nodes on 127.0.0.1 with one CPU and the smallest object store; 90 s at most in all."""
    import json

    temp, port, nodes = Path(ray_env["HOME"]), free_port(), []
    try:
        try:
            head = rc.start_head(
                ONE_CPU,
                port=port,
                dashboard_host=None,
                temp_dir=str(temp),
                extra=[*_ports(), f"--ray-client-server-port={free_port()}"],
                log_file=temp / "head.log",
                env=ray_env,
                timeout=40,
            )
        except (RuntimeError, TimeoutError, OSError) as exc:
            log = (
                (temp / "head.log").read_text(errors="replace")[-1500:]
                if (temp / "head.log").exists()
                else ""
            )
            pytest.skip(f"ray cannot start a head on this machine ({exc}); its log ends:\n{log}")
        nodes.append(head)
        assert os.environ["RAY_ADDRESS"] == f"127.0.0.1:{port}"
        nodes.append(
            rc.join(f"127.0.0.1:{port}", ONE_CPU, extra=_ports(), log_file=temp / "worker.log", env=ray_env)
        )
        driver = subprocess.run(
            [sys.executable, "-c", DRIVER],
            env={**ray_env, "RAY_ADDRESS": f"127.0.0.1:{port}"},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert driver.returncode == 0, driver.stderr[-3000:]
        result = json.loads(driver.stdout.strip().splitlines()[-1])
        assert result["ok"] is True
        assert result["reports"][-1] == {
            "step": 0,
            "total_steps": 4,
            "state": "starting",
            "config_sha256": "cfg",
            "ray_nodes": 2,
            "ray_nodes_wanted": 2,
        }
        assert all(n.alive() for n in nodes), "a node ended on its own"
    finally:
        for node in reversed(nodes):
            node.stop(timeout=2)
    for node in nodes:
        assert not rc._group_alive(node.process.pid), "a Ray process outlived its node"


def test_a_joining_pod_answers_its_probes_while_the_head_is_away_and_ends_on_sigterm(
    ray_env: dict[str, str], tmp_path: Path
) -> None:
    """Pod 1 of a verl run whose head is not up: `inharness train` keeps trying to join and answers
    /health on the engine port meanwhile (so the pod's startup probe never kills it); SIGTERM ends it
    and the Ray processes it started."""
    health = free_port()
    args = [
        "--config",
        str(tmp_path / "run.yaml"),
        "--out",
        str(tmp_path / "out"),
        "--engine-host",
        "127.0.0.1",
    ]
    ray_args = [
        "--ray-nodes",
        "2",
        "--ray-head-address",
        f"127.0.0.1:{free_port()}",
        "--ray-node-ip",
        "127.0.0.1",
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "inharness.cli", "train", *args, "--engine-port", str(health), *ray_args],
        env={**ray_env, "POD_NAME": "calc-trainer-1", "POD_INDEX": "", "INHARNESS_GATEWAY_URL": ""},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline, answered = time.monotonic() + 30, None
        while answered is None and time.monotonic() < deadline and proc.poll() is None:
            try:
                answered = httpx.get(f"http://127.0.0.1:{health}/health", timeout=1)
            except httpx.HTTPError:
                time.sleep(0.2)
        assert answered is not None and answered.status_code == 200, proc.poll()
        assert answered.json()["role"] == "ray-node"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=40)
        assert proc.returncode == 0, out[-3000:]
        assert "joining the Ray head at 127.0.0.1:" in out
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert not rc._group_alive(proc.pid), "a Ray process outlived the pod's process"
