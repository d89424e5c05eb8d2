"""A Kubernetes API emulator for the operator's tests: kmock's KubernetesEmulator on 127.0.0.1, plus
the little of the API server's bookkeeping that the operator relies on and kmock leaves out.

Not a kube-apiserver (none can run here): objects are JSON merged by merge-patch, nothing is
validated, no controller runs (no pods, no status on Deployments), and owner references are not
garbage-collected. What this adds, and nothing more:
- metadata.uid, creationTimestamp and generation 1 on create; a name for `generateName` (events);
- a new resourceVersion on every write;
- generation + 1 when a write changes `spec` (not through the status subresource);
- discovery of the resources the operator uses, and a kubeconfig file pointing at the emulator.
"""

import copy
import itertools
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml
from kmock import KubernetesEmulator, ResourceInfo, action
from kmock._internal.dicts import merge_patch_dict

_RW = {"get", "list", "watch", "create", "patch", "update", "delete"}

# (group/version/plural, kind, namespaced, subresources)
RESOURCES = [
    ("inharness.dev/v1alpha1/trainingruns", "TrainingRun", True, {"status"}),
    ("inharness.dev/v1alpha1/rolloutpools", "RolloutPool", True, {"status"}),
    ("inharness.dev/v1alpha1/harnessspecs", "HarnessSpec", True, {"status"}),
    ("v1/secrets", "Secret", True, set()),
    ("v1/configmaps", "ConfigMap", True, set()),
    ("v1/services", "Service", True, set()),
    ("v1/persistentvolumeclaims", "PersistentVolumeClaim", True, set()),
    ("v1/pods", "Pod", True, {"status"}),
    ("v1/events", "Event", True, set()),
    ("v1/namespaces", "Namespace", False, set()),
    ("events.k8s.io/v1/events", "Event", True, set()),
    ("apps/v1/deployments", "Deployment", True, {"status", "scale"}),
    ("apps/v1/statefulsets", "StatefulSet", True, {"status", "scale"}),
    ("batch/v1/jobs", "Job", True, {"status"}),
    ("apiextensions.k8s.io/v1/customresourcedefinitions", "CustomResourceDefinition", False, set()),
]


class EmulatedCluster(KubernetesEmulator):
    """kmock's emulator with uids, resourceVersions, generations and generated names."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._versions = itertools.count(1)
        for key, kind, namespaced, subresources in RESOURCES:
            self.resources[key] = ResourceInfo(
                kind=kind, namespaced=namespaced, verbs=_RW, subresources=subresources
            )

    async def _handle(self, request: Any) -> Any:
        if request.resource is not None and isinstance(request.data, dict):
            if request.action == action.CREATE:
                self._stamp_create(request)
            elif request.action == action.UPDATE and request.name is not None:
                self._stamp_update(request)
        return await super()._handle(request)

    def _stamp_create(self, request: Any) -> None:
        meta = request.data.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = f"{meta['generateName']}{uuid.uuid4().hex[:8]}"
        if request.namespace and not meta.get("namespace"):
            meta["namespace"] = request.namespace
        meta["uid"] = str(uuid.uuid4())
        meta["resourceVersion"] = str(next(self._versions))
        meta["generation"] = 1
        meta["creationTimestamp"] = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")

    def _stamp_update(self, request: Any) -> None:
        key = (request.resource, request.namespace, request.name)
        if key not in self.objects or self.objects[key].deleted:
            return
        current = copy.deepcopy(dict(self.objects[key].raw))
        meta = request.data.setdefault("metadata", {}) or {}
        request.data["metadata"] = meta
        meta["resourceVersion"] = str(next(self._versions))
        if request.subresource is None and "spec" in request.data:
            merged = merge_patch_dict(current, request.data)
            if merged.get("spec") != current.get("spec"):
                meta["generation"] = int(current.get("metadata", {}).get("generation") or 1) + 1

    def kubeconfig(self, path: Path, server: str) -> Path:
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "current-context": "emulator",
            "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "emulator"}}],
            "clusters": [{"name": "emulator", "cluster": {"server": server}}],
            "users": [{"name": "emulator", "user": {"token": "emulator-token"}}],
        }
        path.write_text(yaml.safe_dump(config))
        return path

    def add_namespace(self, name: str) -> None:
        self.objects["v1/namespaces", None, name] = {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {"name": name, "uid": str(uuid.uuid4()), "resourceVersion": "1"},
        }
