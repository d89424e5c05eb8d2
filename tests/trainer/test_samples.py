"""The sample adapter on hand-built recorded traces: token-exact merges, and splits with their reason."""

from typing import Any

import pytest
import torch

from inharness.gateway.schema import CallOut, ExportedRollout, RolloutOut
from inharness.trainer.algorithms import token_advantages
from inharness.trainer.samples import AdapterStats, build_batch, build_samples, index_rollouts


def call(
    cid: int,
    prompt: list[int],
    response: list[int],
    logprobs: list[float] | None = None,
    *,
    parent: int | None = None,
    mismatch: str | None = None,
    request: str | None = None,
    choice: int = 0,
    version: int = 0,
    finish: str = "stop",
) -> CallOut:
    return CallOut(
        id=cid,
        attempt_id="att",
        rollout_id="r",
        request_id=request or f"req-{cid}",
        choice_index=choice,
        protocol="openai.chat",
        requested_model="m",
        model_version=version,
        engine="e0",
        prompt_ids=prompt,
        response_ids=response,
        response_logprobs=logprobs if logprobs is not None else [-0.5] * len(response),
        finish_reason=finish,
        parent_call_id=parent,
        prefix_reused=parent is not None and mismatch is None,
        prefix_mismatch=mismatch,
        started_at=0.0,
        first_token_at=None,
        finished_at=1.0,
    )


def rollout(
    calls: list[CallOut], *, rid: str = "r", group: str = "g", reward: float | None = 1.0, **kw: Any
) -> ExportedRollout:
    ro = RolloutOut(
        id=rid,
        group_id=group,
        pool="default",
        task={},
        labels={},
        status=kw.pop("status", "succeeded"),
        reward=reward,
        max_attempts=1,
        created_at=0.0,
    )
    return ExportedRollout(cursor=0, rollout=ro, calls=calls)


# A 3-turn tool conversation: system+user [1, 2, 3]; the model answers [10, 11] (a tool call); the
# tool result is [20, 21]; the model answers [12]; the user says [22, 23, 24]; the model answers [13, 14].
P1 = [1, 2, 3]
P2 = [*P1, 10, 11, 20, 21]
P3 = [*P2, 12, 22, 23, 24]


def three_turns(**kw: Any) -> list[CallOut]:
    return [
        call(1, P1, [10, 11], [-0.1, -0.2], version=3),
        call(2, P2, [12], [-0.3], parent=kw.get("p2", 1), version=3),
        call(3, P3, [13, 14], [-0.4, -0.5], parent=kw.get("p3", 2), version=4),
    ]


def test_three_turn_tool_conversation_merges_into_one_sample() -> None:
    samples, stats = build_samples(rollout(three_turns(), reward=0.5))
    assert len(samples) == 1
    s = samples[0]
    assert s.input_ids == [1, 2, 3, 10, 11, 20, 21, 12, 22, 23, 24, 13, 14]
    assert s.loss_mask == [0, 0, 0, 1, 1, 0, 0, 1, 0, 0, 0, 1, 1]
    assert s.behaviour_logprobs == [0.0, 0.0, 0.0, -0.1, -0.2, 0.0, 0.0, -0.3, 0.0, 0.0, 0.0, -0.4, -0.5]
    assert s.call_ids == [1, 2, 3]
    assert s.model_versions == [3, 3, 4]
    assert (s.rollout_id, s.group_id, s.reward, s.num_prompt_tokens) == ("r", "g", 0.5, 3)
    assert s.num_generated_tokens == 5
    assert (stats.calls, stats.samples, stats.merged_turns, stats.splits) == (3, 1, 2, {})
    assert stats.merged_turn_ratio == 1.0


def test_tokens_decide_the_merge_not_parent_call_id() -> None:
    samples, stats = build_samples(rollout(three_turns(p2=None, p3=None)))
    assert [s.call_ids for s in samples] == [[1, 2, 3]]
    assert stats.merged_turns == 2


def test_rewritten_history_splits_with_the_gateway_reason() -> None:
    calls = three_turns()
    # Turn 3 arrives with a compacted history: it extends no earlier call token-exactly.
    calls[2] = call(3, [1, 2, 3, 99, 12, 22], [13, 14], [-0.4, -0.5], mismatch="history_rewritten")
    samples, stats = build_samples(rollout(calls))
    assert [s.call_ids for s in samples] == [[1, 2], [3]]
    assert stats.splits == {"prefix_mismatch:history_rewritten": 1}
    assert stats.merged_turns == 1
    assert stats.merged_turn_ratio == 0.5
    second = samples[1]
    assert second.input_ids == [1, 2, 3, 99, 12, 22, 13, 14]
    assert second.loss_mask == [0, 0, 0, 0, 0, 0, 1, 1]
    assert second.num_prompt_tokens == 6


def test_a_call_tree_trains_each_token_once_and_splits_by_root_reason() -> None:
    """Claude Code's shape: a main line, a side call (a title), a sub-agent of two turns, a branch from
    the main line's first call after later calls, and a summary under another system prompt."""
    calls = [
        call(1, P1, [10, 11]),  # main, turn 1
        call(2, [5, 6], [60], mismatch="new_conversation"),  # a side call: a title
        call(3, [7, 8], [70, 71], mismatch="new_conversation"),  # the sub-agent's first call
        call(4, P2, [12], parent=1),  # main, turn 2: extends call 1, not the latest call
        call(5, [7, 8, 70, 71, 80], [72], parent=3),  # the sub-agent's second turn
        call(6, [*P1, 10, 11, 90], [13], parent=1),  # a branch from call 1: fan-out
        call(7, [4, 2, 3, 10, 11, 20, 21, 12, 25], [14], mismatch="system_changed"),  # a summary
    ]
    samples, stats = build_samples(rollout(calls))
    assert [s.call_ids for s in samples] == [[1, 4], [2], [3, 5], [6], [7]]
    assert stats.splits == {
        "prefix_mismatch:new_conversation": 2,
        "choice_fanout": 1,
        "prefix_mismatch:system_changed": 1,
    }
    assert sum(s.num_generated_tokens for s in samples) == sum(len(c.response_ids) for c in calls)
    assert samples[3].loss_mask == [0, 0, 0, 0, 0, 0, 1]  # call 1's reply is trained in [1, 4] only


def test_template_not_prefix_splits_although_the_gateway_names_a_parent() -> None:
    calls = three_turns()
    calls[2] = call(3, [1, 2, 3, 10, 77, 20, 21, 12], [13], parent=2, mismatch="template_not_prefix")
    _, stats = build_samples(rollout(calls))
    assert stats.splits == {"prefix_mismatch:template_not_prefix": 1}


def test_unexplained_divergence_is_not_a_prefix() -> None:
    calls = [call(1, P1, [10]), call(2, [5, 6], [11])]
    samples, stats = build_samples(rollout(calls))
    assert len(samples) == 2
    assert stats.splits == {"not_a_prefix": 1}


def test_n2_fanout_gives_two_samples_and_trains_shared_history_once() -> None:
    p2 = [*P1, 10, 11, 20]
    calls = [
        call(1, P1, [10, 11], [-0.1, -0.2]),
        call(2, p2, [30], [-0.3], parent=1, request="req-2", choice=0),
        call(3, p2, [40, 41], [-0.6, -0.7], parent=1, request="req-2", choice=1),
        # The harness continued with the second choice.
        call(4, [*p2, 40, 41, 50], [42], [-0.8], parent=3),
    ]
    samples, stats = build_samples(rollout(calls))
    assert [s.call_ids for s in samples] == [[1, 2], [3, 4]]
    assert stats.splits == {"choice_fanout": 1}
    assert stats.merged_turns == 2
    a, b = samples
    assert a.input_ids == [1, 2, 3, 10, 11, 20, 30]
    assert a.loss_mask == [0, 0, 0, 1, 1, 0, 1]
    assert b.input_ids == [1, 2, 3, 10, 11, 20, 40, 41, 50, 42]
    assert b.loss_mask == [0, 0, 0, 0, 0, 0, 1, 1, 0, 1]  # call 1's response is context here
    assert b.behaviour_logprobs == [0.0] * 6 + [-0.6, -0.7, 0.0, -0.8]
    assert sum(s.num_generated_tokens for s in samples) == sum(len(c.response_ids) for c in calls)


def test_fanout_on_the_first_turn_and_resampled_turn() -> None:
    calls = [call(1, P1, [10], request="q", choice=0), call(2, P1, [11], request="q", choice=1)]
    samples, stats = build_samples(rollout(calls))
    assert len(samples) == 2
    assert stats.splits == {"choice_fanout": 1}
    # A re-sampled turn: the harness asks turn 2 again with the same prompt (new request).
    calls = [call(1, P1, [10, 11]), call(2, P2, [12], parent=1), call(3, P2, [13])]
    samples, stats = build_samples(rollout(calls))
    assert [s.call_ids for s in samples] == [[1, 2], [3]]
    assert stats.splits == {"choice_fanout": 1}


def test_length_cap_splits_and_flags_oversized_sample() -> None:
    # Merged lengths: call 1 -> 5 tokens, + call 2 -> 8, + call 3 -> 13.
    samples, stats = build_samples(rollout(three_turns()), max_tokens=10)
    assert [s.call_ids for s in samples] == [[1, 2], [3]]
    assert stats.splits == {"length_cap": 1}
    assert stats.oversized_samples == 1  # call 3 alone is 13 tokens; it is kept whole
    assert samples[1].loss_mask == [0] * 11 + [1, 1]
    samples, stats = build_samples(rollout(three_turns()), max_tokens=13)
    assert len(samples) == 1 and stats.oversized_samples == 0


def test_no_calls_and_failed_rollouts() -> None:
    samples, stats = build_samples(rollout([]))
    assert samples == [] and stats.skipped == {"no_calls": 1}
    failed = rollout(three_turns(), status="failed", reward=None)
    samples, stats = build_samples(failed)
    assert samples == [] and stats.skipped == {"failed": 1} and stats.calls == 0
    samples, _ = build_samples(failed, include_failed=True)
    assert len(samples) == 1 and samples[0].reward is None


def test_build_batch_sums_stats() -> None:
    fanout = [call(1, P1, [10], request="q"), call(2, P1, [11], request="q", choice=1)]
    samples, stats = build_batch(
        [
            rollout(three_turns(), rid="a"),
            rollout(fanout, rid="b"),
            rollout([], rid="c"),
            rollout(three_turns(), rid="d", status="failed"),
        ]
    )
    assert [s.rollout_id for s in samples] == ["a", "b", "b"]
    assert stats == AdapterStats(
        rollouts=4,
        calls=5,
        samples=3,
        merged_turns=2,
        splits={"choice_fanout": 1},
        skipped={"no_calls": 1, "failed": 1},
    )
    assert stats.mergeable_turns == 3  # (3 - 1) + (2 - 1)
    assert stats.merged_turn_ratio == pytest.approx(2 / 3)
    assert AdapterStats().merged_turn_ratio == 1.0


def test_a_group_whose_one_attempt_was_cut_off_mid_stream_trains_that_attempt_against_the_other() -> None:
    """A harness that gave up on a stream (gateway finish reason client_cut) leaves a sample like any
    other: its group's baseline sees a reward with the tokens that earned it (issue 31)."""
    cut = rollout([call(1, P1, [10, 10, 10], finish="client_cut")], rid="gave-up", reward=0.0)
    samples, stats = build_batch([cut, rollout(three_turns(), rid="fine", reward=1.0)])
    assert [s.rollout_id for s in samples] == ["gave-up", "fine"] and stats.skipped == {}
    assert samples[0].loss_mask == [0, 0, 0, 1, 1, 1]
    width = max(len(s.loss_mask) for s in samples)
    mask = torch.tensor([s.loss_mask + [0] * (width - len(s.loss_mask)) for s in samples])
    adv = token_advantages(torch.tensor([0.0, 1.0]), torch.tensor([0, 0]), torch.tensor([0, 1]), mask)
    assert (adv[0][mask[0].bool()] < 0).all() and (adv[1][mask[1].bool()] > 0).all()


def test_logprobs_must_match_response_ids() -> None:
    with pytest.raises(ValueError, match="not token-exact"):
        build_samples(rollout([call(1, P1, [10, 11], [-0.1])]))


def test_index_rollouts() -> None:
    fanout = [call(1, P1, [10], request="q"), call(2, P1, [11], request="q", choice=1)]
    samples, _ = build_batch(
        [
            rollout(fanout, rid="a", group="g1", reward=1.0),
            rollout(three_turns(), rid="b", group="g2", reward=0.0),
            rollout(three_turns(), rid="c", group="g1", reward=0.5),
        ]
    )
    index = index_rollouts(samples)
    assert index.rollout_ids == ["a", "b", "c"]
    assert index.rewards == [1.0, 0.0, 0.5]
    assert index.group_index == [0, 1, 0]
    assert index.sample_rollout == [0, 0, 1, 2]
    samples[0].reward = None
    with pytest.raises(ValueError, match="no reward"):
        index_rollouts(samples)
