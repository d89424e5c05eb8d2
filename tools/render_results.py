"""Render the `make demo` figures of docs/results.md and the README from the files each run wrote.

Why generated: runs 1-10 were transcribed by hand, and two of those records did not add up (run 8's
listed rewards give +0.297 where its row said +0.305, met; runs 2, 3 and 5 list nine last-fifth
rewards where a fifth is eight steps). Each run keeps its figures under docs/results/calc-demo/run-NN/:

- a kept run: `summary.json` and `demo.json` as the demo wrote them, and `rewards.json` (each step's
  `reward_mean` from its metrics.jsonl, with the commit and date). Its row is computed from the
  rewards and checked against summary.json and demo.json.
- a transcribed run: `record.json`, what docs/results.md recorded, its "source" saying so. Its row is
  the demo's printed figures, checked against its listed rewards where each fifth lists a fifth's
  steps (both are shown where they disagree); a footnote flags a list of another length.

Only the text between `<!-- render:NAME -->` and `<!-- /render -->` is replaced; the rest is prose.
`--check` writes nothing and exits 1 naming each region that differs from its render.
`add RUN_DIR --commit C --date D` keeps a finished `make demo` run's files as the next run, then renders.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import shutil
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from inharness.trainer.report import fifth_means, read_metrics

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "docs" / "results" / "calc-demo"
RESULTS_MD = ROOT / "docs" / "results.md"
README = ROOT / "README.md"
REGION = re.compile(r"<!-- render:(?P<name>[a-z0-9-]+) -->(?P<body>.*?)<!-- /render -->", re.S)
MISCOUNTED = "†"
EN_DASH = "\u2013"  # a range in the README's prose
WIDTH = 100  # the docs' prose lines


def _goal() -> tuple[float, int]:
    """The gain and the time limit as examples/calc/demo.py judges a run (defined there once)."""
    spec = importlib.util.spec_from_file_location("calc_demo", ROOT / "examples" / "calc" / "demo.py")
    assert spec is not None and spec.loader is not None
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    return demo.GOAL, demo.LIMIT_SECONDS


GOAL, LIMIT_SECONDS = _goal()


@dataclass(frozen=True)
class Fifth:
    """The rewards listed for the first or the last fifth of a run's steps, and the mean shown for it."""

    name: str
    rewards: list[float]
    shown: float
    size: int
    per_step: int

    @property
    def counts(self) -> list[int]:
        """Each step's reward is a count out of the step's rollouts, so two decimals recover it exactly."""
        return [round(r * self.per_step) for r in self.rewards]

    @property
    def complete(self) -> bool:
        return len(self.rewards) == self.size

    def mean(self, start: int = 0) -> float:
        """Mean of `size` listed rewards from `start`, from their counts."""
        return sum(self.counts[start : start + self.size]) / (self.size * self.per_step)


@dataclass(frozen=True)
class Run:
    """One `make demo` run as the table shows it: kept runs' figures computed, transcribed ones' printed."""

    number: int
    first: Fifth
    last: Fifth
    gain: float
    seconds: float
    met: bool
    steps: int
    transcribed: bool

    @property
    def miscounted(self) -> list[Fifth]:
        return [f for f in (self.first, self.last) if not f.complete]

    @property
    def derived(self) -> tuple[float, float] | None:
        """First and last fifth from the listed rewards, where both lists are complete."""
        if self.miscounted:
            return None
        return self.first.mean(), self.last.mean()


def _kept(number: int, folder: Path) -> Run:
    summary = json.loads((folder / "summary.json").read_text())
    demo = json.loads((folder / "demo.json").read_text())["rollout_level"]
    rewards = json.loads((folder / "rewards.json").read_text())["reward_mean"]
    first, last = fifth_means(rewards)
    size, per_step = len(rewards) // 5, summary["rollouts"] // summary["steps"]
    checks = {
        "steps": (summary["steps"], len(rewards)),
        "first fifth": (summary["reward_first_fifth"], first),
        "last fifth": (summary["reward_last_fifth"], last),
        "gain": (demo["gain"], last - first),
        "met": (demo["met"], last - first >= GOAL and demo["seconds"] <= LIMIT_SECONDS),
    }
    for what, (written, computed) in checks.items():
        if abs(written - computed) > 1e-9:
            raise ValueError(f"run {number}: {what} {written} in its files, {computed} from its rewards")
    return Run(
        number=number,
        first=Fifth("first", rewards[:size], first, size, per_step),
        last=Fifth("last", rewards[-size:], last, size, per_step),
        gain=last - first,
        seconds=demo["seconds"],
        met=demo["met"],
        steps=len(rewards),
        transcribed=False,
    )


def _transcribed(number: int, folder: Path) -> Run:
    record = json.loads((folder / "record.json").read_text())
    printed = record["printed"]
    size, per_step = record["steps"] // 5, record["rollouts"] // record["steps"]
    run = Run(
        number=number,
        first=Fifth("first", record["rewards_first_fifth"], printed["first_fifth"], size, per_step),
        last=Fifth("last", record["rewards_last_fifth"], printed["last_fifth"], size, per_step),
        gain=printed["gain"],
        seconds=printed["seconds"],
        met=record["met"],
        steps=record["steps"],
        transcribed=True,
    )
    derived = run.derived
    if run.met and not (
        run.gain >= GOAL
        and run.seconds <= LIMIT_SECONDS
        and (derived is None or derived[1] - derived[0] >= GOAL)
    ):
        raise ValueError(f"run {number}: recorded as met, but its figures do not meet the goal")
    return run


def load_runs(folder: Path | None = None) -> list[Run]:
    """Every run under `folder` (default RUNS: run-NN/), in order."""
    runs = []
    for sub in sorted((RUNS if folder is None else folder).glob("run-*")):
        number = int(sub.name.removeprefix("run-"))
        runs.append(_transcribed(number, sub) if (sub / "record.json").exists() else _kept(number, sub))
    return runs


def _three(x: float) -> str:
    return f"{x:.3f}"


def _agrees(run: Run) -> bool:
    """Whether the listed rewards give the row's figures (vacuously, where a list is miscounted)."""
    derived = run.derived
    return derived is None or (_three(derived[0]), _three(derived[1])) == (
        _three(run.first.shown),
        _three(run.last.shown),
    )


def runs_table(runs: list[Run]) -> str:
    lines = [
        "| run | first fifth → last fifth | gain | time (warm-up included) | met |",
        "|---|---|---|---|---|",
    ]
    for run in runs:
        label = f"{run.number} {MISCOUNTED}" if run.miscounted else f"{run.number}"
        fifths = f"{_three(run.first.shown)} → {_three(run.last.shown)}"
        gain = f"{run.gain:+.3f}"
        met = "yes" if run.met else "no"
        derived = run.derived
        if derived is not None and not _agrees(run):
            fifths += f" as printed; {_three(derived[0])} → {_three(derived[1])} from the rewards below"
            gain += f" printed; {derived[1] - derived[0]:+.3f} below"
            met = "yes" if run.met else "counted as no"
        lines.append(f"| {label} | {fifths} | {gain} | {run.seconds:.0f} s | {met} |")
    return "\n".join(lines)


def rewards_list(runs: list[Run]) -> str:
    def two(rewards: list[float]) -> str:
        return " ".join(f"{r:.2f}" for r in rewards)

    return "\n".join(f"- run {r.number}: {two(r.first.rewards)} | {two(r.last.rewards)}" for r in runs)


def _names(numbers: list[int], word: str = "run") -> str:
    """`run 8`, `runs 2 and 3`, `runs 2, 3 and 5`."""
    if len(numbers) == 1:
        return f"{word} {numbers[0]}"
    return f"{word}s {', '.join(map(str, numbers[:-1]))} and {numbers[-1]}"


def _window(fifth: Fifth) -> str:
    """Which `size` consecutive values of a miscounted list average the mean shown for it."""
    starts = [
        s for s in range(len(fifth.rewards) - fifth.size + 1) if _three(fifth.mean(s)) == _three(fifth.shown)
    ]
    shown = _three(fifth.shown)
    if not starts:
        return f"no {fifth.size} in a row average the printed {shown}"
    where = {0: "first", len(fifth.rewards) - fifth.size: "last"}
    return " and ".join(
        f"the {where.get(s, f'{s + 1}th to {s + fifth.size}th')} {fifth.size} average {shown}, as printed"
        for s in starts
    )


def notes(runs: list[Run]) -> str:
    """A sentence per run whose rewards contradict its row, a footnote for each kind of miscounted list."""
    paragraphs = []
    for run in runs:
        derived = run.derived
        if derived is None or _agrees(run):
            continue
        wrong = [
            f for f, d in zip((run.first, run.last), derived, strict=True) if _three(d) != _three(f.shown)
        ]
        said = "; ".join(
            f"its {len(f.rewards)} {f.name}-fifth rewards (counts out of {f.per_step}: "
            f"{', '.join(map(str, f.counts))}) average {_three(f.mean())} "
            f"where the demo printed {_three(f.shown)}"
            for f in wrong
        )
        gain = derived[1] - derived[0]
        below = ", below the goal" if gain < GOAL else ""
        counted = "met" if run.met else "not met"
        paragraphs.append(
            f"Run {run.number}: {said}, which makes its gain {gain:+.3f} (printed {run.gain:+.3f}){below}; "
            f"the table shows both, and the run counts as {counted}."
        )
    kinds: dict[tuple[str, int, int], list[Run]] = {}
    for run in runs:
        for fifth in run.miscounted:
            kinds.setdefault((fifth.name, len(fifth.rewards), run.steps), []).append(run)
    for (name, listed, steps), flagged in kinds.items():
        size = steps // 5
        windows = "; ".join(
            f"run {r.number}: {_window(r.first if name == 'first' else r.last)}" for r in flagged
        )
        paragraphs.append(
            f"{MISCOUNTED} {_names([r.number for r in flagged]).capitalize()} list {listed} {name}-fifth "
            f"values where a fifth of {steps} steps is {size}: the table shows the demo's printed figures "
            f"and the lists keep every value recorded ({windows})."
        )
    return "\n\n".join(textwrap.fill(p, WIDTH, break_on_hyphens=False) for p in paragraphs)


def readme_record(runs: list[Run]) -> str:
    """The README's sentence: runs met of recorded, the met runs' range, and why each other one was not."""
    met = [r for r in runs if r.met]
    gains, times = [r.gain for r in met], [r.seconds for r in met]
    sentence = (
        f"it met the goal in {len(met)} of {len(runs)} recorded runs, gaining {min(gains):+.2f} to "
        f"{max(gains):+.2f} in {min(times):.0f}{EN_DASH}{max(times):.0f} s"
    )
    others = []
    for run in runs:
        derived = run.derived
        if run.met:
            continue
        if derived is not None and not _agrees(run):
            others.append(
                f"run {run.number}'s record does not add up "
                f"({derived[1] - derived[0]:+.3f} from its rewards) and counts as not met"
            )
        elif run.gain < GOAL:
            others.append(f"run {run.number} gained {run.gain:+.3f} in {run.seconds:.0f} s, short of +{GOAL}")
        else:
            others.append(f"run {run.number} took {run.seconds:.0f} s, over {LIMIT_SECONDS // 60} minutes")
    return sentence + ("; " + ", and ".join(others) if others else "")


def _block(render: Callable[[list[Run]], str]) -> Callable[[list[Run]], str]:
    """A region on lines of its own, blank lines around it so that markdown keeps it one block."""
    return lambda runs: f"\n\n{render(runs)}\n\n"


RENDERS: dict[Path, dict[str, Callable[[list[Run]], str]]] = {
    RESULTS_MD: {
        "calc-demo-runs": _block(runs_table),
        "calc-demo-rewards": _block(rewards_list),
        "calc-demo-notes": _block(notes),
    },
    README: {"calc-demo-record": readme_record},
}


def apply(text: str, bodies: dict[str, str]) -> tuple[str, list[str]]:
    """`text` with each region's body replaced, and the names of the regions whose body changed."""
    found = [m["name"] for m in REGION.finditer(text)]
    if sorted(found) != sorted(bodies):
        raise ValueError(f"regions {found}, expected each of {sorted(bodies)} once")
    changed = [m["name"] for m in REGION.finditer(text) if m["body"] != bodies[m["name"]]]

    def body(m: re.Match[str]) -> str:
        return f"<!-- render:{m['name']} -->{bodies[m['name']]}<!-- /render -->"

    return REGION.sub(body, text), changed


def render(*, check: bool, runs: list[Run] | None = None) -> list[str]:
    """Render every region, writing the files unless `check`; `FILE: REGION` for each that differed."""
    runs = load_runs() if runs is None else runs
    rendered = {
        path: apply(path.read_text(), {n: r(runs) for n, r in rs.items()}) for path, rs in RENDERS.items()
    }
    if not check:
        for path, (text, changed) in rendered.items():
            if changed:
                path.write_text(text)
    return [
        f"{path.relative_to(ROOT)}: {name}" for path, (_, changed) in rendered.items() for name in changed
    ]


def add(run_dir: Path, *, commit: str, date: str) -> Path:
    """Keep a finished `make demo` run (its --out folder) as the next run-NN, its small files only."""
    numbers = [int(p.name.removeprefix("run-")) for p in RUNS.glob("run-*")]
    dest = RUNS / f"run-{max(numbers, default=0) + 1:02d}"
    dest.mkdir(parents=True)
    shutil.copy(run_dir / "demo.json", dest / "demo.json")
    shutil.copy(run_dir / "rollout-level" / "summary.json", dest / "summary.json")
    rewards = {
        "commit": commit,
        "date": date,
        "source": "the run's own files: summary.json and demo.json as written, reward_mean of each step "
        "from its metrics.jsonl",
        "reward_mean": [m["reward_mean"] for m in read_metrics(run_dir / "rollout-level" / "metrics.jsonl")],
    }
    (dest / "rewards.json").write_text(json.dumps(rewards, indent=2) + "\n")
    return dest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a region differs")
    sub = parser.add_subparsers(dest="command")
    adding = sub.add_parser("add", help="keep a finished make demo run as the next run, then render")
    adding.add_argument("run_dir", type=Path, help="the demo's --out folder (default runs/calc-demo)")
    adding.add_argument("--commit", required=True, help="the commit the run was made at")
    adding.add_argument("--date", required=True, help="YYYY-MM-DD")
    args = parser.parse_args(argv)
    if args.command == "add":
        print(f"kept {add(args.run_dir, commit=args.commit, date=args.date).relative_to(ROOT)}")
    differ = render(check=args.check)
    for line in differ:
        print(f"{'differs from its render' if args.check else 'rendered'}: {line}")
    return 1 if args.check and differ else 0


if __name__ == "__main__":
    sys.exit(main())
