"""checkov over everything inharness puts on a cluster: the chart with each values variant, the kustomize
base and overlays (real `kubectl kustomize`), what the operator creates for a run (`inharness operator
render` of examples/calc) and for an attempt (a harness Pod, its Job form and its batch's Secret).

One checkov process over one folder (about 6 s for its ~80 objects; a process per file would pay its 3 s
start every time), one object per file so that every finding names the object it is about. The checks
not enforced are in checkov-skips.yaml, each with its reason: those without `components` are passed as
`--skip-check`; those with `components` are skipped only on objects with such an
`app.kubernetes.io/component` label, and must still be needed. checkov is pinned in the Makefile
(CHECKOV_VERSION) and installed into its own environment by `make checkov`, a prerequisite of `make test`.
"""

import json
import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml
from manifest_support import (
    BIN,
    CHART_VARIANTS,
    OVERLAYS,
    ROOT,
    Obj,
    docs,
    helm_template,
    key,
    kustomize,
    run,
)

from inharness.gateway.schema import ClaimedAttempt
from inharness.operator import render
from inharness.operator.render import harness
from inharness.operator.spec import TrainingRun
from inharness.operator.specfile import load_specs

CHECKOV = ROOT / ".cache" / "checkov" / "bin" / "checkov"
SKIPS = Path(__file__).with_name("checkov-skips.yaml")
EXAMPLE = ROOT / "examples" / "calc" / "trainingrun.yaml"
RUN_NAMESPACE = "ml"  # where the example's run lives (not `default`, which checkov rightly refuses)
COMPONENT = "app.kubernetes.io/component"


def pinned_version() -> str:
    found = re.search(r"^CHECKOV_VERSION\s*:?=\s*(\S+)", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert found, "the Makefile pins no CHECKOV_VERSION"
    return found.group(1)


def need_checkov() -> None:
    if not CHECKOV.exists():
        where = CHECKOV.parent.parent.relative_to(ROOT)
        pytest.skip(f"checkov is not installed in {where}: `make checkov` installs it (`make test` does too)")


# --- what is scanned ---------------------------------------------------------------------------------


def harness_objects() -> list[Obj]:
    """An attempt of the example as the rollout controller creates it: its Pod, the same as a Job
    (`spec.kubernetes.workload: Job`), and the batch's Secret of attempt keys."""
    specs = load_specs(EXAMPLE, check_files=False)
    run_name, pool = specs.training_run.metadata.name, specs.rollout_pool.metadata.name
    attempt = ClaimedAttempt(
        id="att-0123456789abcdef",
        rollout_id="r1",
        group_id="g1",
        seq=0,
        task={"question": "2+3"},
        token="attempt-key",
        lease_expires_at=0,
    )

    def context(workload: str) -> harness.PodContext:
        return harness.PodContext(
            namespace=RUN_NAMESPACE,
            run=run_name,
            pool=pool,
            pool_uid="6f1c1d8e-1111-2222-3333-444455556666",
            harness=specs.harness.spec,
            settings=specs.rollout_pool.spec.kubernetes.model_copy(update={"workload": workload}),
            gateway_url=render.gateway_url(run_name),
        )

    workloads = [harness.harness_workload(context(w), attempt, "b1") for w in ("Pod", "Job")]
    return [*workloads, *harness.batch_objects(context("Pod"), "b1", [attempt])]


def operator_render() -> list[Obj]:
    args = [BIN / "inharness", "operator", "render", EXAMPLE, "--admin-token", "X"]
    return docs(run([*args, "--namespace", RUN_NAMESPACE]).stdout)


def verl_trainer() -> list[Obj]:
    """The trainer StatefulSet of the example with engine verl on two GPU nodes (one Ray cluster): the
    one child that differs from the torch run's, beside it."""
    specs = load_specs(EXAMPLE, check_files=False)
    doc = specs.training_run.model_dump(mode="json", by_alias=True)
    doc["metadata"]["namespace"] = RUN_NAMESPACE
    doc["spec"]["trainer"] = {"engine": "verl", "nodes": 2, "gpus": 8}
    objs = render.render_children(
        TrainingRun.model_validate(doc),
        specs.rollout_pool,
        specs.harness,
        settings=render.RenderSettings.from_env({}),
        admin_token="X",
    )
    return [o for o in objs if o["kind"] == "StatefulSet"]


# What is scanned, in four groups (a test each): the chart and deploy/ are this folder's to fix, the
# operator's objects the render code's (operator/inharness/operator/render/).
GROUPS = ("chart", "deploy", "operator-render", "harness")


def sources() -> Iterator[tuple[str, str, list[Obj]]]:
    """(group, what, objects)."""
    for variant, args in CHART_VARIANTS.items():
        yield "chart", variant, helm_template(*args)
    for path in OVERLAYS:
        yield "deploy", path.removeprefix("deploy/").replace("/", "-"), kustomize(path)
    yield "operator-render", "calc", operator_render()
    yield "operator-render", "calc-verl", verl_trainer()
    yield "harness", "calc", harness_objects()


def group_of(file_name: str) -> str:
    return file_name.split(".", 1)[0]


def write_objects(folder: Path) -> dict[str, Obj]:
    """Every object into a file of its own, `<group>.<what>--<n>-<kind>-<name>.yaml`; {file name: object}."""
    written = {}
    for group, what, objs in sources():
        for i, obj in enumerate(objs):
            name = f"{group}.{what}--{i:02d}-{obj['kind']}-{obj['metadata']['name']}.yaml".lower()
            (folder / name).write_text(yaml.safe_dump(obj, sort_keys=False), encoding="utf-8")
            written[name] = obj
    return written


# --- the skip file -----------------------------------------------------------------------------------


@cache
def skips() -> tuple[dict[str, Any], ...]:
    entries = yaml.safe_load(SKIPS.read_text(encoding="utf-8"))["skips"]
    for e in entries:
        assert set(e) <= {"check", "title", "components", "reason"}, e
        assert re.fullmatch(r"CKV2?_K8S_\d+", e["check"]) and e["title"] and e["reason"].strip(), e
    ids = [e["check"] for e in entries]
    assert len(ids) == len(set(ids)), f"a check is listed twice in {SKIPS.name}"
    return tuple(entries)


def test_skip_file_gives_each_check_a_title_and_a_reason() -> None:
    assert skips()


# --- the scan ----------------------------------------------------------------------------------------


def checkov(folder: Path, skip: list[str]) -> dict[str, Any]:
    # --skip-download: no call to the Prisma Cloud API (guidelines, severities): the scan runs offline.
    args = [CHECKOV, "--directory", folder, "--framework", "kubernetes", "--skip-download", "-o", "json"]
    if skip:
        args += ["--skip-check", ",".join(skip)]
    # Run in the scanned folder: no .checkov.yaml of a working directory can change what is checked.
    out = subprocess.run([str(a) for a in args], cwd=folder, capture_output=True, text=True, timeout=300)
    if out.returncode not in (0, 1):  # 1: some check failed
        pytest.fail(f"checkov exited {out.returncode}: {out.stderr.strip()[-2000:]}")
    report = json.loads(out.stdout)
    [report] = report if isinstance(report, list) else [report]
    assert report["check_type"] == "kubernetes"
    return report


@dataclass(frozen=True)
class Scan:
    objects: dict[str, Obj] = field(repr=False)  # by file name
    report: dict[str, Any] = field(repr=False)


@pytest.fixture(scope="module")
def scan(tmp_path_factory: pytest.TempPathFactory) -> Scan:
    """The objects by file name and checkov's report on them: one checkov run for every test here."""
    need_checkov()
    folder = tmp_path_factory.mktemp("checkov")
    objects = write_objects(folder)
    return Scan(objects, checkov(folder, [e["check"] for e in skips() if "components" not in e]))


def failures(scan: Scan) -> Iterator[tuple[str, str, Obj]]:
    """(check id, file name, checkov's record) of every failed check, scoped skips included."""
    for f in scan.report["results"]["failed_checks"]:
        yield f["check_id"], Path(f["file_path"]).name, f


def scoped_skip(scan: Scan, check: str, file_name: str) -> bool:
    scoped = {e["check"]: set(e["components"]) for e in skips() if "components" in e}
    labels = scan.objects[file_name]["metadata"].get("labels") or {}
    return labels.get(COMPONENT) in scoped.get(check, set())


def test_checkov_is_the_version_the_makefile_pins(scan: Scan) -> None:
    assert scan.report["summary"]["checkov_version"] == pinned_version(), "stale: run `make checkov`"


def test_every_object_is_scanned(scan: Scan) -> None:
    assert scan.report["summary"]["parsing_errors"] == 0
    results = scan.report["results"]
    scanned = {Path(r["file_path"]).name for part in results.values() for r in part if "file_path" in r}
    kinds = {"Deployment", "StatefulSet", "Pod", "Job", "ClusterRole", "Role", "Service"}
    missing = {name for name, obj in scan.objects.items() if obj["kind"] in kinds} - scanned
    assert not missing, f"checkov did not scan {sorted(missing)}"
    assert {group_of(name) for name in scanned} == set(GROUPS)


@pytest.mark.parametrize("group", GROUPS)
def test_no_failed_check_but_the_listed_skips(scan: Scan, group: str) -> None:
    failed = [
        f"{check} {f['check_name']}: {key(scan.objects[name])} ({name})"
        for check, name, f in failures(scan)
        if group_of(name) == group and not scoped_skip(scan, check, name)
    ]
    assert not failed, (
        f"{len(failed)} failed checkov checks; fix the object, or list the check in {SKIPS.name} "
        "with the reason it does not apply:\n" + "\n".join(sorted(failed))
    )


def test_every_skip_limited_to_some_components_is_still_needed(scan: Scan) -> None:
    used = {check for check, name, _ in failures(scan) if scoped_skip(scan, check, name)}
    unused = {e["check"] for e in skips() if "components" in e} - used
    assert not unused, f"{sorted(unused)} in {SKIPS.name} no longer fail on their components: remove them"
