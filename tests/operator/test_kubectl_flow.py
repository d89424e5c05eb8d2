"""The README's "On a cluster" commands, run with the real kubectl (.venv/bin/kubectl, 1.35) against
the emulated API server (kube_emulator.py) and the real `inharness operator run`, asserting what a
user sees: `kubectl get trainingruns` with the CRD's printer columns, the short name and category,
`kubectl describe` with conditions and events, suspend and resume by `kubectl patch`, a server-side
dry run stored nowhere, and `kubectl delete -f` taking the children with it.

What the emulator cannot do is checked elsewhere: the CRD schemas and their CEL rules offline
with the real schemas (test_crds.py), the Deployment and StatefulSet controllers not at all (the
test writes the gateway's available status with `kubectl patch --subresource=status`, as the
Deployment controller would). The install commands (`kubectl apply --server-side -k`, `helm
install`) are test_install_flow.py's.

One emulator and one operator for the module; the tests run in file order (the last one deletes).
"""

import contextlib
import json
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kube_emulator import serving
from operator_process import operator_running

from inharness.procs import free_port

ROOT = Path(__file__).resolve().parents[2]
KUBECTL = ROOT / ".venv" / "bin" / "kubectl"
EXAMPLE = "examples/calc/trainingrun.yaml"
NS = "test"
CHILDREN = [
    "secret/calc-gateway",
    "configmap/calc-config",
    "persistentvolumeclaim/calc-gateway-store",
    "service/calc-gateway",
    "deployment/calc-gateway",
    "service/calc-trainer",
    "statefulset/calc-trainer",
]

pytestmark = pytest.mark.skipif(
    not KUBECTL.exists(), reason="no kubectl in .venv/bin (tools/k8s_binaries.py)"
)


class Kubectl:
    """`kubectl --kubeconfig <the emulator's> -n test ...` from the repository root, as a user types it."""

    def __init__(self, kubeconfig: Path, cache: Path) -> None:
        self.base = [str(KUBECTL), "--kubeconfig", str(kubeconfig), "--cache-dir", str(cache)]

    def run(
        self, *args: str, check: bool = True, stdin: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        namespace = [] if "-n" in args else ["-n", NS]
        done = subprocess.run(
            [*self.base, *namespace, *args], cwd=ROOT, capture_output=True, text=True, timeout=60, input=stdin
        )
        if check:
            assert done.returncode == 0, f"kubectl {' '.join(args)}:\n{done.stdout}\n{done.stderr}"
        return done

    def __call__(self, *args: str) -> str:
        return self.run(*args).stdout

    def json(self, *args: str) -> dict[str, Any]:
        return json.loads(self(*args, "-o", "json"))


def eventually(check: Callable[[], Any], what: str, within: float = 30.0) -> Any:
    deadline = time.monotonic() + within
    last = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(0.2)
    pytest.fail(f"not within {within:.0f}s: {what} (last: {last!r})")


@pytest.fixture(scope="module")
def kubectl(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kubectl]:
    """The emulator and the operator in a thread of their own, the CRDs applied as the chart would
    (`kubectl apply -f crds/`), and a kubectl pointed at them."""
    tmp = tmp_path_factory.mktemp("kubectl")

    def operator(kubeconfig: Path) -> contextlib.AbstractAsyncContextManager[Any]:
        # nothing listens at the gateway's url: no progress to read
        return operator_running(
            kubeconfig, tmp / "operator.log", namespace=NS, gateway_url=f"http://127.0.0.1:{free_port()}"
        )

    with serving(tmp, namespaces=(NS, "dry"), alongside=operator) as kubeconfig:
        k = Kubectl(kubeconfig, tmp / "cache")
        out = k("apply", "-f", "crds/")
        assert out.splitlines() == [
            f"customresourcedefinition.apiextensions.k8s.io/{plural}.inharness.dev created"
            for plural in ("harnessspecs", "rolloutpools", "trainingruns")
        ]
        yield k
    log = (tmp / "operator.log").read_text()  # the operator's log holds no traceback
    assert "Traceback" not in log, log[-4000:]


def _rows(table: str) -> list[list[str]]:
    """`kubectl get` output as cells: split at the header's column starts (cells may be empty)."""
    header, *lines = table.splitlines()
    starts = [i for i, ch in enumerate(header) if ch != " " and (i == 0 or header[i - 1] == " ")]
    bounds = [*starts[1:], None]
    return [[line[a:b].strip() for a, b in zip(starts, bounds, strict=True)] for line in [header, *lines]]


def test_kubectl_apply_then_get_trainingruns_shows_the_printer_columns(kubectl: Kubectl) -> None:
    out = kubectl("apply", "-f", EXAMPLE)
    assert out.splitlines() == [
        "harnessspec.inharness.dev/calc-harness created",
        "rolloutpool.inharness.dev/calc-pool created",
        "trainingrun.inharness.dev/calc created",
    ]
    eventually(lambda: kubectl.run("get", *CHILDREN, check=False).returncode == 0, "the operator's children")
    header, row = eventually(
        lambda: (rows := _rows(kubectl("get", "trainingruns")))[1][1] == "Pending" and rows, "phase Pending"
    )
    assert header == ["NAME", "PHASE", "STEP", "REWARD", "MODEL", "AGE"]
    assert row[:5] == ["calc", "Pending", "0", "", ""] and row[5].endswith("s")  # no progress read yet

    # What the Deployment and StatefulSet controllers would write: the run turns Running.
    available = {
        "status": {"observedGeneration": 1, "replicas": 1, "availableReplicas": 1, "readyReplicas": 1}
    }
    kubectl(
        "patch",
        "deployment",
        "calc-gateway",
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps(available),
    )
    ready = {"status": {"replicas": 1, "readyReplicas": 1}}
    kubectl(
        "patch",
        "statefulset",
        "calc-trainer",
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps(ready),
    )
    eventually(lambda: _rows(kubectl("get", "trainingruns"))[1][1] == "Running", "phase Running")

    # the short name and the category (`kubectl get inharness`), as the CRDs declare them
    assert _rows(kubectl("get", "tr"))[1][:2] == ["calc", "Running"]
    everything = kubectl("get", "inharness")
    for name in ("rolloutpool.inharness.dev/calc-pool", "trainingrun.inharness.dev/calc"):
        assert name in everything
    assert "harnessspec.inharness.dev/calc-harness   ghcr.io/inharness/calc-harness" in everything


def test_kubectl_describe_shows_the_conditions_and_the_events(kubectl: Kubectl) -> None:
    out = kubectl("describe", "trainingrun", "calc")
    status = out[out.index("\nStatus:") : out.index("\nEvents:")]
    conditions = [
        {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in block.splitlines() if ":" in line)}
        for block in status.split("    Last Transition Time:")[1:]
    ]
    by_type = {c["Type"]: (c["Status"], c["Reason"]) for c in conditions}
    assert by_type == {
        "Ready": ("True", "Available"),
        "Progressing": ("True", "GatewayUnreachable"),
        "Degraded": ("False", "AsExpected"),
        "Suspended": ("False", "NotSuspended"),
        "Complete": ("False", "StepsRemaining"),
        "Failed": ("False", "NoFailure"),
    }
    assert re.search(r"^  Phase:\s+Running$", status, re.MULTILINE), status
    events = _rows(out[out.index("\nEvents:") + len("\nEvents:\n") :].replace("  ----", "      "))
    assert events[0][:3] == ["Type", "Reason", "Age"]
    assert [(e[0], e[1], e[3]) for e in events[2:]] == [
        ("Normal", "Pending", "inharness-operator"),
        ("Normal", "Running", "inharness-operator"),
    ]
    assert events[2][4].startswith("new -> Pending") and events[3][4].startswith("Pending -> Running")


def test_kubectl_patch_suspends_and_resumes_the_run(kubectl: Kubectl) -> None:
    def state() -> tuple[str, str, str]:
        run = kubectl.json("get", "trainingrun", "calc")
        d, s = (
            kubectl.json("get", "deployment", "calc-gateway"),
            kubectl.json("get", "statefulset", "calc-trainer"),
        )
        return run["status"]["phase"], d["spec"]["replicas"], s["spec"]["replicas"]

    out = kubectl("patch", "trainingrun", "calc", "--type", "merge", "-p", '{"spec":{"suspend":true}}')
    assert out.strip() == "trainingrun.inharness.dev/calc patched"
    eventually(lambda: state() == ("Suspended", 0, 0), "suspended: gateway and trainer at zero")
    assert _rows(kubectl("get", "trainingruns"))[1][1] == "Suspended"
    kubectl("patch", "trainingrun", "calc", "--type", "merge", "-p", '{"spec":{"suspend":false}}')
    eventually(lambda: state()[1:] == (1, 1), "resumed: gateway and trainer back to one replica")
    eventually(lambda: state()[0] != "Suspended", "no longer Suspended")
    events = kubectl("describe", "trainingrun", "calc")
    assert "Suspended" in events[events.index("\nEvents:") :]


def test_kubectl_server_side_dry_run_stores_nothing(kubectl: Kubectl, tmp_path: Path) -> None:
    """docs/operator.md: `inharness operator render ... | kubectl apply --dry-run=server -f -`."""
    docs = list(yaml.safe_load_all((ROOT / EXAMPLE).read_text()))
    for doc in docs:
        doc["metadata"]["name"] = f"dry-{doc['metadata']['name']}"
    out = kubectl.run("apply", "--dry-run=server", "-f", "-", stdin=yaml.safe_dump_all(docs)).stdout
    assert out.splitlines() == [
        "harnessspec.inharness.dev/dry-calc-harness created (server dry run)",
        "rolloutpool.inharness.dev/dry-calc-pool created (server dry run)",
        "trainingrun.inharness.dev/dry-calc created (server dry run)",
    ]
    render = subprocess.run(
        [sys.executable, "-m", "inharness.cli", "operator", "render", EXAMPLE, "--namespace", "dry"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert render.returncode == 0, render.stderr
    out = kubectl.run("apply", "-n", "dry", "--dry-run=server", "-f", "-", stdin=render.stdout).stdout
    apps = {"deployment/": "deployment.apps/", "statefulset/": "statefulset.apps/"}
    for child in CHILDREN:
        kind = child.split("/")[0] + "/"
        assert f"{child.replace(kind, apps.get(kind, kind))} created (server dry run)" in out, out
    assert kubectl("get", "trainingruns", "-o", "name").split() == ["trainingrun.inharness.dev/calc"]
    assert (
        kubectl("get", "-n", "dry", "secrets,configmaps,deployments,statefulsets,services", "-o", "name")
        == ""
    )
    missing = kubectl.run("get", "trainingrun", "dry-calc", check=False)
    assert missing.returncode == 1, missing
    assert (
        missing.stderr.strip()
        == 'Error from server (NotFound): trainingruns.inharness.dev "dry-calc" not found'
    )


def test_kubectl_delete_takes_the_children_with_the_run(kubectl: Kubectl) -> None:
    out = kubectl("delete", "-f", EXAMPLE)
    assert out.splitlines() == [
        f'{kind}.inharness.dev "{name}" deleted from {NS} namespace'
        for kind, name in (
            ("harnessspec", "calc-harness"),
            ("rolloutpool", "calc-pool"),
            ("trainingrun", "calc"),
        )
    ]
    # The emulator collects what the TrainingRun owned, as the garbage collector does.
    gone = kubectl.run("get", *CHILDREN, check=False)
    assert gone.returncode == 1 and gone.stdout == "", gone
    assert gone.stderr.count("(NotFound)") == len(CHILDREN), gone.stderr
    time.sleep(2)  # two resyncs: nothing comes back
    kinds = "secrets,configmaps,persistentvolumeclaims,services,deployments,statefulsets,networkpolicies"
    assert kubectl("get", kinds, "-o", "name") == ""
    assert kubectl.run("get", "trainingruns").stderr.strip() == f"No resources found in {NS} namespace."
