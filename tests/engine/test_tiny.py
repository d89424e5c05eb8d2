"""The tiny model: loadable by the Auto classes, Qwen-compatible tokenizer and chat template."""

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedTokenizerFast

from inharness.engine.tiny import IM_END, TOOL_CALL_CLOSE, TOOL_CALL_OPEN, build_tokenizer, init_tiny

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    },
]


def _call(call_id: str, name: str, arguments: Any) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


MULTI_TURN = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 2+3, and then times 4?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [_call("c1", "calculator", '{"expression": "2+3"}')],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "5"},
    {
        "role": "assistant",
        "content": "Now the product.",
        "tool_calls": [_call("c2", "calculator", {"expression": "5*4"})],
    },
    {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "20"}]},
    {"role": "assistant", "content": "It is 20."},
    {"role": "user", "content": [{"type": "text", "text": "Thanks! "}, {"type": "text", "text": "Bye."}]},
    {"role": "assistant", "content": "Bye 👋"},
]


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Built per module (about a second) rather than in a conftest: tests/ modules import `conftest` by name.
    return init_tiny(tmp_path_factory.mktemp("tiny-engine") / "tiny", seed=0)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> PreTrainedTokenizerFast:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def render(tok: PreTrainedTokenizerFast, messages: list[dict], **kwargs: Any) -> str:
    return tok.apply_chat_template(messages, tokenize=False, **kwargs)


def test_loads_as_qwen2_with_expected_size(tiny_model_dir: Path, tokenizer: PreTrainedTokenizerFast) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert model.dtype == torch.float32
    assert model.config.tie_word_embeddings
    assert model.config.max_position_embeddings == 2048
    assert 2_000_000 < sum(p.numel() for p in model.parameters()) < 8_000_000
    assert 2000 <= len(tokenizer) <= 4000
    assert model.config.vocab_size == len(tokenizer)
    assert isinstance(tokenizer, PreTrainedTokenizerFast)
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    assert GenerationConfig.from_pretrained(tiny_model_dir).eos_token_id == im_end
    assert tokenizer.eos_token == IM_END
    assert tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.bos_token is None


@pytest.mark.parametrize(
    "text",
    [
        "hello world",
        "Grüße aus Köln, 東京 und Zürich — ça va? 😀🎉👩‍💻",
        '{"name": "calculator", "arguments": {"expression": "(12.5*3)/7"}}',
        "def f(x):\n\treturn x  +  1\n\n\n   trailing   ",
        "\x00\x01 control \r\n crlf",
        f"<|im_start|>user\n{TOOL_CALL_OPEN}\n{{}}\n{TOOL_CALL_CLOSE}{IM_END}\n",
    ],
)
def test_round_trip(tokenizer: PreTrainedTokenizerFast, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


def test_markup_tokens_are_single_ids(tokenizer: PreTrainedTokenizerFast) -> None:
    for token in ["<|endoftext|>", "<|im_start|>", IM_END, TOOL_CALL_OPEN, TOOL_CALL_CLOSE]:
        assert len(tokenizer.encode(token, add_special_tokens=False)) == 1
    for token in ["<tool_response>", "</tool_response>"]:
        assert len(tokenizer.encode(token, add_special_tokens=False)) == 1
    ids = tokenizer.encode(
        f'{TOOL_CALL_OPEN}\n{{"a": 1}}\n{TOOL_CALL_CLOSE}{IM_END}', add_special_tokens=False
    )
    # As in Qwen: tool-call markup survives skip_special_tokens, the chat control tokens do not.
    assert (
        tokenizer.decode(ids, skip_special_tokens=True) == f'{TOOL_CALL_OPEN}\n{{"a": 1}}\n{TOOL_CALL_CLOSE}'
    )


def test_tokenizer_is_deterministic(tokenizer: PreTrainedTokenizerFast) -> None:
    text = 'Determinism: 2+2=4, emoji 🙂, JSON {"k": [1, 2]}'
    first, second = build_tokenizer(), build_tokenizer()
    assert first.backend_tokenizer.to_str() == second.backend_tokenizer.to_str()
    assert first.encode(text) == second.encode(text) == tokenizer.encode(text)


def test_same_seed_same_weights(tiny_model_dir: Path, tmp_path: Path) -> None:
    again = init_tiny(tmp_path / "again", seed=0)
    other = init_tiny(tmp_path / "other", seed=1)
    a = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    b = AutoModelForCausalLM.from_pretrained(again).state_dict()
    c = AutoModelForCausalLM.from_pretrained(other).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)
    assert (again / "tokenizer.json").read_text() == (tiny_model_dir / "tokenizer.json").read_text()


def test_plain_chat_rendering(tokenizer: PreTrainedTokenizerFast) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert (
        render(tokenizer, messages)
        == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    )
    assert render(tokenizer, messages, add_generation_prompt=True).endswith(
        "Hi<|im_end|>\n<|im_start|>assistant\n"
    )
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert render(tokenizer, parts) == "<|im_start|>user\nab<|im_end|>\n"


def test_tools_block_and_tool_calls(tokenizer: PreTrainedTokenizerFast) -> None:
    text = render(tokenizer, MULTI_TURN[:4], tools=TOOLS)
    system_block = text.split(IM_END)[0]
    assert system_block.startswith("<|im_start|>system\nYou are a helpful assistant.\n\n")
    inside = system_block.split("<tools>\n")[1].split("\n</tools>")[0]
    assert [json.loads(line) for line in inside.split("\n")] == TOOLS
    assert (
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
        in system_block
    )
    assert text.count("<|im_start|>system") == 1
    assert text.endswith(
        "<|im_start|>assistant\n<tool_call>\n"
        '{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n"
    )
    # A tools block is emitted even without a system message.
    assert render(tokenizer, [MULTI_TURN[1]], tools=TOOLS).startswith("<|im_start|>system\n# Tools\n")


def test_arguments_as_string_or_dict_render_identically(tokenizer: PreTrainedTokenizerFast) -> None:
    as_string = {"role": "assistant", "tool_calls": [_call("x", "calculator", '{"expression": "1+1"}')]}
    as_dict = {"role": "assistant", "tool_calls": [_call("x", "calculator", {"expression": "1+1"})]}
    assert render(tokenizer, [as_string]) == render(tokenizer, [as_dict])
    with_text = render(tokenizer, [MULTI_TURN[4]])
    assert with_text == (
        "<|im_start|>assistant\nNow the product.\n<tool_call>\n"
        '{"name": "calculator", "arguments": {"expression": "5*4"}}\n</tool_call><|im_end|>\n'
    )


def test_parallel_tool_calls_and_results_share_turns(tokenizer: PreTrainedTokenizerFast) -> None:
    messages = [
        {"role": "user", "content": "Weather in Paris and Oslo?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                _call("a", "get_weather", {"city": "Paris"}),
                _call("b", "get_weather", {"city": "Oslo"}),
            ],
        },
        {"role": "tool", "tool_call_id": "a", "content": "sunny"},
        {"role": "tool", "tool_call_id": "b", "content": "snow"},
    ]
    text = render(tokenizer, messages)
    assert '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}' in text
    assert text.endswith(
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nsnow\n</tool_response>"
        "<|im_end|>\n"
    )
    # Prefix stability holds at every boundary outside the run of tool messages.
    full = render(tokenizer, [*messages, {"role": "assistant", "content": "Done."}])
    for k in (1, 2, 4):
        assert full.startswith(render(tokenizer, messages[:k]))


def test_prefix_property_on_multi_turn_tool_conversation(tokenizer: PreTrainedTokenizerFast) -> None:
    for tools in (TOOLS, None):
        for k in range(1, len(MULTI_TURN)):
            shorter = render(tokenizer, MULTI_TURN[:k], tools=tools)
            longer = render(tokenizer, MULTI_TURN[: k + 1], tools=tools)
            assert longer.startswith(shorter), k
            if MULTI_TURN[k]["role"] == "assistant":
                prompt = render(tokenizer, MULTI_TURN[:k], tools=tools, add_generation_prompt=True)
                assert longer.startswith(prompt), k


def test_text_is_nfc_normalised_like_qwen(tokenizer: PreTrainedTokenizerFast) -> None:
    # transformers always loads a qwen2 checkpoint's tokenizer with Qwen's NFC normaliser, so round trips are
    # exact for NFC text (nearly all text); decomposed input comes back composed.
    ids = tokenizer.encode("cafe\u0301", add_special_tokens=False)
    assert tokenizer.decode(ids) == "caf\u00e9"
