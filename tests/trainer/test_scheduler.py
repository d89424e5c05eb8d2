"""The scheduler as a pure state machine: hand-checked sequences of events and decisions for each mode
(no clock, no sleeping), its replay on resume; then the loop driving it against a real gateway and
engine on 127.0.0.1, where this test plays the rollout pool."""

import asyncio
import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, get_args

import httpx
import pytest
from conftest import ADMIN
from testsupport import Server, eventually, gateway_server, start_engine

from inharness.gateway.client import GatewayClient
from inharness.gateway.schema import ClaimedAttempt
from inharness.operator.spec import Scheduling
from inharness.trainer.config import LoopConfig, UpdateConfig
from inharness.trainer.inference import EngineServers
from inharness.trainer.loop import LoopState, RunDir, TrainingLoop, batch_tasks
from inharness.trainer.scheduler import (
    SCHEDULING_MODES,
    Decision,
    Scheduler,
    ScheduleState,
    scheduling_policy,
    slot_tasks,
)


def scheduler(mode: str, *, batch_size: int, k: int, steps: int, version: int = 0) -> Scheduler:
    policy = scheduling_policy(mode)
    return Scheduler(
        policy, batch_size=batch_size, max_staleness=k, steps=steps, state=ScheduleState(), version=version
    )


def create(*groups: int, slots: tuple[int, ...] | None = None) -> tuple[tuple[int, int], ...]:
    """(group, slot) pairs; a fresh group's slot is its number unless said otherwise."""
    return tuple(zip(groups, slots or groups, strict=True))


def test_mode_names_are_the_specs() -> None:
    assert set(SCHEDULING_MODES) == set(get_args(Scheduling.model_fields["mode"].annotation))
    with pytest.raises(ValueError, match="unknown scheduling mode 'eventual'"):
        scheduling_policy("eventual")


def test_collocated_async_needs_a_staleness_bound_here_and_in_the_crd() -> None:
    with pytest.raises(ValueError, match="must be at least 1 when mode is collocated-async"):
        Scheduling.model_validate({"mode": "collocated-async"})
    assert Scheduling.model_validate({"mode": "collocated-async", "maxStaleness": 2}).max_staleness == 2
    rules = Scheduling.model_json_schema()["x-kubernetes-validations"]
    assert {
        "rule": "self.mode != 'collocated-async' || self.maxStaleness >= 1",
        "message": "maxStaleness must be at least 1 when mode is collocated-async",
        "fieldPath": ".maxStaleness",
        "reason": "FieldValueInvalid",
    } in rules


def test_slots_are_the_batches_tasks_in_order() -> None:
    tasks = list(range(5))
    flat = [t for b in range(4) for t in batch_tasks(tasks, b, 3, seed=7)]
    assert slot_tasks(tasks, range(12), seed=7) == flat
    assert slot_tasks(tasks, [4, 0], seed=7) == [flat[4], flat[0]]


def test_sync_creates_each_batch_after_the_last_update_and_trains_it_whole() -> None:
    s = scheduler("sync", batch_size=2, k=0, steps=2)
    assert s.decide() == Decision(create=create(0, 1))
    s.group_finished(1, 0)
    assert s.decide() == Decision()  # group 0 is still running
    s.group_finished(0, 0)
    assert s.decide() == Decision(update=(0, 1))
    assert s.decide() == Decision()  # training: nothing more to start
    s.update_done()
    assert s.decide() == Decision(create=create(2, 3))
    s.group_finished(2, 1)
    s.group_finished(3, 1)
    assert s.decide() == Decision(update=(2, 3))
    s.update_done()
    assert s.decide() == Decision() and s.state.open == {} and s.version == 2


def test_async_keeps_k_batches_ahead_and_trains_in_order() -> None:
    s = scheduler("async", batch_size=1, k=1, steps=3)
    assert s.decide() == Decision(create=create(0, 1))
    s.group_finished(1, 0)
    assert s.decide() == Decision()  # in order: group 1 waits for group 0
    s.group_finished(0, 0)
    assert s.decide() == Decision(update=(0,))
    s.update_done()
    assert s.decide() == Decision(create=create(2), update=(1,))
    s.group_finished(2, 1)
    s.update_done()
    assert s.decide() == Decision(update=(2,))  # all 3 slots are created: no more groups
    s.update_done()
    assert s.decide() == Decision() and s.version == 3


def test_collocated_async_k1_trains_finished_groups_first_and_reruns_a_stale_one() -> None:
    s = scheduler("collocated-async", batch_size=1, k=1, steps=3)
    assert s.decide() == Decision(create=create(0, 1))
    s.group_finished(1, 0)
    assert s.decide() == Decision(update=(1,))  # group 0, older, is not waited for
    s.update_done()
    assert s.decide() == Decision(create=create(2))
    s.group_finished(2, 1)
    assert s.decide() == Decision(update=(2,))
    s.update_done()
    assert s.decide() == Decision()  # version 2; every slot has a group
    s.group_finished(0, 0)  # its first call was answered by version 0: 2 behind, K = 1
    assert s.decide() == Decision(drop=(0,), create=create(3, slots=(0,)))
    s.group_finished(3, 2)
    assert s.decide() == Decision(update=(3,))
    s.update_done()
    assert s.decide() == Decision() and s.state == ScheduleState(next_group=4, next_slot=3)


def test_collocated_async_k2_admits_k_behind_and_drops_k_plus_one() -> None:
    s = scheduler("collocated-async", batch_size=2, k=2, steps=4)
    assert s.decide() == Decision(create=create(0, 1, 2, 3, 4, 5))  # batch_size x (K + 1) open
    s.group_finished(2, 0)
    s.group_finished(3, 0)
    assert s.decide() == Decision(update=(2, 3))
    s.group_finished(4, 0)
    assert s.decide() == Decision()  # an update at a time
    s.update_done()
    assert s.decide() == Decision(create=create(6, 7))
    s.group_finished(5, 1)
    assert s.decide() == Decision(update=(4, 5))  # group 4: 1 behind version 1
    s.update_done()
    s.group_finished(6, 2)
    s.group_finished(0, 0)  # 2 behind version 2: admitted
    assert s.decide() == Decision(update=(0, 6))
    s.update_done()
    s.group_finished(1, 0)  # 3 behind version 3: dropped, its slot re-run
    s.group_finished(7, 2)
    assert s.decide() == Decision(drop=(1,), create=create(8, slots=(1,)))
    s.group_finished(8, 3)
    assert s.decide() == Decision(update=(7, 8))
    s.update_done()
    assert s.decide() == Decision() and s.state.open == {} and s.version == 4


def test_a_group_without_calls_is_never_stale() -> None:
    s = scheduler("collocated-async", batch_size=1, k=1, steps=1, version=5)
    s.decide()
    s.group_finished(0, None)  # every attempt failed before a call: trained (and reported) as is
    assert s.decide() == Decision(update=(0,))


def test_resume_replays_the_journal_after_the_checkpoint_and_redoes_lost_steps() -> None:
    """The K = 1 collocated run above, checkpointed after step 0 and killed after its drop. Replaying
    the whole journal over the checkpoint re-creates nothing, keeps the drop, and trains group 2 again:
    its update (step 1) came after the checkpoint and died with the process."""
    s = scheduler("collocated-async", batch_size=1, k=1, steps=3)
    s.decide(), s.group_finished(1, 0), s.decide(), s.update_done()
    assert s.decide() == Decision(create=create(2))
    checkpoint = json.loads(json.dumps(s.state.to_json()))
    s.group_finished(2, 1), s.decide(), s.update_done(), s.group_finished(0, 0)
    assert s.decide() == Decision(drop=(0,), create=create(3, slots=(0,)))
    journal: list[tuple[str, int, int]] = [("created", 0, 0), ("created", 1, 1), ("created", 2, 2)]
    journal += [("dropped", 0, 0), ("created", 3, 0)]  # trained lines are not replayed

    r = Scheduler(
        scheduling_policy("collocated-async"),
        batch_size=1,
        max_staleness=1,
        steps=3,
        state=ScheduleState.from_json(checkpoint),
        version=1,
    )
    adopted = [
        r.replay_created(g, slot) if kind == "created" else r.replay_dropped(g) for kind, g, slot in journal
    ]
    assert adopted == [False, False, False, True, True]
    assert r.state == ScheduleState(next_group=4, next_slot=3, open={2: 2, 3: 0})
    assert r.hold_beyond_window() == ()
    assert r.decide() == Decision()  # nothing re-created
    r.group_finished(2, 1)
    assert r.decide() == Decision(update=(2,))


def test_adopted_groups_beyond_the_window_are_held_until_it_reaches_them() -> None:
    """A sync run killed after creating batch 1 and before its checkpoint at step 1."""
    r = scheduler("sync", batch_size=1, k=0, steps=3)
    assert [r.replay_created(0, 0), r.replay_created(1, 1)] == [True, True]
    assert r.hold_beyond_window() == (1,)
    assert r.decide() == Decision()
    r.group_finished(0, 0)
    assert r.decide() == Decision(update=(0,))
    r.update_done()
    assert r.decide() == Decision(release=(1,))


def test_a_checkpoint_keeps_the_schedule_and_refuses_a_batch_journal() -> None:
    schedule = ScheduleState(next_group=5, next_slot=4, open={2: 2, 4: 0}, requeue=[3])
    state = LoopState(step=2, version=2, cursor=9, journal={2: ["a", "b"], 4: ["c", "d"]}, schedule=schedule)
    assert LoopState.from_json(json.loads(json.dumps(state.to_json()))) == state
    with pytest.raises(ValueError, match="journalled batches, not groups"):
        LoopState.from_json({"step": 1, "version": 1, "cursor": 0, "journal": {"1": ["a"]}})


# -- the loop with a real gateway and engine -------------------------------------------------------


@pytest.fixture(scope="module")
def served(
    tiny_model: Path, log_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Server, Server]]:
    """A gateway and an engine of its own (weight loads must not change the session's engine)."""
    engine = start_engine(tiny_model, log_dir)
    db = tmp_path_factory.mktemp("gw-scheduler") / "gateway.db"
    gateway = gateway_server(tiny_model, [engine.url], db, log_dir, admin_token=ADMIN).start()
    yield gateway, engine
    gateway.stop()
    engine.stop()


def training_loop(
    gw: GatewayClient, engine: Server, model: Path, rd: RunDir, state: LoopState
) -> TrainingLoop:
    from inharness.trainer.torch_engine import TorchTrainingEngine

    policy = TorchTrainingEngine(model, learning_rate=1e-4)
    if (ckpt := rd.latest_checkpoint()) is not None:
        policy.load_checkpoint(ckpt / "policy")
    config = LoopConfig(
        run_name="colloc",
        pool="colloc-pool",
        steps=3,
        batch_size=1,
        group_size=2,
        max_attempts=1,
        max_staleness=1,
        checkpoint_interval=1,
        checkpoint_keep=2,
        seed=0,
        max_tokens_per_sample=None,
        update=UpdateConfig(),
        scheduling_mode="collocated-async",
    )
    return TrainingLoop(
        gateway=gw,
        inference=EngineServers(policy, [engine.url], rd.weights),
        policy=policy,
        tasks=["a", "b", "c"],
        config=config,
        run_dir=rd,
        state=state,
    )


async def claim(gw: GatewayClient, n: int, loop: "asyncio.Task[None]") -> list[ClaimedAttempt]:
    got: list[ClaimedAttempt] = []

    async def more() -> bool:
        if loop.done():
            loop.result()  # raises what ended the loop
        got.extend(await gw.claim_batch("colloc-pool", lease_seconds=120, limit=n - len(got)))
        return len(got) == n

    await eventually(more, f"{n} attempts to claim")
    return got


async def play(gw: GatewayClient, attempt: ClaimedAttempt, *, call: bool = True, finish: bool = True) -> None:
    """One harness run: one model call, then the outcome (rewards 1, 0, 1, ...: they differ in a group)."""
    if call:
        body = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        async with httpx.AsyncClient(timeout=60) as http:
            auth = {"Authorization": f"Bearer {attempt.token}"}
            r = await http.post(f"{gw.base_url}/v1/chat/completions", json=body, headers=auth)
        assert r.status_code == 200, r.text
    if finish:
        await gw.complete(attempt.id, "succeeded", reward=float(next(_REWARDS) % 2 == 0))


_REWARDS = itertools.count()


def journal(rd: RunDir) -> list[dict[str, Any]]:
    return [json.loads(line) for line in rd.journal.read_text().splitlines()]


async def test_collocated_async_loop_drops_a_stale_group_reruns_its_task_and_resumes(
    served: tuple[Server, Server], tiny_model: Path, tmp_path: Path
) -> None:
    """Group 0 is slow (its first call at version 0); groups 1 and 2 train steps 0 and 1; group 0 then
    finishes 2 versions behind (K = 1): dropped, its task re-run as group 3. The run stops there and
    resumes from its checkpoint: group 3 is adopted, not created again, and trains step 2."""
    rd, (gateway, engine) = RunDir(tmp_path), served
    async with GatewayClient(gateway.url, ADMIN) as gw:
        loop = training_loop(gw, engine, tiny_model, rd, LoopState())
        stop = asyncio.Event()
        running = asyncio.create_task(loop.run(stop))
        slow, *others = await claim(gw, 4, running)  # oldest first: group 0's two rollouts, then group 1's
        await play(gw, slow, finish=False)
        for attempt in others:
            await play(gw, attempt)
        for attempt in await claim(gw, 2, running):  # group 2, created once step 0 is published
            await play(gw, attempt)
        await eventually(lambda: loop.state.step == 2, "steps 0 and 1")
        await play(gw, slow, call=False)
        rerun = await claim(gw, 2, running)  # group 3: slot 0 again
        stop.set()
        await asyncio.wait_for(running, 30)

        state = LoopState.from_json(json.loads((rd.checkpoints / "step-2" / "state.json").read_text()))
        loop = training_loop(gw, engine, tiny_model, rd, state)
        await loop.hold_adopted()
        running = asyncio.create_task(loop.run(asyncio.Event()))
        for attempt in rerun:
            await play(gw, attempt)
        await asyncio.wait_for(running, 60)
        counts = (await gw.progress()).rollouts

    assert sum(counts.values()) == 4 * 2, "four groups created, none twice"
    lines = journal(rd)
    slots = {e["group"]: e["slot"] for e in lines if "group" in e}
    assert slots == {0: 0, 1: 1, 2: 2, 3: 0}
    assert [(e["step"], e["trained"]) for e in lines if "trained" in e] == [(0, [1]), (1, [2]), (2, [3])]
    assert [e["dropped"] for e in lines if "dropped" in e] == [[0]]
    rows = [json.loads(line) for line in rd.metrics.read_text().splitlines()]
    assert [(m["groups_trained"], m["dropped_stale"]) for m in rows] == [(1, 0), (1, 0), (1, 1)]
    assert [m["staleness_max"] for m in rows] == [0, 0, 0] and all(m["staleness_mean"] == 0 for m in rows)
    assert all(m["time_calls_held_s"] >= m["time_update_s"] > 0 for m in rows), "calls held while training"
    assert loop.state.version == 3 and loop.state.journal == {} and loop.state.schedule.open == {}
