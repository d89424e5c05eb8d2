"""The README's install commands, run with the real kubectl (1.35) and helm (v4) from .venv/bin
against the emulated API server (kube_emulator.py): `kubectl apply --server-side -k
deploy/overlays/production` and `helm install inharness charts/inharness -n inharness-system
--create-namespace`, each object asserted as the binaries report it and as `kubectl get` finds it.

The emulator's server-side apply is a fake (its docstring says how far it goes: no field
ownership, no conflicts), no controller runs (the Deployment never gets pods), and nothing is
validated (the CRD schemas are test_crds.py's, the chart's rendering tests/manifests/test_chart.py's).
What these tests show is that both install paths send only what the API server serves, in an order
it accepts, and that a second apply changes nothing.
"""

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kube_emulator import serving

ROOT = Path(__file__).resolve().parents[2]
KUBECTL = ROOT / ".venv" / "bin" / "kubectl"
HELM = ROOT / ".venv" / "bin" / "helm"
OVERLAY = "deploy/overlays/production"

pytestmark = pytest.mark.skipif(
    not KUBECTL.exists(), reason="no kubectl in .venv/bin (tools/k8s_binaries.py)"
)


class Cli:
    """The real kubectl and helm pointed at one emulator, from the repository root, each call with
    a timeout; `run` returns the finished process, `__call__` its stdout once it succeeded."""

    def __init__(self, kubeconfig: Path, tmp: Path) -> None:
        self.kubeconfig, self.tmp = kubeconfig, tmp

    def run(self, binary: Path, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        env = {
            "KUBECONFIG": str(self.kubeconfig),
            "HOME": str(self.tmp),  # helm's and kubectl's caches and configs, nothing of the user's
            "PATH": "/usr/bin:/bin",
        }
        return subprocess.run(
            [str(binary), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, input=stdin
        )

    def __call__(self, binary: Path, *args: str, stdin: str | None = None) -> str:
        done = self.run(binary, *args, stdin=stdin)
        assert done.returncode == 0, f"{binary.name} {' '.join(args)}:\n{done.stdout}\n{done.stderr}"
        return done.stdout

    def objects(self, *args: str) -> list[dict[str, Any]]:
        """`kubectl get ... -o yaml` as its items (a List for several objects, one object else); YAML
        as `kubectl kustomize` writes it, so both read alike (`1e-05` a string to PyYAML)."""
        got = yaml.safe_load(self(KUBECTL, "get", *args, "-o", "yaml"))
        return got["items"] if got.get("kind") == "List" else [got]


@pytest.fixture
def cli(tmp_path: Path) -> Iterator[Cli]:
    """A fresh emulator, no namespace in it: the install makes what it needs."""
    with serving(tmp_path) as kubeconfig:
        yield Cli(kubeconfig, tmp_path)


def _ref(doc: dict[str, Any]) -> str:
    """How kubectl names an object in its output: `deployment.apps/inharness`, `service/x`."""
    group = doc["apiVersion"].rpartition("/")[0]
    return f"{doc['kind'].lower()}{'.' + group if group else ''}/{doc['metadata']['name']}"


def test_kubectl_server_side_apply_of_the_production_overlay(cli: Cli) -> None:
    docs = list(yaml.safe_load_all(cli(KUBECTL, "kustomize", OVERLAY)))
    kinds = {d["kind"] for d in docs}
    assert {"Namespace", "CustomResourceDefinition", "ClusterRole", "Deployment"} <= kinds, kinds

    out = cli(KUBECTL, "apply", "--server-side", "-k", OVERLAY)
    assert out.splitlines() == [f"{_ref(d)} serverside-applied" for d in docs]
    stored = cli.objects("-k", OVERLAY)
    assert [_ref(o) for o in stored] == [_ref(d) for d in docs]
    for doc, obj in zip(docs, stored, strict=True):
        assert obj["metadata"]["uid"] and obj["metadata"]["generation"] == 1, obj["metadata"]
        assert obj["metadata"].get("namespace") == doc["metadata"].get("namespace")
        for field in set(doc) - {"metadata", "apiVersion", "kind"}:  # spec, rules, data: as applied
            assert obj[field] == doc[field], (_ref(doc), field)
    # the CRDs serve their kinds at once, and the namespace holds the operator
    none = cli.run(KUBECTL, "get", "trainingruns", "-A")
    assert (none.returncode, none.stderr.strip()) == (0, "No resources found"), none
    assert cli.objects("deployments", "-n", "inharness")[0]["metadata"]["name"] == "inharness"

    # Applying the same again is a no-op: reported as applied, and nothing written, so not even a
    # resourceVersion moves (the API server skips a write that changes nothing; managedFields, which
    # it would keep unchanged too, the emulator does not record).
    again = cli(KUBECTL, "apply", "--server-side", "-k", OVERLAY)
    assert again.splitlines() == out.splitlines()
    assert cli.objects("-k", OVERLAY) == stored


def test_kubectl_server_side_apply_merges_a_change(cli: Cli) -> None:
    """A changed field is merged in (a new resourceVersion and generation); with `--dry-run=server`
    it is answered but not stored."""
    cli(KUBECTL, "apply", "--server-side", "-k", OVERLAY)
    (before,) = cli.objects("deployment", "inharness", "-n", "inharness")
    docs = list(yaml.safe_load_all(cli(KUBECTL, "kustomize", OVERLAY)))
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    container["image"] = "example.org/inharness:changed"
    changed = yaml.safe_dump(deployment)

    dry = cli(KUBECTL, "apply", "--server-side", "--dry-run=server", "-f", "-", stdin=changed)
    assert dry.strip() == "deployment.apps/inharness serverside-applied (server dry run)"
    assert cli.objects("deployment", "inharness", "-n", "inharness") == [before]

    out = cli(KUBECTL, "apply", "--server-side", "-f", "-", stdin=changed)
    assert out.strip() == "deployment.apps/inharness serverside-applied"
    (after,) = cli.objects("deployment", "inharness", "-n", "inharness")
    assert after["spec"]["template"]["spec"]["containers"][0]["image"] == "example.org/inharness:changed"
    assert after["metadata"]["generation"] == 2
    assert int(after["metadata"]["resourceVersion"]) > int(before["metadata"]["resourceVersion"])
    assert after["metadata"]["uid"] == before["metadata"]["uid"]


@pytest.mark.skipif(not HELM.exists(), reason="no helm in .venv/bin (tools/k8s_binaries.py)")
def test_helm_install_lists_the_release_and_uninstall_removes_it(cli: Cli) -> None:
    """helm v4: the CRDs from crds/ and the templates by server-side apply, the namespace by
    `--create-namespace`, the release in a Secret (protobuf, which the emulator reads); uninstall
    deletes the templates' objects and the release, and keeps the CRDs, as helm does."""
    ns = "inharness-system"
    chart = yaml.safe_load((ROOT / "charts/inharness/Chart.yaml").read_text())
    docs = list(yaml.safe_load_all(cli(HELM, "template", "inharness", "charts/inharness", "-n", ns)))
    refs = [_ref(d) for d in docs if d]
    crds = [
        _ref(yaml.safe_load(p.read_text())) for p in sorted((ROOT / "charts/inharness/crds").glob("*.yaml"))
    ]

    out = cli(HELM, "install", "inharness", "charts/inharness", "-n", ns, "--create-namespace")
    assert "STATUS: deployed" in out.splitlines(), out
    (release,) = yaml.safe_load(cli(HELM, "list", "-n", ns, "-o", "json"))
    assert (release["name"], release["namespace"], release["revision"], release["status"]) == (
        "inharness",
        ns,
        "1",
        "deployed",
    )
    assert release["chart"] == f"inharness-{chart['version']}"
    assert cli.objects("namespace", ns)[0]["metadata"]["name"] == ns
    stored = cli.objects("-n", ns, *refs, *crds)
    assert [_ref(o) for o in stored] == [*refs, *crds]
    (secret,) = cli.objects("secrets", "-n", ns, "-l", "owner=helm")
    assert secret["metadata"]["name"] == "sh.helm.release.v1.inharness.v1"
    assert secret["metadata"]["labels"]["status"] == "deployed" and secret["type"] == "helm.sh/release.v1"

    assert cli(HELM, "uninstall", "inharness", "-n", ns).strip() == 'release "inharness" uninstalled'
    assert yaml.safe_load(cli(HELM, "list", "-n", ns, "-o", "json")) == []
    gone = cli.run(KUBECTL, "get", "-n", ns, *refs)
    assert gone.returncode == 1 and gone.stderr.count("(NotFound)") == len(refs), gone
    assert cli.objects("secrets", "-n", ns) == []
    assert [_ref(o) for o in cli.objects(*crds)] == crds  # helm never deletes a chart's CRDs
