"""TrainingRun -> the Kubernetes objects that run it, as plain dicts: pure functions, no API calls.

The operator applies exactly what `render_children` returns, and `inharness operator render` prints
the same, so a preview (or `kubectl apply --dry-run=server`) shows what the operator would create.

Children of TrainingRun `<run>` (all in the run's namespace, all with the recommended labels):
- Secret `<run>-gateway`: `admin-token`, generated once by the operator and then kept (render takes it
  as an input, so rendering is deterministic), and `engine-api-key`, derived from it
  (`engine_api_key_for`), which the trainer's engine requires and the gateway sends. Both pods mount
  the Secret as files (`SECRETS_DIR`), never as env vars.
- ConfigMap `<run>-config` (key `run.yaml`): the TrainingRun, its RolloutPool and HarnessSpec as one
  spec file, the file the trainer reads (the same format `inharness run` takes locally).
- PersistentVolumeClaim `<run>-gateway-store`, Deployment + Service `<run>-gateway`: the gateway, its
  SQLite store on the claim (so suspend and pod restarts keep every recorded call), one pod replaced
  by Recreate. With `spec.gateway.store.urlSecret` there is no claim: the gateway reads the PostgreSQL
  URL from that Secret key as an env var (`secretKeyRef`: the URL never appears in the objects),
  `spec.gateway.replicas` pods share the database and roll over one by one.
- StatefulSet + headless Service `<run>-trainer`: the trainer and its engine (port 8001), Ray-ready
  ports, GPUs as `nvidia.com/gpu`, /dev/shm as a memory emptyDir, a `work` claim for checkpoints.
  Engine torch: one pod. Engine verl: `spec.trainer.nodes` pods, one Ray cluster (`ray_args`): pod 0
  is the Ray head and the driver, the others join it at `<run>-trainer-0.<run>-trainer:6379`; the
  Service publishes not-ready addresses, so they find the head before it is Ready.
- NetworkPolicies `<run>-trainer`, `<run>-gateway`, `<run>-harness` (unless the operator's
  `network_policies` is off, for clusters that manage policy themselves): the trainer accepts the
  engine port from the run's gateway only and anything from the run's other trainer pods (Ray); the
  gateway accepts 8000 from the run's harness and trainer pods and the operator; the run's harness
  pods may reach only the run's gateway and DNS. Beside the run, whatever its namespace.

Resources: every container has requests and limits of CPU and memory (spec.py's `*_RESOURCES`; the
spec's pod overrides merge over them). The gateway and trainer run with a read-only root filesystem:
they write only to their volumes (store or work claim, /tmp, /dev/shm), with HOME=/tmp.

Owner references: render adds them when given the owner's uid (the operator passes the TrainingRun's
uid); the CLI preview has no uid and leaves them out. Doing it here rather than with `kopf.adopt`
keeps the objects the operator compares against the live ones complete in one place.

Paths: relative paths of the spec (model, dataset, checkpoint dir) resolve against the containers'
working directory, /workspace, as they resolve against the spec file's directory locally. The model
reaches the pods through the image or through a volume the user mounts with the allowlisted pod
overrides, on both the gateway (it needs the tokenizer) and the trainer.

Pod overrides and the restricted security context: render/pods.py.
"""

import base64
import hashlib
import hmac
import json
import os
import secrets
from collections.abc import Callable, Mapping
from importlib.metadata import version
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field

from inharness.cli import GATEWAY_ENV_PREFIX
from inharness.engine import DEFAULT_PORT as ENGINE_DEFAULT_PORT
from inharness.gateway.settings import DEFAULT_PORT as GATEWAY_DEFAULT_PORT
from inharness.operator.api import API_VERSION
from inharness.operator.render.pods import (
    WORKSPACE,
    http_probe,
    merge_resources,
    overrides_of,
    pod_spec,
    quantity_value,
    resolve_path,
    user_volume_names,
)
from inharness.operator.spec import (
    GATEWAY_RESOURCES,
    TRAINER_CPU_RESOURCES,
    TRAINER_RESOURCES_PER_GPU,
    HarnessSpec,
    RolloutPool,
    TrainerSpec,
    TrainingRun,
)
from inharness.trainer import raycluster

Obj = dict[str, Any]

GATEWAY_PORT = GATEWAY_DEFAULT_PORT
ENGINE_PORT = ENGINE_DEFAULT_PORT
RAY_PORTS = (("ray-gcs", 6379), ("ray-dashboard", 8265), ("ray-client", 10001))
ADMIN_TOKEN_KEY = "admin-token"
ENGINE_KEY_KEY = "engine-api-key"
SECRETS_DIR = "/var/run/secrets/inharness"  # the run's Secret, mounted read-only in gateway and trainer
ADMIN_TOKEN_PATH = f"{SECRETS_DIR}/{ADMIN_TOKEN_KEY}"
ENGINE_KEY_PATH = f"{SECRETS_DIR}/{ENGINE_KEY_KEY}"
CONFIG_KEY = "run.yaml"
CONFIG_DIR = "/etc/inharness"
CONFIG_PATH = f"{CONFIG_DIR}/{CONFIG_KEY}"
STORE_DIR = "/var/lib/inharness/store"
STORE_ENV = f"{GATEWAY_ENV_PREFIX}STORE"  # the gateway's `store` setting, as an env var
TRAINER_DIR = "/var/lib/inharness/trainer"

CONFIG_HASH_ANNOTATION = "inharness.dev/config-sha256"
TOKEN_HASH_ANNOTATION = "inharness.dev/admin-token-sha256"
GPU_RESOURCE = "nvidia.com/gpu"
POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"  # set by the StatefulSet controller (Kubernetes 1.28+)


class RenderSettings(BaseModel):
    """Operator-wide settings that shape the children; the chart sets them through env vars."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    gateway_image: str = Field(min_length=1, description="Image that runs `inharness gateway`.")
    trainer_image: str = Field(min_length=1, description="Image that runs `inharness train`.")
    namespace: str = Field(default="default", description="Namespace of runs that name none (render CLI).")
    gateway_store_size: str = Field(default="1Gi", description="Size of the gateway store's claim.")
    trainer_storage_size: str = Field(default="20Gi", description="Size of the trainer's work claim.")
    storage_class: str | None = Field(default=None, description="StorageClass of both claims; None: default.")
    network_policies: bool = Field(
        default=True, description="Give each run its NetworkPolicies; off where the cluster manages policy."
    )
    operator_namespace: str | None = Field(
        default=None, description="The operator's namespace (its pods may reach the gateways); None: any."
    )
    operator_pod_labels: dict[str, str] = Field(
        default_factory=lambda: {
            "app.kubernetes.io/name": "inharness",
            "app.kubernetes.io/component": "operator",
        },
        description="Labels of the operator's pods, which may reach each run's gateway (progress).",
    )
    dns_namespace: str = Field(default="kube-system", description="Namespace of the cluster DNS.")
    dns_pod_labels: dict[str, str] = Field(
        default_factory=lambda: {"k8s-app": "kube-dns"},
        description="Labels of the cluster DNS pods; empty: any pod of dns_namespace.",
    )
    extra_gateway_ingress: list[dict[str, Any]] = Field(
        default_factory=list, description="More NetworkPolicyPeers allowed into each gateway on its port."
    )

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ, **overrides: Any) -> "RenderSettings":
        """The chart's env vars (charts/inharness/templates/deployment.yaml); JSON for labels and peers."""
        ver = version("inharness")
        values: dict[str, Any] = {
            "gateway_image": env.get("INHARNESS_GATEWAY_IMAGE") or f"ghcr.io/inharness/inharness:{ver}",
            "trainer_image": env.get("INHARNESS_TRAINER_IMAGE") or f"ghcr.io/inharness/trainer:{ver}",
            "gateway_store_size": env.get("INHARNESS_GATEWAY_STORE_SIZE") or "1Gi",
            "trainer_storage_size": env.get("INHARNESS_TRAINER_STORAGE_SIZE") or "20Gi",
            "storage_class": env.get("INHARNESS_STORAGE_CLASS") or None,
            "network_policies": (env.get("INHARNESS_NETWORK_POLICIES") or "true").lower() != "false",
            "operator_namespace": env.get("INHARNESS_OPERATOR_NAMESPACE") or None,
        }
        for key in ("operator_pod_labels", "dns_pod_labels", "extra_gateway_ingress"):
            if env.get(f"INHARNESS_{key.upper()}"):
                values[key] = json.loads(env[f"INHARNESS_{key.upper()}"])
        if env.get("INHARNESS_DNS_NAMESPACE"):
            values["dns_namespace"] = env["INHARNESS_DNS_NAMESPACE"]
        return cls(**{**values, **overrides})


# --- names and labels --------------------------------------------------------------------------------


def gateway_name(run: str) -> str:
    return f"{run}-gateway"


def trainer_name(run: str) -> str:
    return f"{run}-trainer"


def config_name(run: str) -> str:
    return f"{run}-config"


def store_claim_name(run: str) -> str:
    return f"{run}-gateway-store"


def engine_url(run: str) -> str:
    """The engine of trainer replica 0 through the headless Service, as the gateway reaches it."""
    return f"http://{trainer_name(run)}-0.{trainer_name(run)}:{ENGINE_PORT}"


def gateway_url(run: str, namespace: str | None = None) -> str:
    host = gateway_name(run) if namespace is None else f"{gateway_name(run)}.{namespace}.svc"
    return f"http://{host}:{GATEWAY_PORT}"


GATEWAY_URL_TEMPLATE = gateway_url("{name}", "{namespace}")
"""Where a run's gateway answers the operator, with the run's name and namespace to fill in."""


def selector_labels(run: str, component: str) -> dict[str, str]:
    """The immutable subset used by selectors: no version, nothing that may change."""
    return {
        "app.kubernetes.io/name": "inharness",
        "app.kubernetes.io/instance": run,
        "app.kubernetes.io/component": component,
    }


def labels(run: str, component: str) -> dict[str, str]:
    return {
        **selector_labels(run, component),
        "app.kubernetes.io/part-of": "inharness",
        "app.kubernetes.io/managed-by": "inharness-operator",
        "inharness.dev/training-run": run,
    }


def owner_reference(run: str, uid: str) -> Obj:
    return {
        "apiVersion": API_VERSION,
        "kind": "TrainingRun",
        "name": run,
        "uid": uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _meta(run: str, name: str, component: str, namespace: str, owner_uid: str | None) -> Obj:
    meta: Obj = {"name": name, "namespace": namespace, "labels": labels(run, component)}
    if owner_uid is not None:
        meta["ownerReferences"] = [owner_reference(run, owner_uid)]
    return meta


# --- secret and config -------------------------------------------------------------------------------


def new_admin_token() -> str:
    return secrets.token_urlsafe(32)


def engine_api_key_for(admin_token: str) -> str:
    """The run's engine API key, derived from its admin token: run-scoped, kept and rotated with it,
    and no second secret for the operator to generate and read back. Whoever holds the admin token
    (the gateway, the trainer, the operator) may use the engine anyway; the engine is never given it."""
    return hmac.new(admin_token.encode(), b"inharness engine api key", hashlib.sha256).hexdigest()


def admin_token_of(secret: Mapping[str, Any] | None) -> str | None:
    """The token held by a live Secret, or None when it has none (then the operator makes one)."""
    if not secret:
        return None
    encoded = (secret.get("data") or {}).get(ADMIN_TOKEN_KEY)
    if not encoded:
        return None
    try:
        token = base64.b64decode(encoded, validate=True).decode()
    except (ValueError, UnicodeDecodeError):
        return None
    return token or None


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def run_config(run: TrainingRun, pool: RolloutPool, harness: HarnessSpec, namespace: str) -> str:
    """The spec file the trainer reads: the three documents with defaults filled in, no status, and
    metadata cut to name and namespace. `spec.suspend` is left out, so suspending only scales."""

    def doc(res: TrainingRun | RolloutPool | HarnessSpec) -> Obj:
        body = res.model_dump(mode="json", by_alias=True, exclude={"status", "metadata"})
        body["metadata"] = {"name": res.metadata.name, "namespace": namespace}
        return {"apiVersion": body.pop("apiVersion"), "kind": body.pop("kind"), **body}

    tr = doc(run)
    tr["spec"].pop("suspend", None)
    return yaml.safe_dump_all([doc(harness), doc(pool), tr], sort_keys=False)


def config_sha256(run: TrainingRun, pool: RolloutPool, harness: HarnessSpec, namespace: str) -> str:
    return _sha256(run_config(run, pool, harness, namespace))


# --- pod building blocks -----------------------------------------------------------------------------


def _secrets_volume(run: str) -> Obj:
    """The run's Secret as files, readable by the pods' group (fsGroup) only."""
    return {"name": "secrets", "secret": {"secretName": gateway_name(run), "defaultMode": 0o440}}


def _secrets_mount() -> Obj:
    return {"name": "secrets", "mountPath": SECRETS_DIR, "readOnly": True}


SECRET_ARGS = ["--admin-token-file", ADMIN_TOKEN_PATH, "--engine-api-key-file", ENGINE_KEY_PATH]


def _claim(size: str, settings: RenderSettings) -> Obj:
    spec: Obj = {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": size}}}
    if settings.storage_class is not None:
        spec["storageClassName"] = settings.storage_class
    return spec


# --- the children ------------------------------------------------------------------------------------


def render_children(
    run: TrainingRun,
    pool: RolloutPool,
    harness: HarnessSpec,
    *,
    settings: RenderSettings,
    admin_token: str,
    owner_uid: str | None = None,
    finished: bool = False,
) -> list[Obj]:
    """Every child of the run, in the order to apply them (what pods mount comes first).

    `finished` (the run is Complete or Failed) keeps the gateway up, so its records stay readable,
    and scales the trainer to zero to give its GPUs back; `spec.suspend` scales both to zero and
    keeps the Secret, the ConfigMap and both claims.
    """
    name = run.metadata.name
    ns = run.metadata.namespace or settings.namespace
    config = run_config(run, pool, harness, ns)
    token_hash = _sha256(admin_token)

    def meta(obj_name: str, component: str) -> Obj:
        return _meta(name, obj_name, component, ns, owner_uid)

    out = [
        _admin_secret(meta(gateway_name(name), "gateway"), admin_token),
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": meta(config_name(name), "trainer"),
            "data": {CONFIG_KEY: config},
        },
    ]
    gw_overrides = overrides_of(run.spec.gateway.pod)
    sqlite = run.spec.gateway.store.url_secret is None
    if sqlite and "store" not in user_volume_names(gw_overrides):
        out.append(_store_claim(meta(store_claim_name(name), "gateway"), settings))
    gw_meta = meta(gateway_name(name), "gateway")
    out.append(_gateway_service(name, gw_meta))
    out.append(_gateway_deployment(run, harness, pool, gw_meta, settings, gw_overrides, token_hash))
    out.append(_trainer_service(name, meta(trainer_name(name), "trainer")))
    replicas = 0 if run.spec.suspend or finished else run.spec.trainer.nodes
    tr_meta = meta(trainer_name(name), "trainer")
    out.append(_trainer_statefulset(run, tr_meta, settings, _sha256(config), token_hash, replicas=replicas))
    if settings.network_policies:
        out += network_policies(name, meta, settings, vllm=run.spec.trainer.inference == "vllm")
    return out


def _admin_secret(meta: Obj, admin_token: str) -> Obj:
    data = {ADMIN_TOKEN_KEY: admin_token, ENGINE_KEY_KEY: engine_api_key_for(admin_token)}
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": meta,
        "type": "Opaque",
        "data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()},
    }


def _store_claim(meta: Obj, settings: RenderSettings) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": meta,
        "spec": _claim(settings.gateway_store_size, settings),
    }


def _service(meta: Obj, spec: Obj) -> Obj:
    return {"apiVersion": "v1", "kind": "Service", "metadata": meta, "spec": spec}


def _gateway_service(run: str, meta: Obj) -> Obj:
    ports = [{"name": "http", "port": GATEWAY_PORT, "targetPort": "http", "protocol": "TCP"}]
    return _service(meta, {"type": "ClusterIP", "selector": selector_labels(run, "gateway"), "ports": ports})


def _gateway_args(run: TrainingRun, harness: HarnessSpec, pool: RolloutPool) -> list[str]:
    """`inharness gateway` flags: the model, the engine of trainer replica 0, the SQLite store on the
    claim (a PostgreSQL store comes as an env var instead: `_gateway_deployment`), the bodies it keeps,
    the policy's sampling (spec.generation)."""
    sqlite = run.spec.gateway.store.url_secret is None
    return [
        "gateway",
        "--model",
        resolve_path(run.spec.model.path),
        "--engine",
        engine_url(run.metadata.name),
        *(["--store", f"sqlite:///{STORE_DIR}/gateway.db"] if sqlite else []),
        "--bodies",
        run.spec.gateway.store.bodies,
        "--temperature",  # the policy's sampling, whatever a harness asks: the trainer scores samples at it
        str(run.spec.generation.temperature),
        "--max-tokens",
        str(run.spec.generation.max_tokens),
        "--host",
        "0.0.0.0",
        "--port",
        str(GATEWAY_PORT),
        "--served-model-name",
        harness.spec.model.model_name,
        "--max-attempts",
        str(pool.spec.max_attempts_per_rollout),
        *SECRET_ARGS,
    ]


def _gateway_deployment(
    run: TrainingRun,
    harness: HarnessSpec,
    pool: RolloutPool,
    meta: Obj,
    settings: RenderSettings,
    overrides: Obj,
    token_hash: str,
) -> Obj:
    name = run.metadata.name
    url_secret = run.spec.gateway.store.url_secret
    env: list[Obj] = [{"name": "HOME", "value": "/tmp"}]
    mounts: list[Obj] = [{"name": "tmp", "mountPath": "/tmp"}, _secrets_mount()]
    volumes: list[Obj] = [{"name": "tmp", "emptyDir": {}}, _secrets_volume(name)]
    if url_secret is None:
        mounts.insert(0, {"name": "store", "mountPath": STORE_DIR})
        volumes.insert(0, {"name": "store", "persistentVolumeClaim": {"claimName": store_claim_name(name)}})
        # One SQLite writer on a ReadWriteOnce claim: the old pod goes before the new one starts.
        strategy: Obj = {"type": "Recreate"}
    else:
        selector = {"name": url_secret.name, "key": url_secret.key}
        env.append({"name": STORE_ENV, "valueFrom": {"secretKeyRef": selector}})
        # Pods share the database: a new one is ready (its migrations applied) before an old one goes.
        strategy = {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    container: Obj = {
        "name": "gateway",
        "image": run.spec.gateway.image or settings.gateway_image,
        "command": ["inharness"],
        "args": _gateway_args(run, harness, pool),
        "workingDir": WORKSPACE,
        "env": env,
        "ports": [{"name": "http", "containerPort": GATEWAY_PORT, "protocol": "TCP"}],
        "resources": merge_resources(GATEWAY_RESOURCES, None),
        "volumeMounts": mounts,
        "startupProbe": http_probe("/healthz", "http", period=5, failures=60),
        "readinessProbe": http_probe("/healthz", "http", period=10, failures=3),
        "livenessProbe": http_probe("/healthz", "http", period=20, failures=3, timeout=5),
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta,
        "spec": {
            "replicas": 0 if run.spec.suspend else run.spec.gateway.replicas,
            "strategy": strategy,
            "revisionHistoryLimit": 3,
            "selector": {"matchLabels": selector_labels(name, "gateway")},
            "template": {
                "metadata": {
                    "labels": labels(name, "gateway"),
                    "annotations": {TOKEN_HASH_ANNOTATION: token_hash},
                },
                "spec": pod_spec(container, volumes, overrides, read_only_root=True),
            },
        },
    }


def _trainer_service(run: str, meta: Obj) -> Obj:
    ports = [
        {"name": "engine", "port": ENGINE_PORT, "targetPort": "engine", "protocol": "TCP"},
        *({"name": n, "port": p, "targetPort": n, "protocol": "TCP"} for n, p in RAY_PORTS),
    ]
    # Headless; peers (the gateway, Ray workers) resolve the pod before it is ready.
    spec = {
        "clusterIP": "None",
        "publishNotReadyAddresses": True,
        "selector": selector_labels(run, "trainer"),
    }
    return _service(meta, {**spec, "ports": ports})


def ray_head_address(run: str) -> str:
    """Where the run's Ray nodes join the head: trainer pod 0 through the headless Service."""
    return f"{trainer_name(run)}-0.{trainer_name(run)}:{raycluster.GCS_PORT}"


def ray_args(run: str, trainer: TrainerSpec, resources: Obj) -> list[str]:
    """`inharness train` flags that make each trainer pod a Ray node (engine verl). Every pod has the
    same flags (one pod template): `inharness train` tells the head (pod 0) from the others by the
    pod's ordinal. Each node offers the container's CPUs (its CPU limit, else its request, rounded
    up), its `gpus`, and an object store within its /dev/shm."""
    cpu = (resources.get("limits") or {}).get("cpu") or (resources.get("requests") or {}).get("cpu") or 1
    shm = int(quantity_value(trainer.shm_size))
    return [
        "--ray-nodes",
        str(trainer.nodes),
        "--ray-head-address",
        ray_head_address(run),
        "--ray-node-ip",
        "$(POD_IP)",
        "--ray-gpus",
        str(trainer.gpus),
        "--ray-cpus",
        str(raycluster.num_cpus(quantity_value(cpu))),
        "--ray-object-store-memory",
        str(raycluster.object_store_memory(shm)),
    ]


def _ray_env() -> list[Obj]:
    """A Ray node's identity (the pod IP, the ordinal), and Ray's token authentication with the run's
    engine API key as the token: every trainer pod holds that file, and nothing outside the run does."""
    return [
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {
            "name": "POD_INDEX",
            "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{POD_INDEX_LABEL}']"}},
        },
        {"name": "RAY_AUTH_MODE", "value": "token"},
        {"name": "RAY_AUTH_TOKEN_PATH", "value": ENGINE_KEY_PATH},
    ]


def _trainer_container(run: TrainingRun, settings: RenderSettings, overrides: Obj) -> Obj:
    name = run.metadata.name
    trainer = run.spec.trainer
    resources = trainer_resources(trainer.gpus)
    verl = trainer.engine == "verl"
    args = ["train", "--config", CONFIG_PATH, "--out", TRAINER_DIR, *SECRET_ARGS]
    if verl:
        args += ray_args(name, trainer, merge_resources(resources, overrides.get("resources")))
    # The engine answers /health from the first version on; before it, the trainer waits for the
    # gateway (up to 5 minutes) and loads the policy: the startup probe gives that 30 minutes, and a
    # Ray head the time its nodes may take to join besides. Ray nodes other than the head answer
    # /health themselves while they run, joined or waiting for the head, so the probes never kill a
    # node while the head starts. The liveness probe sees only a dead or wedged engine server: a hung
    # update is not something an HTTP probe can see (a stuck run shows in the status instead).
    startup_seconds = 1800 + (raycluster.NODES_WAIT_SECONDS if verl else 0)
    container: Obj = {
        "name": "trainer",
        "image": trainer.image or settings.trainer_image,
        "command": ["inharness"],
        "args": args,
        "workingDir": WORKSPACE,
        "env": [
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            {"name": "INHARNESS_GATEWAY_URL", "value": gateway_url(name)},
            # What the gateway dials to reach this pod's engine (replica-independent, via the headless DNS).
            {
                "name": "INHARNESS_ENGINE_URL",
                "value": f"http://$(POD_NAME).{trainer_name(name)}:{ENGINE_PORT}",
            },
            {"name": "INHARNESS_ENGINE_PORT", "value": str(ENGINE_PORT)},
            {"name": "HOME", "value": "/tmp"},
            *(_ray_env() if verl else []),
        ],
        "ports": [
            {"name": "engine", "containerPort": ENGINE_PORT, "protocol": "TCP"},
            *({"name": n, "containerPort": p, "protocol": "TCP"} for n, p in RAY_PORTS),
        ],
        "volumeMounts": [
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "work", "mountPath": TRAINER_DIR},
            {"name": "dshm", "mountPath": "/dev/shm"},
            {"name": "tmp", "mountPath": "/tmp"},
            _secrets_mount(),
        ],
        "resources": resources,
        "startupProbe": http_probe("/health", "engine", period=10, failures=int(startup_seconds // 10)),
        "readinessProbe": http_probe("/health", "engine", period=10, failures=3),
        "livenessProbe": http_probe("/health", "engine", period=20, failures=3, timeout=5),
    }
    return container


def trainer_resources(gpus: int) -> Obj:
    """The trainer container's default resources: `TRAINER_CPU_RESOURCES` for a CPU run, else
    `TRAINER_RESOURCES_PER_GPU` times the GPUs, with the GPUs as a limit (extended resources take none
    as requests)."""
    if gpus == 0:
        return merge_resources(TRAINER_CPU_RESOURCES, None)
    out: Obj = {
        part: {"cpu": str(v["cpu"] * gpus), "memory": f"{v['memory'] * gpus}Gi"}
        for part, v in TRAINER_RESOURCES_PER_GPU.items()
    }
    out["limits"][GPU_RESOURCE] = str(gpus)
    return out


def _trainer_statefulset(
    run: TrainingRun, meta: Obj, settings: RenderSettings, config_hash: str, token_hash: str, *, replicas: int
) -> Obj:
    name = run.metadata.name
    trainer = run.spec.trainer
    overrides = overrides_of(trainer.pod)
    volumes: list[Obj] = [
        {"name": "config", "configMap": {"name": config_name(name)}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": trainer.shm_size}},
        {"name": "tmp", "emptyDir": {}},
        _secrets_volume(name),
    ]
    extra: Obj = {}
    if trainer.gpus > 0:
        extra["tolerations"] = [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}]
    spec: Obj = {
        "replicas": replicas,
        "serviceName": trainer_name(name),
        "podManagementPolicy": "Parallel",
        "selector": {"matchLabels": selector_labels(name, "trainer")},
        "template": {
            "metadata": {
                "labels": labels(name, "trainer"),
                "annotations": {CONFIG_HASH_ANNOTATION: config_hash, TOKEN_HASH_ANNOTATION: token_hash},
            },
            "spec": pod_spec(
                _trainer_container(run, settings, overrides), volumes, overrides, read_only_root=True, **extra
            ),
        },
    }
    if "work" not in user_volume_names(overrides):
        spec["volumeClaimTemplates"] = [
            {
                "metadata": {"name": "work", "labels": labels(name, "trainer")},
                "spec": _claim(settings.trainer_storage_size, settings),
            }
        ]
        # Checkpoints outlive a scale-down (suspend) and go with the run.
        spec["persistentVolumeClaimRetentionPolicy"] = {"whenDeleted": "Delete", "whenScaled": "Retain"}
    return {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": meta, "spec": spec}


# --- network policies --------------------------------------------------------------------------------


def _pods_of(run: str, component: str) -> Obj:
    """A NetworkPolicyPeer: the run's pods of one component, in the policy's namespace."""
    return {"podSelector": {"matchLabels": selector_labels(run, component)}}


def _tcp(port: int) -> Obj:
    return {"protocol": "TCP", "port": port}


def network_policies(
    run: str, meta: Callable[[str, str], Obj], settings: RenderSettings, *, vllm: bool = False
) -> list[Obj]:
    """The run's three NetworkPolicies (`meta(name, component)` gives their metadata):

    - `<run>-trainer`: ingress to the trainer pods from the run's gateway on the engine port (on any
      port with `vllm`: verl's vLLM servers listen on ports they pick at start), and from the run's own
      trainer pods on any port (Ray: GCS, dashboard and client ports, and the node manager's, object
      manager's and workers' ports, which Ray picks at start);
    - `<run>-gateway`: ingress to the gateway on its port from the run's harness and trainer pods,
      the operator's pods (progress) and `extra_gateway_ingress`;
    - `<run>-harness`: egress of the run's harness pods (the agent under training, untrusted) to the
      run's gateway on its port and to the cluster DNS only.
    Egress of the gateway (to the engines) and of the trainer (to the gateway, model hubs) is left open.
    """
    operator: Obj = {"podSelector": {"matchLabels": dict(settings.operator_pod_labels)}}
    operator["namespaceSelector"] = (
        {"matchLabels": {"kubernetes.io/metadata.name": settings.operator_namespace}}
        if settings.operator_namespace is not None
        else {}
    )
    dns: Obj = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": settings.dns_namespace}}}
    if settings.dns_pod_labels:
        dns["podSelector"] = {"matchLabels": dict(settings.dns_pod_labels)}

    def policy(name: str, selected: str, spec: Obj) -> Obj:
        body = {"podSelector": {"matchLabels": selector_labels(run, selected)}, **spec}
        return {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": meta(name, "network-policy"),
            "spec": body,
        }

    from_gateway: Obj = {"from": [_pods_of(run, "gateway")]}
    if not vllm:
        from_gateway["ports"] = [_tcp(ENGINE_PORT)]
    trainer_in = [from_gateway, {"from": [_pods_of(run, "trainer")]}]
    gateway_from = [
        _pods_of(run, "harness"),
        _pods_of(run, "trainer"),
        operator,
        *settings.extra_gateway_ingress,
    ]
    harness_out = [
        {"to": [_pods_of(run, "gateway")], "ports": [_tcp(GATEWAY_PORT)]},
        {"to": [dns], "ports": [{"protocol": "UDP", "port": 53}, _tcp(53)]},
    ]
    return [
        policy(trainer_name(run), "trainer", {"policyTypes": ["Ingress"], "ingress": trainer_in}),
        policy(
            gateway_name(run),
            "gateway",
            {"policyTypes": ["Ingress"], "ingress": [{"from": gateway_from, "ports": [_tcp(GATEWAY_PORT)]}]},
        ),
        policy(f"{run}-harness", "harness", {"policyTypes": ["Egress"], "egress": harness_out}),
    ]


def to_yaml(objects: list[Obj]) -> str:
    return yaml.safe_dump_all(objects, sort_keys=False)


def render_file(
    path: str,
    *,
    settings: RenderSettings,
    admin_token: str | None = None,
    run: str | None = None,
) -> str:
    """`inharness operator render FILE`: the children of the file's TrainingRun as a YAML stream.

    Without `admin_token` a fresh one is generated, as the operator does for a new run (so the
    output is safe to apply); pass one for output that diffs cleanly. Paths are not checked on
    this machine: on a cluster they are inside the containers.
    """
    from inharness.operator.specfile import load_specs

    specs = load_specs(path, run=run, check_files=False)
    objects = render_children(
        specs.training_run,
        specs.rollout_pool,
        specs.harness,
        settings=settings,
        admin_token=admin_token or new_admin_token(),
    )
    head = (
        f"# Rendered by `inharness operator render {path}`: what the operator creates for TrainingRun "
        f'"{specs.training_run.metadata.name}".\n'
        "# The operator also sets ownerReferences (to the TrainingRun's uid), which a preview cannot know.\n"
    )
    return head + to_yaml(objects)
