"""The pure rules of the TrainingRun reconcile: drift versus API-server defaults, progress mapping,
phase and conditions, lastTransitionTime, failure and completion."""

from typing import Any

from inharness.gateway.schema import ProgressOut
from inharness.operator import conditions as cond
from inharness.operator.planning import (
    Observed,
    compute_status,
    is_finished,
    is_subset,
    progress_fields,
    spec_model,
    status_changed,
    without,
)
from inharness.operator.spec import TrainingRun, TrainingRunStatus

T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"
AVAILABLE = {"metadata": {"generation": 2}, "status": {"observedGeneration": 2, "availableReplicas": 1}}
READY = {"status": {"readyReplicas": 1}}


def progress(**kw: Any) -> ProgressOut:
    base: dict[str, Any] = {
        "reported": True,
        "step": 3,
        "total_steps": 10,
        "state": "running",
        "reward_mean": 0.5,
        "reward_history": [0.1, 0.3, 0.5],
        "message": None,
        "config_sha256": "cfg",
        "model_version": 3,
        "rollouts": {"queued": 4, "running": 2, "succeeded": 90, "failed": 6},
        "updated_at": 1.0,
    }
    return ProgressOut(**{**base, **kw})


def observed(**kw: Any) -> Observed:
    base: dict[str, Any] = {"generation": 2, "total_steps": 10, "suspended": False, "config_sha256": "cfg"}
    return Observed(**{**base, **kw})


def conditions_of(status: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


# --- drift -------------------------------------------------------------------------------------------


def test_api_server_defaults_are_not_drift_but_changed_or_extra_list_items_are() -> None:
    rendered = {"spec": {"replicas": 1, "containers": [{"name": "a", "image": "x", "env": [{"name": "E"}]}]}}
    live = {
        "metadata": {"uid": "u", "resourceVersion": "9"},
        "spec": {
            "replicas": 1,
            "revisionHistoryLimit": 10,
            "containers": [
                {"name": "a", "image": "x", "imagePullPolicy": "IfNotPresent", "env": [{"name": "E"}]}
            ],
        },
    }
    assert is_subset(rendered, live)
    scaled = {**live, "spec": {**live["spec"], "replicas": 3}}
    assert not is_subset(rendered, scaled)
    extra_env = {
        "spec": {
            **live["spec"],
            "containers": [{"name": "a", "image": "x", "env": [{"name": "E"}, {"name": "F"}]}],
        }
    }
    assert not is_subset(rendered, extra_env)
    assert not is_subset(rendered, {"spec": {"replicas": 1}})


def test_immutable_fields_are_left_out_of_patches_without_touching_the_rendering() -> None:
    sts = {"spec": {"replicas": 1, "selector": {"matchLabels": {"a": "b"}}, "volumeClaimTemplates": [{}]}}
    patch = without(sts, (("spec", "volumeClaimTemplates"), ("spec", "selector")))
    assert patch == {"spec": {"replicas": 1}}
    assert "selector" in sts["spec"]  # a copy was cut, not the original


def test_live_objects_are_read_as_spec_models_without_server_metadata() -> None:
    body = {
        "apiVersion": "inharness.dev/v1alpha1",
        "kind": "TrainingRun",
        "metadata": {
            "name": "r",
            "namespace": "ns",
            "uid": "u",
            "resourceVersion": "5",
            "generation": 2,
            "managedFields": [{}],
            "annotations": {"inharness.dev/last-handled-configuration": "{}"},
        },
        "spec": {"model": {"path": "m"}, "dataset": {"tasks": [1]}, "rolloutPoolRef": {"name": "p"}},
        "status": {"phase": "Running", "conditions": []},
    }
    run = spec_model(TrainingRun, body)
    assert (
        run.metadata.name == "r" and run.metadata.namespace == "ns" and run.spec.rollout_pool_ref.name == "p"
    )


# --- conditions --------------------------------------------------------------------------------------


def test_last_transition_time_moves_only_when_the_status_flips() -> None:
    first = cond.merge(None, [cond.condition("Ready", False, "GatewayNotReady", "a")], generation=1, now=T0)
    reworded = cond.merge(
        first, [cond.condition("Ready", False, "TrainerNotReady", "b")], generation=2, now=T1
    )
    assert reworded[0]["lastTransitionTime"] == T0 and reworded[0]["reason"] == "TrainerNotReady"
    assert reworded[0]["observedGeneration"] == 2
    flipped = cond.merge(reworded, [cond.condition("Ready", True, "Available")], generation=2, now=T1)
    assert flipped[0]["lastTransitionTime"] == T1 and flipped[0]["status"] == "True"


# --- progress ----------------------------------------------------------------------------------------


def test_progress_maps_into_status_fields() -> None:
    fields = progress_fields({}, progress())
    assert fields == {
        "step": 3,
        "modelVersion": 3,
        "rewardMean": 0.5,
        "rolloutsDone": 90,
        "rolloutsFailed": 6,
        "rewardHistory": [0.1, 0.3, 0.5],
    }


def test_an_unreachable_or_restarted_gateway_keeps_the_last_progress() -> None:
    before = {
        "step": 7,
        "modelVersion": 7,
        "rewardMean": 0.8,
        "rolloutsDone": 5,
        "rolloutsFailed": 1,
        "rewardHistory": [0.8],
    }
    assert progress_fields(before, None) == before
    restarted = progress(reported=False, step=0, reward_mean=None, reward_history=[], model_version=7)
    kept = progress_fields(before, restarted)
    assert kept["step"] == 7 and kept["rewardHistory"] == [0.8] and kept["rewardMean"] == 0.8


# --- phase and conditions ----------------------------------------------------------------------------


def test_a_new_run_is_pending_and_starting() -> None:
    status = compute_status({}, observed(), T0)
    assert status["phase"] == "Pending" and status["observedGeneration"] == 2
    c = conditions_of(status)
    assert c["Ready"] == ("False", "GatewayNotReady")
    assert c["Progressing"] == ("True", "Starting")
    assert c["Degraded"] == ("False", "AsExpected")
    assert c["Suspended"] == ("False", "NotSuspended")
    assert c["Complete"] == ("False", "StepsRemaining")
    assert c["Failed"] == ("False", "NoFailure")
    assert status["startTime"] is None and status["completionTime"] is None
    assert [x["type"] for x in status["conditions"]] == [
        "Ready",
        "Progressing",
        "Degraded",
        "Suspended",
        "Complete",
        "Failed",
    ]


def test_an_unreachable_gateway_is_progressing_not_degraded() -> None:
    status = compute_status(
        {}, observed(gateway=AVAILABLE, trainer=READY, progress_error="ConnectError: nope"), T0
    )
    c = conditions_of(status)
    assert c["Progressing"] == ("True", "GatewayUnreachable")
    assert c["Degraded"] == ("False", "AsExpected")
    assert status["phase"] == "Running"


def test_a_training_run_reports_its_step_and_starts_its_clock() -> None:
    status = compute_status({}, observed(gateway=AVAILABLE, trainer=READY, progress=progress()), T0)
    assert status["phase"] == "Running" and status["step"] == 3 and status["startTime"] == T0
    c = conditions_of(status)
    assert c["Ready"] == ("True", "Available") and c["Progressing"] == ("True", "Training")
    later = compute_status(status, observed(gateway=AVAILABLE, trainer=READY, progress=progress(step=4)), T1)
    assert later["startTime"] == T0 and not status_changed(later, later)
    assert status_changed(status, later)


def test_all_steps_done_is_complete_and_finished() -> None:
    done = observed(gateway=AVAILABLE, progress=progress(step=10, state="complete"))
    status = compute_status({}, done, T1)
    assert status["phase"] == "Complete" and status["completionTime"] == T1
    c = conditions_of(status)
    assert c["Complete"] == ("True", "StepsDone") and c["Progressing"] == ("False", "Complete")
    assert c["Ready"] == ("True", "Available")  # the trainer is scaled down on purpose
    assert is_finished({}, done)
    # raising spec.steps afterwards continues the run
    assert not is_finished(status, observed(total_steps=20, generation=3))


def test_a_trainer_failure_of_the_current_config_fails_the_run_and_a_spec_change_retries() -> None:
    failing = observed(gateway=AVAILABLE, progress=progress(state="failed", message="dataset missing"))
    status = compute_status({}, failing, T0)
    assert status["phase"] == "Failed"
    assert conditions_of(status)["Failed"] == ("True", "TrainerFailed")
    assert next(x for x in status["conditions"] if x["type"] == "Failed")["message"] == "dataset missing"
    assert is_finished({}, failing)
    # the gateway restarts and forgets: the Failed status of this generation stands
    assert compute_status(status, observed(gateway=AVAILABLE), T1)["phase"] == "Failed"
    # the user fixes the spec: a report about the old config no longer counts
    fixed = observed(
        generation=3,
        config_sha256="new",
        gateway=AVAILABLE,
        trainer=READY,
        progress=progress(state="failed", config_sha256="cfg"),
    )
    assert not is_finished(status, fixed)
    assert compute_status(status, fixed, T1)["phase"] == "Running"


def test_suspended_run_is_suspended_not_ready_and_not_progressing() -> None:
    status = compute_status({}, observed(suspended=True), T0)
    c = conditions_of(status)
    assert status["phase"] == "Suspended"
    assert c["Suspended"] == ("True", "SuspendRequested")
    assert c["Ready"] == ("False", "Suspended") and c["Progressing"] == ("False", "Suspended")


def test_a_missing_pool_is_pending_and_degraded_with_the_reason() -> None:
    status = compute_status({}, observed(problem=("RolloutPoolNotFound", 'no RolloutPool "p" in ns')), T0)
    c = conditions_of(status)
    assert status["phase"] == "Pending"
    assert c["Degraded"] == ("True", "RolloutPoolNotFound") and c["Ready"] == ("False", "RolloutPoolNotFound")


def test_a_stuck_gateway_rollout_is_degraded() -> None:
    stuck = {
        "status": {
            "conditions": [
                {
                    "type": "Progressing",
                    "status": "False",
                    "reason": "ProgressDeadlineExceeded",
                    "message": 'ReplicaSet "x" has timed out progressing.',
                }
            ]
        }
    }
    c = conditions_of(compute_status({}, observed(gateway=stuck), T0))
    assert c["Degraded"] == ("True", "GatewayRolloutStuck")


def test_an_invalid_spec_fails_with_the_field_and_every_condition_names_it() -> None:
    status = compute_status({}, observed(invalid="spec.steps: must be at least 1"), T0)
    c = conditions_of(status)
    assert status["phase"] == "Failed" and c["Failed"] == ("True", "InvalidSpec")
    assert c["Ready"] == ("False", "InvalidSpec"), "not a missing gateway pod: none was created"
    assert c["Progressing"] == ("False", "Failed")


def test_every_computed_status_fits_the_status_model() -> None:
    cases = [
        observed(),
        observed(suspended=True),
        observed(gateway=AVAILABLE, trainer=READY, progress=progress()),
        observed(gateway=AVAILABLE, progress=progress(step=10, state="complete")),
        observed(gateway=AVAILABLE, progress=progress(state="failed", message="x")),
        observed(problem=("ApplyFailed", "StatefulSet: 422 Invalid: spec.volumeClaimTemplates: Forbidden")),
        observed(invalid="spec: bad"),
    ]
    for case in cases:
        status = TrainingRunStatus.model_validate(compute_status({}, case, T0))
        assert status.observed_generation == 2 and len(status.conditions) == 6


# --- engine verl: the Ray cluster's nodes ------------------------------------------------------------


def test_a_verl_run_shows_its_ray_nodes_and_waits_for_all_of_them() -> None:
    """The trainer's "1 of 2 nodes joined" (a `starting` report, kept by the gateway) becomes
    status.rayNodes/rayNodesWanted and RayClusterReady, False with reason Waiting until all joined."""
    verl = {"gateway": AVAILABLE, "ray_nodes_wanted": 2}
    unreported = compute_status({}, observed(**verl, progress=progress(reported=False, step=0)), T0)
    assert (unreported["rayNodes"], unreported["rayNodesWanted"]) == (None, 2)
    assert conditions_of(unreported)["RayClusterReady"] == ("False", "Waiting")

    one = progress(reported=False, step=0, ray_nodes=1, ray_nodes_wanted=2)
    waiting = compute_status(unreported, observed(**verl, progress=one), T0)
    assert (waiting["rayNodes"], waiting["rayNodesWanted"]) == (1, 2)
    ray = next(c for c in waiting["conditions"] if c["type"] == "RayClusterReady")
    assert (ray["status"], ray["reason"], ray["message"]) == ("False", "Waiting", "1 of 2 nodes joined")
    assert waiting["conditions"][-1] is ray  # after the six every run has

    both = progress(ray_nodes=2, ray_nodes_wanted=2)
    training = compute_status(waiting, observed(**verl, trainer=READY, progress=both), T1)
    assert training["rayNodes"] == 2 and training["phase"] == "Running"
    assert conditions_of(training)["RayClusterReady"] == ("True", "NodesJoined")
    # a restarted gateway knows no count until the trainer reports again: the last one stays
    restarted = compute_status(training, observed(**verl, trainer=READY, progress=progress()), T1)
    assert restarted["rayNodes"] == 2
    assert TrainingRunStatus.model_validate(restarted).ray_nodes == 2

    suspended = compute_status(training, observed(**verl, suspended=True), T1)
    assert conditions_of(suspended)["RayClusterReady"] == ("False", "Suspended")


def test_a_torch_run_has_no_ray_status() -> None:
    status = compute_status(
        {}, observed(gateway=AVAILABLE, trainer=READY, progress=progress(ray_nodes=1)), T0
    )
    assert status["rayNodes"] is None and status["rayNodesWanted"] is None
    assert "RayClusterReady" not in conditions_of(status)
