"""`inharness sft`: a warm-up from recorded attempts in a real store (SQLite file and PostgreSQL 15): which
rollouts it keeps (rejection sampling by reward), that only the model's own tokens carry the loss, and
the command as a user runs it, from a run directory with relative paths, and on a store with nothing
to learn from."""

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from postgres_server import postgres_fixture, postgres_url_fixture  # noqa: F401 (the fixtures)
from transformers import AutoModelForCausalLM, AutoTokenizer

from inharness.gateway import schema
from inharness.gateway.store import CallRecord, Store
from inharness.trainer.samples import Sample
from inharness.trainer.torch_engine import TorchTrainingEngine
from inharness.trainer.warmup import read_rollouts, select


@pytest.fixture(params=["sqlite", "postgresql"], name="url")
def url_fixture(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'gateway.db'}"
    return request.getfixturevalue("postgres_url")


def _ids(tokenizer: AutoTokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _call(attempt: schema.ClaimedAttempt, n: int, prompt: list[int], response: list[int]) -> CallRecord:
    now = time.time()
    return CallRecord(
        attempt_id=attempt.id,
        rollout_id=attempt.rollout_id,
        request_id=f"{attempt.id}-{n}",
        choice_index=0,
        protocol="openai.chat",
        requested_model="policy",
        model_version=0,
        engine="e",
        prompt_ids=prompt,
        response_ids=response,
        response_logprobs=[-1.0] * len(response),
        finish_reason="stop",
        parent_call_id=None,
        prefix_reused=False,
        prefix_mismatch=None,
        request_digest=f"q{attempt.id}{n}",
        reply_digest=f"a{attempt.id}{n}",
        started_at=now,
        first_token_at=None,
        finished_at=now,
        request_body={},
        response_body={},
    )


class Recorded:
    """What a harness of two turns leaves: system prompt and task, a tool call, the tool's output, an
    answer; as token ids of the tiny model's tokenizer."""

    def __init__(self, model: Path) -> None:
        tok = AutoTokenizer.from_pretrained(model)
        self.prompt = _ids(
            tok, "<|im_start|>system\nYou are a shell agent.<|im_end|>\n<|im_start|>user\nAdd 2 and 3."
        )
        self.tool_call = _ids(tok, "echo $((2+3)) > answer.txt<|im_end|>")
        self.tool_output = _ids(tok, "\n<|im_start|>user\nreturncode 0<|im_end|>\n<|im_start|>assistant\n")
        self.answer = _ids(tok, "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT<|im_end|>")

    def calls(self, attempt: schema.ClaimedAttempt) -> list[CallRecord]:
        second = self.prompt + self.tool_call + self.tool_output
        return [_call(attempt, 0, self.prompt, self.tool_call), _call(attempt, 1, second, self.answer)]


async def _fill(url: str, recorded: Recorded) -> list[str]:
    """Four finished rollouts: rewarded 1.0, rewarded 0.0, failed, and rewarded without any model call."""
    store = await Store.open(url)
    try:
        ids = await store.create_rollouts(
            schema.CreateRollouts(tasks=["good", "bad", "failed", "silent"]), default_max_attempts=1
        )
        outcomes = [
            ("succeeded", 1.0, True),
            ("succeeded", 0.0, True),
            ("failed", None, True),
            ("succeeded", 1.0, False),
        ]
        for status, reward, calls in outcomes:
            attempt = await store.claim("default", 600)
            assert attempt is not None
            if calls:
                await store.record_calls(recorded.calls(attempt))
            await store.complete(attempt.id, schema.CompleteRequest(status=status, reward=reward))
        return ids
    finally:
        await store.close()


async def test_the_warm_up_keeps_succeeded_rollouts_rewarded_at_least_the_minimum(
    url: str, tiny_model: Path
) -> None:
    recorded = Recorded(tiny_model)
    ids = await _fill(url, recorded)
    rollouts = await read_rollouts(url)
    assert [r.rollout.id for r in rollouts] == ids

    picky = select(rollouts, min_reward=0.5)
    assert (picky.rollouts, picky.kept) == (4, 1)
    assert picky.skipped == {"failed": 1, "reward below 0.5": 1, "without model calls": 1}
    assert {s.rollout_id for s in picky.samples} == {ids[0]}

    every = select(rollouts, min_reward=None)
    assert every.kept == 2 and {s.rollout_id for s in every.samples} == set(ids[:2])
    assert every.skipped == {"failed": 1, "without model calls": 1}


async def test_only_the_models_turns_carry_the_loss_system_task_and_tool_output_do_not(
    url: str, tiny_model: Path
) -> None:
    recorded = Recorded(tiny_model)
    await _fill(url, recorded)
    (sample,) = select(await read_rollouts(url), min_reward=1.0).samples
    r = recorded
    assert sample.input_ids == r.prompt + r.tool_call + r.tool_output + r.answer  # two turns, one sample
    assert sample.loss_mask == (
        [0] * len(r.prompt) + [1] * len(r.tool_call) + [0] * len(r.tool_output) + [1] * len(r.answer)
    )


def test_the_sft_loss_is_the_mean_nll_of_the_masked_in_tokens_and_learning_lowers_it(
    tiny_model: Path,
) -> None:
    recorded = Recorded(tiny_model)
    r = recorded
    ids = r.prompt + r.tool_call + r.tool_output + r.answer
    mask = [0] * len(r.prompt) + [1] * len(r.tool_call) + [0] * len(r.tool_output) + [1] * len(r.answer)
    sample = Sample("ro", "g", [1], ids, mask, [0.0] * len(ids), [0], 1.0, len(r.prompt))
    engine = TorchTrainingEngine(tiny_model, learning_rate=3e-3, seed=0)
    (lp,) = engine.logprobs([sample], temperature=1.0)
    on = torch.tensor(mask[1:], dtype=torch.bool)
    first = engine.sft_step([sample] * 3, learning_rate=3e-3)  # rows alike: the shared-prefix forward
    assert first["tokens"] == 3 * sum(mask)
    assert first["loss"] == pytest.approx(
        float(-lp[on].mean()), rel=1e-4
    )  # masked-out tokens count for nothing
    for _ in range(15):
        last = engine.sft_step([sample], learning_rate=3e-3)
    assert last["loss"] < 0.5 * first["loss"]


def test_a_frozen_context_gives_the_same_loss_with_the_prompt_outside_the_graph(tiny_model: Path) -> None:
    """`context_gradient=False`: the loss is the plain pass's (rows of different prompt lengths in one
    micro-batch), but the positions before the first learnt token run without gradient: only the turns
    and what follows them are in the autograd graph, so the backward pass costs what they cost."""
    r = Recorded(tiny_model)
    turns = r.tool_call + r.tool_output + r.answer
    learnt = [1] * len(r.tool_call) + [0] * len(r.tool_output) + [1] * len(r.answer)
    prompts = [r.prompt, r.prompt[:1] + r.prompt]  # the second row's learnt turns start one later
    samples = [
        Sample(f"ro{k}", "g", [1], p + turns, [0] * len(p) + learnt, [0.0] * len(p + turns), [0], 1.0, len(p))
        for k, p in enumerate(prompts)
    ]
    width = len(prompts[1] + turns)
    seen: dict[bool, list[tuple[int, bool]]] = {}
    losses: dict[bool, float] = {}
    for context_gradient in (True, False):
        engine = TorchTrainingEngine(tiny_model, learning_rate=1e-3, seed=0)
        passes = seen[context_gradient] = []
        hook = engine.model.get_input_embeddings().register_forward_hook(
            lambda _m, _i, out, passes=passes: passes.append((out.shape[1], out.requires_grad))
        )
        losses[context_gradient] = engine.sft_step(
            samples, learning_rate=1e-3, context_gradient=context_gradient
        )["loss"]
        hook.remove()
    assert losses[False] == pytest.approx(losses[True], rel=1e-5)
    start = len(r.prompt) - 1  # the logits there score the first learnt token of the first row
    assert seen[False] == [(start, False), (width - start, True)]
    assert all(tracked for _, tracked in seen[True]) and sum(n for n, _ in seen[True]) >= width


def _sft(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "inharness.cli", "sft", *args]
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=300, env=os.environ)


def test_inharness_sft_from_a_run_directory_writes_a_model_the_engine_loads(
    tmp_path: Path, tiny_model: Path
) -> None:
    run_dir = tmp_path / "runs" / "teacher"
    run_dir.mkdir(parents=True)
    asyncio.run(_fill(f"sqlite:///{run_dir / 'gateway.db'}", Recorded(tiny_model)))
    model = os.path.relpath(tiny_model, tmp_path)
    done = _sft(
        tmp_path,
        "--from",
        "runs/teacher",
        "--model",
        model,
        "--out",
        "warm",
        "--min-reward",
        "1",
        "--steps",
        "4",
    )
    assert done.returncode == 0, done.stderr
    assert "1 of 4 rollouts kept" in done.stdout + done.stderr
    summary = json.loads((tmp_path / "warm" / "sft_summary.json").read_text())
    assert (summary["rollouts_kept"], summary["samples"], len(summary["losses"])) == (1, 1, 4)
    assert summary["skipped"] == {"failed": 1, "reward below 1": 1, "without model calls": 1}
    assert (tmp_path / "warm" / "sft_loss.png").stat().st_size > 0
    warm = AutoModelForCausalLM.from_pretrained(tmp_path / "warm")
    cold = AutoModelForCausalLM.from_pretrained(tiny_model)
    assert any(not torch.equal(a, b) for a, b in zip(warm.parameters(), cold.parameters(), strict=True))


def test_inharness_sft_without_anything_to_learn_says_why_in_one_line(
    tmp_path: Path, tiny_model: Path
) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    asyncio.run(_fill(f"sqlite:///{run_dir / 'gateway.db'}", Recorded(tiny_model)))
    model = str(tiny_model)
    picky = _sft(tmp_path, "--from", "run", "--model", model, "--out", "warm", "--min-reward", "2")
    assert picky.returncode == 2
    (line,) = [x for x in picky.stderr.splitlines() if x.startswith("inharness sft:")]
    assert "nothing to learn from in run: 0 of 4 rollouts kept" in line and "3 reward below 2" in line
    assert not (tmp_path / "warm").exists()

    missing = _sft(tmp_path, "--from", "no-such-run", "--model", model, "--out", "warm")
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines()[-1] == (
        "inharness sft: no gateway store at no-such-run: no-such-run does not exist "
        "(name a run directory, a .db file or a URL)"
    )
