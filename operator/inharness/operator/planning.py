"""The pure parts of reconciling a TrainingRun: reading live objects as spec models, telling
drift from API-server defaults, and computing the status from what one reconcile observed.

No API calls here, so every rule is unit-tested on its own (tests/operator/test_planning.py).
"""

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from inharness.gateway.schema import ProgressOut
from inharness.operator import conditions as cond
from inharness.operator.spec import HarnessSpec, RolloutPool, TrainingRun

HISTORY = 100

# Set once at creation and refused by the API server on update, so never patched.
IMMUTABLE: dict[str, tuple[tuple[str, ...], ...]] = {
    "StatefulSet": (
        ("spec", "volumeClaimTemplates"),
        ("spec", "selector"),
        ("spec", "serviceName"),
        ("spec", "podManagementPolicy"),
    ),
    "Deployment": (("spec", "selector"),),
    "Service": (("spec", "clusterIP"),),
    "PersistentVolumeClaim": (("spec",),),
}


# --- pure parts --------------------------------------------------------------------------------------


def spec_model(
    model: type[TrainingRun] | type[RolloutPool] | type[HarnessSpec], body: Mapping[str, Any]
) -> Any:
    """A live object as its spec model: the API server's own metadata (uid, managedFields, ...) and
    the status are not part of what a user writes."""
    meta = body.get("metadata") or {}
    return model.model_validate(
        {
            "apiVersion": body.get("apiVersion"),
            "kind": body.get("kind"),
            "metadata": {
                "name": meta.get("name"),
                "namespace": meta.get("namespace"),
                "labels": dict(meta.get("labels") or {}),
                "annotations": dict(meta.get("annotations") or {}),
            },
            "spec": body.get("spec"),
        }
    )


def is_subset(want: Any, have: Any) -> bool:
    """Whether the live value already holds everything rendered (the API server adds defaults;
    lists must match item by item, since a merge patch replaces them whole)."""
    if isinstance(want, Mapping):
        return isinstance(have, Mapping) and all(k in have and is_subset(v, have[k]) for k, v in want.items())
    if isinstance(want, list):
        return isinstance(have, list) and len(want) == len(have) and all(map(is_subset, want, have))
    return want == have


def without(obj: Mapping[str, Any], paths: tuple[tuple[str, ...], ...]) -> dict[str, Any]:
    out = _copy(obj)
    for path in paths:
        node = out
        for key in path[:-1]:
            node = node.get(key, {})
        if isinstance(node, dict):
            node.pop(path[-1], None)
    return out


def _copy(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


@dataclass(frozen=True)
class Observed:
    """Everything the status is computed from, gathered by one reconcile."""

    generation: int
    total_steps: int
    suspended: bool
    config_sha256: str | None = None
    problem: tuple[str, str] | None = None  # (reason, message): the run cannot be (fully) applied
    invalid: str | None = None  # the spec itself is unusable
    gateway: Mapping[str, Any] | None = None  # live Deployment
    trainer: Mapping[str, Any] | None = None  # live StatefulSet
    progress: ProgressOut | None = None
    progress_error: str | None = None
    ray_nodes_wanted: int | None = None  # engine verl: spec.trainer.nodes; None: no Ray cluster


def gateway_available(deployment: Mapping[str, Any] | None) -> bool:
    if not deployment:
        return False
    status = deployment.get("status") or {}
    generation = (deployment.get("metadata") or {}).get("generation")
    current = generation is None or (status.get("observedGeneration") or 0) >= generation
    return current and (status.get("availableReplicas") or 0) >= 1


def _stuck(deployment: Mapping[str, Any] | None) -> str | None:
    """The Deployment controller's verdict that a rollout stopped progressing, if it said so."""
    for c in (deployment or {}).get("status", {}).get("conditions") or []:
        if c.get("type") == "Progressing" and c.get("status") == "False":
            return c.get("message") or c.get("reason") or "rollout stopped progressing"
    return None


def _trainer_ready(statefulset: Mapping[str, Any] | None) -> bool:
    return bool(statefulset) and ((statefulset or {}).get("status") or {}).get("readyReplicas", 0) >= 1


def progress_fields(current: Mapping[str, Any], progress: ProgressOut | None) -> dict[str, Any]:
    """Progress as status fields. What the gateway reports wins; when it reports nothing (it is
    unreachable, or restarted and the trainer has not reported since) the last values stay."""
    keys = ("step", "modelVersion", "rewardMean", "rolloutsDone", "rolloutsFailed", "rewardHistory")
    out = {k: current.get(k) for k in keys}
    out["step"] = out["step"] or 0
    out["rewardHistory"] = list(out["rewardHistory"] or [])
    if progress is None:
        return out
    if progress.model_version is not None:
        out["modelVersion"] = progress.model_version
    out["rolloutsDone"] = progress.rollouts.get("succeeded", 0)
    out["rolloutsFailed"] = progress.rollouts.get("failed", 0)
    if progress.reported:
        out["step"] = progress.step
        reward = progress.reward_mean
        out["rewardMean"] = reward if reward is not None and math.isfinite(reward) else out["rewardMean"]
        out["rewardHistory"] = [r for r in progress.reward_history if math.isfinite(r)][-HISTORY:]
    return out


def ray_fields(current: Mapping[str, Any], observed: Observed) -> dict[str, Any]:
    """The Ray cluster's size as status fields (engine verl only): how many nodes joined as the trainer
    last reported (kept while the gateway has nothing newer), and how many the spec wants."""
    if observed.ray_nodes_wanted is None:
        return {"rayNodes": None, "rayNodesWanted": None}
    p = observed.progress
    joined = p.ray_nodes if p is not None and p.ray_nodes is not None else current.get("rayNodes")
    return {"rayNodes": joined, "rayNodesWanted": observed.ray_nodes_wanted}


def _ray_cluster_ready(o: Observed, phase: str, joined: int | None) -> list[dict[str, Any]]:
    """RayClusterReady, for engine verl only: False (Waiting) until the trainer reports all its nodes."""
    wanted = o.ray_nodes_wanted
    if wanted is None:
        return []
    if phase in ("Suspended", "Complete", "Failed"):
        return [cond.condition("RayClusterReady", False, phase, "the trainer is scaled to zero")]
    if joined is None:
        message = f"the trainer has not reported its Ray cluster yet ({wanted} nodes wanted)"
        return [cond.condition("RayClusterReady", False, "Waiting", message)]
    if joined < wanted:
        return [cond.condition("RayClusterReady", False, "Waiting", f"{joined} of {wanted} nodes joined")]
    return [cond.condition("RayClusterReady", True, "NodesJoined", f"{joined} of {wanted} nodes joined")]


def trainer_failure(current: Mapping[str, Any], observed: Observed) -> str | None:
    """Why the trainer failed, for the config it runs now: a failure reported for an older config
    (the spec changed since) is not this run's; a Failed status of this generation stays."""
    p = observed.progress
    current_config = p is not None and p.config_sha256 in (None, observed.config_sha256)
    if p is not None and p.reported and p.state == "failed" and current_config:
        return p.message or "the trainer reported a failure"
    failed = cond.find(current.get("conditions"), "Failed")
    if (
        current.get("phase") == "Failed"
        and current.get("observedGeneration") == observed.generation
        and failed is not None
        and failed.get("status") == "True"
        and failed.get("reason") == "TrainerFailed"
    ):
        return str(failed.get("message") or "the trainer reported a failure")
    return None


def is_finished(current: Mapping[str, Any], observed: Observed) -> bool:
    """Complete or Failed: then the trainer is scaled to zero (its GPUs go back)."""
    step = progress_fields(current, observed.progress)["step"]
    return step >= observed.total_steps or trainer_failure(current, observed) is not None


def _failed(o: Observed, failure: str | None) -> dict[str, Any]:
    if o.invalid is not None:
        return cond.condition("Failed", True, "InvalidSpec", o.invalid)
    if failure is not None:
        return cond.condition("Failed", True, "TrainerFailed", failure)
    return cond.condition("Failed", False, "NoFailure")


def _degraded(o: Observed) -> dict[str, Any]:
    stuck = _stuck(o.gateway)
    if o.problem is not None:
        return cond.condition("Degraded", True, *o.problem)
    if stuck is not None and not o.suspended:
        return cond.condition("Degraded", True, "GatewayRolloutStuck", stuck)
    return cond.condition("Degraded", False, "AsExpected")


def _ready(o: Observed, phase: str, gateway_ok: bool, trainer_ok: bool) -> dict[str, Any]:
    if o.invalid is not None:
        return cond.condition("Ready", False, "InvalidSpec", "no children are created for an invalid spec")
    if o.suspended:
        return cond.condition("Ready", False, "Suspended", "spec.suspend is true: scaled to zero")
    if o.problem is not None:
        return cond.condition("Ready", False, o.problem[0], o.problem[1])
    if not gateway_ok:
        return cond.condition(
            "Ready", False, "GatewayNotReady", "the gateway Deployment has no available pod"
        )
    if not trainer_ok and phase not in ("Complete", "Failed"):
        return cond.condition("Ready", False, "TrainerNotReady", "the trainer StatefulSet has no ready pod")
    return cond.condition("Ready", True, "Available", "gateway and trainer are up")


def _progressing(o: Observed, phase: str, gateway_ok: bool, at: str) -> dict[str, Any]:
    if phase in ("Failed", "Complete", "Suspended"):
        return cond.condition("Progressing", False, phase, at)
    if o.problem is not None:
        return cond.condition("Progressing", False, o.problem[0], o.problem[1])
    if gateway_ok and o.progress_error is not None:
        return cond.condition(
            "Progressing", True, "GatewayUnreachable", f"progress not readable: {o.progress_error}"
        )
    if o.progress is not None and o.progress.reported:
        return cond.condition("Progressing", True, "Training", at)
    return cond.condition("Progressing", True, "Starting", "waiting for the gateway and trainer")


def compute_status(current: Mapping[str, Any], observed: Observed, now: str) -> dict[str, Any]:
    """The whole status of a run from what one reconcile saw; `current` is the status before it.
    The phase is decided first; each condition then has its own function, in KubeRay's manner."""
    o = observed
    fields = {**progress_fields(current, o.progress), **ray_fields(current, o)}
    step, total = fields["step"], o.total_steps
    failure = o.invalid or trainer_failure(current, o)
    complete = failure is None and step >= total
    gateway_ok, trainer_ok = gateway_available(o.gateway), _trainer_ready(o.trainer)

    if failure is not None:
        phase = "Failed"
    elif complete:
        phase = "Complete"
    elif o.suspended:
        phase = "Suspended"
    elif o.problem is None and gateway_ok and trainer_ok:
        phase = "Running"
    else:
        phase = "Pending"

    at = f"step {step}/{total}"
    wanted = [
        _ready(o, phase, gateway_ok, trainer_ok),
        _progressing(o, phase, gateway_ok, at),
        _degraded(o),
        cond.condition("Suspended", o.suspended, "SuspendRequested" if o.suspended else "NotSuspended"),
        cond.condition("Complete", complete, "StepsDone" if complete else "StepsRemaining", at),
        _failed(o, failure),
        *_ray_cluster_ready(o, phase, fields["rayNodes"]),
    ]
    start = current.get("startTime") or (now if phase == "Running" or step > 0 else None)
    finished_at = (current.get("completionTime") or now) if phase in ("Complete", "Failed") else None
    return {
        "observedGeneration": o.generation,
        "phase": phase,
        **fields,
        "conditions": cond.merge(current.get("conditions"), wanted, generation=o.generation, now=now),
        "startTime": start,
        "completionTime": finished_at,
    }


def status_changed(current: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
    return any(current.get(k) != v for k, v in new.items())
