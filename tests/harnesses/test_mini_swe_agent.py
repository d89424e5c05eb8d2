"""mini-SWE-agent 2.4.6 (PyPI), unmodified, under `inharness run` (examples/mini-swe-agent): Chat
Completions through LiteLLM. The engine replays examples/mini-swe-agent/script.json (a bash tool call,
then the submit command) on the hello task, one step of one task, so the agent really runs a command and
sends its output back; the example's RL demo (demo.py) has its own smoke, test_demo_swe.py."""

import json
from pathlib import Path

import pytest
from harness_run import HARNESSES, Run, check_merged, check_recorded, check_task_done, run_installed

MINI = HARNESSES / "mini-swe-agent" / "bin" / "mini"
HELLO = Path(__file__).with_name("hello-task.jsonl")
ONE_STEP = {"steps": 1, "batchSize": 1, "dataset": {"path": str(HELLO)}, "algorithm": {"groupSize": 2}}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return run_installed(
        "mini-swe-agent",
        MINI,
        ".cache/harnesses/mini-swe-agent/.installed-2.4.6",
        tmp_path_factory,
        training=ONE_STEP,
    )


def test_mini_swe_agent_exits_as_against_openai(run: Run) -> None:
    check_recorded(run, "openai.chat", attempts=2)
    for attempt in run.attempt_dirs():
        traj = json.loads((attempt / "traj.json").read_text())
        assert traj["info"]["exit_status"] == "Submitted", traj["info"]
        check_task_done(attempt)


def test_mini_swe_agent_tool_turn_merges_token_exactly(run: Run) -> None:
    check_merged(run, turns=2)
    for calls in run.attempts().values():
        first, second = calls[0], calls[1]
        assert [t["function"]["name"] for t in first.request["tools"]] == ["bash"]
        assert len(first.prompt_ids) < 4000  # its instructions and one tool: small
        # The command's output went back to the model as the tool's result.
        (tool,) = [m for m in second.request["messages"] if m["role"] == "tool"]
        assert '"output": "hi\\n"' in tool["content"]
        assert tool["tool_call_id"] == second.request["messages"][-2]["tool_calls"][0]["id"]
