"""The real operator (`inharness operator run`, a subprocess) against kmock's Kubernetes emulator on
127.0.0.1: children with owner references, status and conditions, updates, drift, suspend, deletion,
and progress read from a real gateway.

The emulator is no kube-apiserver: no controller runs, so a test that needs an available gateway
or a ready trainer writes those Deployment/StatefulSet statuses itself, as the controllers would.
Its one stand-in for a controller is the garbage collector's owner-reference rule (kube_emulator.py).
The same flow through the real kubectl: test_kubectl_flow.py.
"""

import asyncio
import base64
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import kmock
import pytest
import yaml
from kmock import Server
from kube_emulator import EmulatedCluster, plain
from operator_process import operator_running
from testsupport import eventually

from inharness.gateway.client import GatewayClient
from inharness.gateway.schema import ProgressReport
from inharness.procs import ServerProcess, free_port

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "calc" / "trainingrun.yaml"
NS = "test"
RUNS = "inharness.dev/v1alpha1/trainingruns"
CHILDREN = {
    ("v1/secrets", "calc-gateway"),
    ("v1/configmaps", "calc-config"),
    ("v1/persistentvolumeclaims", "calc-gateway-store"),
    ("v1/services", "calc-gateway"),
    ("apps/v1/deployments", "calc-gateway"),
    ("v1/services", "calc-trainer"),
    ("apps/v1/statefulsets", "calc-trainer"),
}
API = {
    "inharness.dev/v1alpha1/trainingruns": "/apis/inharness.dev/v1alpha1/namespaces/test/trainingruns",
    "inharness.dev/v1alpha1/rolloutpools": "/apis/inharness.dev/v1alpha1/namespaces/test/rolloutpools",
    "inharness.dev/v1alpha1/harnessspecs": "/apis/inharness.dev/v1alpha1/namespaces/test/harnessspecs",
    "v1/secrets": "/api/v1/namespaces/test/secrets",
    "v1/configmaps": "/api/v1/namespaces/test/configmaps",
    "v1/persistentvolumeclaims": "/api/v1/namespaces/test/persistentvolumeclaims",
    "v1/services": "/api/v1/namespaces/test/services",
    "apps/v1/deployments": "/apis/apps/v1/namespaces/test/deployments",
    "apps/v1/statefulsets": "/apis/apps/v1/namespaces/test/statefulsets",
}
PLURAL = {
    "TrainingRun": RUNS,
    "RolloutPool": "inharness.dev/v1alpha1/rolloutpools",
    "HarnessSpec": "inharness.dev/v1alpha1/harnessspecs",
}


@dataclass
class Cluster:
    k8s: EmulatedCluster
    client: Any  # aiohttp session bound to the emulator, as kubectl would talk to it
    metrics_url: str
    operator: asyncio.subprocess.Process
    log: Path

    def get(self, resource: str, name: str) -> dict[str, Any] | None:
        *group, version, plural = resource.split("/")
        key = (kmock.resource(group[0] if group else "", version, plural), NS, name)
        if key not in self.k8s.objects or self.k8s.objects[key].deleted:
            return None
        return plain(self.k8s.objects[key].raw)

    def run(self) -> dict[str, Any]:
        run = self.get(RUNS, "calc")
        assert run is not None
        return run

    def status(self) -> dict[str, Any]:
        return self.run().get("status") or {}

    def condition(self, type_: str) -> tuple[str, str] | None:
        c = next((c for c in self.status().get("conditions") or [] if c["type"] == type_), None)
        return (c["status"], c["reason"]) if c else None

    async def apply(self, doc: dict[str, Any]) -> None:
        r = await self.client.post(API[PLURAL[doc["kind"]]], json=doc)
        assert r.status == 200 or r.status == 201, await r.text()

    async def patch(self, resource: str, name: str, patch: dict[str, Any], subresource: str = "") -> None:
        path = f"{API[resource]}/{name}" + (f"/{subresource}" if subresource else "")
        r = await self.client.patch(
            path, json=patch, headers={"Content-Type": "application/merge-patch+json"}
        )
        assert r.status == 200, await r.text()

    async def delete(self, resource: str, name: str) -> None:
        r = await self.client.delete(f"{API[resource]}/{name}")
        assert r.status == 200, await r.text()

    def events(self, reason: str | None = None) -> list[dict[str, Any]]:
        out = []
        for (res, _ns, _name), obj in self.k8s.objects.items():
            if res.plural != "events" or res.group != "" or obj.deleted:
                continue
            event = plain(obj.raw)
            if event["involvedObject"]["kind"] == "TrainingRun" and reason in (None, event["reason"]):
                out.append(event)
        return out

    async def mark_up(self) -> None:
        """Do what the Deployment and StatefulSet controllers would: pods available and ready."""
        deployment = self.get("apps/v1/deployments", "calc-gateway")
        assert deployment is not None
        gen = deployment["metadata"]["generation"]
        await self.patch(
            "apps/v1/deployments",
            "calc-gateway",
            {
                "status": {
                    "observedGeneration": gen,
                    "replicas": 1,
                    "availableReplicas": 1,
                    "readyReplicas": 1,
                }
            },
            "status",
        )
        await self.patch(
            "apps/v1/statefulsets", "calc-trainer", {"status": {"replicas": 1, "readyReplicas": 1}}, "status"
        )


def example_docs() -> list[dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d]
    for d in docs:
        d["metadata"]["namespace"] = NS
    return docs


@pytest.fixture
def gateway_port() -> int:
    return free_port()


@contextlib.asynccontextmanager
async def operator_on(
    k8s: EmulatedCluster, server: Server, tmp_path: Path, gateway_port: int
) -> AsyncIterator[Cluster]:
    """The operator watching NS of this emulator, with nothing listening at its gateway URL."""
    kubeconfig = k8s.kubeconfig(tmp_path / "kubeconfig", str(server.url).rstrip("/"))
    gateway_url = f"http://127.0.0.1:{gateway_port}"
    async with operator_running(
        kubeconfig, tmp_path / "operator.log", namespace=NS, gateway_url=gateway_url
    ) as op:
        yield Cluster(k8s, server.client, op.metrics_url, op.proc, op.log)


@pytest.fixture
async def cluster(tmp_path: Path, gateway_port: int) -> AsyncIterator[Cluster]:
    async with EmulatedCluster() as k8s, Server(k8s) as server:
        k8s.add_namespace(NS)
        async with operator_on(k8s, server, tmp_path, gateway_port) as c:
            yield c


async def apply_example(c: Cluster) -> None:
    for doc in example_docs():
        await c.apply(doc)


def children_present(c: Cluster) -> bool:
    return all(c.get(res, name) is not None for res, name in CHILDREN)


async def test_emulator_run_gets_owned_children_status_conditions_events_and_metrics(
    cluster: Cluster,
) -> None:
    c = cluster
    await apply_example(c)
    await eventually(lambda: children_present(c), "all seven children exist")
    uid = c.run()["metadata"]["uid"]
    for res, name in CHILDREN:
        owners = c.get(res, name)["metadata"]["ownerReferences"]  # type: ignore[index]
        assert owners == [
            {
                "apiVersion": "inharness.dev/v1alpha1",
                "kind": "TrainingRun",
                "name": "calc",
                "uid": uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ], (res, name)
    status = await eventually(lambda: c.status().get("conditions") and c.status(), "a status with conditions")
    assert status["observedGeneration"] == 1 and status["phase"] == "Pending"
    types = {x["type"]: x for x in status["conditions"]}
    assert set(types) == {"Ready", "Progressing", "Degraded", "Suspended", "Complete", "Failed"}
    for x in types.values():
        assert x["lastTransitionTime"].endswith("Z") and x["observedGeneration"] == 1
    assert c.condition("Ready") == ("False", "GatewayNotReady")
    assert c.condition("Progressing") == ("True", "Starting")
    # no finalizer of ours or kopf's: deletion is the garbage collector's
    assert not c.run()["metadata"].get("finalizers")
    annotations = await eventually(
        lambda: (
            "inharness.dev/last-handled-configuration" in (c.run()["metadata"].get("annotations") or {})
            and c.run()["metadata"]["annotations"]
        ),
        "kopf's diff base under our annotation prefix",
    )
    assert all(not k.startswith("kopf.zalando.org") for k in annotations)
    await eventually(lambda: c.events("Pending"), "an Event for the phase change to Pending")

    async def metrics() -> str | None:
        async with httpx.AsyncClient(timeout=2) as h:
            text = (await h.get(c.metrics_url)).text
        ok = 'inharness_operator_reconciles_total{kind="TrainingRun",result="ok"}' in text
        return text if ok and 'inharness_operator_training_runs{phase="Pending"} 1.0' in text else None

    await eventually(metrics, "metrics count reconciles and runs by phase")


async def test_emulator_spec_update_is_re_reconciled_into_the_config(cluster: Cluster) -> None:
    c = cluster
    await apply_example(c)
    await eventually(lambda: children_present(c), "children exist")
    await c.patch(RUNS, "calc", {"spec": {"steps": 21}})
    assert c.run()["metadata"]["generation"] == 2

    def rerendered() -> bool:
        run_yaml = c.get("v1/configmaps", "calc-config")["data"]["run.yaml"]  # type: ignore[index]
        return list(yaml.safe_load_all(run_yaml))[2]["spec"]["steps"] == 21

    await eventually(rerendered, "the ConfigMap holds the new steps")
    await eventually(lambda: c.status().get("observedGeneration") == 2, "observedGeneration 2")
    assert {x["observedGeneration"] for x in c.status()["conditions"]} == {2}


async def test_emulator_deleted_or_edited_children_are_restored_by_the_resync(cluster: Cluster) -> None:
    c = cluster
    await apply_example(c)
    await eventually(lambda: children_present(c), "children exist")
    token = c.get("v1/secrets", "calc-gateway")["data"]["admin-token"]  # type: ignore[index]
    await c.delete("apps/v1/deployments", "calc-gateway")
    await c.delete("v1/configmaps", "calc-config")
    await c.patch("apps/v1/statefulsets", "calc-trainer", {"spec": {"replicas": 5}})
    await eventually(lambda: c.get("apps/v1/deployments", "calc-gateway"), "the Deployment is recreated")
    await eventually(lambda: c.get("v1/configmaps", "calc-config"), "the ConfigMap is recreated")
    await eventually(
        lambda: c.get("apps/v1/statefulsets", "calc-trainer")["spec"]["replicas"] == 1,  # type: ignore[index]
        "the scaled StatefulSet is patched back",
    )
    # the token is generated once and kept
    assert c.get("v1/secrets", "calc-gateway")["data"]["admin-token"] == token  # type: ignore[index]


async def test_emulator_suspend_scales_to_zero_and_back_keeping_state(cluster: Cluster) -> None:
    c = cluster
    await apply_example(c)
    await eventually(lambda: children_present(c), "children exist")
    token = c.get("v1/secrets", "calc-gateway")["data"]["admin-token"]  # type: ignore[index]

    def replicas() -> tuple[int, int]:
        d, s = c.get("apps/v1/deployments", "calc-gateway"), c.get("apps/v1/statefulsets", "calc-trainer")
        return d["spec"]["replicas"], s["spec"]["replicas"]  # type: ignore[index]

    await c.patch(RUNS, "calc", {"spec": {"suspend": True}})
    await eventually(lambda: replicas() == (0, 0), "gateway and trainer scaled to zero")
    await eventually(lambda: c.status().get("phase") == "Suspended", "phase Suspended")
    assert c.condition("Suspended") == ("True", "SuspendRequested")
    assert children_present(c)  # Secret, ConfigMap and the store claim stay
    await eventually(lambda: c.events("Suspended"), "an Event for the suspension")

    await c.patch(RUNS, "calc", {"spec": {"suspend": False}})
    await eventually(lambda: replicas() == (1, 1), "scaled back up")
    await eventually(lambda: c.condition("Suspended") == ("False", "NotSuspended"), "no longer suspended")
    assert c.get("v1/secrets", "calc-gateway")["data"]["admin-token"] == token  # type: ignore[index]


async def test_emulator_available_children_with_unreachable_gateway_are_running_and_progressing(
    cluster: Cluster,
) -> None:
    c = cluster
    await apply_example(c)
    await eventually(lambda: children_present(c), "children exist")
    await c.mark_up()
    await eventually(lambda: c.status().get("phase") == "Running", "phase Running")
    await eventually(
        lambda: c.condition("Progressing") == ("True", "GatewayUnreachable"), "GatewayUnreachable"
    )
    assert c.condition("Ready") == ("True", "Available")
    assert c.condition("Degraded") == ("False", "AsExpected")


@pytest.mark.slow
async def test_emulator_progress_from_a_real_gateway_reaches_status_and_completion_frees_the_trainer(
    cluster: Cluster, gateway_port: int, tiny_model: Path, tmp_path: Path
) -> None:
    c = cluster
    steps = example_docs()[2]["spec"]["steps"]
    await apply_example(c)
    await eventually(lambda: children_present(c), "children exist")
    secret = c.get("v1/secrets", "calc-gateway")
    token = base64.b64decode(secret["data"]["admin-token"]).decode()  # type: ignore[index]
    args = ["gateway", "--model", str(tiny_model), "--store", f"sqlite:///{tmp_path / 'gw.db'}"]
    args += ["--port", str(gateway_port), f"--admin-token={token}"]  # "=": it may start with "-"
    gw = ServerProcess.inharness(args, port=gateway_port, log=tmp_path / "gateway.log", health="/healthz")
    await asyncio.to_thread(gw.spawn().wait_healthy)
    try:
        await c.mark_up()
        async with GatewayClient(gw.url, token) as client:
            await client.create_rollouts([{"q": 1}], pool="calc-pool")
            await client.register_version(2, ["http://127.0.0.1:9"], activate=True)
            for step, reward in [(1, 0.25), (2, 0.5)]:
                await client.report_progress(ProgressReport(step=step, total_steps=steps, reward_mean=reward))
            await eventually(lambda: c.status().get("step") == 2, "step 2 in the status")
            status = c.status()
            assert status["rewardHistory"] == [0.25, 0.5] and status["rewardMean"] == 0.5
            assert status["modelVersion"] == 2 and status["phase"] == "Running"
            assert c.condition("Progressing") == ("True", "Training")
            assert status["startTime"]

            await client.report_progress(
                ProgressReport(step=steps, total_steps=steps, reward_mean=0.9, state="complete")
            )
            await eventually(lambda: c.status().get("phase") == "Complete", "phase Complete")
            assert c.condition("Complete") == ("True", "StepsDone") and c.status()["completionTime"]
            await eventually(
                lambda: c.get("apps/v1/statefulsets", "calc-trainer")["spec"]["replicas"] == 0,  # type: ignore[index]
                "the finished run's trainer scaled to zero",
            )
            assert c.get("apps/v1/deployments", "calc-gateway")["spec"]["replicas"] == 1  # type: ignore[index]
            await eventually(lambda: c.events("Complete"), "an Event for completion")
    finally:
        await asyncio.to_thread(gw.stop)


async def test_emulator_missing_pool_degrades_then_recovers_when_it_arrives(cluster: Cluster) -> None:
    c = cluster
    harness, pool, run = example_docs()
    await c.apply(run)
    await eventually(lambda: c.condition("Degraded") == ("True", "RolloutPoolNotFound"), "Degraded: no pool")
    assert c.status()["phase"] == "Pending" and c.get("apps/v1/deployments", "calc-gateway") is None
    await c.apply(pool)
    await eventually(
        lambda: c.condition("Degraded") == ("True", "HarnessSpecNotFound"), "Degraded: no harness"
    )
    await c.apply(harness)
    await eventually(lambda: children_present(c), "children once the references resolve")
    await eventually(lambda: c.condition("Degraded") == ("False", "AsExpected"), "no longer degraded")


async def test_emulator_deleted_run_goes_at_once_and_its_children_with_it(cluster: Cluster) -> None:
    c = cluster
    await apply_example(c)
    await eventually(lambda: children_present(c), "children exist")
    await c.delete(RUNS, "calc")
    assert c.get(RUNS, "calc") is None  # no finalizer holds it
    # The garbage collector (emulated) deletes what the TrainingRun owns; no resync brings it back.
    assert all(c.get(res, name) is None for res, name in CHILDREN)
    await asyncio.sleep(2)
    assert all(c.get(res, name) is None for res, name in CHILDREN)

    async def forgotten() -> bool:
        async with httpx.AsyncClient(timeout=2) as h:
            text = (await h.get(c.metrics_url)).text
        return all(
            f'inharness_operator_training_runs{{phase="{p}"}} 0.0' in text for p in ("Pending", "Running")
        )

    await eventually(forgotten, "the operator no longer counts the deleted run")
    assert c.operator.returncode is None


async def test_emulator_refused_child_degrades_with_an_event_and_the_next_resync_recovers(
    cluster: Cluster,
) -> None:
    c = cluster
    refusal = {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "code": 422,
        "reason": "Invalid",
        "message": 'StatefulSet.apps "calc-trainer" is invalid: spec.template: Invalid value',
    }
    c.k8s[f"post {API['apps/v1/statefulsets']}"][:1] << 422 << refusal
    await apply_example(c)
    event = await eventually(lambda: c.events("ApplyFailed"), "a Warning event naming the refusal")
    assert event[0]["type"] == "Warning" and "StatefulSet calc-trainer: 422 Invalid" in event[0]["message"]

    async def counted() -> bool:
        async with httpx.AsyncClient(timeout=2) as h:
            text = (await h.get(c.metrics_url)).text
        return 'inharness_operator_errors_total{error="ApplyFailed",kind="TrainingRun"} 1.0' in text

    await eventually(counted, "the refusal counted as an error")
    await eventually(lambda: children_present(c), "every child once the API server accepts it")
    await eventually(lambda: c.condition("Degraded") == ("False", "AsExpected"), "no longer degraded")


async def test_emulator_objects_made_while_the_operator_was_down_get_one_event_per_phase_change(
    tmp_path: Path, gateway_port: int
) -> None:
    """Resume, the pool's and harness's create handlers and the resync all reconcile the run at
    start; each must see what the previous one wrote, so "new -> Pending" is posted once."""
    async with EmulatedCluster() as k8s, Server(k8s) as server:
        k8s.add_namespace(NS)
        for doc in example_docs():
            r = await server.client.post(API[PLURAL[doc["kind"]]], json=doc)
            assert r.status in (200, 201), await r.text()
        async with operator_on(k8s, server, tmp_path, gateway_port) as c:
            await eventually(lambda: c.status().get("phase") == "Pending", "phase Pending")
            await asyncio.sleep(3)  # three resyncs and every start-up handler have run
            events = [e["message"] for e in c.events()]
            assert events == ["new -> Pending: the gateway Deployment has no available pod"], events


async def test_emulator_unreachable_gateway_backs_the_claims_off_says_it_once_and_in_the_pool_status(
    cluster: Cluster,
) -> None:
    """The gateway's Deployment is available but nothing listens at --gateway-url (a closed port):
    the pool's controller backs off, logs the first failure at WARNING and no line per retry, and
    the RolloutPool says GatewayReachable=False."""
    c = cluster
    await apply_example(c)
    await eventually(lambda: children_present(c), "children exist")
    await c.mark_up()

    def reachable() -> dict[str, Any] | None:
        pool = c.get("inharness.dev/v1alpha1/rolloutpools", "calc-pool") or {}
        conditions = (pool.get("status") or {}).get("conditions") or []
        return next((x for x in conditions if x["type"] == "GatewayReachable"), None)

    condition = await eventually(
        lambda: (reachable() or {}).get("status") == "False" and reachable(), "GatewayReachable False"
    )
    assert condition["reason"] == "GatewayUnreachable"
    assert condition["message"].startswith("cannot claim from the gateway of TrainingRun calc since ")
    assert "ConnectError" in condition["message"]
    await asyncio.sleep(6)  # 0.5 s between claims before the backoff would have meant 12 lines by now
    lines = [x for x in c.log.read_text().splitlines() if "claim" in x]
    assert len(lines) == 1, lines
    assert (
        " WARNING inharness.operator.pools: test/calc: pool calc-pool: cannot claim from the gateway"
        in lines[0]
    )
    pool_events = [
        e
        for (res, _ns, _name), obj in c.k8s.objects.items()
        if res.plural == "events" and not obj.deleted
        for e in [plain(obj.raw)]
        if e["involvedObject"]["kind"] == "RolloutPool"
    ]
    assert [(e["type"], e["reason"]) for e in pool_events] == [("Warning", "GatewayUnreachable")]
