"""A fake Kubernetes API server for the operator's tests: kmock's KubernetesEmulator on 127.0.0.1,
plus the little of the API server's bookkeeping that the operator and the real kubectl rely on and
kmock leaves out.

Not a kube-apiserver (none can run here): objects are JSON merged by merge-patch, nothing is
validated against a schema (no CRD schema, no CEL: tests/operator/test_crds.py checks those offline
with the real schemas), no controller runs (no pods, no status on Deployments), no JSON patch, no
strategic merge (a strategic patch merges as a merge patch does). What this adds, and nothing more:
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
  keeps its dependents;
- a fake server-side apply (PATCH with `Content-Type: application/apply-patch+yaml`, what
  `kubectl apply --server-side` and helm v4 send): the object is created when absent; when present
  the applied fields are merged in (mappings merged recursively, lists replaced, as a merge patch
  does), a write like the others, and nothing is written when that changes nothing (the API server
  keeps the resourceVersion of a no-op apply too). No field ownership: no managedFields, never a
  conflict, so `fieldManager` and `force` are accepted and ignored, and a field dropped from the
  applied object stays (the API server would remove it, its manager no longer owning it);
- for helm v4: `/version` saying 1.35 (kmock says 1.26; the chart needs 1.29 or later); PUT as a
  replacement of the stored object (no resourceVersion precondition); `labelSelector` on lists
  (`a=b`, `==`, `!=`, `a`, `!a`); a namespace by name for every verb (kmock reads
  `/api/v1/namespaces/<name>` as a namespace, not as an object); protobuf request bodies of
  Secrets and DeleteOptions read as JSON (client-go 1.35's typed clients send protobuf; the
  release Secrets are written so), answers always JSON, a 415 for any other kind in protobuf;
- the emulator served on a thread of its own (`serving`), for tests that run kubectl and helm as
  blocking subprocesses.

Not there: a collection list of namespaces (`kubectl get namespaces`: kmock's path parser fails on
`/api/v1/namespaces`; by name it works), short names of the built-in kinds (`deploy`, `ns`), 201 on
create (always 200), watch bookmarks, a namespace's deletion taking its objects.
"""

import asyncio
import base64
import contextlib
import copy
import itertools
import json
import threading
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp.web
import attrs
import yaml
from kmock import KubernetesEmulator, ResourceInfo, Server, action, resource
from kmock._internal.dicts import merge_patch_dict
from kmock._internal.k8s import KubernetesObjectConflictError, KubernetesObjectNotFoundError

_RW = {"get", "list", "watch", "create", "patch", "update", "delete"}
_NAMESPACES = resource("", "v1", "namespaces")
_VERBS = {"GET": action.FETCH, "PATCH": action.UPDATE, "PUT": action.UPDATE, "DELETE": action.DELETE}
_SYSTEM_FIELDS = {"uid", "creationTimestamp", "generation"}  # what a PUT cannot take away

SERVER_VERSION = {"major": "1", "minor": "35", "gitVersion": "v1.35.0"}

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
    ("v1/serviceaccounts", "ServiceAccount", True, set()),
    ("rbac.authorization.k8s.io/v1/roles", "Role", True, set()),
    ("rbac.authorization.k8s.io/v1/rolebindings", "RoleBinding", True, set()),
    ("rbac.authorization.k8s.io/v1/clusterroles", "ClusterRole", False, set()),
    ("rbac.authorization.k8s.io/v1/clusterrolebindings", "ClusterRoleBinding", False, set()),
    ("scheduling.k8s.io/v1/priorityclasses", "PriorityClass", False, set()),
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

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        """A protobuf body (what helm v4's typed clients send for Secrets) read as its JSON twin."""
        if raw_request.content_type == PROTOBUF:
            raw_request = raw_request.clone(
                headers={**raw_request.headers, "Content-Type": "application/json"}
            )
            body = from_protobuf(await raw_request.read())
            raw_request._read_bytes = json.dumps(body).encode()  # what read(), json() and text() return
        return await super().__call__(raw_request)

    async def _handle(self, request: Any) -> Any:
        path = request.url.path
        if path == "/openapi/v3" or path.startswith("/openapi/v3/"):
            return self._openapi(path.removeprefix("/openapi/v3").strip("/"))
        parts = path.strip("/").split("/")
        if parts[:3] == ["api", "v1", "namespaces"] and len(parts) == 4:  # kmock reads it as a namespace
            verb = _VERBS.get(request.method) if request.params.get("watch") != "true" else request.action
            request = self._reread(request, resource=_NAMESPACES, namespace=None, name=parts[3], action=verb)
        if request.resource is None:
            return await super()._handle(request)
        key = (request.resource, request.namespace, request.name)
        exists = key in self.objects and not self.objects[key].deleted
        if request.method == "PUT" and request.name is not None and isinstance(request.data, dict):
            current = plain(self.objects[key].raw) if exists else {}
            kept = {k: v for k, v in (current.get("metadata") or {}).items() if k in _SYSTEM_FIELDS}
            new = {**request.data, "metadata": {**(request.data.get("metadata") or {}), **kept}}
            request = self._reread(request, action=action.UPDATE, data=_replacing(current, new))
        if "apply-patch" in (request.headers.get("Content-Type") or "") and request.name is not None:
            applied = request.data if isinstance(request.data, dict) else yaml.safe_load(request.text)
            applied.setdefault("metadata", {}).setdefault("name", request.name)
            current = plain(self.objects[key].raw) if exists else None
            if current is not None and merge_patch_dict(current, applied) == current:
                return _json(current)  # a no-op apply writes nothing
            as_create = {} if exists else {"method": "POST", "action": action.CREATE, "name": None}
            request = self._reread(request, data=applied, **as_create)
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

    def _reread(self, request: Any, **changes: Any) -> Any:
        """The request as the API server reads it; kmock routes a request only if its log holds that
        very object, so the new one takes the old one's place there (an apply that creates is logged
        as a POST, a PUT as a merge patch)."""
        new = attrs.evolve(request, **changes)
        log = self._requests
        log[next(i for i in range(len(log) - 1, -1, -1) if log[i] is request)] = new
        return new

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

    async def _serve_server_version(self, request: Any) -> Any:
        """/version: the version of the kubectl beside it, not kmock's 1.26 (the chart needs 1.29+)."""
        return {**await super()._serve_server_version(request), **SERVER_VERSION}

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
        """A list (or a Table of it) with its kind, honouring `fieldSelector` (`a.b=c`, `==`, `!=`) and
        `labelSelector` (`a=b`, `==`, `!=`, `a`, `!a`; no set terms)."""
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
        for term in filter(None, (request.params.get("labelSelector") or "").split(",")):
            items = [i for i in items if _selects(term, i["metadata"].get("labels") or {})]
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


@contextlib.contextmanager
def serving(
    tmp: Path,
    *,
    namespaces: tuple[str, ...] = (),
    alongside: Callable[[Path], contextlib.AbstractAsyncContextManager[Any]] | None = None,
) -> Iterator[Path]:
    """The emulator on a thread of its own, for the real kubectl and helm (blocking subprocesses), with
    `namespaces` made and `alongside(kubeconfig)` (the operator) entered while it serves; yields the
    kubeconfig. On exit it stops, and re-raises what failed on its thread."""
    ready, stopped = threading.Event(), threading.Event()
    failure: list[BaseException] = []
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    kubeconfig = tmp / "kubeconfig"

    async def serve() -> None:
        async with EmulatedCluster() as k8s, Server(k8s) as server:
            for name in namespaces:
                k8s.add_namespace(name)
            k8s.kubeconfig(kubeconfig, str(server.url).rstrip("/"))
            async with alongside(kubeconfig) if alongside else contextlib.nullcontext():
                ready.set()
                await stop.wait()

    def main() -> None:
        try:
            loop.run_until_complete(serve())
        except BaseException as exc:
            failure.append(exc)
        finally:
            ready.set()
            stopped.set()

    thread = threading.Thread(target=main, name="emulator", daemon=True)
    thread.start()
    assert ready.wait(90) and not failure, failure
    try:
        yield kubeconfig
    finally:
        loop.call_soon_threadsafe(stop.set)
        assert stopped.wait(60), "the emulator thread did not stop"
        thread.join(10)
        loop.close()
        assert not failure, failure


# Protobuf, as much as helm's release Secrets and their deletion need: per message, field number ->
# (JSON name, type); a type is a message's name, `string`, `bytes` (base64 in JSON), `int`, `bool`,
# `[string]` (repeated) or `{string}`, `{bytes}` (maps). Other fields (timestamps, owner
# references, managedFields) are skipped: a 415 for any other kind.
PROTOBUF = "application/vnd.kubernetes.protobuf"
_MESSAGES: dict[str, dict[int, tuple[str, str]]] = {
    "ObjectMeta": {
        1: ("name", "string"),
        2: ("generateName", "string"),
        3: ("namespace", "string"),
        5: ("uid", "string"),
        6: ("resourceVersion", "string"),
        7: ("generation", "int"),
        11: ("labels", "{string}"),
        12: ("annotations", "{string}"),
        14: ("finalizers", "[string]"),
    },
    "Secret": {
        1: ("metadata", "ObjectMeta"),
        2: ("data", "{bytes}"),
        3: ("type", "string"),
        5: ("immutable", "bool"),
    },
    "DeleteOptions": {
        1: ("gracePeriodSeconds", "int"),
        4: ("propagationPolicy", "string"),
        5: ("dryRun", "[string]"),
    },
}


def from_protobuf(body: bytes) -> dict[str, Any]:
    """A Kubernetes protobuf body (`k8s\\0`, then a runtime.Unknown: typeMeta, raw) as JSON."""
    if not body.startswith(b"k8s\x00"):
        raise aiohttp.web.HTTPUnsupportedMediaType(text="not a Kubernetes protobuf envelope")
    envelope = dict(_wire(body[4:]))
    type_meta = {1: "", 2: ""} | dict(_wire(envelope.get(1, b"")))
    api_version, kind = (type_meta[n].decode() for n in (1, 2))
    if kind not in _MESSAGES:
        raise aiohttp.web.HTTPUnsupportedMediaType(text=f"no protobuf here for {kind}")
    return {"apiVersion": api_version, "kind": kind, **_message(kind, envelope.get(2, b""))}


def _message(name: str, buf: bytes) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for number, value in _wire(buf):
        if number not in _MESSAGES[name]:
            continue
        field, kind = _MESSAGES[name][number]
        if kind.startswith("{"):
            entry = {1: b"", 2: b""} | dict(_wire(value))
            text = base64.b64encode(entry[2]).decode() if kind == "{bytes}" else entry[2].decode()
            out.setdefault(field, {})[entry[1].decode()] = text
        elif kind == "[string]":
            out.setdefault(field, []).append(value.decode())
        elif kind in ("int", "bool"):
            out[field] = bool(value) if kind == "bool" else value
        elif kind == "string":
            if value:  # proto2 writes unset strings as empty ones
                out[field] = value.decode()
        else:
            out[field] = _message(kind, value)
    return out


def _wire(buf: bytes) -> Iterator[tuple[int, Any]]:
    """Protobuf's wire format: (field number, an int for a varint, bytes for the rest)."""
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        wire = key & 7
        if wire == 0:
            value, i = _varint(buf, i)
        elif wire == 2:
            size, i = _varint(buf, i)
            value, i = buf[i : i + size], i + size
        else:  # fixed 64 or 32 bits
            size = 8 if wire == 1 else 4
            value, i = buf[i : i + size], i + size
        yield key >> 3, value


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buf[i]
        value |= (byte & 0x7F) << shift
        i, shift = i + 1, shift + 7
        if byte < 0x80:
            return value, i


def plain(value: Any) -> Any:
    """kmock's stored object (mappings of its own) as plain dicts and lists."""
    if hasattr(value, "items"):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value


def _replacing(current: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """The merge patch that turns `current` into `new`: PUT as a replacement, on kmock's patching."""
    patch: dict[str, Any] = {k: None for k in current if k not in new}
    for k, v in new.items():
        both_maps = isinstance(v, dict) and isinstance(current.get(k), dict)
        patch[k] = _replacing(current[k], v) if both_maps else v
    return patch


def _selects(term: str, labels: dict[str, str]) -> bool:
    """One term of a label selector: `a=b`, `a==b`, `a!=b`, `a` (present), `!a` (absent)."""
    if "!=" in term:
        key, value = term.split("!=", 1)
        return labels.get(key.strip()) != value.strip()
    if "=" in term:
        key, value = term.replace("==", "=").split("=", 1)
        return labels.get(key.strip()) == value.strip()
    term = term.strip()
    return term[1:] not in labels if term.startswith("!") else term in labels


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
