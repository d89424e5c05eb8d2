"""`inharness simulate`: flags and the handler. Imports only the standard library at the top, since
`inharness`'s parser adds these flags for every subcommand; the simulation loads when it runs."""

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

MODES = ("sync", "async", "collocated-async")  # == params.MODES, checked by the tests
PRESET_NAMES = ("swe", "calc")  # == params.PRESETS


def _at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"'{text}' is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum} (got {value})")
        return value

    return parse


def _modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise argparse.ArgumentTypeError(
            f"{', '.join(unknown) or 'nothing'}: not a mode; choose from {','.join(MODES)}"
        )
    return list(dict.fromkeys(modes))


def _workload(text: str) -> Any:
    from inharness.trainer.simulate.params import load

    try:
        return load(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(_plain(exc)) from None


def _run_dir(text: str) -> Path:
    path = Path(text)
    if not (path / "gateway.db").is_file() and not (path.is_file() and path.suffix == ".db"):
        raise argparse.ArgumentTypeError(f"{text}: no gateway.db there (a run directory of `inharness run`)")
    return path


def _plain(exc: Exception) -> str:
    """A pydantic error as one line per field (`shape.gpus: ...`), anything else as its message."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        return "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in errors())
    return str(exc)


def add_arguments(p: argparse.ArgumentParser) -> None:
    source = p.add_mutually_exclusive_group()
    source.add_argument(
        "--workload",
        type=_workload,
        default=None,
        metavar="swe|calc|FILE",
        help="a preset, or a YAML/JSON file of overrides on one (`preset: calc`, then any of shape, "
        "workload, hardware; docs/simulate.md). Default: swe",
    )
    source.add_argument(
        "--from-run",
        type=_run_dir,
        default=None,
        metavar="DIR",
        help="resample the workload a run recorded (DIR/gateway.db, DIR/metrics.jsonl)",
    )
    ints: tuple[tuple[str, int, str], ...] = (
        ("--gpus", 1, "GPUs of the run (async: split between generation and training)"),
        ("--steps", 1, "updates to simulate"),
        ("--batch-size", 1, "groups per update"),
        ("--group-size", 1, "rollouts per group"),
        ("--max-staleness", 1, "K of the async modes: versions a trained sample may lag"),
        ("--train-gpus", 1, "async: GPUs that train (default half); the rest generate"),
        ("--concurrency", 1, "rollouts at once, the pool's parallelism (default and most: K+1 batches)"),
    )
    for flag, minimum, text in ints:
        p.add_argument(
            flag, type=_at_least(minimum), default=None, metavar="N", help=f"{text}; default: the workload's"
        )
    p.add_argument(
        "--modes",
        type=_modes,
        default=None,
        help=f"comma-separated, of {','.join(MODES)} (default: every mode the GPUs allow)",
    )
    p.add_argument("--seed", type=int, default=0, help="the rollouts drawn (the same in every mode)")
    p.add_argument("--out", type=Path, default=Path("runs/simulate"), help="where PNGs and summary.json go")


_SHAPE_FLAGS = ("gpus", "steps", "batch_size", "group_size", "max_staleness", "train_gpus", "concurrency")


def run(args: argparse.Namespace) -> int:
    from inharness.trainer.simulate.engine import Sim
    from inharness.trainer.simulate.fit import fit_run
    from inharness.trainer.simulate.params import SWE, override
    from inharness.trainer.simulate.report import headline, plot_timeline, summarize, table, write_summary

    def fail(message: str) -> int:
        print(f"inharness simulate: {message}", file=sys.stderr)
        return 2

    fitted = None
    if args.from_run is not None:
        try:
            fitted = fit_run(args.from_run)
        except ValueError as exc:
            return fail(f"--from-run: {_plain(exc)}")
        params = fitted.params
    else:
        params = args.workload or SWE
    shape = {k: getattr(args, k) for k in _SHAPE_FLAGS if getattr(args, k) is not None}
    try:
        params = override(params, {"shape": shape})
    except ValueError as exc:
        return fail(_plain(exc))
    modes = args.modes or params.modes_possible()
    for mode in modes:
        try:
            params.check_mode(mode)
        except ValueError as exc:
            return fail(str(exc))

    try:
        sims = [Sim(params, mode, args.seed).run() for mode in modes]
    except RuntimeError as exc:  # admission control dropping nearly everything
        return fail(str(exc))
    print(headline(params, args.seed))
    if args.modes is None and "async" not in modes:
        print("(async left out: it needs 2 GPUs or more, one to generate and one to train)")
    if fitted is not None:
        for note in fitted.notes:
            print(f"note: {note}")
    print()
    print(table([summarize(s) for s in sims]))
    extra: dict[str, object] = {}
    if fitted is not None and fitted.recorded_steps_per_hour is not None:
        print(
            f"\nrecorded by the run itself: {fitted.recorded_steps_per_hour:.2f} steps/hour "
            f"(max staleness {fitted.recorded_max_staleness})"
        )
        extra = {
            "recorded_steps_per_hour": fitted.recorded_steps_per_hour,
            "recorded_max_staleness": fitted.recorded_max_staleness,
            "notes": fitted.notes,
        }
    args.out.mkdir(parents=True, exist_ok=True)
    until = max(s.end or 0.0 for s in sims)
    zoom = 3 * max((s.end or 0.0) / s.steps_done for s in sims)  # three of the slowest mode's steps
    for sim in sims:
        plot_timeline(sim, args.out / f"timeline-{sim.mode}.png", until=until, zoom=zoom)
    write_summary(args.out / "summary.json", params, args.seed, sims, extra)
    print(f"\nwrote {args.out}/summary.json and timeline-<mode>.png")
    return 0
