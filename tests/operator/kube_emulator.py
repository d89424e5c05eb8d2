"""A fake Kubernetes API server for the operator's tests: kmock's KubernetesEmulator on 127.0.0.1,
plus the little of the API server's bookkeeping that the operator and the real kubectl rely on and
kmock leaves out.

Not a kube-apiserver (none can run here): objects are JSON merged by merge-patch, nothing is
validated against a schema (no CRD schema, no CEL: tests/operator/test_crds.py checks those offline
with the real schemas), no controller runs (no pods, no status on Deployments), no server-side
apply, no JSON patch. What this adds, and nothing more:
- metadata.uid, creationTimestamp and generation 1 on create; a name for `generateName` (events);
- a new resourceVersion on every write;
- generation + 1 when a write changes `spec` (not through the status subresource);
- discovery of the resources the operator uses (groupVersion `v1` for the core group, singular
  names), a CRD's names (kind, singular, short names, categories) once the CRD is created, and a
  kubeconfig file pointing at the emulator;
- for kubectl: an OpenAPI v3 index and per-group-version documents holding only each resource's
  PATCH operation with its `fieldValidation` and `dryRun` parameters (so kubectl leaves validation
  to the server, which here does none); lists with `kind: <Kind>List`, `apiVersion` and a
  resourceVersion; `fieldSelector` on lists (`a.b=c`, `==`, `!=`); Tables (`kubectl get`) with a
  CRD's printer columns (a `date` column as an age, as the API server does), NAME and AGE for
  the others; `dryRun` writes answered but not stored; 404/409 with the API server's reasons and
  messages;
- garbage collection of owner references: deleting an object deletes, at once and recursively,
  the objects all of whose owners were deleted (unless `propagationPolicy: Orphan`), also one
  created later for a deleted owner; an owner the emulator never held (a test's made-up uid)
  keeps its dependents.
"""

import copy
import itertools
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp.web
import yaml
from kmock import KubernetesEmulator, ResourceInfo, action
from kmock._internal.dicts import merge_patch_dict
from kmock._internal.k8s import KubernetesObjectConflictError, KubernetesObjectNotFoundError

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
    ("networking.k8s.io/v1/networkpolicies", "NetworkPolicy", True, set()),
    ("apiextensions.k8s.io/v1/customresourcedefinitions", "CustomResourceDefinition", False, set()),
]


class EmulatedCluster(KubernetesEmulator):
    """kmock's emulator with uids, resourceVersions, generations, generated names, and what kubectl
    needs (see the module docstring)."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._versions = itertools.count(1)
        self.crds: dict[str, dict[str, Any]] = {}  # "group/version/plural" -> the CRD
        self.deleted_uids: set[str] = set()  # owners whose dependents the garbage collector deletes
        for key, kind, namespaced, subresources in RESOURCES:
            self.resources[key] = ResourceInfo(
                kind=kind,
                singular=kind.lower(),
                namespaced=namespaced,
                verbs=_RW,
                subresources=subresources,
            )

    async def _handle(self, request: Any) -> Any:
        path = request.url.path
        if path == "/openapi/v3" or path.startswith("/openapi/v3/"):
            return self._openapi(path.removeprefix("/openapi/v3").strip("/"))
        parts = path.strip("/").split("/")
        if parts[:3] == ["api", "v1", "namespaces"] and len(parts) == 4:  # kmock reads it as a namespace
            return self._namespace(parts[3])
        if request.resource is None:
            return await super()._handle(request)
        key = (request.resource, request.namespace, request.name)
        exists = key in self.objects and not self.objects[key].deleted
        if request.params.get("dryRun") and (request.action == action.CREATE or exists):
            return self._dry_run(request)
        if isinstance(request.data, dict):
            if request.action == action.CREATE:
                self._stamp_create(request)
            elif request.action == action.UPDATE and request.name is not None:
                self._stamp_update(request)
        try:
            response = await super()._handle(request)
        except KubernetesObjectNotFoundError:
            return _status(404, "NotFound", f'{_qualified(request.resource)} "{request.name}" not found')
        except KubernetesObjectConflictError:
            name = (request.data.get("metadata") or {}).get("name")
            return _status(409, "AlreadyExists", f'{_qualified(request.resource)} "{name}" already exists')
        body = request.data if isinstance(request.data, dict) else {}
        if request.action == action.CREATE and request.resource.plural == "customresourcedefinitions":
            self._serve_crd(body)
        deleted = request.action == action.DELETE and key in self.objects and self.objects[key].deleted
        if deleted:
            self.deleted_uids.add((self.objects[key].last.raw.get("metadata") or {}).get("uid"))
        owners = {o.get("uid") for o in (body.get("metadata") or {}).get("ownerReferences") or []}
        if (deleted and body.get("propagationPolicy") != "Orphan") or (
            request.action == action.CREATE and owners and owners <= self.deleted_uids
        ):
            await self._collect_garbage()  # also what was created for an owner deleted meanwhile
        return response

    def _stamp_create(self, request: Any) -> None:
        meta = request.data.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = f"{meta['generateName']}{uuid.uuid4().hex[:8]}"
        if request.namespace and not meta.get("namespace"):
            meta["namespace"] = request.namespace
        meta["uid"] = str(uuid.uuid4())
        meta["resourceVersion"] = str(next(self._versions))
        meta["generation"] = 1
        meta["creationTimestamp"] = _now()

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

    # -- what kubectl needs -------------------------------------------------------------------------

    def _namespace(self, name: str) -> aiohttp.web.Response:
        obj = next(
            (
                o
                for (r, _, n), o in self.objects.items()
                if r.plural == "namespaces" and n == name and not o.deleted
            ),
            None,
        )
        return _json(plain(obj.raw)) if obj else _status(404, "NotFound", f'namespaces "{name}" not found')

    async def _serve_version(self, request: Any) -> Any:
        """APIResourceList of one group/version, with the core group's groupVersion `v1`."""
        wanted = request.resource
        resources = []
        for res in self._get_resources():
            if (res.group, res.version) != (wanted.group, wanted.version) or res not in self.resources:
                continue
            info = self.resources[res]
            for sub in ["", *sorted(info.subresources)]:
                resources.append(
                    {
                        "name": f"{res.plural}/{sub}" if sub else res.plural,
                        "singularName": "" if sub else (info.singular or res.plural),
                        "namespaced": bool(info.namespaced),
                        "kind": info.kind,
                        "verbs": sorted(info.verbs) if not sub else ["get", "patch", "update"],
                        "shortNames": sorted(info.shortnames) if not sub else [],
                        "categories": sorted(info.categories) if not sub else [],
                    }
                )
        gv = f"{wanted.group}/{wanted.version}" if wanted.group else wanted.version
        return {"apiVersion": "v1", "kind": "APIResourceList", "groupVersion": gv, "resources": resources}

    def _serve_crd(self, crd: dict[str, Any]) -> None:
        """A created CRD serves its resource under its names; its printer columns make its Tables."""
        spec = crd.get("spec") or {}
        names = spec.get("names") or {}
        for version in spec.get("versions") or []:
            key = f"{spec['group']}/{version['name']}/{names['plural']}"
            self.crds[key] = crd
            self.resources[key] = ResourceInfo(
                kind=names["kind"],
                singular=names.get("singular") or names["kind"].lower(),
                namespaced=spec.get("scope") == "Namespaced",
                verbs=_RW,
                shortnames=set(names.get("shortNames") or []),
                categories=set(names.get("categories") or []),
                subresources=set((version.get("subresources") or {}).keys()),
            )

    def _openapi(self, path: str) -> aiohttp.web.Response:
        """OpenAPI v3: the index of group/versions, and per group/version each resource's PATCH
        operation with the query parameters kubectl checks for (no schemas)."""
        gvs: dict[str, list[Any]] = {}
        for res in self._get_resources():
            if res in self.resources:
                gv = f"apis/{res.group}/{res.version}" if res.group else f"api/{res.version}"
                gvs.setdefault(gv, []).append(res)
        if not path:
            return _json({"paths": {gv: {"serverRelativeURL": f"/openapi/v3/{gv}?hash=0"} for gv in gvs}})
        if path not in gvs:
            return _status(404, "NotFound", f"no OpenAPI document for {path}")
        paths: dict[str, Any] = {}
        for res in gvs[path]:
            info = self.resources[res]
            scope = "namespaces/{namespace}/" if info.namespaced else ""
            gvk = {"group": res.group, "version": res.version, "kind": info.kind}
            params = [
                {"name": p, "in": "query", "schema": {"type": "string"}}
                for p in ("dryRun", "fieldValidation")
            ]
            op = {
                "operationId": f"patch{info.kind}",
                "x-kubernetes-group-version-kind": gvk,
                "parameters": params,
            }
            paths[f"/{path}/{scope}{res.plural}/{{name}}"] = {"patch": op}
        return _json(
            {"openapi": "3.0.0", "info": {"title": "Kubernetes (emulated)", "version": "v0"}, "paths": paths}
        )

    def _dry_run(self, request: Any) -> aiohttp.web.Response:
        """A write with `dryRun`: what it would return, nothing stored."""
        key = (request.resource, request.namespace, request.name)
        if request.action == action.CREATE:
            obj = copy.deepcopy(request.data)
            meta = obj.setdefault("metadata", {})
            meta.setdefault("namespace", request.namespace)
            meta.update(uid=str(uuid.uuid4()), generation=1, creationTimestamp=_now())
            return _json(obj, 201)
        current = plain(self.objects[key].raw)
        if request.action == action.UPDATE and isinstance(request.data, dict):
            return _json(merge_patch_dict(current, request.data))
        return _json(current)

    async def _serve_fetch(self, request: Any) -> Any:
        obj = await super()._serve_fetch(request)
        return self._table(request.resource, [plain(obj)]) if _wants_table(request) else obj

    async def _serve_list(self, request: Any) -> Any:
        """A list (or a Table of it) with its kind, honouring `fieldSelector` (`a.b=c`, `==`, `!=`)."""
        res = request.resource
        if res not in self.resources:
            return await super()._serve_list(request)
        items = [
            plain(obj.raw)
            for (r, ns, _name), obj in self.objects.items()
            if r == res and not obj.deleted and request.namespace in (None, ns)
        ]
        for term in filter(None, (request.params.get("fieldSelector") or "").split(",")):
            negate = "!=" in term
            field, value = term.replace("!=", "=").replace("==", "=").split("=", 1)
            items = [i for i in items if (str(_dotted(i, field)) == value) != negate]
        if _wants_table(request):
            return self._table(res, items)
        gv = f"{res.group}/{res.version}" if res.group else res.version
        return {
            "apiVersion": gv,
            "kind": f"{self.resources[res].kind}List",
            "metadata": {"resourceVersion": str(next(self._versions))},
            "items": items,
        }

    def _table(self, res: Any, items: list[dict[str, Any]]) -> dict[str, Any]:
        """meta.k8s.io/v1 Table: NAME, then a CRD's printer columns (NAME and AGE for the rest)."""
        crd = self.crds.get(f"{res.group}/{res.version}/{res.plural}")
        version = next(
            (v for v in ((crd or {}).get("spec") or {}).get("versions") or [] if v["name"] == res.version), {}
        )
        columns = version.get("additionalPrinterColumns") or [
            {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}
        ]
        definitions = [{"name": "Name", "type": "string", "format": "name", "description": "", "priority": 0}]
        definitions += [
            {
                "name": c["name"],
                "type": c["type"],
                "format": c.get("format", ""),
                "description": c.get("description", ""),
                "priority": c.get("priority", 0),
            }
            for c in columns
        ]
        rows = []
        for item in items:
            cells: list[Any] = [item["metadata"]["name"]]
            for c in columns:
                value = _dotted(item, c["jsonPath"].lstrip("."))
                cells.append(_age(value) if c["type"] == "date" and value else value)
            meta = {
                "apiVersion": "meta.k8s.io/v1",
                "kind": "PartialObjectMetadata",
                "metadata": item["metadata"],
            }
            rows.append({"cells": cells, "object": meta})
        return {
            "apiVersion": "meta.k8s.io/v1",
            "kind": "Table",
            "metadata": {"resourceVersion": str(next(self._versions))},
            "columnDefinitions": definitions,
            "rows": rows,
        }

    async def _collect_garbage(self) -> None:
        """Delete every object all of whose owners were deleted, until none is left to delete. An
        owner this emulator never held (a test's made-up uid) counts as there, not as deleted."""
        while True:
            async with self._lock:
                orphans = [
                    (key, obj)
                    for key, obj in self.objects.items()
                    if not obj.deleted
                    and (owners := (obj.raw.get("metadata") or {}).get("ownerReferences"))
                    and all(o.get("uid") in self.deleted_uids for o in owners)
                ]
                for key, obj in orphans:
                    self.deleted_uids.add((obj.raw.get("metadata") or {}).get("uid"))
                    obj.delete()
                    await self._buses[key[0]].put({"type": "DELETED", "object": obj.last.raw})
            if not orphans:
                return


def plain(value: Any) -> Any:
    """kmock's stored object (mappings of its own) as plain dicts and lists."""
    if hasattr(value, "items"):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value


def _dotted(obj: Any, path: str) -> Any:
    for part in path.split("."):
        if not isinstance(obj, dict):
            return None
        obj = obj.get(part)
    return obj


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _age(timestamp: str) -> str:
    """A date column as the API server shows it: 5s, 3m, 2h, 4d."""
    then = datetime.strptime(timestamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
    seconds = max(0, int((datetime.now(UTC) - then).total_seconds()))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= 2 * size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def _wants_table(request: Any) -> bool:
    return "as=Table" in (request.headers.get("Accept") or "")


def _qualified(res: Any) -> str:
    return f"{res.plural}.{res.group}" if res.group else str(res.plural)


def _json(body: Any, status: int = 200) -> aiohttp.web.Response:
    return aiohttp.web.json_response(body, status=status)


def _status(code: int, reason: str, message: str) -> aiohttp.web.Response:
    body = {"apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure"}
    return _json({**body, "code": code, "reason": reason, "message": message}, code)
