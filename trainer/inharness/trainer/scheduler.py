"""Which groups to create, which to train next and which to drop: the training loop's scheduling as a
pure state machine (no I/O, no clock), so that every mode's sequence can be checked by hand.

Vocabulary. A *group* is the `group_size` rollouts of one task, created together (one advantage
group). Groups are numbered in creation order. A *slot* is a place in the run's task stream: slot
``s`` is task ``s`` of the seeded per-epoch shuffle (`slot_tasks`), and a run trains ``steps x
batch_size`` slots, each exactly once. A fresh group fills the next slot; a dropped group's slot is
given to a new group (its task re-runs), so an epoch's tasks are all trained. A group is *open* from
its creation until it is trained or dropped.

The loop feeds events (`group_finished`: all its rollouts finished; `update_done`) and asks
`decide`, which returns what to do now: drop these stale groups, create these groups, release these
held ones, start an update on these. Every mode keeps at most ``batch_size x (K + 1)`` groups open
(K = ``max_staleness``); the modes differ in three choices, a row each in `SCHEDULING_MODES`:

==================  ===========================  ================  =========================
mode                an update takes              admission         calls held
==================  ===========================  ================  =========================
sync (K = 0)        the oldest batch_size open   all               while weights load
async (K >= 1)      groups, once all finished    all               while weights load
collocated-async    the oldest batch_size        drop a group      while the update trains
                    *finished* groups            > K versions old  and weights load
==================  ===========================  ================  =========================

Why sync and async need no admission control: taking the oldest groups in order, a group created
while version v is served is trained by version v + K at the latest. Collocated-async trains groups
out of order (a slow group does not hold an update back), so a slow group can fall further behind:
its staleness, the version being trained minus the oldest version its calls were answered by, is
checked when it finishes, and a group beyond K is dropped, counted, and its task re-run.

Why collocated-async holds calls during the update: inference and training share the devices, so the
update gets them; rollouts in flight wait in the gateway and go on under the new version (each call
records its version).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class SchedulingPolicy:
    """One mode's choices (see the module docstring's table)."""

    in_order: bool  # an update takes the oldest open groups and waits for all of them
    drop_stale: bool  # a finished group more than K versions behind is dropped, its task re-run
    hold_calls_during_update: bool  # the gateway holds calls while the update trains, not only while it loads


_IN_ORDER = SchedulingPolicy(in_order=True, drop_stale=False, hold_calls_during_update=False)
SCHEDULING_MODES: dict[str, SchedulingPolicy] = {
    "sync": _IN_ORDER,  # K = 0: the next batch is created once the version it will use is served
    "async": _IN_ORDER,
    "collocated-async": SchedulingPolicy(in_order=False, drop_stale=True, hold_calls_during_update=True),
}
"""``spec.scheduling.mode`` -> its policy (tests/trainer/test_scheduler.py checks the names agree)."""


def scheduling_policy(mode: str) -> SchedulingPolicy:
    try:
        return SCHEDULING_MODES[mode]
    except KeyError:
        raise ValueError(f"unknown scheduling mode {mode!r}; one of {sorted(SCHEDULING_MODES)}") from None


def slot_tasks(tasks: Sequence[Any], slots: Sequence[int], seed: int) -> list[Any]:
    """The task of each slot: consecutive places in one seeded shuffle per epoch, the same on every run."""
    out = []
    for slot in slots:
        epoch, offset = divmod(slot, len(tasks))
        order = list(range(len(tasks)))
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
        out.append(tasks[order[offset]])
    return out


@dataclass
class ScheduleState:
    """What a checkpoint keeps of the schedule. Which open groups have finished is not kept: a resumed
    loop reads the export again from its cursor and learns it anew."""

    next_group: int = 0  # number of the next group to create
    next_slot: int = 0  # the first slot no group was created for
    open: dict[int, int] = field(default_factory=dict)  # open group -> its slot
    requeue: list[int] = field(default_factory=list)  # slots of dropped groups, not yet given a new group

    def to_json(self) -> dict[str, Any]:
        return {
            "next_group": self.next_group,
            "next_slot": self.next_slot,
            "open": {str(g): s for g, s in self.open.items()},
            "requeue": list(self.requeue),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ScheduleState:
        return cls(
            next_group=data["next_group"],
            next_slot=data["next_slot"],
            open={int(g): s for g, s in data["open"].items()},
            requeue=list(data["requeue"]),
        )


@dataclass(frozen=True)
class Decision:
    """What to do now, in this order; all empty: wait for the next event."""

    drop: tuple[int, ...] = ()  # finished groups too stale to train (their slots are in `create`)
    create: tuple[tuple[int, int], ...] = ()  # (group, slot) to create, in order
    release: tuple[int, ...] = ()  # held groups the window has reached
    update: tuple[int, ...] = ()  # groups to train now, oldest first

    def __bool__(self) -> bool:
        return bool(self.drop or self.create or self.release or self.update)


class Scheduler:
    """The state machine. `state` is shared with the caller's checkpoint (mutated in place)."""

    def __init__(
        self,
        policy: SchedulingPolicy,
        *,
        batch_size: int,
        max_staleness: int,
        steps: int,
        state: ScheduleState,
        version: int,
    ) -> None:
        self.policy = policy
        self.batch_size = batch_size
        self.max_staleness = max_staleness
        self.total_slots = steps * batch_size
        self.state = state
        self.version = version  # the version being served, which the next update trains from
        self.training: tuple[int, ...] = ()
        self._finished: dict[int, int | None] = {}  # open group -> oldest version of its calls (None: none)
        self._held: set[int] = set()

    @property
    def window(self) -> int:
        """How many groups may be open: the batch being trained and K more batches."""
        return self.batch_size * (self.max_staleness + 1)

    # -- events ------------------------------------------------------------------------------

    def group_finished(self, group: int, oldest_version: int | None) -> None:
        """Every rollout of `group` finished; its calls' oldest model version (None: it made none)."""
        if group in self.state.open:
            self._finished[group] = oldest_version

    def update_done(self) -> None:
        """The update on `training` was published: those groups are trained, the next version serves."""
        for group in self.training:
            del self.state.open[group]
            self._finished.pop(group, None)
        self.training = ()
        self.version += 1

    # -- resume ------------------------------------------------------------------------------

    def replay_created(self, group: int, slot: int) -> bool:
        """A journalled creation: open the group again (never re-create it) unless the checkpoint already
        counts it; returns whether it was new."""
        if group < self.state.next_group:
            return False
        self.state.open[group] = slot
        self.state.next_group = group + 1
        if slot in self.state.requeue:
            self.state.requeue.remove(slot)
        else:
            self.state.next_slot = max(self.state.next_slot, slot + 1)
        return True

    def replay_dropped(self, group: int) -> bool:
        """A journalled drop: the group stays dropped (its slot re-run) if it is still open."""
        if group not in self.state.open:
            return False
        self._drop(group)
        return True

    def hold_beyond_window(self) -> tuple[int, ...]:
        """Open groups beyond the window (a resumed run adopted them from the journal): to be held in the
        gateway, so that none runs on an older version than a run without a restart would have used."""
        beyond = tuple(sorted(self.state.open)[self.window :])
        self._held = set(beyond)
        return beyond

    # -- decisions ---------------------------------------------------------------------------

    def decide(self) -> Decision:
        """What to do now; the decision is taken (the state moves), so carry all of it out."""
        drop = self._drop_stale()
        create = self._create()
        release = self._release()
        update = () if self.training else self._pick()
        self.training = self.training or update
        return Decision(drop, create, release, update)

    def candidates(self) -> list[int]:
        """The open groups the next update may take (what the loop shows progress on)."""
        groups = sorted(self.state.open)
        return groups[: self.batch_size] if self.policy.in_order else groups

    def _drop_stale(self) -> tuple[int, ...]:
        if not self.policy.drop_stale:
            return ()
        # Groups being trained passed this check at the same version, which changes only once they are gone.
        too_old = self.version - self.max_staleness
        stale = tuple(sorted(g for g, v in self._finished.items() if v is not None and v < too_old))
        for group in stale:
            self._drop(group)
        return stale

    def _drop(self, group: int) -> None:
        self.state.requeue.append(self.state.open.pop(group))
        self._finished.pop(group, None)
        self._held.discard(group)

    def _create(self) -> tuple[tuple[int, int], ...]:
        state, made = self.state, []
        while len(state.open) < self.window and (state.requeue or state.next_slot < self.total_slots):
            if state.requeue:
                slot = state.requeue.pop(0)
            else:
                slot, state.next_slot = state.next_slot, state.next_slot + 1
            state.open[state.next_group] = slot
            made.append((state.next_group, slot))
            state.next_group += 1
        return tuple(made)

    def _release(self) -> tuple[int, ...]:
        inside = set(sorted(self.state.open)[: self.window])
        released = tuple(sorted(self._held & inside))
        self._held -= inside
        return released

    def _pick(self) -> tuple[int, ...]:
        if self.policy.in_order:
            head = sorted(self.state.open)[: self.batch_size]
            complete = len(head) == self.batch_size and all(g in self._finished for g in head)
            return tuple(head) if complete else ()
        ready = sorted(self._finished)
        return tuple(ready[: self.batch_size]) if len(ready) >= self.batch_size else ()
