"""The objects of a RolloutPool's harness runs on Kubernetes, as plain dicts: pure functions, no API
calls. The rollout controller (rollouts/kubernetes.py) creates exactly what these return.

Per attempt: Pod `<pool>-<attempt id>` (a deterministic name, so an attempt never gets a second
pod: AlreadyExists means adopt it), restartPolicy Never, activeDeadlineSeconds = the harness's
timeout, the restricted security context of every inharness pod, labels naming run, pool, rollout
and attempt, owned by the RolloutPool. With `spec.kubernetes.workload: Job` the same pod is the
template of a Job of that name (`harness_job`). Per claimed batch: one Secret with each attempt's
key (data key = attempt id), which the pod reads through `secretKeyRef`, so no key is ever in a pod
spec; and, when the harness takes its task as a file, one ConfigMap with each attempt's task
(key = attempt id) that the pod mounts by item (`batch_objects`).

With `outcome.type: grader` the harness runs as the pod's init container and the grader as its
container (same image, a shared emptyDir for the harness's result file, the grader's result JSON
as its termination message), so neither command is wrapped; `harness_pod` says what the grader sees.

Resources: each container gets the HarnessSpec's `resources` over the defaults (`HARNESS_RESOURCES`),
then the pool's `kubernetes.pod.resources` over those, so that every harness pod has requests (which
the scheduler, quotas and Kueue place it by) and limits. A harness pod's root filesystem stays
writable: an unmodified agent in the user's image may write anywhere its image lets it.
"""

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from inharness.gateway.schema import ClaimedAttempt
from inharness.operator.api import API_VERSION
from inharness.operator.render.pods import (
    apply_container_overrides,
    container_security,
    merge_resources,
    overrides_of,
    pod_spec,
    resolve_path,
)
from inharness.operator.render.run import labels as run_labels
from inharness.operator.spec import HARNESS_RESOURCES, HarnessSpecSpec, KubernetesPool

Obj = dict[str, Any]

KEY_PLACEHOLDER = "inharness-key-is-in-the-url"
"""API key handed to a harness with keyIn=path: many clients refuse to start without one."""

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
MAX_LABEL_VALUE = 63  # a Job's name is its pods' `job-name` label value, so it must fit one


# --- names -------------------------------------------------------------------------------------------


def pod_name(pool: str, attempt_id: str) -> str:
    return f"{pool}-{attempt_id}"


def job_name(pool: str, attempt_id: str) -> str:
    """The Job of an attempt: `<pool>-<attempt id>` like its pod, with the pool's part cut so that the
    name fits a label value (the job controller labels its pods with it)."""
    room = MAX_LABEL_VALUE - len(attempt_id) - 1
    return f"{pool[:room].rstrip('-')}-{attempt_id}"


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
    lease_seconds: int = 0  # the attempts' lease: how long a finished Job may wait for a controller

    def labels(self) -> dict[str, str]:
        out = {**run_labels(self.run, "harness"), LABEL_POOL: self.pool}
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


# --- batch objects -----------------------------------------------------------------------------------


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


def batch_of(pool: str, pod: Mapping[str, Any]) -> str | None:
    """The batch a live pod (or a Job's pod template) belongs to: the Secret its key comes from names it."""
    prefix = f"{pool}-"
    spec = pod.get("spec") or {}
    if "template" in spec:
        spec = (spec.get("template") or {}).get("spec") or {}
    for c in [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]:
        for e in c.get("env") or []:
            name = str(((e.get("valueFrom") or {}).get("secretKeyRef") or {}).get("name") or "")
            if e.get("name") == KEY_ENV and name.startswith(prefix) and name.endswith("-keys"):
                return name.removeprefix(prefix).removesuffix("-keys")
    return None


# --- the harness pod ---------------------------------------------------------------------------------


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


def _harness_env(ctx: PodContext, attempt: ClaimedAttempt, batch: str) -> list[Obj]:
    """The model endpoint, key, task and result path in the variables the HarnessSpec names; the
    key only by reference to the batch's Secret."""
    h, m = ctx.harness, ctx.harness.model
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
        graded = h.outcome.type == "grader"
        ours[h.outcome.result_file_env] = {"value": HARNESS_RESULT if graded else TERMINATION_LOG}
    ours["INHARNESS_ATTEMPT_ID"] = {"value": attempt.id}
    ours["INHARNESS_ROLLOUT_ID"] = {"value": attempt.rollout_id}
    # The key comes first: $(INHARNESS_ATTEMPT_KEY) only expands in variables defined after it.
    env: list[Obj] = [{"name": KEY_ENV, "valueFrom": key_ref}]
    env += [{"name": e.name, "value": e.value} for e in h.env if e.name not in ours and e.name != KEY_ENV]
    env += [{"name": name, **value} for name, value in ours.items() if name != KEY_ENV]
    return env


def _task_volume(ctx: PodContext, attempt: ClaimedAttempt, batch: str) -> tuple[list[Obj], list[Obj]]:
    """(volumes, mounts) of the task file: the batch's ConfigMap, mounted by the attempt's item."""
    if not ctx.task_as_file:
        return [], []
    volume = {
        "name": "task",
        "configMap": {"name": tasks_name(ctx.pool, batch), "items": [{"key": attempt.id, "path": TASK_FILE}]},
    }
    return [volume], [{"name": "task", "mountPath": TASK_DIR, "readOnly": True}]


def harness_pod_spec(ctx: PodContext, attempt: ClaimedAttempt, batch: str) -> Obj:
    """The pod spec of one attempt: the user's image, command and args unchanged, with the env of
    `_harness_env`.

    With `outcome.type: grader` the harness is the pod's init container and the grader its one
    container, in the same image: the kubelet starts the grader only once the harness exited 0, no
    wrapper around the user's command is needed, and the grader's result is the pod's termination
    message. The harness's result file is in an emptyDir that the grader mounts read-only."""
    h = ctx.harness
    graded = h.outcome.type == "grader"
    container: Obj = {
        "name": CONTAINER,
        "image": h.image,
        "command": list(h.command),
        "args": list(h.args),
        "env": _harness_env(ctx, attempt, batch),
        "terminationMessagePath": TERMINATION_LOG,
        "terminationMessagePolicy": "File",
        "resources": _resources(h),
    }
    if h.working_dir is not None:
        container["workingDir"] = resolve_path(h.working_dir)
    volumes, mounts = _task_volume(ctx, attempt, batch)
    if graded:
        volumes.append({"name": HANDOFF_VOLUME, "emptyDir": {}})
        container["volumeMounts"] = [*mounts, {"name": HANDOFF_VOLUME, "mountPath": HANDOFF_DIR}]
    elif mounts:
        container["volumeMounts"] = mounts
    overrides = overrides_of(ctx.settings.pod)
    spec = pod_spec(
        container, volumes, overrides, restartPolicy="Never", activeDeadlineSeconds=pod_deadline(h)
    )
    if graded:
        grader = _grader_container(ctx, attempt, mounts)
        apply_container_overrides(grader, overrides)  # the pod-level ones are set already
        grader["securityContext"] = container_security()
        spec["initContainers"], spec["containers"] = spec["containers"], [grader]
    return spec


def _resources(harness: HarnessSpecSpec) -> Obj:
    """A harness container's resources before the pool's overrides: the HarnessSpec's over the defaults."""
    own = harness.resources.model_dump(mode="json") if harness.resources is not None else None
    return merge_resources(HARNESS_RESOURCES, own)


def _attempt_labels(attempt: ClaimedAttempt) -> dict[str, str]:
    return {LABEL_ROLLOUT: attempt.rollout_id, LABEL_ATTEMPT: attempt.id}


def harness_pod(ctx: PodContext, attempt: ClaimedAttempt, batch: str) -> Obj:
    """The bare Pod of one attempt (`spec.kubernetes.workload: Pod`, the default)."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": ctx.meta(pod_name(ctx.pool, attempt.id), _attempt_labels(attempt)),
        "spec": harness_pod_spec(ctx, attempt, batch),
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
        "resources": _resources(h),
    }
    if h.working_dir is not None:
        container["workingDir"] = resolve_path(h.working_dir)
    return container


# --- the Job workload --------------------------------------------------------------------------------

JOB_DEADLINE_SLACK_SECONDS = 30


def job_deadline(ctx: PodContext) -> int:
    """activeDeadlineSeconds of an attempt's Job, a backstop for when no controller runs: a Job's
    deadline counts from its start (after admission), scheduling and image pulls included, so it is
    the pod's deadline plus both graces of the controller and a slack, and the pod's own deadline and
    the controller's graces always come first (their failure reasons are the more precise)."""
    s = ctx.settings
    return (
        pod_deadline(ctx.harness)
        + s.unschedulable_grace_seconds
        + s.image_pull_grace_seconds
        + JOB_DEADLINE_SLACK_SECONDS
    )


POD_FAILURE_POLICY: Obj = {
    "rules": [
        # Named failures in the Job's Failed condition: a disruption (eviction, preemption) and any
        # non-zero exit end the Job at once, whatever backoffLimit says.
        {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
        {"action": "FailJob", "onExitCodes": {"operator": "NotIn", "values": [0]}},
    ]
}


def harness_job(ctx: PodContext, attempt: ClaimedAttempt, batch: str) -> Obj:
    """The Job of one attempt (`spec.kubernetes.workload: Job`): the pod of `harness_pod` as its
    template, run once (backoffLimit 0: the gateway retries, as a new attempt), a backstop deadline
    (`job_deadline`) and TTL (the pool's TTL plus the lease: by then no controller can report it any
    more), `podFailurePolicy` so the Job's condition names a failure, and the Kueue queue label on the
    Job, which is then created suspended: Kueue starts it when it admits it. The pod template carries
    the attempt's labels (the controller watches pods by them), not the queue label (the pod is the
    Job's, not one for Kueue's pod integration)."""
    labels = _attempt_labels(attempt)
    meta = ctx.meta(job_name(ctx.pool, attempt.id), labels)
    template_labels = {k: v for k, v in meta["labels"].items() if k != KUEUE_QUEUE_LABEL}
    spec: Obj = {
        "backoffLimit": 0,
        "activeDeadlineSeconds": job_deadline(ctx),
        "ttlSecondsAfterFinished": ctx.settings.ttl_seconds_after_finished + ctx.lease_seconds,
        "podFailurePolicy": POD_FAILURE_POLICY,
        "template": {"metadata": {"labels": template_labels}, "spec": harness_pod_spec(ctx, attempt, batch)},
    }
    if ctx.settings.queue_name is not None:
        spec["suspend"] = True
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta, "spec": spec}


def harness_workload(ctx: PodContext, attempt: ClaimedAttempt, batch: str) -> Obj:
    """The object the controller creates for an attempt: its Pod, or its Job."""
    if ctx.settings.workload == "Job":
        return harness_job(ctx, attempt, batch)
    return harness_pod(ctx, attempt, batch)


def workload_name(ctx: PodContext, attempt_id: str) -> str:
    return (
        job_name(ctx.pool, attempt_id) if ctx.settings.workload == "Job" else pod_name(ctx.pool, attempt_id)
    )
