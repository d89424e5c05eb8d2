"""Pod building blocks shared by every pod inharness renders (gateway, trainer, harness): the
restricted security context, path resolution against the containers' working directory, and the
allowlisted pod overrides. Pure functions over plain dicts.

Pod overrides: user `volumes` replace a default volume of the same name (e.g. `store` or `work` with
a volume of one's own; then no claim is rendered for it), user `volumeMounts` replace a default
mount at the same path, user `env` replaces a default variable of the same name; resources merge per
key over the container's defaults (`merge_resources`: every container has requests and limits of CPU
and memory, so that the scheduler, quotas and Kueue can place it and it cannot starve its node). The
security context is not overridable: every pod runs at the "restricted" Pod Security level, and the
gateway and trainer with a read-only root filesystem (they write only to their mounted volumes).
"""

import copy
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

from pydantic import BaseModel

Obj = dict[str, Any]

WORKSPACE = "/workspace"
RUN_AS = 1000

CONTAINER_SECURITY: Mapping[str, Any] = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "runAsNonRoot": True,
    "seccompProfile": {"type": "RuntimeDefault"},
}
POD_SECURITY: Mapping[str, Any] = {
    "runAsNonRoot": True,
    "runAsUser": RUN_AS,
    "runAsGroup": RUN_AS,
    "fsGroup": RUN_AS,
    "seccompProfile": {"type": "RuntimeDefault"},
}


def container_security() -> Obj:
    """A fresh copy of the restricted container security context."""
    return copy.deepcopy(dict(CONTAINER_SECURITY))


def resolve_path(path: str) -> str:
    """A spec path as the containers see it: relative paths resolve against /workspace."""
    return path if path.startswith("/") else f"{WORKSPACE}/{path}"


def merge_named(defaults: list[Obj], extra: list[Obj], key: str) -> list[Obj]:
    """Defaults with user items of the same `key` replaced in place and the other user items appended."""
    out = [dict(d) for d in defaults]
    index = {item[key]: i for i, item in enumerate(out) if key in item}
    for item in extra:
        if item.get(key) in index:
            out[index[item[key]]] = item
        else:
            index[item[key]] = len(out)
            out.append(item)
    return out


def quantities(values: Mapping[str, Any]) -> dict[str, str]:
    """Resource quantities as strings, as the API server returns them (so no false drift)."""
    return {k: str(v) for k, v in values.items()}


_SCALE = {
    **{s: Decimal(1024) ** (i + 1) for i, s in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"))},
    **{s: Decimal(10) ** e for s, e in (("n", -9), ("u", -6), ("m", -3), ("k", 3), ("M", 6), ("G", 9))},
    **{s: Decimal(10) ** e for s, e in (("T", 12), ("P", 15), ("E", 18))},
}


def quantity_value(quantity: str | int) -> Decimal:
    """A Kubernetes quantity as a number ('500m' -> 0.5, '1Gi' -> 1073741824, '1e3' -> 1000)."""
    text = str(quantity)
    for suffix in (text[-2:], text[-1:]):
        if suffix in _SCALE and text[: -len(suffix)]:
            return Decimal(text[: -len(suffix)]) * _SCALE[suffix]
    return Decimal(text)


def merge_resources(base: Mapping[str, Any], over: Mapping[str, Any] | None) -> Obj:
    """`over`'s requests and limits merged per key over `base`'s; a request of `over` above a limit it
    does not set itself raises that limit to the request (else the pod would be invalid)."""
    over = over or {}
    out: Obj = {part: quantities(base[part]) for part in ("requests", "limits") if base.get(part)}
    for part in ("requests", "limits"):
        if over.get(part):
            out[part] = {**out.get(part, {}), **quantities(over[part])}
    limits, own_limits = out.get("limits", {}), set(over.get("limits") or {})
    for key, request in (over.get("requests") or {}).items():
        if key in limits and key not in own_limits and quantity_value(request) > quantity_value(limits[key]):
            limits[key] = str(request)
    return out


def overrides_of(pod: BaseModel | None) -> Obj:
    """A spec's PodOverrides as the camelCase dict `apply_overrides` takes ({} for none)."""
    return pod.model_dump(mode="json", by_alias=True, exclude_none=True) if pod is not None else {}


def apply_container_overrides(container: Obj, overrides: Obj) -> None:
    """The container-level part of the overrides: resources, env, volume mounts."""
    if overrides.get("resources"):
        container["resources"] = merge_resources(container.get("resources") or {}, overrides["resources"])
    if overrides.get("env"):
        container["env"] = merge_named(container.get("env", []), overrides["env"], "name")
    if overrides.get("volumeMounts"):
        container["volumeMounts"] = merge_named(
            container.get("volumeMounts", []), overrides["volumeMounts"], "mountPath"
        )


def apply_overrides(pod_spec: Obj, container: Obj, overrides: Obj) -> None:
    """The allowlisted pod overrides, applied to the pod spec and its one container."""
    apply_container_overrides(container, overrides)
    if overrides.get("volumes"):
        pod_spec["volumes"] = merge_named(pod_spec.get("volumes", []), overrides["volumes"], "name")
    if overrides.get("tolerations"):
        pod_spec["tolerations"] = [*pod_spec.get("tolerations", []), *overrides["tolerations"]]
    if overrides.get("nodeSelector"):
        pod_spec["nodeSelector"] = {**pod_spec.get("nodeSelector", {}), **overrides["nodeSelector"]}
    for key in ("affinity", "serviceAccountName", "priorityClassName", "imagePullSecrets"):
        if overrides.get(key):
            pod_spec[key] = overrides[key]


def user_volume_names(overrides: Obj) -> set[str]:
    return {v["name"] for v in overrides.get("volumes") or [] if "name" in v}


def pod_spec(
    container: Obj, volumes: list[Obj], overrides: Obj, *, read_only_root: bool = False, **extra: Any
) -> Obj:
    """A pod spec around one container: no service account token, no service links, the restricted
    security context on pod and container (after the overrides, which cannot touch it), with a
    read-only root filesystem when `read_only_root`."""
    spec: Obj = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": copy.deepcopy(dict(POD_SECURITY)),
        "containers": [container],
        "volumes": volumes,
        **extra,
    }
    apply_overrides(spec, container, overrides)
    container["securityContext"] = container_security()
    if read_only_root:
        container["securityContext"]["readOnlyRootFilesystem"] = True
    return spec


def http_probe(path: str, port: str, period: int, failures: int, timeout: int = 1) -> Obj:
    return {
        "httpGet": {"path": path, "port": port},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": timeout,
    }
