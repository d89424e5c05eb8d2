"""Request bodies of Anthropic's Messages API, as far as the gateway reads them (what Claude Code sends).

Unknown fields are accepted and recorded (`thinking`, `context_management`, `output_config`,
`metadata`, ...). Content blocks and tools of types the model cannot take (server tools, their
results) are accepted and left out of the prompt with a note; images and documents are refused
until the served model reads them.
"""

import re
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from inharness.gateway.conversation import parameters_problem
from inharness.gateway.protocols.common import OpenModel, type_tag
from inharness.gateway.schema import MAX_INT64, MIN_INT64

_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,128}$")


class TextBlock(OpenModel):
    type: Literal["text"]
    text: str


class MediaBlock(OpenModel):
    type: Literal["image", "document"]

    @model_validator(mode="after")
    def _refuse(self) -> "MediaBlock":
        raise ValueError(f"{self.type} blocks are not supported: the served model reads text only")


ResultPart = Annotated[TextBlock | MediaBlock, Field(discriminator="type")]


class ToolUseBlock(OpenModel):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str
    input: dict[str, Any]


class ToolResultBlock(OpenModel):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[ResultPart] | None = None
    is_error: bool | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(p.text for p in self.content if isinstance(p, TextBlock))


class ThinkingBlock(OpenModel):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(OpenModel):
    type: Literal["redacted_thinking"]
    data: str


class OtherBlock(OpenModel):
    """A block the prompt has no place for (server tool use and results, containers, ...)."""

    type: str


_BLOCK_KINDS = {"text", "image", "document", "tool_use", "tool_result", "thinking", "redacted_thinking"}


def _block_kind(v: Any) -> str:
    kind = type_tag(v)
    if kind in ("image", "document"):
        return "media"
    return kind if kind in _BLOCK_KINDS else "other"


Block = Annotated[
    Annotated[TextBlock, Tag("text")]
    | Annotated[MediaBlock, Tag("media")]
    | Annotated[ToolUseBlock, Tag("tool_use")]
    | Annotated[ToolResultBlock, Tag("tool_result")]
    | Annotated[ThinkingBlock, Tag("thinking")]
    | Annotated[RedactedThinkingBlock, Tag("redacted_thinking")]
    | Annotated[OtherBlock, Tag("other")],
    Discriminator(_block_kind),
]


class MessageIn(OpenModel):
    role: Literal["user", "assistant"]
    content: str | list[Block]

    def blocks(self) -> list[Any]:
        return [TextBlock(type="text", text=self.content)] if isinstance(self.content, str) else self.content


class CustomTool(OpenModel):
    type: Literal["custom"] | None = None
    name: str
    description: str | None = None
    input_schema: dict[str, Any]

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _TOOL_NAME.match(v):
            raise ValueError("a tool name is 1-128 letters, digits, '_' or '-'")
        return v

    @field_validator("input_schema")
    @classmethod
    def _schema(cls, v: dict[str, Any]) -> dict[str, Any]:
        problem = parameters_problem(v)
        if problem:
            raise ValueError(problem.replace("parameters", "input_schema", 1))
        return v


class OtherTool(OpenModel):
    """A tool the model cannot call through the chat template (web search, code execution, ...)."""

    type: str


def _tool_kind(v: Any) -> str:
    kind = type_tag(v)
    return "custom" if kind in (None, "custom") else "other"


Tool = Annotated[
    Annotated[CustomTool, Tag("custom")] | Annotated[OtherTool, Tag("other")], Discriminator(_tool_kind)
]


class ToolChoice(OpenModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class CountTokensRequest(OpenModel):
    model: str = Field(min_length=1)
    messages: list[MessageIn] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None

    @model_validator(mode="after")
    def _check(self) -> "CountTokensRequest":
        names = [t.name for t in self.custom_tools()]
        if len(set(names)) != len(names):
            raise ValueError("tool names must be unique")
        choice = self.tool_choice
        if choice is not None and choice.type == "tool" and choice.name not in names:
            raise ValueError(f"tool_choice names tool '{choice.name}', which is not in tools")
        if self.messages[-1].role == "assistant":
            raise ValueError("messages: a final assistant message (prefill) is not supported yet")
        return self

    def custom_tools(self) -> list[CustomTool]:
        return [t for t in self.tools or [] if isinstance(t, CustomTool)]

    def system_text(self) -> str:
        if self.system is None or isinstance(self.system, str):
            return self.system or ""
        return "\n\n".join(b.text for b in self.system)


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1, le=MAX_INT64)
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0, le=MAX_INT64)
    stop_sequences: list[str] | None = None
    # not in Anthropic's API; the gateway's engines take it
    seed: int | None = Field(default=None, ge=MIN_INT64, le=MAX_INT64)
    stream: bool = False
    thinking: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None

    @field_validator("stop_sequences")
    @classmethod
    def _stops(cls, v: list[str] | None) -> list[str] | None:
        if v and any(not s.strip() for s in v):
            raise ValueError("stop sequences must contain non-whitespace")
        return v
