"""The Helm chart with the real helm binary: lint, render with each kind of values, validate every
object against Kubernetes' own schemas, and check what the chart promises (restricted pods,
least-privilege RBAC covering what the operator calls, NetworkPolicies, the values schema)."""

import ast
from collections.abc import Iterable
from typing import Any

import pytest
import yaml
from manifest_support import (
    CHART,
    CHART_VARIANTS,
    HELM,
    K8S_VERSIONS,
    NAMESPACE,
    RELEASE,
    ROOT,
    Obj,
    helm_template,
    key,
    need_binaries,
    of_kind,
    one,
    pod_templates,
    project_version,
    run,
    selects,
    validate_all,
)

from inharness.operator import render
from inharness.operator.specfile import load_specs

FULLNAME = f"{RELEASE}-inharness"
EXAMPLE = ROOT / "examples" / "calc" / "trainingrun.yaml"
SETTINGS = render.RenderSettings(gateway_image="gw:1", trainer_image="tr:1")


def rendered(variant: str, *extra: str) -> list[Obj]:
    """The chart's templates with a variant's values (the CRDs, the same for all, are checked apart)."""
    return helm_template(*CHART_VARIANTS[variant], *extra)


# --- chart metadata and lint -------------------------------------------------------------------------


def test_chart_claims_kubernetes_1_29_and_the_projects_version() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text(encoding="utf-8"))
    assert chart["apiVersion"] == "v2"
    assert chart["kubeVersion"] == ">=1.29.0-0"
    assert chart["appVersion"] == project_version()
    assert chart["version"] == project_version()


@pytest.mark.parametrize("variant", sorted(CHART_VARIANTS))
def test_helm_lint_strict_passes(variant: str) -> None:
    need_binaries()
    out = run([HELM, "lint", "--strict", CHART, *CHART_VARIANTS[variant]])
    assert "1 chart(s) linted, 0 chart(s) failed" in out.stdout


def test_chart_ships_the_generated_crds() -> None:
    objs = helm_template("--include-crds")
    crds = {o["metadata"]["name"] for o in of_kind(objs, "CustomResourceDefinition")}
    assert crds == {f"{p}.inharness.dev" for p in ("trainingruns", "rolloutpools", "harnessspecs")}
    for name in crds:
        assert (CHART / "crds" / f"{name}.yaml").read_text() == (ROOT / "crds" / f"{name}.yaml").read_text()
    for version in K8S_VERSIONS:
        crd_objs = of_kind(objs, "CustomResourceDefinition")
        assert not validate_all(crd_objs, version), "\n".join(validate_all(crd_objs, version))


# --- every object is valid Kubernetes ----------------------------------------------------------------


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("variant", sorted(CHART_VARIANTS))
def test_every_rendered_object_is_valid_at_the_claimed_kubernetes_versions(
    variant: str, version: str
) -> None:
    objs = rendered(variant)
    assert not validate_all(objs, version), "\n".join(validate_all(objs, version))


def test_service_monitor_is_rendered_only_when_enabled_and_selects_the_metrics_service() -> None:
    assert not of_kind(rendered("default"), "ServiceMonitor")
    objs = rendered("service-monitor")
    monitor, service = one(objs, "ServiceMonitor"), one(objs, "Service", f"{FULLNAME}-metrics")
    # Not checked by kubernetes-validate (a prometheus-operator CRD): its selector and port are checked here.
    assert selects(monitor["spec"]["selector"], service["metadata"]["labels"])
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    [endpoint] = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert endpoint["path"] == "/metrics"


def test_service_monitor_without_the_metrics_service_is_refused_with_a_reason() -> None:
    need_binaries()
    out = run(
        [
            HELM,
            "template",
            "x",
            CHART,
            "--set",
            "serviceMonitor.enabled=true",
            "--set",
            "metrics.service.enabled=false",
        ],
        check=False,
    )
    assert out.returncode != 0
    assert "serviceMonitor.enabled needs metrics.service.enabled" in out.stderr


# --- the operator Deployment --------------------------------------------------------------------------


def operator_container(objs: list[Obj]) -> Obj:
    deployment = one(objs, "Deployment", FULLNAME)
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    return container


def env_of(container: Obj) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container["env"]}


def test_operator_runs_one_replica_recreated_watching_every_namespace_by_default() -> None:
    objs = rendered("default")
    deployment = one(objs, "Deployment", FULLNAME)
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    container = operator_container(objs)
    assert container["image"] == f"ghcr.io/inharness/inharness:{project_version()}"
    assert container["command"] == ["inharness"]
    assert container["args"][:3] == ["operator", "run", "--all-namespaces"]
    assert "--namespace" not in container["args"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"metrics": 8080, "healthz": 8081}
    for kind in ("livenessProbe", "readinessProbe"):
        probe = container[kind]["httpGet"]
        assert (probe["path"], ports[probe["port"]]) == ("/healthz", 8081), kind
    resources = container["resources"]
    assert set(resources["requests"]) == set(resources["limits"]) == {"cpu", "memory"}


def test_operator_gets_the_children_settings_as_the_env_vars_it_reads() -> None:
    env = env_of(operator_container(rendered("default")))
    version = project_version()
    assert env["INHARNESS_GATEWAY_IMAGE"] == f"ghcr.io/inharness/inharness:{version}"
    assert env["INHARNESS_TRAINER_IMAGE"] == f"ghcr.io/inharness/trainer:{version}"
    assert env["INHARNESS_GATEWAY_STORE_SIZE"] == "1Gi"
    assert env["INHARNESS_TRAINER_STORAGE_SIZE"] == "20Gi"
    assert "INHARNESS_STORAGE_CLASS" not in env  # the cluster default
    # The operator reads them with RenderSettings.from_env: the chart's values reach the children.
    settings = render.RenderSettings.from_env(env)
    assert settings.gateway_image == env["INHARNESS_GATEWAY_IMAGE"]
    assert settings.trainer_image == env["INHARNESS_TRAINER_IMAGE"]

    custom = env_of(
        operator_container(
            helm_template(
                "--set",
                "children.storageClass=fast",
                "--set",
                "children.trainerImage=reg/t:1",
                "--set",
                "children.gatewayStoreSize=5Gi",
            )
        )
    )
    settings = render.RenderSettings.from_env(custom)
    assert (settings.storage_class, settings.trainer_image, settings.gateway_store_size) == (
        "fast",
        "reg/t:1",
        "5Gi",
    )


def test_namespaced_install_watches_exactly_its_namespaces_with_a_role_in_each() -> None:
    objs = rendered("namespaced")
    args = operator_container(objs)["args"]
    assert "--all-namespaces" not in args
    assert [args[i + 1] for i, a in enumerate(args) if a == "--namespace"] == ["team-a", "team-b"]
    assert not of_kind(objs, "ClusterRole") and not of_kind(objs, "ClusterRoleBinding")
    roles = {o["metadata"]["namespace"]: o for o in of_kind(objs, "Role")}
    bindings = {o["metadata"]["namespace"]: o for o in of_kind(objs, "RoleBinding")}
    assert set(roles) == set(bindings) == {"team-a", "team-b"}
    for ns, binding in bindings.items():
        assert binding["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": FULLNAME,
        }
        assert roles[ns]["metadata"]["name"] == FULLNAME
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": FULLNAME, "namespace": NAMESPACE}]


def test_namespaced_install_without_watch_namespaces_watches_the_release_namespace() -> None:
    objs = helm_template("--set", "rbac.namespaced=true")
    args = operator_container(objs)["args"]
    assert args[2:4] == ["--namespace", NAMESPACE]
    assert [o["metadata"]["namespace"] for o in of_kind(objs, "Role")] == [NAMESPACE]


def test_watch_namespaces_with_cluster_rbac_pass_namespace_flags() -> None:
    objs = helm_template("--set", "watchNamespaces={ml}")
    assert operator_container(objs)["args"][2:4] == ["--namespace", "ml"]
    assert len(of_kind(objs, "ClusterRole")) == 1 and not of_kind(objs, "Role")


def test_kind_values_use_the_locally_loaded_images_and_never_pull() -> None:
    container = operator_container(rendered("kind"))
    assert container["image"] == "ghcr.io/inharness/inharness:dev"
    assert container["imagePullPolicy"] == "Never"
    env = env_of(container)
    assert (
        env["INHARNESS_GATEWAY_IMAGE"]
        == env["INHARNESS_TRAINER_IMAGE"]
        == "ghcr.io/inharness/calc-harness:dev"
    )


# --- pod security -----------------------------------------------------------------------------------

# Pod Security Standards, "restricted" (kubernetes.io/docs/concepts/security/pod-security-standards).
RESTRICTED_VOLUME_TYPES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}


def restricted_violations(where: str, pod: Obj) -> list[str]:
    bad = []
    psc = pod.get("securityContext") or {}
    for host in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(host):
            bad.append(f"{where}: {host}")
    for volume in pod.get("volumes") or []:
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUME_TYPES:
            bad.append(f"{where}: volume {volume['name']} of type {kinds}")
    for c in [*(pod.get("initContainers") or []), *pod["containers"]]:
        csc, name = c.get("securityContext") or {}, f"{where} container {c['name']}"
        if csc.get("privileged"):
            bad.append(f"{name}: privileged")
        if csc.get("allowPrivilegeEscalation") is not False:
            bad.append(f"{name}: allowPrivilegeEscalation is not false")
        caps = csc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []) or set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            bad.append(f"{name}: capabilities {caps}")
        if csc.get("runAsNonRoot", psc.get("runAsNonRoot")) is not True:
            bad.append(f"{name}: runAsNonRoot is not true")
        if csc.get("runAsUser", psc.get("runAsUser")) == 0:
            bad.append(f"{name}: runAsUser 0")
        seccomp = (csc.get("seccompProfile") or psc.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            bad.append(f"{name}: seccompProfile {seccomp}")
        for port in c.get("ports") or []:
            if port.get("hostPort"):
                bad.append(f"{name}: hostPort")
    return bad


@pytest.mark.parametrize("variant", sorted(CHART_VARIANTS))
def test_every_pod_template_is_restricted_with_a_read_only_root(variant: str) -> None:
    templates = pod_templates(rendered(variant))
    assert templates, "no pod template rendered"
    bad = [v for where, pod in templates for v in restricted_violations(where, pod)]
    assert not bad, "\n".join(bad)
    for where, pod in templates:
        assert pod["securityContext"]["runAsUser"] == pod["securityContext"]["fsGroup"] == 1000, where
        for c in pod["containers"]:
            assert c["securityContext"]["readOnlyRootFilesystem"] is True, f"{where} {c['name']}"
            assert "/tmp" in {m["mountPath"] for m in c.get("volumeMounts") or []}, (
                f"{where}: no writable /tmp"
            )


def test_the_restricted_check_catches_a_violation() -> None:
    where, pod = pod_templates(rendered("default"))[0]
    pod["containers"][0]["securityContext"]["allowPrivilegeEscalation"] = True
    pod["volumes"].append({"name": "host", "hostPath": {"path": "/"}})
    assert len(restricted_violations(where, pod)) == 2


# --- RBAC -------------------------------------------------------------------------------------------

# What the operator does with the API, after docs/operator.md ("RBAC the operator needs") and
# docs/rollouts.md ("RBAC"): (API group, resource, verbs). The rendered rules must grant exactly this.
OPERATOR_NEEDS: list[tuple[str, str, tuple[str, ...]]] = [
    ("inharness.dev", "trainingruns", ("get", "list", "watch", "patch")),
    ("inharness.dev", "rolloutpools", ("get", "list", "watch", "patch")),
    ("inharness.dev", "harnessspecs", ("get", "list", "watch", "patch")),
    ("inharness.dev", "trainingruns/status", ("patch",)),
    ("inharness.dev", "rolloutpools/status", ("patch",)),
    ("inharness.dev", "trainingruns/finalizers", ("update",)),
    ("inharness.dev", "rolloutpools/finalizers", ("update",)),
    ("", "secrets", ("get", "list", "create", "patch", "delete")),
    ("", "configmaps", ("get", "list", "create", "patch", "delete")),
    ("", "services", ("get", "create", "patch")),
    ("", "persistentvolumeclaims", ("get", "create", "patch")),
    ("apps", "deployments", ("get", "create", "patch")),
    ("apps", "statefulsets", ("get", "create", "patch")),
    ("networking.k8s.io", "networkpolicies", ("get", "create", "patch")),
    ("", "pods", ("get", "list", "watch", "create", "delete")),
    ("batch", "jobs", ("list", "watch", "create", "delete")),
    ("", "events", ("create", "patch")),
    ("events.k8s.io", "events", ("create", "patch")),
]
NEEDED = {(g, r, v) for g, r, verbs in OPERATOR_NEEDS for v in verbs}


def granted(rules: Iterable[Obj]) -> set[tuple[str, str, str]]:
    return {
        (g, r, v)
        for rule in rules
        for g in rule.get("apiGroups") or []
        for r in rule.get("resources") or []
        for v in rule.get("verbs") or []
    }


@pytest.mark.parametrize("variant", ["default", "namespaced"])
def test_rbac_grants_exactly_what_the_operator_needs_without_wildcards(variant: str) -> None:
    objs = rendered(variant)
    roles = of_kind(objs, "ClusterRole" if variant == "default" else "Role")
    assert roles
    for role in roles:
        for rule in role["rules"]:
            for field in ("apiGroups", "resources", "verbs"):
                assert "*" not in rule.get(field, []), f"{key(role)}: wildcard in {field}: {rule}"
            assert "resourceNames" not in rule and "nonResourceURLs" not in rule
        have = granted(role["rules"])
        assert not NEEDED - have, f"{key(role)} misses {sorted(NEEDED - have)}"
        assert not have - NEEDED, f"{key(role)} grants more than needed: {sorted(have - NEEDED)}"


VERBS = {"get": ("get",), "list": ("list",), "list_with_version": ("list",), "create": ("create",)}
VERBS |= {"patch": ("patch",), "delete": ("delete",), "watch": ("list", "watch")}


WORKLOADS = ("PODS", "JOBS")
"""What a harness attempt runs as (RolloutPool spec.kubernetes.workload): the rollout backend calls
the API on either through a variable, so its variable-resource calls count for both."""


def kube_calls_with_a_constant_resource() -> set[tuple[str, str, str]]:
    """(group, resource[/subresource], verb) of every `kube.<verb>(CONSTANT, ...)` in the operator's
    code, the constants read from kube.py; in the Kubernetes rollout backend a call on a variable
    resource counts for every workload kind. Other calls with a variable resource (the generic apply
    of a run's children) are covered by the test after this one."""
    from inharness.operator import kube

    constants = {n: v for n, v in vars(kube).items() if isinstance(v, kube.Resource)}
    backend = ROOT / "operator" / "inharness" / "operator" / "rollouts" / "kubernetes.py"
    found = set()
    for path in (ROOT / "operator" / "inharness" / "operator").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            target = node.func.value
            on_kube = (isinstance(target, ast.Name) and target.id == "kube") or (
                isinstance(target, ast.Attribute) and target.attr == "kube"
            )
            if not on_kube or node.func.attr not in VERBS or not node.args:
                continue
            arg = node.args[0]
            if isinstance(arg, ast.Name) and arg.id in constants:
                res = constants[arg.id]
                sub = next((k.value for k in node.keywords if k.arg == "subresource"), None)
                name = res.plural if sub is None else f"{res.plural}/{ast.literal_eval(sub)}"
                found |= {(res.group, name, v) for v in VERBS[node.func.attr]}
            elif path == backend:
                workloads = [constants[w] for w in WORKLOADS]
                found |= {(r.group, r.plural, v) for r in workloads for v in VERBS[node.func.attr]}
    return found


def test_rbac_table_covers_every_kube_call_the_operator_code_makes() -> None:
    calls = kube_calls_with_a_constant_resource()
    assert ("inharness.dev", "trainingruns/status", "patch") in calls  # the scan does find calls
    assert {("", "pods", "watch"), ("batch", "jobs", "create")} <= calls
    assert not calls - NEEDED, (
        f"the operator calls the API for {sorted(calls - NEEDED)}: add them to the chart"
    )


def test_rbac_table_covers_creating_and_patching_every_child_the_operator_renders() -> None:
    from inharness.operator.trainingruns import RESOURCES  # the API resource of each kind it applies

    children = render.render_children(*example_specs(), settings=SETTINGS, admin_token="t")
    assert "NetworkPolicy" in {c["kind"] for c in children}
    for child in children:
        group = child["apiVersion"].rpartition("/")[0]
        res = RESOURCES[child["kind"]]
        assert res.api_version == child["apiVersion"], child["kind"]
        for verb in ("get", "create", "patch"):
            assert (group, res.plural, verb) in NEEDED, f"{child['kind']}: {verb}"


def example_specs() -> tuple[Any, ...]:
    loaded = load_specs(EXAMPLE, check_files=False)
    return loaded.training_run, loaded.rollout_pool, loaded.harness


# --- values.schema.json --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--set", "replicaCount=foo"), "at '/replicaCount': got string, want integer"),
        (("--set", "replicaCount=2"), "at '/replicaCount'"),
        (("--set", "bogus=1"), "additional properties 'bogus' not allowed"),
        (
            ("--set", "networkPolicy.bogus=1"),
            "at '/networkPolicy': additional properties 'bogus' not allowed",
        ),
        (("--set", "image.pullPolicy=Sometimes"), "at '/image/pullPolicy'"),
        (("--set", "watchNamespaces={Not_A_Namespace}"), "at '/watchNamespaces/0'"),
        (("--set", "children.trainerStorageSize=lots"), "at '/children/trainerStorageSize'"),
    ],
)
def test_values_schema_refuses_a_bad_value_with_a_readable_message(
    args: tuple[str, ...], message: str
) -> None:
    need_binaries()
    out = run([HELM, "template", "x", CHART, *args], check=False)
    assert out.returncode != 0, f"{args} was accepted"
    assert "values don't meet the specifications of the schema" in out.stderr
    assert message in out.stderr, out.stderr


def test_values_yaml_passes_its_own_schema_and_every_key_is_in_it() -> None:
    import json

    import jsonschema

    schema = json.loads((CHART / "values.schema.json").read_text(encoding="utf-8"))
    values = yaml.safe_load((CHART / "values.yaml").read_text(encoding="utf-8"))
    jsonschema.Draft7Validator.check_schema(schema)
    jsonschema.Draft7Validator(schema).validate(values)
    assert set(schema["properties"]) - {"global"} == set(values)


# --- NetworkPolicies ---------------------------------------------------------------------------------


def ns_labels(ns: str) -> dict[str, str]:
    return {"kubernetes.io/metadata.name": ns}


def peer_matches(peer: Obj, policy_ns: str, pod_ns: str, labels: dict[str, str]) -> bool:
    """NetworkPolicyPeer semantics: podSelector alone means the policy's namespace."""
    assert "ipBlock" not in peer, "ipBlock peers are not expected"
    if "namespaceSelector" in peer:
        if not selects(peer["namespaceSelector"], ns_labels(pod_ns)):
            return False
    elif pod_ns != policy_ns:
        return False
    return "podSelector" not in peer or selects(peer["podSelector"], labels)


def allows(
    rules: list[Obj], side: str, policy_ns: str, pod_ns: str, labels: dict[str, str], port: int, proto: str
) -> bool:
    for rule in rules:
        peers = rule.get(side)
        ports = rule.get("ports")
        peer_ok = not peers or any(peer_matches(p, policy_ns, pod_ns, labels) for p in peers)
        port_ok = not ports or any(p.get("port") == port and p.get("protocol", "TCP") == proto for p in ports)
        if peer_ok and port_ok:
            return True
    return False


def run_pod_labels() -> dict[str, dict[str, str]]:
    """The labels of the pods of the example run, as the operator's own code makes them."""
    run_, _, _ = example_specs()
    name = run_.metadata.name
    children = render.render_children(*example_specs(), settings=SETTINGS, admin_token="t")
    templates = {
        c["metadata"]["labels"]["app.kubernetes.io/component"]: c
        for c in children
        if c["kind"] in ("Deployment", "StatefulSet")
    }
    from inharness.operator.rollouts.kubernetes import LABEL_POOL

    return {
        "gateway": templates["gateway"]["spec"]["template"]["metadata"]["labels"],
        "trainer": templates["trainer"]["spec"]["template"]["metadata"]["labels"],
        "harness": {**render.labels(name, "harness"), LABEL_POOL: "calc-pool"},
    }


def test_harness_pods_may_reach_only_the_gateway_and_dns() -> None:
    objs = rendered("default")
    policy = one(objs, "NetworkPolicy", f"{FULLNAME}-harness-egress")
    spec, ns = policy["spec"], policy["metadata"]["namespace"]
    pods = run_pod_labels()
    assert selects(spec["podSelector"], pods["harness"])
    assert not selects(spec["podSelector"], pods["gateway"]) and not selects(
        spec["podSelector"], pods["trainer"]
    )
    assert spec["policyTypes"] == ["Egress"]
    egress = spec["egress"]
    assert allows(egress, "to", ns, ns, pods["gateway"], 8000, "TCP")
    dns = {"k8s-app": "kube-dns"}
    assert allows(egress, "to", ns, "kube-system", dns, 53, "UDP")
    assert allows(egress, "to", ns, "kube-system", dns, 53, "TCP")
    # Nothing else: not the trainer's engine, not the gateway on another port, not the API server or
    # other pods of kube-system, not DNS in another namespace, not other pods on 53.
    assert not allows(egress, "to", ns, ns, pods["trainer"], 8001, "TCP")
    assert not allows(egress, "to", ns, ns, pods["gateway"], 8080, "TCP")
    assert not allows(egress, "to", ns, "kube-system", {"component": "kube-apiserver"}, 443, "TCP")
    assert not allows(egress, "to", ns, "kube-system", dns, 9153, "TCP")
    assert not allows(egress, "to", ns, ns, {"app": "anything"}, 53, "UDP")
    assert not allows(egress, "to", ns, "other", pods["gateway"], 8000, "TCP")
    for rule in egress:
        assert rule.get("to") and rule.get("ports"), f"a rule without peers or ports allows too much: {rule}"


def test_gateway_accepts_only_harness_trainer_and_operator_pods_on_8000() -> None:
    objs = rendered("default")
    policy = one(objs, "NetworkPolicy", f"{FULLNAME}-gateway-ingress")
    spec, ns = policy["spec"], policy["metadata"]["namespace"]
    pods = run_pod_labels()
    operator_labels = one(objs, "Deployment", FULLNAME)["spec"]["template"]["metadata"]["labels"]
    assert selects(spec["podSelector"], pods["gateway"])
    assert not selects(spec["podSelector"], pods["harness"])
    assert spec["policyTypes"] == ["Ingress"]  # the gateway's own egress (to the engine) stays open
    ingress = spec["ingress"]
    assert allows(ingress, "from", ns, ns, pods["harness"], 8000, "TCP")
    assert allows(ingress, "from", ns, ns, pods["trainer"], 8000, "TCP")
    assert allows(ingress, "from", ns, NAMESPACE, operator_labels, 8000, "TCP")
    assert not allows(ingress, "from", ns, ns, {"app": "other"}, 8000, "TCP")
    assert not allows(ingress, "from", ns, "elsewhere", pods["harness"], 8000, "TCP")
    assert not allows(ingress, "from", ns, ns, pods["harness"], 8001, "TCP")


def test_the_bundled_postgresql_is_off_by_default_and_only_gateway_pods_reach_it() -> None:
    import base64

    assert not [o for o in rendered("default") if "postgresql" in o["metadata"]["name"]]
    objs = rendered("postgresql")
    name = f"{FULLNAME}-postgresql"
    secret, service = one(objs, "Secret", name), one(objs, "Service", name)
    statefulset = one(objs, "StatefulSet", name)
    password = base64.b64decode(secret["data"]["password"]).decode()
    url = base64.b64decode(secret["data"]["url"]).decode()
    # What a TrainingRun's spec.gateway.store.urlSecret names: the Service, by its in-cluster name.
    assert url == f"postgresql://inharness:{password}@{name}.{NAMESPACE}.svc:5432/inharness"
    assert len(password) == 32
    pod = statefulset["spec"]["template"]
    assert selects(service["spec"]["selector"], pod["metadata"]["labels"])
    [c] = pod["spec"]["containers"]
    assert not [e for e in c["env"] if "valueFrom" in e]  # the password reaches it as a file only
    assert {e["name"]: e["value"] for e in c["env"]}["POSTGRES_PASSWORD_FILE"].endswith("/password")

    policy = one(objs, "NetworkPolicy", f"{name}-ingress")
    spec, ns = policy["spec"], policy["metadata"]["namespace"]
    pods = run_pod_labels()
    assert selects(spec["podSelector"], pod["metadata"]["labels"]) and spec["policyTypes"] == ["Ingress"]
    assert allows(spec["ingress"], "from", ns, "team-a", pods["gateway"], 5432, "TCP")
    for other in ("harness", "trainer"):
        assert not allows(spec["ingress"], "from", ns, "team-a", pods[other], 5432, "TCP")
    assert not allows(spec["ingress"], "from", ns, "team-a", pods["gateway"], 5433, "TCP")


def test_network_policies_go_to_every_watched_namespace_or_none_when_disabled() -> None:
    def where(objs: list[Obj]) -> set[tuple[str, str]]:
        return {(p["metadata"]["name"], p["metadata"]["namespace"]) for p in of_kind(objs, "NetworkPolicy")}

    def expected(*namespaces: str) -> set[tuple[str, str]]:
        names = (f"{FULLNAME}-harness-egress", f"{FULLNAME}-gateway-ingress")
        return {(name, ns) for name in names for ns in namespaces}

    assert where(rendered("default")) == expected(NAMESPACE)
    assert where(rendered("namespaced")) == expected("team-a", "team-b")
    assert where(helm_template("--set", "networkPolicy.namespaces={ml,research}")) == expected(
        "ml", "research"
    )
    assert where(helm_template("--set", "networkPolicy.enabled=false")) == set()


def test_notes_tell_where_the_operator_watches() -> None:
    need_binaries()
    # `helm template` leaves NOTES.txt out; a client-side dry-run install renders it (no cluster needed).
    dry = run(
        [
            HELM,
            "install",
            RELEASE,
            CHART,
            "-n",
            NAMESPACE,
            "--dry-run=client",
            "--set",
            "watchNamespaces={ml}",
        ]
    ).stdout
    assert "watching: ml" in dry
    assert "kubectl apply -n ml -f examples/calc/trainingrun.yaml" in dry
