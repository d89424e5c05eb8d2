"""The discrete-event simulation: rollouts, GPUs that decode and train, driven by the trainer's own
scheduler.

Which groups exist, which an update takes and which are dropped is decided by the training loop's
state machine (`inharness.trainer.scheduler.Scheduler`, a row of `SCHEDULING_MODES` per mode), fed
the events it gets in a real run: a group finished (with the oldest version its calls ran on), an
update was published. The simulation only supplies time: rollouts, GPUs, training, weight sync.
So the modes here are the trainer's, not a second description of them:

- sync (K = 0) and async (K >= 1): at most batch_size x (K + 1) groups open; an update takes the
  oldest batch_size groups once all have finished. Calls are held only while weights load.
- collocated-async: the same window, but an update takes the oldest batch_size *finished* groups,
  and a finished group more than K versions behind the version being served is dropped (its task is
  re-run by a new group). Calls are held while the update trains and while weights load.

What the simulation adds:

- A rollout is `startup`, then calls separated by tool time, then `finish`. A call starts under the
  version being served and records it. Up to `concurrency` rollouts run (the pool's parallelism);
  the others of open groups wait their turn.
- Holding calls is the gateway's `pause(drain_seconds=...)`: new calls wait, calls in flight finish
  first (no call spans two versions), tool time goes on. After each update the gateway resumes, so
  held calls start before the next update (if one is ready at once) holds and drains them again.
- GPUs: sync and collocated-async generate and train on every GPU; async splits them. Each call
  decodes on the least-loaded generation GPU, sharing it (`Hardware`). All calls on a GPU decode at
  the same rate, so a GPU keeps one "service so far" clock and a heap of finish marks on it: an
  arrival or a finish costs O(log n), not O(n).
- Group g is drawn from a generator seeded with (seed, g): every mode sees the same rollouts in the
  same order (common random numbers), so their ratios are not sampling noise.
"""

import heapq
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from inharness.trainer.scheduler import Scheduler, ScheduleState, scheduling_policy
from inharness.trainer.simulate.params import Dist, Params

_CALL, _PREFILLED, _GPU, _DONE, _TRAINED, _SYNCED = range(6)
_EPS = 1e-9  # tokens of service, relative: calls that finish at the same moment


@dataclass(slots=True, eq=False)
class Group:
    index: int  # the scheduler's group number
    rollouts: list["Rollout"] = field(default_factory=list)
    done: int = 0
    min_version: int | None = None


@dataclass(slots=True, eq=False)
class Rollout:
    group: Group
    startup: float
    tools: list[float]  # after call i: tools[i]; the last is the finish
    responses: list[int]
    prompts: list[int]  # first prompt, then the tokens each later call adds
    call: int = 0
    min_version: int | None = None

    @property
    def tokens(self) -> int:
        """Trained tokens: the sample's prompt and responses, shared prefixes once."""
        return sum(self.prompts) + sum(self.responses)


def draw(dist: Dist, rng: np.random.Generator, n: int) -> np.ndarray:
    if dist.values is not None:
        return rng.choice(np.asarray(dist.values, dtype=float), size=n)
    if dist.sigma == 0:
        return np.full(n, dist.median, dtype=float)
    return np.clip(dist.median * np.exp(dist.sigma * rng.standard_normal(n)), dist.low, dist.high)


def make_group(params: Params, seed: int, index: int) -> Group:
    """Group `index`'s rollouts: a pure function of (params, seed, index)."""
    w, size = params.workload, params.shape.group_size
    rng = np.random.default_rng([seed, index])
    group = Group(index)
    counts = np.maximum(1, np.rint(draw(w.calls_per_rollout, rng, size))).astype(int)
    starts = draw(w.startup_seconds, rng, size)
    finishes = draw(w.finish_seconds, rng, size)
    for n, start, finish in zip(counts.tolist(), starts.tolist(), finishes.tolist(), strict=True):
        tools = [*draw(w.tool_seconds, rng, n - 1).tolist(), finish]
        responses = np.maximum(1, np.rint(draw(w.response_tokens, rng, n))).astype(int).tolist()
        first = round(float(draw(w.first_prompt_tokens, rng, 1)[0]))
        later = np.rint(draw(w.prompt_tokens, rng, n - 1)).astype(int).tolist()
        group.rollouts.append(Rollout(group, start, tools, responses, [first, *later]))
    return group


class Gpu:
    """One GPU's decoding: processor sharing with a per-call cap (see `Hardware`)."""

    __slots__ = (
        "busy",
        "cap",
        "epoch",
        "finishes",
        "index",
        "max_batch",
        "n",
        "next_t",
        "segments",
        "service",
        "t",
    )

    def __init__(self, index: int, tokens_per_s: float, max_batch: int) -> None:
        self.index = index
        self.cap = tokens_per_s
        self.max_batch = max_batch
        self.n = 0
        self.service = 0.0  # tokens each active call has been served since the GPU started
        self.t = 0.0
        self.finishes: list[tuple[float, int, Rollout]] = []
        self.epoch = 0
        self.next_t = -1.0  # when the event of `epoch` fires
        self.busy = 0.0  # GPU-seconds of decode capacity used
        self.segments: list[tuple[float, float, float]] = []  # (start, end, share of capacity used)

    def rate(self) -> float:
        return self.cap / (self.n if self.n > self.max_batch else self.max_batch)

    def advance(self, now: float) -> None:
        n, dt = self.n, now - self.t
        if n and dt > 0:
            share = n if n > self.max_batch else self.max_batch
            self.service += self.cap / share * dt
            used = n / share
            self.busy += used * dt
            self.segments.append((self.t, now, used))
        self.t = now


class Sim:
    """The event loop, the generation pool, the trainer; the trainer's `Scheduler` decides what runs."""

    def __init__(self, params: Params, mode: str, seed: int) -> None:
        params.check_mode(mode)
        self.params, self.mode, self.seed = params, mode, seed
        shape, hw = params.shape, params.hardware
        if mode == "async":
            n_gen, _ = shape.split()
            self.gen_gpus = [Gpu(i, hw.decode_tokens_per_s, hw.max_batch) for i in range(n_gen)]
            self.train_gpus = list(range(n_gen, shape.gpus))
        else:
            self.gen_gpus = [Gpu(i, hw.decode_tokens_per_s, hw.max_batch) for i in range(shape.gpus)]
            self.train_gpus = list(range(shape.gpus))
        self.policy = scheduling_policy(mode)
        self.sched = Scheduler(
            self.policy,
            batch_size=shape.batch_size,
            max_staleness=0 if mode == "sync" else shape.max_staleness,
            steps=shape.steps,
            state=ScheduleState(),
            version=0,
        )
        self.concurrency = shape.rollouts_at_once(mode)
        self.now = 0.0
        self._events: list[tuple[float, int, int, object]] = []
        self._seq = itertools.count()
        self.version = 0
        self.steps_done = 0
        self.end: float | None = None
        self.groups: dict[int, Group] = {}  # open groups, by the scheduler's number
        # Generation pool: held calls wait in `waiting`; `on_drained` runs once none is in flight.
        self.held = False
        self.waiting: deque[Rollout] = deque()
        self.in_flight = 0
        self._on_drained: Callable[[], None] | None = None
        # Rollout pool: `queued` wait for one of `concurrency` slots.
        self.queued: deque[Rollout] = deque()
        self.running = 0
        self.groups_started = 0
        # What happened.
        self.trained: list[tuple[int, int]] = []  # (step, staleness) per trained rollout
        # Calls per rollout, trained and dropped: admission control can favour short rollouts.
        self.trained_calls: list[int] = []
        self.dropped_calls: list[int] = []
        self.step_ends: list[float] = []
        self.train_spans: list[tuple[float, float]] = []
        self.sync_spans: list[tuple[float, float]] = []
        self.hold_spans: list[tuple[float, float]] = []
        self._held_since = 0.0
        self.dropped_stale = 0
        self._batch: list[Group] = []

    # -- events ------------------------------------------------------------------------------

    def at(self, t: float, kind: int, obj: object) -> None:
        heapq.heappush(self._events, (t, next(self._seq), kind, obj))

    def run(self, *, max_groups: int | None = None) -> "Sim":
        limit = max_groups or 100 * self.params.shape.steps * self.params.shape.batch_size + 1000
        self._decide()
        handlers = {
            _CALL: self._call,
            _PREFILLED: self._prefilled,
            _DONE: self._rollout_done,
            _TRAINED: self._trained,
            _SYNCED: self._synced,
        }
        while self._events and self.end is None:
            t, _, kind, obj = heapq.heappop(self._events)
            self.now = t
            if kind == _GPU:
                gpu, epoch = obj  # type: ignore[misc]
                if epoch == gpu.epoch:
                    self._gpu_event(gpu)
            else:
                handlers[kind](obj)
            if self.groups_started > limit:
                raise RuntimeError(
                    f"{self.mode}: {self.groups_started} groups started for {self.steps_done} of "
                    f"{self.params.shape.steps} steps: nearly every group is dropped as stale "
                    "(raise --max-staleness)"
                )
        if self.end is None:
            raise RuntimeError(f"{self.mode}: stalled after {self.steps_done} steps (a scheduler bug)")
        return self

    def _decide(self) -> None:
        """Carry out the scheduler's decision, in its order: drops, creations, the update."""
        decision = self.sched.decide()
        for g in decision.drop:
            self._drop(self.groups.pop(g))
        for g, _slot in decision.create:
            self._new_group(g)
        if decision.update:
            self._update([self.groups.pop(g) for g in decision.update])

    # -- rollouts ----------------------------------------------------------------------------

    def _new_group(self, index: int) -> None:
        group = make_group(self.params, self.seed, index)
        self.groups[index] = group
        self.groups_started += 1
        self.queued.extend(group.rollouts)
        self._admit()

    def _admit(self) -> None:
        while self.queued and self.running < self.concurrency:
            r = self.queued.popleft()
            self.running += 1
            self.at(self.now + r.startup, _CALL, r)

    def _call(self, r: Rollout) -> None:
        if self.held:
            self.waiting.append(r)
        else:
            self._start_call(r)

    def _start_call(self, r: Rollout) -> None:
        v = self.version
        if r.min_version is None:
            r.min_version = v
        g = r.group
        if g.min_version is None or v < g.min_version:
            g.min_version = v
        self.in_flight += 1
        prefill = self.params.hardware.prefill_tokens_per_s
        if prefill:
            self.at(self.now + r.prompts[r.call] / prefill, _PREFILLED, r)
        else:
            self._prefilled(r)

    def _prefilled(self, r: Rollout) -> None:
        gpu = self.gen_gpus[0]
        for other in self.gen_gpus:
            if other.n < gpu.n:
                gpu = other
        gpu.advance(self.now)
        heapq.heappush(gpu.finishes, (gpu.service + r.responses[r.call], next(self._seq), r))
        gpu.n += 1
        self._reschedule(gpu)

    def _reschedule(self, gpu: Gpu) -> None:
        """Set the GPU's next finish; an arrival that changes neither the head nor the rate (fewer
        than `max_batch` calls) keeps the event already set, rather than pushing a new one."""
        if not gpu.finishes:
            gpu.epoch += 1
            gpu.next_t = -1.0
            return
        left = max(0.0, gpu.finishes[0][0] - gpu.service)
        t = self.now + left / gpu.rate()
        if t != gpu.next_t:
            gpu.epoch += 1
            gpu.next_t = t
            self.at(t, _GPU, (gpu, gpu.epoch))

    def _gpu_event(self, gpu: Gpu) -> None:
        gpu.advance(self.now)
        # The event was set for the head's finish: pop it even if rounding left it a hair short
        # (so time always moves on), and every call finishing with it.
        done = [heapq.heappop(gpu.finishes)[2]]
        while gpu.finishes and gpu.finishes[0][0] <= gpu.service + _EPS * (1.0 + gpu.service):
            done.append(heapq.heappop(gpu.finishes)[2])
        gpu.n -= len(done)
        self._reschedule(gpu)
        for r in done:
            self._call_done(r)

    def _call_done(self, r: Rollout) -> None:
        self.in_flight -= 1
        tool = r.tools[r.call]
        r.call += 1
        self.at(self.now + tool, _DONE if r.call == len(r.responses) else _CALL, r)
        if self.held and self.in_flight == 0 and self._on_drained is not None:
            then, self._on_drained = self._on_drained, None
            then()

    def _rollout_done(self, r: Rollout) -> None:
        self.running -= 1
        g = r.group
        g.done += 1
        self._admit()
        if g.done == len(g.rollouts):
            self.sched.group_finished(g.index, g.min_version)
            self._decide()

    def _drop(self, group: Group) -> None:
        self.dropped_stale += 1
        self.dropped_calls += [len(r.responses) for r in group.rollouts]

    # -- generation pauses -------------------------------------------------------------------

    def _hold(self, then: Callable[[], None]) -> None:
        """Hold new calls; run `then` once the calls in flight have finished."""
        if not self.held:
            self.held, self._held_since = True, self.now
        if self.in_flight == 0:
            then()
        else:
            self._on_drained = then

    def _release(self) -> None:
        self.held = False
        self.hold_spans.append((self._held_since, self.now))
        waiting, self.waiting = self.waiting, deque()
        for r in waiting:
            self._start_call(r)

    # -- updates -----------------------------------------------------------------------------

    def _update(self, batch: list[Group]) -> None:
        """Train `batch` on the version being served, then load the weights: version + 1."""
        self._batch = batch
        for g in batch:
            for r in g.rollouts:
                assert r.min_version is not None
                self.trained.append((self.steps_done, self.version - r.min_version))
                self.trained_calls.append(len(r.responses))
        if self.policy.hold_calls_during_update:
            self._hold(self._train)
        else:
            self._train()

    def _train(self) -> None:
        hw = self.params.hardware
        tokens = sum(r.tokens for g in self._batch for r in g.rollouts)
        seconds = tokens / (hw.train_tokens_per_s * len(self.train_gpus))
        self.train_spans.append((self.now, self.now + seconds))
        self.at(self.now + seconds, _TRAINED, None)

    def _trained(self, _: object) -> None:
        self._hold(self._sync)

    def _sync(self) -> None:
        seconds = self.params.hardware.weight_sync_seconds
        self.sync_spans.append((self.now, self.now + seconds))
        self.at(self.now + seconds, _SYNCED, None)

    def _synced(self, _: object) -> None:
        self.version += 1
        self.steps_done += 1
        self.step_ends.append(self.now)
        self._release()  # the gateway resumes once the new version is served
        if self.steps_done == self.params.shape.steps:
            self.end = self.now
            return
        self.sched.update_done()
        self._decide()
