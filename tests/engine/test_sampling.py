"""The generation loop: stopping rules, seeding, batching and the logprob convention."""

import math
import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from inharness.engine.sampling import (
    MAX_N,
    MAX_SEED,
    MIN_SEED,
    Completion,
    PrefixCache,
    SamplingParams,
    Scheduler,
    generate,
)
from inharness.engine.tiny import init_tiny

PROMPT = [300, 75, 417, 893, 220, 16, 10, 17, 28]


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Built per module (about a second) rather than in a conftest: tests/ modules import `conftest` by name.
    return init_tiny(tmp_path_factory.mktemp("tiny-engine") / "tiny", seed=0)


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


def full_forward_logprobs(
    model: PreTrainedModel, prompt: list[int], completion: list[int], temperature: float
) -> list[float]:
    """The trainer's view: one forward over prompt+completion, log_softmax(logits / T) at each token."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0].float()
    scaled = logits if temperature == 0 else logits / temperature
    logp = torch.log_softmax(scaled, dim=-1)
    return [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(completion)]


def test_greedy_is_deterministic_and_matches_full_forward(model: PreTrainedModel) -> None:
    params = SamplingParams(max_tokens=12, temperature=0)
    first, second = generate(model, PROMPT, params)[0], generate(model, PROMPT, params)[0]
    assert first == second
    assert first.finish_reason == "length" and first.stop_token_id is None and len(first.token_ids) == 12
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + first.token_ids])).logits[0]
    assert first.token_ids == logits[len(PROMPT) - 1 : -1].argmax(-1).tolist()
    expected = full_forward_logprobs(model, PROMPT, first.token_ids, 0)
    assert first.logprobs == pytest.approx(expected, abs=1e-4)


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9), (1.3, 0.5)])
def test_logprobs_are_tempered_and_taken_before_top_p(
    model: PreTrainedModel, temperature: float, top_p: float
) -> None:
    params = SamplingParams(max_tokens=16, temperature=temperature, top_p=top_p, seed=7)
    out = generate(model, PROMPT, params)[0]
    expected = full_forward_logprobs(model, PROMPT, out.token_ids, temperature)
    assert out.logprobs == pytest.approx(expected, abs=1e-4)


def test_seeded_sampling_reproduces(model: PreTrainedModel) -> None:
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=123)
    assert generate(model, PROMPT, params) == generate(model, PROMPT, params)
    other = generate(model, PROMPT, SamplingParams(max_tokens=20, temperature=1.0, seed=124))
    assert other != generate(model, PROMPT, params)


# Values at float32's and float64's edges: 1.2e-38 the smallest normal float32, 1.4e-45 the smallest
# subnormal, 1e-40 a subnormal, 5e-324 the smallest positive float64 (0 in float32).
TINY = [1e-6, 1e-30, 1.2e-38, 1e-40, 1.4e-45, 1e-50, 5e-324]


@pytest.mark.parametrize("top_p", TINY)
def test_tiny_top_p_is_greedy(model: PreTrainedModel, top_p: float) -> None:
    """Down to values that are 0 in float32 (an outside fuzzer sent 5e-324): the top token survives."""
    greedy = generate(model, PROMPT, SamplingParams(max_tokens=10, temperature=0))[0]
    nucleus = generate(model, PROMPT, SamplingParams(max_tokens=10, temperature=0.8, top_p=top_p, seed=1))[0]
    assert nucleus.token_ids == greedy.token_ids


@pytest.mark.parametrize("temperature", TINY[1:])
def test_a_temperature_near_0_samples_the_greedy_tokens_with_logprob_0(
    model: PreTrainedModel, temperature: float
) -> None:
    """Logits divided by such a temperature overflow to infinities, whose softmax is NaN (torch.multinomial
    refused it: a 500); the limit as the temperature falls to 0 is greedy, its token certain."""
    greedy = generate(model, PROMPT, SamplingParams(max_tokens=10, temperature=0))[0]
    for top_p in (1.0, 5e-324):
        params = SamplingParams(max_tokens=10, temperature=temperature, top_p=top_p, seed=2)
        cold = generate(model, PROMPT, params)[0]
        assert cold.token_ids == greedy.token_ids
        assert cold.logprobs == [0.0] * 10


def test_the_greedy_threshold_is_0_and_a_small_temperature_still_samples(model: PreTrainedModel) -> None:
    """Only 0 means greedy (with untempered logprobs); the logprob of a sampled token is tempered, down
    to where the tempered distribution is the greedy one."""
    greedy = generate(model, PROMPT, SamplingParams(max_tokens=6, temperature=0))[0]
    assert all(lp < 0 for lp in greedy.logprobs)  # log_softmax(logits): the random model is unsure
    for temperature in (1e-3, 1e-2):
        out = generate(model, PROMPT, SamplingParams(max_tokens=6, temperature=temperature, seed=3))[0]
        assert out.logprobs == pytest.approx(
            full_forward_logprobs(model, PROMPT, out.token_ids, temperature), abs=1e-4
        )


@pytest.mark.parametrize("top_p", [1.0, math.nextafter(1.0, 0.0), 0.5])
def test_top_p_near_1_samples_as_documented(model: PreTrainedModel, top_p: float) -> None:
    params = SamplingParams(max_tokens=8, temperature=1.0, top_p=top_p, seed=11)
    out = generate(model, PROMPT, params)[0]
    assert len(out.token_ids) == 8 and out.finish_reason == "length"
    assert out.logprobs == pytest.approx(full_forward_logprobs(model, PROMPT, out.token_ids, 1.0), abs=1e-4)
    if top_p == 1.0:  # no truncation at all: the same draws as without top_p
        plain = generate(model, PROMPT, SamplingParams(max_tokens=8, temperature=1.0, seed=11))[0]
        assert out.token_ids == plain.token_ids


def test_stop_token_is_included_and_reported(model: PreTrainedModel) -> None:
    free = generate(model, PROMPT, SamplingParams(max_tokens=30, temperature=1.0, seed=5))[0]
    stop = free.token_ids[4]
    first = free.token_ids.index(stop)
    out = generate(
        model, PROMPT, SamplingParams(max_tokens=30, temperature=1.0, seed=5, stop_token_ids=[stop])
    )[0]
    assert out.token_ids == free.token_ids[: first + 1]
    assert out.logprobs == free.logprobs[: first + 1]
    assert out.finish_reason == "stop" and out.stop_token_id == stop


@pytest.mark.parametrize("max_tokens", [3, 50, 2**63 - 1])
def test_context_limit_ends_with_length(model: PreTrainedModel, max_tokens: int) -> None:
    """max_tokens exactly the room left, above it, and far above it: the context's end ends the choice."""
    context = model.config.max_position_embeddings
    prompt = (PROMPT * (context // len(PROMPT) + 1))[: context - 3]
    out = generate(model, prompt, SamplingParams(max_tokens=max_tokens, temperature=0))[0]
    assert len(out.token_ids) == 3 and out.finish_reason == "length"


def test_one_token_fills_the_last_place_of_the_context(model: PreTrainedModel) -> None:
    context = model.config.max_position_embeddings
    prompt = (PROMPT * (context // len(PROMPT) + 1))[: context - 1]
    for max_tokens in (1, 2):
        out = generate(model, prompt, SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=1))[0]
        assert len(out.token_ids) == 1 and out.finish_reason == "length"


def test_n_at_its_bound_runs_and_one_more_is_refused(model: PreTrainedModel) -> None:
    outs = generate(model, PROMPT, SamplingParams(max_tokens=1, temperature=1.0, seed=6, n=MAX_N))
    assert len(outs) == MAX_N and len({o.token_ids[0] for o in outs}) > 1
    with pytest.raises(ValueError, match="n must be between 1 and"):
        generate(model, PROMPT, SamplingParams(max_tokens=1, n=MAX_N + 1))


@pytest.mark.parametrize("seed", [MIN_SEED, -1, 0, 2**63 - 1, MAX_SEED])
def test_every_seed_in_range_reproduces(model: PreTrainedModel, seed: int) -> None:
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=seed)
    assert generate(model, PROMPT, params) == generate(model, PROMPT, params)


def test_n_choices_run_as_a_batch(model: PreTrainedModel) -> None:
    seen: list[tuple[int, int, float]] = []
    outs = generate(
        model,
        PROMPT,
        SamplingParams(max_tokens=8, temperature=1.0, seed=3, n=3),
        on_token=lambda i, t, lp, _finish, _stop: seen.append((i, t, lp)),
    )
    assert len(outs) == 3 and len({tuple(o.token_ids) for o in outs}) > 1
    for i, out in enumerate(outs):
        assert [(t, lp) for j, t, lp in seen if j == i] == list(zip(out.token_ids, out.logprobs, strict=True))
        assert out.logprobs == pytest.approx(
            full_forward_logprobs(model, PROMPT, out.token_ids, 1.0), abs=1e-4
        )
    greedy = generate(model, PROMPT, SamplingParams(max_tokens=8, temperature=0, n=2))
    single = generate(model, PROMPT, SamplingParams(max_tokens=8, temperature=0))[0]
    for row in greedy:  # batched matmuls round differently per row, hence approx
        assert row.token_ids == single.token_ids
        assert row.logprobs == pytest.approx(single.logprobs, abs=1e-4)


def test_cancel_aborts(model: PreTrainedModel) -> None:
    cancel = threading.Event()
    produced: list[int] = []

    def on_token(index: int, token: int, logprob: float, _finish: str | None, _stop: str | None) -> None:
        produced.append(token)
        if len(produced) == 3:
            cancel.set()

    out = generate(model, PROMPT, SamplingParams(max_tokens=100, temperature=0), on_token, cancel=cancel)[0]
    assert out.finish_reason == "abort" and out.token_ids == produced


def test_concurrent_calls_are_serialised(model: PreTrainedModel) -> None:
    params = SamplingParams(max_tokens=15, temperature=1.0, seed=9)
    expected = generate(model, PROMPT, params)
    results: list[list[Completion]] = []
    threads = [
        threading.Thread(target=lambda: results.append(generate(model, PROMPT, params))) for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results == [expected] * 3


@pytest.mark.parametrize(
    ("prompt", "params"),
    [
        ([], SamplingParams(max_tokens=1)),
        ([10**6], SamplingParams(max_tokens=1)),
        ([-1], SamplingParams(max_tokens=1)),
        ([1] * 2048, SamplingParams(max_tokens=1)),
        ([1], SamplingParams(max_tokens=0)),
        ([1], SamplingParams(max_tokens=1, n=0)),
        ([1], SamplingParams(max_tokens=1, temperature=-1)),
        ([1], SamplingParams(max_tokens=1, top_p=0)),
        ([1], SamplingParams(max_tokens=1, top_p=math.nextafter(1.0, 2.0))),
        ([1], SamplingParams(max_tokens=1, top_p=math.nan)),
        ([1], SamplingParams(max_tokens=1, temperature=math.nan)),
        ([1], SamplingParams(max_tokens=1, temperature=math.inf)),
        ([1], SamplingParams(max_tokens=1, n=MAX_N + 1)),
        ([1], SamplingParams(max_tokens=1, seed=MAX_SEED + 1)),
        ([1], SamplingParams(max_tokens=1, seed=MIN_SEED - 1)),
    ],
)
def test_invalid_inputs_raise(model: PreTrainedModel, prompt: list[int], params: SamplingParams) -> None:
    with pytest.raises(ValueError):
        generate(model, prompt, params)


# The scheduler: prefix cache and batching. Its results must be those of `generate` (tokens exactly, logprobs
# up to float rounding), whatever was cached before and whatever runs beside a request.


def assert_same(got: list[Completion], expected: list[Completion]) -> None:
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    assert [c.finish_reason for c in got] == [c.finish_reason for c in expected]
    for g, e in zip(got, expected, strict=True):
        assert g.logprobs == pytest.approx(e.logprobs, abs=1e-4)


def test_prefix_cache_reuses_a_shared_prefix_and_a_previous_turn(model: PreTrainedModel) -> None:
    scheduler = Scheduler(model, max_batch=1)
    shared = list(range(100, 140))
    first = scheduler.submit([*shared, 7, 8, 9], SamplingParams(max_tokens=6, temperature=0)).result(60)
    assert (scheduler.stats.prompt_tokens, scheduler.stats.cached_tokens) == (43, 0)

    other = [*shared, 11, 12]  # another prompt with the same system prompt: only its own tokens are computed
    params = SamplingParams(max_tokens=8, temperature=0)
    assert_same(scheduler.submit(other, params).result(60), generate(model, other, params))
    assert scheduler.stats.cached_tokens == 40

    # The next turn extends prompt + response: all of it but the last sampled token is cached.
    turn = [*shared, 7, 8, 9, *first[0].token_ids, 13, 14, 15]
    before = scheduler.stats.cached_tokens
    assert_same(scheduler.submit(turn, params).result(60), generate(model, turn, params))
    assert scheduler.stats.cached_tokens - before == 43 + 5

    # Sampled requests too: the logprob convention holds on a cached prefix.
    sampled = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=4, n=2)
    assert_same(scheduler.submit(other, sampled).result(60), generate(model, other, sampled))


def test_prefix_cache_is_a_bounded_lru_that_never_changes_its_tensors() -> None:
    def kv(ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        t = torch.tensor(ids, dtype=torch.float32).view(1, 1, -1, 1)
        return [(t, -t)]

    cache = PrefixCache(max_tokens=10)
    cache.insert([1, 2, 3, 4], kv([1, 2, 3, 4]))
    cache.insert([1, 2, 3, 4, 5, 6], kv([1, 2, 3, 4, 5, 6]))  # extends the first: replaces it
    assert (len(cache), cache.tokens) == (1, 6)
    cache.insert([1, 2], kv([1, 2]))  # already held by the longer entry
    assert (len(cache), cache.tokens) == (1, 6)
    hit, got = cache.lookup([1, 2, 3, 9])
    assert (
        hit == 3
        and got[0][0].flatten().tolist() == [1, 2, 3]
        and got[0][1].flatten().tolist() == [-1, -2, -3]
    )
    cache.insert([7, 8, 9], kv([7, 8, 9]))
    assert cache.tokens == 9
    cache.lookup([1])  # touch [1..6]: [7, 8, 9] is now the least recently used
    cache.insert([20, 21], kv([20, 21]))
    assert cache.tokens == 8 and cache.lookup([7, 8])[0] == 0 and cache.lookup([1, 2])[0] == 2
    cache.insert(list(range(11)), kv(list(range(11))))  # larger than the whole cache: not kept
    assert cache.tokens == 8 and cache.lookup([0, 1])[0] == 0

    source = kv([5, 6, 7])  # entries are copies
    cache.insert([5, 6, 7], source)
    source[0][0].zero_()
    assert cache.lookup([5, 6, 7])[1][0][0].flatten().tolist() == [5, 6, 7]


def test_generating_from_a_cached_prefix_leaves_the_entry_unchanged(model: PreTrainedModel) -> None:
    scheduler = Scheduler(model, max_batch=1)
    scheduler.submit(PROMPT, SamplingParams(max_tokens=1, temperature=0)).result(60)
    hit, entry = scheduler.prefix_cache.lookup(PROMPT)
    assert hit == len(PROMPT)
    saved = [(k.clone(), v.clone()) for k, v in entry]
    for n in (1, 3):
        scheduler.submit([*PROMPT, 5, 6], SamplingParams(max_tokens=12, temperature=1.0, n=n)).result(60)
    assert scheduler.stats.cached_tokens == len(PROMPT) + len(PROMPT) + 1  # the second reuses the first
    for (k, v), (k0, v0) in zip(
        entry, saved, strict=True
    ):  # views of the entry's storage: written if it were
        assert torch.equal(k, k0) and torch.equal(v, v0)


def test_concurrent_requests_decode_together_as_if_alone(model: PreTrainedModel) -> None:
    requests = [
        (PROMPT, SamplingParams(max_tokens=30, temperature=0)),
        (PROMPT[:4] + [9] * 25, SamplingParams(max_tokens=12, temperature=0)),
        ([5, 6], SamplingParams(max_tokens=25, temperature=1.0, seed=3)),
        (PROMPT * 3, SamplingParams(max_tokens=20, temperature=0.7, top_p=0.8, seed=8, n=3)),
        ([42] * 17, SamplingParams(max_tokens=40, temperature=1.0, seed=1, stop_token_ids=[7, 11, 19])),
    ]
    expected = [generate(model, prompt, params) for prompt, params in requests]
    scheduler = Scheduler(model, prefix_cache_tokens=0)
    futures = [scheduler.submit(prompt, params) for prompt, params in requests]
    for future, want in zip(futures, expected, strict=True):
        assert_same(future.result(60), want)
    sizes = scheduler.stats.batch_sizes
    assert max(sizes) > 1 and max(sizes) <= 7
    assert sum(sizes.values()) == scheduler.stats.decode_steps


def test_max_batch_bounds_the_rows_of_a_step(model: PreTrainedModel) -> None:
    scheduler = Scheduler(model, max_batch=2)
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=2)
    futures = [scheduler.submit(PROMPT[:k], params) for k in (3, 5, 7, 9)]
    futures.append(scheduler.submit(PROMPT, SamplingParams(max_tokens=5, temperature=1.0, n=3)))
    for future in futures:
        future.result(60)
    assert set(scheduler.stats.batch_sizes) <= {1, 2, 3}  # a request with more choices runs alone


def test_cancel_and_stop_strings_per_request_in_a_batch(model: PreTrainedModel) -> None:
    cancel = threading.Event()
    produced: list[int] = []

    def on_token(index: int, token: int, logprob: float, _finish: str | None, _stop: str | None) -> None:
        produced.append(token)
        if len(produced) == 5:
            cancel.set()

    def text(ids: list[int]) -> str:
        return "".join(chr(97 + t % 26) for t in ids)

    free = generate(model, PROMPT, SamplingParams(max_tokens=30, temperature=1.0, seed=5))[0]
    stop = text(free.token_ids)[10:12]
    scheduler = Scheduler(model)
    long = scheduler.submit([3, 4], SamplingParams(max_tokens=60, temperature=0))
    aborted = scheduler.submit(PROMPT, SamplingParams(max_tokens=200, temperature=0), on_token, cancel=cancel)
    stopped = scheduler.submit(
        PROMPT, SamplingParams(max_tokens=30, temperature=1.0, seed=5, stop=(stop,)), detokenize=text
    )
    (out,) = aborted.result(60)
    assert out.finish_reason == "abort" and out.token_ids == produced and len(produced) == 5
    (cut,) = stopped.result(60)
    assert cut.finish_reason == "stop" and cut.stop_str == stop
    assert cut.token_ids == free.token_ids[: len(cut.token_ids)] and len(cut.token_ids) <= 12
    assert_same(long.result(60), generate(model, [3, 4], SamplingParams(max_tokens=60, temperature=0)))


def test_load_model_lets_running_requests_finish_then_serves_new_weights_uncached(
    model: PreTrainedModel, tmp_path: Path
) -> None:
    other = AutoModelForCausalLM.from_pretrained(init_tiny(tmp_path / "other", seed=1)).eval()
    scheduler = Scheduler(model)
    params = SamplingParams(max_tokens=8, temperature=0)
    scheduler.submit(PROMPT, params).result(60)  # cached under the old weights
    running = scheduler.submit([1, 2, 3], SamplingParams(max_tokens=80, temperature=0))
    while not running.running():
        time.sleep(0.001)
    scheduler.load_model(other)
    after = scheduler.submit([*PROMPT, 4], params)
    assert_same(running.result(60), generate(model, [1, 2, 3], SamplingParams(max_tokens=80, temperature=0)))
    assert_same(after.result(60), generate(other, [*PROMPT, 4], params))
    assert scheduler.stats.cached_tokens == 0
