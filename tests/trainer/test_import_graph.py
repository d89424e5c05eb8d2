"""The trainer's modules import one another without a circle: read from their source, every import
counted (top-level, inside functions, under ``TYPE_CHECKING``), so a lazy import cannot hide one."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "trainer" / "inharness" / "trainer"


def module_name(path: Path) -> str:
    parts = ("inharness", *path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(node: ast.Import | ast.ImportFrom, here: str, is_package: bool) -> list[str]:
    """The modules an import statement may load: ``from a import b`` names ``a`` and ``a.b``."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        anchor = here.split(".")[: len(here.split(".")) - node.level + int(is_package)]
        base = ".".join([*anchor, base] if base else anchor)
    return [base, *(f"{base}.{alias.name}" for alias in node.names)]


def trainer_graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        tree = ast.parse(path.read_text())
        nodes = [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)]
        targets = {t for n in nodes for t in imported(n, name, path.name == "__init__.py")}
        graph[name] = {t for t in targets if t in paths and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of imports (its modules in order, the first repeated at the end), or None."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return [*path[path.index(node) :], node]
        if node in done:
            return None
        for target in sorted(graph[node]):
            if cycle := visit(target, [*path, node]):
                return cycle
        done.add(node)
        return None

    return next((c for n in sorted(graph) if (c := visit(n, []))), None)


def test_the_trainer_has_no_import_cycle() -> None:
    graph = trainer_graph()
    assert len(graph) > 20, sorted(graph)  # the walk found the package
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_config_is_a_leaf_and_only_app_builds_the_policy() -> None:
    graph = trainer_graph()
    assert graph["inharness.trainer.config"] == {"inharness.trainer.algorithms"}
    assert not [m for m, targets in graph.items() if "inharness.trainer.build" in targets]


@pytest.mark.parametrize(
    ("graph", "cycle"),
    [
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
        ({"a": {"b"}, "b": set(), "c": {"b"}}, None),
        ({"a": {"a"}}, ["a", "a"]),
    ],
)
def test_find_cycle_names_the_circle(graph: dict[str, set[str]], cycle: list[str] | None) -> None:
    assert find_cycle(graph) == cycle
