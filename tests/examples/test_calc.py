"""examples/calc: the grader, the task generator, the warm-up traces, and harness.py run for real as a
subprocess against a real engine and gateway, as the RL loop runs it."""

import importlib.util
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from conftest import ADMIN
from openai.types.chat import ChatCompletion
from testsupport import Server, free_port, gateway_server

from inharness.gateway.client import GatewayClient
from inharness.trainer.sft import IGNORE, build_example

CALC = Path(__file__).resolve().parents[2] / "examples" / "calc"


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"test_calc_{name}", CALC / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


grader, tasks, harness = load("grader"), load("tasks"), load("harness")


@pytest.mark.parametrize(
    ("answer", "expected", "reward"),
    [
        ("The answer is 22.", "22", 1.0),
        ("22", "22", 1.0),
        ("It is 22.0, I think", "22", 1.0),
        ("(22)", "22", 1.0),
        ("The answer is -3.", "-3", 1.0),
        ("The answer is 122.", "22", 0.0),
        ("The answer is 221.", "22", 0.0),
        ("The answer is 2.22.", "22", 0.0),
        ("The answer is 1,022.", "22", 0.0),
        ("x22", "22", 0.0),
        ("The answer is 3.", "-3", 0.0),
        ("The answer is five.", "5", 0.0),
        ("7+5 = 12", "12", 1.0),
        ("12, or 13", "12", 0.0),
        ('{"expression": "6-0 {"expression":', "6", 0.0),
        ("", "5", 0.0),
        (None, "5", 0.0),
    ],
)
def test_grade(answer: str | None, expected: str, reward: float) -> None:
    assert grader.grade({"question": "?", "answer": expected}, answer) == reward


def test_make_tasks_is_deterministic_and_correct() -> None:
    a = tasks.make_tasks(50, 3)
    assert a == tasks.make_tasks(50, 3)
    assert a != tasks.make_tasks(50, 4)
    for t in a:
        assert harness.calculator(tasks.intended_expression(t)) == t["answer"]
        assert int(t["answer"]) >= 0
    assert {t["question"].split()[3] for t in a} == set(tasks.OPERATORS)


def test_tasks_file_matches_generator() -> None:
    assert tasks.load_tasks() == tasks.make_tasks(tasks.TRAIN_TASKS, tasks.TRAIN_SEED)


def test_warmup_conversations_render_with_the_tiny_chat_template(tiny_model: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    conversations = tasks.make_warmup_conversations(8, 0)
    assert conversations == tasks.make_warmup_conversations(8, 0)
    for conv in conversations:
        assert conv["tools"] == [harness.CALC_TOOL]
        assert conv["messages"][0] == {"role": "system", "content": harness.SYSTEM}
        ids, labels = build_example(tok, conv)  # raises unless the rendering is prefix-stable
        expression = json.loads(conv["messages"][2]["tool_calls"][0]["function"]["arguments"])["expression"]
        trained = tok.decode([t for t in labels if t != IGNORE])
        assert f'"arguments": {{"expression": "{expression}"}}' in trained
        assert f"The answer is {harness.calculator(expression)}." in trained
        assert len(ids) < 400

    # Warm-up phase 1: the same messages without the tools preamble, so the same supervised tokens.
    for full, short in zip(conversations, tasks.make_warmup_conversations(8, 0, tools=False), strict=True):
        assert short["messages"] == full["messages"] and not short["tools"]
        (full_ids, full_labels), (short_ids, short_labels) = (
            build_example(tok, full),
            build_example(tok, short),
        )
        assert len(short_ids) < len(full_ids) - 100
        assert [t for t in short_labels if t != IGNORE] == [t for t in full_labels if t != IGNORE]


def test_warmup_traces_copy_the_numbers_but_not_the_meaning_of_the_operator_word() -> None:
    """The demo's premise: the warm-up teaches the tool format and copying; only the reward says which
    operator "plus", "minus" and "times" ask for."""

    def parts(conv: dict[str, Any]) -> tuple[dict[str, str], str]:
        task = {"question": conv["messages"][1]["content"]}
        call = json.loads(conv["messages"][2]["tool_calls"][0]["function"]["arguments"])["expression"]
        return task, call

    random_traces = [parts(c) for c in tasks.make_warmup_conversations(300, 0)]
    for task, call in random_traces:
        assert re.findall(r"\d+", call) == re.findall(r"\d+", task["question"])
    right = sum(call == tasks.intended_expression(task) for task, call in random_traces) / len(random_traces)
    assert 0.2 < right < 0.5  # a third, by chance
    for conv in tasks.make_warmup_conversations(50, 0, random_operator=False):
        task, call = parts(conv)
        assert call == tasks.intended_expression(task)


def test_warm_up_runs_both_phases(tiny_model: Path, tmp_path: Path) -> None:
    stats = tasks.warm_up(
        tiny_model, tmp_path / "warm", conversations=2, short_steps=1, steps=1, batch_size=2
    )
    assert stats["steps"] == 1 and stats["short"]["steps"] == 1
    assert (tmp_path / "warm" / "config.json").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["warm"]


def test_run_tool_reports_model_mistakes_instead_of_raising() -> None:
    assert harness.run_tool("calculator", '{"expression": "17+5"}') == ("22", True)
    for name, arguments in [
        ("calculator", "{not json"),
        ("calculator", '["17+5"]'),
        ("calculator", '{"expr": "17+5"}'),
        ("calculator", '{"expression": 22}'),
        ("calculator", '{"expression": "import os"}'),
        ("calculator", '{"expression": "1/0"}'),
        ("calculator", '{"expression": "' + "9*" * 40 + '9"}'),
        ("search", '{"query": "17+5"}'),
    ]:
        content, ok = harness.run_tool(name, arguments)
        assert not ok and content.startswith("error:"), (name, arguments)


class ScriptedClient:
    """Stands in for `openai.OpenAI`: answers each create() with the next scripted message."""

    def __init__(self, replies: list[dict[str, Any]]) -> None:
        self.replies, self.requests = replies, []
        self.chat = self.completions = self

    def create(self, **request: Any) -> ChatCompletion:
        self.requests.append(json.loads(json.dumps(request)))
        message = {"role": "assistant", **self.replies[len(self.requests) - 1]}
        return ChatCompletion.model_validate(
            {
                "id": "x",
                "object": "chat.completion",
                "created": 0,
                "model": "m",
                "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
            }
        )


def tool_call(arguments: str, name: str = "calculator") -> dict[str, Any]:
    call = {"id": "c1", "type": "function", "function": {"name": name, "arguments": arguments}}
    return {"tool_calls": [call]}


def test_solve_feeds_bad_tool_calls_back_and_stops_after_max_calls() -> None:
    client = ScriptedClient([tool_call("{bad"), tool_call('{"expression": "2+3"}'), {"content": "It is 5."}])
    run = harness.solve(client, "m", "What is 2+3?", 1.0)
    assert (run["answer"], run["turns"], run["tool_calls"], run["tool_errors"]) == ("It is 5.", 3, 2, 1)
    tool_messages = [m for m in client.requests[-1]["messages"] if m["role"] == "tool"]
    assert [m["content"] for m in tool_messages] == ["error: arguments must be a JSON object", "5"]
    assert client.requests[0]["temperature"] == 1.0
    assert client.requests[0]["max_tokens"] == harness.MAX_TOKENS

    looping = ScriptedClient([tool_call('{"expression": "1+1"}')] * harness.MAX_CALLS)
    run = harness.solve(looping, "m", "What is 1+1?", 0.0)
    assert run["answer"] is None and run["turns"] == harness.MAX_CALLS


def harness_env(
    base_url: str, key: str, task: dict[str, Any], result: Path, temperature: str
) -> dict[str, str]:
    return {
        **os.environ,
        "OPENAI_BASE_URL": base_url,
        "OPENAI_API_KEY": key,
        "OPENAI_MODEL": "calc-agent",
        "INHARNESS_TASK": json.dumps(task),
        "INHARNESS_RESULT_FILE": str(result),
        "INHARNESS_TEMPERATURE": temperature,
    }


def run_harness(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(CALC / "harness.py")], env=env, capture_output=True, text=True, timeout=60
    )


def test_harness_exits_nonzero_on_api_errors(tmp_path: Path) -> None:
    result = tmp_path / "result.json"
    dead = f"http://127.0.0.1:{free_port()}/v1"
    proc = run_harness(harness_env(dead, "k", {"question": "What is 2+3?", "answer": "5"}, result, "1.0"))
    assert proc.returncode != 0
    assert "model API error" in proc.stderr
    assert not result.exists()


@pytest.fixture(scope="module")
def gateway(
    engine: Server, tool_model: Path, tmp_path_factory: pytest.TempPathFactory, log_dir: Path
) -> Iterator[Server]:
    db = tmp_path_factory.mktemp("calc-gw") / "gateway.db"
    server = gateway_server(tool_model, [engine.url], db, log_dir, admin_token=ADMIN).start()
    yield server
    server.stop()


async def test_harness_subprocess_against_real_gateway(gateway: Server, tmp_path: Path) -> None:
    task = {"question": "What is 2+3?", "answer": "5"}
    async with GatewayClient(gateway.url, ADMIN) as gw:
        await gw.create_rollouts([task])
        attempt = await gw.claim()
        assert attempt is not None and attempt.task == task
        result_file = tmp_path / "result.json"
        env = harness_env(f"{gateway.url}/v1", attempt.token, attempt.task, result_file, "0")
        proc = run_harness(env)
        assert proc.returncode == 0, proc.stderr
        result = json.loads(result_file.read_text())
        await gw.complete(attempt.id, "succeeded", reward=result["reward"], info=result)
        calls = await gw.calls(attempt.id)

    assert isinstance(result["reward"], float) and result["reward"] in (0.0, 1.0)
    assert result["expected"] == "5"
    assert result["reward"] == grader.grade(task, result["answer"])
    # The tool model was warmed up on exactly this trace, so greedy decoding follows it.
    assert (result["turns"], result["tool_calls"], result["tool_errors"]) == (2, 1, 0)
    assert result["reward"] == 1.0
    assert len(calls) == result["turns"]
    assert all(c.requested_model == "calc-agent" and c.response_ids for c in calls)
    assert calls[1].parent_call_id == calls[0].id
    assert calls[0].request is not None and calls[0].request["temperature"] == 0.0


def test_sim_runs_a_step_of_the_imitated_agent_loop_and_reports_the_gain(
    tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sim = load("sim")
    assert sim.main([str(tiny_model), "--steps", "1", "--batch-size", "1", "--group-size", "2"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^step 0: reward \d\.\d\d right-operator \d\.\d\d tool-use \d\.\d\d", out, re.M), out
    assert "gain" in out.splitlines()[-1]


def test_sim_parses_tool_calls_as_the_chat_template_writes_them() -> None:
    sim = load("sim")
    text = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "7*5"}}\n</tool_call>'
    assert sim._parse_call(text) == ("calculator", '{"expression": "7*5"}')
    assert sim._parse_call("The answer is 35.") is None
    assert sim._parse_call("<tool_call>\n{not json}\n</tool_call>") == ("?", "{}")
