"""What a simulation is given: the run's shape, the workload its rollouts draw from, the hardware.

One pydantic model (`Params`) holds all three, so a preset, a YAML/JSON override file, a fitted run
and the command line's flags all meet in one place and are validated once. Numbers of a preset are
assumptions written down with their reasons, not measurements; `--from-run` replaces them with a
recorded run's (`fit.py`).
"""

import math
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from inharness.trainer.scheduler import SCHEDULING_MODES

MODES = tuple(SCHEDULING_MODES)  # the trainer's modes, by the names a TrainingRun gives them


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Dist(_Model):
    """A non-negative quantity drawn per rollout or per call.

    Lognormal by `median` and `sigma` (sigma 0: always the median, for cases checked by hand),
    clipped to [low, high]; or, when `values` is set, resampled uniformly from them (what a recorded
    run observed). A bare number in a file means that fixed value."""

    median: float = Field(default=0.0, ge=0)
    sigma: float = Field(default=0.0, ge=0)
    low: float = Field(default=0.0, ge=0)
    high: float = Field(default=math.inf, gt=0)
    values: tuple[float, ...] | None = Field(default=None, min_length=1)

    @model_validator(mode="before")
    @classmethod
    def _number_is_fixed(cls, data: Any) -> Any:
        if isinstance(data, int | float) and not isinstance(data, bool):
            return {"median": float(data)}
        return data

    @model_validator(mode="after")
    def _bounds(self) -> "Dist":
        if self.low > self.high:
            raise ValueError(f"low ({self.low}) is above high ({self.high})")
        if self.values is not None and min(self.values) < 0:
            raise ValueError("values must be non-negative")
        return self

    def mean(self) -> float:
        """The mean before clipping: enough for defaults and for the docs' back-of-envelope sums."""
        if self.values is not None:
            return sum(self.values) / len(self.values)
        return self.median * math.exp(self.sigma**2 / 2)


class Workload(_Model):
    """One rollout: `startup`, then calls with tool time between them, then `finish` (the last tool
    call, tests, grading). A call's prompt is the first prompt for the first call; for a later call
    only the tokens added since its parent (tool output, a user turn): the prefix is cached by the
    engine and a sample's shared prefix is trained once, so these are also the tokens trained."""

    calls_per_rollout: Dist
    startup_seconds: Dist = Dist()
    tool_seconds: Dist
    finish_seconds: Dist = Dist()
    first_prompt_tokens: Dist
    prompt_tokens: Dist
    response_tokens: Dist


class Hardware(_Model):
    """Per GPU. Decoding is shared among a GPU's concurrent calls: n calls each decode at
    `decode_tokens_per_s / max(n, max_batch)` (a lone call at the single-stream speed
    `decode_tokens_per_s / max_batch`; from `max_batch` calls on, the GPU's throughput is spent).
    Prefill is a latency per call (compute-bound; overlapped with other calls' decoding by chunked
    prefill) and not counted as busy; None: folded into the decode speed (what `--from-run` fits).
    Training takes `train_tokens_per_s` per GPU over every trained token (all passes of an update:
    old log-probs, forward, backward). Weight sync is a fixed pause after every update."""

    decode_tokens_per_s: float = Field(gt=0)
    max_batch: int = Field(ge=1)
    prefill_tokens_per_s: float | None = Field(default=None, gt=0)
    train_tokens_per_s: float = Field(gt=0)
    weight_sync_seconds: float = Field(ge=0)


class Shape(_Model):
    """The TrainingRun being planned. `train_gpus`: the async split (default half, at least one
    each side); `concurrency`: rollouts running at once, the pool's parallelism (default and most:
    every rollout of the scheduler's open groups, batch_size x group_size x (K + 1), K = 0 for sync)."""

    gpus: int = Field(ge=1)
    steps: int = Field(default=50, ge=1)
    batch_size: int = Field(ge=1)
    group_size: int = Field(ge=1)
    max_staleness: int = Field(default=1, ge=1)
    train_gpus: int | None = Field(default=None, ge=1)
    concurrency: int | None = Field(default=None, ge=1)

    def split(self) -> tuple[int, int]:
        """(generation GPUs, training GPUs) of the async mode."""
        train = self.train_gpus or max(1, self.gpus // 2)
        return self.gpus - train, train

    def rollouts_at_once(self, mode: str) -> int:
        """At most this many rollouts run: the pool's parallelism, within the scheduler's window of
        batch_size x (K + 1) open groups (K = 0 for sync)."""
        window = self.batch_size * self.group_size * (1 if mode == "sync" else self.max_staleness + 1)
        return window if self.concurrency is None else min(self.concurrency, window)


class Params(_Model):
    name: str
    shape: Shape
    workload: Workload
    hardware: Hardware

    def modes_possible(self) -> list[str]:
        """The async mode needs a GPU on each side of its split."""
        return [m for m in MODES if m != "async" or self.shape.gpus >= 2]

    def check_mode(self, mode: str) -> None:
        """Refuse a mode this shape cannot run, naming the flags to change."""
        if mode == "async":
            gen, train = self.shape.split()
            if gen < 1:
                raise ValueError(
                    f"async needs at least one generation GPU: {self.shape.gpus} GPUs, {train} to train "
                    "(--gpus, --train-gpus)"
                )


# An 8B-class dense model on one node of 8 H100s, SWE-agent-like rollouts (docs/simulate.md says why
# each number): ~28 calls per rollout (lognormal, up to 100), tool calls of seconds with a tail into
# minutes, a test run at the end, a few hundred tokens per reply, a 6k-token first prompt.
SWE = Params(
    name="swe",
    shape=Shape(gpus=8, steps=50, batch_size=16, group_size=8, max_staleness=1),
    workload=Workload(
        calls_per_rollout=Dist(median=25, sigma=0.5, low=3, high=100),
        startup_seconds=Dist(median=10, sigma=0.5, high=300),
        tool_seconds=Dist(median=2.5, sigma=1.2, low=0.05, high=600),
        finish_seconds=Dist(median=30, sigma=0.7, low=1, high=900),
        first_prompt_tokens=Dist(median=6000, sigma=0.2),
        prompt_tokens=Dist(median=400, sigma=1.0, low=20, high=16000),
        response_tokens=Dist(median=250, sigma=0.8, low=10, high=4096),
    ),
    hardware=Hardware(
        decode_tokens_per_s=2000,
        max_batch=16,
        prefill_tokens_per_s=20000,
        train_tokens_per_s=4000,
        weight_sync_seconds=10,
    ),
)

# The CPU demo (examples/calc, `make demo`): one CPU engine on 2 cores, 8 harness processes at once,
# 8 groups of 4 per step. Fitted with `--from-run` from a 40-step demo run and rounded: 9 in 10
# rollouts make 2 calls (21 tokens, then 7-8), the second call adds ~14 prompt tokens to a 220-token
# first prompt; a call alone decodes ~57 tokens/s, 8 at once ~590 (still rising: a lower bound).
CALC = Params(
    name="calc",
    shape=Shape(gpus=1, steps=40, batch_size=8, group_size=4, max_staleness=1, concurrency=8),
    workload=Workload(
        calls_per_rollout=Dist(values=(1,) + (2,) * 10),
        startup_seconds=Dist(median=0.33, sigma=0.3),
        tool_seconds=Dist(median=0.025, sigma=0.4),
        finish_seconds=Dist(median=0.025, sigma=0.5),
        first_prompt_tokens=Dist(median=220),
        prompt_tokens=Dist(median=14, sigma=0.3),
        response_tokens=Dist(values=(21,) * 10 + (7,) * 6 + (8,) * 3),
    ),
    hardware=Hardware(
        decode_tokens_per_s=575,
        max_batch=10,
        prefill_tokens_per_s=None,
        train_tokens_per_s=1730,
        weight_sync_seconds=0.09,
    ),
)

PRESETS = {p.name: p for p in (SWE, CALC)}


def _merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def override(params: Params, values: dict[str, Any]) -> Params:
    """`params` with `values` merged in (nested: `{"hardware": {"max_batch": 32}}` keeps the rest)."""
    return Params.model_validate(_merge(params.model_dump(), values))


def load(source: str) -> Params:
    """A preset by name, or a YAML/JSON file of overrides on the preset it names (`preset: calc`;
    default swe). Raises ValueError with a message fit for the command line."""
    if source in PRESETS:
        return PRESETS[source]
    path = Path(source)
    if not path.is_file():
        raise ValueError(f"'{source}' is neither a preset ({', '.join(PRESETS)}) nor a file")
    try:
        data = yaml.safe_load(path.read_text()) or {}  # JSON is YAML
    except yaml.YAMLError as exc:
        raise ValueError(f"{source}: not YAML or JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{source}: expected a mapping of parameters")
    base = data.pop("preset", "swe")
    if base not in PRESETS:
        raise ValueError(f"{source}: preset '{base}' is not one of {', '.join(PRESETS)}")
    data.setdefault("name", f"{base}+{path.stem}")
    return override(PRESETS[base], data)
