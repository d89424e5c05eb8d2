"""The protocol-neutral conversation a call is asked with, and its digests.

A digest chain over (tools, message 1, message 2, ...) identifies every prefix of a conversation.
A recorded call stores the digest of its request and of its request plus its reply; a later turn
whose messages extend that reply finds its parent call by digest and reuses its token ids exactly.
Digests cover what the chat template renders (role, text, tool calls' names and arguments) and
ignore what it does not (tool-call ids, SDK extras), so an SDK's echo of the reply still matches.
"""

import hashlib
import json
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import orjson
from jsonschema import Draft202012Validator, SchemaError

TURNS_ROOT = "turns"  # where a turns chain (Conversation.turns_chain) starts


@dataclass(frozen=True, slots=True)
class FunctionCall:
    name: str
    arguments: str  # JSON text


@dataclass(frozen=True, slots=True)
class Message:
    role: str
    content: str
    tool_calls: tuple[FunctionCall, ...] = ()
    tool_call_id: str | None = None

    def for_template(self) -> dict[str, Any]:
        """The message as a chat template (Qwen / Hermes style) expects it."""
        out: dict[str, Any] = {
            "role": "system" if self.role == "developer" else self.role,
            "content": self.content,
        }
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    "type": "function",
                    "function": {"name": c.name, "arguments": _arguments_for_template(c.arguments)},
                }
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out

    @property
    def is_system(self) -> bool:
        return self.role in ("system", "developer")

    def canonical(self) -> str:
        calls = [[c.name, _canonical_json(c.arguments)] for c in self.tool_calls]
        role = "system" if self.role == "developer" else self.role
        return json.dumps([role, self.content, calls], ensure_ascii=False, separators=(",", ":"))


@dataclass(frozen=True, slots=True)
class Conversation:
    messages: tuple[Message, ...]
    tools: tuple[dict[str, Any], ...] = field(default=())  # `function_tool` definitions

    def size(self) -> int:
        """Characters of text the chat template will render (messages, tool-call arguments, tools):
        how much CPU building its prompt costs."""
        text = sum(len(m.content) + sum(len(c.arguments) for c in m.tool_calls) for m in self.messages)
        return text + len(json.dumps(self.tools)) if self.tools else text

    def template_messages(self, upto: int | None = None) -> list[dict[str, Any]]:
        return [m.for_template() for m in self.messages[:upto]]

    def digest_chain(self) -> list[str]:
        """chain[k] identifies (tools, messages[:k]); len(chain) == len(messages) + 1."""
        chain = [_digest("tools", json.dumps(self.tools, sort_keys=True, ensure_ascii=False))]
        for m in self.messages:
            chain.append(_digest(chain[-1], m.canonical()))
        return chain

    def turns_chain(self) -> list[tuple[int, str]]:
        """The digest chain of the turns alone, without system messages and tools: (k, digest of the
        non-system messages among messages[:k]) for every k after a non-system message. A call whose
        turns extend an earlier reply's although its full chain does not kept the history and changed
        its system prompt or tools."""
        chain: list[tuple[int, str]] = []
        tip = TURNS_ROOT
        for k, m in enumerate(self.messages, start=1):
            if not m.is_system:
                tip = _digest(tip, m.canonical())
                chain.append((k, tip))
        return chain


def function_tool(
    name: str, description: str | None, parameters: dict[str, Any] | None, strict: bool | None = None
) -> dict[str, Any]:
    """A tool the model may call, as the chat template renders it (OpenAI Chat's tool object): every
    protocol's tool definitions become this, so the same tools render the same prompt."""
    function: dict[str, Any] = {"name": name}
    if description is not None:
        function["description"] = description
    if parameters is not None:
        function["parameters"] = parameters
    if strict is not None:
        function["strict"] = strict
    return {"type": "function", "function": function}


def parameters_problem(schema: dict[str, Any]) -> str | None:
    """Why a tool's parameters schema is not usable, or None."""
    return _schema_problem(json.dumps(schema, sort_keys=True))


@lru_cache(maxsize=1024)
def _schema_problem(schema_json: str) -> str | None:
    """Cached, since harnesses send the same tools with every call and checking a schema costs far
    more than the rest of the request."""
    schema = json.loads(schema_json)
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        return f"parameters is not a valid JSON Schema: {exc.message}"
    if schema.get("type", "object") != "object":
        return "parameters must be a JSON Schema of type 'object'"
    return None


def extend_digest(chain_tip: str, reply: Message) -> str:
    """The digest of a conversation after `reply` was appended to the one ending at `chain_tip`."""
    return _digest(chain_tip, reply.canonical())


def _digest(prev: str, item: str) -> str:
    return hashlib.blake2b(f"{prev}\x00{item}".encode(), digest_size=16).hexdigest()


def _canonical_json(text: str) -> str:
    """Tool-call arguments with their keys sorted, if they are JSON (orjson's reading: no NaN, no lone
    surrogate, which could not be hashed as UTF-8), else the text as it is."""
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError:
        return text
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def _arguments_for_template(text: str) -> Any:
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return text
