"""The task family of the mini-SWE-agent demo: write the opposite of a word into answer.txt.

"Ticket 417: write the opposite of the word hot into answer.txt, then submit." The agent must run a
shell command that leaves `cold` in answer.txt in its own workspace; grade.py reads that file, nothing
the agent says about itself. Four words (hot, up, yes, left) and four answers (cold, down, no, right).

Why a 4M-parameter model can learn it inside an unmodified mini-SWE-agent: everything but one word of
its 1.8k-token prompt is the same in every task (the ticket number is noise it must learn to ignore),
and the answer is one of four words in a command whose shape never changes. The teacher
(`teacher_script`) is the engine's scripted mode driving the real harness: it writes a well-formed
`echo WORD > answer.txt` and then submits, but with WORD drawn from the four answers independently of
the task, each word with each answer equally often. The warm-up (`inharness sft` on those recordings)
therefore teaches the tool-call format, the file name and how to finish, and leaves a success rate of
about one in four: which answer goes with which word only the reward can teach.

The teacher's tickets (100-499) and the training tasks' (500-999) do not overlap, so the warm-up
cannot have memorised an answer per ticket.

`python examples/mini-swe-agent/family.py --write` regenerates tasks.jsonl.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TASKS_FILE = HERE / "tasks.jsonl"
OPPOSITES = {"hot": "cold", "up": "down", "yes": "no", "left": "right"}
ANSWERS = tuple(OPPOSITES.values())
ANSWER_FILE = "answer.txt"
TRAIN_TICKETS = range(500, 1000)
TEACHER_TICKETS = range(100, 500)
TRAIN_TASKS = 128
SUBMIT = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"  # mini-SWE-agent's own end-of-task marker


def task(ticket: int, word: str) -> dict[str, Any]:
    """One task: the text the agent sees, and the file and content grade.py expects (never shown to it)."""
    text = f"Ticket {ticket}: write the opposite of the word {word} into {ANSWER_FILE}, then submit."
    return {"task": text, "file": ANSWER_FILE, "content": OPPOSITES[word]}


def make_tasks(n: int, seed: int, tickets: range = TRAIN_TICKETS) -> list[dict[str, Any]]:
    """`n` tasks on distinct tickets, the words in equal shares (up to one) in a seeded order."""
    rng = random.Random(f"opposites-{seed}")
    words = [w for _ in range(n // len(OPPOSITES) + 1) for w in OPPOSITES][:n]
    rng.shuffle(words)
    return [task(t, w) for t, w in zip(rng.sample(tickets, n), words, strict=True)]


def teacher_tasks(copies: int, seed: int) -> list[dict[str, Any]]:
    """`copies` tasks per (word, answer) pair, on teacher tickets; `teacher_script` gives each task its pair's
    answer, so the recorded answers are independent of the words."""
    rng = random.Random(f"opposites-teacher-{seed}")
    pairs = [(w, a) for w in OPPOSITES for a in ANSWERS for _ in range(copies)]
    tickets = rng.sample(TEACHER_TICKETS, len(pairs))
    return [{**task(t, w), "teacher_answer": a} for t, (w, a) in zip(tickets, pairs, strict=True)]


def _bash(thought: str, command: str) -> str:
    call = json.dumps({"name": "bash", "arguments": {"command": command}})
    return f"{thought}\n<tool_call>\n{call}\n</tool_call>"


def teacher_script(tasks: list[dict[str, Any]]) -> dict[str, Any]:
    """An engine script (inharness/engine/script.py) for `teacher_tasks`: per task (matched on its text),
    write its teacher answer and show the file, then submit."""
    return {
        "scripts": [
            {
                "when": t["task"],
                "turns": [
                    _bash(
                        "I will write the answer.",
                        f"echo {t['teacher_answer']} > {ANSWER_FILE} && cat {ANSWER_FILE}",
                    ),
                    _bash("The file is written. Submitting.", f"echo {SUBMIT}"),
                ],
            }
            for t in tasks
        ]
    }


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def write_teacher(out: Path, copies: int) -> list[dict[str, Any]]:
    """`teacher_tasks` into out/teacher-tasks.jsonl, their `teacher_script` into out/teacher-script.json."""
    out.mkdir(parents=True, exist_ok=True)
    tasks = teacher_tasks(copies, seed=0)
    write_jsonl(out / "teacher-tasks.jsonl", tasks)
    (out / "teacher-script.json").write_text(json.dumps(teacher_script(tasks), indent=1))
    return tasks


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--write", action="store_true", help=f"write {TASKS_FILE.name} ({TRAIN_TASKS} tasks)")
    p.add_argument(
        "--teacher",
        type=Path,
        metavar="DIR",
        help="write teacher-tasks.jsonl and their engine script, teacher-script.json, to DIR",
    )
    p.add_argument("--copies", type=int, default=2, help="--teacher: tasks per (word, answer) pair")
    args = p.parse_args(argv)
    if args.teacher:
        tasks = write_teacher(args.teacher, args.copies)
        print(f"wrote {len(tasks)} teacher tasks and their script to {args.teacher}")
        return 0
    rows = make_tasks(TRAIN_TASKS, seed=0)
    if args.write:
        print(f"wrote {write_jsonl(TASKS_FILE, rows)}")
    else:
        print("\n".join(json.dumps(r) for r in rows[:5]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
