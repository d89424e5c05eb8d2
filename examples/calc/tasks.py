"""Tasks and warm-up traces for the calculator example, and the warm-up setting the RL demo starts from.

Questions name the operation in words ("What is 7 times 5?"). The supervised warm-up teaches the format
(call the calculator on the question's numbers, then say "The answer is N.") but its traces pick the
calculator's operator at random, whatever the word: they teach how to use the tool, not what "plus",
"minus" and "times" mean. Only the grader's reward says which operator a word asks for, so a rising
reward is RL learning from the reward alone, not the warm-up replayed. Calibrated with calibrate.py.

`python examples/calc/tasks.py --write` regenerates tasks.jsonl, the demo's training tasks.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TASKS_FILE = HERE / "tasks.jsonl"

OPERATORS = {"plus": "+", "minus": "-", "times": "*"}
OPS = tuple(OPERATORS)
MAX_OPERAND = 9
TRAIN_TASKS = 256
TRAIN_SEED = 0

# The warm-up, calibrated with calibrate.py (table in its docstring). Two phases of `sft`, because at random
# init the ~175-token tools preamble the harness's chat template puts before every question drowns the few
# digits the model must copy; phase 1 trains on the traces rendered without it, phase 2 on the exact
# harness format. lr 3e-3 (sft's default) never learns to copy at all. 1024 traces, each seen about twice:
# with 64, each seen ~30 times, the model memorised an operator per question, so the four rollouts of a
# group mostly agreed and GRPO had little to compare; 60 format steps (not 20) keep the tool-call format
# through RL (sim.py: reward 0.35 -> 0.76 in 36 steps, against 0.28 -> 0.64 with 20).
WARMUP_CONVERSATIONS = 1024
WARMUP_SHORT_STEPS = 250
WARMUP_STEPS = 60
WARMUP_LR = 1e-3
WARMUP_BATCH_SIZE = 8


def _harness() -> Any:
    """harness.py, loaded by path: the SAME system prompt, tool definition and calculator it uses."""
    spec = importlib.util.spec_from_file_location("calc_harness", HERE / "harness.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _problem(rng: random.Random, ops: tuple[str, ...], max_operand: int) -> tuple[int, str, int]:
    """(a, operator word, b); "minus" keeps a >= b so answers are never negative."""
    word = rng.choice(ops)
    a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
    if word == "minus" and a < b:
        a, b = b, a
    return a, word, b


def question(a: int, word: str, b: int) -> str:
    return f"What is {a} {word} {b}?"


def intended_expression(task: dict[str, Any]) -> str:
    """The calculator expression a task's question asks for: "What is 7 times 5?" -> "7*5"."""
    a, word, b = task["question"].removeprefix("What is ").removesuffix("?").split()
    return f"{a}{OPERATORS[word]}{b}"


def make_tasks(
    n: int, seed: int, *, ops: tuple[str, ...] = OPS, max_operand: int = MAX_OPERAND
) -> list[dict[str, Any]]:
    """`n` questions like {"question": "What is 7 times 5?", "answer": "35"}; same (n, seed) -> same tasks."""
    calculator = _harness().calculator  # the answer is what the right call returns
    rng = random.Random(f"calc-tasks-{seed}")
    tasks = []
    for _ in range(n):
        a, word, b = _problem(rng, ops, max_operand)
        tasks.append({"question": question(a, word, b), "answer": calculator(f"{a}{OPERATORS[word]}{b}")})
    return tasks


def make_warmup_conversations(
    n: int,
    seed: int,
    *,
    ops: tuple[str, ...] = OPS,
    max_operand: int = MAX_OPERAND,
    tools: bool = True,
    random_operator: bool = True,
) -> list[dict[str, Any]]:
    """`n` well-formed traces in exactly the chat format the harness produces, for the supervised warm-up.

    System prompt + question, an assistant turn that only calls the calculator on the question's two
    numbers, the tool's result, and the final "The answer is <result>.". With `random_operator` (the
    demo's setting) the call's operator is drawn uniformly from `ops`, independent of the question's
    word, so a trace is consistent (its answer is what the tool said) but right only by chance; without
    it, every trace is right (calibrate.py uses that for the copying ceiling). Drawn from their own RNG
    stream, so they are not the tasks of `make_tasks` with the same seed. `tools=False` leaves out the
    tool list, so the template renders the same messages without the tools preamble (warm-up phase 1).
    """
    harness = _harness()
    rng = random.Random(f"calc-warmup-{seed}")
    conversations = []
    for _ in range(n):
        a, word, b = _problem(rng, ops, max_operand)
        symbol = OPERATORS[rng.choice(ops)] if random_operator else OPERATORS[word]
        expression = f"{a}{symbol}{b}"
        result = harness.calculator(expression)
        call = {
            "id": "call_0",
            "type": "function",
            "function": {"name": "calculator", "arguments": json.dumps({"expression": expression})},
        }
        conversations.append(
            {
                "tools": [harness.CALC_TOOL] if tools else None,
                "messages": [
                    {"role": "system", "content": harness.SYSTEM},
                    {"role": "user", "content": question(a, word, b)},
                    {"role": "assistant", "content": "", "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "call_0", "content": result},
                    {"role": "assistant", "content": f"The answer is {result}."},
                ],
            }
        )
    return conversations


def warm_up(
    model_dir: str | Path,
    out_dir: str | Path,
    *,
    conversations: int = WARMUP_CONVERSATIONS,
    short_steps: int = WARMUP_SHORT_STEPS,
    steps: int = WARMUP_STEPS,
    lr: float = WARMUP_LR,
    batch_size: int = WARMUP_BATCH_SIZE,
    seed: int = 0,
    ops: tuple[str, ...] = OPS,
    max_operand: int = MAX_OPERAND,
    random_operator: bool = True,
) -> dict[str, Any]:
    """The calibrated two-phase warm-up of `model_dir` into `out_dir`; returns the last phase's sft stats.

    Phase 1 (`short_steps`) learns to copy digits on the traces rendered without the tools preamble,
    phase 2 (`steps`) the harness's exact format; both phases see the same `conversations` traces.
    """
    from inharness.trainer.sft import sft

    family = {"ops": ops, "max_operand": max_operand, "random_operator": random_operator}
    traces = make_warmup_conversations(conversations, seed, **family)
    common = {"lr": lr, "seed": seed, "batch_size": batch_size}
    if not short_steps:
        return sft(model_dir, traces, out_dir=out_dir, steps=steps, **common)
    with tempfile.TemporaryDirectory(prefix="calc-warmup-") as tmp:
        short = make_warmup_conversations(conversations, seed, **family, tools=False)
        first = sft(model_dir, short, out_dir=tmp, steps=short_steps, **common)
        return {**sft(tmp, traces, out_dir=out_dir, steps=steps, **common), "short": first}


def write_tasks(path: Path = TASKS_FILE, n: int = TRAIN_TASKS, seed: int = TRAIN_SEED) -> Path:
    path.write_text("".join(json.dumps(t) + "\n" for t in make_tasks(n, seed)), encoding="utf-8")
    return path


def load_tasks(path: Path = TASKS_FILE) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--write", action="store_true", help=f"write {TASKS_FILE.name} ({TRAIN_TASKS} tasks)")
    p.add_argument("-n", type=int, default=5, help="without --write: print this many tasks")
    p.add_argument("--seed", type=int, default=TRAIN_SEED)
    args = p.parse_args(argv)
    if args.write:
        print(f"wrote {write_tasks(seed=args.seed)}")
        return 0
    for task in make_tasks(args.n, args.seed):
        print(json.dumps(task))
    return 0


if __name__ == "__main__":
    sys.exit(main())
