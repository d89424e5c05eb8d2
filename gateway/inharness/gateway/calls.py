"""One harness call, whatever protocol it arrived in: admit, tokenise, generate, detokenise, record.

Protocol adapters build a `Conversation` and `Sampling`, open `CallService.call(...)`, read the
engine's tokens through it, and hand back the reply they rendered; the call is recorded (durably)
before the adapter answers the harness.

Which calls are recorded (docs/gateway.md, "What is recorded"): a call is recorded iff its whole
answer was generated while its harness was still connected and its attempt still running, and the
record is committed before the answer's last bytes are handed to the transport (so that the next
turn always finds it). Otherwise it is dropped, counted in `inharness_gateway_calls_dropped` by
reason: the trainer learns only from answers an agent can have acted on.
"""

import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import anyio

from inharness.gateway.conversation import Conversation, Message, extend_digest
from inharness.gateway.engines import Choice, EnginePool, EngineRejected, NoEngineAvailable, Served
from inharness.gateway.errors import APIError
from inharness.gateway.metrics import GatewayMetrics
from inharness.gateway.prompts import BuiltPrompt, PromptBuilder
from inharness.gateway.serving import ServingGate
from inharness.gateway.store import AttemptAuth, AttemptEnded, CallRecord, ParentCall, Store


@dataclass(frozen=True, slots=True)
class Sampling:
    max_tokens: int | None
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    n: int = 1
    stop: tuple[str, ...] = ()


class TextDecoder:
    """Incremental detokenisation with stop strings. Holds back text that may still change (an
    incomplete UTF-8 sequence, a possible start of a stop string); both streaming and plain
    answers use it, so they agree."""

    def __init__(self, tokenizer: Any, stop: tuple[str, ...]) -> None:
        self._tok = tokenizer
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._ids: list[int] = []
        self._sent = 0
        self.stopped = False
        self.stopped_by: str | None = None  # the stop string that cut the text

    def feed(self, ids: list[int]) -> str:
        if self.stopped:
            return ""
        self._ids.extend(ids)
        text = self._tok.decode(self._ids, skip_special_tokens=True)
        found = [(i, s) for s in self._stop if (i := text.find(s)) >= 0]
        if found:
            cut, self.stopped_by = min(found)
            self.stopped = True
            return self._take(text[:cut], len(text[:cut]))
        safe = len(text) - self._hold
        while safe > self._sent and text[safe - 1] == "\ufffd":
            safe -= 1
        return self._take(text, safe)

    def finish(self) -> str:
        if self.stopped:
            return ""
        text = self._tok.decode(self._ids, skip_special_tokens=True)
        return self._take(text, len(text))

    def _take(self, text: str, upto: int) -> str:
        if upto <= self._sent:
            return ""
        out = text[self._sent : upto]
        self._sent = upto
        return out


@dataclass(slots=True)
class Output:
    """One choice as generated: what the engine returned, and when its first token came."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = "stop"
    stopped_by_string: bool = False


# Why a generated call was not recorded (the `reason` of inharness_gateway_calls_dropped).
CLIENT_GONE = "client_gone"  # the harness disconnected (timed out, left a serving pause) before its answer
ATTEMPT_ENDED = "attempt_ended"  # the attempt completed, was released or lost its lease while the call ran
MAX_CACHED_KEYS = 65_536
GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS


async def _never_gone() -> bool:
    return False


@dataclass(slots=True)
class CallContext:
    service: "CallService"
    auth: AttemptAuth
    chain: list[str]
    prompt: BuiltPrompt
    sampling: Sampling
    max_tokens: int
    version: int
    protocol: str
    requested_model: str
    request_body: dict[str, Any]
    request_id: str
    notes: tuple[str, ...] = ()
    started_at: float = field(default_factory=time.time)
    first_token_at: float | None = None
    served: Served | None = None
    client_gone: Callable[[], Awaitable[bool]] = _never_gone
    recorded: bool = False
    dropped: str | None = None
    # Set by a streaming adapter: what the harness has been sent so far, as `record`'s arguments.
    sent_so_far: Callable[[], tuple[list[Output], list[Message], dict[str, Any]]] | None = None

    def engine_body(self) -> dict[str, Any]:
        s = self.sampling
        body: dict[str, Any] = {
            "prompt": self.prompt.ids,
            "max_tokens": self.max_tokens,
            # A temperature this close to 0 divides logits into infinities (an engine error that
            # would be retried as if transient); it means greedy, as vLLM reads it too.
            "temperature": 0.0 if s.temperature < GREEDY_BELOW else s.temperature,
            "top_p": s.top_p,
            "n": s.n,
            "stop_token_ids": self.service.stop_token_ids,
        }
        if s.seed is not None:
            body["seed"] = s.seed
        if s.stop:
            body["stop"] = list(s.stop)
        return body

    async def complete(self) -> list[Output]:
        try:
            self.served, choices = await self.service.pool.complete(
                self.auth.id, self.version, self.engine_body()
            )
        except (NoEngineAvailable, EngineRejected) as exc:
            raise self.service.engine_error(exc) from exc
        return [_output(i, c) for i, c in enumerate(choices)]

    async def open_stream(self) -> AsyncIterator[tuple[int, list[int], list[float], str | None]]:
        """Connect to an engine (errors surface here, before any byte reaches the harness), then
        return the chunks: (choice index, new token ids, their logprobs, finish reason)."""
        try:
            self.served, chunks = await self.service.pool.stream(
                self.auth.id, self.version, self.engine_body()
            )
        except (NoEngineAvailable, EngineRejected) as exc:
            raise self.service.engine_error(exc) from exc
        return self._timed(chunks)

    async def _timed(
        self, chunks: AsyncIterator[tuple[int, list[int], list[float], str | None]]
    ) -> AsyncIterator[tuple[int, list[int], list[float], str | None]]:
        try:
            async for item in chunks:
                if self.first_token_at is None and item[1]:
                    self.first_token_at = time.time()
                yield item
        except NoEngineAvailable as exc:
            raise self.service.engine_error(exc) from exc

    async def record(
        self,
        outputs: list[Output],
        replies: list[Message],
        response_body: dict[str, Any],
        *,
        cut: bool = False,
    ) -> None:
        """Durably record every choice; only then may the adapter answer the harness. An APIError
        instead when the call is dropped (module docstring): its harness left (499) or its attempt
        ended (403). ``cut``: the record of a stream its harness hung up on (`CLIENT_CUT`), which
        the harness's leaving does not drop."""
        svc = self.service
        if not cut and await self.client_gone():
            raise svc.dropped(self, CLIENT_GONE)
        now = time.time()
        served = self.served or Served(self.version, "")
        records = [
            CallRecord(
                attempt_id=self.auth.id,
                rollout_id=self.auth.rollout_id,
                request_id=self.request_id,
                choice_index=o.index,
                protocol=self.protocol,
                requested_model=self.requested_model,
                model_version=served.version,
                engine=served.engine,
                prompt_ids=self.prompt.ids,
                response_ids=o.token_ids,
                response_logprobs=o.logprobs,
                finish_reason=o.finish_reason,
                parent_call_id=self.prompt.parent_call_id,
                prefix_reused=self.prompt.prefix_reused,
                prefix_mismatch=self.prompt.mismatch,
                request_digest=self.chain[-1],
                reply_digest=extend_digest(self.chain[-1], reply),
                turns_digest=extend_digest(self.prompt.turns_digest, reply),
                started_at=self.started_at,
                first_token_at=self.first_token_at,
                finished_at=now,
                request_body=self.request_body,
                response_body=response_body,
                notes=self.notes,
            )
            for o, reply in zip(outputs, replies, strict=True)
        ]
        try:
            # Shielded: a request cancelled mid-write would leave unknown whether its call was recorded.
            with anyio.CancelScope(shield=True):
                await svc.store.record_calls(records)
                self.recorded = True
        except AttemptEnded:  # checked in the commit's own transaction, whichever process ended it
            raise svc.dropped(self, ATTEMPT_ENDED) from None
        for rec, o in zip(records, outputs, strict=True):
            assert rec.id is not None
            svc.prompts.remember(
                self.auth.id,
                rec.id,
                rec.request_digest,
                rec.reply_digest,
                rec.turns_digest or "",
                ParentCall(rec.id, list(self.prompt.ids), o.token_ids, o.finish_reason),
            )
        m = svc.metrics
        m.tokens.labels("prompt").inc(len(self.prompt.ids))
        m.tokens.labels("completion").inc(sum(len(o.token_ids) for o in outputs))
        if self.prompt.prefix_reused:
            m.prefix_reused.inc()
        if self.prompt.mismatch:
            m.prefix_mismatch.labels(self.prompt.mismatch).inc()


def _output(index: int, c: Choice) -> Output:
    return Output(index, c.token_ids, c.logprobs, c.finish_reason or "stop")


class CallService:
    def __init__(
        self,
        *,
        store: Store,
        pool: EnginePool,
        prompts: PromptBuilder,
        tokenizer: Any,
        gate: ServingGate,
        metrics: GatewayMetrics,
        max_model_len: int,
        stop_token_ids: list[int],
        temperature: float | None = None,
        max_tokens: int | None = None,
    ) -> None:
        """``temperature`` and ``max_tokens``: the policy's sampling (the gateway's settings of those
        names), applied over what each request asks; None leaves the request's."""
        self.store = store
        self.pool = pool
        self.prompts = prompts
        self.tokenizer = tokenizer
        self.gate = gate
        self.metrics = metrics
        self.max_model_len = max_model_len
        self.stop_token_ids = stop_token_ids
        self.temperature = temperature
        self.max_tokens = max_tokens
        # Keys of running attempts as last read from the store, trusted until the lease they carry
        # passes; every path that moves a lease or ends an attempt here updates or forgets them.
        self._auth: dict[str, AttemptAuth] = {}
        self._token_of: dict[str, str] = {}  # attempt id -> its key, for the keys in `_auth`

    async def authenticate(self, token: str | None) -> AttemptAuth:
        if not token:
            raise APIError(
                401,
                "missing API key: send the attempt's key as 'Authorization: Bearer <key>' (or 'x-api-key')",
                code="invalid_api_key",
            )
        cached = self._auth.get(token)
        if cached is not None and cached.lease_expires_at > time.time():
            return cached
        auth = await self.store.attempt_by_token(token)
        if auth is None:
            raise APIError(
                401, "unknown API key: it belongs to no attempt of this gateway", code="invalid_api_key"
            )
        if auth.status != "running":
            self._auth.pop(token, None)
            self._token_of.pop(auth.id, None)
            state = "past its lease" if auth.status == "expired" else auth.status
            raise APIError(
                403, f"attempt {auth.id} is {state}; its key no longer serves calls", code="attempt_finished"
            )
        while len(self._auth) >= MAX_CACHED_KEYS:  # the oldest key is read from the store again
            evicted = self._auth.pop(next(iter(self._auth)))
            self._token_of.pop(evicted.id, None)
        self._auth[token] = auth
        self._token_of[auth.id] = token
        return auth

    def lease_renewed(self, attempt_id: str, lease_expires_at: float) -> None:
        """A heartbeat moved the attempt's lease (later or earlier): its cached key follows."""
        token = self._token_of.get(attempt_id)
        cached = None if token is None else self._auth.get(token)
        if token is not None and cached is not None:
            self._auth[token] = replace(cached, lease_expires_at=lease_expires_at)

    def forget_attempt(self, attempt_id: str) -> None:
        """An attempt ended: its key stops working here at once, and its prompt cache goes."""
        token = self._token_of.pop(attempt_id, None)
        if token is not None:
            self._auth.pop(token, None)
        self.prompts.forget(attempt_id)

    def dropped(self, ctx: CallContext, reason: str) -> APIError:
        """Count a generated call that is not recorded, and the error its harness gets, if still there."""
        ctx.dropped = reason
        self.metrics.calls_dropped.labels(reason).inc()
        if reason == CLIENT_GONE:
            return APIError(499, "the client left before its answer; the call is not recorded")
        return APIError(
            403,
            f"attempt {ctx.auth.id} ended while this call ran; its answer is not recorded",
            code="attempt_finished",
        )

    @asynccontextmanager
    async def call(
        self,
        auth: AttemptAuth,
        conv: Conversation,
        sampling: Sampling,
        *,
        protocol: str,
        requested_model: str,
        request_body: dict[str, Any],
        id_prefix: str = "chatcmpl-",
        notes: tuple[str, ...] = (),
        client_gone: Callable[[], Awaitable[bool]] = _never_gone,
    ) -> AsyncIterator[CallContext]:
        """Admit a call (waiting out a serving pause), build its prompt and check that it fits.
        `id_prefix` starts the protocol's id of the answer (also the recorded request id); `notes`
        say what of the request the prompt leaves out, and are recorded with the call;
        `client_gone` tells whether the harness has disconnected (then nothing is generated for it
        after a pause, and nothing recorded)."""
        held = self.gate.holding  # only a held call can have lost its client before it starts
        async with self.gate.admit():
            if held and await client_gone():
                self.metrics.calls_dropped.labels(CLIENT_GONE).inc()
                raise APIError(499, "the client left while its call was held; nothing was generated")
            if self.pool.active is None:
                raise APIError(503, "no model version is active on this gateway", code="no_active_model")
            chain = conv.digest_chain()
            prompt = await self.prompts.build(auth.id, conv, chain)
            room = self.max_model_len - len(prompt.ids)
            if room < 1:
                raise APIError(
                    400,
                    f"this model's maximum context length is {self.max_model_len} tokens; the messages take "
                    f"{len(prompt.ids)} tokens and leave no room for an answer",
                    param="messages",
                    code="context_length_exceeded",
                )
            max_tokens = min(sampling.max_tokens or room, self.max_tokens or room, room)
            if self.temperature is not None:
                sampling = replace(sampling, temperature=self.temperature)
            yield CallContext(
                service=self,
                auth=auth,
                chain=chain,
                prompt=prompt,
                sampling=sampling,
                max_tokens=max_tokens,
                version=self.pool.active,
                protocol=protocol,
                requested_model=requested_model,
                request_body=request_body,
                request_id=id_prefix + uuid.uuid4().hex,
                notes=notes,
                client_gone=client_gone,
            )

    def engine_error(self, exc: NoEngineAvailable | EngineRejected) -> APIError:
        self.metrics.engine_errors.inc()
        if isinstance(exc, EngineRejected):
            # A 400/422 is about the request (a sampling value the engine cannot honour): the harness's
            # 400, not retried, so that it does not retry it either. Any other 4xx (the engine refused the
            # gateway's key, does not know the model) is the deployment's fault: a 502.
            status = 400 if exc.status in (400, 422) else 502
            message = f"the inference engine refused the request: {exc}"
            return APIError(status, message, code="engine_rejected")
        return APIError(503, str(exc), code="engine_unavailable")
