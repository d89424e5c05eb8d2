"""The Argo CD health check of TrainingRun (charts/inharness/argocd/health-trainingrun.lua), run in a real
Lua 5.1 interpreter (lupa; Argo CD's gopher-lua is Lua 5.1) on statuses the operator's own planning code
computes, and the argocd-cm snippet in the chart's README, which must be the script byte for byte."""

from typing import Any

import pytest
import yaml
from lupa import lua51
from manifest_support import CHART

from inharness.gateway.schema import ProgressOut
from inharness.operator.planning import Observed, compute_status

SCRIPT = (CHART / "argocd" / "health-trainingrun.lua").read_text(encoding="utf-8")
NOW = "2026-01-01T00:00:00Z"
AVAILABLE = {"metadata": {"generation": 1}, "status": {"observedGeneration": 1, "availableReplicas": 1}}
READY = {"status": {"readyReplicas": 1}}


def lua_value(rt: Any, value: Any) -> Any:
    """JSON-like Python values as Lua values, lists as 1-based tables (as Argo CD hands `obj` over)."""
    if isinstance(value, dict):
        return rt.table_from({k: lua_value(rt, v) for k, v in value.items()})
    if isinstance(value, list):
        return rt.table_from([lua_value(rt, v) for v in value])
    return value


def health(obj: dict[str, Any]) -> tuple[str, str]:
    rt = lua51.LuaRuntime(unpack_returned_tuples=True)
    rt.globals().obj = lua_value(rt, obj)
    hs = rt.execute(SCRIPT)
    return hs["status"], hs["message"]


def progress(step: int, *, state: str = "running", message: str | None = None) -> ProgressOut:
    return ProgressOut(
        reported=True,
        step=step,
        total_steps=8,
        state=state,
        reward_mean=0.5,
        reward_history=[0.5] * step,
        message=message,
        config_sha256="cfg",
        model_version=step,
        rollouts={"queued": 0, "running": 0, "succeeded": 4 * step, "failed": 0},
        updated_at=1.0,
    )


def training_run(generation: int = 1, **observed: Any) -> dict[str, Any]:
    """A TrainingRun whose status is what the operator computes from `observed`."""
    base: dict[str, Any] = {"generation": 1, "total_steps": 8, "suspended": False, "config_sha256": "cfg"}
    status = compute_status({}, Observed(**{**base, **observed}), NOW)
    return {
        "apiVersion": "inharness.dev/v1alpha1",
        "kind": "TrainingRun",
        "metadata": {"name": "calc", "namespace": "ml", "generation": generation},
        "spec": {"steps": 8},
        "status": status,
    }


CASES: dict[str, tuple[dict[str, Any], str, str]] = {
    "starting": (
        training_run(),
        "Progressing",
        "GatewayNotReady: the gateway Deployment has no available pod",
    ),
    "pending on a missing pool": (
        training_run(problem=("RolloutPoolNotFound", 'RolloutPool "calc-pool" not found')),
        "Degraded",
        'RolloutPoolNotFound: RolloutPool "calc-pool" not found',
    ),
    "running without a ready trainer": (
        training_run(gateway=AVAILABLE, trainer={"status": {}}),
        "Progressing",
        "TrainerNotReady: the trainer StatefulSet has no ready pod",
    ),
    "running and ready": (
        training_run(gateway=AVAILABLE, trainer=READY, progress=progress(3)),
        "Healthy",
        "Training: step 3/8",
    ),
    "complete": (
        training_run(gateway=AVAILABLE, trainer=READY, progress=progress(8, state="complete")),
        "Healthy",
        "StepsDone: step 8/8",
    ),
    "suspended": (
        training_run(suspended=True),
        "Suspended",
        "Suspended: spec.suspend is true: scaled to zero",
    ),
    "failed": (
        training_run(
            gateway=AVAILABLE, progress=progress(2, state="failed", message="dataset tasks.jsonl: missing")
        ),
        "Degraded",
        "TrainerFailed: dataset tasks.jsonl: missing",
    ),
    "degraded while running": (
        training_run(
            gateway={
                "status": {"conditions": [{"type": "Progressing", "status": "False", "message": "deadline"}]}
            },
            trainer=READY,
        ),
        "Degraded",
        "GatewayRolloutStuck: deadline",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_health_of_a_trainingrun_in_each_state(case: str) -> None:
    obj, status, message = CASES[case]
    assert health(obj) == (status, message), obj["status"]


def test_the_cases_cover_every_phase_and_every_health() -> None:
    phases = {obj["status"]["phase"] for obj, _, _ in CASES.values()}
    assert phases == {"Pending", "Running", "Suspended", "Complete", "Failed"}
    assert {status for _, status, _ in CASES.values()} == {"Healthy", "Progressing", "Degraded", "Suspended"}


def test_a_spec_change_the_operator_has_not_seen_yet_is_progressing_whatever_the_phase() -> None:
    obj = training_run(gateway=AVAILABLE, trainer=READY, progress=progress(8, state="complete"), generation=2)
    assert obj["status"]["phase"] == "Complete"
    assert health(obj) == ("Progressing", "waiting for the operator to observe generation 2")


def test_no_status_yet_is_progressing() -> None:
    obj = training_run()
    del obj["status"]
    assert health(obj) == ("Progressing", "waiting for the operator to report a status")


def test_readme_snippet_is_the_lua_file() -> None:
    readme = (CHART / "README.md").read_text(encoding="utf-8")
    blocks = readme.split("```yaml\n")[1:]
    snippets = [yaml.safe_load(b.split("```")[0]) for b in blocks]
    [cm] = [s for s in snippets if isinstance(s, dict) and s.get("metadata", {}).get("name") == "argocd-cm"]
    assert cm["data"]["resource.customizations.health.inharness.dev_TrainingRun"] == SCRIPT
