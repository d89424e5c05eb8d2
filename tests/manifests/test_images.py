"""The Dockerfiles, read statically (no container engine here: `make images` builds them), and the
scripts behind `make images` and `make e2e` where docker and kind are missing."""

import fnmatch
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from manifest_support import ROOT

DOCKER = ROOT / "docker"
IMAGES = ("inharness", "trainer", "calc-harness")


def instructions(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in (DOCKER / f"Dockerfile.{name}").read_text(encoding="utf-8").splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        word, _, rest = (pending + line).strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        pending = ""
    return out


def args_of(name: str) -> dict[str, str]:
    return dict(a.split("=", 1) for w, a in instructions(name) if w == "ARG" and "=" in a)


def index(steps: list[tuple[str, str]], word: str, needle: str) -> int:
    found = [i for i, (w, a) in enumerate(steps) if w == word and needle in a]
    assert found, f"no {word} with {needle!r}"
    return found[0]


@pytest.mark.parametrize("name", IMAGES)
def test_image_runs_as_uid_1000_in_workspace(name: str) -> None:
    steps = instructions(name)
    users = [a for w, a in steps if w == "USER"]
    assert users and users[-1] in ("1000", "1000:1000"), users
    assert [a for w, a in steps if w == "WORKDIR"][-1] == "/workspace"


@pytest.mark.parametrize("name", IMAGES)
def test_base_images_and_packages_are_pinned(name: str) -> None:
    steps = instructions(name)
    frm = [a for w, a in steps if w == "FROM"]
    args = args_of(name)
    for ref in frm:
        image = args.get(ref.strip("${}").split()[0], ref) if ref.startswith("$") else ref
        assert ":" in image and not image.endswith(":latest"), f"{name}: unpinned base {image}"
    for _, run in (s for s in steps if s[0] == "RUN" and "pip install" in s[1]):
        for token in run.split():
            if token.startswith('"') and "==" not in token and "/src" not in token:
                pytest.fail(f"{name}: unpinned package {token}")


def test_inharness_image_is_python_slim_with_cpu_torch_before_the_package() -> None:
    steps = instructions("inharness")
    assert args_of("inharness")["PYTHON_IMAGE"] == "python:3.11-slim"
    torch = index(steps, "RUN", "torch==")
    assert "--index-url https://download.pytorch.org/whl/cpu" in steps[torch][1]
    package = index(steps, "RUN", "pip install /src")
    sources = index(steps, "COPY", "pyproject.toml")
    assert torch < sources < package
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert f"torch=={args_of('inharness')['TORCH_VERSION']}" in deps


def test_trainer_image_is_cuda_with_a_pinned_verl() -> None:
    args = args_of("trainer")
    assert args["CUDA_IMAGE"].startswith("nvidia/cuda:") and "runtime" in args["CUDA_IMAGE"]
    assert args["VERL_VERSION"].count(".") == 2
    steps = instructions("trainer")
    assert (
        index(steps, "RUN", "torch==")
        < index(steps, "RUN", "verl==")
        < index(steps, "RUN", "pip install --no-deps /src")
    )
    assert "python3.11" in steps[index(steps, "RUN", "apt-get")][1]


def test_trainer_image_takes_the_project_pins_but_those_vllm_decides() -> None:
    """torch and verl as pyproject.toml pins them; vLLM beside them in the same pip run as the project's
    other pins, read from pyproject.toml at build time, less fastapi and numpy (vLLM's bounds win); the
    package itself without its dependencies, so that its own fastapi and numpy pins do not undo that."""
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    args = args_of("trainer")
    assert f"torch=={args['TORCH_VERSION']}" in deps and f"verl=={args['VERL_VERSION']}" in deps
    assert args["VLLM_VERSION"].count(".") == 2
    steps = instructions("trainer")
    resolve = steps[index(steps, "RUN", "vllm==")][1]
    assert "pyproject.toml" in resolve and "pip install -r /src/requirements.txt" in resolve
    skipped = resolve.split("sep=chr(10))'", 1)[1].split(">", 1)[0].split()
    assert skipped == ["fastapi", "numpy", "torch", "verl"]
    assert index(steps, "COPY", "pyproject.toml") < index(steps, "RUN", "vllm==")


def test_calc_harness_image_carries_the_example_and_its_model_in_workspace() -> None:
    steps = instructions("calc-harness")
    assert args_of("calc-harness")["BASE_IMAGE"] == "ghcr.io/inharness/inharness:dev"
    copy = steps[index(steps, "COPY", "examples/calc/")][1]
    assert copy.split()[-1] == "/workspace/"
    model = index(steps, "RUN", "prepare_model")
    assert index(steps, "COPY", "examples/calc/") < model
    assert "openai==" in steps[index(steps, "RUN", "openai")][1]
    # prepare_model writes examples/calc/model beside demo.py: /workspace/model, the spec's `model`.
    import yaml

    spec = [d for d in yaml.safe_load_all((ROOT / "examples" / "calc" / "trainingrun.yaml").read_text()) if d]
    run = next(d for d in spec if d["kind"] == "TrainingRun")
    assert run["spec"]["model"]["path"] == "model"
    assert (ROOT / "examples" / "calc" / run["spec"]["dataset"]["path"]).is_file()
    # ... which is where the operator's render points the run's gateway (and the trainer's cwd).
    from inharness.operator import render
    from inharness.operator.specfile import load_specs

    specs = load_specs(ROOT / "examples" / "calc" / "trainingrun.yaml", check_files=False)
    objs = render.render_children(
        specs.training_run,
        specs.rollout_pool,
        specs.harness,
        settings=render.RenderSettings(gateway_image="g", trainer_image="t"),
        admin_token="x" * 16,
    )
    by_kind = {o["kind"]: o for o in objs}
    (gateway,) = by_kind["Deployment"]["spec"]["template"]["spec"]["containers"]
    (trainer,) = by_kind["StatefulSet"]["spec"]["template"]["spec"]["containers"]
    assert gateway["args"][gateway["args"].index("--model") + 1] == "/workspace/model"
    assert gateway["workingDir"] == trainer["workingDir"] == "/workspace"


def dockerignore_keeps(path: str) -> bool:
    """Whether the build context keeps `path` (the last matching .dockerignore pattern wins)."""
    keep = True
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate, pattern = line.startswith("!"), line.lstrip("!").rstrip("/")
        parts = path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        # fnmatch's * also matches "/", so "**" and "**/x" match at any depth.
        if any(pattern == "**" or fnmatch.fnmatch(p, pattern) for p in prefixes):
            keep = negate
    return keep


@pytest.mark.parametrize("name", IMAGES)
def test_every_copied_source_exists_and_is_in_the_build_context(name: str) -> None:
    for word, arg in instructions(name):
        if word != "COPY":
            continue
        *sources, _ = [a for a in arg.split() if not a.startswith("--")]
        for src in sources:
            assert (ROOT / src).exists(), f"{name}: COPY {src}: no such path"
            assert dockerignore_keeps(src.rstrip("/")), f"{name}: COPY {src} is excluded by .dockerignore"


def test_build_context_leaves_out_the_local_model_and_the_venv() -> None:
    assert not dockerignore_keeps("examples/calc/model")
    assert not dockerignore_keeps(".venv")
    assert not dockerignore_keeps("app/inharness/__pycache__")
    assert dockerignore_keeps("examples/calc/harness.py")


# --- make images / make e2e without a container engine ----------------------------------------------


def restricted_path(tmp: Path) -> str:
    """A PATH with the shell tools the scripts use but neither docker, podman nor kind."""
    for tool in ("bash", "dirname", "basename", "grep", "mktemp", "rm", "env"):
        found = shutil.which(tool)
        assert found, tool
        (tmp / tool).symlink_to(found)
    return str(tmp)


def test_make_e2e_skips_with_what_it_needs_when_docker_and_kind_are_missing(tmp_path: Path) -> None:
    env = {"PATH": restricted_path(tmp_path), "HOME": str(tmp_path)}
    out = subprocess.run(
        ["bash", str(ROOT / "tools" / "e2e.sh")], env=env, capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == "make e2e needs docker and kind on PATH; skipping\n"


def test_make_images_fails_naming_the_missing_engine(tmp_path: Path) -> None:
    env = {"PATH": restricted_path(tmp_path), "HOME": str(tmp_path)}
    out = subprocess.run(
        ["bash", str(ROOT / "tools" / "images.sh")], env=env, capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 1
    assert "make images needs docker or podman on PATH" in out.stderr


def test_e2e_script_is_valid_bash() -> None:
    for script in ("e2e.sh", "images.sh"):
        path = ROOT / "tools" / script
        assert os.access(path, os.X_OK), f"{script} is not executable"
        subprocess.run(["bash", "-n", str(path)], check=True, timeout=30)
