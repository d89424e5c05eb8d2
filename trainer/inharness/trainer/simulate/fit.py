"""`--from-run DIR`: a workload resampled from what a real run recorded.

The gateway store (`DIR/gateway.db`, read through the store's own table definitions) gives, per
finished attempt: calls per rollout, the first prompt and the tokens each later call added to its
parent, response tokens, the gaps between calls (tool time), the time before the first call
(startup) and after the last (finish). These become `Dist(values=...)`, resampled as observed.

Decode speed is fitted to the sharing model of `Hardware`: each call's rate (response tokens over
its duration, prefill included, so `prefill_tokens_per_s` is None) against how many calls ran with
it. The single-stream speed is the median rate of calls that ran alone; the GPU's throughput is the
best median of rate x concurrency over concurrency levels seen often enough. A run that never
filled its engine shows a lower bound on throughput, and the fit says so.

Training comes from `DIR/metrics.jsonl` (`time_update_s`, `tokens`, `time_publish_s`). Its `tokens`
are generated tokens only, so they are scaled by the store's ratio of trained tokens (prompt added +
response) to response tokens. The shape (engines as GPUs, group size, batch size, the pool's
parallelism) is read from the run too; whatever cannot be read keeps the base preset's value and
is listed in `notes`.
"""

import itertools
import json
import statistics
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from sqlalchemy import create_engine, func, inspect, literal, select

from inharness.gateway.codec import pack_ids
from inharness.gateway.store.tables import attempts, calls, rollouts
from inharness.trainer.simulate.params import CALC, Params, override

_ID_BYTES = len(pack_ids([0]))  # the store keeps token ids packed, this many bytes each
_MIN_CALLS_PER_LEVEL = 10  # a concurrency level with fewer calls says little about speed


@dataclass
class FittedRun:
    params: Params
    notes: list[str] = field(default_factory=list)
    recorded_steps_per_hour: float | None = None  # what the run itself achieved
    recorded_max_staleness: int | None = None


@dataclass
class _Attempt:
    claimed: float
    finished: float
    calls: list[Any] = field(default_factory=list)


def _store_path(run: Path) -> Path:
    path = run / "gateway.db" if run.is_dir() else run
    if not path.is_file():
        raise ValueError(f"{run}: no gateway store (expected {run / 'gateway.db'})")
    return path


def _read_store(path: Path) -> tuple[list[_Attempt], list[int], int]:
    """(finished attempts with their first-choice calls, group sizes, engines seen)."""
    engine = create_engine(f"sqlite:///{path}")
    try:
        with engine.connect() as conn:
            # A continuation stores only the ids its prompt adds after its first `prompt_prefix`
            # (store migration 6); a store written before that has no such column and stores prompts whole.
            stored = {c["name"] for c in inspect(conn).get_columns("calls")}
            prefix = func.coalesce(calls.c.prompt_prefix, 0) if "prompt_prefix" in stored else literal(0)
            found: dict[str, _Attempt] = {}
            for a in conn.execute(
                select(attempts.c.id, attempts.c.claimed_at, attempts.c.finished_at).where(
                    attempts.c.finished_at.is_not(None)
                )
            ):
                found[a.id] = _Attempt(a.claimed_at, a.finished_at)
            query = (
                select(
                    calls.c.id,
                    calls.c.attempt_id,
                    calls.c.parent_call_id,
                    calls.c.engine,
                    calls.c.started_at,
                    calls.c.finished_at,
                    (prefix + func.length(calls.c.prompt_ids) / _ID_BYTES).label("prompt"),
                    (func.length(calls.c.response_ids) / _ID_BYTES).label("response"),
                )
                .where(calls.c.choice_index == 0)
                .order_by(calls.c.id)
            )
            engines: set[str] = set()
            for c in conn.execute(query):
                engines.add(c.engine)
                if c.attempt_id in found:
                    found[c.attempt_id].calls.append(c)
            sizes = [
                n for _, n in conn.execute(select(rollouts.c.group_id, func.count()).group_by("group_id"))
            ]
    finally:
        engine.dispose()
    return [a for a in found.values() if a.calls], sizes, len(engines)


def _decode_speed(all_calls: list[Any]) -> tuple[float, float, int, list[str]]:
    """(single-stream tokens/s, GPU tokens/s, highest concurrency seen, notes) of one engine."""
    start = np.array([c.started_at for c in all_calls])
    end = np.array([c.finished_at for c in all_calls])
    tokens = np.array([c.response for c in all_calls], dtype=float)
    ok = (end > start) & (tokens > 0)
    start, end, tokens = start[ok], end[ok], tokens[ok]
    rate = tokens / (end - start)
    mid = (start + end) / 2
    # Calls running at each call's midpoint, itself included.
    level = np.searchsorted(np.sort(start), mid, "right") - np.searchsorted(np.sort(end), mid, "right")
    counts = Counter(level.tolist())
    seen = sorted(n for n, k in counts.items() if k >= _MIN_CALLS_PER_LEVEL) or sorted(counts)
    single = float(np.median(rate[level == seen[0]]))
    throughput = max(float(np.median(rate[level == n] * n)) for n in seen)
    notes = []
    if seen[0] > 1:
        notes.append(f"no call ran alone often enough: single-stream speed taken at {seen[0]} calls at once")
    top = seen[-1]
    if throughput / single >= top * 0.9:
        notes.append(
            f"decode throughput still rose at the most calls seen at once ({top}): "
            f"{throughput:.0f} tokens/s is a lower bound"
        )
    return single, throughput, top, notes


def _most_at_once(intervals: list[tuple[float, float]]) -> int:
    edges = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    best = now = 0
    for _, d in edges:
        now += d
        best = max(best, now)
    return best


def _metrics(run: Path) -> list[dict[str, Any]]:
    path = run / "metrics.jsonl" if run.is_dir() else run.parent / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def fit_run(run: Path, *, base: Params = CALC) -> FittedRun:
    """The workload, hardware and shape of a recorded run; see the module's docstring."""
    found, sizes, n_engines = _read_store(_store_path(run))
    if not found:
        raise ValueError(f"{run}: the gateway store holds no finished attempt with model calls")
    notes: list[str] = []
    by_id = {c.id: c for a in found for c in a.calls}
    counts, startup, finish, tools, first, later, responses = [], [], [], [], [], [], []
    generated = 0
    for a in found:
        cs = a.calls
        counts.append(len(cs))
        startup.append(max(0.0, cs[0].started_at - a.claimed))
        finish.append(max(0.0, a.finished - cs[-1].finished_at))
        tools += [max(0.0, b.started_at - p.finished_at) for p, b in itertools.pairwise(cs)]
        first.append(cs[0].prompt)
        for c in cs[1:]:
            parent = by_id.get(c.parent_call_id) if c.parent_call_id is not None else None
            later.append(max(0, c.prompt - parent.prompt - parent.response) if parent else c.prompt)
        responses += [c.response for c in cs]
        generated += sum(c.response for c in cs)
    trained = sum(first) + sum(later) + generated

    def values(xs: list[float]) -> dict[str, Any]:
        return {"values": [float(x) for x in xs] or [0.0]}

    single, throughput, _, speed_notes = _decode_speed([c for a in found for c in a.calls])
    notes += speed_notes
    max_batch = max(1, round(throughput / single))
    changes: dict[str, Any] = {
        "name": f"run:{run.name}",
        "workload": {
            "calls_per_rollout": values(counts),
            "startup_seconds": values(startup),
            "tool_seconds": values(tools),
            "finish_seconds": values(finish),
            "first_prompt_tokens": values(first),
            "prompt_tokens": values(later),
            "response_tokens": values(responses),
        },
        "hardware": {
            "decode_tokens_per_s": single * max_batch,
            "max_batch": max_batch,
            "prefill_tokens_per_s": None,
        },
        "shape": {
            "gpus": max(1, n_engines),
            "concurrency": _most_at_once([(a.claimed, a.finished) for a in found]),
        },
    }
    group_size = Counter(sizes).most_common(1)[0][0] if sizes else base.shape.group_size
    changes["shape"]["group_size"] = group_size
    metrics = _metrics(run)
    fitted = FittedRun(params=base, notes=notes)
    if metrics:
        update_s = sum(m["time_update_s"] for m in metrics)
        step_tokens = sum(m["tokens"] for m in metrics) * trained / max(generated, 1)
        changes["hardware"]["train_tokens_per_s"] = step_tokens / update_s / changes["shape"]["gpus"]
        changes["hardware"]["weight_sync_seconds"] = statistics.median(m["time_publish_s"] for m in metrics)
        per_step = statistics.median(m["rollouts"] for m in metrics)
        changes["shape"]["batch_size"] = max(1, round(per_step / group_size))
        changes["shape"]["steps"] = len(metrics)
        wall = metrics[-1].get("wall_s")
        if wall:
            fitted.recorded_steps_per_hour = 3600 * len(metrics) / wall
        fitted.recorded_max_staleness = max(m.get("staleness_max", 0) for m in metrics)
    else:
        notes.append(
            f"no metrics.jsonl: training speed, weight sync and batch size are the {base.name} preset's"
        )
    fitted.params = override(base, changes)
    return fitted
