"""The engine's scripted mode (`inharness engine --script FILE`) and the tiny model's context flag: a
scripted answer is the script's tokens exactly, with the model's own logprobs of them, chosen by the
prompt alone."""

import json
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient
from transformers import AutoModelForCausalLM, AutoTokenizer

from inharness.engine.script import Scripts
from inharness.engine.server import create_app
from inharness.engine.tiny import IM_END, init_tiny

CALL = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>'


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_tiny(tmp_path_factory.mktemp("tiny-script") / "tiny", seed=0, context=8192)


@pytest.fixture(scope="module")
def script(model_dir: Path) -> Path:
    path = model_dir.parent / "script.json"
    path.write_text(
        json.dumps({"scripts": [{"when": "Write a title", "turns": ["A title"]}, {"turns": [CALL, "Done."]}]})
    )
    return path


@pytest.fixture(scope="module")
def client(model_dir: Path, script: Path) -> TestClient:
    return TestClient(create_app(str(model_dir), served_model_name="tiny", script=str(script)))


def prompt(model_dir: Path, *messages: tuple[str, str]) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    chat = [{"role": role, "content": content} for role, content in messages]
    return tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)


def complete(client: TestClient, ids: list[int], **body: object) -> dict:
    response = client.post(
        "/v1/completions",
        json={"prompt": ids, "max_tokens": 200, "logprobs": 0, "return_token_ids": True, **body},
    )
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def test_init_tiny_context_sets_what_the_engine_accepts(model_dir: Path, client: TestClient) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert model.config.max_position_embeddings == 8192
    assert AutoTokenizer.from_pretrained(model_dir).model_max_length == 8192
    assert client.get("/v1/models").json()["data"][0]["max_model_len"] == 8192
    # The prefix cache holds a whole context by default: a harness's long prompt is reused next turn.
    assert client.app.state.engine.scheduler.prefix_cache.max_tokens == 8192
    with pytest.raises(ValueError, match="context"):
        init_tiny(model_dir.parent / "bad", context=4)


def test_a_scripted_turn_is_its_tokens_with_the_models_logprobs(client: TestClient, model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    first = prompt(model_dir, ("system", "You run commands."), ("user", "List the files."))
    choice = complete(client, first, temperature=0.7)
    expected = [*tokenizer.encode(CALL, add_special_tokens=False), tokenizer.convert_tokens_to_ids(IM_END)]
    assert choice["token_ids"] == expected
    assert choice["text"] == CALL and choice["finish_reason"] == "stop"

    # The logprobs are the model's, teacher-forced, at the request's temperature (sampling's convention).
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([first + expected])).logits[0, len(first) - 1 : -1]
    want = torch.log_softmax(logits / 0.7, -1).gather(-1, torch.tensor(expected)[:, None]).squeeze(-1)
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(want.tolist(), abs=1e-4)

    # The next turn (one assistant turn in its prompt) gets the second answer; past the end, the last.
    second = prompt(model_dir, ("user", "List the files."), ("assistant", CALL), ("user", "a.txt"))
    assert complete(client, second)["text"] == "Done."
    third = prompt(
        model_dir,
        ("user", "x"),
        ("assistant", CALL),
        ("user", "a"),
        ("assistant", "Done."),
        ("user", "again"),
    )
    assert complete(client, third)["text"] == "Done."


def test_a_script_is_chosen_by_the_prompt_and_limits_still_apply(client: TestClient, model_dir: Path) -> None:
    titled = prompt(model_dir, ("system", "Write a title for this chat."), ("user", "List the files."))
    assert complete(client, titled)["text"] == "A title"
    cut = complete(client, prompt(model_dir, ("user", "List the files.")), max_tokens=3)
    assert cut["finish_reason"] == "length" and len(cut["token_ids"]) == 3
    streamed = client.post(
        "/v1/completions",
        json={"prompt": titled, "max_tokens": 50, "stream": True, "return_token_ids": True},
    )
    assert "A title" in "".join(
        json.loads(line[6:])["choices"][0]["text"]
        for line in streamed.text.splitlines()
        if line.startswith("data: {")
    )


def test_a_bad_script_is_refused_with_its_place(tmp_path: Path, model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"scripts": [{"turns": [{"token_ids": [99999]}]}]}))
    with pytest.raises(ValueError, match=r"bad.json: scripts\[0\].turns\[0\]"):
        Scripts.load(bad, tokenizer, 3072)
    bad.write_text(json.dumps({"scripts": [{"when": "", "turns": ["x"]}]}))
    with pytest.raises(ValueError, match=r"scripts\[0\].when"):
        Scripts.load(bad, tokenizer, 3072)


def test_a_cycle_turn_gives_each_alternative_in_turn_to_the_same_prompt(model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    path = model_dir.parent / "cycle.json"
    path.write_text(json.dumps({"scripts": [{"turns": [{"cycle": ["cold", "down", "no"]}, "Done."]}]}))
    scripts = Scripts.load(path, tokenizer, int(tokenizer.vocab_size))
    first = prompt(model_dir, ("user", "the opposite of hot"))
    answers = [tokenizer.decode(scripts.tokens_for(first), skip_special_tokens=True) for _ in range(7)]
    assert answers == ["cold", "down", "no", "cold", "down", "no", "cold"]
    later = prompt(model_dir, ("user", "the opposite of hot"), ("assistant", "cold"), ("user", "ok"))
    assert tokenizer.decode(scripts.tokens_for(later), skip_special_tokens=True) == "Done."
    path.write_text(json.dumps({"scripts": [{"turns": [{"cycle": []}]}]}))
    with pytest.raises(ValueError, match=r"scripts\[0\].turns\[0\].cycle"):
        Scripts.load(path, tokenizer, 3072)
