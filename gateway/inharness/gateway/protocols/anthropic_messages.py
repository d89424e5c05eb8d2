"""Anthropic Messages (`POST /v1/messages`, `POST /v1/messages/count_tokens`), as Claude Code calls it.

`system` and the messages become one conversation: an assistant message's text and `tool_use` blocks
are one assistant turn with tool calls, a user message's `tool_result` blocks are tool messages
(before its text, in block order), `thinking` blocks the harness echoes are left out (the model
produced none). The answer's content blocks are built by `_Blocks` from the decoded choice, the same
way for plain and streamed answers. Errors are in Anthropic's format (`errors.protocol_route`);
the key comes as `x-api-key` or `Authorization: Bearer`.
"""

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from inharness.gateway.calls import CallContext, CallService, Sampling
from inharness.gateway.conversation import Conversation, FunctionCall, Message, function_tool
from inharness.gateway.errors import APIError, anthropic_error_body, anthropic_error_response, parse_json
from inharness.gateway.protocols.anthropic_models import (
    CountTokensRequest,
    CustomTool,
    MessagesRequest,
    OtherBlock,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from inharness.gateway.protocols.common import (
    CallRequest,
    ChoiceStream,
    Chunks,
    answer,
    attempt_key,
    harness_route,
    sse,
    track_sent,
)
from inharness.gateway.store import AttemptAuth
from inharness.gateway.toolcalls import ContentDelta, Event, ToolCall

PROTOCOL = "anthropic.messages"
router = APIRouter(route_class=harness_route(anthropic_error_response, protocol=PROTOCOL))


@router.post("/v1/messages")
async def create_message(request: Request, req: MessagesRequest) -> Response:
    async def build(_auth: AttemptAuth) -> CallRequest:
        conv, notes = to_conversation(req)
        body = req.model_dump(mode="json", exclude_none=True)
        return CallRequest(conv, to_sampling(req), req.model, body, tuple(notes))

    return await answer(
        request,
        protocol=PROTOCOL,
        id_prefix="msg_",
        stream=req.stream,
        build=build,
        complete=lambda ctx: _complete(ctx, req),
        streamed=lambda ctx, chunks: _stream(ctx, req, chunks),
    )


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request, req: CountTokensRequest) -> Response:
    """The prompt's length as the gateway would tokenise it for a first turn; nothing is recorded."""
    svc: CallService = request.app.state.calls
    await svc.authenticate(attempt_key(request))
    conv, _ = to_conversation(req)
    ids = await svc.prompts.first_turn_ids(conv)
    return Response(json.dumps({"input_tokens": len(ids)}), media_type="application/json")


def to_sampling(req: MessagesRequest) -> Sampling:
    return Sampling(
        max_tokens=req.max_tokens,  # the call path clamps it to the context left
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        seed=req.seed,
        stop=tuple(req.stop_sequences or ()),
    )


def to_conversation(req: CountTokensRequest) -> tuple[Conversation, list[str]]:
    """The conversation and the notes on what it leaves out."""
    notes: list[str] = []
    tools = []
    for i, t in enumerate(req.tools or []):
        if isinstance(t, CustomTool):
            tools.append(function_tool(t.name, t.description, t.input_schema))
        else:
            notes.append(f"tools[{i}] of type '{t.type}' is left out of the prompt: the model cannot run it")
    messages: list[Message] = []
    if req.system:
        messages.append(Message("system", req.system_text()))
    for i, m in enumerate(req.messages):
        texts: list[str] = []
        calls: list[FunctionCall] = []
        for j, b in enumerate(m.blocks()):
            if isinstance(b, TextBlock):
                texts.append(b.text)
            elif isinstance(b, ToolUseBlock) and m.role == "assistant":
                calls.append(FunctionCall(b.name, json.dumps(b.input, ensure_ascii=False)))
            elif isinstance(b, ToolResultBlock) and m.role == "user":
                if texts:
                    messages.append(Message("user", "".join(texts)))
                    texts = []
                messages.append(Message("tool", b.text(), tool_call_id=b.tool_use_id))
            elif isinstance(b, ThinkingBlock | RedactedThinkingBlock) and m.role == "assistant":
                notes.append(f"messages[{i}].content[{j}]: {b.type} is left out of the prompt")
            else:
                assert isinstance(b, OtherBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock)
                notes.append(f"messages[{i}].content[{j}] of type '{b.type}' is left out of the prompt")
        if m.role == "assistant":
            messages.append(Message("assistant", "".join(texts), tuple(calls)))
        elif texts:
            messages.append(Message("user", "".join(texts)))
    return Conversation(tuple(messages), tuple(tools)), notes


def _input(call: ToolCall) -> dict[str, Any]:
    """A tool call's arguments as the `input` object, parsed as strictly as a request body (the
    model's text may hold NaN, lone surrogates or deep nesting, which no reader could give back)."""
    try:
        value = parse_json(call.arguments.encode(errors="surrogatepass"))
    except APIError:
        value = call.arguments
    return value if isinstance(value, dict) else {"arguments": value}


class _Blocks:
    """The answer's content blocks, built from a choice's decoded events; also the stream events
    that announce them."""

    def __init__(self) -> None:
        self.content: list[dict[str, Any]] = []
        self._text_open = False

    def feed(self, events: list[Event]) -> list[bytes]:
        out: list[bytes] = []
        for e in events:
            if isinstance(e, ContentDelta):
                if not self._text_open:
                    self.content.append({"type": "text", "text": ""})
                    self._text_open = True
                    out.append(
                        _event("content_block_start", index=self._index, content_block=self.content[-1])
                    )
                self.content[-1]["text"] += e.text
                delta = {"type": "text_delta", "text": e.text}
                out.append(_event("content_block_delta", index=self._index, delta=delta))
            else:
                out += self.finish()
                block = {"type": "tool_use", "id": "toolu_" + e.id.removeprefix("call_"), "name": e.name}
                out.append(
                    _event(
                        "content_block_start", index=len(self.content), content_block={**block, "input": {}}
                    )
                )
                delta = {"type": "input_json_delta", "partial_json": e.arguments}
                out.append(_event("content_block_delta", index=len(self.content), delta=delta))
                out.append(_event("content_block_stop", index=len(self.content)))
                self.content.append({**block, "input": _input(e)})
        return out

    def finish(self) -> list[bytes]:
        if not self._text_open:
            return []
        self._text_open = False
        return [_event("content_block_stop", index=self._index)]

    @property
    def _index(self) -> int:
        return len(self.content) - 1


def _event(kind: str, **fields: Any) -> bytes:
    return sse({"type": kind, **fields}, event=kind)


def _parse_tools(req: MessagesRequest) -> bool:
    return not (req.tool_choice and req.tool_choice.type == "none") and bool(req.custom_tools())


def _stop(s: ChoiceStream) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished choice."""
    if s.output.finish_reason == "length":
        return "max_tokens", None
    if s.tool_calls:
        return "tool_use", None
    if s.decoder.stopped_by is not None:
        return "stop_sequence", s.decoder.stopped_by
    return "end_turn", None


def _usage(ctx: CallContext, output_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": len(ctx.prompt.ids),
        "output_tokens": output_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }


def _message(
    ctx: CallContext, content: list[dict[str, Any]], stop: tuple[str | None, str | None]
) -> dict[str, Any]:
    return {
        "id": ctx.request_id,
        "type": "message",
        "role": "assistant",
        "model": ctx.requested_model,
        "content": content,
        "stop_reason": stop[0],
        "stop_sequence": stop[1],
    }


async def _complete(ctx: CallContext, req: MessagesRequest) -> dict[str, Any]:
    (output,) = await ctx.complete()
    s = ChoiceStream(ctx, 0, parse_tools=_parse_tools(req))
    blocks = _Blocks()  # built as a stream would build them, its events unused
    blocks.feed(s.events(output.token_ids, output.logprobs, output.finish_reason))
    body = {**_message(ctx, blocks.content, _stop(s)), "usage": _usage(ctx, len(output.token_ids))}
    await ctx.record([s.output], [s.reply()], body)
    return body


async def _stream(ctx: CallContext, req: MessagesRequest, chunks: Chunks) -> AsyncIterator[bytes]:
    start = {**_message(ctx, [], (None, None)), "usage": _usage(ctx, 0)}
    yield _event("message_start", message=start)
    yield _event("ping")
    s = ChoiceStream(ctx, 0, parse_tools=_parse_tools(req))
    track_sent(ctx, [s], parse_tools=_parse_tools(req))
    blocks = _Blocks()
    try:
        async for _, ids, lps, finish in chunks:
            for event in blocks.feed(s.events(ids, lps, finish)):
                yield event
            s.mark_sent()
    except APIError as exc:
        yield sse(anthropic_error_body(exc.status, exc.message)[1], event="error")
        return
    for event in blocks.finish():
        yield event
    stop = _stop(s)
    usage = _usage(ctx, len(s.output.token_ids))
    try:
        await ctx.record([s.output], [s.reply()], {**_message(ctx, blocks.content, stop), "usage": usage})
    except APIError as exc:  # dropped: the attempt ended while the call ran
        yield sse(anthropic_error_body(exc.status, exc.message)[1], event="error")
        return
    yield _event(
        "message_delta",
        delta={"stop_reason": stop[0], "stop_sequence": stop[1]},
        usage={"output_tokens": usage["output_tokens"]},
    )
    yield _event("message_stop")
