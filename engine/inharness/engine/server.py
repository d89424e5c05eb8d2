"""A small OpenAI-compatible completions server: the subset of vLLM's API that the gateway uses.

Field names, defaults and stop semantics follow vLLM's ``/v1/completions`` (including ``return_token_ids``,
``return_tokens_as_token_ids`` and ``stop_token_ids``), so a real vLLM server is a drop-in replacement.
Generation runs on the ``Scheduler``'s thread, which batches concurrent requests and reuses cached prompt
prefixes (see ``sampling``); streamed tokens cross back to the event loop through an asyncio queue.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from inharness.engine import auth
from inharness.engine.sampling import (
    MAX_N,
    MAX_SEED,
    MIN_SEED,
    Completion,
    SamplingParams,
    Scheduler,
    validate,
)
from inharness.engine.script import SCRIPT_ENV, Scripts

MAX_LOGPROBS = 20  # vLLM's default --max-logprobs
DEFAULT_PREFIX_CACHE_TOKENS = 4096  # the smallest default prefix cache (4 KiB of KV per token, tiny model)
Number = StrictFloat | StrictInt


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: StrictBool | None = False


class CompletionRequest(BaseModel):
    """``POST /v1/completions`` body; unknown fields are ignored, as vLLM accepts many more."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    prompt: list[StrictInt] | StrictStr
    max_tokens: StrictInt | None = 16
    temperature: Number | None = None
    top_p: Number | None = None
    seed: StrictInt | None = None
    n: StrictInt = 1
    stop_token_ids: list[StrictInt] | None = None
    stop: StrictStr | list[StrictStr] | None = None
    ignore_eos: StrictBool = False
    logprobs: StrictInt | None = None
    return_token_ids: StrictBool | None = False
    return_tokens_as_token_ids: StrictBool | None = False
    skip_special_tokens: StrictBool = True
    stream: StrictBool = False
    stream_options: StreamOptions | None = None


class LoadWeights(BaseModel):
    """``POST /v1/inharness/load_weights``: replace the served weights by those saved in ``path``."""

    model_config = ConfigDict(extra="forbid")

    path: StrictStr


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def _error(message: str, param: str | None, status: int = 400, kind: str = "BadRequestError") -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return JSONResponse(body, status_code=status)


@dataclass
class EngineState:
    """What the routes share: the loaded model, its tokenizer, the scheduler that runs it and a few counters
    (read by tests/metrics; prefix-cache hits and batch sizes are in ``scheduler.stats``)."""

    model: PreTrainedModel
    scheduler: Scheduler
    tokenizer: PreTrainedTokenizerBase
    name: str
    root: str
    max_model_len: int
    eos_token_id: int | None
    extra_eos_ids: list[int] = field(default_factory=list)
    device: str = "cpu"
    script: Scripts | None = None  # scripted mode: answers taken from a script (inharness.engine.script)
    requests: int = 0
    aborted: int = 0
    weight_loads: int = 0

    def detokenize(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)


@dataclass
class _Job:
    """One validated request, ready to run."""

    prompt_ids: list[int]
    params: SamplingParams
    req: CompletionRequest
    request_id: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))


def _load_model(model_dir: str, device: str) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()


def _load(
    model_dir: str,
    served_model_name: str | None,
    device: str | None,
    prefix_cache_tokens: int | None,
    max_batch: int,
    script: str | None = None,
) -> EngineState:
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = _load_model(model_dir, device)
    eos_ids: list[int] = []
    try:
        gen_eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
    except OSError:
        gen_eos = None
    if gen_eos is not None:
        eos_ids = [gen_eos] if isinstance(gen_eos, int) else list(gen_eos)
    primary = tokenizer.eos_token_id
    context = int(model.config.max_position_embeddings)
    if prefix_cache_tokens is None:
        prefix_cache_tokens = max(DEFAULT_PREFIX_CACHE_TOKENS, context)
    scripts = None if script is None else Scripts.load(script, tokenizer, int(model.config.vocab_size))
    return EngineState(
        model=model,
        scheduler=Scheduler(model, prefix_cache_tokens=prefix_cache_tokens, max_batch=max_batch),
        tokenizer=tokenizer,
        name=served_model_name or Path(model_dir).name,
        root=str(model_dir),
        max_model_len=context,
        eos_token_id=primary,
        extra_eos_ids=[t for t in eos_ids if t != primary],
        device=device,
        script=scripts,
    )


def _prepare(state: EngineState, req: CompletionRequest) -> _Job:
    """Turn a request into prompt ids and sampling params, raising BadRequest like vLLM would."""
    vocab = int(state.model.config.vocab_size)
    prompt_ids = state.tokenizer.encode(req.prompt) if isinstance(req.prompt, str) else list(req.prompt)
    if not prompt_ids:
        raise BadRequest("prompt must not be empty", "prompt")
    bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise BadRequest(f"token id {bad} is out of vocabulary (size {vocab})", "prompt")
    room = state.max_model_len - len(prompt_ids)
    if room < 1:
        raise BadRequest(
            f"This model's maximum context length is {state.max_model_len} tokens; the prompt has "
            f"{len(prompt_ids)} tokens, which leaves no room for completion tokens.",
            "prompt",
        )
    max_tokens = room if req.max_tokens is None else req.max_tokens
    if max_tokens < 1:
        raise BadRequest("max_tokens must be at least 1", "max_tokens")
    if not 1 <= req.n <= MAX_N:
        raise BadRequest(f"n must be between 1 and {MAX_N}", "n")
    if req.seed is not None and not MIN_SEED <= req.seed <= MAX_SEED:
        raise BadRequest(f"seed must be between {MIN_SEED} and {MAX_SEED}", "seed")
    temperature = 1.0 if req.temperature is None else float(req.temperature)
    if not 0 <= temperature < math.inf:  # NaN fails too (Python's JSON reader takes NaN and Infinity)
        raise BadRequest("temperature must be a finite number, at least 0", "temperature")
    top_p = 1.0 if req.top_p is None else float(req.top_p)
    if not 0 < top_p <= 1:
        raise BadRequest("top_p must be in (0, 1]", "top_p")
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
        raise BadRequest(f"logprobs must be between 0 and {MAX_LOGPROBS}", "logprobs")
    stop = list(req.stop_token_ids or [])
    if any(not 0 <= t < vocab for t in stop):
        raise BadRequest("stop_token_ids contains an id out of vocabulary", "stop_token_ids")
    if not req.ignore_eos:
        stop += state.extra_eos_ids
        if state.eos_token_id is not None:
            stop.append(state.eos_token_id)
    stop_strings = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if any(not x for x in stop_strings):
        raise BadRequest("stop strings must not be empty", "stop")
    params = SamplingParams(
        stop=tuple(stop_strings),
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=req.seed,
        stop_token_ids=list(dict.fromkeys(stop)),
        n=req.n,
        forced=() if state.script is None else state.script.tokens_for(prompt_ids),
    )
    try:
        validate(state.model, prompt_ids, params)
    except ValueError as exc:
        raise BadRequest(str(exc)) from exc
    return _Job(prompt_ids=prompt_ids, params=params, req=req)


class _ChoiceOutput:
    """Accumulates one choice's tokens and renders vLLM's per-choice fields, whole or as stream deltas."""

    def __init__(self, state: EngineState, job: _Job, index: int) -> None:
        self.state, self.job, self.index = state, job, index
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.text_emitted = 0
        self.char_offset = 0

    def add(
        self, token_id: int, logprob: float, finish_reason: str | None, stop_str: str | None = None
    ) -> None:
        self.token_ids.append(token_id)
        self.logprobs.append(logprob)
        if finish_reason is not None:
            self.finish_reason = finish_reason
            if stop_str is not None:
                self.stop_reason = stop_str
            elif finish_reason == "stop" and token_id != self.state.eos_token_id:
                self.stop_reason = token_id

    def text(self) -> str:
        """Decoded completion; like vLLM, the stop token's text or the stop string is left out."""
        if isinstance(self.stop_reason, str):
            full = self.state.tokenizer.decode(
                self.token_ids, skip_special_tokens=self.job.req.skip_special_tokens
            )
            return full[: full.find(self.stop_reason)] if self.stop_reason in full else full
        ids = self.token_ids[:-1] if self.finish_reason == "stop" else self.token_ids
        return self.state.tokenizer.decode(ids, skip_special_tokens=self.job.req.skip_special_tokens)

    def text_delta(self) -> str:
        """New text since the last call, holding back a trailing partial UTF-8 sequence until it completes,
        and, while stop strings may still match, the text that could be the start of one."""
        full = self.text()
        if self.finish_reason is None:
            if full.endswith("\ufffd"):
                return ""
            hold = max((len(x) for x in self.job.params.stop), default=1) - 1
            full = full[: len(full) - hold] if hold else full
        if len(full) <= self.text_emitted:
            return ""
        delta = full[self.text_emitted :]
        self.text_emitted = len(full)
        return delta

    def logprobs_block(self, start: int) -> dict[str, Any] | None:
        if self.job.req.logprobs is None:
            return None
        tokens, offsets = [], []
        for token_id in self.token_ids[start:]:
            if self.job.req.return_tokens_as_token_ids:
                token = f"token_id:{token_id}"
            else:
                token = self.state.tokenizer.decode([token_id], skip_special_tokens=False)
            tokens.append(token)
            offsets.append(self.char_offset)
            self.char_offset += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": self.logprobs[start:],
            "top_logprobs": None,
            "text_offset": offsets,
        }

    def choice(self, *, text: str, start: int, with_prompt: bool) -> dict[str, Any]:
        want_ids = bool(self.job.req.return_token_ids)
        return {
            "index": self.index,
            "text": text,
            "logprobs": self.logprobs_block(start),
            "finish_reason": self.finish_reason,
            "stop_reason": self.stop_reason,
            "token_ids": self.token_ids[start:] if want_ids else None,
            "prompt_token_ids": self.job.prompt_ids if want_ids and with_prompt else None,
        }


def _usage(job: _Job, completion_tokens: int) -> dict[str, int]:
    prompt_tokens = len(job.prompt_ids)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


def _submit(
    state: EngineState,
    job: _Job,
    on_token: Callable[[int, int, float, str | None, str | None], None] | None,
    cancel: threading.Event,
) -> asyncio.Future[list[Completion]]:
    return asyncio.wrap_future(
        state.scheduler.submit(
            job.prompt_ids, job.params, on_token, cancel=cancel, detokenize=state.detokenize
        )
    )


async def _complete(state: EngineState, job: _Job) -> dict[str, Any]:
    completions: list[Completion] = await _submit(state, job, None, threading.Event())
    choices = []
    for i, comp in enumerate(completions):
        out = _ChoiceOutput(state, job, i)
        for k, (token_id, logprob) in enumerate(zip(comp.token_ids, comp.logprobs, strict=True)):
            last = k == len(comp.token_ids) - 1
            out.add(token_id, logprob, comp.finish_reason if last else None, comp.stop_str if last else None)
        choices.append(out.choice(text=out.text(), start=0, with_prompt=True))
    return {
        "id": job.request_id,
        "object": "text_completion",
        "created": job.created,
        "model": state.name,
        "choices": choices,
        "usage": _usage(job, sum(len(c.token_ids) for c in completions)),
    }


async def _stream(state: EngineState, job: _Job) -> AsyncIterator[str]:
    """SSE chunks, one per generated token per choice; a client disconnect cancels generation."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[int, int, float, str | None, str | None] | None] = asyncio.Queue()
    cancel = threading.Event()

    def on_token(index: int, token_id: int, logprob: float, finish: str | None, stop_str: str | None) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, (index, token_id, logprob, finish, stop_str))

    def on_done(fut: asyncio.Future[list[Completion]]) -> None:
        queue.put_nowait(None)
        if (
            not fut.cancelled()
            and fut.exception() is None
            and any(c.finish_reason == "abort" for c in fut.result())
        ):
            state.aborted += 1

    future = _submit(state, job, on_token, cancel)
    future.add_done_callback(on_done)
    outputs = [_ChoiceOutput(state, job, i) for i in range(job.params.n)]
    head = {"id": job.request_id, "object": "text_completion", "created": job.created, "model": state.name}
    try:
        while (item := await queue.get()) is not None:
            index, token_id, logprob, finish, stop_str = item
            out = outputs[index]
            out.add(token_id, logprob, finish, stop_str)
            start = len(out.token_ids) - 1
            choice = out.choice(text=out.text_delta(), start=start, with_prompt=start == 0)
            yield _sse({**head, "choices": [choice]})
        try:
            await future
        except Exception as exc:
            yield _sse(
                {"error": {"message": str(exc), "type": "InternalServerError", "param": None, "code": 500}}
            )
        else:
            options = job.req.stream_options
            if options is not None and options.include_usage:
                total = sum(len(o.token_ids) for o in outputs)
                yield _sse({**head, "choices": [], "usage": _usage(job, total)})
        yield _sse("[DONE]")
    finally:
        cancel.set()


def create_app(
    model_dir: str,
    *,
    served_model_name: str | None = None,
    device: str | None = None,
    prefix_cache_tokens: int | None = None,
    max_batch: int = 16,
    script: str | None = None,
    api_key: str | None = None,
    weights_root: str | None = None,
) -> FastAPI:
    """Load the model and tokenizer from ``model_dir`` (eagerly: /health is 200 once this returns).

    ``prefix_cache_tokens`` bounds the prefix cache (0: off; default: the model's context, at least
    ``DEFAULT_PREFIX_CACHE_TOKENS``, so that a real harness's 10-30k-token prompt is cached for its next turn
    and for the other attempts that share its system prompt), ``max_batch`` the rows decoded together (1: one
    request at a time); see ``Scheduler``. ``script``: a file of scripted completions to answer with
    (``inharness.engine.script``). ``api_key``: every route but /health needs it as a bearer token;
    ``weights_root``: load_weights only from under it (``inharness.engine.auth``).

    Long because the routes are closures over the one loaded engine state, defined together so the
    server's whole HTTP surface reads in one place; each route is a few lines.
    """
    state = _load(model_dir, served_model_name, device, prefix_cache_tokens, max_batch, script)
    app = FastAPI(title="inharness engine")
    app.state.engine = state
    auth.protect(app, api_key=api_key, weights_root=weights_root)

    @app.exception_handler(RequestValidationError)
    async def _on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        """FastAPI answers 422 by default; vLLM (and OpenAI clients) expect a 400 BadRequestError."""
        errors = list(exc.errors())
        fields = [[str(p) for p in e.get("loc", ()) if p != "body"] for e in errors]
        message = "; ".join(
            f"{'.'.join(loc) or 'body'}: {e.get('msg')}" for loc, e in zip(fields, errors, strict=True)
        )
        param = fields[0][0] if errors and fields[0] and errors[0].get("type") != "json_invalid" else None
        return _error(message or "invalid request", param)

    @app.exception_handler(BadRequest)
    async def _on_bad_request(request: Request, exc: BadRequest) -> JSONResponse:
        return _error(exc.message, exc.param)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": state.name,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "inharness",
                    "root": state.root,
                    "parent": None,
                    "max_model_len": state.max_model_len,
                    "permission": [],
                }
            ],
        }

    @app.post("/v1/inharness/load_weights")
    async def load_weights(req: LoadWeights) -> dict[str, Any]:
        """Swap in new weights (same architecture and tokenizer). Requests already generating finish
        on the weights they started with, later ones wait for them and then run on the new weights with
        an emptied prefix cache; the trainer pauses the gateway around this call so that no harness call
        straddles two versions."""
        auth.check_weights_path(req.path, weights_root)
        loop = asyncio.get_running_loop()
        try:
            model = await loop.run_in_executor(None, _load_model, req.path, state.device)
        except (OSError, ValueError) as exc:
            raise BadRequest(f"cannot load weights from {req.path}: {exc}", "path") from exc
        if model.config.vocab_size != state.model.config.vocab_size:
            raise BadRequest("the new weights have a different vocabulary size", "path")
        state.scheduler.load_model(model)
        state.model, state.root = model, req.path
        state.weight_loads += 1
        return {"loaded": req.path, "weight_loads": state.weight_loads}

    @app.post("/v1/completions", response_model=None)
    async def completions(req: CompletionRequest) -> JSONResponse | StreamingResponse:
        job = _prepare(state, req)
        state.requests += 1
        if req.stream:
            return StreamingResponse(_stream(state, job), media_type="text/event-stream")
        return JSONResponse(await _complete(state, job))

    return app


async def _serve_until_done(server: uvicorn.Server, host: str) -> None:
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            await task
            return
        await asyncio.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    print(f"engine ready on http://{host}:{port}", flush=True)
    await task


def serve(
    model_dir: str,
    host: str,
    port: int,
    served_model_name: str | None = None,
    threads: int | None = None,
    *,
    prefix_cache_tokens: int | None = None,
    max_batch: int = 16,
    script: str | None = None,
    api_key_file: str | None = None,
    weights_root: str | None = None,
) -> None:
    """Serve ``model_dir`` until interrupted; prints ``engine ready on http://H:P`` once listening.

    ``script`` (default: the file named by ``INHARNESS_ENGINE_SCRIPT``, so that `inharness run`, which
    starts the engine itself, can run it scripted) switches to scripted completions.
    ``api_key_file`` and ``weights_root`` (default: ``INHARNESS_ENGINE_API_KEY_FILE``,
    ``INHARNESS_ENGINE_WEIGHTS_ROOT``): see ``inharness.engine.auth``.

    ``threads`` sets torch's intra-op threads. Where other busy processes share the cores (harnesses and
    the gateway during `inharness run`), more than one makes each forward pass wait on a descheduled
    thread: a tiny model's request measured 13x slower with 2 threads than with 1 on 2 busy cores.
    """
    if threads is not None:
        torch.set_num_threads(threads)
    script = script or os.environ.get(SCRIPT_ENV) or None
    if script:
        print(f"engine answers with the scripted completions of {script}", flush=True)
    api_key, weights_root = auth.settings_from_env(api_key_file, weights_root)
    app = create_app(
        model_dir,
        served_model_name=served_model_name,
        prefix_cache_tokens=prefix_cache_tokens,
        max_batch=max_batch,
        script=script,
        api_key=api_key,
        weights_root=weights_root,
    )
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    asyncio.run(_serve_until_done(server, host))
