"""Spec models and spec files: a valid file loads and round-trips in camelCase; every bad file
fails with a message that names the file, the document and the field as written in the YAML."""

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from inharness.operator.spec import (
    KINDS,
    Algorithm,
    HarnessSpec,
    HarnessSpecSpec,
    RolloutPool,
    RolloutPoolSpec,
    Scheduling,
    TrainingRun,
)
from inharness.operator.specfile import SpecError, Specs, load_specs, load_tasks

V = "inharness.dev/v1alpha1"
HARNESS: dict[str, Any] = {
    "apiVersion": V,
    "kind": "HarnessSpec",
    "metadata": {"name": "calc", "labels": {"app": "calc"}},
    "spec": {
        "command": ["python", "harness.py"],
        "args": ["--fast"],
        "env": [{"name": "LEVEL", "value": "easy"}],
        "model": {"keyIn": "path", "modelNameEnv": None},
        "timeoutSeconds": 30,
        "outcome": {"type": "grader", "grader": {"command": ["python", "grade.py"], "timeoutSeconds": 20}},
    },
}
POOL: dict[str, Any] = {
    "apiVersion": V,
    "kind": "RolloutPool",
    "metadata": {"name": "calc-pool"},
    "spec": {"harnessRef": {"name": "calc"}, "parallelism": 16},
}
RUN: dict[str, Any] = {
    "apiVersion": V,
    "kind": "TrainingRun",
    "metadata": {"name": "calc", "namespace": "research"},
    "spec": {
        "model": {"path": "models/tiny"},
        "dataset": {"path": "tasks.jsonl"},
        "rolloutPoolRef": {"name": "calc-pool"},
        "algorithm": {"advantageEstimator": "rloo", "groupSize": 4, "maxTokensPerSample": 256},
        "scheduling": {"mode": "async", "maxStaleness": 2},
        "checkpoint": {"interval": 2},
    },
}
TASKS = [{"question": "What is 2+3?", "answer": 5}, {"question": "What is 7*6?", "answer": 42}]


def write(tmp: Path, docs: list[Any] | None = None, *, tasks: bool = True) -> Path:
    if tasks:
        (tmp / "tasks.jsonl").write_text("\n".join(json.dumps(t) for t in TASKS) + "\n\n")
    f = tmp / "run.yaml"
    f.write_text(yaml.safe_dump_all(docs if docs is not None else [HARNESS, POOL, RUN], sort_keys=False))
    return f


def errors_of(f: Path, **kw: Any) -> list[str]:
    with pytest.raises(SpecError) as info:
        load_specs(f, **kw)
    assert str(info.value) == "\n".join(info.value.errors)
    return info.value.errors


def test_valid_file_loads_and_resolves(tmp_path: Path) -> None:
    specs = load_specs(write(tmp_path))
    assert isinstance(specs, Specs)
    assert (specs.base_dir, specs.path) == (tmp_path.resolve(), tmp_path / "run.yaml")
    tr, pool, h = specs.training_run, specs.rollout_pool, specs.harness
    assert (tr.metadata.name, pool.metadata.name, h.metadata.name) == ("calc", "calc-pool", "calc")
    assert pool.spec.harness_ref.name == h.metadata.name and tr.spec.rollout_pool_ref.name == "calc-pool"
    assert tr.spec.algorithm.group_size == 4 and tr.spec.scheduling.max_staleness == 2
    assert tr.spec.algorithm.learning_rate == 1e-5 and tr.spec.batch_size == 8 and tr.spec.steps == 10
    assert tr.spec.generation.temperature == 1.0 and tr.spec.checkpoint.keep == 3
    assert h.spec.model.key_in == "path" and h.spec.model.model_name_env is None
    assert h.spec.model.base_url_env == "OPENAI_BASE_URL" and h.spec.task.file_env == "INHARNESS_TASK_FILE"
    assert pool.spec.lease_for(h.spec) == 90 and pool.spec.max_attempts_per_rollout == 2
    assert specs.resolve("models/tiny") == tmp_path.resolve() / "models/tiny"
    assert load_tasks(specs) == TASKS


def test_the_off_policy_correction_and_its_cap() -> None:
    assert (Algorithm().off_policy_correction, Algorithm().tis_cap) == ("bypass", 2.0)
    tis = Algorithm.model_validate({"offPolicyCorrection": "tis", "tisCap": 1})
    assert (tis.off_policy_correction, tis.tis_cap) == ("tis", 1.0)
    assert tis.model_dump()["offPolicyCorrection"] == "tis" and tis.model_dump()["tisCap"] == 1.0


def test_inline_tasks_and_defaults(tmp_path: Path) -> None:
    run = copy.deepcopy(RUN)
    run["spec"]["dataset"] = {"tasks": ["a", {"b": 1}]}
    del run["spec"]["scheduling"]
    harness = {**HARNESS, "spec": {"command": ["./h"]}}
    specs = load_specs(write(tmp_path, [harness, POOL, run], tasks=False))
    assert load_tasks(specs) == ["a", {"b": 1}]
    h = specs.harness.spec
    assert (h.timeout_seconds, h.outcome.type, h.outcome.result_file_env) == (
        600,
        "resultFile",
        "INHARNESS_RESULT_FILE",
    )
    assert (h.model.model_name, h.model.key_in, h.task.env) == ("policy", "header", "INHARNESS_TASK")
    assert specs.rollout_pool.spec.lease_for(h) == 660
    assert specs.training_run.spec.gateway.store.bodies == "full"
    assert (specs.training_run.spec.scheduling.mode, specs.training_run.spec.scheduling.max_staleness) == (
        "sync",
        0,
    )


@pytest.mark.parametrize("doc", [HARNESS, POOL, RUN], ids=lambda d: d["kind"])
def test_camel_case_round_trip(doc: dict[str, Any]) -> None:
    model = KINDS[doc["kind"]].model_validate(doc)
    dumped = model.model_dump(by_alias=True, exclude_unset=True)
    assert dumped == doc
    assert model.model_dump(exclude_unset=True) == doc, "serializes by alias by default"
    full = model.model_dump(mode="json")
    assert all("_" not in k for k in _keys(full)), "every key is camelCase"
    assert type(model).model_validate(full) == model
    assert type(model).model_validate_json(model.model_dump_json()) == model


def _keys(value: Any) -> list[str]:
    if isinstance(value, dict):
        return [k for k, v in value.items() for k in [k, *_keys(v)] if k not in ("labels",)]
    if isinstance(value, list):
        return [k for v in value for k in _keys(v)]
    return []


def test_python_names_also_validate() -> None:
    pool = RolloutPoolSpec(harness_ref={"name": "h"}, max_attempts_per_rollout=3)  # type: ignore[arg-type]
    assert pool.model_dump()["maxAttemptsPerRollout"] == 3


@pytest.mark.parametrize("model", [TrainingRun, RolloutPool, HarnessSpec])
def test_json_schema_is_crd_ready(model: type) -> None:
    """Every property documented and camelCase: the schema becomes the CRD."""
    schema = model.model_json_schema(by_alias=True)
    seen = 0
    for where, props in _properties(schema):
        for name, prop in props.items():
            seen += 1
            assert re.fullmatch(r"[a-z][A-Za-z]*", name), (where, name)
            assert prop.get("description"), f"{where}.{name} has no description"
    assert seen > 10


def _properties(schema: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    out = [(schema.get("title", ""), schema.get("properties", {}))]
    for name, sub in schema.get("$defs", {}).items():
        out.append((name, sub.get("properties", {})))
    return out


# --- one bad thing at a time ---------------------------------------------------------------------------

H, P, R = (
    'document 1 (HarnessSpec "calc")',
    'document 2 (RolloutPool "calc-pool")',
    'document 3 (TrainingRun "calc")',
)


def _set(doc: dict[str, Any], path: str, value: Any) -> None:
    *parents, last = path.split(".")
    for p in parents:
        doc = doc.setdefault(p, {})
    if value is _DELETE:
        del doc[last]
    else:
        doc[last] = value


_DELETE = object()

CASES = [
    # (document index 0..2, path, value, how the error line starts after "<file>: ")
    pytest.param(
        1,
        "spec.parallelism",
        "many",
        f"{P}: spec.parallelism: Input should be a valid integer, unable to parse string as an integer",
        id="wrong type",
    ),
    pytest.param(
        2,
        "spec.algorithm.groupSize",
        1,
        f"{R}: spec.algorithm.groupSize: Input should be greater than or equal to 2",
        id="out of range",
    ),
    pytest.param(
        1,
        "spec.parallelism",
        10_001,
        f"{P}: spec.parallelism: Input should be less than or equal to 10000",
        id="too parallel",
    ),
    pytest.param(
        2,
        "spec.scheduling",
        {"mode": "sync", "maxStaleness": 1},
        f"{R}: spec.scheduling.maxStaleness: must be 0 when mode is sync (got 1); use mode async",
        id="sync staleness",
    ),
    pytest.param(
        2,
        "spec.scheduling",
        {"mode": "async"},
        f"{R}: spec.scheduling.maxStaleness: must be at least 1 when mode is async (got 0)",
        id="async staleness",
    ),
    pytest.param(
        2,
        "spec.algorithm.advantageEstimator",
        "ppo",
        f"{R}: spec.algorithm.advantageEstimator: Input should be 'grpo' or 'rloo'",
        id="bad enum",
    ),
    pytest.param(
        2,
        "spec.algorithm.tisCap",
        0.5,
        f"{R}: spec.algorithm.tisCap: Input should be greater than or equal to 1",
        id="tis cap below 1",
    ),
    pytest.param(
        2,
        "spec.algorithm.offPolicyCorrection",
        "is",
        f"{R}: spec.algorithm.offPolicyCorrection: Input should be 'bypass' or 'tis'",
        id="bad correction",
    ),
    pytest.param(
        2,
        "spec.trainer",
        {"nodes": 2},
        f"{R}: spec.trainer.nodes: nodes above 1 need engine verl (got 2 with engine torch): the torch "
        "engine trains in one pod",
        id="torch on two nodes",
    ),
    pytest.param(
        2,
        "spec.trainer",
        {"inference": "vllm"},
        f"{R}: spec.trainer: inference vllm needs engine verl and gpus of at least 1 (got engine torch, "
        "gpus 1): verl starts the vLLM servers on the trainer's GPUs",
        id="vllm with the torch engine",
    ),
    pytest.param(
        2,
        "spec.trainer",
        {"engine": "verl", "gpus": 3, "inference": "vllm", "vllm": {"tensorParallelSize": 2}},
        f"{R}: spec.trainer: gpus (3) must be a multiple of vllm.tensorParallelSize (2)",
        id="vllm tensor parallel not dividing the gpus",
    ),
    pytest.param(
        2,
        "spec.gateway",
        {"replicas": 2},
        f"{R}: spec.gateway.replicas: replicas above 1 need store.urlSecret (got 2 with the SQLite store): "
        "SQLite on a ReadWriteOnce claim serves one gateway",
        id="gateway replicas on sqlite",
    ),
    pytest.param(
        2,
        "spec.gateway",
        {"store": {"urlSecret": {"name": "db"}}},
        f"{R}: spec.gateway.store.urlSecret.key: Field required",
        id="store secret without key",
    ),
    pytest.param(
        2,
        "spec.gateway",
        {"store": {"bodies": "some"}},
        f"{R}: spec.gateway.store.bodies: Input should be 'full' or 'none'",
        id="store bodies neither full nor none",
    ),
    pytest.param(
        2,
        "spec.trainer",
        {"engine": "verl", "nodes": 65},
        f"{R}: spec.trainer.nodes: Input should be less than or equal to 64",
        id="too many nodes",
    ),
    pytest.param(
        2,
        "spec.trainer",
        {"shmSize": "plenty"},
        f"{R}: spec.trainer.shmSize: String should match pattern",
        id="shm size not a quantity",
    ),
    pytest.param(
        0,
        "spec.outcome",
        {"type": "grader"},
        f"{H}: spec.outcome.grader: required when type is grader",
        id="grader missing",
    ),
    pytest.param(
        0,
        "spec.outcome.type",
        "exitCode",
        f"{H}: spec.outcome.grader: only allowed when type is grader (type is exitCode)",
        id="grader unwanted",
    ),
    pytest.param(
        2,
        "spec.dataset",
        {"path": "tasks.jsonl", "tasks": [1]},
        f"{R}: spec.dataset: set exactly one of tasks and path (both are set)",
        id="dataset both",
    ),
    pytest.param(
        2,
        "spec.dataset",
        {},
        f"{R}: spec.dataset: set exactly one of tasks and path (neither is set)",
        id="dataset neither",
    ),
    pytest.param(
        2,
        "spec.dataset",
        {"tasks": []},
        f"{R}: spec.dataset.tasks: List should have at least 1 item after validation, not 0",
        id="dataset empty",
    ),
    pytest.param(
        0,
        "spec.task",
        {"env": None, "fileEnv": None},
        f"{H}: spec.task: at least one of env and fileEnv must be set",
        id="no task input",
    ),
    pytest.param(1, "spec.paralelism", 3, f"{P}: spec.paralelism: Extra inputs are not permitted", id="typo"),
    pytest.param(2, "spec.model", _DELETE, f"{R}: spec.model: Field required", id="missing field"),
    pytest.param(
        0,
        "spec.command",
        [],
        f"{H}: spec.command: List should have at least 1 item after validation, not 0",
        id="empty command",
    ),
    pytest.param(
        0,
        "spec.env",
        [{"name": "1X", "value": "v"}],
        f"{H}: spec.env[0].name: '1X' is not a valid environment variable name",
        id="bad env name",
    ),
    pytest.param(
        0,
        "metadata.name",
        "Calc_1",
        "document 1 (HarnessSpec \"Calc_1\"): metadata.name: 'Calc_1' is not a valid name: use at most 63",
        id="bad name",
    ),
    pytest.param(
        1,
        "spec.leaseSeconds",
        5,
        f"{P}: spec.leaseSeconds: Input should be greater than or equal to 10",
        id="short lease",
    ),
    pytest.param(
        1,
        "spec",
        {"harnessRef": {"name": "calc"}, "leaseSeconds": 20, "heartbeatSeconds": 20},
        f"{P}: spec.heartbeatSeconds: must be less than leaseSeconds (20)",
        id="beat vs lease",
    ),
    pytest.param(
        1,
        "spec.heartbeatSeconds",
        90,
        f"{P}: spec.heartbeatSeconds: must be less than the lease (90s: the harness's timeoutSeconds + 60",
        id="beat vs default lease",
    ),
    pytest.param(
        1,
        "spec.backend",
        "kubernetes",
        f'{H}: spec.image: required, as RolloutPool "calc-pool" runs it with backend kubernetes',
        id="image on cluster",
    ),
    pytest.param(
        1,
        "spec.local.preload",
        ["openai", "open-ai"],
        f"{P}: spec.local.preload[1]: 'open-ai' is not a Python module name: use dotted identifiers",
        id="preload module with a dash",
    ),
    pytest.param(
        1,
        "spec.local.preload",
        ["openai."],
        f"{P}: spec.local.preload[0]: 'openai.' is not a Python module name",
        id="preload module with a trailing dot",
    ),
    pytest.param(
        1,
        "spec.local.preload",
        ["1st"],
        f"{P}: spec.local.preload[0]: '1st' is not a Python module name",
        id="preload module starting with a digit",
    ),
    pytest.param(
        1,
        "spec.local.preload",
        ["m"] * 33,
        f"{P}: spec.local.preload: List should have at most 32 items after validation, not 33",
        id="too many preload modules",
    ),
    pytest.param(
        1,
        "kind",
        "RolloutPol",
        "document 2 (RolloutPol \"calc-pool\"): kind: unknown kind 'RolloutPol'; expected one of HarnessSpec",
        id="unknown kind",
    ),
    pytest.param(
        0,
        "apiVersion",
        "inharness.dev/v1",
        f"{H}: apiVersion: must be inharness.dev/v1alpha1 (got 'inharness.dev/v1')",
        id="wrong apiVersion",
    ),
    pytest.param(
        2,
        "spec.rolloutPoolRef.name",
        "pool",
        f'{R}: spec.rolloutPoolRef.name: no RolloutPool "pool" in this file (RolloutPools here: "calc-pool")',
        id="dangling pool ref",
    ),
    pytest.param(
        1,
        "spec.harnessRef.name",
        "calk",
        f'{P}: spec.harnessRef.name: no HarnessSpec "calk" in this file (HarnessSpecs here: "calc")',
        id="dangling harness ref",
    ),
    pytest.param(
        2,
        "status",
        ["not", "a", "mapping"],
        f"{R}: status: Input should be a valid dictionary",
        id="status is free-form",
    ),
]


@pytest.mark.parametrize(("index", "path", "value", "expected"), CASES)
def test_bad_field_is_named(tmp_path: Path, index: int, path: str, value: Any, expected: str) -> None:
    docs = copy.deepcopy([HARNESS, POOL, RUN])
    _set(docs[index], path, value)
    f = write(tmp_path, docs)
    errors = errors_of(f)
    assert any(e.startswith(f"{f}: {expected}") for e in errors), errors


def test_status_may_be_written_by_the_operator(tmp_path: Path) -> None:
    run = {**RUN, "status": {"phase": "Running", "anything": [1, 2]}}
    assert load_specs(write(tmp_path, [HARNESS, POOL, run])).training_run.status == run["status"]


def test_all_errors_of_a_file_at_once(tmp_path: Path) -> None:
    docs = copy.deepcopy([HARNESS, POOL, RUN])
    docs[1]["spec"]["parallelism"] = 0
    docs[2]["spec"]["algorithm"]["groupSize"] = 0
    docs[2]["spec"]["steps"] = "ten"
    f = write(tmp_path, docs)
    assert errors_of(f) == [
        f"{f}: {P}: spec.parallelism: Input should be greater than or equal to 1",
        f"{f}: {R}: spec.algorithm.groupSize: Input should be greater than or equal to 2",
        f"{f}: {R}: spec.steps: Input should be a valid integer, unable to parse string as an integer",
    ]


def test_bad_yaml_gives_line_and_column(tmp_path: Path) -> None:
    f = tmp_path / "run.yaml"
    f.write_text("apiVersion: inharness.dev/v1alpha1\nkind: TrainingRun\nmetadata: {name: calc\nspec: {}\n")
    [msg] = errors_of(f)
    assert msg.startswith(f"{f}: invalid YAML at line 4, column 5: ")
    assert "flow mapping" in msg


def test_duplicate_yaml_key_is_an_error(tmp_path: Path) -> None:
    f = tmp_path / "run.yaml"
    f.write_text("apiVersion: inharness.dev/v1alpha1\nkind: RolloutPool\nkind: TrainingRun\n")
    [msg] = errors_of(f)
    assert msg.startswith(f"{f}: invalid YAML at line 3, column 1: ") and "duplicate key 'kind'" in msg


def test_document_that_is_not_a_mapping(tmp_path: Path) -> None:
    f = write(tmp_path, [HARNESS, ["a", "list"], POOL, RUN])
    assert errors_of(f) == [
        f"{f}: document 2: expected a mapping with apiVersion, kind, metadata and spec, got a list"
    ]


def test_missing_documents(tmp_path: Path) -> None:
    f = write(tmp_path, [HARNESS, POOL])
    errors = errors_of(f)
    assert f"{f}: {P}: not referenced by any TrainingRun's spec.rolloutPoolRef" in errors
    assert errors[-1].startswith(f"{f}: no TrainingRun document; a spec file holds a TrainingRun")
    f = write(tmp_path, [RUN])
    assert errors_of(f) == [
        f'{f}: document 1 (TrainingRun "calc"): spec.rolloutPoolRef.name: no RolloutPool "calc-pool" '
        "in this file (RolloutPools here: none)"
    ]
    f.write_text("# nothing here\n---\n")
    assert errors_of(f) == [f"{f}: no documents"]
    assert errors_of(tmp_path / "absent.yaml")[0].startswith(f"{tmp_path / 'absent.yaml'}: cannot read: ")


def test_duplicate_and_unreferenced_documents(tmp_path: Path) -> None:
    other = copy.deepcopy(HARNESS)
    other["metadata"]["name"] = "other"
    f = write(tmp_path, [HARNESS, POOL, RUN, HARNESS, other])
    assert errors_of(f) == [
        f'{f}: document 4 (HarnessSpec "calc"): metadata.name: duplicate HarnessSpec "calc" (also {H})',
        f'{f}: document 5 (HarnessSpec "other"): not referenced by any RolloutPool\'s spec.harnessRef',
    ]


def test_several_runs_in_one_file_are_chosen_by_name(tmp_path: Path) -> None:
    other = copy.deepcopy(RUN)
    other["metadata"]["name"] = "calc-hard"
    other["spec"]["dataset"] = {"tasks": [{"question": "hard"}]}
    f = write(tmp_path, [HARNESS, POOL, RUN, other])
    assert errors_of(f) == [f'{f}: 2 TrainingRuns ("calc", "calc-hard"); choose one by name']
    assert load_tasks(load_specs(f, run="calc-hard")) == [{"question": "hard"}]
    assert errors_of(f, run="nope") == [
        f'{f}: no TrainingRun "nope" (TrainingRuns here: "calc", "calc-hard")'
    ]


def test_missing_dataset_file(tmp_path: Path) -> None:
    docs = copy.deepcopy([HARNESS, POOL, RUN])
    docs[2]["spec"]["dataset"]["path"] = "data/missing.jsonl"
    f = write(tmp_path, docs)
    missing = tmp_path.resolve() / "data/missing.jsonl"
    assert errors_of(f) == [f"{f}: {R}: spec.dataset.path: file not found: {missing}"]


@pytest.mark.parametrize("backend", ["local", "kubernetes"])
def test_missing_working_dir_of_a_local_harness(tmp_path: Path, backend: str) -> None:
    # `inharness run` (check_files) runs the harness here whatever the backend; the operator's
    # uses (check_files=False) leave the path to the container.
    docs = copy.deepcopy([HARNESS, POOL, RUN])
    docs[0]["spec"].update(workingDir="work", image="example.org/calc:1")
    docs[1]["spec"]["backend"] = backend
    f = write(tmp_path, docs)
    work = tmp_path.resolve() / "work"
    expected = f'{f}: {H}: spec.workingDir: not a directory: {work} (RolloutPool "calc-pool" runs it locally)'
    assert errors_of(f) == [expected]
    assert load_specs(f, check_files=False).rollout_pool.spec.backend == backend
    work.mkdir()
    assert load_specs(f).harness.spec.working_dir == "work"


def test_a_kubernetes_pool_loads_for_a_local_run_and_still_needs_its_image(tmp_path: Path) -> None:
    docs = copy.deepcopy([HARNESS, POOL, RUN])
    docs[0]["spec"]["image"] = "example.org/calc:1"
    docs[1]["spec"]["backend"] = "kubernetes"
    specs = load_specs(write(tmp_path, docs))
    assert (specs.rollout_pool.spec.backend, specs.harness.spec.image) == ("kubernetes", "example.org/calc:1")
    del docs[0]["spec"]["image"]
    f = write(tmp_path, docs)
    image = f'{f}: {H}: spec.image: required, as RolloutPool "calc-pool" runs it with backend kubernetes'
    assert errors_of(f) == errors_of(f, check_files=False) == [image]


def test_the_example_is_one_file_for_inharness_run_and_the_operator() -> None:
    example = Path(__file__).resolve().parents[2] / "examples" / "calc" / "trainingrun.yaml"
    local, cluster = load_specs(example), load_specs(example, check_files=False)
    for specs in (local, cluster):
        assert specs.rollout_pool.spec.backend == "kubernetes"
        assert specs.harness.spec.image == "ghcr.io/inharness/calc-harness:0.1.0"


def test_bad_jsonl_line_is_named(tmp_path: Path) -> None:
    specs = load_specs(write(tmp_path))
    data = tmp_path.resolve() / "tasks.jsonl"
    data.write_text('{"question": "ok"}\n\n{"question": oops}\n')
    with pytest.raises(SpecError, match=re.escape(f"{data}: line 3: not valid JSON: Expecting value")):
        load_tasks(specs)
    data.write_text("\n  \n")
    with pytest.raises(SpecError, match=re.escape(f"{data}: no tasks")):
        load_tasks(specs)


def test_models_validate_alone_with_clear_messages() -> None:
    with pytest.raises(ValueError, match="must be 0 when mode is sync"):
        Scheduling.model_validate({"maxStaleness": 3})
    with pytest.raises(ValueError, match="command"):
        HarnessSpecSpec.model_validate({})


def test_verl_takes_several_nodes_and_torch_one() -> None:
    spec = copy.deepcopy(RUN["spec"])
    run = TrainingRun.model_validate({**RUN, "spec": {**spec, "trainer": {"engine": "verl", "nodes": 4}}})
    assert (run.spec.trainer.nodes, run.spec.trainer.engine) == (4, "verl")
    assert TrainingRun.model_validate(RUN).spec.trainer.nodes == 1  # the default: one pod, torch


def test_vllm_serves_on_the_trainer_gpus_with_verl_and_never_beside_async_updates() -> None:
    spec = copy.deepcopy(RUN["spec"])
    trainer = {"engine": "verl", "gpus": 2, "inference": "vllm", "vllm": {"gpuMemoryUtilization": 0.4}}
    collocated = {"mode": "collocated-async", "maxStaleness": 1}
    run = TrainingRun.model_validate({**RUN, "spec": {**spec, "trainer": trainer, "scheduling": collocated}})
    assert run.spec.trainer.inference == "vllm"
    assert run.spec.trainer.vllm.gpu_memory_utilization == 0.4
    assert TrainingRun.model_validate(RUN).spec.trainer.inference == "engine"  # the default
    with pytest.raises(ValueError, match="use sync or collocated-async"):
        TrainingRun.model_validate(
            {**RUN, "spec": {**spec, "trainer": trainer, "scheduling": {"mode": "async", "maxStaleness": 1}}}
        )
