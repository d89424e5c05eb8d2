"""Token-in/token-out generation on a Hugging Face causal LM with a KV cache, batched and prefix-cached.

The engine owns the sampling loop (instead of ``model.generate``) so that every choice it makes is explicit
and reproducible: which logprob is reported, when a sequence stops, how the RNG is consumed.

Logprob convention: the logprob of a sampled token is ``log_softmax(logits / temperature)`` at that token,
computed in float32 over the full vocabulary *before* top-p truncation (``log_softmax(logits)`` when
temperature is 0, i.e. greedy). The trainer recomputes exactly this quantity from a full forward pass, so
the two agree up to floating-point noise.

Two savings keep that agreement, because neither changes what any token attends to:

- the prefix cache (``PrefixCache``): a causal LM's keys and values at position i depend only on tokens
  0..i and the weights, so the KV of a prompt's longest previously computed prefix is what its prefill would
  compute; only the rest is prefilled. Entries are dropped when the weights change.
- batching (``Scheduler``): concurrent requests decode together, one forward pass per step for all their
  rows. Every operation but attention is row-wise; rows of different lengths are left-padded, the attention
  mask gives the padding zero weight and each row's position ids are its own sequence's, so each row's
  logits are those of its sequence alone. Each request samples its own rows with its own generator, so a
  seeded request draws the same tokens whatever runs beside it.

Both change only how the matmuls are chunked, hence float rounding (~1e-6), not the result.
"""

from __future__ import annotations

import math
import threading
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PreTrainedModel

FinishReason = Literal["stop", "length", "abort"]
OnToken = Callable[[int, int, float, FinishReason | None, str | None], None]
KV = list[tuple[torch.Tensor, torch.Tensor]]
"""A DynamicCache's content: per layer (keys, values), each ``(rows, kv_heads, tokens, head_dim)``."""

# Choices of one request: each is a row of the batch with its own KV (a few MiB per 1k tokens on the tiny
# model), and a request with more rows than the batch holds runs alone, so a larger n would only hold the
# engine. The gateway takes at most 16.
MAX_N = 64
# What torch.Generator.manual_seed takes (a negative seed is read modulo 2**64).
MIN_SEED, MAX_SEED = -(2**63), 2**64 - 1

# `generate` calls run one at a time: the model is shared and a CPU gains nothing from two concurrent passes.
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
    # Scripted mode (``inharness.engine.script``): every choice emits exactly these tokens, each with the
    # model's logprob of it under this temperature (what sampling it would have reported), instead of
    # sampling; stop tokens, stop strings and max_tokens end it as they would a sampled choice.
    forced: tuple[int, ...] = ()


@dataclass
class Completion:
    """One generated choice; ``token_ids`` includes the stop token when ``finish_reason == "stop"``."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    stop_token_id: int | None = None
    stop_str: str | None = None


@dataclass
class Stats:
    """Counters a scheduler keeps (read by tests and benchmarks; written by its thread only)."""

    prompt_tokens: int = 0  # prompt tokens of admitted requests ...
    cached_tokens: int = 0  # ... of which the prefix cache supplied (not recomputed)
    decode_steps: int = 0
    batch_sizes: Counter[int] = field(default_factory=Counter)  # rows in a decode step -> steps


def max_context(model: PreTrainedModel) -> int:
    """Tokens the model can hold: prompt plus generated tokens never exceed this."""
    return int(model.config.max_position_embeddings)


def finish_reason_for(
    token_id: int, num_generated: int, prompt_len: int, params: SamplingParams, context: int
) -> FinishReason | None:
    """Whether the ``num_generated``-th token (just produced) ends its choice, and why."""
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
    if not 1 <= params.n <= MAX_N:
        raise ValueError(f"n must be between 1 and {MAX_N}")
    if params.seed is not None and not MIN_SEED <= params.seed <= MAX_SEED:
        raise ValueError(f"seed must be between {MIN_SEED} and {MAX_SEED}")
    if not 0 <= params.temperature < math.inf:  # NaN fails too
        raise ValueError("temperature must be a finite number, at least 0")
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
        logp = torch.log_softmax(_tempered(logits, params.temperature), dim=-1)
        probs = logp.exp()
        if params.top_p < 1:
            sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
            # Keep the smallest prefix whose mass reaches top_p (the top token always survives).
            keep = (sorted_probs.cumsum(dim=-1) - sorted_probs) < params.top_p
            # A top_p below float32's smallest subnormal (1e-50 passes the range check) rounds to 0 in
            # the comparison and would keep nothing: the top token is kept whatever top_p is.
            keep[..., 0] = True
            sorted_probs = sorted_probs * keep
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tokens, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


# float32's smallest positive (subnormal) value: a temperature below it would be 0 where the logits are.
_MIN_TEMPERATURE = float(torch.finfo(torch.float32).smallest_normal) * 2.0**-23


def _tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``logits / temperature`` for any temperature the API accepts, without a NaN.

    Dividing raw logits by a tiny temperature (1e-39, 5e-324) overflows to +-inf, and softmax of two
    infinities is NaN, which ``torch.multinomial`` refuses. Shifted so that the top logit is 0 first (which
    softmax does not see), the quotient is 0 for the top token(s) and -inf at worst for the others: the
    limit, greedy (tied top tokens share the mass). A temperature below float32's smallest subnormal
    (5e-324 is 0 there, and 0/0 is NaN) is taken as that subnormal (1.4e-45), which is the same limit for
    any two logits more than about 1e-43 apart.
    """
    shifted = logits - logits.max(dim=-1, keepdim=True).values
    return shifted / max(temperature, _MIN_TEMPERATURE)


def _kv(cache: DynamicCache) -> KV:
    return [(layer.keys, layer.values) for layer in cache.layers]


def _cache(model: PreTrainedModel, kv: KV) -> DynamicCache:
    """A DynamicCache holding a copy of ``kv``: its layers grow by ``torch.cat`` into new tensors, so the
    tensors passed here (prefix-cache entries among them) are never written by later forward passes."""
    return DynamicCache(kv, config=model.config)


def _shared(a: torch.Tensor, b: torch.Tensor) -> int:
    """Length of the common prefix of two 1-D token id tensors."""
    n = min(len(a), len(b))
    differ = torch.nonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


class PrefixCache:
    """KV of recently computed token sequences, reused by any prompt that starts with part of one.

    An entry serves every prefix of its sequence (its KV cropped), so a sequence that extends an entry
    replaces it: a conversation's next request finds its previous prompt and response in one entry. Bounded
    by ``max_tokens`` cached tokens in all, least recently used first out; 0 disables it.
    """

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.tokens = 0
        self._entries: OrderedDict[tuple[int, ...], tuple[torch.Tensor, KV]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, ids: list[int]) -> tuple[int, KV]:
        """The longest cached prefix of ``ids``: its length and KV (one row; views, not to be written)."""
        probe = torch.tensor(ids)
        best, best_key = 0, None
        for key, (seq, _) in self._entries.items():
            if (shared := _shared(seq, probe)) > best:
                best, best_key = shared, key
        if best_key is None:
            return 0, []
        self._entries.move_to_end(best_key)
        return best, [(k[..., :best, :], v[..., :best, :]) for k, v in self._entries[best_key][1]]

    def insert(self, ids: list[int], kv: KV) -> None:
        """Remember ``kv`` (one row, ``len(ids)`` tokens; copied) as the KV of ``ids``."""
        if not 0 < len(ids) <= self.max_tokens:
            return
        probe = torch.tensor(ids)
        for key, (seq, _) in list(self._entries.items()):
            shared = _shared(seq, probe)
            if shared == len(ids):  # an entry already holds all of it
                self._entries.move_to_end(key)
                return
            if shared == len(seq):
                self._drop(key)
        self._entries[tuple(ids)] = (probe, [(k.clone(), v.clone()) for k, v in kv])
        self.tokens += len(ids)
        while self.tokens > self.max_tokens:
            self._drop(next(iter(self._entries)))

    def clear(self) -> None:
        self._entries.clear()
        self.tokens = 0

    def _drop(self, key: tuple[int, ...]) -> None:
        del self._entries[key]
        self.tokens -= len(key)


class _Request:
    """One call's ``n`` choices: its own generator, stop rules, callbacks and result, wherever it runs."""

    def __init__(
        self,
        model: PreTrainedModel,
        prompt_ids: list[int],
        params: SamplingParams,
        on_token: OnToken | None,
        cancel: threading.Event | None,
        detokenize: Callable[[list[int]], str] | None,
    ) -> None:
        validate(model, prompt_ids, params)
        if params.stop and detokenize is None:
            raise ValueError("stop strings need a detokenize function")
        self.prompt_ids, self.params = prompt_ids, params
        self.on_token, self.cancel, self.detokenize = on_token, cancel, detokenize
        self.context = max_context(model)
        # A stop string ends within the newest token; the last few tokens' text is enough to see it.
        self.window = 4 * max((len(x) for x in params.stop), default=0) + 4
        self.generator = torch.Generator(device=next(model.parameters()).device)
        if params.seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(params.seed)
        self.tokens: list[list[int]] = [[] for _ in range(params.n)]
        self.logprobs: list[list[float]] = [[] for _ in range(params.n)]
        self.finish: list[FinishReason | None] = [None] * params.n
        self.stop_str: list[str | None] = [None] * params.n
        self.future: Future[list[Completion]] = Future()

    @property
    def done(self) -> bool:
        return all(f is not None for f in self.finish)

    def record(self, logits: torch.Tensor) -> torch.Tensor:
        """Sample a token per choice from ``logits`` (n, vocab), record and stream it; return the tokens.

        Finished choices keep sampling in lockstep (outputs ignored), so the generator is consumed the same
        way whichever choices are still running. A set ``cancel`` ends the unfinished ones with "abort".
        """
        params = self.params
        if params.forced:
            picked, picked_logp = self._forced(logits)
        else:
            picked, picked_logp = _sample(logits, params, self.generator)
        for i in range(params.n):
            if self.finish[i] is not None:
                continue
            token, logprob = int(picked[i]), float(picked_logp[i])
            self.tokens[i].append(token)
            self.logprobs[i].append(logprob)
            self.finish[i] = finish_reason_for(
                token, len(self.tokens[i]), len(self.prompt_ids), params, self.context
            )
            if params.stop and self.finish[i] != "stop":
                assert self.detokenize is not None
                tail = self.detokenize(self.tokens[i][-self.window :])
                hit = next((x for x in params.stop if x in tail), None)
                if hit is not None:
                    self.finish[i], self.stop_str[i] = "stop", hit
            if self.on_token is not None:
                self.on_token(i, token, logprob, self.finish[i], self.stop_str[i])
        if not self.done and self.cancel is not None and self.cancel.is_set():
            self.finish = [f if f is not None else "abort" for f in self.finish]
        return picked

    def _forced(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The scripted token of each row (its next one; the last again once the script is spent: only a
        finished row gets there) and the model's logprob of it, by ``_sample``'s convention."""
        forced = self.params.forced
        picked = torch.tensor(
            [forced[min(len(tokens), len(forced) - 1)] for tokens in self.tokens], device=logits.device
        )
        temperature = self.params.temperature
        scaled = _tempered(logits.float(), temperature) if temperature else logits.float()
        logp = torch.log_softmax(scaled, dim=-1)
        return picked, logp.gather(-1, picked.unsqueeze(-1)).squeeze(-1)

    def result(self) -> list[Completion]:
        return [
            Completion(
                token_ids=tokens,
                logprobs=logprobs,
                finish_reason=finish or "length",
                stop_token_id=tokens[-1] if finish == "stop" and stop_str is None else None,
                stop_str=stop_str,
            )
            for tokens, logprobs, finish, stop_str in zip(
                self.tokens, self.logprobs, self.finish, self.stop_str, strict=True
            )
        ]


class _Batch:
    """Running requests, decoded together: one forward pass per step for all their rows.

    Request after request, each holds ``params.n`` consecutive rows of one DynamicCache, left-padded to a
    common length; ``mask`` marks the real tokens (so a row's position is its count of real tokens).
    """

    def __init__(self, model: PreTrainedModel, prefix_cache: PrefixCache, stats: Stats) -> None:
        self.model, self.prefix_cache, self.stats = model, prefix_cache, stats
        self.device = next(model.parameters()).device
        self._reset()

    @property
    def rows(self) -> int:
        return len(self.last)

    def _reset(self) -> None:
        self.requests: list[_Request] = []
        self.cache: DynamicCache | None = None
        self.mask = torch.zeros(0, 0, dtype=torch.long, device=self.device)
        self.last = torch.zeros(0, dtype=torch.long, device=self.device)  # each row's token to feed next

    def prefill(self, req: _Request) -> None:
        """Compute the prompt (past its longest cached prefix), sample the first tokens, join the batch.

        The last prompt token is always recomputed: its logits give the first token.
        """
        prompt, n = req.prompt_ids, req.params.n
        hit, kv = self.prefix_cache.lookup(prompt[:-1])
        self.stats.prompt_tokens += len(prompt)
        self.stats.cached_tokens += hit
        cache = _cache(self.model, [(k.expand(n, -1, -1, -1), v.expand(n, -1, -1, -1)) for k, v in kv])
        ids = torch.tensor([prompt[hit:]], dtype=torch.long, device=self.device).expand(n, -1)
        # `past_key_values=`: transformers 5.10 (verl's bound) ignores `cache=` silently; newer accept both.
        logits = self.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[
            :, -1
        ]
        self.prefix_cache.insert(prompt, [(k[:1], v[:1]) for k, v in _kv(cache)])
        picked = req.record(logits)
        if req.done:
            req.future.set_result(req.result())
            return
        new_kv, new_mask = _kv(cache), torch.ones(n, len(prompt), dtype=torch.long, device=self.device)
        if self.cache is None:
            self.cache, self.mask = cache, new_mask
        else:
            width = max(self.mask.shape[1], len(prompt))
            self.cache = _cache(
                self.model,
                [
                    (
                        torch.cat([_pad(k0, width), _pad(k1, width)]),
                        torch.cat([_pad(v0, width), _pad(v1, width)]),
                    )
                    for (k0, v0), (k1, v1) in zip(_kv(self.cache), new_kv, strict=True)
                ],
            )
            self.mask = torch.cat([_pad(self.mask, width), _pad(new_mask, width)])
        self.last = torch.cat([self.last, picked])
        self.requests.append(req)

    def decode(self) -> None:
        """One forward pass for every row; then each request samples its rows, and finished ones leave."""
        assert self.cache is not None
        positions = self.mask.sum(-1, keepdim=True)
        self.mask = F.pad(self.mask, (0, 1), value=1)
        out = self.model(
            input_ids=self.last[:, None],
            attention_mask=self.mask,
            position_ids=positions,
            past_key_values=self.cache,
            use_cache=True,
        )
        self.stats.decode_steps += 1
        self.stats.batch_sizes[self.rows] += 1
        keep: list[int] = []
        running: list[_Request] = []
        row = 0
        for req in self.requests:
            rows = slice(row, row + req.params.n)
            self.last[rows] = req.record(out.logits[rows, -1])
            if req.done:
                self._retire(req, row)
            else:
                keep.extend(range(rows.start, rows.stop))
                running.append(req)
            row = rows.stop
        if len(running) < len(self.requests):
            self._select(keep, running)

    def fail(self, exc: BaseException) -> None:
        """End every running request with ``exc`` (the batch's state cannot be trusted after an error)."""
        for req in self.requests:
            req.future.set_exception(exc)
        self._reset()

    def _retire(self, req: _Request, row: int) -> None:
        """Cache each choice's computed sequence (prompt and all but its last token), then deliver."""
        assert self.cache is not None
        width = self.mask.shape[1]
        for i, tokens in enumerate(req.tokens):
            seq = req.prompt_ids + tokens[:-1]
            start = width - int(self.mask[row + i].sum())
            kv = [
                (k[row + i, None, :, start : start + len(seq)], v[row + i, None, :, start : start + len(seq)])
                for k, v in _kv(self.cache)
            ]
            self.prefix_cache.insert(seq, kv)
        req.future.set_result(req.result())

    def _select(self, keep: list[int], running: list[_Request]) -> None:
        """Keep only rows ``keep``, dropping padding columns that no kept row needs any more."""
        if not keep:
            self._reset()
            return
        assert self.cache is not None
        index = torch.tensor(keep, device=self.device)
        mask = self.mask[index]
        drop = int(mask.any(0).int().argmax())  # first column some kept row uses
        self.cache = _cache(
            self.model, [(k[index, :, drop:], v[index, :, drop:]) for k, v in _kv(self.cache)]
        )
        self.mask, self.last, self.requests = mask[:, drop:], self.last[index], running


def _pad(x: torch.Tensor, width: int) -> torch.Tensor:
    """Left-pad a mask (rows, tokens) or KV (rows, heads, tokens, dim) with zeros to ``width`` tokens."""
    missing = width - (x.shape[1] if x.dim() == 2 else x.shape[2])
    return F.pad(x, (missing, 0) if x.dim() == 2 else (0, 0, missing, 0))


class Scheduler:
    """Serves requests from one thread that owns the model, batching concurrent ones and caching prefixes.

    Between decode steps it admits waiting requests while the batch has room for their rows (``max_batch``;
    a request with more choices is admitted alone), prefilling each from the prefix cache
    (``prefix_cache_tokens``), then runs one decode step for all running rows. ``max_batch=1`` and
    ``prefix_cache_tokens=0`` give the one-request-at-a-time engine this replaced.
    """

    def __init__(
        self, model: PreTrainedModel, *, prefix_cache_tokens: int = 4096, max_batch: int = 16
    ) -> None:
        if max_batch < 1 or prefix_cache_tokens < 0:
            raise ValueError("max_batch must be at least 1 and prefix_cache_tokens at least 0")
        self.model = model
        self.max_batch = max_batch
        self.prefix_cache = PrefixCache(prefix_cache_tokens)
        self.stats = Stats()
        self._waiting: deque[_Request] = deque()
        self._next_model: PreTrainedModel | None = None
        self._wake = threading.Condition()
        threading.Thread(target=self._run, name="inharness-engine", daemon=True).start()

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        on_token: OnToken | None = None,
        *,
        cancel: threading.Event | None = None,
        detokenize: Callable[[list[int]], str] | None = None,
    ) -> Future[list[Completion]]:
        """Queue a request (arguments as for ``generate``; ValueError at once for invalid ones).

        Callbacks run on the scheduler's thread. Cancelling the future before the request starts drops it.
        """
        req = _Request(self.model, prompt_ids, params, on_token, cancel, detokenize)
        with self._wake:
            self._waiting.append(req)
            self._wake.notify()
        return req.future

    def load_model(self, model: PreTrainedModel) -> None:
        """Serve ``model`` from now on: running requests finish on the weights they started with (admission
        pauses until they have), then the prefix cache is cleared, as its KV came from the old weights."""
        with self._wake:
            self._next_model = model
            self._wake.notify()

    def _admit(self, batch: _Batch) -> list[_Request]:
        with self._wake:
            while not (self._waiting or batch.requests or self._next_model is not None):
                self._wake.wait()
            if self._next_model is not None:
                if batch.requests:
                    return []
                self.model = batch.model = self._next_model
                self._next_model = None
                self.prefix_cache.clear()
            admitted: list[_Request] = []
            rows = batch.rows
            while self._waiting and (rows == 0 or rows + self._waiting[0].params.n <= self.max_batch):
                req = self._waiting.popleft()
                if req.future.set_running_or_notify_cancel():
                    admitted.append(req)
                    rows += req.params.n
            return admitted

    def _run(self) -> None:
        batch = _Batch(self.model, self.prefix_cache, self.stats)
        with torch.inference_mode():
            while True:
                for req in self._admit(batch):
                    try:
                        batch.prefill(req)
                    except Exception as exc:  # a failed request must not stop the others
                        req.future.set_exception(exc)
                if batch.requests:
                    try:
                        batch.decode()
                    except Exception as exc:
                        batch.fail(exc)


def generate(
    model: PreTrainedModel,
    prompt_ids: list[int],
    params: SamplingParams,
    on_token: OnToken | None = None,
    *,
    cancel: threading.Event | None = None,
    detokenize: Callable[[list[int]], str] | None = None,
) -> list[Completion]:
    """Generate ``params.n`` choices for one prompt, as one batch, with a KV cache (no prefix cache).

    ``on_token(choice_index, token_id, logprob, finish_reason, stop_str)`` is called as each token is
    produced (streaming; finish_reason, and stop_str for a stop string, are set on a choice's last
    token). Each choice ends at a stop token (kept in ``token_ids``), at a stop string (``params.stop``,
    checked on the text ``detokenize`` gives; the token that completes it is kept, as in vLLM), at
    ``max_tokens``, or when the context is full ("length"). Setting ``cancel`` ends all unfinished
    choices with finish_reason "abort". Thread-safe: calls are serialised by a module lock; a server
    batches concurrent requests with a ``Scheduler`` instead.
    """
    req = _Request(model, prompt_ids, params, on_token, cancel, detokenize)
    with _LOCK, torch.inference_mode():
        batch = _Batch(model, PrefixCache(0), Stats())
        batch.prefill(req)
        while batch.requests:
            batch.decode()
    return req.future.result()
