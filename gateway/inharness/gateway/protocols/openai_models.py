"""Request bodies of OpenAI's Chat Completions API, as far as the gateway reads them.

Unknown fields are accepted (harnesses and their SDKs send many) and recorded; known fields of the
wrong type or out of range are rejected with a 400 that names the field.
"""

import re
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from inharness.gateway.conversation import parameters_problem
from inharness.gateway.protocols.common import OpenModel
from inharness.gateway.schema import MAX_INT64, MIN_INT64

_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
# What the validators below enforce, stated in the OpenAPI document too (their own messages stay), so that
# a client generator or fuzzer builds values the gateway takes.
MAX_STOP = 4
StopSequence = Annotated[str, Field(json_schema_extra={"minLength": 1})]


class TextPart(OpenModel):
    type: Literal["text"]
    text: str


class FunctionCallIn(OpenModel):
    name: str
    arguments: str | dict[str, Any] = ""


class ToolCallIn(OpenModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(OpenModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _check_role_fields(self) -> "ChatMessage":
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a message with role 'tool' needs a tool_call_id")
        if self.role != "assistant" and self.tool_calls:
            raise ValueError(f"only assistant messages carry tool_calls, not role '{self.role}'")
        if self.role != "assistant" and self.content is None:
            raise ValueError(f"a message with role '{self.role}' needs content")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class FunctionDef(OpenModel):
    name: str = Field(json_schema_extra={"pattern": _FUNCTION_NAME.pattern})
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _FUNCTION_NAME.match(v):
            raise ValueError("a function name is 1-64 letters, digits, '_', '-' or '.'")
        return v

    @field_validator("parameters")
    @classmethod
    def _schema(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is None:
            return v
        problem = parameters_problem(v)
        if problem:
            raise ValueError(problem)
        return v


class ToolDef(OpenModel):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(OpenModel):
    name: str


class NamedToolChoice(OpenModel):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(OpenModel):
    include_usage: bool = False


class ChatCompletionRequest(OpenModel):
    model: str = Field(min_length=1)
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_INT64)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_INT64)
    n: int = Field(default=1, ge=1, le=16)
    stop: (
        StopSequence | Annotated[list[StopSequence], Field(json_schema_extra={"maxItems": MAX_STOP})] | None
    ) = None
    seed: int | None = Field(default=None, ge=MIN_INT64, le=MAX_INT64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    parallel_tool_calls: bool | None = None
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        items = [v] if isinstance(v, str) else (v or [])
        if len(items) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        if any(not s for s in items):
            raise ValueError("stop sequences must not be empty")
        return v

    @model_validator(mode="after")
    def _check_tools(self) -> "ChatCompletionRequest":
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tool function names must be unique")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(
                f"tool_choice names function '{self.tool_choice.function.name}', which is not in tools"
            )
        if self.tool_choice == "required" and not names:
            raise ValueError("tool_choice 'required' needs tools")
        return self

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
