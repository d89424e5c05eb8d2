"""The kubernetes rollout backend against kmock's emulator on 127.0.0.1, a real gateway server on
127.0.0.1, and a fake kubelet (tests/operator/fake_kubelet.py: no kubelet can run here) that plays
the harness pods: pods and their env, secret and security, outcomes and failure reasons, requeues,
heartbeats, parallelism, restarts; and the RolloutPool controller inside the real operator.
"""

import asyncio
import base64
import os
import signal
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import kubernetes_validate
import pytest
import yaml
from conftest import ADMIN
from fake_kubelet import FakeJobController, FakeKubelet, RolloutCluster
from kmock import Server
from kube_emulator import plain
from testsupport import Server as GatewayServer
from testsupport import eventually, gateway_server

from inharness.gateway.client import GatewayClient, GatewayError
from inharness.gateway.schema import ClaimedAttempt, RolloutOut
from inharness.operator.kube import (
    DEPLOYMENTS,
    HARNESSSPECS,
    JOBS,
    PODS,
    ROLLOUTPOOLS,
    SECRETS,
    TRAININGRUNS,
    KubeClient,
    NotFound,
)
from inharness.operator.pools import PoolManager
from inharness.operator.render.harness import PodContext, harness_pod, keys_name, pod_name, tasks_name
from inharness.operator.rollouts.kubernetes import KubernetesRolloutController, pool_backend_problem
from inharness.operator.rollouts.outcome import Graces, Outcome, classify
from inharness.operator.spec import HarnessSpecSpec, RolloutPoolSpec
from inharness.procs import free_port

NS = "team"
RUN = "calc"
POOL_UID = "5b4a3c1e-0000-4000-8000-00000000abcd"
TIMEOUT = 30.0
ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "calc" / "trainingrun.yaml"


@pytest.fixture(scope="module")
def gateway(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, log_dir: Path
) -> Iterator[GatewayServer]:
    """The control API is all the rollout controller uses, so no engine is needed."""
    db = tmp_path_factory.mktemp("k8s-rollouts") / "gateway.db"
    server = gateway_server(tiny_model, [], db, log_dir, admin_token=ADMIN).start()
    yield server
    server.stop()


class Env:
    """One test's cluster: the emulator, the controller's and the kubelet's API clients, the gateway."""

    def __init__(self, k8s: RolloutCluster, url: str, gateway: GatewayServer, pool: str) -> None:
        self.k8s, self.url, self.gateway_url, self.pool = k8s, url, gateway.url, pool
        self.kube = KubeClient(url, qps=1000, burst=1000)
        self.gw = GatewayClient(gateway.url, ADMIN)

    def objects(self, plural: str) -> dict[str, dict[str, Any]]:
        out = {}
        for (res, ns, name), obj in self.k8s.objects.items():
            if res.plural == plural and ns == NS and not obj.deleted:
                out[name] = plain(obj.raw)
        return out

    def pods(self) -> dict[str, dict[str, Any]]:
        return self.objects("pods")

    def controller(
        self, pool: dict[str, Any] | None = None, harness: dict[str, Any] | None = None, **kw: Any
    ) -> KubernetesRolloutController:
        pool_spec = RolloutPoolSpec.model_validate(
            {
                "harnessRef": {"name": "calc-harness"},
                "backend": "kubernetes",
                "parallelism": 4,
                "heartbeatSeconds": 1,
                "kubernetes": {
                    "ttlSecondsAfterFinished": 0,
                    "keepFailed": 0,
                    "unschedulableGraceSeconds": 0,
                    "imagePullGraceSeconds": 0,
                },
                **(pool or {}),
            }
        )
        harness_spec = HarnessSpecSpec.model_validate(
            {
                "image": "ghcr.io/inharness/calc-harness:0.1.0",
                "command": ["python", "harness.py"],
                "timeoutSeconds": 60,
                **(harness or {}),
            }
        )
        return KubernetesRolloutController(
            self.gw,
            self.kube,
            namespace=NS,
            run=RUN,
            pool_name=self.pool,
            pool_uid=POOL_UID,
            pool=pool_spec,
            harness=harness_spec,
            **kw,
        )

    async def rollouts(self, tasks: list[Any], max_attempts: int = 1) -> list[RolloutOut]:
        return await self.gw.create_rollouts(tasks, pool=self.pool, max_attempts=max_attempts)

    async def settled(self, ids: list[str], within: float = TIMEOUT) -> list[RolloutOut]:
        async def all_done() -> list[RolloutOut] | None:
            got = [await self.gw.get_rollout(i) for i in ids]
            return got if all(r.status in ("succeeded", "failed") for r in got) else None

        return await eventually(all_done, f"rollouts {ids} settled", within)


@pytest.fixture
async def env(gateway: GatewayServer, request: pytest.FixtureRequest) -> AsyncIterator[Env]:
    pool = (
        "p-" + request.node.name.replace("_", "-").replace("[", "-").replace("]", "")[-40:].strip("-").lower()
    )
    async with RolloutCluster() as k8s, Server(k8s) as server:
        e = Env(k8s, str(server.url).rstrip("/"), gateway, pool)
        try:
            yield e
        finally:
            await e.kube.aclose()
            await e.gw.aclose()


@asynccontextmanager
async def kubelet(e: Env, **kw: Any) -> AsyncIterator[FakeKubelet]:
    async with KubeClient(e.url) as kube, FakeKubelet(kube, NS, **kw) as k:
        yield k


@asynccontextmanager
async def running(controller: KubernetesRolloutController) -> AsyncIterator[asyncio.Event]:
    stop = asyncio.Event()
    task = asyncio.create_task(controller.run(stop))
    try:
        yield stop
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


def kubelet_task(**script: Any) -> dict[str, Any]:
    return {"question": "2+3", "kubelet": script}


# --- pods ---------------------------------------------------------------------------------------------


async def test_an_attempt_becomes_a_pod_with_gateway_env_secret_key_deadline_security_labels_and_owner(
    env: Env,
) -> None:
    e = env
    (rollout,) = await e.rollouts([kubelet_task(hold="pod-shape", result={"reward": 0.5})])
    async with kubelet(e) as k, running(e.controller(harness={"timeoutSeconds": 45})):
        pods = await eventually(lambda: e.pods(), "a pod")
        ((name, pod),) = pods.items()
        attempt = (await e.gw.get_rollout(rollout.id)).attempts[0]
        assert name == pod_name(e.pool, attempt.id)
        meta, spec = pod["metadata"], pod["spec"]
        assert meta["labels"] == {
            "app.kubernetes.io/name": "inharness",
            "app.kubernetes.io/instance": RUN,
            "app.kubernetes.io/component": "harness",
            "app.kubernetes.io/part-of": "inharness",
            "app.kubernetes.io/managed-by": "inharness-operator",
            "inharness.dev/training-run": RUN,
            "inharness.dev/rollout-pool": e.pool,
            "inharness.dev/rollout": rollout.id,
            "inharness.dev/attempt": attempt.id,
        }
        assert meta["ownerReferences"] == [
            {
                "apiVersion": "inharness.dev/v1alpha1",
                "kind": "RolloutPool",
                "name": e.pool,
                "uid": POOL_UID,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
        assert spec["restartPolicy"] == "Never" and spec["activeDeadlineSeconds"] == 45
        assert spec["automountServiceAccountToken"] is False
        assert spec["securityContext"] == {
            "runAsNonRoot": True,
            "runAsUser": 1000,
            "runAsGroup": 1000,
            "fsGroup": 1000,
            "seccompProfile": {"type": "RuntimeDefault"},
        }
        (c,) = spec["containers"]
        assert c["image"] == "ghcr.io/inharness/calc-harness:0.1.0" and c["command"] == [
            "python",
            "harness.py",
        ]
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
        assert (
            c["terminationMessagePath"] == "/dev/termination-log" and c["terminationMessagePolicy"] == "File"
        )
        kubernetes_validate.validate({k: v for k, v in pod.items() if k != "status"}, "1.29", strict=True)

        by_name = {v["name"]: v for v in c["env"]}
        assert by_name["OPENAI_BASE_URL"]["value"] == f"http://{RUN}-gateway:8000/v1"
        assert by_name["OPENAI_MODEL"]["value"] == "policy"
        assert by_name["INHARNESS_RESULT_FILE"]["value"] == "/dev/termination-log"
        assert by_name["INHARNESS_ATTEMPT_ID"]["value"] == attempt.id
        key_ref = {"secretKeyRef": {"name": keys_name(e.pool, attempt.id), "key": attempt.id}}
        assert by_name["OPENAI_API_KEY"] == {"name": "OPENAI_API_KEY", "valueFrom": key_ref}

        # The key reaches the container only through the Secret, and it is the attempt's live key.
        resolved = await eventually(lambda: k.env.get(name), "the kubelet resolved the env")
        key = resolved["OPENAI_API_KEY"]
        assert key.startswith("ih-") and key not in yaml.safe_dump(pod)
        async with httpx.AsyncClient() as h:
            r = await h.post(
                f"{e.gateway_url}/v1/chat/completions",
                json={"model": "policy", "messages": [{"role": "user", "content": "hi"}]},
                headers={"Authorization": f"Bearer {key}"},
            )
            assert r.status_code not in (401, 403), r.text
            bad = await h.post(
                f"{e.gateway_url}/v1/chat/completions",
                json={"model": "policy", "messages": [{"role": "user", "content": "hi"}]},
                headers={"Authorization": "Bearer ih-not-the-key"},
            )
            assert bad.status_code == 401

        # The task as an env var and as a file: the batch's ConfigMap, mounted by item.
        assert '"question": "2+3"' in by_name["INHARNESS_TASK"]["value"]
        assert by_name["INHARNESS_TASK_FILE"]["value"] == "/etc/inharness/task/task.json"
        (volume,) = spec["volumes"]
        assert volume["configMap"] == {
            "name": tasks_name(e.pool, attempt.id),
            "items": [{"key": attempt.id, "path": "task.json"}],
        }
        assert '"2+3"' in e.objects("configmaps")[tasks_name(e.pool, attempt.id)]["data"][attempt.id]

        k.release("pod-shape")
        (done,) = await e.settled([rollout.id])
    assert done.status == "succeeded" and done.reward == 0.5


async def test_key_in_path_puts_the_secret_key_into_the_base_url_by_reference_and_pool_settings_apply(
    env: Env,
) -> None:
    e = env
    await e.rollouts([kubelet_task(hold="path")])
    harness = {
        "model": {"keyIn": "path", "modelNameEnv": None},
        "task": {"env": "INHARNESS_TASK", "fileEnv": None},
    }
    pool = {
        "kubernetes": {
            "queueName": "team-a",
            "pod": {
                "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"memory": "1Gi"}},
                "nodeSelector": {"pool": "harness"},
                "env": [{"name": "EXTRA", "value": "1"}],
            },
        }
    }
    async with kubelet(e) as k, running(e.controller(pool=pool, harness=harness)):
        pods = await eventually(lambda: e.pods(), "a pod")
        pod = next(iter(pods.values()))
        assert pod["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"  # Kueue's pod integration
        container = pod["spec"]["containers"][0]
        assert container["resources"] == {  # the pool's values win; the default CPU limit stays
            "requests": {"cpu": "500m", "memory": "1Gi"},
            "limits": {"cpu": "2", "memory": "1Gi"},
        }
        assert pod["spec"]["nodeSelector"] == {"pool": "harness"}
        assert {"name": "EXTRA", "value": "1"} in container["env"]
        assert container["securityContext"]["runAsNonRoot"] is True  # overrides never touch it
        ((name, pod),) = pods.items()
        env_list = pod["spec"]["containers"][0]["env"]
        assert env_list[0]["name"] == "INHARNESS_ATTEMPT_KEY" and "secretKeyRef" in env_list[0]["valueFrom"]
        by_name = {v["name"]: v for v in env_list}
        assert (
            by_name["OPENAI_BASE_URL"]["value"] == f"http://{RUN}-gateway:8000/t/$(INHARNESS_ATTEMPT_KEY)/v1"
        )
        assert "OPENAI_MODEL" not in by_name and not pod["spec"]["volumes"]
        resolved = await eventually(lambda: k.env.get(name), "the kubelet resolved the env")
        assert (
            resolved["OPENAI_BASE_URL"]
            == f"http://{RUN}-gateway:8000/t/{resolved['INHARNESS_ATTEMPT_KEY']}/v1"
        )
        assert not e.objects("configmaps")  # no task file, no ConfigMap
        k.release("path")


# --- outcomes -----------------------------------------------------------------------------------------


async def test_exit_zero_with_a_result_message_completes_with_its_reward_and_cleans_up(env: Env) -> None:
    e = env
    rewards = [0.0, 0.25, 1.0, 0.75, 0.5]
    made = await e.rollouts([kubelet_task(result={"reward": r, "steps": i}) for i, r in enumerate(rewards)])
    async with kubelet(e), running(e.controller()) as _:
        done = await e.settled([r.id for r in made])
        assert [r.reward for r in done] == rewards and {r.status for r in done} == {"succeeded"}
        assert [r.attempts[0].info["result"] for r in done] == [{"steps": i} for i in range(5)]
        # ttlSecondsAfterFinished 0: pods go at once, and the batch's Secret and ConfigMap with the last
        await eventually(
            lambda: not e.pods() and not e.objects("secrets") and not e.objects("configmaps"), "all gone"
        )


async def test_exit_code_outcome_rewards_zero_exit_with_one_and_other_exits_with_zero(env: Env) -> None:
    e = env
    made = await e.rollouts([kubelet_task(), kubelet_task(do="exit", code=3)])
    async with kubelet(e), running(e.controller(harness={"outcome": {"type": "exitCode"}})):
        done = await e.settled([r.id for r in made])
    assert [(r.status, r.reward) for r in done] == [("succeeded", 1.0), ("succeeded", 0.0)]


FAILURES = [
    ("exit", {"do": "exit", "code": 3, "message": "Traceback: boom"}, "NonZeroExit: exited with code 3"),
    ("oom", {"do": "oom"}, "OOMKilled: "),
    ("deadline", {"do": "succeed", "seconds": 30}, "DeadlineExceeded: ran past activeDeadlineSeconds (1s)"),
    ("image-pull", {"do": "image-pull"}, "ImagePullBackOff: "),
    ("unschedulable", {"do": "unschedulable"}, "Unschedulable: 0/3 nodes are available"),
    ("deleted", {"do": "delete"}, "PodDeleted: "),
    ("evicted", {"do": "evict"}, "Evicted: The node was low on resource: memory."),
    ("no-result", {"do": "exit", "code": 0}, "BadResult: no result in the termination message"),
    (
        "bad-result",
        {"do": "exit", "code": 0, "message": '{"score": 1}'},
        "BadResult: result has no numeric 'reward'",
    ),
]


@pytest.mark.parametrize(("case", "script", "reason"), FAILURES, ids=[f[0] for f in FAILURES])
async def test_a_failure_is_reported_with_its_reason_and_requeued_up_to_max_attempts(
    env: Env, case: str, script: dict[str, Any], reason: str
) -> None:
    e = env
    (made,) = await e.rollouts([kubelet_task(**script)], max_attempts=2)
    timeout = 1 if case == "deadline" else 60
    async with kubelet(e), running(e.controller(harness={"timeoutSeconds": timeout})) as _:
        (done,) = await e.settled([made.id])
        # Pods that never finish by themselves (waiting, unschedulable) are deleted, all pods go (TTL 0).
        await eventually(lambda: not e.pods(), "the failed pods are gone")
    assert done.status == "failed" and len(done.attempts) == 2, done
    for a in done.attempts:
        assert (
            a.status == "failed" and a.failure_reason is not None and a.failure_reason.startswith(reason)
        ), a
        assert a.info["pod"] == pod_name(e.pool, a.id)


async def test_the_newest_failed_pods_are_kept_and_the_rest_deleted_after_the_ttl(env: Env) -> None:
    e = env
    made = await e.rollouts([kubelet_task(do="exit", code=i + 1) for i in range(4)] + [kubelet_task()])
    controller = e.controller(
        pool={"parallelism": 1, "kubernetes": {"ttlSecondsAfterFinished": 0, "keepFailed": 2}}
    )
    async with kubelet(e), running(controller):
        done = await e.settled([r.id for r in made])
        codes = {r.attempts[0].id: r.attempts[0].info["exit_code"] for r in done[:4]}

        def kept() -> set[int] | None:
            pods = e.pods()
            return (
                {codes[p["metadata"]["labels"]["inharness.dev/attempt"]] for p in pods.values()}
                if len(pods) == 2
                else None
            )

        # parallelism 1 runs them in order: the last two failures (exit 3 and 4) stay
        assert await eventually(kept, "two failed pods kept") == {3, 4}
        # and the Secrets of their batches with them, while the others go with their pods (a Secret is
        # deleted after its pod is: wait for it rather than catch it in between)
        kept_keys = {keys_name(e.pool, a) for a, c in codes.items() if c in (3, 4)}
        await eventually(lambda: set(e.objects("secrets")) == kept_keys, "only the kept pods' Secrets left")


GRADED = {
    "timeoutSeconds": 45,
    "outcome": {"type": "grader", "grader": {"command": ["python", "grade.py"], "timeoutSeconds": 15}},
}


async def test_a_graded_pod_runs_the_harness_as_its_init_container_and_completes_with_the_graders_reward(
    env: Env,
) -> None:
    e = env
    made = await e.rollouts(
        [
            # the grader hands on what the harness wrote to its result file (through the emptyDir)
            kubelet_task(hold="graded", result={"reward": 0.25, "steps": 3}, grader={"do": "echo"}),
            kubelet_task(
                hold="graded",
                result={"reward": 0.0},
                grader={"result": {"reward": 0.75, "why": "tests pass"}},
            ),
        ]
    )
    async with kubelet(e) as k, running(e.controller(harness=GRADED)):
        pods = await eventually(lambda: len(e.pods()) == 2 and e.pods(), "two pods, both held")
        held = next(
            p for p in pods.values() if p["metadata"]["labels"]["inharness.dev/rollout"] == made[0].id
        )
        spec = held["spec"]
        kubernetes_validate.validate({k: v for k, v in held.items() if k != "status"}, "1.29", strict=True)
        assert spec["activeDeadlineSeconds"] == 45 + 15  # one deadline for the whole pod
        (harness,) = spec["initContainers"]
        (grader,) = spec["containers"]
        assert (harness["name"], harness["image"], harness["command"]) == (
            "harness",
            "ghcr.io/inharness/calc-harness:0.1.0",
            ["python", "harness.py"],
        )
        assert (grader["name"], grader["image"], grader["command"]) == (
            "grader",
            "ghcr.io/inharness/calc-harness:0.1.0",
            ["python", "grade.py"],
        )
        for c in (harness, grader):
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert c["terminationMessagePath"] == "/dev/termination-log"
        h_env = {v["name"]: v for v in harness["env"]}
        g_env = {v["name"]: v for v in grader["env"]}
        assert h_env["INHARNESS_RESULT_FILE"]["value"] == "/var/run/inharness/harness/result.json"
        assert "OPENAI_API_KEY" in h_env and "INHARNESS_ATTEMPT_KEY" in h_env
        # The grader gets no model endpoint and no key: none of its calls could pass as the policy's.
        assert not {"OPENAI_API_KEY", "OPENAI_BASE_URL", "INHARNESS_ATTEMPT_KEY"} & set(g_env)
        assert "secretKeyRef" not in yaml.safe_dump(grader)
        assert g_env["INHARNESS_RESULT_FILE"]["value"] == "/dev/termination-log"
        assert g_env["INHARNESS_HARNESS_RESULT_FILE"]["value"] == "/var/run/inharness/harness/result.json"
        assert g_env["INHARNESS_EXIT_CODE"]["value"] == "0" and "INHARNESS_OUTPUT_FILE" not in g_env
        assert g_env["INHARNESS_TASK"] == h_env["INHARNESS_TASK"]
        assert g_env["INHARNESS_TASK_FILE"] == h_env["INHARNESS_TASK_FILE"]
        assert g_env["INHARNESS_ATTEMPT_ID"] == h_env["INHARNESS_ATTEMPT_ID"]
        shared = {"name": "harness-out", "mountPath": "/var/run/inharness/harness"}
        assert shared in harness["volumeMounts"] and {**shared, "readOnly": True} in grader["volumeMounts"]
        assert {"name": "harness-out", "emptyDir": {}} in spec["volumes"]
        task_mount = {"name": "task", "mountPath": "/etc/inharness/task", "readOnly": True}
        assert task_mount in harness["volumeMounts"] and task_mount in grader["volumeMounts"]
        k.release("graded")
        done = await e.settled([r.id for r in made])
    assert [(r.status, r.reward) for r in done] == [("succeeded", 0.25), ("succeeded", 0.75)]
    assert done[0].attempts[0].info["result"] == {"steps": 3}
    assert done[1].attempts[0].info["result"] == {"why": "tests pass"}
    assert {r.attempts[0].info["exit_code"] for r in done} == {0}
    assert {r.attempts[0].info["grader_exit_code"] for r in done} == {0}


GRADED_FAILURES = [
    (
        "harness-exit",
        {"do": "exit", "code": 3},
        "NonZeroExit: the harness exited with code 3; the grader did not run",
    ),
    ("harness-oom", {"do": "oom"}, "OOMKilled: the harness exceeded its memory limit"),
    (
        "grader-exit",
        {"grader": {"do": "exit", "code": 2, "message": "cannot grade"}},
        "GraderFailed: the grader exited with code 2",
    ),
    ("grader-oom", {"grader": {"do": "oom"}}, "OOMKilled: the grader exceeded its memory limit"),
    (
        "grader-no-result",
        {"grader": {"do": "exit", "code": 0}},
        "BadResult: no grader result in the termination message",
    ),
    (
        "grader-bad-result",
        {"grader": {"message": '{"score": 1}'}},
        "BadResult: grader result has no numeric 'reward'",
    ),
    (
        "harness-deadline",
        {"seconds": 30},
        "DeadlineExceeded: the harness ran past activeDeadlineSeconds (2s, the harness's timeoutSeconds "
        "and the grader's",
    ),
    (
        "grader-deadline",
        {"grader": {"seconds": 30}},
        "DeadlineExceeded: the grader ran past activeDeadlineSeconds (2s",
    ),
]


@pytest.mark.parametrize(("case", "script", "reason"), GRADED_FAILURES, ids=[f[0] for f in GRADED_FAILURES])
async def test_a_graded_pod_fails_with_a_reason_naming_the_harness_or_the_grader_and_requeues(
    env: Env, case: str, script: dict[str, Any], reason: str
) -> None:
    e = env
    (made,) = await e.rollouts([kubelet_task(**script)], max_attempts=2)
    deadline = case.endswith("-deadline")
    graded = {
        "timeoutSeconds": 1 if deadline else 30,
        "outcome": {
            "type": "grader",
            "grader": {"command": ["python", "grade.py"], "timeoutSeconds": 1 if deadline else 30},
        },
    }
    async with kubelet(e), running(e.controller(harness=graded)):
        (done,) = await e.settled([made.id])
        await eventually(lambda: not e.pods(), "the failed pods are gone")
    assert done.status == "failed" and len(done.attempts) == 2, done
    for a in done.attempts:
        assert a.failure_reason is not None and a.failure_reason.startswith(reason), a
    if case == "grader-exit":
        assert done.attempts[0].info["message"] == "cannot grade"
        assert done.attempts[0].info["grader_exit_code"] == 2


async def post_as_harness(e: Env, k: FakeKubelet, rollout_id: str, body: dict[str, Any]) -> None:
    """What a harness in the pod would do: post its reward to the gateway with the key it was given."""

    def pod_env() -> dict[str, str] | None:
        for name, pod in e.pods().items():
            if pod["metadata"]["labels"]["inharness.dev/rollout"] == rollout_id:
                return k.env.get(name)
        return None

    key = (await eventually(pod_env, f"the pod of {rollout_id} runs"))["OPENAI_API_KEY"]
    async with httpx.AsyncClient() as h:
        r = await h.post(
            f"{e.gateway_url}/v1/inharness/reward", json=body, headers={"Authorization": f"Bearer {key}"}
        )
    assert r.status_code == 200, r.text


async def test_a_reward_posted_by_the_harness_completes_a_pod_without_one_and_the_result_file_wins(
    env: Env,
) -> None:
    e = env
    scripts: list[dict[str, Any]] = [
        {"do": "exit", "code": 0},  # no termination message: the posted reward
        {"result": {"reward": 0.9}},  # the result file wins
        {"message": '{"steps": 4}'},  # a result without a reward: the posted one, the steps kept
        {"do": "exit", "code": 3},  # a failed harness stays failed
    ]
    made = await e.rollouts([kubelet_task(hold=f"p{i}", **s) for i, s in enumerate(scripts)])
    async with kubelet(e) as k, running(e.controller()):
        for i, rollout in enumerate(made):
            await post_as_harness(e, k, rollout.id, {"reward": 0.25 + i / 100, "by": "harness"})
            k.release(f"p{i}")
        done = await e.settled([r.id for r in made])
    assert [(r.status, r.reward) for r in done] == [
        ("succeeded", 0.25),
        ("succeeded", 0.9),
        ("succeeded", 0.27),
        ("failed", None),
    ]
    first = done[0].attempts[0].info
    assert first["reward_source"] == "posted" and first["posted"] == {"by": "harness"}
    assert "reward_source" not in done[1].attempts[0].info
    assert done[2].attempts[0].info["result"] == {"steps": 4}
    assert (done[3].attempts[0].failure_reason or "").startswith("NonZeroExit: exited with code 3")
    assert all("_reward_missing" not in r.attempts[0].info for r in done)


async def test_a_reward_posted_by_the_harness_never_stands_in_for_a_missing_grade(env: Env) -> None:
    e = env
    (made,) = await e.rollouts([kubelet_task(hold="graded-post", grader={"do": "exit", "code": 0})])
    async with kubelet(e) as k, running(e.controller(harness=GRADED)):
        await post_as_harness(e, k, made.id, {"reward": 1.0})
        k.release("graded-post")
        (done,) = await e.settled([made.id])
    assert done.status == "failed"
    assert (done.attempts[0].failure_reason or "").startswith("BadResult: no grader result")


# --- leases, parallelism, restarts --------------------------------------------------------------------


async def test_heartbeats_renew_the_lease_while_the_pod_runs(env: Env) -> None:
    e = env
    (made,) = await e.rollouts([kubelet_task(hold="beats")])
    async with kubelet(e) as k, running(e.controller(pool={"leaseSeconds": 10})):
        await eventually(lambda: e.pods(), "a pod")
        claimed = (await e.gw.get_rollout(made.id)).attempts[0]

        async def renewed() -> bool:
            a = (await e.gw.get_rollout(made.id)).attempts[0]
            return a.lease_expires_at > claimed.claimed_at + 10 + 0.5

        await eventually(renewed, "the lease renewed past its first expiry")
        k.release("beats")
        (done,) = await e.settled([made.id])
    assert done.status == "succeeded" and len(done.attempts) == 1


async def test_parallelism_is_never_exceeded_on_any_pod_watch_event(env: Env) -> None:
    e = env
    scripts = [{"seconds": 0.01 * (i % 5)} for i in range(18)] + [
        {"do": "unschedulable"},
        {"do": "image-pull"},
    ] * 3
    made = await e.rollouts([kubelet_task(**s) for s in scripts])
    async with kubelet(e, limit=3) as k, running(e.controller(pool={"parallelism": 3})):
        done = await e.settled([r.id for r in made], within=60)
    assert [r.status for r in done] == ["succeeded"] * 18 + ["failed"] * 6
    assert k.active_over == [] and k.max_active == 3, (k.active_over, k.max_active)
    assert set(k.added.values()) == {1} and len(k.added) == len(scripts)


async def test_a_restart_mid_batch_neither_duplicates_a_pod_nor_loses_or_double_reports_an_outcome(
    env: Env,
) -> None:
    e = env
    made = await e.rollouts([kubelet_task(hold=f"g{i}", result={"reward": i / 10}) for i in range(6)])
    keep = {"parallelism": 4, "kubernetes": {"ttlSecondsAfterFinished": 3600}}
    reports: list[tuple[str, str]] = []
    async with kubelet(e, limit=4) as k:
        first = e.controller(pool=keep, on_report=lambda a, o, r: reports.append((a.id, r)))
        async with running(first):
            await eventually(lambda: len(k.env) == 4, "four pods running (parallelism 4)")
            k.release("g0")
            await eventually(
                lambda: len(reports) == 1 and len(k.env) == 5, "g0 reported, a fifth pod in its slot"
            )
        # The first controller is gone; meanwhile two more harnesses finish unobserved.
        k.release("g1")
        k.release("g2")
        await eventually(
            lambda: sum((p.get("status") or {}).get("phase") == "Succeeded" for p in e.pods().values()) == 3,
            "three pods finished",
        )
        second = e.controller(pool=keep, on_report=lambda a, o, r: reports.append((a.id, r)))
        async with running(second):
            await eventually(lambda: len(reports) == 4, "the adopted finished pods reported")
            assert second.adopted == 5
            for i in range(3, 6):
                k.release(f"g{i}")
            done = await e.settled([r.id for r in made])
    assert [r.reward for r in done] == [i / 10 for i in range(6)]
    assert all(len(r.attempts) == 1 and r.status == "succeeded" for r in done)  # nothing requeued
    assert set(k.added.values()) == {1} and len(k.added) == 6  # one pod per attempt, ever
    by_attempt: dict[str, list[str]] = {}
    for attempt, report in reports:
        by_attempt.setdefault(attempt, []).append(report)
    # g0 was reported by the first controller and re-reported after adoption: a duplicate, not counted.
    assert sorted(map(tuple, by_attempt.values())) == sorted(
        [("accepted", "duplicate")] + [("accepted",)] * 5
    )
    assert first.succeeded + second.succeeded == 6 and second.duplicates == 1


async def test_a_pod_of_a_lost_lease_is_deleted_and_not_reported_as_the_attempt(env: Env) -> None:
    e = env
    (made,) = await e.rollouts([kubelet_task(hold="lost")])
    async with kubelet(e), running(e.controller(pool={"leaseSeconds": 10})):
        await eventually(lambda: e.pods(), "a pod")
        attempt = (await e.gw.get_rollout(made.id)).attempts[0]
        # The gateway settles the attempt some other way (here: an admin completes it).
        await e.gw.complete(attempt.id, "failed", None, {"reason": "cancelled by an admin"})
        await eventually(lambda: not e.pods(), "the orphaned pod is deleted")
    (after,) = (await e.gw.get_rollout(made.id)).attempts
    assert after.failure_reason == "cancelled by an admin"


async def test_a_deletion_missed_while_the_watch_was_away_is_found_by_the_relist_after_410_gone(
    env: Env,
) -> None:
    e = env
    (made,) = await e.rollouts([kubelet_task(hold="missed")])
    controller = e.controller()
    controller.watch_timeout_seconds = 1  # the server ends each watch after 1 s; the controller resumes
    async with kubelet(e), running(controller):
        pods = await eventually(lambda: e.pods(), "a pod")
        (name,) = pods
        # The pod vanishes without an event reaching the controller, and its resourceVersion is too
        # old by the time it reconnects: the API server answers 410 Gone, the controller re-lists.
        e.k8s.expire_versions = True
        del e.k8s.objects["v1/pods", NS, name]
        (done,) = await e.settled([made.id])
    assert done.status == "failed" and done.attempts[0].failure_reason is not None
    assert done.attempts[0].failure_reason.startswith("PodDeleted: ")
    assert not e.k8s.expire_versions  # the 410 was served


async def test_the_controller_claims_a_batch_in_one_gateway_request(env: Env) -> None:
    e = env
    paths: list[str] = []

    async def count(request: httpx.Request) -> None:
        paths.append(request.url.path)

    e.gw._http.event_hooks["request"].append(count)
    made = await e.rollouts([kubelet_task(hold="batch") for _ in range(6)])
    async with kubelet(e) as k, running(e.controller(pool={"parallelism": 6})):
        await eventually(lambda: len(k.env) == 6, "six pods running")
        # the six were queued before the controller started: one request claimed them all
        assert paths.count("/api/v1/attempts/claim-batch") == 1 and "/api/v1/attempts/claim" not in paths
        k.release("batch")
        done = await e.settled([r.id for r in made])
    assert {r.status for r in done} == {"succeeded"}


class OlderGateway(GatewayClient):
    """A gateway from before batch claims: its claim-batch route does not exist."""

    async def claim_batch(
        self,
        pool: str = "default",
        lease_seconds: float = 600.0,
        limit: int = 100,
        claim_key: str | None = None,
    ) -> Any:
        raise GatewayError(404, "Not Found")


async def test_against_a_gateway_without_batch_claims_the_controller_claims_one_at_a_time(env: Env) -> None:
    e = env
    made = await e.rollouts([kubelet_task() for _ in range(5)])
    controller = e.controller()
    logs: list[str] = []
    async with OlderGateway(e.gateway_url, ADMIN) as old:
        controller.gateway, controller.log = old, logs.append
        async with kubelet(e), running(controller):
            done = await e.settled([r.id for r in made])
    assert {r.status for r in done} == {"succeeded"}
    assert sum("no batch claims" in line for line in logs) == 1  # found out once, then single claims


# --- the Job workload ---------------------------------------------------------------------------------


def job_pool(**kubernetes: Any) -> dict[str, Any]:
    base = {
        "ttlSecondsAfterFinished": 0,
        "keepFailed": 0,
        "unschedulableGraceSeconds": 0,
        "imagePullGraceSeconds": 0,
    }
    return {"kubernetes": {**base, "workload": "Job", **kubernetes}}


@asynccontextmanager
async def job_controller(e: Env) -> AsyncIterator[FakeJobController]:
    async with KubeClient(e.url) as kube, FakeJobController(kube, NS) as jobs:
        yield jobs


WORKLOAD_CASES = [
    ("success", {"result": {"reward": 0.25}}, None),
    ("exit", {"do": "exit", "code": 3, "message": "Traceback: boom"}, "NonZeroExit: exited with code 3"),
    ("deadline", {"do": "succeed", "seconds": 30}, "DeadlineExceeded: ran past activeDeadlineSeconds (1s)"),
]


@pytest.mark.parametrize("workload", ["Pod", "Job"])
@pytest.mark.parametrize(("case", "script", "reason"), WORKLOAD_CASES, ids=[c[0] for c in WORKLOAD_CASES])
async def test_a_job_attempt_ends_as_the_pod_attempt_does_and_its_job_takes_its_pod_along(
    env: Env, workload: str, case: str, script: dict[str, Any], reason: str | None
) -> None:
    e = env
    (made,) = await e.rollouts([kubelet_task(**script)])
    pool = job_pool(workload=workload)
    harness = {"timeoutSeconds": 1 if case == "deadline" else 60}
    async with kubelet(e), job_controller(e) as jobs, running(e.controller(pool=pool, harness=harness)):
        (done,) = await e.settled([made.id])
        await eventually(
            lambda: not e.pods() and not e.objects("jobs") and not e.objects("secrets"), "all gone"
        )
    (attempt,) = done.attempts
    if reason is None:
        assert (done.status, done.reward) == ("succeeded", 0.25)
    else:
        assert done.status == "failed" and (attempt.failure_reason or "").startswith(reason), attempt
    if workload == "Job":
        # one pod for the Job, ever; the Job was deleted and its pod went with it (Background)
        assert list(jobs.created.values()) == [1] and len(jobs.collected) == 1
        assert attempt.info["pod"].startswith(f"{e.pool}-{attempt.id}-")
    else:
        assert not jobs.created and attempt.info["pod"] == pod_name(e.pool, attempt.id)


async def test_a_job_carries_the_attempt_and_waits_suspended_in_its_queue_until_admitted(env: Env) -> None:
    e = env
    (made,) = await e.rollouts([kubelet_task(result={"reward": 1.0})])
    async with (
        kubelet(e),
        job_controller(e) as jobs,
        running(e.controller(pool=job_pool(queueName="team-a"))),
    ):
        ((name, job),) = (await eventually(lambda: e.objects("jobs"), "a Job")).items()
        attempt = (await e.gw.get_rollout(made.id)).attempts[0]
        assert name == f"{e.pool}-{attempt.id}" and job["spec"]["suspend"] is True
        assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
        assert job["metadata"]["labels"]["inharness.dev/attempt"] == attempt.id
        assert job["metadata"]["ownerReferences"][0]["uid"] == POOL_UID
        assert (
            job["spec"]["backoffLimit"] == 0 and job["spec"]["template"]["spec"]["restartPolicy"] == "Never"
        )
        kubernetes_validate.validate({k: v for k, v in job.items() if k != "status"}, "1.29", strict=True)
        await asyncio.sleep(0.5)
        assert not e.pods() and not jobs.created  # suspended: no pod, the lease is kept meanwhile
        assert (await e.gw.get_rollout(made.id)).status == "running"
        await e.kube.patch(JOBS, name, {"spec": {"suspend": False}}, NS)  # Kueue admits it
        (done,) = await e.settled([made.id])
    assert done.status == "succeeded" and done.reward == 1.0 and list(jobs.created.values()) == [1]


async def test_a_restarted_controller_adopts_running_and_finished_jobs_without_a_second_pod(env: Env) -> None:
    e = env
    made = await e.rollouts([kubelet_task(hold=f"j{i}", result={"reward": i / 10}) for i in range(3)])
    keep = job_pool(ttlSecondsAfterFinished=3600)
    async with kubelet(e) as k, job_controller(e) as jobs:
        async with running(e.controller(pool=keep)):
            await eventually(lambda: len(k.env) == 3, "three Job pods running")
        k.release("j0")  # finishes while no controller runs
        await eventually(
            lambda: any((p.get("status") or {}).get("phase") == "Succeeded" for p in e.pods().values()),
            "a pod finished",
        )
        second = e.controller(pool=keep)
        async with running(second):
            k.release("j1")
            k.release("j2")
            done = await e.settled([r.id for r in made])
            assert second.adopted == 3
    assert [(r.status, r.reward, len(r.attempts)) for r in done] == [
        ("succeeded", i / 10, 1) for i in range(3)
    ]
    assert list(jobs.created.values()) == [1, 1, 1]


# --- pure parts ---------------------------------------------------------------------------------------


def waiting_pod(reason: str) -> dict[str, Any]:
    return {
        "metadata": {"name": "p"},
        "status": {
            "phase": "Pending",
            "containerStatuses": [
                {"name": "harness", "state": {"waiting": {"reason": reason, "message": "m"}}}
            ],
        },
    }


def test_waiting_problems_fail_only_after_their_grace_counted_from_first_sight() -> None:
    graces = Graces(image_pull_seconds=120, unschedulable_seconds=300)
    seen: dict[str, float] = {}

    def at(pod: dict[str, Any], now: float) -> tuple[Outcome | None, float | None]:
        return classify(
            pod,
            gone=False,
            outcome_type="resultFile",
            timeout_seconds=60,
            graces=graces,
            first_seen=seen,
            now=now,
        )

    assert at(waiting_pod("ErrImagePull"), 1000.0) == (None, 1120.0)
    assert at(waiting_pod("ImagePullBackOff"), 1100.0) == (None, 1120.0)  # one grace for both reasons
    outcome, _ = at(waiting_pod("ImagePullBackOff"), 1120.0)
    assert outcome is not None and outcome.reason == "ImagePullBackOff: m"
    unschedulable = {
        "metadata": {"name": "p"},
        "status": {
            "phase": "Pending",
            "conditions": [
                {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "no"}
            ],
        },
    }
    assert at(unschedulable, 2000.0) == (None, 2300.0)
    outcome, _ = at(unschedulable, 2300.0)
    assert outcome is not None and outcome.reason == "Unschedulable: no"
    outcome, _ = at(waiting_pod("InvalidImageName"), 0.0)
    assert outcome is not None and outcome.reason == "InvalidImageName: m"  # no grace: it never heals


def test_a_grader_outcome_is_no_longer_a_problem_for_the_kubernetes_backend() -> None:
    graded = HarnessSpecSpec.model_validate({"image": "h:1", "command": ["h"], **GRADED})
    assert pool_backend_problem(graded) is None
    assert pool_backend_problem(HarnessSpecSpec.model_validate({"command": ["h"]})) == (
        "HarnessImageMissing",
        "the HarnessSpec has no image; pods need one",
    )


def test_a_pod_killed_by_its_deletion_or_an_eviction_is_not_a_harness_failure() -> None:
    graces = Graces(0, 0)
    killed = {
        "metadata": {"name": "p", "deletionTimestamp": "2026-01-01T00:00:00Z"},
        "status": {
            "phase": "Running",
            "containerStatuses": [
                {"name": "harness", "state": {"terminated": {"exitCode": 143, "reason": "Error"}}}
            ],
        },
    }
    outcome, _ = classify(
        killed, gone=False, outcome_type="resultFile", timeout_seconds=1, graces=graces, first_seen={}, now=0
    )
    assert outcome is not None and outcome.reason is not None and outcome.reason.startswith("PodDeleted: ")
    killed["status"]["conditions"] = [
        {
            "type": "DisruptionTarget",
            "status": "True",
            "reason": "EvictionByEvictionAPI",
            "message": "Eviction API: evicting",
        }
    ]
    outcome, _ = classify(
        killed, gone=True, outcome_type="exitCode", timeout_seconds=1, graces=graces, first_seen={}, now=0
    )
    assert outcome is not None and outcome.reason == "Evicted: EvictionByEvictionAPI: Eviction API: evicting"


# --- the operator ---------------------------------------------------------------------------------------


@pytest.fixture
async def own_gateway(tiny_model: Path, tmp_path: Path) -> AsyncIterator[GatewayServer]:
    """Its own gateway: the pool's `queued` count is the whole gateway's queue."""
    server = gateway_server(tiny_model, [], tmp_path / "gw.db", tmp_path, admin_token=ADMIN)
    await asyncio.to_thread(server.spawn().wait_healthy)
    try:
        yield server
    finally:
        server.stop()


class Operator:
    """`inharness operator run` as a subprocess against the emulator, stopped with SIGTERM."""

    def __init__(self, kubeconfig: Path, gateway_url: str, log: Path) -> None:
        self.env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
        self.gateway_url, self.log = gateway_url, log
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        with self.log.open("ab") as out:
            self.proc = await asyncio.create_subprocess_exec(
                *[sys.executable, "-m", "inharness.cli", "operator", "run", "--namespace", NS],
                *["--metrics-port", str(free_port()), "--liveness-port", str(free_port())],
                *["--resync-seconds", "1", "--gateway-url", self.gateway_url],
                env=self.env,
                stdout=out,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
            )

    async def stop(self) -> None:
        if self.proc is None or self.proc.returncode is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(self.proc.wait(), 20)
        except TimeoutError:
            os.killpg(self.proc.pid, signal.SIGKILL)
            await self.proc.wait()


async def test_the_example_as_written_is_planned_into_harness_pods_not_refused_as_backend_local() -> None:
    """The RolloutPool controller's decision for examples/calc/trainingrun.yaml, unchanged: a
    controller for the run (once its gateway is available), pods from the HarnessSpec's image; the
    same pool with backend local is what the operator refuses."""

    class Kube:
        """The run's gateway Deployment available and its admin token Secret present."""

        async def get(self, resource: Any, name: str, namespace: str) -> dict[str, Any]:
            assert name == "calc-gateway" and namespace == NS
            if resource is DEPLOYMENTS:
                return {
                    "metadata": {"generation": 1},
                    "status": {"observedGeneration": 1, "availableReplicas": 1},
                }
            assert resource is SECRETS
            return {"data": {"admin-token": base64.b64encode(ADMIN.encode()).decode()}}

    docs = [d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d]
    for d in docs:
        d["metadata"]["namespace"] = NS
    harness, pool, run = docs
    manager = PoolManager(
        Kube(), None, None, gateway_url="http://{name}-gateway.{namespace}.svc:8000", namespaces=[NS]
    )
    harnesses = {(NS, harness["metadata"]["name"]): harness}
    wanted: dict[Any, Any] = {}
    assert await manager._plan(pool, [run], harnesses, wanted) is None
    want = wanted[(NS, "calc")]
    ctx = PodContext(
        NS, "calc", "calc-pool", None, want.harness, want.spec.kubernetes, "http://calc-gateway:8000"
    )
    attempt = ClaimedAttempt(
        id="a1", rollout_id="r1", group_id="g1", seq=0, task={"q": 1}, token="k", lease_expires_at=0.0
    )
    (container,) = harness_pod(ctx, attempt, "b1")["spec"]["containers"]
    assert container["image"] == "ghcr.io/inharness/calc-harness:0.1.0"
    # No workingDir: the image's own (/workspace, where the calc-harness image holds harness.py).
    assert container["command"] == ["python", "harness.py"] and "workingDir" not in container

    pool["spec"]["backend"] = "local"
    problem = await manager._plan(pool, [run], harnesses, {})
    assert problem is not None and problem[0] == "BackendLocal"


async def test_the_operator_runs_a_kubernetes_pool_reports_counts_and_the_dominant_failure_across_restarts(
    own_gateway: GatewayServer, tmp_path: Path
) -> None:
    docs = [d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d]
    for d in docs:
        d["metadata"]["namespace"] = NS
    harness, pool, run = docs
    assert pool["spec"]["backend"] == "kubernetes"  # the example as `inharness run` takes it, too
    pool["spec"].update(
        parallelism=2,
        maxAttemptsPerRollout=1,
        kubernetes={"ttlSecondsAfterFinished": 0, "keepFailed": 1},
    )
    async with RolloutCluster() as k8s, Server(k8s) as server:
        k8s.add_namespace(NS)
        url = str(server.url).rstrip("/")
        log = tmp_path / "operator.log"
        operator = Operator(k8s.kubeconfig(tmp_path / "kubeconfig", url), own_gateway.url, log)
        async with (
            KubeClient(url) as kube,
            FakeKubelet(kube, NS, limit=2) as k,
            GatewayClient(own_gateway.url, ADMIN) as gw,
        ):
            # The run's admin token Secret exists already, so the operator uses it (as it keeps it).
            secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "calc-gateway"}}
            await kube.create(
                SECRETS, {**secret, "data": {"admin-token": base64.b64encode(ADMIN.encode()).decode()}}, NS
            )
            for resource, doc in ((HARNESSSPECS, harness), (ROLLOUTPOOLS, pool), (TRAININGRUNS, run)):
                await kube.create(resource, doc, NS)

            async def gateway_up() -> bool:
                """Do what the Deployment controller would: the operator's gateway is available."""
                try:
                    d = await kube.get(DEPLOYMENTS, "calc-gateway", NS)
                except NotFound:
                    return False
                status = {"observedGeneration": d["metadata"]["generation"], "availableReplicas": 1}
                await kube.patch(DEPLOYMENTS, "calc-gateway", {"status": status}, NS, subresource="status")
                return True

            async def pool_status(succeeded: int, failed: int) -> dict[str, Any] | None:
                status = (await kube.get(ROLLOUTPOOLS, "calc-pool", NS)).get("status") or {}
                return (
                    status if (status.get("succeeded"), status.get("failed")) == (succeeded, failed) else None
                )

            await operator.start()
            try:
                await eventually(gateway_up, "the operator made the gateway Deployment", within=60)
                tasks = [kubelet_task(result={"reward": 1.0})] * 2 + [kubelet_task(do="oom")] * 5
                made = await gw.create_rollouts(tasks, pool="calc-pool", max_attempts=1)
                status = await eventually(lambda: pool_status(2, 5), "status: 2 succeeded, 5 failed", 60)
                done = [await gw.get_rollout(r.id) for r in made]
                assert [r.status for r in done] == ["succeeded"] * 2 + ["failed"] * 5
                assert status["observedGeneration"] == 1 and status["queued"] == 0 and status["running"] == 0
                conditions = {c["type"]: c for c in status["conditions"]}
                assert conditions["Ready"]["status"] == "True"
                degraded = conditions["Degraded"]
                assert (degraded["status"], degraded["reason"]) == ("True", "OOMKilled"), degraded
                assert "5 of the last 7" in degraded["message"]
                pool_uid = (await kube.get(ROLLOUTPOOLS, "calc-pool", NS))["metadata"]["uid"]

                async def one_kept() -> list[dict[str, Any]] | None:
                    pods = await kube.list(PODS, NS)
                    return pods if len(pods) == 1 else None

                (kept,) = await eventually(one_kept, "only the newest failed pod kept (keepFailed 1)")
                assert kept["metadata"]["ownerReferences"][0]["uid"] == pool_uid
                assert kept["status"]["containerStatuses"][0]["state"]["terminated"]["reason"] == "OOMKilled"

                # An operator restart while an attempt runs: the pod is left running, adopted, reported once.
                (held,) = await gw.create_rollouts(
                    [kubelet_task(hold="restart")], pool="calc-pool", max_attempts=1
                )
                await eventually(lambda: len(k.env) == 8, "the eighth pod runs")
                await operator.stop()
                k.release("restart")
                await operator.start()
                status = await eventually(lambda: pool_status(3, 5), "status: 3 succeeded, 5 failed", 60)
                assert (await gw.get_rollout(held.id)).status == "succeeded"
                assert len((await gw.get_rollout(held.id)).attempts) == 1
                # too few outcomes since the restart to judge: Degraded stays as it was
                assert {c["type"]: c["reason"] for c in status["conditions"]}["Degraded"] == "OOMKilled"
                assert k.active_over == [] and set(k.added.values()) == {1}
            finally:
                await operator.stop()
            assert "Traceback" not in log.read_text(), log.read_text()[-4000:]
