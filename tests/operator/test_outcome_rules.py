"""The classification of a harness pod (rollouts/outcome.py) walked row by row: for each rule of
`POD_RULES`, a pod (and, for the Job workload, its Job) that the rule decides, the rule that decides
it and the outcome; a test fails when a rule is added without a row here."""

from typing import Any

import pytest

from inharness.operator.rollouts.outcome import POD_RULES, Graces, Outcome, PodFacts, classify, rule_for

GRACES = Graces(image_pull_seconds=120, unschedulable_seconds=300)


def terminated(code: int, reason: str = "Error", message: str = "", name: str = "harness") -> dict[str, Any]:
    term = {"exitCode": code, "reason": reason, "message": message}
    term |= {"startedAt": "2026-01-01T00:00:00Z", "finishedAt": "2026-01-01T00:00:05Z"}
    return {"name": name, "state": {"terminated": term}}


def pod(phase: str | None = "Running", *statuses: dict[str, Any], **more: Any) -> dict[str, Any]:
    status: dict[str, Any] = {"containerStatuses": list(statuses)}
    if phase is not None:
        status["phase"] = phase
    status |= more.pop("status", {})
    return {
        "metadata": {"name": "p", **more.pop("metadata", {})},
        "spec": {"nodeName": "n1"},
        "status": status,
    }


def waiting(reason: str) -> dict[str, Any]:
    return {"name": "harness", "state": {"waiting": {"reason": reason, "message": "m"}}}


def failed_job(reason: str, message: str = "why") -> dict[str, Any]:
    return {
        "status": {"conditions": [{"type": "Failed", "status": "True", "reason": reason, "message": message}]}
    }


DELETING = {"deletionTimestamp": "2026-01-01T00:00:06Z"}
DISRUPTED = {
    "conditions": [
        {"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler", "message": "m"}
    ]
}
UNSCHEDULABLE = {
    "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "no"}]
}

# (rule, the pod, keyword arguments of classify, the outcome's status, its reason's start or reward)
ROWS: list[tuple[str, dict[str, Any], dict[str, Any], str, Any]] = [
    (
        "DeadlineExceeded",
        pod("Failed", status={"reason": "DeadlineExceeded"}),
        {},
        "failed",
        "DeadlineExceeded: ran past activeDeadlineSeconds (60s)",
    ),
    (
        "Evicted",
        pod("Failed", status={"reason": "Evicted", "message": "low memory"}),
        {},
        "failed",
        "Evicted: low memory",
    ),
    (
        "JobDeadlineExceeded",
        pod("Running", metadata=DELETING),
        {"job": failed_job("DeadlineExceeded")},
        "failed",
        "DeadlineExceeded: the Job ran past",
    ),
    (
        "OOMKilled",
        pod("Failed", terminated(137, "OOMKilled")),
        {},
        "failed",
        "OOMKilled: the harness exceeded its memory limit",
    ),
    (
        "KilledByDeletion",
        pod("Running", terminated(143), metadata=DELETING, status=DISRUPTED),
        {},
        "failed",
        "Evicted: PreemptionByScheduler",
    ),
    ("ExitCode", pod("Failed", terminated(3)), {"outcome_type": "exitCode"}, "succeeded", 0.0),
    (
        "GraderFailed",
        pod("Failed", terminated(2, name="grader"), status={"initContainerStatuses": [terminated(0)]}),
        {"outcome_type": "grader"},
        "failed",
        "GraderFailed: the grader exited with code 2",
    ),
    (
        "NonZeroExit",
        pod("Failed", terminated(3, message="Traceback")),
        {},
        "failed",
        "NonZeroExit: exited with code 3",
    ),
    ("Result", pod("Succeeded", terminated(0, "Completed", '{"reward": 0.5}')), {}, "succeeded", 0.5),
    (
        "PodFailed",
        pod("Failed", status={"reason": "NodeLost", "message": "gone"}),
        {},
        "failed",
        "PodFailed: NodeLost: gone",
    ),
    ("JobFailed", {}, {"job": failed_job("PodFailurePolicy")}, "failed", "JobFailed: PodFailurePolicy: why"),
    ("PodDeleted", pod("Running"), {"gone": True}, "failed", "PodDeleted: "),
    ("InvalidImageName", pod("Pending", waiting("InvalidImageName")), {}, "failed", "InvalidImageName: m"),
    (
        "ImageOrCreateError",
        pod("Pending", waiting("CreateContainerConfigError")),
        {"now": 1e9},
        "failed",
        "CreateContainerConfigError: m",
    ),
    ("Unschedulable", pod("Pending", status=UNSCHEDULABLE), {"now": 1e9}, "failed", "Unschedulable: no"),
]


def decide(p: dict[str, Any], **kw: Any) -> tuple[str | None, Outcome | None, float | None]:
    args = {"gone": False, "outcome_type": "resultFile", "timeout_seconds": 60, "job": None} | kw
    now = args.pop("now", 0.0)
    rule = rule_for(PodFacts.of(p, **args))
    outcome, recheck = classify(
        p,
        **args,
        graces=GRACES,
        first_seen={"ImagePullBackOff": 0.0, "CreateContainerConfigError": 0.0, "Unschedulable": 0.0},
        now=now,
    )
    return (rule.name if rule else None), outcome, recheck


def test_every_rule_has_a_row() -> None:
    assert [r.name for r in POD_RULES] == [row[0] for row in ROWS]


@pytest.mark.parametrize(("rule", "p", "kw", "status", "expect"), ROWS, ids=[r[0] for r in ROWS])
def test_each_rule_decides_its_row(
    rule: str, p: dict[str, Any], kw: dict[str, Any], status: str, expect: Any
) -> None:
    name, outcome, recheck = decide(p, **kw)
    assert name == rule and outcome is not None and recheck is None
    assert outcome.status == status, outcome
    if isinstance(expect, str):
        assert (outcome.reason or "").startswith(expect), outcome.reason
    else:
        assert outcome.reward == expect


def test_a_running_pod_matches_no_rule_and_a_waiting_problem_waits_for_its_grace() -> None:
    assert decide(pod("Running", {"name": "harness", "state": {"running": {}}})) == (None, None, None)
    name, outcome, recheck = decide(pod("Pending", waiting("ErrImagePull")), now=10.0)
    assert (name, outcome, recheck) == ("ImageOrCreateError", None, 120.0)


def test_a_result_without_a_reward_may_be_made_good_by_a_posted_one_but_a_bad_one_not() -> None:
    _, missing, _ = decide(pod("Succeeded", terminated(0, "Completed", "")))
    assert (
        missing is not None
        and missing.info.get("_reward_missing")
        and (missing.reason or "").startswith("BadResult: no result")
    )
    _, bad, _ = decide(pod("Succeeded", terminated(0, "Completed", "not json")))
    assert (
        bad is not None
        and not bad.info.get("_reward_missing")
        and (bad.reason or "").startswith("BadResult: result file is not valid JSON")
    )
    assert bad.info["exit_code"] == 0 and bad.info["node"] == "n1" and bad.info["pod_seconds"] == 5.0
