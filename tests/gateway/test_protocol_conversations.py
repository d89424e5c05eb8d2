"""Each protocol's request becomes the same conversation as its Chat Completions equivalent: the same
messages, tools and digests, so the same prompt and the same parent call."""

from typing import Any

from inharness.demo import CALC_TOOL, QUESTION, SYSTEM
from inharness.gateway.conversation import Conversation, FunctionCall, Message
from inharness.gateway.protocols import anthropic_messages, openai_chat, openai_responses
from inharness.gateway.protocols.anthropic_models import MessagesRequest
from inharness.gateway.protocols.openai_models import ChatCompletionRequest
from inharness.gateway.protocols.openai_responses_models import ResponsesRequest

ARGS = '{"expression": "2+3"}'
CHAT: list[dict[str, Any]] = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": QUESTION},
    {
        "role": "assistant",
        "content": "Let me compute.",
        "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "calculator", "arguments": ARGS}},
            {"id": "b", "type": "function", "function": {"name": "calculator", "arguments": "{}"}},
        ],
    },
    {"role": "tool", "tool_call_id": "a", "content": "5"},
    {"role": "tool", "tool_call_id": "b", "content": "error: no expression"},
    {"role": "user", "content": "and 3+4?"},
]


def chat_conversation() -> Conversation:
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": CHAT, "tools": [CALC_TOOL]})
    return openai_chat.to_conversation(req)


def test_responses_items_are_the_chat_conversation() -> None:
    fn = CALC_TOOL["function"]
    req = ResponsesRequest.model_validate(
        {
            "model": "m",
            "instructions": SYSTEM,
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
                {"type": "reasoning", "id": "rs_1", "summary": []},
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "Let me compute."}],
                },
                {
                    "type": "function_call",
                    "call_id": "a",
                    "name": "calculator",
                    "arguments": '{"expression":"2+3"}',
                },
                {"type": "function_call", "call_id": "b", "name": "calculator", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "a", "output": "5"},
                {"type": "function_call_output", "call_id": "b", "output": "error: no expression"},
                {"role": "user", "content": "and 3+4?"},
            ],
            "tools": [{"type": "function", **fn}, {"type": "web_search"}],
        }
    )
    conv, notes = openai_responses.to_conversation(req)
    chat = chat_conversation()
    assert conv.template_messages() == chat.template_messages() and conv.tools == chat.tools
    assert conv.digest_chain() == chat.digest_chain()
    assert notes == [
        "tools[1] of type 'web_search' is left out of the prompt: the model cannot run it",
        "input[1] of type 'reasoning' is left out of the prompt",
    ]


def test_a_string_input_is_one_user_message() -> None:
    conv, notes = openai_responses.to_conversation(
        ResponsesRequest(model="m", input="hi", instructions="Be brief.")
    )
    assert conv.messages == (Message("system", "Be brief."), Message("user", "hi")) and notes == []


def test_anthropic_messages_are_the_chat_conversation() -> None:
    fn = CALC_TOOL["function"]
    req = MessagesRequest.model_validate(
        {
            "model": "m",
            "max_tokens": 128_000,
            "system": [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
            "messages": [
                {"role": "user", "content": QUESTION},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "use the tool", "signature": "s"},
                        {"type": "text", "text": "Let me compute."},
                        {"type": "tool_use", "id": "a", "name": "calculator", "input": {"expression": "2+3"}},
                        {"type": "tool_use", "id": "b", "name": "calculator", "input": {}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "a",
                            "content": [{"type": "text", "text": "5"}],
                        },
                        {
                            "type": "tool_result",
                            "tool_use_id": "b",
                            "content": "error: no expression",
                            "is_error": True,
                        },
                        {"type": "text", "text": "and 3+4?"},
                    ],
                },
            ],
            "tools": [
                {"name": "calculator", "description": fn["description"], "input_schema": fn["parameters"]},
                {"type": "web_search_20250305", "name": "web_search"},
            ],
        }
    )
    conv, notes = anthropic_messages.to_conversation(req)
    chat = chat_conversation()
    assert conv.template_messages() == chat.template_messages() and conv.tools == chat.tools
    assert conv.digest_chain() == chat.digest_chain()
    assert notes == [
        "tools[1] of type 'web_search_20250305' is left out of the prompt: the model cannot run it",
        "messages[1].content[0]: thinking is left out of the prompt",
    ]


def test_text_before_a_tool_result_stays_before_it() -> None:
    req = MessagesRequest.model_validate(
        {
            "model": "m",
            "max_tokens": 8,
            "messages": [
                {"role": "user", "content": "go"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}]},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "note: "},
                        {"type": "tool_result", "tool_use_id": "a"},
                        {"type": "text", "text": "next"},
                    ],
                },
            ],
        }
    )
    conv, _ = anthropic_messages.to_conversation(req)
    assert conv.messages[1:] == (
        Message("assistant", "", (FunctionCall("f", "{}"),)),
        Message("user", "note: "),
        Message("tool", "", tool_call_id="a"),
        Message("user", "next"),
    )
