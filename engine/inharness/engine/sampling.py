"""Token-in/token-out generation on a Hugging Face causal LM with a KV cache.

The engine owns the sampling loop (instead of ``model.generate``) so that every choice it makes is explicit
and reproducible: which logprob is reported, when a sequence stops, how the RNG is consumed.

Logprob convention: the logprob of a sampled token is ``log_softmax(logits / temperature)`` at that token,
computed in float32 over the full vocabulary *before* top-p truncation (``log_softmax(logits)`` when
temperature is 0, i.e. greedy). The trainer recomputes exactly this quantity from a full forward pass, so
the two agree up to floating-point noise.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
from transformers import DynamicCache, PreTrainedModel

FinishReason = Literal["stop", "length", "abort"]

# One forward pass at a time: the model is shared between server requests and a CPU gains nothing from
# running two concurrently.
_LOCK = threading.Lock()


@dataclass
class SamplingParams:
    """What to sample; ``temperature == 0`` means greedy, ``seed`` makes sampling reproducible."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    stop: tuple[str, ...] = ()  # stop strings: end a choice once its text contains one
    n: int = 1


@dataclass
class Completion:
    """One generated choice; ``token_ids`` includes the stop token when ``finish_reason == "stop"``."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    stop_token_id: int | None = None
    stop_str: str | None = None


def max_context(model: PreTrainedModel) -> int:
    """Tokens the model can hold: prompt plus generated tokens never exceed this."""
    return int(model.config.max_position_embeddings)


def finish_reason_for(
    token_id: int, num_generated: int, prompt_len: int, params: SamplingParams, context: int
) -> FinishReason | None:
    """Whether the ``num_generated``-th token (just produced) ends its choice, and why.

    Shared with the server so streaming can mark the last chunk without waiting for the loop to return.
    """
    if token_id in params.stop_token_ids:
        return "stop"
    if num_generated >= params.max_tokens or prompt_len + num_generated >= context:
        return "length"
    return None


def validate(model: PreTrainedModel, prompt_ids: list[int], params: SamplingParams) -> None:
    """Raise ValueError for inputs the loop cannot serve (the server maps these to HTTP 400)."""
    vocab = int(model.config.vocab_size)
    if not prompt_ids:
        raise ValueError("prompt must contain at least one token")
    if len(prompt_ids) >= max_context(model):
        raise ValueError(
            f"prompt has {len(prompt_ids)} tokens but the context holds {max_context(model)}, "
            "which leaves no room to generate"
        )
    bad = [t for t in prompt_ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"token id {bad[0]} is out of vocabulary (size {vocab})")
    if params.max_tokens < 1:
        raise ValueError("max_tokens must be at least 1")
    if params.n < 1:
        raise ValueError("n must be at least 1")
    if params.temperature < 0:
        raise ValueError("temperature must be non-negative")
    if not 0 < params.top_p <= 1:
        raise ValueError("top_p must be in (0, 1]")


def _sample(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row of ``logits`` (n, vocab); return (token ids, their logprobs)."""
    logits = logits.float()
    if params.temperature == 0:
        logp = torch.log_softmax(logits, dim=-1)
        tokens = torch.argmax(logits, dim=-1)
    else:
        logp = torch.log_softmax(logits / params.temperature, dim=-1)
        probs = logp.exp()
        if params.top_p < 1:
            sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
            # Keep the smallest prefix whose mass reaches top_p (the top token always survives).
            keep = (sorted_probs.cumsum(dim=-1) - sorted_probs) < params.top_p
            sorted_probs = sorted_probs * keep
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tokens, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def generate(
    model: PreTrainedModel,
    prompt_ids: list[int],
    params: SamplingParams,
    on_token: Callable[[int, int, float, FinishReason | None, str | None], None] | None = None,
    *,
    cancel: threading.Event | None = None,
    detokenize: Callable[[list[int]], str] | None = None,
) -> list[Completion]:
    """Generate ``params.n`` choices for one prompt, as one batch, with a KV cache.

    ``on_token(choice_index, token_id, logprob, finish_reason, stop_str)`` is called as each token is
    produced (streaming; finish_reason, and stop_str for a stop string, are set on a choice's last
    token). Each choice ends at a stop token (kept in ``token_ids``), at a stop string (``params.stop``,
    checked on the text ``detokenize`` gives; the token that completes it is kept, as in vLLM), at
    ``max_tokens``, or when the context is full ("length"). Setting ``cancel`` ends all unfinished
    choices with finish_reason "abort". Thread-safe: calls are serialised by a module lock.
    """
    validate(model, prompt_ids, params)
    if params.stop and detokenize is None:
        raise ValueError("stop strings need a detokenize function")
    context = max_context(model)
    # A stop string ends within the newest token; the last few tokens' text is enough to see it.
    window = 4 * max((len(x) for x in params.stop), default=0) + 4
    with _LOCK, torch.inference_mode():
        device = next(model.parameters()).device
        generator = torch.Generator(device=device)
        if params.seed is None:
            generator.seed()
        else:
            generator.manual_seed(params.seed)

        n = params.n
        tokens = [[] for _ in range(n)]
        logprobs: list[list[float]] = [[] for _ in range(n)]
        finish: list[FinishReason | None] = [None] * n
        stop_str: list[str | None] = [None] * n

        input_ids = torch.tensor([prompt_ids], dtype=torch.long, device=device).expand(n, -1)
        # transformers 5.x calls the KV cache argument `cache` (was `past_key_values`); it fills in place.
        cache = DynamicCache(config=model.config)
        out = model(input_ids=input_ids, cache=cache, use_cache=True)
        logits = out.logits[:, -1, :]
        prompt_len = len(prompt_ids)
        while True:
            picked, picked_logp = _sample(logits, params, generator)
            for i in range(n):
                if finish[i] is not None:
                    continue
                token, logprob = int(picked[i]), float(picked_logp[i])
                tokens[i].append(token)
                logprobs[i].append(logprob)
                finish[i] = finish_reason_for(token, len(tokens[i]), prompt_len, params, context)
                if params.stop and finish[i] != "stop":
                    assert detokenize is not None
                    tail = detokenize(tokens[i][-window:])
                    hit = next((x for x in params.stop if x in tail), None)
                    if hit is not None:
                        finish[i], stop_str[i] = "stop", hit
                if on_token is not None:
                    on_token(i, token, logprob, finish[i], stop_str[i])
            if all(f is not None for f in finish):
                break
            if cancel is not None and cancel.is_set():
                finish = [f if f is not None else "abort" for f in finish]
                break
            # Finished rows keep decoding in lockstep (outputs ignored): cheaper than reshaping the cache.
            out = model(input_ids=picked.unsqueeze(-1), cache=cache, use_cache=True)
            logits = out.logits[:, -1, :]

    return [
        Completion(
            token_ids=tokens[i],
            logprobs=logprobs[i],
            finish_reason=finish[i] or "length",
            stop_token_id=tokens[i][-1] if finish[i] == "stop" and stop_str[i] is None else None,
            stop_str=stop_str[i],
        )
        for i in range(n)
    ]
