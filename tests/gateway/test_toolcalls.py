"""Hermes tool-call parsing: the same answer whether fed at once or a character at a time."""

import json

import pytest

from inharness.gateway.toolcalls import ContentDelta, ToolCall, ToolCallParser, parse_all

ANSWERS = [
    "Plain answer.",
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>',
    'Let me compute.\n<tool_call>\n{"name": "calc", "arguments": {"x": 1}}\n</tool_call>\n'
    '<tool_call>{"name": "calc", "arguments": {"x": 2}}</tool_call>',
    "  \n leading and trailing whitespace \n ",
    "broken <tool_call>{not json}</tool_call> stays content",
    'never closed <tool_call>{"name": "x"',
    "a < b and <tool_ is not a tag",
]


def _stream(text: str, step: int) -> tuple[str | None, list[ToolCall]]:
    parser = ToolCallParser()
    events = []
    for i in range(0, len(text), step):
        events += parser.feed(text[i : i + step])
    events += parser.finish()
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    return content or None, parser.tool_calls


@pytest.mark.parametrize("text", ANSWERS)
@pytest.mark.parametrize("step", [1, 3, 7])
def test_streamed_parse_equals_whole_parse(text: str, step: int) -> None:
    whole_content, whole_calls = parse_all(text)
    content, calls = _stream(text, step)
    assert content == whole_content
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole_calls]


def test_tool_calls_are_parsed_and_content_is_stripped() -> None:
    content, calls = parse_all(ANSWERS[2])
    assert content == "Let me compute."
    assert [c.name for c in calls] == ["calc", "calc"]
    assert [json.loads(c.arguments) for c in calls] == [{"x": 1}, {"x": 2}]
    assert len({c.id for c in calls}) == 2


def test_invalid_or_unclosed_blocks_stay_in_content() -> None:
    assert parse_all(ANSWERS[4]) == ("broken <tool_call>{not json}</tool_call> stays content", [])
    assert parse_all(ANSWERS[5]) == ('never closed <tool_call>{"name": "x"', [])
    assert parse_all(ANSWERS[6]) == ("a < b and <tool_ is not a tag", [])


def test_parse_tools_off_returns_the_text_verbatim() -> None:
    content, calls = parse_all(ANSWERS[1], parse_tools=False)
    assert calls == []
    assert content is not None and content.startswith("<tool_call>")


@pytest.mark.parametrize(
    "block",
    [
        '{"name": "calc", "arguments": {"x": "\\ud800"}}',  # a lone surrogate
        '{"name": "calc", "arguments": {"x": NaN}}',
    ],
)
def test_a_block_no_answer_could_carry_stays_text(block: str) -> None:
    text = f"<tool_call>{block}</tool_call>"
    content, calls = parse_all(text)
    assert calls == [] and content == text
    assert content.encode("utf-8")  # and the text itself encodes: the escape stayed six characters
