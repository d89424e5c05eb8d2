"""Request bodies of OpenAI's Responses API, as far as the gateway reads them (what Codex CLI sends).

Unknown fields are accepted and recorded. Input items and tools of types the model cannot take are
accepted too and left out of the prompt (the adapter records a note); known items and function
tools of the wrong shape are a 400 naming the field.
"""

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, model_validator

from inharness.gateway.protocols.common import OpenModel, type_tag
from inharness.gateway.protocols.openai_models import FunctionDef
from inharness.gateway.schema import MAX_INT64, MIN_INT64


class TextPart(OpenModel):
    type: Literal["input_text", "output_text"]
    text: str


class RefusalPart(OpenModel):
    type: Literal["refusal"]
    refusal: str


class MediaPart(OpenModel):
    type: Literal["input_image", "input_file", "input_audio"]

    @model_validator(mode="after")
    def _refuse(self) -> "MediaPart":
        raise ValueError(f"{self.type} is not supported: the served model reads text only")


Part = Annotated[TextPart | RefusalPart | MediaPart, Field(discriminator="type")]


def part_text(content: str | list[TextPart | RefusalPart | MediaPart]) -> str:
    if isinstance(content, str):
        return content
    return "".join(p.text if isinstance(p, TextPart) else getattr(p, "refusal", "") for p in content)


class MessageItem(OpenModel):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[Part]


class FunctionCallItem(OpenModel):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str
    arguments: str


class FunctionCallOutputItem(OpenModel):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[Part]


class OtherItem(OpenModel):
    """An item the prompt has no place for (reasoning, custom or built-in tool calls, references)."""

    type: str


_ITEM_KINDS = {"message", "function_call", "function_call_output"}


def _item_kind(v: Any) -> str:
    kind = type_tag(v, "message")
    return kind if kind in _ITEM_KINDS else "other"


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[OtherItem, Tag("other")],
    Discriminator(_item_kind),
]


class FunctionTool(FunctionDef):
    """A function tool: Chat Completions' function definition with the type beside it."""

    type: Literal["function"]


class OtherTool(OpenModel):
    """A tool the model cannot call through the chat template (web_search, namespace, custom, ...)."""

    type: str


Tool = Annotated[
    Annotated[FunctionTool, Tag("function")] | Annotated[OtherTool, Tag("other")],
    Discriminator(lambda v: "function" if type_tag(v) == "function" else "other"),
]


class ResponsesRequest(OpenModel):
    model: str = Field(min_length=1)
    # An empty list is refused (no input item to answer), as the document says; omitted, the same.
    input: str | Annotated[list[InputItem], Field(json_schema_extra={"minItems": 1})] = Field(
        default_factory=list
    )
    instructions: str | None = None
    previous_response_id: str | None = Field(default=None, min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    max_output_tokens: int | None = Field(default=None, ge=1, le=MAX_INT64)
    # not in OpenAI's API; the gateway's engines take it
    seed: int | None = Field(default=None, ge=MIN_INT64, le=MAX_INT64)
    stream: bool = False
    store: bool | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    prompt_cache_key: str | None = None
    client_metadata: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_tools(self) -> "ResponsesRequest":
        names = [t.name for t in self.function_tools()]
        if len(set(names)) != len(names):
            raise ValueError("tool function names must be unique")
        choice = self.tool_choice
        if isinstance(choice, dict) and choice.get("type") == "function" and choice.get("name") not in names:
            raise ValueError(f"tool_choice names function '{choice.get('name')}', which is not in tools")
        if choice == "required" and not names:
            raise ValueError("tool_choice 'required' needs function tools")
        return self

    def function_tools(self) -> list[FunctionTool]:
        return [t for t in self.tools or [] if isinstance(t, FunctionTool)]

    def input_items(self) -> list[MessageItem | FunctionCallItem | FunctionCallOutputItem | OtherItem]:
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)
