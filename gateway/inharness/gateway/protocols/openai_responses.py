"""OpenAI Responses (`POST /v1/responses`), as Codex CLI calls it: plain and streamed, with tools.

The request's `instructions` and `input` items (messages, `function_call`, `function_call_output`),
with the items of the responses that `previous_response_id` chains to, become one conversation;
a run of assistant-side items (an assistant message, its function calls) is one assistant turn,
as the chat template renders it. The answer's output items are built by `_OutputItems` from the
decoded choice, the same way for plain and streamed answers, so both carry the same items.

`previous_response_id` resolves against the calls the gateway recorded for the same attempt (the
response id is the recorded request id); responses made with `store: false` are not kept for it.
"""

import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import APIRouter, Request
from pydantic import TypeAdapter
from starlette.responses import Response

from inharness.gateway.calls import CallContext, Sampling
from inharness.gateway.conversation import Conversation, FunctionCall, Message, function_tool
from inharness.gateway.errors import APIError
from inharness.gateway.protocols.common import (
    CallRequest,
    ChoiceStream,
    Chunks,
    answer,
    harness_route,
    sse,
    track_sent,
)
from inharness.gateway.protocols.openai_responses_models import (
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionTool,
    InputItem,
    MessageItem,
    OtherItem,
    ResponsesRequest,
    part_text,
)
from inharness.gateway.store import AttemptAuth, Store
from inharness.gateway.toolcalls import ContentDelta, Event, ToolCall

PROTOCOL = "openai.responses"
router = APIRouter(route_class=harness_route(protocol=PROTOCOL))
_ITEMS = TypeAdapter(list[InputItem])
# How many responses a previous_response_id chain may reach back (one store read each).
MAX_CHAIN = 1000


@router.post("/v1/responses")
async def create_response(request: Request, req: ResponsesRequest) -> Response:
    svc = request.app.state.calls

    async def build(auth: AttemptAuth) -> CallRequest:
        history = await _history(svc.store, auth, req.previous_response_id)
        conv, notes = to_conversation(req, history)
        body = req.model_dump(mode="json", exclude_none=True)
        return CallRequest(conv, to_sampling(req), req.model, body, tuple(notes))

    return await answer(
        request,
        protocol=PROTOCOL,
        id_prefix="resp_",
        stream=req.stream,
        build=build,
        complete=lambda ctx: _complete(ctx, req),
        streamed=lambda ctx, chunks: _stream(ctx, req, chunks),
    )


def to_sampling(req: ResponsesRequest) -> Sampling:
    return Sampling(
        max_tokens=req.max_output_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        seed=req.seed,
    )


def to_conversation(req: ResponsesRequest, history: Sequence[Any] = ()) -> tuple[Conversation, list[str]]:
    """The conversation and the notes on what it leaves out. `history`: the items of the responses
    `previous_response_id` chains to (their inputs and outputs), oldest first."""
    notes: list[str] = []
    tools = []
    for i, t in enumerate(req.tools or []):
        if isinstance(t, FunctionTool):
            tools.append(function_tool(t.name, t.description, t.parameters, t.strict))
        else:
            notes.append(f"tools[{i}] of type '{t.type}' is left out of the prompt: the model cannot run it")
    messages: list[Message] = []
    if req.instructions:
        messages.append(Message("system", req.instructions))
    turn: tuple[list[str], list[FunctionCall]] | None = None  # the assistant turn being gathered

    def close_turn() -> None:
        nonlocal turn
        if turn is not None:
            messages.append(Message("assistant", "".join(turn[0]), tuple(turn[1])))
            turn = None

    items = [("previous_response_id", item) for item in history]
    items += [("input", item) for item in req.input_items()]
    for n, (where, item) in enumerate(items):
        index = n if where == "previous_response_id" else n - len(history)
        if isinstance(item, MessageItem) and item.role == "assistant":
            turn = turn or ([], [])
            turn[0].append(part_text(item.content))
        elif isinstance(item, FunctionCallItem):
            turn = turn or ([], [])
            turn[1].append(FunctionCall(item.name, item.arguments))
        elif isinstance(item, MessageItem):
            close_turn()
            messages.append(Message(item.role, part_text(item.content)))
        elif isinstance(item, FunctionCallOutputItem):
            close_turn()
            messages.append(Message("tool", part_text(item.output), tool_call_id=item.call_id))
        else:
            assert isinstance(item, OtherItem)
            notes.append(f"{where}[{index}] of type '{item.type}' is left out of the prompt")
    close_turn()
    if not any(m.role != "system" for m in messages):
        raise APIError(400, "input: the request has no input items to answer", param="input")
    return Conversation(tuple(messages), tuple(tools)), notes


async def _history(store: Store, auth: AttemptAuth, previous: str | None) -> list[Any]:
    """Input and output items of the chain of responses ending at `previous`, oldest first."""
    chain: list[list[Any]] = []
    while previous is not None:
        found = await store.call_bodies(auth.id, previous)
        request_body, response_body = found or (None, None)
        if found is not None and (request_body is None or response_body is None):
            raise APIError(
                400,
                f"previous_response_id: response '{previous}' was recorded by a gateway that keeps no "
                "bodies (--bodies none), so its conversation cannot be rebuilt: send the whole "
                "conversation as input instead",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        if request_body is None or response_body is None or response_body.get("object") != "response":
            raise APIError(
                400,
                f"previous_response_id: no response '{previous}' was made for this attempt",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        if request_body.get("store") is False:
            raise APIError(
                400,
                f"previous_response_id: response '{previous}' was made with store: false, so it was not kept",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        given = request_body.get("input", [])
        items = [{"role": "user", "content": given}] if isinstance(given, str) else list(given)
        chain.append(_ITEMS.validate_python(items + response_body.get("output", [])))
        if len(chain) > MAX_CHAIN:
            raise APIError(400, f"previous_response_id: a chain longer than {MAX_CHAIN} responses")
        previous = request_body.get("previous_response_id")
    return [item for items in reversed(chain) for item in items]


class _OutputItems:
    """The response's output items, built from a choice's decoded events; also the stream events
    that announce them (`sse_events`), numbered by `sequence_number` from `seq`."""

    def __init__(self, seq: int = 0) -> None:
        self.items: list[dict[str, Any]] = []
        self.seq = seq
        self._message: dict[str, Any] | None = None  # the message item being written

    def event(self, kind: str, **fields: Any) -> bytes:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse(body, event=kind)

    def feed(self, events: list[Event]) -> list[bytes]:
        out: list[bytes] = []
        for e in events:
            if isinstance(e, ContentDelta):
                out += self._text(e.text)
            else:
                out += self._close_message() + self._call(e)
        return out

    def finish(self, status: str) -> list[bytes]:
        return self._close_message(status)

    def _text(self, delta: str) -> list[bytes]:
        out = []
        where = {"output_index": len(self.items)}
        if self._message is None:
            self._message = {
                "id": "msg_" + uuid.uuid4().hex,
                "type": "message",
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
            out.append(self.event("response.output_item.added", item=dict(self._message), **where))
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            self._message["content"].append(part)
            out.append(
                self.event(
                    "response.content_part.added",
                    item_id=self._message["id"],
                    content_index=0,
                    part=dict(part),
                    **where,
                )
            )
        self._message["content"][0]["text"] += delta
        out.append(
            self.event(
                "response.output_text.delta",
                item_id=self._message["id"],
                content_index=0,
                delta=delta,
                logprobs=[],
                **where,
            )
        )
        return out

    def _close_message(self, status: str = "completed") -> list[bytes]:
        msg, self._message = self._message, None
        if msg is None:
            return []
        part = msg["content"][0]
        where = {"item_id": msg["id"], "output_index": len(self.items), "content_index": 0}
        out = [
            self.event("response.output_text.done", text=part["text"], logprobs=[], **where),
            self.event("response.content_part.done", part=part, **where),
        ]
        msg["status"] = status
        out.append(self.event("response.output_item.done", item=msg, output_index=len(self.items)))
        self.items.append(msg)
        return out

    def _call(self, call: ToolCall) -> list[bytes]:
        item = {
            "id": "fc_" + uuid.uuid4().hex,
            "type": "function_call",
            "status": "in_progress",
            "call_id": call.id,
            "name": call.name,
            "arguments": "",
        }
        where = {"item_id": item["id"], "output_index": len(self.items)}
        out = [self.event("response.output_item.added", item=dict(item), output_index=len(self.items))]
        out.append(self.event("response.function_call_arguments.delta", delta=call.arguments, **where))
        out.append(
            self.event(
                "response.function_call_arguments.done", arguments=call.arguments, name=call.name, **where
            )
        )
        item.update(arguments=call.arguments, status="completed")
        out.append(self.event("response.output_item.done", item=item, output_index=len(self.items)))
        self.items.append(item)
        return out


def _parse_tools(req: ResponsesRequest) -> bool:
    return req.tool_choice != "none" and bool(req.function_tools())


def _response(
    ctx: CallContext, req: ResponsesRequest, status: str, output: list[dict[str, Any]], usage: Any = None
) -> dict[str, Any]:
    """The Response object; `status` in_progress (stream start), completed or incomplete."""
    return {
        "id": ctx.request_id,
        "object": "response",
        "created_at": int(ctx.started_at),
        "status": status,
        "background": False,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "model": ctx.requested_model,
        "output": output,
        "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
        "previous_response_id": req.previous_response_id,
        "prompt_cache_key": req.prompt_cache_key,
        "reasoning": req.reasoning or {"effort": None, "summary": None},
        "store": req.store is not False,
        "temperature": ctx.sampling.temperature,
        "text": {"format": {"type": "text"}},
        "tool_choice": req.tool_choice or "auto",
        "tools": [t.model_dump(mode="json", exclude_none=True) for t in req.tools or []],
        "top_p": ctx.sampling.top_p,
        "truncation": "disabled",
        "usage": usage,
        "metadata": req.metadata or {},
    }


def _usage(ctx: CallContext, completion: int) -> dict[str, Any]:
    prompt = len(ctx.prompt.ids)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def _status(s: ChoiceStream) -> str:
    return "incomplete" if s.output.finish_reason == "length" else "completed"


async def _complete(ctx: CallContext, req: ResponsesRequest) -> dict[str, Any]:
    (output,) = await ctx.complete()
    s = ChoiceStream(ctx, 0, parse_tools=_parse_tools(req))
    items = _OutputItems()  # built as a stream would build them, its events unused
    items.feed(s.events(output.token_ids, output.logprobs, output.finish_reason))
    items.finish(_status(s))
    body = _response(ctx, req, _status(s), items.items, _usage(ctx, len(output.token_ids)))
    await ctx.record([s.output], [s.reply()], body)
    return body


async def _stream(ctx: CallContext, req: ResponsesRequest, chunks: Chunks) -> AsyncIterator[bytes]:
    items = _OutputItems()
    yield items.event("response.created", response=_response(ctx, req, "in_progress", []))
    yield items.event("response.in_progress", response=_response(ctx, req, "in_progress", []))
    s = ChoiceStream(ctx, 0, parse_tools=_parse_tools(req))
    track_sent(ctx, [s], parse_tools=_parse_tools(req))
    try:
        async for _, ids, lps, finish in chunks:
            for event in items.feed(s.events(ids, lps, finish)):
                yield event
            s.mark_sent()
    except APIError as exc:
        yield _error_event(items, exc)
        return
    status = _status(s)
    for event in items.finish(status):
        yield event
    body = _response(ctx, req, status, items.items, _usage(ctx, len(s.output.token_ids)))
    try:
        await ctx.record([s.output], [s.reply()], body)
    except APIError as exc:  # dropped: the attempt ended while the call ran
        yield _error_event(items, exc)
        return
    yield items.event(f"response.{status}", response=body)


def _error_event(items: "_OutputItems", exc: APIError) -> bytes:
    """OpenAI's error event; the SDK raises what `error` says."""
    error = {"code": exc.code, "message": exc.message, "param": exc.param}
    return items.event("error", error={"type": "server_error", **error}, **error)
