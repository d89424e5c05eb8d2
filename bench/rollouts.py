"""The kubernetes rollout backend's throughput and its Kubernetes API requests per attempt, for
100 / 1,000 / 10,000 attempts, each as bare Pods and as Jobs (`spec.kubernetes.workload`), side by
side in one run; and with `--long`, gateway requests per attempt when harnesses run 30 s, with
leases renewed one request per attempt (the controller before heartbeat-batch) and in batches.

Parts: a real gateway (subprocess, SQLite store), kmock's emulator with the fake kubelet and fake job
controller of the tests (tests/operator/fake_kubelet.py) in a second process, and the controller in
this one, as the operator runs it: one pod (or Job) per attempt, a key Secret and a task ConfigMap per
batch, a pod watch (and a Job watch), TTL 0 (each pod or Job deleted once reported). Each harness
"runs" for no time (`--seconds`: that long), so what is measured is the controller, the API and the
gateway, not harnesses.
API requests are counted by verb in the controller's KubeClient (the kubelet's own requests are not
the operator's); the fake job controller's requests (pod creations, Job status writes, the pods it
deletes with their Job) are counted apart, as `jobctl/att`: a lower bound of the real job
controller's, which also writes tracking finalizers and more status. Gateway requests are counted
by kind in the controller's GatewayClient.

Lease renewal (`--heartbeats`): `batch` is the controller as it is, one `heartbeat-batch` request
per `heartbeatSeconds` for all its attempts (up to 1,000 per request); `per-attempt` is the same
controller renewing each lease with a request of its own at each interval (`renew_each`, its path
for a gateway without heartbeat-batch): the count the controller had before, with one timer per
attempt, `in flight / heartbeatSeconds` requests a second.

Run: make bench-rollouts   (or: .venv/bin/python bench/rollouts.py [--sizes 100,1000] [--workloads Pod,Job])
     .venv/bin/python bench/rollouts.py --long   (1,000 attempts of 30 s, both lease renewals: ~2 min)
"""

import argparse
import asyncio
import multiprocessing
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "operator"))

from inharness.gateway.client import GatewayClient  # noqa: E402
from inharness.operator.kube import KubeClient  # noqa: E402
from inharness.operator.rollouts.kubernetes import KubernetesRolloutController  # noqa: E402
from inharness.operator.spec import HarnessSpecSpec, RolloutPoolSpec  # noqa: E402
from inharness.procs import ServerProcess, free_port  # noqa: E402

ADMIN = "bench-admin-token"
NS = "bench"
VERBS = ("create", "delete", "list", "watch", "get", "patch")
GATEWAY_KINDS = ("claim", "heartbeat", "complete", "other")
HEARTBEATS = ("per-attempt", "batch")
LONG = {"sizes": [1000], "workloads": ["Pod"], "seconds": 30.0, "heartbeats": list(HEARTBEATS)}


def gateway_kind(path: str) -> str:
    """Which controller request a gateway path is: claims (one or a batch), lease renewals (one or a
    batch), completions."""
    if path.startswith("/api/v1/attempts/claim"):
        return "claim"
    if path == "/api/v1/attempts/heartbeat-batch":
        return "heartbeat"
    for kind in ("heartbeat", "complete"):
        if path.endswith(f"/{kind}"):
            return kind
    return "other"


def emulator_process(ready: Any, done: Any, job_requests: Any) -> None:
    """The emulator, the fake kubelet and the fake job controller, in their own process (the
    machine's second core); `job_requests`: the job controller's API requests so far."""

    async def serve() -> None:
        from fake_kubelet import FakeJobController, FakeKubelet, RolloutCluster
        from kmock import Server

        async with RolloutCluster() as k8s, Server(k8s) as server:
            url = str(server.url).rstrip("/")
            async with (
                KubeClient(url, qps=1e6, burst=1_000_000) as kube,
                FakeKubelet(kube, NS),
                FakeJobController(kube, NS) as jobs,
            ):
                ready.put(url)
                while not await asyncio.to_thread(done.wait, 0.2):
                    job_requests.value = jobs.requests

    asyncio.run(serve())


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far, from /proc."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rfind(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class PerAttemptHeartbeats(KubernetesRolloutController):
    """Leases renewed one request per attempt at each interval (the controller's path for a gateway
    without heartbeat-batch): the gateway requests the controller sent before it, side by side."""

    async def renew_leases(self) -> None:
        await self.renew_each()


def make_controller(
    gw: GatewayClient,
    kube: KubeClient,
    pool_name: str,
    workload: str,
    heartbeats: str,
    args: argparse.Namespace,
    reported: Counter[str],
) -> KubernetesRolloutController:
    pool = RolloutPoolSpec.model_validate(
        {
            "harnessRef": {"name": "bench"},
            "backend": "kubernetes",
            "parallelism": args.parallelism,
            "heartbeatSeconds": args.heartbeat_seconds,
            "kubernetes": {"workload": workload, "ttlSecondsAfterFinished": 0, "keepFailed": 0},
        }
    )
    harness = HarnessSpecSpec.model_validate({"image": "example.org/harness:bench", "command": ["harness"]})
    kind = PerAttemptHeartbeats if heartbeats == "per-attempt" else KubernetesRolloutController
    return kind(
        gw,
        kube,
        namespace=NS,
        run="bench",
        pool_name=pool_name,
        pool_uid=None,
        pool=pool,
        harness=harness,
        log=lambda _: None,
        on_report=lambda _a, outcome, report: reported.update([f"{outcome.status}/{report}"]),
    )


async def drive(controller: KubernetesRolloutController, n: int, reported: Counter[str]) -> dict[str, Any]:
    """Run the controller until all `n` attempts are reported and their pods or Jobs deleted."""
    stop = asyncio.Event()
    t0 = time.perf_counter()
    task = asyncio.create_task(controller.run(stop))
    started_at = done_at = None
    max_running, next_note = 0, 10.0
    while True:
        await asyncio.sleep(0.02)
        max_running = max(max_running, controller.running)
        elapsed = time.perf_counter() - t0
        if started_at is None and controller.started >= n:
            started_at = elapsed
        if done_at is None and sum(reported.values()) >= n:
            done_at = elapsed
        if elapsed >= next_note:
            next_note += 10
            print(
                f"  {n}: {elapsed:.0f}s, {controller.started} started, {sum(reported.values())} reported, "
                f"{controller.running} running, {controller.pods} tracked",
                file=sys.stderr,
                flush=True,
            )
        # the last deletions belong to the count too
        if done_at is not None and (not controller.pods or elapsed > done_at + 60):
            break
        if task.done():
            task.result()
            raise RuntimeError("the controller stopped early")
    stop.set()
    await task
    assert started_at is not None and done_at is not None
    return {"started_at": started_at, "done_at": done_at, "max_running": max_running}


async def one_size(
    url: str,
    gateway: str,
    n: int,
    workload: str,
    heartbeats: str,
    args: argparse.Namespace,
    pids: dict[str, int],
    job_requests: Any,
) -> dict[str, Any]:
    pool_name = f"bench-{workload.lower()}-{n}-{heartbeats}"
    script = {"kubelet": {"seconds": args.seconds}} if args.seconds else {}
    async with (
        GatewayClient(gateway, ADMIN, timeout=120) as gw,
        KubeClient(url, qps=args.qps, burst=args.burst) as kube,
    ):
        for start in range(0, n, 10_000):
            tasks = [{"i": i, **script} for i in range(start, min(n, start + 10_000))]
            await gw.create_rollouts(tasks, pool=pool_name, max_attempts=1)
        reported: Counter[str] = Counter()
        gateway_requests: Counter[str] = Counter()

        async def count(request: httpx.Request) -> None:
            gateway_requests[gateway_kind(request.url.path)] += 1

        gw._http.event_hooks["request"].append(count)
        controller = make_controller(gw, kube, pool_name, workload, heartbeats, args, reported)
        cpu_before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        jobs_before = job_requests.value
        ran = await drive(controller, n, reported)
        await asyncio.sleep(0.5)  # the job controller's count arrives every 0.2 s
        cpu_after = {name: cpu_seconds(pid) for name, pid in pids.items()}
        requests = dict(kube.requests)
    return {
        "workload": workload,
        "heartbeats": heartbeats,
        "n": n,
        "started_per_s": n / ran["started_at"],
        "completed_per_s": n / ran["done_at"],
        "seconds": ran["done_at"],
        "max_running": ran["max_running"],
        "per_attempt": {v: requests.get(v, 0) / n for v in VERBS},
        "jobctl_per_attempt": (job_requests.value - jobs_before) / n,
        "gateway_per_attempt": {k: gateway_requests[k] / n for k in GATEWAY_KINDS},
        "reported": dict(reported),
        "cpu_ms": {name: 1000 * (cpu_after[name] - cpu_before[name]) / n for name in pids},
    }


async def bench(args: argparse.Namespace) -> list[dict[str, Any]]:
    from inharness.engine.tiny import init_tiny

    with tempfile.TemporaryDirectory() as tmp:
        model = init_tiny(Path(tmp) / "tiny", seed=0)
        port = free_port()
        gw_args = ["gateway", "--model", str(model), "--store", f"sqlite:///{tmp}/gw.db", "--port", str(port)]
        gateway = ServerProcess.inharness(
            [*gw_args, "--admin-token", ADMIN], port=port, log=Path(tmp) / "gateway.log", health="/healthz"
        ).start()
        ctx = multiprocessing.get_context("spawn")
        ready, done, job_requests = ctx.Queue(), ctx.Event(), ctx.Value("q", 0)
        emulator = ctx.Process(target=emulator_process, args=(ready, done, job_requests), daemon=True)
        emulator.start()
        try:
            url = ready.get(timeout=60)
            assert gateway.proc is not None and emulator.pid is not None
            pids = {"controller": os.getpid(), "emulator+fakes": emulator.pid, "gateway": gateway.proc.pid}
            return [
                await one_size(url, gateway.url, n, workload, heartbeats, args, pids, job_requests)
                for n in args.sizes
                for workload in args.workloads
                for heartbeats in args.heartbeats
            ]
        finally:
            done.set()
            emulator.join(10)
            gateway.stop()


def print_table(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(
        "kubernetes rollout backend on kmock's emulator + fake kubelet + fake job controller + real gateway, "
        f"parallelism {args.parallelism}, client QPS {args.qps:g} burst {args.burst}, harnesses run "
        f"{args.seconds:g} s, heartbeatSeconds {args.heartbeat_seconds}"
    )
    head = f"{'workload':>8} {'leases':>11} {'attempts':>9} {'started/s':>10} {'completed/s':>12}"
    head += f" {'seconds':>8} {'in flight':>10}"
    head += "".join(f" {v + '/att':>11}" for v in VERBS) + f" {'all/att':>8} {'jobctl/att':>10}"
    print(head)
    for r in results:
        row = f"{r['workload']:>8} {r['heartbeats']:>11} {r['n']:>9}"
        row += f" {r['started_per_s']:>10.1f} {r['completed_per_s']:>12.1f}"
        row += f" {r['seconds']:>8.1f} {r['max_running']:>10}"
        row += "".join(f" {r['per_attempt'][v]:>11.3f}" for v in VERBS)
        row += f" {sum(r['per_attempt'].values()):>8.3f} {r['jobctl_per_attempt']:>10.3f}"
        print(row)
    print("gateway requests per attempt, by the controller:")
    print(
        f"{'workload':>8} {'leases':>11} {'attempts':>9}"
        + "".join(f" {k + '/att':>13}" for k in GATEWAY_KINDS)
        + f" {'all/att':>8}"
    )
    for r in results:
        g = r["gateway_per_attempt"]
        row = f"{r['workload']:>8} {r['heartbeats']:>11} {r['n']:>9}"
        row += "".join(f" {g[k]:>13.3f}" for k in GATEWAY_KINDS)
        print(row + f" {sum(g.values()):>8.3f}")
    print("CPU milliseconds per attempt, by process:")
    for r in results:
        cpu = ", ".join(f"{name} {ms:.1f}" for name, ms in r["cpu_ms"].items())
        print(f"  {r['workload']:>4} {r['heartbeats']:>11} {r['n']:>6} attempts: {cpu}; {r['reported']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="100,1000,10000", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--workloads", default="Pod,Job", type=lambda s: s.split(","))
    parser.add_argument("--parallelism", type=int, default=1000)
    parser.add_argument(
        "--qps", type=float, default=200.0, help="the controller's client-side API rate limit"
    )
    parser.add_argument("--burst", type=int, default=400)
    parser.add_argument("--seconds", type=float, default=0.0, help="how long each fake harness runs")
    parser.add_argument(
        "--heartbeats",
        default=["batch"],
        type=lambda s: s.split(","),
        help=f"lease renewals to run side by side, of {','.join(HEARTBEATS)}",
    )
    parser.add_argument("--heartbeat-seconds", type=int, default=10, help="the pool's heartbeatSeconds")
    parser.add_argument(
        "--long",
        action="store_true",
        help="harnesses that run: --sizes 1000 --workloads Pod --seconds 30 --heartbeats per-attempt,batch "
        "(flags given as well win)",
    )
    if "--long" in sys.argv[1:]:
        parser.set_defaults(**LONG)
    args = parser.parse_args()
    if unknown := set(args.heartbeats) - set(HEARTBEATS):
        parser.error(f"--heartbeats: unknown {sorted(unknown)}, choose of {','.join(HEARTBEATS)}")
    print_table(asyncio.run(bench(args)), args)


if __name__ == "__main__":
    main()
