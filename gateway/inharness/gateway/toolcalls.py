"""Tool calls in the Hermes / Qwen convention: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

One incremental parser serves both streaming and non-streaming answers, so the two are identical
by construction: the non-streaming answer is the parser fed the whole text at once.
"""

import json
import secrets
from dataclasses import dataclass

import orjson

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


@dataclass(frozen=True, slots=True)
class ContentDelta:
    text: str


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON text, as OpenAI's API carries it


Event = ContentDelta | ToolCall


def _parse_block(body: str) -> ToolCall | None:
    """A block is a tool call only if its JSON is one every reader can round-trip: orjson refuses
    what the model may write but no answer could carry (lone surrogates, NaN), and such a block
    stays text."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return ToolCall(id="call_" + secrets.token_hex(12), name=obj["name"], arguments=arguments)


class ToolCallParser:
    """Feed decoded text as it grows; get content deltas and complete tool calls.

    Content is the text outside valid tool-call blocks with surrounding whitespace stripped; a block
    that is not valid JSON, or is never closed, stays in the content verbatim.
    """

    def __init__(self, *, parse_tools: bool = True) -> None:
        self._parse_tools = parse_tools
        self._buf = ""  # text not yet classified
        self._in_block = False
        self._pending_ws = ""  # whitespace held until non-whitespace content follows
        self._started = False  # has any content been emitted
        self.tool_calls: list[ToolCall] = []

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        events: list[Event] = []
        while True:
            if not self._parse_tools:
                self._emit(self._buf, events)
                self._buf = ""
                return events
            if self._in_block:
                end = self._buf.find(CLOSE)
                if end < 0:
                    return events
                body = self._buf[:end]
                self._buf = self._buf[end + len(CLOSE) :]
                self._in_block = False
                call = _parse_block(body.strip())
                if call is None:
                    self._emit(OPEN + body + CLOSE, events)
                else:
                    self.tool_calls.append(call)
                    events.append(call)
                continue
            start = self._buf.find(OPEN)
            if start >= 0:
                self._emit(self._buf[:start], events)
                self._buf = self._buf[start + len(OPEN) :]
                self._in_block = True
                continue
            keep = _partial_suffix(self._buf, OPEN)
            self._emit(self._buf[: len(self._buf) - keep], events)
            self._buf = self._buf[len(self._buf) - keep :]
            return events

    def finish(self) -> list[Event]:
        events: list[Event] = []
        rest = (OPEN + self._buf) if self._in_block else self._buf
        self._buf, self._in_block = "", False
        self._emit(rest, events)
        return events

    def _emit(self, text: str, events: list[Event]) -> None:
        if not text:
            return
        stripped = text.rstrip()
        if not stripped:
            if self._started:
                self._pending_ws += text
            return
        trailing = text[len(stripped) :]
        if not self._started:
            stripped = stripped.lstrip()
            out = stripped
        else:
            out = self._pending_ws + stripped
        self._pending_ws = trailing
        self._started = True
        events.append(ContentDelta(out))


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def parse_all(text: str, *, parse_tools: bool = True) -> tuple[str | None, list[ToolCall]]:
    """Content and tool calls of a complete answer."""
    parser = ToolCallParser(parse_tools=parse_tools)
    events = parser.feed(text) + parser.finish()
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    return (content or None), parser.tool_calls
