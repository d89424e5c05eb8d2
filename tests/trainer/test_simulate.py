"""`inharness simulate`: hand-computed timelines are met exactly, staleness stays within K, stale
groups are counted, a real gateway store is fitted, and the command refuses bad flags by name."""

import json
import time
from pathlib import Path

import pytest

from inharness import cli
from inharness.gateway import schema
from inharness.gateway.store import CallRecord, Store
from inharness.trainer.simulate import cli as sim_cli
from inharness.trainer.simulate import engine
from inharness.trainer.simulate.engine import Sim
from inharness.trainer.simulate.fit import fit_run
from inharness.trainer.simulate.params import MODES, PRESETS, Dist, Hardware, Params, Shape, Workload, load
from inharness.trainer.simulate.report import summarize


def one_call(*, gpus: int = 1, concurrency: int | None = None, k: int = 1, max_batch: int = 1) -> Params:
    """1 group of 1 rollout per step; a rollout is one call (5 tokens at 5 tokens/s alone: 1 s),
    then 10 s of tools; training its 5 tokens takes 1 s on one GPU; weight sync 1 s."""
    return Params(
        name="hand",
        shape=Shape(gpus=gpus, steps=6, batch_size=1, group_size=1, max_staleness=k, concurrency=concurrency),
        workload=Workload(
            calls_per_rollout=Dist(median=1),
            tool_seconds=Dist(),
            finish_seconds=Dist(median=10),
            first_prompt_tokens=Dist(),
            prompt_tokens=Dist(),
            response_tokens=Dist(median=5),
        ),
        hardware=Hardware(
            decode_tokens_per_s=5 * max_batch,
            max_batch=max_batch,
            train_tokens_per_s=5,
            weight_sync_seconds=1,
        ),
    )


def staleness(sim: Sim) -> list[int]:
    return [s for _, s in sim.trained]


def test_sync_step_is_generation_plus_tools_plus_training_plus_sync() -> None:
    sim = Sim(one_call(), "sync", seed=0).run()
    assert sim.step_ends == [13.0 * k for k in range(1, 7)]  # 1 + 10 + 1 + 1
    assert staleness(sim) == [0] * 6 and sim.dropped_stale == 0


def test_sync_with_prefill_several_calls_and_a_shared_gpu() -> None:
    """2 groups of 2 share one GPU (max_batch 4: each call decodes at 5 tokens/s). A rollout:
    startup 3, [prefill 100/100 + decode 10/5] tool 4, [50/100 + 2] tool 4, [0.5 + 2] finish 6 = 25 s;
    training 4 x (100 + 50 + 50 + 30) = 920 tokens at 46/s = 20 s; sync 5: 50 s a step."""
    params = Params(
        name="hand",
        shape=Shape(gpus=1, steps=3, batch_size=2, group_size=2),
        workload=Workload(
            calls_per_rollout=Dist(median=3),
            startup_seconds=Dist(median=3),
            tool_seconds=Dist(median=4),
            finish_seconds=Dist(median=6),
            first_prompt_tokens=Dist(median=100),
            prompt_tokens=Dist(median=50),
            response_tokens=Dist(median=10),
        ),
        hardware=Hardware(
            decode_tokens_per_s=20,
            max_batch=4,
            prefill_tokens_per_s=100,
            train_tokens_per_s=46,
            weight_sync_seconds=5,
        ),
    )
    sim = Sim(params, "sync", seed=0).run()
    assert sim.step_ends == pytest.approx([50.0, 100.0, 150.0])
    r = summarize(sim)
    assert r.gen_busy == pytest.approx(6 / 50)  # 3 calls x 2 s at full capacity (4 of 4) per step
    assert r.train_busy == pytest.approx(20 / 50)
    assert r.held == pytest.approx(5 / 50)  # sync holds calls only while the weights load
    assert r.steps_per_hour == pytest.approx(3600 / 50)


def test_collocated_async_steady_state_by_hand() -> None:
    """K=1: two groups open. Both end at 11: update 0 trains group 0 (11-13, v1). Group 2 is created
    then, but update 1 takes group 1 at once (13-15, staleness 1), so its call waits, held. From 15
    groups 2 and 3 call under v2 and end at 26: updates 26-28 and 28-30, and so on: 2 steps per
    15 s against sync's 13 s per step."""
    sim = Sim(one_call(max_batch=2), "collocated-async", seed=0).run()
    assert sim.concurrency == 2  # batch x group x (K + 1)
    assert sim.step_ends == [13.0, 15.0, 28.0, 30.0, 43.0, 45.0]
    assert staleness(sim) == [0, 1, 0, 1, 0, 1] and sim.dropped_stale == 0
    sync = Sim(one_call(max_batch=2), "sync", seed=0).run()
    assert sync.step_ends[-1] / sim.step_ends[-1] == pytest.approx(78 / 45)


def test_collocated_async_resumes_calls_between_back_to_back_updates() -> None:
    """K=2: three groups open, all end at 11. Update 0 (11-13), then update 1 (13-15) while group 3
    waits held. The gateway resumes at 15: group 3 calls (15-16) and update 2 drains it before it
    trains (16-18). Groups 3, 4 (created 15, 18) end at 26 and 29: updates end at 28, 31, 33."""
    sim = Sim(one_call(k=2, max_batch=3), "collocated-async", seed=0).run()
    assert sim.step_ends == [13.0, 15.0, 18.0, 28.0, 31.0, 33.0]
    assert staleness(sim) == [0, 1, 2, 1, 1, 2] and sim.dropped_stale == 0


def test_a_group_too_slow_for_k_is_dropped_and_its_task_rerun(monkeypatch: pytest.MonkeyPatch) -> None:
    """K=1, group 0's tools take 30 s instead of 10. Group 1 trains first (11-13, v1); groups 2 and
    3 follow (24-26, 37-39). Group 0 ends at 31 with its call on v0, but v2 is served: more than 1
    behind, dropped, and group 4 re-runs its task (ends 42, trained 42-44 at staleness 1)."""
    real = engine.make_group

    def slow_first(params: Params, seed: int, index: int) -> engine.Group:
        group = real(params, seed, index)
        if index == 0:
            group.rollouts[0].tools[-1] = 30.0
        return group

    monkeypatch.setattr(engine, "make_group", slow_first)
    sim = Sim(one_call(max_batch=2), "collocated-async", seed=0).run()
    assert sim.step_ends == [13.0, 26.0, 39.0, 44.0, 52.0, 57.0]
    assert staleness(sim) == [0, 0, 0, 1, 1, 1]
    assert sim.dropped_stale == 1 and sim.groups_started == 6 + 1
    r = summarize(sim)
    assert r.dropped_stale == 1 and r.calls_per_dropped_rollout == 1 and r.calls_per_trained_rollout == 1


def test_async_on_split_gpus_by_hand() -> None:
    """1 GPU generates, 1 trains (1 s). Batches 0 and 1 start together and end at 11; batch 2
    starts after the first sync (13) and ends at 24: steps end at 13, 15, then 2 per 13 s."""
    sim = Sim(one_call(gpus=2, max_batch=2), "async", seed=0).run()
    assert sim.step_ends == [13.0, 15.0, 26.0, 28.0, 39.0, 41.0]
    assert staleness(sim) == [0, 1, 1, 1, 1, 1]


def small_swe(k: int) -> Params:
    swe = PRESETS["swe"]
    shape = Shape(gpus=4, steps=6, batch_size=4, group_size=2, max_staleness=k)
    return swe.model_copy(update={"shape": shape})


@pytest.mark.parametrize("k", [1, 2, 3])
def test_staleness_never_exceeds_k_and_runs_repeat(k: int) -> None:
    for mode in MODES:
        sim = Sim(small_swe(k), mode, seed=k).run()
        assert min(staleness(sim)) >= 0 and max(staleness(sim)) <= (0 if mode == "sync" else k), mode
        assert len(sim.trained) == 6 * 4 * 2 and sim.steps_done == 6
        # every task slot is trained once; a dropped group's slot is run again by a new group
        assert sim.groups_started == 6 * 4 + sim.dropped_stale
        r = summarize(sim)
        assert r.gen_busy > 0 and r.train_busy > 0 and r.gen_busy + r.train_busy <= 1
        again = Sim(small_swe(k), mode, seed=k).run()
        assert again.step_ends == sim.step_ends and again.dropped_stale == sim.dropped_stale
    assert Sim(small_swe(k), "sync", seed=k + 10).run().step_ends != sim.step_ends


def test_shapes_a_mode_cannot_run_are_refused() -> None:
    params = one_call(gpus=2)
    every_gpu_trains = params.model_copy(update={"shape": params.shape.model_copy(update={"train_gpus": 2})})
    with pytest.raises(ValueError, match="at least one generation GPU"):
        Sim(every_gpu_trains, "async", seed=0)
    assert "async" not in one_call().modes_possible()


def test_override_files_merge_into_their_preset(tmp_path: Path) -> None:
    f = tmp_path / "w.yaml"
    f.write_text(
        "preset: calc\nshape: {steps: 3}\nworkload:\n  tool_seconds: {median: 2}\n  startup_seconds: 1\n"
    )
    p = load(str(f))
    calc = PRESETS["calc"]
    assert p.shape.steps == 3 and p.shape.batch_size == calc.shape.batch_size
    assert p.workload.tool_seconds == calc.workload.tool_seconds.model_copy(update={"median": 2.0})
    assert p.workload.startup_seconds == Dist(median=1)
    f.write_text(json.dumps({"hardware": {"max_batch": 0}}))
    with pytest.raises(ValueError, match="max_batch"):
        load(str(f))
    assert sim_cli.MODES == MODES and set(sim_cli.PRESET_NAMES) == set(PRESETS)


def _call(
    attempt: schema.ClaimedAttempt, n: int, start: float, prompt: list[int], parent: int | None
) -> CallRecord:
    return CallRecord(
        attempt_id=attempt.id,
        rollout_id=attempt.rollout_id,
        request_id=f"{attempt.id}-{n}",
        choice_index=0,
        protocol="openai.chat",
        requested_model="m",
        model_version=0,
        engine="http://engine-0",
        prompt_ids=prompt,
        response_ids=list(range(20)),
        response_logprobs=[-0.5] * 20,
        finish_reason="stop",
        parent_call_id=parent,
        prefix_reused=parent is not None,
        prefix_mismatch=None,
        request_digest=f"q{attempt.id}{n}",
        reply_digest=f"a{attempt.id}{n}",
        started_at=start,
        first_token_at=None,
        finished_at=start + 0.5,
        request_body={},
        response_body={},
    )


async def test_from_run_fits_a_real_gateway_store(tmp_path: Path) -> None:
    """2 groups of 2; each attempt: a 100-token prompt, 20 tokens in 0.5 s, 2 s of tools, then a call
    adding 15 tokens to its parent's 120 (stored as those 15: the store keeps a continuation's new
    ids only). The calls never overlap: 40 tokens/s, alone."""
    store = await Store.open(f"sqlite:///{tmp_path / 'gateway.db'}")
    try:
        await store.create_rollouts(
            schema.CreateRollouts(tasks=["a", "b"], group_size=2), default_max_attempts=1
        )
        claimed = await store.claim_many("default", 60.0, 10)
        base = time.time() + 1.0
        for i, a in enumerate(claimed):
            first = _call(a, 0, base + 10 * i, list(range(100)), None)
            await store.record_calls([first])
            extended = [*first.prompt_ids, *first.response_ids, *range(500, 515)]
            await store.record_calls([_call(a, 1, base + 10 * i + 2.5, extended, first.id)])
            await store.complete(a.id, schema.CompleteRequest(status="succeeded", reward=1.0))
    finally:
        await store.close()
    step = {"time_update_s": 2.0, "tokens": 80, "time_publish_s": 0.25, "rollouts": 4, "staleness_max": 0}
    (tmp_path / "metrics.jsonl").write_text(
        "\n".join(json.dumps({**step, "step": s, "wall_s": 10.0 * (s + 1)}) for s in range(2)) + "\n"
    )

    fitted = fit_run(tmp_path)
    p = fitted.params
    w = p.workload
    assert w.calls_per_rollout.values == (2.0,) * 4
    assert w.first_prompt_tokens.values == (100.0,) * 4 and w.prompt_tokens.values == (15.0,) * 4
    assert w.response_tokens.values == (20.0,) * 8
    assert w.tool_seconds.values == pytest.approx([2.0] * 4)
    assert p.hardware.decode_tokens_per_s == pytest.approx(40.0) and p.hardware.max_batch == 1
    # trained tokens: 4 x (100 + 15 + 40) = 620 for 160 generated: metrics' 2 x 80 → 620 in 4 s
    assert p.hardware.train_tokens_per_s == pytest.approx(155.0)
    assert p.hardware.weight_sync_seconds == 0.25
    assert (p.shape.gpus, p.shape.group_size, p.shape.batch_size, p.shape.steps) == (1, 2, 2, 2)
    assert fitted.recorded_steps_per_hour == pytest.approx(360.0)
    assert any("lower bound" in n for n in fitted.notes)
    assert Sim(p, "sync", seed=0).run().steps_done == 2


def test_cli_row_reaches_its_handler_and_refuses_bad_flags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "gateway.db").touch()
    assert cli.parser().parse_args(["simulate"]).handler is next(
        c.run for c in cli.COMMANDS if isinstance(c, cli.Command) and c.name == "simulate"
    )
    for argv, message in (
        (["--gpus", "0"], "argument --gpus: must be at least 1"),
        (["--steps", "x"], "argument --steps: 'x' is not an integer"),
        (["--modes", "sync,fast"], "argument --modes: fast: not a mode"),
        (["--workload", str(tmp_path / "none.yaml")], "argument --workload: "),
        (["--from-run", str(tmp_path)], "argument --from-run: "),
        (["--workload", "calc", "--from-run", str(run)], "not allowed with argument"),
    ):
        with pytest.raises(SystemExit) as exited:
            cli.main(["simulate", *argv])
        assert exited.value.code == 2 and message in capsys.readouterr().err, argv
    assert cli.main(["simulate", "--workload", "calc", "--modes", "async", "--out", str(tmp_path)]) == 2
    assert "async needs at least one generation GPU" in capsys.readouterr().err


def test_cli_prints_the_table_and_writes_timelines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    argv = ["simulate", "--workload", "calc", "--gpus", "2", "--steps", "3", "--out", str(out)]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "vs sync" in printed and "collocated-async" in printed and "1.00x" in printed
    for mode in MODES:
        png = out / f"timeline-{mode}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["modes"]) == set(MODES) and summary["params"]["shape"]["gpus"] == 2
