"""How an attempt ended (`Outcome`), the result JSON rules every backend shares, and the
classification of a harness pod (or Job) as a table of rules.

Three ways an attempt ends: `succeeded`, `failed` (the harness's fault: it counts against the
rollout's `maxAttemptsPerRollout`) and `released` (not the harness's fault: the controller was
stopped, or the machine's engine or gateway was down; the rollout is requeued uncharged).

A pod's outcome is read from its state by `POD_RULES`, walked in order: the first rule whose `when`
holds decides. Each failure reason starts with a CamelCase key (`OOMKilled: ...`) that the pool's
status aggregates. Rules with a `grace` (waiting problems that may heal: image pulls, scheduling)
fail the attempt only once the problem has lasted that long since it was first seen.
"""

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from inharness.operator.render.harness import CONTAINER, GRADER, TERMINATION_LOG

REWARD_MISSING = "_reward_missing"
"""Info key of an `Outcome.missing_reward`; never reported, `with_posted_reward` removes it."""

MESSAGE_TAIL = 1024
IMAGE_ERRORS = {"ErrImagePull", "ImagePullBackOff", "ErrImageNeverPull", "RegistryUnavailable"}
CREATE_ERRORS = {"CreateContainerConfigError", "CreateContainerError", "RunContainerError"}
DISRUPTIONS = {"EvictionByEvictionAPI", "PreemptionByScheduler", "DeletionByTaintManager"}


@dataclass(frozen=True)
class Outcome:
    """How one attempt ended, as reported to the gateway; a failure's `info["reason"]` says why in
    words a user can act on."""

    status: Literal["succeeded", "failed", "released"]
    reward: float | None = None
    info: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def success(cls, reward: float, **info: Any) -> "Outcome":
        return cls("succeeded", reward, info)

    @classmethod
    def failure(cls, reason: str, **info: Any) -> "Outcome":
        return cls("failed", None, {"reason": reason, **info})

    @classmethod
    def missing_reward(cls, reason: str, **info: Any) -> "Outcome":
        """A harness that ended normally without a reward in its result: a failure with `reason`,
        unless the harness posted a reward to the gateway (`ClaimingController.with_posted_reward`)."""
        return cls("failed", None, {"reason": reason, **info, REWARD_MISSING: True})

    @classmethod
    def released(cls, reason: str, **info: Any) -> "Outcome":
        """Not the harness's fault (a stop, an outage of the infrastructure): requeued uncharged."""
        return cls("released", None, {"reason": reason, **info})

    @property
    def reason(self) -> str | None:
        return self.info.get("reason")


def without_reason(info: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in info.items() if k != "reason"}


def reason_key(reason: str) -> str:
    """Counter key of a failure reason: its part before any ':' detail, so that keys stay few."""
    return reason.split(":", 1)[0].strip()


# What a user can do about a failure, by how its reason starts; shown when a run stops early.
FIXES = {
    "could not start": "check the HarnessSpec's command (on PATH, or relative to workingDir) and workingDir",
    "exited with code": "the harness failed before calling the model: read its stderr.log",
    "killed by signal": "the harness was killed before calling the model: read its stderr.log",
    "timed out after": "the harness made no model call within timeoutSeconds: does it read the model "
    "endpoint from the environment variables the HarnessSpec's model section names?",
    "result file missing": 'the harness must write {"reward": ...} to the file its outcome\'s '
    "resultFileEnv names, or post its reward to the gateway",
}


def fix_for(reason: str) -> str | None:
    """What a user can do about a failure with this reason, where it is known."""
    return next((fix for start, fix in FIXES.items() if reason.startswith(start)), None)


# --- result JSON -------------------------------------------------------------------------------------


class NoReward(ValueError):
    """Result JSON that is an object without a 'reward' key; `rest`: its other keys."""

    def __init__(self, message: str, rest: dict[str, Any]) -> None:
        super().__init__(message)
        self.rest = rest


def parse_result(raw: bytes, who: str = "") -> tuple[float, dict[str, Any]]:
    """(reward, the other keys) of result JSON like {"reward": 1.0}, or ValueError saying what is wrong
    with it. The one set of rules for every backend: a pod's result comes from its termination message."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{who}result file is not valid JSON: {exc}") from None
    if isinstance(data, dict) and "reward" not in data:
        raise NoReward(f"{who}result has no numeric 'reward'", data)
    reward = data.get("reward") if isinstance(data, dict) else None
    if isinstance(reward, bool) or not isinstance(reward, int | float):
        raise ValueError(f"{who}result has no numeric 'reward'")
    if not math.isfinite(reward):
        raise ValueError(f"{who}result 'reward' is not finite: {reward}")
    return float(reward), {k: v for k, v in data.items() if k != "reward"}


# --- reading a pod -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Graces:
    image_pull_seconds: float
    unschedulable_seconds: float


def container_status(pod: Mapping[str, Any], name: str = CONTAINER) -> Mapping[str, Any]:
    """The status of container `name`, a regular or an init container (the harness of a graded pod)."""
    status = pod.get("status") or {}
    for cs in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]:
        if cs.get("name") == name:
            return cs
    return {}


def condition(obj: Mapping[str, Any], type_: str) -> Mapping[str, Any]:
    """The status condition of this type of a pod or Job ({} if none)."""
    for c in (obj.get("status") or {}).get("conditions") or []:
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


def tail(text: Any, size: int = MESSAGE_TAIL) -> str:
    return str(text or "")[-size:]


def is_terminal(pod: Mapping[str, Any]) -> bool:
    return (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")


def job_failure(job: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """The condition that fails a Job (Failed, or FailureTarget while its pods are being ended)."""
    for type_ in ("Failed", "FailureTarget"):
        c = condition(job or {}, type_)
        if c.get("status") == "True":
            return c
    return None


def finished_at(pod: Mapping[str, Any]) -> float | None:
    """Wall time the pod's last container (the harness, or its grader) ended, when the pod says."""
    ends = [
        _time(((container_status(pod, name).get("state") or {}).get("terminated") or {}).get("finishedAt"))
        for name in (CONTAINER, GRADER)
    ]
    return max((e for e in ends if e is not None), default=None)


@dataclass(frozen=True)
class PodFacts:
    """What the rules read of a pod (and of its Job, for the Job workload), extracted once. A graded
    pod is read step by step: the harness (its init container) until it exited 0, then the grader."""

    phase: str | None
    pod_reason: str | None
    pod_message: str
    outcome_type: Literal["resultFile", "exitCode", "grader"]
    timeout_seconds: int  # the pod's activeDeadlineSeconds
    step: str  # CONTAINER or GRADER: whose state `term` and `waiting` are
    term: Mapping[str, Any] | None
    waiting: Mapping[str, Any]
    deleted: bool
    disruption: Mapping[str, Any]
    scheduled: Mapping[str, Any]
    job_failed: Mapping[str, Any] | None
    info: dict[str, Any]

    @property
    def graded(self) -> bool:
        return self.outcome_type == "grader"

    @property
    def who(self) -> str:
        return f"the {self.step} " if self.graded else ""

    @property
    def code(self) -> Any:
        return (self.term or {}).get("exitCode")

    @property
    def message(self) -> str:
        return str((self.term or {}).get("message") or "")

    @classmethod
    def of(
        cls,
        pod: Mapping[str, Any],
        *,
        gone: bool,
        outcome_type: Literal["resultFile", "exitCode", "grader"],
        timeout_seconds: int,
        job: Mapping[str, Any] | None = None,
    ) -> "PodFacts":
        meta, status = pod.get("metadata") or {}, pod.get("status") or {}
        harness_term = (container_status(pod).get("state") or {}).get("terminated")
        grading = (
            outcome_type == "grader"
            and harness_term is not None
            and harness_term.get("exitCode") == 0
            and harness_term.get("reason") != "OOMKilled"
        )
        step = GRADER if grading else CONTAINER
        state = container_status(pod, step).get("state") or {}
        term = state.get("terminated")
        return cls(
            phase=status.get("phase"),
            pod_reason=status.get("reason"),
            pod_message=str(status.get("message") or ""),
            outcome_type=outcome_type,
            timeout_seconds=timeout_seconds,
            step=step,
            term=term,
            waiting=state.get("waiting") or {},
            deleted=gone or bool(meta.get("deletionTimestamp")),
            disruption=condition(pod, "DisruptionTarget"),
            scheduled=condition(pod, "PodScheduled"),
            job_failed=job_failure(job),
            info=_info(pod, harness_term, term if grading else None, term),
        )


def _info(
    pod: Mapping[str, Any],
    harness_term: Mapping[str, Any] | None,
    grader_term: Mapping[str, Any] | None,
    term: Mapping[str, Any] | None,
) -> dict[str, Any]:
    info: dict[str, Any] = {"pod": (pod.get("metadata") or {}).get("name")}
    if (pod.get("spec") or {}).get("nodeName"):
        info["node"] = pod["spec"]["nodeName"]
    if harness_term is not None:
        info["exit_code"] = harness_term.get("exitCode")
    if grader_term is not None:
        info["grader_exit_code"] = grader_term.get("exitCode")
    first = _time((harness_term or term or {}).get("startedAt"))
    last = _time((term or {}).get("finishedAt"))
    if first is not None and last is not None:
        info["pod_seconds"] = round(max(0.0, last - first), 3)
    return info


# --- the rules ---------------------------------------------------------------------------------------


def _deadline(f: PodFacts) -> Outcome:
    limit = (
        f"{f.timeout_seconds}s, the harness's timeoutSeconds and the grader's"
        if f.graded
        else f"{f.timeout_seconds}s"
    )
    return Outcome.failure(f"DeadlineExceeded: {f.who}ran past activeDeadlineSeconds ({limit})", **f.info)


def _job_deadline(f: PodFacts) -> Outcome:
    message = tail((f.job_failed or {}).get("message"))
    return Outcome.failure(
        f"DeadlineExceeded: the Job ran past its activeDeadlineSeconds: {message}", **f.info
    )


def _deleted(f: PodFacts) -> Outcome:
    d = f.disruption
    if d.get("status") == "True" and d.get("reason") in DISRUPTIONS:
        return Outcome.failure(f"Evicted: {d['reason']}: {tail(d.get('message'))}", **f.info)
    return Outcome.failure("PodDeleted: the pod was deleted before its harness finished", **f.info)


def _result(f: PodFacts) -> Outcome:
    """A zero exit: the reward in the termination message. A harness's result without a reward may be
    made good by a reward it posted (`Outcome.missing_reward`); a grader's not."""
    no_reward = Outcome.failure if f.graded else Outcome.missing_reward
    whose = "grader " if f.graded else ""
    if not f.message.strip():
        return no_reward(
            f"BadResult: no {whose}result in the termination message ({TERMINATION_LOG})", **f.info
        )
    try:
        reward, rest = parse_result(f.message.encode(), whose)
    except NoReward as exc:
        more = {"result": exc.rest} if exc.rest else {}
        return no_reward(f"BadResult: {exc}", **f.info, **more, message=tail(f.message))
    except ValueError as exc:
        return Outcome.failure(f"BadResult: {exc}", **f.info, message=tail(f.message))
    return Outcome.success(reward, **f.info, **({"result": rest} if rest else {}))


def _non_zero(f: PodFacts) -> Outcome:
    detail = "; the grader did not run" if f.graded else ""
    reason = f"NonZeroExit: {f.who}exited with code {f.code}{detail}"
    return Outcome.failure(reason, **f.info, message=tail(f.message))


def _waiting_group(f: PodFacts) -> str:
    why = str(f.waiting.get("reason") or "")
    return "ImagePullBackOff" if why in IMAGE_ERRORS else why


def _waiting(f: PodFacts) -> Outcome:
    why, group = str(f.waiting.get("reason") or ""), _waiting_group(f)
    message = tail(f.waiting.get("message"))
    return Outcome.failure(f"{group}: {why}: {message}" if why != group else f"{group}: {message}", **f.info)


def _unschedulable(f: PodFacts) -> Outcome:
    return Outcome.failure(f"Unschedulable: {tail(f.scheduled.get('message'))}", **f.info)


def _job_failed(f: PodFacts) -> Outcome:
    c = f.job_failed or {}
    return Outcome.failure(f"JobFailed: {c.get('reason') or 'Failed'}: {tail(c.get('message'))}", **f.info)


@dataclass(frozen=True)
class Rule:
    """One row: when `when` holds (and, with a `grace`, once the problem lasted that long), `then`."""

    name: str
    when: Callable[[PodFacts], bool]
    then: Callable[[PodFacts], Outcome]
    grace: Literal["image_pull", "unschedulable"] | None = None
    grace_key: Callable[[PodFacts], str] | None = None


def _failed_with(reason: str) -> Callable[[PodFacts], bool]:
    return lambda f: f.phase == "Failed" and f.pod_reason == reason


def _exited_non_zero(f: PodFacts) -> bool:
    return f.term is not None and f.code != 0


POD_RULES: list[Rule] = [
    Rule("DeadlineExceeded", _failed_with("DeadlineExceeded"), _deadline),
    Rule(
        "Evicted",
        _failed_with("Evicted"),
        lambda f: Outcome.failure(f"Evicted: {tail(f.pod_message)}", **f.info),
    ),
    # The Job workload: the job controller ended the pod at the Job's own deadline.
    Rule(
        "JobDeadlineExceeded",
        lambda f: (f.job_failed or {}).get("reason") == "DeadlineExceeded" and (f.term is None or f.deleted),
        _job_deadline,
    ),
    Rule(
        "OOMKilled",
        lambda f: f.term is not None and f.term.get("reason") == "OOMKilled",
        lambda f: Outcome.failure(
            f"OOMKilled: the {f.step} exceeded its memory limit (exit code {f.code})", **f.info
        ),
    ),
    # A container killed by the pod's deletion (or an eviction) did not fail by itself.
    Rule("KilledByDeletion", lambda f: _exited_non_zero(f) and f.deleted, _deleted),
    Rule(
        "ExitCode",
        lambda f: f.term is not None and f.outcome_type == "exitCode",
        lambda f: Outcome.success(1.0 if f.code == 0 else 0.0, **f.info),
    ),
    Rule(
        "GraderFailed",
        lambda f: _exited_non_zero(f) and f.step == GRADER,
        lambda f: Outcome.failure(
            f"GraderFailed: the grader exited with code {f.code}", **f.info, message=tail(f.message)
        ),
    ),
    Rule("NonZeroExit", _exited_non_zero, _non_zero),
    Rule("Result", lambda f: f.term is not None, _result),
    Rule(
        "PodFailed",
        lambda f: f.phase in ("Succeeded", "Failed"),
        lambda f: Outcome.failure(
            f"PodFailed: {f.pod_reason or 'PodFailed'}: {tail(f.pod_message)}", **f.info
        ),
    ),
    # The Job workload: the Job failed and no pod of it was ever seen (it could not create one).
    Rule("JobFailed", lambda f: f.job_failed is not None and f.phase is None and not f.deleted, _job_failed),
    Rule("PodDeleted", lambda f: f.deleted, _deleted),
    Rule(
        "InvalidImageName",
        lambda f: f.waiting.get("reason") == "InvalidImageName",
        lambda f: Outcome.failure(f"InvalidImageName: {tail(f.waiting.get('message'))}", **f.info),
    ),
    Rule(
        "ImageOrCreateError",
        lambda f: f.waiting.get("reason") in IMAGE_ERRORS | CREATE_ERRORS,
        _waiting,
        grace="image_pull",
        grace_key=_waiting_group,
    ),
    Rule(
        "Unschedulable",
        lambda f: f.scheduled.get("status") == "False" and f.scheduled.get("reason") == "Unschedulable",
        _unschedulable,
        grace="unschedulable",
        grace_key=lambda f: "Unschedulable",
    ),
]


def rule_for(facts: PodFacts) -> Rule | None:
    """The first rule that holds; None: the pod runs (or waits) without a problem."""
    return next((rule for rule in POD_RULES if rule.when(facts)), None)


def classify(
    pod: Mapping[str, Any],
    *,
    gone: bool,
    outcome_type: Literal["resultFile", "exitCode", "grader"],
    timeout_seconds: int,
    graces: Graces,
    first_seen: dict[str, float],
    now: float,
    job: Mapping[str, Any] | None = None,
) -> tuple[Outcome | None, float | None]:
    """(the attempt's outcome, or None while it runs; when to look again though nothing changes).

    `timeout_seconds` is the pod's activeDeadlineSeconds; `first_seen` remembers (monotonic `now`)
    when a waiting problem was first seen, for its grace; `job` is the pod's Job, for that workload.
    """
    facts = PodFacts.of(pod, gone=gone, outcome_type=outcome_type, timeout_seconds=timeout_seconds, job=job)
    rule = rule_for(facts)
    if rule is None:
        return None, None
    if rule.grace is not None and rule.grace_key is not None:
        seconds = graces.image_pull_seconds if rule.grace == "image_pull" else graces.unschedulable_seconds
        due = first_seen.setdefault(rule.grace_key(facts), now) + seconds
        if now < due:
            return None, due
    return rule.then(facts), None
