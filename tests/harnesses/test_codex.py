"""Codex CLI 0.169.0 (npm), unmodified, under `inharness run` (examples/codex): the OpenAI Responses API,
streamed, with Codex's full default prompt (its instructions, skills and environment context as developer
and user messages, 9 tools: ~40 KB, 13.5k tokens of the tiny tokenizer). The engine replays
examples/codex/script.json (an exec_command call, then a final message), so Codex really runs a command
and sends its output back as a function_call_output."""

import json

import pytest
from harness_run import HARNESSES, Run, check_merged, check_recorded, check_task_done, run_installed

CODEX = HARNESSES / "codex" / "node_modules" / ".bin" / "codex"


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return run_installed("codex", CODEX, ".cache/harnesses/codex/.installed-0.169.0", tmp_path_factory)


def test_codex_exits_as_against_openai(run: Run) -> None:
    check_recorded(run, "openai.responses", attempts=2)
    for attempt in run.attempt_dirs():
        assert (attempt / "last-message.txt").read_text() == "Created hello.txt; it contains hi."
        events = [json.loads(line) for line in (attempt / "events.jsonl").read_text().splitlines()]
        commands = [e["item"] for e in events if e.get("item", {}).get("type") == "command_execution"]
        assert commands[-1]["exit_code"] == 0 and commands[-1]["aggregated_output"] == "hi\n"
        assert events[-1]["type"] == "turn.completed"
        check_task_done(attempt)


def test_codex_tool_turn_merges_token_exactly(run: Run) -> None:
    check_merged(run, turns=2)
    for calls in run.attempts().values():
        first, second = calls[0], calls[1]
        assert first.request["stream"] is True
        assert "exec_command" in [t.get("name") for t in first.request["tools"]]
        output = second.request["input"][-1]
        assert output["type"] == "function_call_output" and output["output"].endswith("Output:\nhi\n")
        call = second.request["input"][-2]
        assert call["type"] == "function_call" and call["call_id"] == output["call_id"]
        assert len(first.prompt_ids) > 10_000  # the real default prompt, not a shortened one
