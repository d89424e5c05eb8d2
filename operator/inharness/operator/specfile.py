"""Spec files for local runs: one YAML file with a TrainingRun, its RolloutPool and that pool's
HarnessSpec, validated and resolved before anything starts.

Every error is a `SpecError` whose message names the file, the document (index, kind and name) and
the field path as written in the YAML, so that a typo is fixed from the message alone; all errors of
a file are reported at once rather than one per run.
"""

import json
from collections.abc import Iterable
from dataclasses import dataclass
from os import PathLike
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from inharness.operator import spec as s
from inharness.operator.api import API_VERSION
from inharness.operator.spec import KINDS, HarnessSpec, Resource, RolloutPool, TrainingRun


class SpecError(Exception):
    """A spec file that cannot be run; `errors` holds one line per problem."""

    def __init__(self, errors: str | list[str]) -> None:
        self.errors = [errors] if isinstance(errors, str) else list(errors)
        super().__init__("\n".join(self.errors))


@dataclass(frozen=True)
class Specs:
    """A TrainingRun with the RolloutPool and HarnessSpec it references, from one file."""

    path: Path
    base_dir: Path
    training_run: TrainingRun
    rollout_pool: RolloutPool
    harness: HarnessSpec

    def resolve(self, value: str) -> Path:
        """A path as written in the file: relative ones are relative to the file's directory."""
        return _resolve(self.base_dir, value)


def load_specs(path: str | PathLike[str], *, run: str | None = None, check_files: bool = True) -> Specs:
    """Read, validate and resolve a spec file. `run` picks a TrainingRun by name when the file
    holds several.

    `check_files=True` (the default, `inharness run`): the harness runs on this machine, as local
    processes whatever the pool's backend, so the paths it needs must exist here (the dataset file,
    the harness's workingDir). `check_files=False` (`inharness operator render`, the trainer in a
    pod): the paths are inside the containers and are not checked. Either way a pool with backend
    kubernetes must name its harness's image, which the operator needs, so that the same file also
    runs on a cluster (locally the image is not used)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(f"{path}: cannot read: {exc}") from None
    base_dir = path.resolve().parent
    docs = _validate_all(path, _parse_yaml(path, text))
    return _resolve_refs(path, base_dir, docs, run, check_files)


def load_tasks(specs: Specs) -> list[Any]:
    """The run's dataset: its inline tasks, or one task per non-blank line of its JSONL file."""
    dataset = specs.training_run.spec.dataset
    if dataset.tasks is not None:
        return list(dataset.tasks)
    assert dataset.path is not None
    file = specs.resolve(dataset.path)
    tasks: list[Any] = []
    try:
        with file.open(encoding="utf-8") as lines:
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    tasks.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise SpecError(f"{file}: line {number}: not valid JSON: {exc}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(f"{file}: cannot read: {exc}") from None
    if not tasks:
        raise SpecError(f"{file}: no tasks (the dataset file has no JSON lines)")
    return tasks


# --- parsing -----------------------------------------------------------------------------------------


class _Loader(yaml.SafeLoader):
    """Safe YAML that refuses duplicate keys: PyYAML would keep the last one without a word."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                duplicate = key in seen
                seen.add(key)
            except TypeError:
                continue
            if duplicate:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping",
                    node.start_mark,
                    f"found duplicate key {key!r}",
                    key_node.start_mark,
                )
        return super().construct_mapping(node, deep=deep)


def _parse_yaml(path: Path, text: str) -> list[tuple[int, Any]]:
    """(1-based index, document) for each non-empty document."""
    try:
        docs = list(yaml.load_all(text, Loader=_Loader))
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        what = " ".join(p for p in (exc.context, exc.problem) if p)
        raise SpecError(f"{path}: invalid YAML{where}: {what}") from None
    except yaml.YAMLError as exc:
        raise SpecError(f"{path}: invalid YAML: {exc}") from None
    return [(i, d) for i, d in enumerate(docs, 1) if d is not None]


def _label(index: int, doc: Any) -> str:
    if not isinstance(doc, dict):
        return f"document {index}"
    kind = doc.get("kind")
    meta = doc.get("metadata")
    name = meta.get("name") if isinstance(meta, dict) else None
    if isinstance(kind, str) and isinstance(name, str):
        return f'document {index} ({kind} "{name}")'
    if isinstance(kind, str):
        return f"document {index} ({kind})"
    return f"document {index}"


def _validate_all(path: Path, docs: list[tuple[int, Any]]) -> list[tuple[str, Resource]]:
    errors: list[str] = []
    out: list[tuple[str, Resource]] = []
    for index, doc in docs:
        where = f"{path}: {_label(index, doc)}"
        problems = _check_header(doc)
        if problems:
            errors += [f"{where}: {p}" for p in problems]
            continue
        try:
            out.append((where, KINDS[doc["kind"]].model_validate(doc)))
        except ValidationError as exc:
            errors += [f"{where}: {line}" for line in _format(exc)]
    if errors:
        raise SpecError(errors)
    if not out:
        raise SpecError(f"{path}: no documents")
    return out


def _check_header(doc: Any) -> list[str]:
    """apiVersion and kind first: they decide which model the rest is checked against."""
    if not isinstance(doc, dict):
        return [f"expected a mapping with apiVersion, kind, metadata and spec, got {_type_name(doc)}"]
    problems = []
    version = doc.get("apiVersion")
    if version != API_VERSION:
        got = "missing" if version is None else f"got {version!r}"
        problems.append(f"apiVersion: must be {API_VERSION} ({got})")
    kind = doc.get("kind")
    if kind not in KINDS:
        got = "missing" if kind is None else f"unknown kind {kind!r}"
        problems.append(f"kind: {got}; expected one of {', '.join(sorted(KINDS))}")
    return problems


def _type_name(value: Any) -> str:
    return {list: "a list", str: "a string", int: "a number", float: "a number", bool: "a boolean"}.get(
        type(value), type(value).__name__
    )


def _aliases() -> dict[str, str]:
    """snake_case field name -> its camelCase alias, over every spec model."""
    out: dict[str, str] = {}
    for obj in vars(s).values():
        if isinstance(obj, type) and issubclass(obj, BaseModel):
            for name, field in obj.model_fields.items():
                out[name] = field.alias or name
    return out


_ALIASES = _aliases()


def _format(exc: ValidationError) -> list[str]:
    """`spec.env[0].name: message` per error. Defaulted fields are reported by pydantic under their
    Python names; they are shown under the camelCase names the YAML uses."""
    lines = []
    for err in exc.errors(include_url=False):
        loc = ""
        for part in err["loc"]:
            if isinstance(part, int):
                loc += f"[{part}]"
            else:
                loc += ("." if loc else "") + _ALIASES.get(part, part)
        lines.append(f"{loc}: {err['msg']}" if loc else err["msg"])
    return lines


# --- references --------------------------------------------------------------------------------------


def _resolve(base_dir: Path, value: str) -> Path:
    p = Path(value).expanduser()
    return p if p.is_absolute() else base_dir / p


def _names(items: Iterable[tuple[str, Resource]]) -> str:
    names = [f'"{r.metadata.name}"' for _, r in items]
    return ", ".join(names) if names else "none"


def _by_kind(
    path: Path, docs: list[tuple[str, Resource]], errors: list[str]
) -> dict[str, dict[str, tuple[str, Resource]]]:
    """The documents by kind and name (where each was, and it); a duplicate name is an error."""
    by_kind: dict[str, dict[str, tuple[str, Resource]]] = {k: {} for k in KINDS}
    for where, res in docs:
        seen = by_kind[res.kind]
        if res.metadata.name in seen:
            first = seen[res.metadata.name][0].removeprefix(f"{path}: ")
            errors.append(
                f'{where}: metadata.name: duplicate {res.kind} "{res.metadata.name}" (also {first})'
            )
        else:
            seen[res.metadata.name] = (where, res)
    return by_kind


def _choice_errors(path: Path, runs: dict[str, tuple[str, Resource]], run: str | None) -> list[str]:
    """Why no single TrainingRun can be chosen: none, not the named one, or several and no name."""
    if not runs:
        return [
            f"{path}: no TrainingRun document; a spec file holds a TrainingRun, the RolloutPool its "
            "spec.rolloutPoolRef names and the HarnessSpec that pool's spec.harnessRef names"
        ]
    if run is not None and run not in runs:
        return [f'{path}: no TrainingRun "{run}" (TrainingRuns here: {_names(runs.values())})']
    if run is None and len(runs) > 1:
        return [f"{path}: {len(runs)} TrainingRuns ({_names(runs.values())}); choose one by name"]
    return []


def _resolve_refs(
    path: Path, base_dir: Path, docs: list[tuple[str, Resource]], run: str | None, check_files: bool = True
) -> Specs:
    """The chosen TrainingRun with its pool and harness, after checking every reference in the file
    both ways (a missing target, an unreferenced document); every error at once."""
    errors: list[str] = []
    by_kind = _by_kind(path, docs, errors)
    runs, pools, harnesses = by_kind["TrainingRun"], by_kind["RolloutPool"], by_kind["HarnessSpec"]

    used_pools: set[str] = set()
    for where, tr in runs.values():
        assert isinstance(tr, TrainingRun)
        ref = tr.spec.rollout_pool_ref.name
        used_pools.add(ref)
        if ref not in pools:
            errors.append(
                f'{where}: spec.rolloutPoolRef.name: no RolloutPool "{ref}" in this file '
                f"(RolloutPools here: {_names(pools.values())})"
            )
        dataset = tr.spec.dataset.path
        if check_files and dataset is not None and not _resolve(base_dir, dataset).is_file():
            errors.append(f"{where}: spec.dataset.path: file not found: {_resolve(base_dir, dataset)}")

    used_harnesses: set[str] = set()
    for where, pool in pools.values():
        assert isinstance(pool, RolloutPool)
        if pool.metadata.name not in used_pools:
            errors.append(f"{where}: not referenced by any TrainingRun's spec.rolloutPoolRef")
        ref = pool.spec.harness_ref.name
        used_harnesses.add(ref)
        if ref not in harnesses:
            errors.append(
                f'{where}: spec.harnessRef.name: no HarnessSpec "{ref}" in this file '
                f"(HarnessSpecs here: {_names(harnesses.values())})"
            )
            continue
        h_where, harness = harnesses[ref]
        assert isinstance(harness, HarnessSpec)
        errors += _check_pool_with_harness(base_dir, where, pool, h_where, harness, check_files)

    for where, harness in harnesses.values():
        if harness.metadata.name not in used_harnesses:
            errors.append(f"{where}: not referenced by any RolloutPool's spec.harnessRef")

    errors += _choice_errors(path, runs, run)
    if errors:
        raise SpecError(errors)

    tr = runs[run if run is not None else next(iter(runs))][1]
    assert isinstance(tr, TrainingRun)
    pool = pools[tr.spec.rollout_pool_ref.name][1]
    assert isinstance(pool, RolloutPool)
    harness = harnesses[pool.spec.harness_ref.name][1]
    assert isinstance(harness, HarnessSpec)
    return Specs(path=path, base_dir=base_dir, training_run=tr, rollout_pool=pool, harness=harness)


def _check_pool_with_harness(
    base_dir: Path,
    where: str,
    pool: RolloutPool,
    h_where: str,
    harness: HarnessSpec,
    check_files: bool = True,
) -> list[str]:
    """Rules that need both documents: the lease against the harness's timeout, the image the
    operator needs for a kubernetes pool, and (`check_files`) what running the harness here needs."""
    errors = []
    p, h = pool.spec, harness.spec
    lease = p.lease_for(h)
    if p.lease_seconds is None and p.heartbeat_seconds >= lease:
        errors.append(
            f"{where}: spec.heartbeatSeconds: must be less than the lease ({lease}s: the harness's "
            "timeoutSeconds + 60, as spec.leaseSeconds is unset)"
        )
    pool_name = f'RolloutPool "{pool.metadata.name}"'
    if p.backend == "kubernetes" and h.image is None:
        errors.append(f"{h_where}: spec.image: required, as {pool_name} runs it with backend kubernetes")
    if check_files and h.working_dir is not None:
        wd = _resolve(base_dir, h.working_dir)
        if not wd.is_dir():
            errors.append(f"{h_where}: spec.workingDir: not a directory: {wd} ({pool_name} runs it locally)")
    return errors
