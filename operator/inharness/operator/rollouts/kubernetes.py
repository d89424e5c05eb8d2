"""Kubernetes rollout backend: one bare Pod per claimed attempt, watched, reported, cleaned up.

Why bare Pods (not a Job per attempt, not an Indexed Job per batch):
- One API object per attempt. A Job per attempt adds the Job object, and the job controller's own
  watches, status writes and pod creations on top of it: twice the objects and about three times
  the API writes per attempt, for retries the gateway already does (a failed attempt requeues its
  rollout as a new attempt).
- An Indexed Job per batch cannot give each index its own task and key without a lookup per index
  (a file per index, or an init step that fetches it), its pods fail and retry as a group, and a
  per-attempt failure reason has to be dug out of the Job's pods anyway.
- Kueue admits plain Pods through its pod integration (label `kueue.x-k8s.io/queue-name`, from the
  pool's `kubernetes.queueName`), so a Job is not needed for quota either.

Per attempt: Pod `<pool>-<attempt id>` (a deterministic name, so an attempt never gets a second
pod: AlreadyExists means adopt it), restartPolicy Never, activeDeadlineSeconds = the harness's
timeout, the restricted security context of every inharness pod, labels naming run, pool, rollout
and attempt, owned by the RolloutPool. Per claimed batch (up to `max_batch` attempts): one Secret
with each attempt's key (data key = attempt id), which the pod reads through `secretKeyRef`, so no
key is ever in a pod spec; and, when the harness takes its task as a file, one ConfigMap with each
attempt's task (key = attempt id) that the pod mounts by item. Both go once the batch's last pod is
gone. So the objects per attempt are one pod plus 2/`max_batch` (4 API writes per batch).

The outcome is the harness container's terminated state: exit code, OOMKilled, the pod's
DeadlineExceeded or Evicted, and the termination message (terminationMessagePath
/dev/termination-log, policy File: logs are not a result), which holds the result JSON the harness
wrote to its result file, read with the local backend's rules (a harness that left no reward there
may have posted one to the gateway: `ClaimingController.with_posted_reward`). With
`outcome.type: grader` the harness runs as the pod's init container and the grader as its
container (same image, a shared emptyDir for the harness's result file, the grader's result JSON
as its termination message), so neither command is wrapped; `harness_pod` says what the grader
sees. Failures that leave a pod waiting (image pull errors, Unschedulable) fail the attempt after a
grace and the pod is deleted. Each failure reason starts with a CamelCase key (`OOMKilled: ...`)
that the pool's status aggregates.

Pods are watched by label selector (list, then watch from the list's resourceVersion; a 410 Gone
re-lists), never polled; attempts are claimed in batches (one gateway request per batch) while
fewer than `parallelism` attempts are in flight (adopted ones included); creation is paced by the
KubeClient's QPS/burst.

Restart safety: on start the controller lists its pods and adopts them (attempt and rollout ids are
in their labels): running ones get a heartbeat at once and then as usual, finished ones are
reported. A report repeated after a restart is answered by the gateway as a duplicate and changes
nothing (nor the counters); an attempt whose lease expired while no controller ran is refused
(409) and was requeued by the gateway. Stopping the controller (operator shutdown, changed spec)
detaches from running pods without reporting them, so the next controller adopts them.
"""

import asyncio
import contextlib
import heapq
import itertools
import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

import aiohttp
import httpx

from inharness.gateway.client import GatewayClient, GatewayError
from inharness.gateway.schema import ClaimedAttempt
from inharness.operator import render
from inharness.operator.api import API_VERSION
from inharness.operator.kube import CONFIGMAPS, PODS, SECRETS, AlreadyExists, KubeClient, KubeError, NotFound
from inharness.operator.rollouts import Abort, ClaimingController, OnFinish, Outcome, reason_key
from inharness.operator.rollouts.local import KEY_PLACEHOLDER, NoReward, parse_result
from inharness.operator.spec import HarnessSpecSpec, KubernetesPool, RolloutPoolSpec

_log = logging.getLogger(__name__)

Obj = dict[str, Any]

CONTAINER = "harness"
GRADER = "grader"
KEY_ENV = "INHARNESS_ATTEMPT_KEY"
TASK_DIR = "/etc/inharness/task"
TASK_FILE = "task.json"
TERMINATION_LOG = "/dev/termination-log"
HANDOFF_VOLUME = "harness-out"
HANDOFF_DIR = "/var/run/inharness/harness"  # emptyDir: the harness writes, the grader reads
HARNESS_RESULT = f"{HANDOFF_DIR}/result.json"
LABEL_RUN = "inharness.dev/training-run"
LABEL_POOL = "inharness.dev/rollout-pool"
LABEL_ROLLOUT = "inharness.dev/rollout"
LABEL_ATTEMPT = "inharness.dev/attempt"
LABEL_COMPONENT = "app.kubernetes.io/component"
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
TASKS_PER_CONFIGMAP_BYTES = 900_000  # the API server refuses objects over about 1 MiB
MESSAGE_TAIL = 1024

IMAGE_ERRORS = {"ErrImagePull", "ImagePullBackOff", "ErrImageNeverPull", "RegistryUnavailable"}
CREATE_ERRORS = {"CreateContainerConfigError", "CreateContainerError", "RunContainerError"}
DISRUPTIONS = {"EvictionByEvictionAPI", "PreemptionByScheduler", "DeletionByTaintManager"}


# --- names and objects (pure) ------------------------------------------------------------------------


def pod_name(pool: str, attempt_id: str) -> str:
    return f"{pool}-{attempt_id}"


def keys_name(pool: str, batch: str) -> str:
    return f"{pool}-{batch}-keys"


def tasks_name(pool: str, batch: str) -> str:
    return f"{pool}-{batch}-tasks"


def selector(run: str, pool: str) -> str:
    return f"{LABEL_COMPONENT}=harness,{LABEL_RUN}={run},{LABEL_POOL}={pool}"


@dataclass(frozen=True)
class PodContext:
    """What every pod of one controller shares."""

    namespace: str
    run: str
    pool: str
    pool_uid: str | None
    harness: HarnessSpecSpec
    settings: KubernetesPool
    gateway_url: str  # as the harness pods reach it: the run's gateway Service

    def labels(self) -> dict[str, str]:
        out = {**render.labels(self.run, "harness"), LABEL_POOL: self.pool}
        if self.settings.queue_name is not None:
            out[KUEUE_QUEUE_LABEL] = self.settings.queue_name
        return out

    def meta(self, name: str, extra_labels: Mapping[str, str] | None = None) -> Obj:
        meta: Obj = {
            "name": name,
            "namespace": self.namespace,
            "labels": {**self.labels(), **(extra_labels or {})},
        }
        if self.pool_uid is not None:
            meta["ownerReferences"] = [
                {
                    "apiVersion": API_VERSION,
                    "kind": "RolloutPool",
                    "name": self.pool,
                    "uid": self.pool_uid,
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ]
        return meta

    @property
    def task_as_file(self) -> bool:
        return self.harness.task.file_env is not None


def batch_objects(ctx: PodContext, batch: str, attempts: list[ClaimedAttempt]) -> list[Obj]:
    """The batch's Secret of keys and, for harnesses that read their task from a file, its ConfigMap."""
    meta_labels = {k: v for k, v in ctx.labels().items() if k != KUEUE_QUEUE_LABEL}
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {**ctx.meta(keys_name(ctx.pool, batch)), "labels": meta_labels},
        "type": "Opaque",
        "stringData": {a.id: a.token for a in attempts},
    }
    out = [secret]
    if ctx.task_as_file:
        out.append(
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {**ctx.meta(tasks_name(ctx.pool, batch)), "labels": meta_labels},
                "data": {a.id: json.dumps(a.task) for a in attempts},
            }
        )
    return out


def pod_deadline(harness: HarnessSpecSpec) -> int:
    """activeDeadlineSeconds of an attempt's pod: it covers every container, so with a grader it is
    the harness's timeout and the grader's together."""
    grader = harness.outcome.grader
    return harness.timeout_seconds + (grader.timeout_seconds if grader is not None else 0)


def _task_env(ctx: PodContext, attempt: ClaimedAttempt) -> dict[str, Obj]:
    t = ctx.harness.task
    out: dict[str, Obj] = {}
    if t.env is not None:
        out[t.env] = {"value": json.dumps(attempt.task)}
    if t.file_env is not None:
        out[t.file_env] = {"value": f"{TASK_DIR}/{TASK_FILE}"}
    return out


def harness_pod(ctx: PodContext, attempt: ClaimedAttempt, batch: str) -> Obj:
    """The Pod of one attempt: the user's image, command and args unchanged; the model endpoint, key,
    task and result path in the environment variables the HarnessSpec names.

    With `outcome.type: grader` the harness is the pod's init container and the grader its one
    container, in the same image: the kubelet starts the grader only once the harness exited 0, no
    wrapper around the user's command is needed, and the grader's result is the pod's termination
    message. The harness's result file is in an emptyDir that the grader mounts read-only."""
    h = ctx.harness
    m = h.model
    graded = h.outcome.type == "grader"
    key_ref = {"secretKeyRef": {"name": keys_name(ctx.pool, batch), "key": attempt.id}}
    ours: dict[str, Obj] = {}
    if m.key_in == "header":
        ours[m.base_url_env] = {"value": f"{ctx.gateway_url}/v1"}
        ours[m.api_key_env] = {"valueFrom": key_ref}
    else:
        ours[m.base_url_env] = {"value": f"{ctx.gateway_url}/t/$({KEY_ENV})/v1"}
        ours[m.api_key_env] = {"value": KEY_PLACEHOLDER}
    if m.model_name_env is not None:
        ours[m.model_name_env] = {"value": m.model_name}
    ours.update(_task_env(ctx, attempt))
    if h.outcome.type != "exitCode":
        ours[h.outcome.result_file_env] = {"value": HARNESS_RESULT if graded else TERMINATION_LOG}
    ours["INHARNESS_ATTEMPT_ID"] = {"value": attempt.id}
    ours["INHARNESS_ROLLOUT_ID"] = {"value": attempt.rollout_id}
    # The key comes first: $(INHARNESS_ATTEMPT_KEY) only expands in variables defined after it.
    env: list[Obj] = [{"name": KEY_ENV, "valueFrom": key_ref}]
    env += [{"name": e.name, "value": e.value} for e in h.env if e.name not in ours and e.name != KEY_ENV]
    env += [{"name": name, **value} for name, value in ours.items() if name != KEY_ENV]

    container: Obj = {
        "name": CONTAINER,
        "image": h.image,
        "command": list(h.command),
        "args": list(h.args),
        "env": env,
        "terminationMessagePath": TERMINATION_LOG,
        "terminationMessagePolicy": "File",
    }
    if h.working_dir is not None:
        container["workingDir"] = render._resolve(h.working_dir)
    volumes: list[Obj] = []
    mounts: list[Obj] = []
    if ctx.task_as_file:
        mounts.append({"name": "task", "mountPath": TASK_DIR, "readOnly": True})
        volumes.append(
            {
                "name": "task",
                "configMap": {
                    "name": tasks_name(ctx.pool, batch),
                    "items": [{"key": attempt.id, "path": TASK_FILE}],
                },
            }
        )
    if graded:
        volumes.append({"name": HANDOFF_VOLUME, "emptyDir": {}})
        container["volumeMounts"] = [*mounts, {"name": HANDOFF_VOLUME, "mountPath": HANDOFF_DIR}]
    elif mounts:
        container["volumeMounts"] = mounts
    overrides = render._overrides_of(ctx.settings.pod)
    spec = render._pod_spec(
        container,
        volumes,
        overrides,
        restartPolicy="Never",
        activeDeadlineSeconds=pod_deadline(h),
    )
    if graded:
        grader = _grader_container(ctx, attempt, mounts)
        render._apply_overrides({}, grader, overrides)  # container-level overrides only: pod ones are set
        grader["securityContext"] = dict(render._CONTAINER_SECURITY)
        spec["initContainers"], spec["containers"] = spec["containers"], [grader]
    labels = {LABEL_ROLLOUT: attempt.rollout_id, LABEL_ATTEMPT: attempt.id}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": ctx.meta(pod_name(ctx.pool, attempt.id), labels),
        "spec": spec,
    }


def _grader_container(ctx: PodContext, attempt: ClaimedAttempt, mounts: list[Obj]) -> Obj:
    """The grader, with the env contract of the local backend's grader (rollouts/local.py) except
    where a pod cannot give it: no model endpoint and no key (none of its calls may be recorded as
    the policy's), the task from the spec (the harness cannot have changed it), INHARNESS_EXIT_CODE
    always 0 (it only runs after exit 0), INHARNESS_HARNESS_RESULT_FILE always set (the file may be
    missing) and no INHARNESS_OUTPUT_FILE: the harness's stdout is its container log, which no
    container can read without a shell wrapper around the user's command or API access."""
    h = ctx.harness
    assert h.outcome.grader is not None
    ours: dict[str, Obj] = {
        **_task_env(ctx, attempt),
        "INHARNESS_ATTEMPT_ID": {"value": attempt.id},
        "INHARNESS_ROLLOUT_ID": {"value": attempt.rollout_id},
        "INHARNESS_EXIT_CODE": {"value": "0"},
        "INHARNESS_HARNESS_RESULT_FILE": {"value": HARNESS_RESULT},
        h.outcome.result_file_env: {"value": TERMINATION_LOG},
    }
    env = [{"name": e.name, "value": e.value} for e in h.env if e.name not in ours]
    env += [{"name": name, **value} for name, value in ours.items()]
    container: Obj = {
        "name": GRADER,
        "image": h.image,
        "command": list(h.outcome.grader.command),
        "env": env,
        "terminationMessagePath": TERMINATION_LOG,
        "terminationMessagePolicy": "File",
        "volumeMounts": [*mounts, {"name": HANDOFF_VOLUME, "mountPath": HANDOFF_DIR, "readOnly": True}],
    }
    if h.working_dir is not None:
        container["workingDir"] = render._resolve(h.working_dir)
    return container


def batch_of(pool: str, pod: Mapping[str, Any]) -> str | None:
    """The batch a live pod belongs to: the Secret its key comes from names it."""
    prefix = f"{pool}-"
    spec = pod.get("spec") or {}
    for c in [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]:
        for e in c.get("env") or []:
            name = str(((e.get("valueFrom") or {}).get("secretKeyRef") or {}).get("name") or "")
            if e.get("name") == KEY_ENV and name.startswith(prefix) and name.endswith("-keys"):
                return name.removeprefix(prefix).removesuffix("-keys")
    return None


# --- reading a pod's state (pure) --------------------------------------------------------------------


@dataclass(frozen=True)
class Graces:
    image_pull_seconds: float
    unschedulable_seconds: float


def _container(pod: Mapping[str, Any], name: str = CONTAINER) -> Mapping[str, Any]:
    """The status of container `name`, a regular or an init container (the harness of a graded pod)."""
    status = pod.get("status") or {}
    for cs in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]:
        if cs.get("name") == name:
            return cs
    return {}


def _condition(pod: Mapping[str, Any], type_: str) -> Mapping[str, Any]:
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == type_:
            return c
    return {}


def _time(value: Any) -> float | None:
    if not isinstance(value, str) or not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _tail(text: Any, size: int = MESSAGE_TAIL) -> str:
    return str(text or "")[-size:]


def is_terminal(pod: Mapping[str, Any]) -> bool:
    return (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")


def finished_at(pod: Mapping[str, Any]) -> float | None:
    """Wall time the pod's last container (the harness, or its grader) ended, when the pod says."""
    ends = [
        _time(((_container(pod, name).get("state") or {}).get("terminated") or {}).get("finishedAt"))
        for name in (CONTAINER, GRADER)
    ]
    return max((e for e in ends if e is not None), default=None)


def classify(
    pod: Mapping[str, Any],
    *,
    gone: bool,
    outcome_type: Literal["resultFile", "exitCode", "grader"],
    timeout_seconds: int,
    graces: Graces,
    first_seen: dict[str, float],
    now: float,
) -> tuple[Outcome | None, float | None]:
    """(the attempt's outcome, or None while it runs; when to look again though nothing changes).

    `timeout_seconds` is the pod's activeDeadlineSeconds; `first_seen` remembers (monotonic `now`)
    when a waiting problem was first seen, for its grace. A graded pod is read step by step: the
    harness (its init container) until it exited 0, then the grader (its container).
    """
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    phase, pod_reason = status.get("phase"), status.get("reason")
    graded = outcome_type == "grader"
    harness_term = (_container(pod).get("state") or {}).get("terminated")
    grading = (
        graded
        and harness_term is not None
        and harness_term.get("exitCode") == 0
        and harness_term.get("reason") != "OOMKilled"
    )
    step = GRADER if grading else CONTAINER
    cs = _container(pod, step)
    state = cs.get("state") or {}
    term = state.get("terminated")
    info: dict[str, Any] = {"pod": meta.get("name")}
    if (pod.get("spec") or {}).get("nodeName"):
        info["node"] = pod["spec"]["nodeName"]
    if harness_term is not None:
        info["exit_code"] = harness_term.get("exitCode")
    if grading and term is not None:
        info["grader_exit_code"] = term.get("exitCode")
    first = _time((harness_term or term or {}).get("startedAt"))
    last = _time((term or {}).get("finishedAt"))
    if first is not None and last is not None:
        info["pod_seconds"] = round(max(0.0, last - first), 3)
    who = f"the {step} " if graded else ""

    if phase == "Failed" and pod_reason == "DeadlineExceeded":
        limit = (
            f"{timeout_seconds}s, the harness's timeoutSeconds and the grader's"
            if graded
            else f"{timeout_seconds}s"
        )
        return Outcome.failure(
            f"DeadlineExceeded: {who}ran past activeDeadlineSeconds ({limit})", **info
        ), None
    if phase == "Failed" and pod_reason == "Evicted":
        return Outcome.failure(f"Evicted: {_tail(status.get('message'))}", **info), None
    disruption = _condition(pod, "DisruptionTarget")
    deleted = gone or bool(meta.get("deletionTimestamp"))
    if term is not None:
        code = term.get("exitCode")
        message = str(term.get("message") or "")
        if term.get("reason") == "OOMKilled":
            return Outcome.failure(
                f"OOMKilled: the {step} exceeded its memory limit (exit code {code})", **info
            ), None
        if code != 0 and deleted:
            return _deleted(disruption, info), None
        if outcome_type == "exitCode":
            return Outcome.success(1.0 if code == 0 else 0.0, **info), None
        if code != 0 and step == GRADER:
            return Outcome.failure(
                f"GraderFailed: the grader exited with code {code}", **info, message=_tail(message)
            ), None
        if code != 0:
            detail = "; the grader did not run" if graded else ""
            return Outcome.failure(
                f"NonZeroExit: {who}exited with code {code}{detail}", **info, message=_tail(message)
            ), None
        # A harness's result without a reward may be made good by a reward it posted; a grader's not.
        if not message.strip():
            whose = "grader " if graded else ""
            empty = f"BadResult: no {whose}result in the termination message ({TERMINATION_LOG})"
            return (Outcome.failure if graded else Outcome.missing_reward)(empty, **info), None
        try:
            reward, rest = parse_result(message.encode(), "grader " if graded else "")
        except NoReward as exc:
            more = {"result": exc.rest} if exc.rest else {}
            make = Outcome.failure if graded else Outcome.missing_reward
            return make(f"BadResult: {exc}", **info, **more, message=_tail(message)), None
        except ValueError as exc:
            return Outcome.failure(f"BadResult: {exc}", **info, message=_tail(message)), None
        return Outcome.success(reward, **info, **({"result": rest} if rest else {})), None
    if phase in ("Succeeded", "Failed"):
        why = pod_reason or "PodFailed"
        return Outcome.failure(f"PodFailed: {why}: {_tail(status.get('message'))}", **info), None
    if deleted:
        return _deleted(disruption, info), None

    waiting = state.get("waiting") or {}
    why = str(waiting.get("reason") or "")
    if why == "InvalidImageName":
        return Outcome.failure(f"InvalidImageName: {_tail(waiting.get('message'))}", **info), None
    if why in IMAGE_ERRORS or why in CREATE_ERRORS:
        group = "ImagePullBackOff" if why in IMAGE_ERRORS else why
        since = first_seen.setdefault(group, now)
        due = since + graces.image_pull_seconds
        if now >= due:
            detail = (
                f"{why}: {_tail(waiting.get('message'))}" if why != group else _tail(waiting.get("message"))
            )
            return Outcome.failure(f"{group}: {detail}", **info), None
        return None, due
    scheduled = _condition(pod, "PodScheduled")
    if scheduled.get("status") == "False" and scheduled.get("reason") == "Unschedulable":
        since = first_seen.setdefault("Unschedulable", now)
        due = since + graces.unschedulable_seconds
        if now >= due:
            return Outcome.failure(f"Unschedulable: {_tail(scheduled.get('message'))}", **info), None
        return None, due
    return None, None


def _deleted(disruption: Mapping[str, Any], info: dict[str, Any]) -> Outcome:
    if disruption.get("status") == "True" and disruption.get("reason") in DISRUPTIONS:
        return Outcome.failure(f"Evicted: {disruption['reason']}: {_tail(disruption.get('message'))}", **info)
    return Outcome.failure("PodDeleted: the pod was deleted before its harness finished", **info)


# --- the controller ----------------------------------------------------------------------------------


@dataclass(eq=False)
class _Tracked:
    """One attempt with a pod (to be) created: the pod as last seen, and what the controller did."""

    attempt: ClaimedAttempt
    name: str
    batch: str | None
    adopted: bool = False
    pod: Obj | None = None
    gone: bool = False
    deleting: bool = False
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    first_seen: dict[str, float] = field(default_factory=dict)
    finished: float | None = None  # monotonic time the outcome was settled, for the TTL
    failed: bool = False
    done: bool = False  # its attempt task has ended
    create: bool = False  # this controller creates the pod (not adopted)


class _Detached(Exception):
    """The controller stops while the attempt's pod runs: leave it to the next controller."""


Report = Literal["accepted", "duplicate", "refused"]
OnReport = Callable[[ClaimedAttempt, Outcome, Report], None]


class KubernetesRolloutController(ClaimingController):
    """Runs a RolloutPool's attempts of one TrainingRun as pods (see the module docstring)."""

    max_batch = 100
    claim_concurrency = 8  # single claims in flight, against a gateway without batch claims
    claim_linger_seconds = 0.1  # how long a freed slot waits for others, so that batches stay large
    gateway_concurrency = 16
    watch_timeout_seconds = 300
    create_tries = 4

    def __init__(
        self,
        gateway: GatewayClient,
        kube: KubeClient,
        *,
        namespace: str,
        run: str,
        pool_name: str,
        pool_uid: str | None,
        pool: RolloutPoolSpec,
        harness: HarnessSpecSpec,
        gateway_service_url: str | None = None,
        log: Callable[[str], None] | None = None,
        on_finish: OnFinish | None = None,
        on_report: OnReport | None = None,
    ) -> None:
        super().__init__(
            gateway,
            pool_name,
            parallelism=pool.parallelism,
            lease_seconds=pool.lease_for(harness),
            heartbeat_seconds=pool.heartbeat_seconds,
            log=log,
            on_finish=on_finish,
        )
        problem = pool_backend_problem(harness)
        if problem is not None:
            raise ValueError(problem[1])
        self.kube = kube
        self.on_report = on_report
        self.ctx = PodContext(
            namespace=namespace,
            run=run,
            pool=pool_name,
            pool_uid=pool_uid,
            harness=harness,
            settings=pool.kubernetes,
            gateway_url=(gateway_service_url or render.gateway_url(run)).rstrip("/"),
        )
        self.graces = Graces(
            float(pool.kubernetes.image_pull_grace_seconds),
            float(pool.kubernetes.unschedulable_grace_seconds),
        )
        self.selector = selector(run, pool_name)
        self.duplicates = 0
        self.adopted = 0
        self._batch_claims = True  # until the gateway says it has no batch-claim endpoint
        self._pods: dict[str, _Tracked] = {}
        self._batches: dict[str, set[str]] = {}
        self._reap = asyncio.Event()
        self._expiry: list[tuple[float, int, _Tracked]] = []  # finished pods by finish time (heap)
        self._kept: list[tuple[float, int, _Tracked]] = []  # the newest failed pods, oldest first
        self._seq = itertools.count()
        self._freed = asyncio.Event()  # an attempt task ended: a slot may be free
        self._cleanups: set[asyncio.Task[None]] = set()  # batch deletions in flight
        self._resource_version = ""

    @property
    def pods(self) -> int:
        """Pods this controller tracks: in flight, or finished and waiting for their cleanup."""
        return len(self._pods)

    # -- run ----------------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        await self._adopt()
        helpers = [
            asyncio.create_task(self._watch(), name=f"{self.pool_name}-watch"),
            asyncio.create_task(self._reaper(), name=f"{self.pool_name}-reaper"),
        ]
        stopped = asyncio.create_task(stop.wait())
        idle = self.idle_min_seconds
        try:
            while not stop.is_set():
                self._freed.clear()
                self._prune()
                free = self.parallelism - len(self._active)
                if free <= 0:
                    # one event, not a wait on every task: that would cost O(parallelism) per attempt
                    freed = asyncio.create_task(self._freed.wait())
                    await asyncio.wait([freed, stopped], return_when=asyncio.FIRST_COMPLETED)
                    freed.cancel()
                    continue
                free = await self._linger(free, stopped)
                batch = await self._claim_batch(min(free, self.max_batch))
                if not batch:
                    await asyncio.wait([stopped], timeout=idle)
                    idle = min(idle * 2, self.idle_max_seconds)
                    continue
                idle = self.idle_min_seconds
                await self._start_batch(batch)
        finally:
            stopped.cancel()
            for abort in self._active.values():
                abort.trigger("stopped")
            while self._active:
                await asyncio.wait(list(self._active))
                self._prune()
            for task in helpers:
                task.cancel()
            for task in helpers:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            if self._cleanups:
                await asyncio.wait(list(self._cleanups), timeout=30)

    async def _linger(self, free: int, stopped: "asyncio.Task[bool]") -> int:
        """Free slots to claim for, after waiting up to `claim_linger_seconds` for more to free up
        while other attempts still run. Each claimed batch costs a request and 4 API writes (its
        Secret and ConfigMap), so claiming the moment one slot frees would pay that per attempt."""
        target = min(self.max_batch, self.parallelism)
        if free >= target or not self._active or self.claim_linger_seconds <= 0:
            return free
        deadline = time.monotonic() + self.claim_linger_seconds
        while free < target and not stopped.done():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._freed.clear()
            freed = asyncio.create_task(self._freed.wait())
            await asyncio.wait([freed, stopped], timeout=left, return_when=asyncio.FIRST_COMPLETED)
            freed.cancel()
            self._prune()
            free = self.parallelism - len(self._active)
        return free

    # -- adoption -----------------------------------------------------------------------------------

    async def _adopt(self) -> None:
        """Take over what a previous controller left: its pods (each resumes, or is reported if
        finished) and batch objects that no pod needs any more."""
        pods, self._resource_version = await self.kube.list_with_version(
            PODS, self.ctx.namespace, label_selector=self.selector
        )
        for pod in pods:
            if self._ours(pod):
                self._adopt_pod(pod)
        needed = set(self._batches)
        for resource, name_of in ((SECRETS, keys_name), (CONFIGMAPS, tasks_name)):
            if resource is CONFIGMAPS and not self.ctx.task_as_file:
                continue
            for obj in await self.kube.list(resource, self.ctx.namespace, label_selector=self.selector):
                name = obj["metadata"]["name"]
                if self._ours(obj) and name not in {name_of(self.pool_name, b) for b in needed}:
                    await self._delete(resource, name)

    def _ours(self, obj: Mapping[str, Any]) -> bool:
        """Whether the object carries this controller's labels: the API server filters by the
        selector already, kmock's stock emulator does not, and the check costs nothing."""
        labels = (obj.get("metadata") or {}).get("labels") or {}
        return (
            labels.get(LABEL_POOL) == self.pool_name
            and labels.get(LABEL_RUN) == self.ctx.run
            and labels.get(LABEL_COMPONENT) == "harness"
        )

    def _adopt_pod(self, pod: Obj) -> None:
        labels = pod["metadata"].get("labels") or {}
        attempt_id, rollout_id = labels.get(LABEL_ATTEMPT), labels.get(LABEL_ROLLOUT)
        if not attempt_id or not rollout_id or attempt_id in self._pods:
            return
        attempt = ClaimedAttempt(
            id=attempt_id,
            rollout_id=rollout_id,
            group_id="",
            seq=0,
            task=None,
            token="",
            lease_expires_at=0.0,
        )
        batch = batch_of(self.pool_name, pod)
        t = _Tracked(attempt, pod["metadata"]["name"], batch, adopted=True, pod=pod)
        self._pods[attempt_id] = t
        if batch is not None:
            self._batches.setdefault(batch, set()).add(attempt_id)
        self.adopted += 1
        abort = Abort()
        self._active[asyncio.create_task(self._attempt_task(t, abort, create=False))] = abort

    # -- claiming and starting ----------------------------------------------------------------------

    async def _claim_batch(self, n: int) -> list[ClaimedAttempt]:
        """Up to `n` attempts: one batch-claim request, or, from a gateway that predates it (404),
        waves of single claims from then on."""
        if self._batch_claims:
            try:
                async with self._gate:
                    return await self.gateway.claim_batch(self.pool_name, self.lease_seconds, n)
            except GatewayError as exc:
                if exc.status not in (404, 405):
                    self.log(f"pool {self.pool_name}: claim failed, retrying: {exc}")
                    return []
                self.log(f"pool {self.pool_name}: the gateway has no batch claims; claiming one at a time")
                self._batch_claims = False
            except httpx.HTTPError as exc:
                self.log(f"pool {self.pool_name}: claim failed, retrying: {exc!r}")
                return []
        out: list[ClaimedAttempt] = []
        while len(out) < n:
            wave = min(n - len(out), self.claim_concurrency)
            got = [a for a in await asyncio.gather(*(self._claim() for _ in range(wave))) if a is not None]
            out += got
            if len(got) < wave:
                break
        return out

    def _split(self, attempts: list[ClaimedAttempt]) -> list[list[ClaimedAttempt]]:
        """Batches whose tasks fit one ConfigMap (only a concern when tasks go in as files)."""
        if not self.ctx.task_as_file:
            return [attempts]
        out: list[list[ClaimedAttempt]] = [[]]
        size = 0
        for a in attempts:
            n = len(json.dumps(a.task)) + len(a.id)
            if out[-1] and size + n > TASKS_PER_CONFIGMAP_BYTES:
                out.append([])
                size = 0
            out[-1].append(a)
            size += n
        return out

    async def _start_batch(self, attempts: list[ClaimedAttempt]) -> None:
        for part in self._split(attempts):
            batch = part[0].id
            refused: str | None = None
            for obj in batch_objects(self.ctx, batch, part):
                try:
                    await self._create_retrying(SECRETS if obj["kind"] == "Secret" else CONFIGMAPS, obj)
                except AlreadyExists:
                    pass
                except (KubeError, aiohttp.ClientError, TimeoutError) as exc:
                    refused = f"BatchRejected: {obj['kind']} {obj['metadata']['name']}: {exc}"
            self._batches[batch] = {a.id for a in part}
            for a in part:
                t = _Tracked(a, pod_name(self.pool_name, a.id), batch)
                self._pods[a.id] = t
                abort = Abort()
                self._active[
                    asyncio.create_task(self._attempt_task(t, abort, create=True, refused=refused))
                ] = abort

    async def _create_retrying(self, resource: Any, obj: Obj) -> Obj:
        """Create, retrying what may pass on a second try (5xx, 429, connection errors)."""
        for tries in range(1, self.create_tries + 1):
            try:
                return await self.kube.create(resource, obj, self.ctx.namespace)
            except KubeError as exc:
                if (exc.status < 500 and exc.status != 429) or tries == self.create_tries:
                    raise
            except (aiohttp.ClientError, TimeoutError):
                if tries == self.create_tries:
                    raise
            await asyncio.sleep(0.2 * 2 ** (tries - 1))
        raise AssertionError("unreachable")

    # -- one attempt --------------------------------------------------------------------------------

    async def _attempt_task(
        self, t: _Tracked, abort: Abort, *, create: bool, refused: str | None = None
    ) -> None:
        self.started += 1
        t.create = create
        start = time.monotonic()
        try:
            if refused is not None:
                t.gone = True
                outcome = Outcome.failure(refused)
            else:
                beats = asyncio.create_task(self._heartbeats(t.attempt, abort))
                try:
                    outcome = await self.with_posted_reward(t.attempt, await self.execute(t.attempt, abort))
                finally:
                    beats.cancel()
            await self._settle(t, outcome, start, abort)
        except _Detached:
            pass  # stopped: the pod runs on, and the next controller adopts it
        finally:
            t.done = True
            self._forget_if_finished(t)
            self._freed.set()

    async def execute(self, attempt: ClaimedAttempt, abort: Abort) -> Outcome:
        """Create the attempt's pod (an adopted one exists already) and wait for its outcome. A stop
        raises `_Detached` and leaves the pod running: stopping the operator must not fail attempts."""
        t = self._pods[attempt.id]
        if t.create:
            rejected = await self._create_pod(t)
            if rejected is not None:
                return rejected
        elif not is_terminal(t.pod or {}) and not await self._renew(t, abort):
            return Outcome.failure(f"LeaseLost: {abort.reason}")
        outcome = await self._wait_outcome(t, abort)
        if outcome is None:
            raise _Detached
        return outcome

    async def _create_pod(self, t: _Tracked) -> Outcome | None:
        try:
            await self._create_retrying(PODS, harness_pod(self.ctx, t.attempt, t.batch or t.attempt.id))
        except AlreadyExists:
            self.log(f"attempt {t.attempt.id}: pod {t.name} exists already; adopting it")
        except (KubeError, aiohttp.ClientError, TimeoutError) as exc:
            t.gone = True
            return Outcome.failure(f"PodRejected: {exc}")
        return None

    async def _renew(self, t: _Tracked, abort: Abort) -> bool:
        """One heartbeat at once for an adopted running pod: its lease ran on while no controller did."""
        try:
            async with self._gate:
                await self.gateway.heartbeat(t.attempt.id, self.lease_seconds)
        except GatewayError as exc:
            if exc.status in (404, 409):
                abort.trigger(f"lease lost: {exc.message}")
                return False
        except httpx.HTTPError:
            pass
        return True

    async def _wait_outcome(self, t: _Tracked, abort: Abort) -> Outcome | None:
        aborted = asyncio.create_task(abort.wait())
        try:
            while True:
                t.changed.clear()
                outcome, recheck = classify(
                    t.pod or {},
                    gone=t.gone,
                    outcome_type=self.ctx.harness.outcome.type,
                    timeout_seconds=pod_deadline(self.ctx.harness),
                    graces=self.graces,
                    first_seen=t.first_seen,
                    now=time.monotonic(),
                )
                if outcome is not None:
                    return outcome
                if abort.is_set():
                    return (
                        None if abort.reason == "stopped" else Outcome.failure(f"LeaseLost: {abort.reason}")
                    )
                changed = asyncio.create_task(t.changed.wait())
                timeout = None if recheck is None else max(0.0, recheck - time.monotonic())
                await asyncio.wait({changed, aborted}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                changed.cancel()
        finally:
            aborted.cancel()

    async def _settle(self, t: _Tracked, outcome: Outcome, start: float, abort: Abort) -> None:
        """Report the outcome, then make sure a pod that still runs (or waits) goes, and is gone
        before its slot is given to another attempt."""
        outcome = Outcome(
            outcome.status, outcome.reward, {**outcome.info, "seconds": round(time.monotonic() - start, 3)}
        )
        if not t.gone and not is_terminal(t.pod or {}):
            await self._delete_pod(t)
        report = await self._complete(t.attempt, outcome)
        t.finished = time.monotonic()
        ended = finished_at(t.pod or {})
        if t.adopted and ended is not None:
            t.finished -= max(0.0, time.time() - ended)
        t.failed = outcome.status == "failed"
        if report == "accepted":
            if outcome.status == "succeeded":
                self.succeeded += 1
            else:
                self.failed += 1
                self.failed_by_reason[reason_key(outcome.reason or "failed")] += 1
            if self.on_finish is not None:
                self.on_finish(t.attempt, outcome)
        elif report == "duplicate":
            self.duplicates += 1
        else:
            self.unreported += 1
        if self.on_report is not None:
            self.on_report(t.attempt, outcome, report)
        if not t.gone and not t.deleting:
            self._to_reap(t)
        if t.deleting:
            await self._wait_gone(t, abort)

    async def _wait_gone(self, t: _Tracked, abort: Abort) -> None:
        """Until the deleted pod is gone (its slot is free only then), the controller stops, or the
        pod's grace period has long passed (a lost node's pods can stay Terminating for good)."""
        grace = float(((t.pod or {}).get("spec") or {}).get("terminationGracePeriodSeconds") or 30)
        deadline = time.monotonic() + grace + 30
        aborted = asyncio.create_task(abort.wait())
        try:
            while not t.gone and not abort.is_set() and time.monotonic() < deadline:
                t.changed.clear()
                changed = asyncio.create_task(t.changed.wait())
                await asyncio.wait(
                    {changed, aborted},
                    timeout=deadline - time.monotonic(),
                    return_when=asyncio.FIRST_COMPLETED,
                )
                changed.cancel()
        finally:
            aborted.cancel()

    async def _complete(self, attempt: ClaimedAttempt, outcome: Outcome) -> Report:
        """Complete at the gateway: accepted, a duplicate of an earlier report (a restart), or refused
        (its lease expired and the gateway requeued the rollout; or the gateway is unreachable and
        the lease will do that)."""
        for tries in range(1, self.report_tries + 1):
            try:
                async with self._gate:
                    _, duplicate = await self.gateway.complete(
                        attempt.id, outcome.status, outcome.reward, outcome.info
                    )
                return "duplicate" if duplicate else "accepted"
            except GatewayError as exc:
                if exc.status < 500:
                    self.log(f"attempt {attempt.id}: completion refused: {exc.message}")
                    return "refused"
                error: Exception = exc
            except httpx.HTTPError as exc:
                error = exc
            if tries < self.report_tries:
                await asyncio.sleep(0.5 * 2 ** (tries - 1))
        self.log(
            f"attempt {attempt.id}: completion failed {self.report_tries} times, "
            f"the lease will requeue it: {error!r}"
        )
        return "refused"

    # -- pods and batch objects ---------------------------------------------------------------------

    async def _delete(self, resource: Any, name: str) -> None:
        try:
            await self.kube.delete(resource, name, self.ctx.namespace)
        except NotFound:
            pass
        except (KubeError, aiohttp.ClientError, TimeoutError) as exc:
            self.log(f"pool {self.pool_name}: cannot delete {name}: {exc}")

    async def _delete_pod(self, t: _Tracked) -> None:
        if t.deleting or t.gone:
            return
        t.deleting = True
        try:
            await self.kube.delete(PODS, t.name, self.ctx.namespace)
        except NotFound:
            self._on_gone(t)
        except (KubeError, aiohttp.ClientError, TimeoutError) as exc:
            t.deleting = False
            self.log(f"pool {self.pool_name}: cannot delete pod {t.name}: {exc}")

    def _on_gone(self, t: _Tracked) -> None:
        t.gone = True
        t.changed.set()
        self._forget_if_finished(t)

    def _forget_if_finished(self, t: _Tracked) -> None:
        """Drop an attempt once its task ended and its pod is gone (or was left to the next controller);
        the batch's Secret and ConfigMap go with its last pod."""
        if not t.done or (not t.gone and t.finished is not None):
            return
        if self._pods.get(t.attempt.id) is t:
            del self._pods[t.attempt.id]
        if t.gone and t.batch is not None and t.batch in self._batches:
            members = self._batches[t.batch]
            members.discard(t.attempt.id)
            if not members:
                del self._batches[t.batch]
                task = asyncio.get_running_loop().create_task(self._delete_batch(t.batch))
                self._cleanups.add(task)
                task.add_done_callback(self._cleanups.discard)

    async def _delete_batch(self, batch: str) -> None:
        await self._delete(SECRETS, keys_name(self.pool_name, batch))
        if self.ctx.task_as_file:
            await self._delete(CONFIGMAPS, tasks_name(self.pool_name, batch))

    def _to_reap(self, t: _Tracked) -> None:
        """Queue a finished pod for deletion after the TTL; the newest `keepFailed` failed pods wait
        in `_kept` until newer failures push them out."""
        assert t.finished is not None
        item = (t.finished, next(self._seq), t)
        keep = self.ctx.settings.keep_failed
        if t.failed and keep > 0:
            heapq.heappush(self._kept, item)
            if len(self._kept) <= keep:
                return
            item = heapq.heappop(self._kept)
        heapq.heappush(self._expiry, item)
        self._reap.set()

    async def _reaper(self) -> None:
        """Delete finished pods once their TTL has passed (O(log n) per pod, deletions concurrent)."""
        ttl = self.ctx.settings.ttl_seconds_after_finished
        while True:
            self._reap.clear()
            now = time.monotonic()
            due: list[_Tracked] = []
            while self._expiry and self._expiry[0][0] + ttl <= now:
                due.append(heapq.heappop(self._expiry)[2])
            await asyncio.gather(*(self._delete_pod(t) for t in due if not t.gone))
            wait = None if not self._expiry else max(0.0, self._expiry[0][0] + ttl - time.monotonic())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._reap.wait(), wait)

    # -- the watch ----------------------------------------------------------------------------------

    async def _watch(self) -> None:
        backoff, expired = 0.5, 0
        while True:
            try:
                async for kind, pod in self.kube.watch(
                    PODS,
                    self.ctx.namespace,
                    label_selector=self.selector,
                    resource_version=self._resource_version or None,
                    timeout_seconds=self.watch_timeout_seconds,
                ):
                    backoff, expired = 0.5, 0
                    version = (pod.get("metadata") or {}).get("resourceVersion")
                    if version:
                        self._resource_version = str(version)
                    if kind != "BOOKMARK":
                        self._on_pod(kind, pod)
                continue  # the server ended the watch (its timeout): resume from the last version
            except KubeError as exc:
                if exc.status == 410:  # too old a resourceVersion: start over from a fresh list
                    expired += 1
                    await self._relist()
                    if expired == 1:
                        continue
                self.log(f"pool {self.pool_name}: pod watch failed, retrying: {exc}")
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                self.log(f"pool {self.pool_name}: pod watch broke, retrying: {exc!r}")
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 10.0)

    async def _relist(self) -> None:
        try:
            pods, self._resource_version = await self.kube.list_with_version(
                PODS, self.ctx.namespace, label_selector=self.selector
            )
        except (KubeError, aiohttp.ClientError, TimeoutError) as exc:
            self.log(f"pool {self.pool_name}: pod list failed: {exc}")
            self._resource_version = ""
            return
        live = {p["metadata"]["name"] for p in pods if self._ours(p)}
        for t in list(self._pods.values()):
            if not t.gone and t.pod is not None and t.name not in live:
                self._on_gone(t)
        for pod in pods:
            self._on_pod("MODIFIED", pod)

    def _on_pod(self, kind: str, pod: Obj) -> None:
        if not self._ours(pod):
            return
        attempt_id = ((pod.get("metadata") or {}).get("labels") or {}).get(LABEL_ATTEMPT)
        t = self._pods.get(attempt_id or "")
        if t is None:
            if kind != "DELETED":
                self.log(f"pool {self.pool_name}: adopting pod {pod['metadata']['name']} made elsewhere")
                self._adopt_pod(pod)
            return
        t.pod = pod
        if kind == "DELETED":
            self._on_gone(t)
            return
        t.changed.set()


def pool_backend_problem(harness: HarnessSpecSpec) -> tuple[str, str] | None:
    """Why a HarnessSpec cannot run on the kubernetes backend, as (reason, message); None: it can."""
    if harness.image is None:
        return "HarnessImageMissing", "the HarnessSpec has no image; pods need one"
    return None
