"""SFT warm-up: a few seconds of training make the tiny model replay a tool-calling trace greedily."""

import json
from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer

from inharness.engine.sampling import SamplingParams, generate
from inharness.engine.tiny import IM_END, init_tiny
from inharness.trainer.sft import IGNORE, build_example, sft

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
    }
]
MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 2+3?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "calculator", "arguments": json.dumps({"expression": "2+3"})},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "5"},
    {"role": "assistant", "content": "The answer is 5."},
]
CONVERSATION = {"messages": MESSAGES, "tools": TOOLS}


def test_loss_mask_covers_exactly_the_assistant_turns(tmp_path: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(init_tiny(tmp_path / "base"))
    ids, labels = build_example(tokenizer, CONVERSATION)
    assert len(ids) == len(labels)
    full = tokenizer.apply_chat_template(MESSAGES, tools=TOOLS, tokenize=False)
    assert tokenizer.decode(ids, skip_special_tokens=False) == full
    trained = [i for i, label in enumerate(labels) if label != IGNORE]
    spans: list[list[int]] = []
    for i in trained:
        if spans and spans[-1][-1] == i - 1:
            spans[-1].append(i)
        else:
            spans.append([i])
    texts = [tokenizer.decode([ids[i] for i in span], skip_special_tokens=False) for span in spans]
    assert texts == [
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call><|im_end|>',
        "The answer is 5.<|im_end|>",
    ]


def test_sft_makes_greedy_decoding_replay_the_trace(tmp_path: Path) -> None:
    base = init_tiny(tmp_path / "base", seed=0)
    logs: list[str] = []
    result = sft(base, [CONVERSATION], out_dir=tmp_path / "sft", steps=80, lr=3e-3, seed=0, log=logs.append)
    assert result["steps"] == 80 and result["loss_last"] < 0.1 < result["loss_first"]
    assert logs and "loss" in logs[-1]

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "sft")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "sft").eval()
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    greedy = SamplingParams(max_tokens=64, temperature=0, stop_token_ids=[im_end])

    for k in (2, 4):  # before the tool call, and after the tool result
        prompt_text = tokenizer.apply_chat_template(
            MESSAGES[:k], tools=TOOLS, tokenize=False, add_generation_prompt=True
        )
        turn_text = tokenizer.apply_chat_template(MESSAGES[: k + 1], tools=TOOLS, tokenize=False)
        expected_text = turn_text[len(prompt_text) : turn_text.rindex(IM_END) + len(IM_END)]
        expected = tokenizer.encode(expected_text, add_special_tokens=False)
        (out,) = generate(model, tokenizer.encode(prompt_text, add_special_tokens=False), greedy)
        assert out.token_ids == expected, tokenizer.decode(out.token_ids)
        assert out.finish_reason == "stop" and out.stop_token_id == im_end
