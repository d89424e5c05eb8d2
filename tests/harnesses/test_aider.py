"""Aider 0.86.2 (PyPI aider-chat), unmodified, under `inharness run` (examples/aider): Chat Completions
through LiteLLM, streamed. Two runs of the hello task, one step of 2 attempts each:

- scripted: the engine replays examples/aider/script.json (the file in Aider's "whole" edit format), so
  Aider writes hello.txt itself;
- the random tiny model, greedy: it repeats one token, LiteLLM aborts the stream as a repetition loop,
  and Aider retries with back-off until it gives up (about a minute). Each aborted stream is a call the
  harness cut off: recorded with finish reason `client_cut`, its tokens trained like any other's.
"""

from pathlib import Path

import pytest
from harness_run import HARNESSES, Run, check_recorded, check_task_done, run_installed

AIDER = HARNESSES / "aider" / "bin" / "aider"
STAMP = ".cache/harnesses/aider/.installed-0.86.2"
MAX_TOKENS = 256
REPEAT_LIMIT = 20
"""LiteLLM's repetition guard (its REPEATED_STREAMING_CHUNK_LIMIT, 100 by default), lowered so that the
loop is caught well inside MAX_TOKENS whatever the chunking: at 100 a stream of 256 tokens in chunks of
one or two may end at its length before 100 chunks in a row are alike."""


@pytest.fixture(scope="module")
def scripted(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return run_installed("aider", AIDER, STAMP, tmp_path_factory)


@pytest.fixture(scope="module")
def looping(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return run_installed(
        "aider",
        AIDER,
        STAMP,
        tmp_path_factory,
        scripted=False,
        harness_env={"REPEATED_STREAMING_CHUNK_LIMIT": str(REPEAT_LIMIT)},
        training={"generation": {"maxTokens": MAX_TOKENS, "temperature": 0}},
        timeout=300,
    )


def aider_output(attempt: Path) -> str:
    return (attempt / "aider.out").read_text()


def test_aider_writes_the_file_its_reply_names(scripted: Run) -> None:
    check_recorded(scripted, "openai.chat", attempts=2)
    for attempt in scripted.attempt_dirs():
        assert "Applied edit to hello.txt" in aider_output(attempt)
        check_task_done(attempt)
    for calls in scripted.attempts().values():
        (call,) = calls
        assert call.request["stream"] is True
        assert call.finish_reason == "stop"
        assert "hello.txt" in call.request["messages"][-1]["content"]


def test_aider_stream_cut_by_litellm_is_recorded_and_trained(looping: Run) -> None:
    check_recorded(looping, "openai.chat", attempts=2)
    for attempt in looping.attempt_dirs():
        assert "The model is repeating the same chunk" in aider_output(attempt)
    for attempt_id, calls in looping.attempts().items():
        cut = [c for c in calls if c.finish_reason == "client_cut"]
        assert cut, (attempt_id, [c.finish_reason for c in calls])
        for call in cut:
            # The tokens LiteLLM was sent before it hung up, and then the engine stopped.
            assert REPEAT_LIMIT <= len(call.response_ids) < MAX_TOKENS
            assert len(set(call.response_ids[-REPEAT_LIMIT:])) == 1
    (step,) = looping.metrics
    assert step["failed_rollouts"] == 0
    assert step["samples"] == len(looping.calls)  # no call skipped, the cut ones included
    assert step["tokens"] == sum(len(c.response_ids) for c in looping.calls)
