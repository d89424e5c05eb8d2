"""What the operator creates for a TrainingRun: names, labels, owner references, pod overrides,
restricted pod security, GPUs, suspend, determinism, resources, probes, secrets as files and the
run's NetworkPolicies; every object checked against Kubernetes' own schemas (kubernetes-validate) at
the oldest and newest versions the chart claims."""

import base64
import copy
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from inharness import cli
from inharness.gateway.schema import ClaimedAttempt
from inharness.operator import render
from inharness.operator.render import RenderSettings, harness, render_children
from inharness.operator.spec import HarnessSpecSpec, PodOverrides, TrainingRun
from inharness.operator.specfile import Specs, load_specs

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "calc" / "trainingrun.yaml"
SETTINGS = RenderSettings(
    gateway_image="example.org/inharness:test", trainer_image="example.org/trainer:test"
)
TOKEN = "test-admin-token-0123456789"
UID = "6f1c1d8e-1111-2222-3333-444455556666"
K8S_VERSIONS = ["1.29.0", "1.35.0"]


@pytest.fixture(scope="module")
def specs() -> Specs:
    return load_specs(EXAMPLE, check_files=False)


def with_spec(specs: Specs, **spec: Any) -> TrainingRun:
    """The example's TrainingRun with camelCase spec fields replaced, validated like user input."""
    doc = specs.training_run.model_dump(mode="json", by_alias=True)
    doc["spec"].update(copy.deepcopy(spec))
    return TrainingRun.model_validate(doc)


def children(specs: Specs, run: TrainingRun | None = None, **kwargs: Any) -> dict[str, dict[str, Any]]:
    objs = render_children(
        run or specs.training_run,
        specs.rollout_pool,
        specs.harness,
        settings=kwargs.pop("settings", SETTINGS),
        admin_token=kwargs.pop("admin_token", TOKEN),
        **kwargs,
    )
    out = {f"{o['kind']}/{o['metadata']['name']}": o for o in objs}
    assert len(out) == len(objs), "two children share a kind and name"
    return out


def pod_specs(objs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {
        k: o["spec"]["template"]["spec"]
        for k, o in objs.items()
        if o["kind"] in ("Deployment", "StatefulSet")
    }


def container(objs: dict[str, dict[str, Any]], key: str) -> dict[str, Any]:
    (c,) = objs[key]["spec"]["template"]["spec"]["containers"]
    return c


def env_of(c: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}


def test_children_are_named_by_the_contract(specs: Specs) -> None:
    assert set(children(specs)) == {
        "Secret/calc-gateway",
        "ConfigMap/calc-config",
        "PersistentVolumeClaim/calc-gateway-store",
        "Service/calc-gateway",
        "Deployment/calc-gateway",
        "Service/calc-trainer",
        "StatefulSet/calc-trainer",
        "NetworkPolicy/calc-trainer",
        "NetworkPolicy/calc-gateway",
        "NetworkPolicy/calc-harness",
    }
    off = SETTINGS.model_copy(update={"network_policies": False})
    assert not [k for k in children(specs, settings=off) if k.startswith("NetworkPolicy/")]


def test_every_child_and_pod_carries_the_recommended_labels_and_the_namespace(specs: Specs) -> None:
    objs = children(specs, settings=SETTINGS.model_copy(update={"namespace": "team-a"}))
    for key, obj in objs.items():
        component = "trainer" if key in ("ConfigMap/calc-config",) or "trainer" in key else "gateway"
        component = "network-policy" if key.startswith("NetworkPolicy/") else component
        assert obj["metadata"]["namespace"] == "team-a", key
        assert obj["metadata"]["labels"] == {
            "app.kubernetes.io/name": "inharness",
            "app.kubernetes.io/instance": "calc",
            "app.kubernetes.io/component": component,
            "app.kubernetes.io/part-of": "inharness",
            "app.kubernetes.io/managed-by": "inharness-operator",
            "inharness.dev/training-run": "calc",
        }, key
    for key in ("Deployment/calc-gateway", "StatefulSet/calc-trainer"):
        spec = objs[key]["spec"]
        selector = spec["selector"]["matchLabels"]
        assert selector.items() <= spec["template"]["metadata"]["labels"].items()
        assert "app.kubernetes.io/managed-by" not in selector  # selectors stay minimal and immutable
    service = objs["Service/calc-gateway"]["spec"]
    assert service["selector"] == objs["Deployment/calc-gateway"]["spec"]["selector"]["matchLabels"]
    assert service["ports"] == [{"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}]


def test_owner_references_only_when_the_owner_uid_is_known(specs: Specs) -> None:
    for obj in children(specs).values():
        assert "ownerReferences" not in obj["metadata"]
    for obj in children(specs, owner_uid=UID).values():
        assert obj["metadata"]["ownerReferences"] == [
            {
                "apiVersion": "inharness.dev/v1alpha1",
                "kind": "TrainingRun",
                "name": "calc",
                "uid": UID,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]


def test_rendering_is_deterministic_and_the_token_only_touches_secret_and_pod_hashes(specs: Specs) -> None:
    a, b = children(specs, owner_uid=UID), children(specs, owner_uid=UID)
    assert yaml.safe_dump(a) == yaml.safe_dump(b)
    other = children(specs, owner_uid=UID, admin_token="another-token-abcdefgh")
    differ = {k for k in a if a[k] != other[k]}
    assert differ == {"Secret/calc-gateway", "Deployment/calc-gateway", "StatefulSet/calc-trainer"}
    for key in ("Deployment/calc-gateway", "StatefulSet/calc-trainer"):
        x, y = copy.deepcopy(a[key]), copy.deepcopy(other[key])
        for o in (x, y):
            o["spec"]["template"]["metadata"]["annotations"].pop(render.TOKEN_HASH_ANNOTATION)
        assert x == y, key


def test_the_secret_holds_the_token_and_reads_back(specs: Specs) -> None:
    secret = children(specs)["Secret/calc-gateway"]
    assert base64.b64decode(secret["data"]["admin-token"]).decode() == TOKEN
    assert render.admin_token_of(secret) == TOKEN
    assert render.admin_token_of(None) is None
    assert render.admin_token_of({"data": {}}) is None
    assert render.admin_token_of({"data": {"admin-token": "not base64!"}}) is None
    engine_key = base64.b64decode(secret["data"]["engine-api-key"]).decode()
    assert engine_key == render.engine_api_key_for(TOKEN) and len(engine_key) == 64
    assert engine_key != TOKEN and render.engine_api_key_for("another-token-abcdefgh") != engine_key
    assert len(render.new_admin_token()) >= 32 and render.new_admin_token() != render.new_admin_token()


def test_restricted_pod_security_on_every_pod_and_container(specs: Specs) -> None:
    for key, pod in pod_specs(children(specs)).items():
        assert pod["securityContext"]["runAsNonRoot"] is True, key
        assert pod["securityContext"]["runAsUser"] != 0
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert pod["automountServiceAccountToken"] is False
        for c in pod["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, key
            assert sc["capabilities"] == {"drop": ["ALL"]}
            assert sc["runAsNonRoot"] is True
            assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
        kinds = {next(k for k in v if k != "name") for v in pod["volumes"]}
        assert kinds <= {"configMap", "emptyDir", "persistentVolumeClaim", "secret", "projected"}


def test_gateway_runs_flags_the_gateway_accepts_with_the_token_from_the_secret(specs: Specs) -> None:
    c = container(children(specs), "Deployment/calc-gateway")
    assert c["command"] == ["inharness"] and c["args"][0] == "gateway"
    args = cli.parser().parse_args(c["args"])  # the real `inharness gateway` parser
    assert args.model == "/workspace/model"
    assert args.engines == ["http://calc-trainer-0.calc-trainer:8001"]
    assert args.store == f"sqlite:///{render.STORE_DIR}/gateway.db"
    assert (args.host, args.port) == ("0.0.0.0", 8000)
    assert args.served_model_name == "calc-policy"
    assert args.max_attempts == specs.rollout_pool.spec.max_attempts_per_rollout
    assert args.admin_token is None  # never on the command line, nor in an env var: in files
    assert args.admin_token_file == f"{render.SECRETS_DIR}/admin-token"
    assert args.engine_api_key_file == f"{render.SECRETS_DIR}/engine-api-key"
    assert {m["mountPath"]: m["name"] for m in c["volumeMounts"]}[render.STORE_DIR] == "store"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthz", "port": "http"}
    deployment = children(specs)["Deployment/calc-gateway"]["spec"]
    assert deployment["strategy"] == {"type": "Recreate"} and deployment["replicas"] == 1


def test_trainer_gets_gpus_shm_ray_ports_config_and_a_work_claim(specs: Specs) -> None:
    run = with_spec(specs, trainer={"gpus": 4, "shmSize": "32Gi", "image": "example.org/custom:1"})
    objs = children(specs, run)
    sts = objs["StatefulSet/calc-trainer"]["spec"]
    c = container(objs, "StatefulSet/calc-trainer")
    pod = sts["template"]["spec"]
    assert c["image"] == "example.org/custom:1"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "4"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "32Gi"}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert mounts["/dev/shm"] == "dshm" and mounts[render.CONFIG_DIR] == "config"
    assert volumes["config"]["configMap"]["name"] == "calc-config"
    assert {p["containerPort"] for p in c["ports"]} == {8001, 6379, 8265, 10001}
    assert [t["metadata"]["name"] for t in sts["volumeClaimTemplates"]] == ["work"]
    assert mounts[render.TRAINER_DIR] == "work"
    assert sts["serviceName"] == "calc-trainer"
    headless = objs["Service/calc-trainer"]["spec"]
    assert headless["clusterIP"] == "None" and headless["publishNotReadyAddresses"] is True
    assert {p["port"] for p in headless["ports"]} == {8001, 6379, 8265, 10001}
    env = env_of(c)
    assert env["INHARNESS_GATEWAY_URL"] == "http://calc-gateway:8000"
    assert env["INHARNESS_ENGINE_URL"] == "http://$(POD_NAME).calc-trainer:8001"


def test_a_cpu_trainer_asks_for_no_gpu(specs: Specs) -> None:
    objs = children(specs, with_spec(specs, trainer={"gpus": 0}))
    c = container(objs, "StatefulSet/calc-trainer")
    assert (
        "nvidia.com/gpu" not in str(c.get("resources"))
        and "tolerations" not in pod_specs(objs)["StatefulSet/calc-trainer"]
    )


def test_suspend_scales_both_to_zero_and_keeps_secret_config_and_claims(specs: Specs) -> None:
    objs = children(specs, with_spec(specs, suspend=True))
    assert objs["Deployment/calc-gateway"]["spec"]["replicas"] == 0
    assert objs["StatefulSet/calc-trainer"]["spec"]["replicas"] == 0
    assert {
        "Secret/calc-gateway",
        "ConfigMap/calc-config",
        "PersistentVolumeClaim/calc-gateway-store",
    } <= set(objs)
    assert (
        objs["StatefulSet/calc-trainer"]["spec"]["persistentVolumeClaimRetentionPolicy"]["whenScaled"]
        == "Retain"
    )
    resumed = children(specs)
    assert resumed["StatefulSet/calc-trainer"]["spec"]["replicas"] == 1
    # suspend only scales: the trainer's config (and so its pod template) is the same either way
    assert objs["ConfigMap/calc-config"] == resumed["ConfigMap/calc-config"]
    assert (
        objs["StatefulSet/calc-trainer"]["spec"]["template"]
        == resumed["StatefulSet/calc-trainer"]["spec"]["template"]
    )


def test_a_finished_run_keeps_its_gateway_and_gives_the_trainer_back(specs: Specs) -> None:
    objs = children(specs, finished=True)
    assert objs["Deployment/calc-gateway"]["spec"]["replicas"] == 1
    assert objs["StatefulSet/calc-trainer"]["spec"]["replicas"] == 0


def test_pod_overrides_are_applied_on_gateway_and_trainer(specs: Specs) -> None:
    pod = {
        "resources": {"requests": {"cpu": "2", "memory": "8Gi"}, "limits": {"memory": "16Gi"}},
        "nodeSelector": {"pool": "gpu-a100"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "rl", "effect": "NoSchedule"}],
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}
                    ]
                }
            }
        },
        "env": [{"name": "HOME", "value": "/home/rl"}, {"name": "EXTRA", "value": "1"}],
        "volumes": [{"name": "models", "persistentVolumeClaim": {"claimName": "models"}}],
        "volumeMounts": [{"name": "models", "mountPath": "/workspace/model", "readOnly": True}],
        "serviceAccountName": "rl-runner",
        "priorityClassName": "high",
        "imagePullSecrets": [{"name": "regcred"}],
    }
    objs = children(specs, with_spec(specs, gateway={"pod": pod}, trainer={"gpus": 1, "pod": pod}))
    for key in ("Deployment/calc-gateway", "StatefulSet/calc-trainer"):
        spec = pod_specs(objs)[key]
        c = container(objs, key)
        assert spec["nodeSelector"] == {"pool": "gpu-a100"}, key
        assert pod["tolerations"][0] in spec["tolerations"]
        assert spec["affinity"] == pod["affinity"]
        assert spec["serviceAccountName"] == "rl-runner" and spec["priorityClassName"] == "high"
        assert spec["imagePullSecrets"] == [{"name": "regcred"}]
        env = env_of(c)
        assert env["HOME"] == "/home/rl" and env["EXTRA"] == "1"
        assert [e["name"] for e in c["env"]].count("HOME") == 1
        assert {"name": "secrets", "mountPath": render.SECRETS_DIR, "readOnly": True} in c["volumeMounts"]
        assert c["resources"]["requests"] == {**c["resources"]["requests"], "cpu": "2", "memory": "8Gi"}
        assert c["resources"]["limits"]["memory"] == "16Gi"
        assert c["resources"]["limits"]["cpu"]  # the defaults not overridden stay
        assert {"name": "models", "mountPath": "/workspace/model", "readOnly": True} in c["volumeMounts"]
        assert {"name": "models", "persistentVolumeClaim": {"claimName": "models"}} in spec["volumes"]
        assert c["securityContext"]["allowPrivilegeEscalation"] is False  # not overridable
    assert container(objs, "StatefulSet/calc-trainer")["resources"]["limits"]["nvidia.com/gpu"] == "1"


POSTGRES_GATEWAY = {"replicas": 3, "store": {"urlSecret": {"name": "calc-db", "key": "url"}}}


def test_a_postgresql_store_comes_from_its_secret_as_env_with_replicas_and_no_claim(specs: Specs) -> None:
    objs = children(specs, with_spec(specs, gateway=POSTGRES_GATEWAY))
    assert "PersistentVolumeClaim/calc-gateway-store" not in objs
    c = container(objs, "Deployment/calc-gateway")
    assert env_of(c)[render.STORE_ENV] == {"secretKeyRef": {"name": "calc-db", "key": "url"}}
    assert cli.parser().parse_args(c["args"]).store is None  # the flag would win over the env var
    assert "store" not in {m["name"] for m in c["volumeMounts"]}
    assert "store" not in {v["name"] for v in pod_specs(objs)["Deployment/calc-gateway"]["volumes"]}
    deployment = objs["Deployment/calc-gateway"]["spec"]
    assert deployment["replicas"] == 3 and deployment["strategy"]["type"] == "RollingUpdate"
    suspended = children(specs, with_spec(specs, gateway=POSTGRES_GATEWAY, suspend=True))
    assert suspended["Deployment/calc-gateway"]["spec"]["replicas"] == 0


def test_the_gateway_keeps_the_bodies_the_spec_asks_for(specs: Specs) -> None:
    def bodies(**spec: Any) -> str:
        args = container(children(specs, with_spec(specs, **spec)), "Deployment/calc-gateway")["args"]
        return str(cli.parser().parse_args(args).bodies)

    assert bodies() == "full"
    assert bodies(gateway={"store": {"bodies": "none"}}) == "none"
    assert (
        bodies(gateway={**POSTGRES_GATEWAY, "store": {**POSTGRES_GATEWAY["store"], "bodies": "none"}})
        == "none"
    )


def test_user_store_and_work_volumes_replace_the_claims(specs: Specs) -> None:
    gateway = {"pod": {"volumes": [{"name": "store", "persistentVolumeClaim": {"claimName": "my-store"}}]}}
    trainer = {"gpus": 0, "pod": {"volumes": [{"name": "work", "emptyDir": {}}]}}
    objs = children(specs, with_spec(specs, gateway=gateway, trainer=trainer))
    assert "PersistentVolumeClaim/calc-gateway-store" not in objs
    gw_volumes = {v["name"]: v for v in pod_specs(objs)["Deployment/calc-gateway"]["volumes"]}
    assert gw_volumes["store"] == {"name": "store", "persistentVolumeClaim": {"claimName": "my-store"}}
    sts = objs["StatefulSet/calc-trainer"]["spec"]
    assert "volumeClaimTemplates" not in sts
    assert {"name": "work", "emptyDir": {}} in sts["template"]["spec"]["volumes"]


def test_the_config_map_is_a_spec_file_of_the_three_documents(specs: Specs, tmp_path: Path) -> None:
    text = children(specs)["ConfigMap/calc-config"]["data"]["run.yaml"]
    (tmp_path / "run.yaml").write_text(text)
    loaded = load_specs(tmp_path / "run.yaml", check_files=False)
    assert loaded.training_run.spec == specs.training_run.spec
    assert loaded.rollout_pool.spec == specs.rollout_pool.spec
    assert loaded.harness.spec == specs.harness.spec
    docs = list(yaml.safe_load_all(text))
    assert [d["kind"] for d in docs] == ["HarnessSpec", "RolloutPool", "TrainingRun"]
    assert "suspend" not in docs[2]["spec"] and "status" not in docs[2]
    # a spec change reaches the trainer's pod template through the config hash
    other = children(specs, with_spec(specs, steps=99))
    key = "StatefulSet/calc-trainer"
    hashes = [
        o[key]["spec"]["template"]["metadata"]["annotations"][render.CONFIG_HASH_ANNOTATION]
        for o in (children(specs), other)
    ]
    assert hashes[0] != hashes[1]


def test_settings_come_from_the_environment() -> None:
    settings = RenderSettings.from_env({"INHARNESS_GATEWAY_IMAGE": "a:1", "INHARNESS_TRAINER_IMAGE": "b:2"})
    assert (settings.gateway_image, settings.trainer_image) == ("a:1", "b:2")
    default = RenderSettings.from_env({})
    assert default.gateway_image.startswith("ghcr.io/inharness/inharness:")
    assert default.trainer_image.startswith("ghcr.io/inharness/trainer:")


@pytest.mark.parametrize("k8s_version", K8S_VERSIONS)
def test_every_rendered_object_is_valid_kubernetes(specs: Specs, k8s_version: str) -> None:
    variants = [
        children(specs, owner_uid=UID),
        children(
            specs, with_spec(specs, suspend=True, trainer={"gpus": 8, "shmSize": "64Gi"}), owner_uid=UID
        ),
        children(
            specs,
            with_spec(
                specs,
                gateway={"pod": {"volumes": [{"name": "store", "emptyDir": {}}], "serviceAccountName": "x"}},
                trainer={
                    "pod": {"env": [{"name": "A", "value": "b"}], "resources": {"limits": {"memory": "1Gi"}}}
                },
            ),
            settings=SETTINGS.model_copy(update={"storage_class": "fast"}),
        ),
        children(specs, with_spec(specs, trainer=VERL), owner_uid=UID),
        children(specs, with_spec(specs, gateway=POSTGRES_GATEWAY), owner_uid=UID),
    ]
    for objs in variants:
        for key, obj in objs.items():
            try:
                kubernetes_validate.validate(obj, k8s_version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(
                    f"{key} is not valid at Kubernetes {k8s_version}: {exc.message} at {list(exc.path)}"
                )


def test_render_command_prints_what_the_operator_renders(specs: Specs) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "inharness.cli", "operator", "render", str(EXAMPLE), "--admin-token", TOKEN],
        capture_output=True,
        text=True,
        check=True,
        env={
            "PATH": "/usr/bin:/bin",
            "INHARNESS_GATEWAY_IMAGE": SETTINGS.gateway_image,
            "INHARNESS_TRAINER_IMAGE": SETTINGS.trainer_image,
        },
    ).stdout
    printed = [d for d in yaml.safe_load_all(out) if d]
    assert printed == list(children(specs).values())
    assert out.startswith("# Rendered by `inharness operator render")


def test_render_command_refuses_a_bad_file_with_the_loader_message(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    text, replaced = re.subn(r"(?m)^  batchSize: \d+$", "  batchSize: 0", EXAMPLE.read_text())
    assert replaced == 1
    bad.write_text(text)
    r = subprocess.run(
        [sys.executable, "-m", "inharness.cli", "operator", "render", str(bad)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "spec.batchSize" in r.stderr and r.stdout == ""


# --- harness pods and Jobs (render/harness.py) ---------------------------------------------------------


def harness_objects(specs: Specs, **kubernetes: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the harness Pod, the harness Job) of one attempt of the example, with pool settings replaced."""
    pool = specs.rollout_pool.spec.model_copy(
        update={"kubernetes": specs.rollout_pool.spec.kubernetes.model_copy(update=kubernetes)}
    )
    ctx = harness.PodContext(
        "team", "calc", "calc-pool", UID, specs.harness.spec, pool.kubernetes, "http://calc-gateway:8000", 660
    )
    attempt = ClaimedAttempt(
        id="att-0123456789abcdef",
        rollout_id="r1",
        group_id="g",
        seq=0,
        task={"q": 1},
        token="k",
        lease_expires_at=0,
    )
    return harness.harness_pod(ctx, attempt, "b1"), harness.harness_job(ctx, attempt, "b1")


def test_a_harness_job_runs_the_harness_pod_once_with_a_backstop_deadline_and_ttl(specs: Specs) -> None:
    pod, job = harness_objects(specs, ttl_seconds_after_finished=60)
    spec = job["spec"]
    assert job["metadata"]["name"] == pod["metadata"]["name"] == "calc-pool-att-0123456789abcdef"
    assert job["metadata"]["labels"] == pod["metadata"]["labels"] == spec["template"]["metadata"]["labels"]
    assert job["metadata"]["ownerReferences"] == pod["metadata"]["ownerReferences"]
    assert spec["template"]["spec"] == pod["spec"]  # the same pod: one rendering, two wrappers
    assert spec["backoffLimit"] == 0 and "suspend" not in spec
    deadline = pod["spec"]["activeDeadlineSeconds"]
    k = specs.rollout_pool.spec.kubernetes
    assert (
        spec["activeDeadlineSeconds"]
        == deadline + k.unschedulable_grace_seconds + k.image_pull_grace_seconds + 30
    )
    assert spec["ttlSecondsAfterFinished"] == 60 + 660  # the pool's TTL and the lease
    assert [r["action"] for r in spec["podFailurePolicy"]["rules"]] == ["FailJob", "FailJob"]


def test_a_queued_harness_job_is_created_suspended_with_the_queue_label_on_the_job_only(specs: Specs) -> None:
    pod, job = harness_objects(specs, queue_name="team-a")
    assert pod["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"  # Kueue's pod integration
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"  # Kueue's Job integration
    assert "kueue.x-k8s.io/queue-name" not in job["spec"]["template"]["metadata"]["labels"]
    assert job["spec"]["suspend"] is True  # Kueue resumes it on admission


def test_a_job_name_fits_a_label_value_however_long_the_pool_name() -> None:
    name = harness.job_name("p" * 63, "att-0123456789abcdef")
    assert len(name) == 63 and name.endswith("-att-0123456789abcdef")


@pytest.mark.parametrize("k8s_version", K8S_VERSIONS)
def test_harness_pods_and_jobs_are_valid_kubernetes(specs: Specs, k8s_version: str) -> None:
    for settings in ({}, {"queue_name": "team-a"}):
        for obj in harness_objects(specs, **settings):
            try:
                kubernetes_validate.validate(obj, k8s_version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(
                    f"{obj['kind']} is not valid at Kubernetes {k8s_version}: "
                    f"{exc.message} at {list(exc.path)}"
                )


# --- secrets as files, resources, probes, read-only roots ---------------------------------------------


def test_the_run_secret_reaches_gateway_and_trainer_as_files_only(specs: Specs) -> None:
    objs = children(specs)
    for key in ("Deployment/calc-gateway", "StatefulSet/calc-trainer"):
        pod = pod_specs(objs)[key]
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["secrets"]["secret"] == {"secretName": "calc-gateway", "defaultMode": 0o440}, key
        c = container(objs, key)
        assert {"name": "secrets", "mountPath": render.SECRETS_DIR, "readOnly": True} in c["volumeMounts"]
        assert not [e for e in c["env"] if "secretKeyRef" in e.get("valueFrom", {})], key
    args = cli.parser().parse_args(container(objs, "StatefulSet/calc-trainer")["args"])
    assert args.admin_token_file == f"{render.SECRETS_DIR}/admin-token"
    assert args.engine_api_key_file == f"{render.SECRETS_DIR}/engine-api-key"


def test_gateway_and_trainer_have_read_only_roots_and_writable_volumes(specs: Specs) -> None:
    objs = children(specs)
    for key in ("Deployment/calc-gateway", "StatefulSet/calc-trainer"):
        c = container(objs, key)
        assert c["securityContext"]["readOnlyRootFilesystem"] is True, key
        assert env_of(c)["HOME"] == "/tmp"
        mounts = {m["mountPath"] for m in c["volumeMounts"] if not m.get("readOnly")}
        assert "/tmp" in mounts and (render.STORE_DIR in mounts or render.TRAINER_DIR in mounts)
    pod, _ = harness_objects(specs)
    # an unmodified agent may write wherever its image lets it (checkov-skips.yaml: CKV_K8S_22)
    assert "readOnlyRootFilesystem" not in pod["spec"]["containers"][0]["securityContext"]


def test_the_trainer_is_probed_for_liveness_after_a_long_startup(specs: Specs) -> None:
    c = container(children(specs), "StatefulSet/calc-trainer")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "engine"}, probe
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 1800  # gateway wait and model load


def test_every_child_has_cpu_and_memory_requests_and_limits_by_default(specs: Specs) -> None:
    objs = children(specs, with_spec(specs, trainer={"gpus": 0}))
    assert container(objs, "Deployment/calc-gateway")["resources"] == {
        "requests": {"cpu": "500m", "memory": "1Gi"},
        "limits": {"cpu": "2", "memory": "4Gi"},
    }
    assert container(objs, "StatefulSet/calc-trainer")["resources"] == {
        "requests": {"cpu": "1", "memory": "4Gi"},
        "limits": {"cpu": "4", "memory": "16Gi"},
    }
    gpu = container(children(specs, with_spec(specs, trainer={"gpus": 2})), "StatefulSet/calc-trainer")
    assert gpu["resources"] == {
        "requests": {"cpu": "8", "memory": "64Gi"},
        "limits": {"cpu": "16", "memory": "128Gi", "nvidia.com/gpu": "2"},
    }
    pod, job = harness_objects(specs)
    for spec in (pod["spec"], job["spec"]["template"]["spec"]):
        assert spec["containers"][0]["resources"] == {
            "requests": {"cpu": "250m", "memory": "512Mi"},
            "limits": {"cpu": "2", "memory": "4Gi"},
        }


def test_a_request_above_a_default_limit_raises_that_limit(specs: Specs) -> None:
    pod = {"resources": {"requests": {"cpu": "6", "memory": "2Gi"}}}
    c = container(children(specs, with_spec(specs, gateway={"pod": pod})), "Deployment/calc-gateway")
    assert c["resources"] == {
        "requests": {"cpu": "6", "memory": "2Gi"},
        "limits": {"cpu": "6", "memory": "4Gi"},  # cpu raised to the request, memory's default kept
    }
    own = {"resources": {"requests": {"cpu": "6"}, "limits": {"cpu": "3"}}}  # the user's own: as written
    c = container(children(specs, with_spec(specs, gateway={"pod": own})), "Deployment/calc-gateway")
    assert c["resources"]["limits"]["cpu"] == "3"


def test_harness_resources_come_from_the_harness_spec_then_the_pool(specs: Specs) -> None:
    own = {"requests": {"memory": "8Gi"}, "limits": {"cpu": "4"}}
    doc = specs.harness.spec.model_dump(mode="json", by_alias=True)
    plain = HarnessSpecSpec.model_validate({**doc, "resources": own})
    graded = HarnessSpecSpec.model_validate(
        {**doc, "resources": own, "outcome": {"type": "grader", "grader": {"command": ["grade"]}}}
    )
    attempt = ClaimedAttempt(
        id="att-1", rollout_id="r1", group_id="g", seq=0, task={}, token="k", lease_expires_at=0
    )

    def containers(spec: HarnessSpecSpec, pool_pod: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        pool = specs.rollout_pool.spec.kubernetes.model_copy(
            update={"pod": PodOverrides.model_validate(pool_pod) if pool_pod else None}
        )
        ctx = harness.PodContext("team", "calc", "calc-pool", UID, spec, pool, "http://calc-gateway:8000")
        pod = harness.harness_pod_spec(ctx, attempt, "b1")
        return [*pod.get("initContainers", []), *pod["containers"]]

    for spec in (plain, graded):
        for c in containers(spec):
            assert c["resources"] == {
                "requests": {"cpu": "250m", "memory": "8Gi"},
                "limits": {"cpu": "4", "memory": "8Gi"},  # memory raised to the HarnessSpec's request
            }, c["name"]
        for c in containers(spec, {"resources": {"requests": {"cpu": "1"}, "limits": {"memory": "12Gi"}}}):
            assert c["resources"] == {
                "requests": {"cpu": "1", "memory": "8Gi"},
                "limits": {"cpu": "4", "memory": "12Gi"},  # the pool's over the HarnessSpec's
            }, c["name"]


@pytest.mark.parametrize(
    ("quantity", "value"),
    [
        ("500m", "0.5"),
        ("2", "2"),
        (3, "3"),
        ("1Gi", str(2**30)),
        ("1G", "1e9"),
        ("1e3", "1000"),
        ("2E", "2e18"),
    ],
)
def test_quantities_compare_as_kubernetes_reads_them(quantity: str | int, value: str) -> None:
    from decimal import Decimal

    assert render.pods.quantity_value(quantity) == Decimal(value)


# --- the run's NetworkPolicies -------------------------------------------------------------------------


def policies(specs: Specs, **settings: Any) -> dict[str, dict[str, Any]]:
    objs = children(
        specs, owner_uid=UID, settings=SETTINGS.model_copy(update={"namespace": "team-a", **settings})
    )
    return {k.removeprefix("NetworkPolicy/"): o for k, o in objs.items() if k.startswith("NetworkPolicy/")}


def run_pods(component: str) -> dict[str, Any]:
    return {
        "podSelector": {
            "matchLabels": {
                "app.kubernetes.io/name": "inharness",
                "app.kubernetes.io/instance": "calc",
                "app.kubernetes.io/component": component,
            }
        }
    }


def test_network_policies_live_beside_the_run_and_are_owned_by_it(specs: Specs) -> None:
    found = policies(specs)
    assert set(found) == {"calc-trainer", "calc-gateway", "calc-harness"}
    for policy in found.values():
        assert policy["metadata"]["namespace"] == "team-a"
        assert policy["metadata"]["ownerReferences"][0]["kind"] == "TrainingRun"
        assert policy["metadata"]["ownerReferences"][0]["uid"] == UID


def test_the_trainer_accepts_the_engine_port_from_the_run_gateway_and_its_own_pods_only(specs: Specs) -> None:
    spec = policies(specs)["calc-trainer"]["spec"]
    assert spec["podSelector"] == run_pods("trainer")["podSelector"]
    assert spec["policyTypes"] == ["Ingress"]
    assert spec["ingress"] == [
        {"from": [run_pods("gateway")], "ports": [{"protocol": "TCP", "port": 8001}]},
        {"from": [run_pods("trainer")]},  # Ray between the run's trainer pods, on the ports Ray picks
    ]


def test_with_vllm_the_gateway_reaches_the_trainer_pods_on_any_port(specs: Specs) -> None:
    vllm = {"engine": "verl", "gpus": 1, "inference": "vllm"}
    with_vllm = with_spec(specs, trainer=vllm, scheduling={"mode": "collocated-async", "maxStaleness": 1})
    objs = children(specs, with_vllm, settings=SETTINGS.model_copy(update={"namespace": "team-a"}))
    spec = objs["NetworkPolicy/calc-trainer"]["spec"]
    assert spec["ingress"] == [
        {"from": [run_pods("gateway")]},  # verl's vLLM servers listen on ports they pick at start
        {"from": [run_pods("trainer")]},
    ]


def test_the_gateway_accepts_the_run_harness_trainer_and_operator(specs: Specs) -> None:
    extra = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    spec = policies(specs, operator_namespace="inharness-system", extra_gateway_ingress=[extra])[
        "calc-gateway"
    ]["spec"]
    assert spec["podSelector"] == run_pods("gateway")["podSelector"]
    [rule] = spec["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 8000}]
    operator = {
        "podSelector": {
            "matchLabels": {"app.kubernetes.io/name": "inharness", "app.kubernetes.io/component": "operator"}
        },
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "inharness-system"}},
    }
    assert rule["from"] == [run_pods("harness"), run_pods("trainer"), operator, extra]


def test_harness_pods_reach_only_the_run_gateway_and_dns(specs: Specs) -> None:
    spec = policies(specs, dns_pod_labels={})["calc-harness"]["spec"]
    assert spec["podSelector"] == run_pods("harness")["podSelector"]
    assert spec["policyTypes"] == ["Egress"]
    dns = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}}}
    assert spec["egress"] == [
        {"to": [run_pods("gateway")], "ports": [{"protocol": "TCP", "port": 8000}]},
        {"to": [dns], "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]},
    ]
    pod, _ = harness_objects(specs)  # the policy selects the run's harness pods
    labels = pod["metadata"]["labels"]
    assert spec["podSelector"]["matchLabels"].items() <= labels.items()


def test_network_policy_settings_come_from_the_chart_env() -> None:
    settings = RenderSettings.from_env(
        {
            "INHARNESS_NETWORK_POLICIES": "false",
            "INHARNESS_OPERATOR_NAMESPACE": "ops",
            "INHARNESS_OPERATOR_POD_LABELS": '{"app": "op"}',
            "INHARNESS_DNS_NAMESPACE": "dns",
            "INHARNESS_DNS_POD_LABELS": "{}",
            "INHARNESS_EXTRA_GATEWAY_INGRESS": '[{"ipBlock": {"cidr": "10.0.0.0/8"}}]',
        }
    )
    assert settings.network_policies is False and settings.operator_namespace == "ops"
    assert settings.operator_pod_labels == {"app": "op"} and settings.dns_namespace == "dns"
    assert settings.dns_pod_labels == {} and settings.extra_gateway_ingress == [
        {"ipBlock": {"cidr": "10.0.0.0/8"}}
    ]
    default = RenderSettings.from_env({})
    assert default.network_policies is True and default.operator_namespace is None


# --- engine verl: the trainer StatefulSet is one Ray cluster -----------------------------------------

VERL = {"engine": "verl", "nodes": 3, "gpus": 8, "shmSize": "64Gi"}


def test_a_verl_trainer_is_one_ray_cluster_of_its_nodes(specs: Specs) -> None:
    objs = children(specs, with_spec(specs, trainer=VERL))
    sts = objs["StatefulSet/calc-trainer"]["spec"]
    assert sts["replicas"] == 3 and sts["podManagementPolicy"] == "Parallel"
    c = container(objs, "StatefulSet/calc-trainer")
    args = cli.parser().parse_args(c["args"])
    # every pod runs the same command; `inharness train` makes pod 0 the head by its ordinal
    assert args.ray_nodes == 3 and args.ray_gpus == 8
    assert args.ray_head_address == "calc-trainer-0.calc-trainer:6379"
    assert args.ray_node_ip == "$(POD_IP)"  # expanded by the kubelet from the env below
    assert args.ray_cpus == 64  # the container's CPU limit: 8 per GPU
    assert args.ray_object_store_memory == 32 * 1024**3  # half of the 64Gi /dev/shm
    env = env_of(c)
    assert env["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env["POD_INDEX"] == {"fieldRef": {"fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}}
    assert (
        env["RAY_AUTH_MODE"] == "token"
        and env["RAY_AUTH_TOKEN_PATH"] == f"{render.SECRETS_DIR}/engine-api-key"
    )
    assert {p["name"]: p["containerPort"] for p in c["ports"]}["engine"] == 8001  # pod 0's engine stays
    # the head may wait for its nodes besides the 30 minutes of a single trainer's start
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 1800 + 1800
    # workers find the head through the headless Service before the head is Ready
    svc = objs["Service/calc-trainer"]["spec"]
    assert sts["serviceName"] == "calc-trainer" and svc["clusterIP"] == "None"
    assert svc["publishNotReadyAddresses"] is True and 6379 in {p["port"] for p in svc["ports"]}
    assert svc["selector"].items() <= sts["template"]["metadata"]["labels"].items()
    # suspend and the end of the run give every node back
    assert (
        children(specs, with_spec(specs, trainer=VERL, suspend=True))["StatefulSet/calc-trainer"]["spec"][
            "replicas"
        ]
        == 0
    )
    assert (
        children(specs, with_spec(specs, trainer=VERL), finished=True)["StatefulSet/calc-trainer"]["spec"][
            "replicas"
        ]
        == 0
    )


def test_ray_cpus_follow_the_pod_overrides_and_a_cpu_run(specs: Specs) -> None:
    trainer = {**VERL, "gpus": 0, "pod": {"resources": {"limits": {"cpu": "6500m"}}}}
    c = container(children(specs, with_spec(specs, trainer=trainer)), "StatefulSet/calc-trainer")
    args = cli.parser().parse_args(c["args"])
    assert (args.ray_cpus, args.ray_gpus) == (7, 0)  # rounded up, as KubeRay does
    small = {**VERL, "shmSize": "64Mi"}
    c = container(children(specs, with_spec(specs, trainer=small)), "StatefulSet/calc-trainer")
    assert cli.parser().parse_args(c["args"]).ray_object_store_memory == 75 * 1024**2  # Ray's minimum


def test_a_torch_trainer_stays_one_pod_without_ray(specs: Specs) -> None:
    objs = children(specs)
    assert objs["StatefulSet/calc-trainer"]["spec"]["replicas"] == 1
    c = container(objs, "StatefulSet/calc-trainer")
    assert c["args"] == ["train", "--config", render.CONFIG_PATH, "--out", render.TRAINER_DIR, *SECRET_ARGS]
    assert not {"POD_IP", "POD_INDEX", "RAY_AUTH_MODE"} & set(env_of(c))
    assert c["startupProbe"]["failureThreshold"] * c["startupProbe"]["periodSeconds"] == 1800


SECRET_ARGS = [
    "--admin-token-file",
    f"{render.SECRETS_DIR}/admin-token",
    "--engine-api-key-file",
    f"{render.SECRETS_DIR}/engine-api-key",
]


def test_trainer_pods_reach_each_other_on_any_port_and_protocol(specs: Specs) -> None:
    """Ray's node manager, object manager and workers, NCCL and vLLM listen on ports they pick at start:
    the rule between the run's trainer pods names no port, so it allows every port and protocol."""
    objs = children(specs, with_spec(specs, trainer=VERL), owner_uid=UID)
    ingress = objs["NetworkPolicy/calc-trainer"]["spec"]["ingress"]
    [between] = [r for r in ingress if r["from"] == [run_pods("trainer")]]
    assert "ports" not in between
    labels = objs["StatefulSet/calc-trainer"]["spec"]["template"]["metadata"]["labels"]
    policy = objs["NetworkPolicy/calc-trainer"]["spec"]["podSelector"]["matchLabels"]
    assert policy.items() <= labels.items()  # the policy selects the trainer pods it is about...
    assert run_pods("trainer")["podSelector"]["matchLabels"].items() <= labels.items()  # ...and admits them
