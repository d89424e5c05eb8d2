"""Claude Code 2.1.328 (npm), unmodified, under `inharness run` (examples/claude-code): the Anthropic
Messages API, streamed. The engine replays examples/claude-code/script.json (a Bash tool call, then a
final message), so Claude Code really runs a command and sends its output back as a tool_result.

The example passes Claude Code's own flags that shorten its first request (`--tools Bash
--disable-slash-commands --exclude-dynamic-system-prompt-sections`: 14 KB, 6.4k tokens of the tiny
tokenizer, instead of 50 KB and 24.5k tokens with its defaults, whose CPU prefill and training take
about two minutes per run; docs/harnesses.md has the figures of that run)."""

import json
import os

import pytest
from harness_run import HARNESSES, Run, check_merged, check_recorded, check_task_done, run_installed

CLAUDE = HARNESSES / "claude-code" / "node_modules" / ".bin" / "claude"
STAMP = ".cache/harnesses/claude-code/.installed-2.1.328"


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return run_installed("claude-code", CLAUDE, STAMP, tmp_path_factory)


def test_claude_code_exits_as_against_anthropic(run: Run) -> None:
    check_recorded(run, "anthropic.messages", attempts=2)
    for attempt in run.attempt_dirs():
        result = json.loads((attempt / "claude.json").read_text())
        assert result["type"] == "result" and result["subtype"] == "success", result
        assert result["is_error"] is False and result["num_turns"] == 2
        assert result["result"] == "Created hello.txt; it contains hi."
        check_task_done(attempt)


def test_claude_code_tool_turn_merges_token_exactly(run: Run) -> None:
    check_merged(run, turns=2)
    for calls in run.attempts().values():
        first, second = calls[0], calls[1]
        assert first.request["stream"] is True
        assert [t["name"] for t in first.request["tools"]] == ["Bash"]
        use = second.request["messages"][-2]["content"][-1]
        (result,) = [b for b in second.request["messages"][-1]["content"] if b["type"] == "tool_result"]
        assert use["type"] == "tool_use" and use["name"] == "Bash"
        assert result["tool_use_id"] == use["id"] and result["content"] == "hi"
        assert result["is_error"] is False


@pytest.mark.slow
@pytest.mark.skipif(
    not os.environ.get("INHARNESS_HARNESS_DEFAULT_PROMPTS"),
    reason="about 2 minutes on 2 cores; set INHARNESS_HARNESS_DEFAULT_PROMPTS=1 to run it",
)
def test_claude_code_with_its_default_prompt(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Claude Code's own first request, all 12 tools and its reminders (50 KB), recorded and merged the
    same way; only Bash is allowed without asking, as the task needs it."""
    run = run_installed(
        "claude-code",
        CLAUDE,
        STAMP,
        tmp_path_factory,
        harness_env={"CLAUDE_CODE_ARGS": "--allowedTools Bash"},
        timeout=540,
    )
    check_recorded(run, "anthropic.messages", attempts=2)
    check_merged(run, turns=2)
    for calls in run.attempts().values():
        assert len(calls[0].request["tools"]) > 5 and len(calls[0].prompt_ids) > 20_000
    for attempt in run.attempt_dirs():
        check_task_done(attempt)
