"""OpenAI Chat Completions, as unmodified harnesses call it (plain and streamed, with tool calls).

Mounted twice: at `/v1/...` with the attempt's key in `Authorization: Bearer`, and at
`/t/{key}/v1/...` for harnesses that can set a base URL but not a key.
"""

from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response

from inharness.gateway.calls import CallContext, CallService, Output, Sampling
from inharness.gateway.conversation import Conversation, FunctionCall, Message
from inharness.gateway.errors import APIError, error_body
from inharness.gateway.protocols.common import (
    CallRequest,
    ChoiceStream,
    Chunks,
    answer,
    decode,
    harness_route,
    sse,
    track_sent,
)
from inharness.gateway.protocols.openai_models import ChatCompletionRequest
from inharness.gateway.store import AttemptAuth
from inharness.gateway.toolcalls import ContentDelta, ToolCall

PROTOCOL = "openai.chat"
router = APIRouter(route_class=harness_route(protocol=PROTOCOL))


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

    async def build(_auth: AttemptAuth) -> CallRequest:
        body = req.model_dump(mode="json", exclude_none=True)
        return CallRequest(to_conversation(req), to_sampling(req), req.model, body)

    return await answer(
        request,
        protocol=PROTOCOL,
        id_prefix="chatcmpl-",
        stream=req.stream,
        build=build,
        complete=lambda ctx: _complete(svc, ctx, req),
        streamed=lambda ctx, chunks: _stream(svc, ctx, req, chunks),
    )


async def _complete(svc: CallService, ctx: CallContext, req: ChatCompletionRequest) -> dict[str, Any]:
    outputs = await ctx.complete()
    parse_tools = req.tool_choice != "none" and bool(req.tools)
    choices, replies = [], []
    for o in outputs:
        d = decode(ctx, o, parse_tools=parse_tools)
        message: dict[str, Any] = {"role": "assistant", "content": d.text, "refusal": None}
        if d.tool_calls:
            message["tool_calls"] = [_tool_call_json(None, c) for c in d.tool_calls]
        choice: dict[str, Any] = {
            "index": o.index,
            "message": message,
            "finish_reason": _finish(o, bool(d.tool_calls)),
            "logprobs": _logprobs(svc, o.token_ids, o.logprobs) if req.logprobs else None,
        }
        choices.append(choice)
        replies.append(d.reply())
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


async def _stream(
    svc: CallService, ctx: CallContext, req: ChatCompletionRequest, chunks: Chunks
) -> AsyncIterator[bytes]:
    parse_tools = req.tool_choice != "none" and bool(req.tools)
    head = {
        "id": ctx.request_id,
        "object": "chat.completion.chunk",
        "created": int(ctx.started_at),
        "model": ctx.requested_model,
        "system_fingerprint": f"inharness-v{ctx.version}",
    }

    def chunk(index: int, delta: dict[str, Any], logprobs: Any = None, finish: str | None = None) -> bytes:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return sse({**head, "choices": [choice]})

    states = [ChoiceStream(ctx, i, parse_tools=parse_tools) for i in range(ctx.sampling.n)]
    track_sent(ctx, states, parse_tools=parse_tools)
    for s in states:
        yield chunk(s.output.index, {"role": "assistant", "content": ""})
    try:
        async for index, ids, lps, finish in chunks:
            s = states[index]
            deltas = []
            for e in s.events(ids, lps, finish):
                if isinstance(e, ContentDelta):
                    deltas.append({"content": e.text})
                else:
                    k = s.tool_calls.index(e)
                    deltas.append({"tool_calls": [_tool_call_json(k, e)]})
            lp = _logprobs(svc, ids, lps) if req.logprobs else None
            if lp is not None and not deltas:
                deltas.append({"content": ""})
            for n, d in enumerate(deltas):
                yield chunk(index, d, lp if n == 0 else None)
            s.mark_sent()
    except APIError as exc:
        yield sse(error_body(exc.status, exc.message, code=exc.code))
        return
    outputs = [s.output for s in states]
    try:
        await ctx.record(outputs, [s.reply() for s in states], _assembled(ctx, states, outputs))
    except APIError as exc:  # dropped: the attempt ended while the call ran
        yield sse(error_body(exc.status, exc.message, code=exc.code))
        return
    for s in states:
        yield chunk(s.output.index, {}, finish=_finish(s.output, bool(s.tool_calls)))
    if req.stream_options and req.stream_options.include_usage:
        yield sse({**head, "choices": [], "usage": _usage(ctx, outputs)})
    yield b"data: [DONE]\n\n"


def _assembled(ctx: CallContext, states: list[ChoiceStream], outputs: list[Output]) -> dict[str, Any]:
    """The non-streaming body equivalent to a streamed answer, for the record."""
    choices = []
    for s in states:
        message: dict[str, Any] = {"role": "assistant", "content": s.text, "refusal": None}
        if s.tool_calls:
            message["tool_calls"] = [_tool_call_json(None, c) for c in s.tool_calls]
        choices.append(
            {
                "index": s.output.index,
                "message": message,
                "finish_reason": _finish(s.output, bool(s.tool_calls)),
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
