"""The task family of the mini-SWE-agent demo: read a word from the workspace, write its opposite.

"Write the opposite of the word in word.txt into answer.txt, then submit." Each attempt's workspace
holds word.txt (one of hot, left, fast, dark; run.sh writes the task's `files` into it); the agent must
run shell commands that leave the opposite (cold, right, slow, light) in answer.txt. grade.py reads that file,
nothing the agent says about itself, and the expected content is never in the workspace or the prompt.

Why a 4M-parameter model can learn it inside an unmodified mini-SWE-agent: the task's text is the same
in every task, so mini's 1.8k-token prompt is too; the word arrives as the output of the agent's own
`cat word.txt`, which mini sends back as the last message, a few tokens before the model writes the
answer. The teacher (`teacher_script`) is the engine's scripted mode driving the real harness: it reads
word.txt, writes a well-formed `echo ANSWER > answer.txt` and then submits, but its ANSWER cycles through
the four answers whatever the word (a `cycle` turn of the engine's script), so each word is recorded
with each answer equally often. The warm-up (`inharness sft` on those recordings) therefore teaches the
tool-call format, reading the file, the answer file's name and how to finish, and leaves a success rate
of one in four: which answer goes with which word only the reward can teach.

What has not worked yet (docs/results.md, make demo-swe runs 2-9): with the word in the task's text
("... the opposite of the word hot ..."), ~1.7k tokens before the answer behind mini's instructions,
the warmed model named the wrong word in 9-12 of 32 samples of its own training prompts. Read from
word.txt it names `hot` every time, but confuses the other three words among themselves (`up` and `yes`
before, `left`, `fast` and `dark` now), after 200 or 400 sft steps, with tied or untied embeddings.

`python examples/mini-swe-agent/family.py --write` regenerates tasks.jsonl.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TASKS_FILE = HERE / "tasks.jsonl"
OPPOSITES = {"hot": "cold", "left": "right", "fast": "slow", "dark": "light"}
ANSWERS = tuple(OPPOSITES.values())
ANSWER_FILE = "answer.txt"
WORD_FILE = "word.txt"
TEXT = f"Write the opposite of the word in {WORD_FILE} into {ANSWER_FILE}, then submit."
SUBMIT = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"  # mini-SWE-agent's own end-of-task marker


def task(word: str) -> dict[str, Any]:
    """One task: the text the agent sees, the workspace's files (run.sh writes them), and the file and
    content grade.py expects (never shown to the agent)."""
    return {"task": TEXT, "files": {WORD_FILE: f"{word}\n"}, "file": ANSWER_FILE, "content": OPPOSITES[word]}


def make_tasks() -> list[dict[str, Any]]:
    """The four tasks, one per word: the same text, a different word.txt."""
    return [task(w) for w in OPPOSITES]


def teacher_tasks(copies: int) -> list[dict[str, Any]]:
    """`copies` rows of each task: with the recording's groups of 2 a word gets ``2 * copies`` attempts,
    so an even `copies` records each of the four answers equally often per word (`teacher_script`)."""
    return [t for _ in range(copies) for t in make_tasks()]


def _bash(thought: str, command: str) -> str:
    call = json.dumps({"name": "bash", "arguments": {"command": command}})
    return f"{thought}\n<tool_call>\n{call}\n</tool_call>"


def observation(output: str) -> str:
    """How mini's prompt shows a command's output (its tool message, JSON, as the decoded prompt holds it)."""
    return json.dumps({"returncode": 0, "output": output}, indent=2)


def teacher_script() -> dict[str, Any]:
    """An engine script (inharness/engine/script.py): read word.txt; then, per word (matched on the
    command's output in the prompt), write one of the four answers, the next in turn for each attempt of
    that word; then submit. The prompts of all tasks are the same until word.txt has been read."""
    read = _bash(f"I will read {WORD_FILE}.", f"cat {WORD_FILE}")
    per_word = [
        {
            "when": observation(f"{word}\n"),
            "turns": [
                read,
                {
                    "cycle": [
                        _bash(f'The word is "{word}".', f"echo {answer} > {ANSWER_FILE}")
                        for answer in ANSWERS
                    ]
                },
                _bash("Submitting.", f"echo {SUBMIT}"),
            ],
        }
        for word in OPPOSITES
    ]
    return {"scripts": [*per_word, {"turns": [read]}]}


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def write_teacher(out: Path, copies: int) -> list[dict[str, Any]]:
    """`teacher_tasks` into out/teacher-tasks.jsonl, `teacher_script` into out/teacher-script.json."""
    out.mkdir(parents=True, exist_ok=True)
    tasks = teacher_tasks(copies)
    write_jsonl(out / "teacher-tasks.jsonl", tasks)
    (out / "teacher-script.json").write_text(json.dumps(teacher_script(), indent=1))
    return tasks


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--write", action="store_true", help=f"write {TASKS_FILE.name} (the four tasks)")
    p.add_argument(
        "--teacher",
        type=Path,
        metavar="DIR",
        help="write teacher-tasks.jsonl and their engine script, teacher-script.json, to DIR",
    )
    p.add_argument("--copies", type=int, default=2, help="--teacher: rows per task (even: balanced answers)")
    args = p.parse_args(argv)
    if args.teacher:
        tasks = write_teacher(args.teacher, args.copies)
        print(f"wrote {len(tasks)} teacher tasks and their script to {args.teacher}")
        return 0
    rows = make_tasks()
    if args.write:
        print(f"wrote {write_jsonl(TASKS_FILE, rows)}")
    else:
        print("\n".join(json.dumps(r) for r in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
