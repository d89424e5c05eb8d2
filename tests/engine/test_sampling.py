"""The generation loop: stopping rules, seeding, batching and the logprob convention."""

import threading
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from inharness.engine.sampling import Completion, SamplingParams, generate
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


def test_tiny_top_p_is_greedy(model: PreTrainedModel) -> None:
    greedy = generate(model, PROMPT, SamplingParams(max_tokens=10, temperature=0))[0]
    nucleus = generate(model, PROMPT, SamplingParams(max_tokens=10, temperature=0.8, top_p=1e-6, seed=1))[0]
    assert nucleus.token_ids == greedy.token_ids


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


def test_context_limit_ends_with_length(model: PreTrainedModel) -> None:
    context = model.config.max_position_embeddings
    prompt = (PROMPT * (context // len(PROMPT) + 1))[: context - 3]
    out = generate(model, prompt, SamplingParams(max_tokens=50, temperature=0))[0]
    assert len(out.token_ids) == 3 and out.finish_reason == "length"


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
    ],
)
def test_invalid_inputs_raise(model: PreTrainedModel, prompt: list[int], params: SamplingParams) -> None:
    with pytest.raises(ValueError):
        generate(model, prompt, params)
