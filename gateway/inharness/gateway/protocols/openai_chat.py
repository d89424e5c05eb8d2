"""OpenAI Chat Completions, as unmodified harnesses call it (plain and streamed, with tool calls).

Mounted twice: at `/v1/...` with the attempt's key in `Authorization: Bearer`, and at
`/t/{key}/v1/...` for harnesses that can set a base URL but not a key.
"""

import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from typing import Any

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response, StreamingResponse

from inharness.gateway.calls import CallContext, CallService, Output, Sampling, TextDecoder
from inharness.gateway.conversation import Conversation, FunctionCall, Message
from inharness.gateway.errors import APIError, error_body
from inharness.gateway.protocols.openai_models import ChatCompletionRequest
from inharness.gateway.toolcalls import ContentDelta, Event, ToolCall, ToolCallParser, parse_all

PROTOCOL = "openai.chat"
router = APIRouter()


def attempt_key(request: Request) -> str | None:
    """The attempt's key: from the `/t/{key}` prefix, else `Authorization: Bearer`."""
    if "token" in request.path_params:
        return request.path_params["token"]
    header = request.headers.get("authorization", "")
    scheme, _, value = header.partition(" ")
    return value.strip() if scheme.lower() == "bearer" and value.strip() else None


def to_conversation(req: ChatCompletionRequest) -> Conversation:
    messages = []
    for m in req.messages:
        calls = tuple(
            FunctionCall(
                c.function.name,
                c.function.arguments
                if isinstance(c.function.arguments, str)
                else orjson.dumps(c.function.arguments).decode(),
            )
            for c in m.tool_calls or []
        )
        messages.append(Message(m.role, m.text(), calls, m.tool_call_id))
    tools = tuple(t.model_dump(exclude_none=True) for t in req.tools or [])
    return Conversation(tuple(messages), tools)


def to_sampling(req: ChatCompletionRequest) -> Sampling:
    return Sampling(
        max_tokens=req.max_completion_tokens or req.max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        seed=req.seed,
        n=req.n,
        stop=tuple(req.stop_list()),
    )


def _reply(content: str | None, calls: list[ToolCall]) -> Message:
    return Message("assistant", content or "", tuple(FunctionCall(c.name, c.arguments) for c in calls))


def _tool_call_json(index: int | None, c: ToolCall) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": c.id,
        "type": "function",
        "function": {"name": c.name, "arguments": c.arguments},
    }
    return out if index is None else {"index": index, **out}


def _finish(o: Output, has_tool_calls: bool) -> str:
    return "tool_calls" if has_tool_calls and o.finish_reason == "stop" else o.finish_reason


def _logprobs(svc: CallService, ids: list[int], lps: list[float]) -> dict[str, Any]:
    content = []
    for i, lp in zip(ids, lps, strict=False):
        tok = svc.tokenizer.decode([i], skip_special_tokens=False)
        content.append({"token": tok, "logprob": lp, "bytes": list(tok.encode()), "top_logprobs": []})
    return {"content": content}


def _usage(ctx: CallContext, outputs: list[Output]) -> dict[str, int]:
    completion = sum(len(o.token_ids) for o in outputs)
    return {
        "prompt_tokens": len(ctx.prompt.ids),
        "completion_tokens": completion,
        "total_tokens": len(ctx.prompt.ids) + completion,
    }


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    name = request.app.state.served_model_name
    body = {
        "object": "list",
        "data": [{"id": name, "object": "model", "created": 0, "owned_by": "inharness"}],
    }
    return Response(orjson.dumps(body), media_type="application/json")


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, req: ChatCompletionRequest) -> Response:
    svc: CallService = request.app.state.calls
    metrics = svc.metrics
    started = time.perf_counter()
    status = "error"
    try:
        auth = await svc.authenticate(attempt_key(request))
        conv = to_conversation(req)
        opened = svc.call(
            auth,
            conv,
            to_sampling(req),
            protocol=PROTOCOL,
            requested_model=req.model,
            request_body=req.model_dump(mode="json", exclude_none=True),
        )
        if req.stream:
            stack = AsyncExitStack()
            try:
                ctx = await stack.enter_async_context(opened)
                chunks = await ctx.open_stream()
            except BaseException:
                await stack.aclose()
                raise
            status = "ok"
            return StreamingResponse(
                _stream(svc, ctx, req, chunks, stack, started), media_type="text/event-stream"
            )
        async with opened as ctx:
            body = await _complete(svc, ctx, req)
        status = "ok"
        return Response(orjson.dumps(body), media_type="application/json")
    except APIError as exc:
        status = str(exc.status)
        raise
    finally:
        metrics.requests.labels(PROTOCOL, status).inc()
        if not req.stream:
            metrics.latency.labels(PROTOCOL).observe(time.perf_counter() - started)


async def _complete(svc: CallService, ctx: CallContext, req: ChatCompletionRequest) -> dict[str, Any]:
    outputs = await ctx.complete()
    parse_tools = req.tool_choice != "none" and bool(req.tools)
    choices, replies = [], []
    for o in outputs:
        decoder = TextDecoder(svc.tokenizer, ctx.sampling.stop)
        content, calls = parse_all(decoder.feed(o.token_ids) + decoder.finish(), parse_tools=parse_tools)
        message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
        if calls:
            message["tool_calls"] = [_tool_call_json(None, c) for c in calls]
        choice: dict[str, Any] = {
            "index": o.index,
            "message": message,
            "finish_reason": _finish(o, bool(calls)),
            "logprobs": _logprobs(svc, o.token_ids, o.logprobs) if req.logprobs else None,
        }
        choices.append(choice)
        replies.append(_reply(content, calls))
    body = {
        "id": ctx.request_id,
        "object": "chat.completion",
        "created": int(ctx.started_at),
        "model": ctx.requested_model,
        "system_fingerprint": f"inharness-v{ctx.version}",
        "choices": choices,
        "usage": _usage(ctx, outputs),
    }
    await ctx.record(outputs, replies, body)
    return body


class _ChoiceStream:
    """Per-choice state of a streamed answer: decoder, tool-call parser, what was sent."""

    def __init__(self, svc: CallService, ctx: CallContext, index: int, parse_tools: bool) -> None:
        self.output = Output(index)
        self.decoder = TextDecoder(svc.tokenizer, ctx.sampling.stop)
        self.parser = ToolCallParser(parse_tools=parse_tools)
        self.content: list[str] = []
        self.done = False

    def events(self, ids: list[int], lps: list[float], finish: str | None) -> list[Event]:
        self.output.token_ids += ids
        self.output.logprobs += lps
        events = self.parser.feed(self.decoder.feed(ids))
        if finish is not None:
            self.output.finish_reason = finish
            events += self.parser.feed(self.decoder.finish()) + self.parser.finish()
            self.done = True
        for e in events:
            if isinstance(e, ContentDelta):
                self.content.append(e.text)
        return events


async def _stream(
    svc: CallService,
    ctx: CallContext,
    req: ChatCompletionRequest,
    chunks: AsyncIterator[tuple[int, list[int], list[float], str | None]],
    stack: AsyncExitStack,
    started: float,
) -> AsyncIterator[bytes]:
    parse_tools = req.tool_choice != "none" and bool(req.tools)
    head = {
        "id": ctx.request_id,
        "object": "chat.completion.chunk",
        "created": int(ctx.started_at),
        "model": ctx.requested_model,
        "system_fingerprint": f"inharness-v{ctx.version}",
    }

    def event(body: dict[str, Any]) -> bytes:
        return b"data: " + orjson.dumps(body) + b"\n\n"

    def sse(index: int, delta: dict[str, Any], logprobs: Any = None, finish: str | None = None) -> bytes:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return event({**head, "choices": [choice]})

    states = [_ChoiceStream(svc, ctx, i, parse_tools) for i in range(ctx.sampling.n)]
    try:
        for s in states:
            yield sse(s.output.index, {"role": "assistant", "content": ""})
        try:
            async for index, ids, lps, finish in chunks:
                s = states[index]
                deltas = []
                for e in s.events(ids, lps, finish):
                    if isinstance(e, ContentDelta):
                        deltas.append({"content": e.text})
                    else:
                        k = s.parser.tool_calls.index(e)
                        deltas.append({"tool_calls": [_tool_call_json(k, e)]})
                lp = _logprobs(svc, ids, lps) if req.logprobs else None
                if lp is not None and not deltas:
                    deltas.append({"content": ""})
                for n, d in enumerate(deltas):
                    yield sse(index, d, lp if n == 0 else None)
        except APIError as exc:
            yield event(error_body(exc.status, exc.message, code=exc.code))
            return
        outputs = [s.output for s in states]
        replies = [_reply("".join(s.content) or None, s.parser.tool_calls) for s in states]
        await ctx.record(outputs, replies, _assembled(ctx, states, outputs))
        for s in states:
            yield sse(s.output.index, {}, finish=_finish(s.output, bool(s.parser.tool_calls)))
        if req.stream_options and req.stream_options.include_usage:
            yield event({**head, "choices": [], "usage": _usage(ctx, outputs)})
        yield b"data: [DONE]\n\n"
    finally:
        await stack.aclose()
        svc.metrics.latency.labels(PROTOCOL).observe(time.perf_counter() - started)


def _assembled(ctx: CallContext, states: list[_ChoiceStream], outputs: list[Output]) -> dict[str, Any]:
    """The non-streaming body equivalent to a streamed answer, for the record."""
    choices = []
    for s in states:
        message: dict[str, Any] = {
            "role": "assistant",
            "content": "".join(s.content) or None,
            "refusal": None,
        }
        if s.parser.tool_calls:
            message["tool_calls"] = [_tool_call_json(None, c) for c in s.parser.tool_calls]
        choices.append(
            {
                "index": s.output.index,
                "message": message,
                "finish_reason": _finish(s.output, bool(s.parser.tool_calls)),
            }
        )
    return {
        "id": ctx.request_id,
        "object": "chat.completion",
        "created": int(ctx.started_at),
        "model": ctx.requested_model,
        "choices": choices,
        "usage": _usage(ctx, outputs),
    }
