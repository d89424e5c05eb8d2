"""docs/results.md's `make demo` figures and the README's sentence about them are their render from
the runs' files under docs/results/calc-demo/ (tools/render_results.py): the committed text agrees,
and a changed figure, the text as it was before the render, or a run file that contradicts its own
rewards is caught."""

import importlib.util
import json
import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("render_results", ROOT / "tools" / "render_results.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


rr = load()

# As they stood before the render: the README counted 8 of 10, and run 8's row said met.
OLD_README = (
    "it met the goal in 8 of 10 recorded runs, gaining +0.36 to +0.49 in 420\u2013504 s; the eighth's record "
    "does not add up (+0.297 from its rewards) and counts as not met, and the tenth gained +0.297 in "
    "435 s, just short"
)
OLD_RUN_8 = "| 8 | 0.355 → 0.660 | +0.305 | 430 s | yes |"


@pytest.fixture
def copies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """docs/results.md and README.md copied, the render pointed at the copies (the runs stay real)."""
    renders = {}
    for path, regions in rr.RENDERS.items():
        copy = tmp_path / path.relative_to(ROOT)
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.write_text(path.read_text())
        renders[copy] = regions
    monkeypatch.setattr(rr, "ROOT", tmp_path)
    monkeypatch.setattr(rr, "RENDERS", renders)
    return {p.name: p for p in renders}


def region(text: str, name: str) -> str:
    return next(m["body"] for m in rr.REGION.finditer(text) if m["name"] == name)


def test_committed_text_is_its_render() -> None:
    assert rr.render(check=True) == []


def test_check_names_a_changed_figure_and_render_restores_it(
    copies: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    results = copies["results.md"]
    row = "| 11 | 0.406 → 0.742 | +0.336 | 541 s | yes |"
    assert row in results.read_text()
    results.write_text(results.read_text().replace(row, row.replace("+0.336", "+0.346")))
    assert rr.main(["--check"]) == 1
    assert "differs from its render: docs/results.md: calc-demo-runs" in capsys.readouterr().out
    assert rr.main([]) == 0
    assert row in results.read_text()
    assert rr.main(["--check"]) == 0


@pytest.mark.parametrize(
    ("name", "region_name", "old"),
    [("README.md", "calc-demo-record", OLD_README), ("results.md", "calc-demo-runs", OLD_RUN_8)],
)
def test_the_text_before_the_render_fails_the_check(
    copies: dict[str, Path], name: str, region_name: str, old: str
) -> None:
    path = copies[name]
    text = path.read_text()
    body = region(text, region_name)
    if region_name == "calc-demo-runs":
        new_row = next(line for line in body.splitlines() if line.startswith("| 8 |"))
        path.write_text(text.replace(new_row, old))
    else:
        path.write_text(text.replace(body, old))
    assert rr.render(check=True) == [f"{path.relative_to(rr.ROOT)}: {region_name}"]


def test_run_8_is_resolved_from_its_rewards_and_nine_value_lists_are_flagged() -> None:
    runs = {r.number: r for r in rr.load_runs()}
    first, last = runs[8].derived
    assert (first * 256, last * 256) == (91, 167)  # counts out of 32 over 8 steps
    table = rr.runs_table(list(runs.values()))
    assert "| +0.305 printed; +0.297 below | 430 s | counted as no |" in table
    assert [n for n, r in runs.items() if r.miscounted] == [2, 3, 5]
    assert all(f"| {n} † |" in table for n in (2, 3, 5))
    notes = rr.notes(list(runs.values()))
    assert "Runs 2, 3 and 5 list 9 last-fifth values" in " ".join(notes.split())
    assert all(r.transcribed for n, r in runs.items() if n <= 10)


def test_a_kept_run_whose_files_contradict_its_rewards_is_refused(tmp_path: Path) -> None:
    shutil.copytree(rr.RUNS / "run-11", tmp_path / "run-11")
    summary = tmp_path / "run-11" / "summary.json"
    written = json.loads(summary.read_text())
    assert rr.load_runs(tmp_path)[0].gain == written["reward_gain"]
    summary.write_text(json.dumps({**written, "reward_last_fifth": 0.75}))
    with pytest.raises(ValueError, match="run 11: last fifth"):
        rr.load_runs(tmp_path)


def test_a_transcribed_run_counted_met_against_its_rewards_is_refused(tmp_path: Path) -> None:
    shutil.copytree(rr.RUNS / "run-08", tmp_path / "run-08")
    record = tmp_path / "run-08" / "record.json"
    record.write_text(json.dumps({**json.loads(record.read_text()), "met": True}))
    with pytest.raises(ValueError, match="run 8: recorded as met"):
        rr.load_runs(tmp_path)


def test_add_keeps_a_demo_runs_small_files_as_the_next_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs = tmp_path / "runs"
    shutil.copytree(rr.RUNS, runs)
    monkeypatch.setattr(rr, "RUNS", runs)
    kept = rr.RUNS / "run-11"
    out = tmp_path / "calc-demo"
    (out / "rollout-level").mkdir(parents=True)
    shutil.copy(kept / "demo.json", out / "demo.json")
    shutil.copy(kept / "summary.json", out / "rollout-level" / "summary.json")
    rewards = json.loads((kept / "rewards.json").read_text())["reward_mean"]
    lines = [json.dumps({"step": i, "reward_mean": r}) for i, r in enumerate(rewards)]
    (out / "rollout-level" / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    assert rr.add(out, commit="abc1234", date="2026-12-08") == runs / "run-12"
    assert sorted(p.name for p in (runs / "run-12").iterdir()) == [
        "demo.json",
        "rewards.json",
        "summary.json",
    ]
    loaded = rr.load_runs()
    assert rr.runs_table(loaded).endswith("| 12 | 0.406 → 0.742 | +0.336 | 541 s | yes |")
    assert rr.readme_record(loaded).startswith("it met the goal in 10 of 12 recorded runs")
