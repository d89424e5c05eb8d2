"""Recorded calls of one attempt -> training samples.

A harness that continues a conversation sends, as call k+1's prompt, call k's prompt + response and then
the tokens of what came after (the closing of the assistant turn, tool results, a new user message). The
gateway keeps that token-exact, so consecutive turns concatenate into one sequence whose forward pass
scores every turn at once. This module does that merge, and splits where it cannot hold.

Alignment convention (all per-token lists of a `Sample` have ``len(input_ids)`` entries): position ``i``
of ``loss_mask`` and ``behaviour_logprobs`` describes token ``input_ids[i]``, i.e. the token the model
predicted from positions ``< i``. With causal-LM logits ``L`` of shape ``[T, V]`` the current policy's
logprob of token ``i`` is ``log_softmax(L[i - 1])[input_ids[i]]``; shift by one before comparing it to
``behaviour_logprobs[i]``. Position 0 is always a prompt token, so it is never trained.

Merge rule, per call in recorded order: find the earlier call whose prompt + response is the longest
token prefix of this call's prompt (the gateway's ``parent_call_id`` is tried first, but the tokens
decide). If that call is the last call of an open sample, append to that sample; otherwise start a new
sample whose prompt is this call's prompt, and count the split under its reason:

- ``"choice_fanout"``: the earlier call was already extended by another call (n > 1 choices, or the
  harness re-sampled a turn), or this call repeats an earlier call's prompt (n > 1 on a first turn).
  Each branch becomes its own sample; the shared history is trained once, in the first branch, and is
  plain context (mask 0) in the others.
- ``"length_cap"``: appending would make the sample longer than ``max_tokens``.
- ``"prefix_mismatch:<reason>"``: no earlier call is a prefix and the gateway said why
  (e.g. ``"prefix_mismatch:history_rewritten"`` for a rewritten or compacted history,
  ``"prefix_mismatch:new_conversation"`` for a sub-agent or side call).
- ``"not_a_prefix"``: no earlier call is a prefix and the gateway gave no reason.

Every generated token is therefore trained in exactly one sample: summed over samples, ``sum(loss_mask)``
equals the number of response tokens of the calls.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from inharness.gateway.schema import CallOut, ExportedRollout

CHOICE_FANOUT = "choice_fanout"
LENGTH_CAP = "length_cap"
NOT_A_PREFIX = "not_a_prefix"
PREFIX_MISMATCH = "prefix_mismatch"
NO_CALLS = "no_calls"
FAILED = "failed"


@dataclass
class Sample:
    """One training sequence: one or more merged calls of one attempt (see the module docstring for
    the alignment of ``loss_mask`` and ``behaviour_logprobs`` with ``input_ids``)."""

    rollout_id: str
    group_id: str
    call_ids: list[int]
    input_ids: list[int]
    loss_mask: list[int]
    behaviour_logprobs: list[float]
    model_versions: list[int]
    reward: float | None
    num_prompt_tokens: int

    @property
    def num_generated_tokens(self) -> int:
        return sum(self.loss_mask)


@dataclass
class AdapterStats:
    """What the adapter did; ``add`` sums stats of several rollouts.

    ``rollouts`` counts every rollout seen, ``calls`` only the calls of rollouts that gave samples.
    ``merged_turns`` counts calls appended to an open sample, ``splits`` counts calls that started a new
    sample although the rollout already had one, by reason. For every rollout that gives samples,
    ``merged_turns + sum(splits.values())`` grows by its number of calls minus one. ``skipped`` counts
    rollouts that gave no samples, by reason (``"no_calls"``, ``"failed"``). ``oversized_samples``
    counts samples longer than ``max_tokens`` on their own (a single call over the cap is kept whole).
    """

    rollouts: int = 0
    calls: int = 0
    samples: int = 0
    merged_turns: int = 0
    splits: dict[str, int] = field(default_factory=dict)
    skipped: dict[str, int] = field(default_factory=dict)
    oversized_samples: int = 0

    @property
    def mergeable_turns(self) -> int:
        """Calls that could have been merged: calls minus one per rollout that gave samples."""
        return self.merged_turns + sum(self.splits.values())

    @property
    def merged_turn_ratio(self) -> float:
        """``merged_turns / mergeable_turns``: 1.0 when every rollout became a single sample (also when
        no rollout had a second call, as nothing was split), 0.0 when every call is its own sample."""
        return self.merged_turns / self.mergeable_turns if self.mergeable_turns else 1.0

    def add(self, other: AdapterStats) -> None:
        self.rollouts += other.rollouts
        self.calls += other.calls
        self.samples += other.samples
        self.merged_turns += other.merged_turns
        self.oversized_samples += other.oversized_samples
        self.splits = dict(Counter(self.splits) + Counter(other.splits))
        self.skipped = dict(Counter(self.skipped) + Counter(other.skipped))


def _check(call: CallOut) -> None:
    if len(call.response_logprobs) != len(call.response_ids):
        raise ValueError(
            f"call {call.id}: {len(call.response_ids)} response ids but "
            f"{len(call.response_logprobs)} logprobs; the recording is not token-exact"
        )


def _extends(prompt: list[int], earlier: CallOut) -> bool:
    """Whether ``prompt`` starts with ``earlier``'s prompt + response (compared without concatenating)."""
    p, r = earlier.prompt_ids, earlier.response_ids
    n = len(p) + len(r)
    if n > len(prompt) or (n and prompt[n - 1] != (r[-1] if r else p[-1])):
        return False
    return prompt[: len(p)] == p and prompt[len(p) : n] == r


def _token_parent(call: CallOut, earlier: Sequence[CallOut], pos: dict[int, int]) -> int | None:
    """Index into ``earlier`` of the call whose prompt + response is the longest prefix of ``call``'s
    prompt, or None. The gateway's parent is checked first since it is nearly always the one, so the
    scan then only looks at longer calls."""
    best: int | None = None
    best_len = -1
    hint = pos.get(call.parent_call_id) if call.parent_call_id is not None else None
    if hint is not None and _extends(call.prompt_ids, earlier[hint]):
        best, best_len = hint, len(earlier[hint].prompt_ids) + len(earlier[hint].response_ids)
    for i in range(len(earlier) - 1, -1, -1):
        c = earlier[i]
        n = len(c.prompt_ids) + len(c.response_ids)
        if n > best_len and _extends(call.prompt_ids, c):
            best, best_len = i, n
    return best


def _split_reason(call: CallOut, earlier: Sequence[CallOut], extended_parent: bool) -> str:
    if extended_parent or any(
        c.request_id == call.request_id or c.prompt_ids == call.prompt_ids for c in earlier
    ):
        return CHOICE_FANOUT
    if call.prefix_mismatch:
        return f"{PREFIX_MISMATCH}:{call.prefix_mismatch}"
    return NOT_A_PREFIX


def _start(call: CallOut, rollout_id: str, group_id: str, reward: float | None) -> Sample:
    p, r = len(call.prompt_ids), len(call.response_ids)
    return Sample(
        rollout_id=rollout_id,
        group_id=group_id,
        call_ids=[call.id],
        input_ids=call.prompt_ids + call.response_ids,
        loss_mask=[0] * p + [1] * r,
        behaviour_logprobs=[0.0] * p + list(call.response_logprobs),
        model_versions=[call.model_version],
        reward=reward,
        num_prompt_tokens=p,
    )


def _append(sample: Sample, call: CallOut) -> None:
    between = call.prompt_ids[len(sample.input_ids) :]
    sample.input_ids.extend(between)
    sample.input_ids.extend(call.response_ids)
    sample.loss_mask.extend([0] * len(between))
    sample.loss_mask.extend([1] * len(call.response_ids))
    sample.behaviour_logprobs.extend([0.0] * len(between))
    sample.behaviour_logprobs.extend(call.response_logprobs)
    sample.call_ids.append(call.id)
    sample.model_versions.append(call.model_version)


def build_samples(
    rollout: ExportedRollout, *, max_tokens: int | None = None, include_failed: bool = False
) -> tuple[list[Sample], AdapterStats]:
    """Merge the recorded calls of ``rollout``'s final attempt into samples (see the module docstring).

    ``max_tokens`` caps the length of a merged sample; a failed rollout gives no samples unless
    ``include_failed``. Samples come in the order of their first call. Raises ValueError when a call's
    logprobs do not match its response ids one for one.
    """
    stats = AdapterStats(rollouts=1)
    ro = rollout.rollout
    if ro.status == "failed" and not include_failed:
        stats.skipped[FAILED] = 1
        return [], stats
    if not rollout.calls:
        stats.skipped[NO_CALLS] = 1
        return [], stats

    calls = rollout.calls
    samples: list[Sample] = []
    open_by_tip: dict[int, Sample] = {}  # id of a sample's last call -> that sample
    pos: dict[int, int] = {}  # call id -> index in calls
    splits: Counter[str] = Counter()
    for k, call in enumerate(calls):
        _check(call)
        sample: Sample | None = None
        reason: str | None = None
        if k > 0:
            earlier = calls[:k]
            parent = _token_parent(call, earlier, pos)
            tip = open_by_tip.get(earlier[parent].id) if parent is not None else None
            if tip is None:
                reason = _split_reason(call, earlier, extended_parent=parent is not None)
            elif max_tokens is not None and len(call.prompt_ids) + len(call.response_ids) > max_tokens:
                reason = LENGTH_CAP
            else:
                sample = tip
        if sample is not None:
            del open_by_tip[sample.call_ids[-1]]
            _append(sample, call)
            stats.merged_turns += 1
        else:
            if reason is not None:
                splits[reason] += 1
            sample = _start(call, ro.id, ro.group_id, ro.reward)
            samples.append(sample)
        open_by_tip[call.id] = sample
        pos[call.id] = k

    stats.calls = len(calls)
    stats.samples = len(samples)
    stats.splits = dict(splits)
    if max_tokens is not None:
        stats.oversized_samples = sum(len(s.input_ids) > max_tokens for s in samples)
    return samples, stats


def build_batch(
    rollouts: Iterable[ExportedRollout], *, max_tokens: int | None = None, include_failed: bool = False
) -> tuple[list[Sample], AdapterStats]:
    """``build_samples`` over many rollouts: samples in rollout order, stats summed."""
    samples: list[Sample] = []
    stats = AdapterStats()
    for rollout in rollouts:
        got, st = build_samples(rollout, max_tokens=max_tokens, include_failed=include_failed)
        samples.extend(got)
        stats.add(st)
    return samples, stats


@dataclass
class RolloutIndex:
    """The integer indices the advantage and loss functions take, for a list of samples.

    ``rewards[r]`` and ``group_index[r]`` describe rollout ``r`` (numbered in first-seen order, groups
    likewise); ``sample_rollout[b]`` is the rollout of sample ``b``.
    """

    rollout_ids: list[str]
    rewards: list[float]
    group_index: list[int]
    sample_rollout: list[int]


def index_rollouts(samples: Sequence[Sample]) -> RolloutIndex:
    """Number the rollouts and groups of ``samples``; raises ValueError on a sample without a reward,
    since an outcome advantage cannot be computed for it."""
    rollout_pos: dict[str, int] = {}
    group_pos: dict[str, int] = {}
    index = RolloutIndex([], [], [], [])
    for s in samples:
        if s.rollout_id not in rollout_pos:
            if s.reward is None:
                raise ValueError(f"rollout {s.rollout_id} has no reward")
            rollout_pos[s.rollout_id] = len(index.rollout_ids)
            index.rollout_ids.append(s.rollout_id)
            index.rewards.append(s.reward)
            index.group_index.append(group_pos.setdefault(s.group_id, len(group_pos)))
        index.sample_rollout.append(rollout_pos[s.rollout_id])
    return index
