"""A small calculator agent: ask the model, run the calculator it calls, ask again, until it answers.

Plain agent code on the official `openai` client. It is configured only through the environment:
OPENAI_BASE_URL / OPENAI_API_KEY / OPENAI_MODEL say where the model is, INHARNESS_TASK holds the task JSON
({"question": ..., "answer": ...}), INHARNESS_TEMPERATURE the sampling temperature (default 1.0), and
INHARNESS_RESULT_FILE where to write the graded result. Model mistakes (a malformed tool call, bad
arguments) go back to the model as a tool error; API errors end the run with a non-zero exit status, so
that whoever started it can retry.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import operator
import os
import sys
from pathlib import Path
from typing import Any

import openai

SYSTEM = "You are a careful assistant. Use the calculator tool for arithmetic."
CALC_TOOL: dict[str, Any] = {
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
MAX_CALLS = 4
MAX_TOKENS = 48
MAX_EXPRESSION = 64  # characters; longer "expressions" are model babble, not arithmetic
MAX_REPORTED = 256  # characters per reported string: a result file may be a 4 KiB termination message

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def calculator(expression: str) -> str:
    """The tool: + - * / and unary minus on numbers, nothing else; problems come back as "error: ..."."""

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        raise ValueError(f"unsupported expression: {expression!r}")

    if len(expression) > MAX_EXPRESSION:
        return "error: expression too long"
    try:
        value = ev(ast.parse(expression.strip(), mode="eval").body)
    except (ValueError, SyntaxError, ZeroDivisionError, OverflowError) as exc:
        return f"error: {exc}"
    return str(int(value)) if float(value).is_integer() else str(round(value, 6))


def run_tool(name: str, arguments: str) -> tuple[str, bool]:
    """(tool message content, ok) for one call; whatever the model wrote, the agent keeps going."""
    if name != "calculator":
        return f"error: unknown tool {name!r}; the only tool is calculator", False
    try:
        args = json.loads(arguments)
    except ValueError:
        return "error: arguments must be a JSON object", False
    expression = args.get("expression") if isinstance(args, dict) else None
    if not isinstance(expression, str):
        return 'error: arguments must be {"expression": "<arithmetic>"}', False
    result = calculator(expression)
    return result, not result.startswith("error:")


def solve(client: openai.OpenAI, model: str, question: str, temperature: float) -> dict[str, Any]:
    """The agent loop; returns the final answer (None if the model never gave one) and what it did."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": question},
    ]
    answer: str | None = None
    arguments_seen: list[str] = []
    turns = tool_calls = tool_errors = 0
    while turns < MAX_CALLS:
        reply = client.chat.completions.create(
            model=model, messages=messages, tools=[CALC_TOOL], temperature=temperature, max_tokens=MAX_TOKENS
        )
        turns += 1
        msg = reply.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            answer = msg.content or ""
            break
        for call in msg.tool_calls:
            tool_calls += 1
            fn = getattr(call, "function", None)
            if fn is None:
                content, ok = "error: not a function call", False
            else:
                content, ok = run_tool(fn.name, fn.arguments)
                arguments_seen.append(fn.arguments)
            tool_errors += not ok
            messages.append({"role": "tool", "tool_call_id": call.id, "content": content})
    return {
        "answer": answer,
        "turns": turns,
        "tool_calls": tool_calls,
        "tool_errors": tool_errors,
        "tool_arguments": arguments_seen,
        "messages": messages,
    }


def _grader() -> Any:
    path = Path(__file__).resolve().with_name("grader.py")
    spec = importlib.util.spec_from_file_location("calc_grader", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> int:
    task = json.loads(os.environ["INHARNESS_TASK"])
    result_file = Path(os.environ["INHARNESS_RESULT_FILE"])
    temperature = float(os.environ.get("INHARNESS_TEMPERATURE", "1.0"))
    client = openai.OpenAI(max_retries=0, timeout=120)  # OPENAI_BASE_URL / OPENAI_API_KEY from the env
    try:
        run = solve(client, os.environ.get("OPENAI_MODEL", "calc-agent"), task["question"], temperature)
    except openai.OpenAIError as exc:
        print(f"calc harness: model API error: {exc}", file=sys.stderr)
        return 1
    reward = _grader().grade(task, run["answer"])
    answer = run["answer"]
    result = {
        "reward": reward,
        "answer": None if answer is None else answer[:MAX_REPORTED],
        "expected": task.get("answer"),
        "turns": run["turns"],
        "tool_calls": run["tool_calls"],
        "tool_errors": run["tool_errors"],
        "tool_arguments": [a[:MAX_REPORTED] for a in run["tool_arguments"][:MAX_CALLS]],
    }
    tmp = result_file.with_name(result_file.name + ".tmp")
    tmp.write_text(json.dumps(result), encoding="utf-8")
    tmp.replace(result_file)  # whoever reads it never sees half a file
    return 0


if __name__ == "__main__":
    sys.exit(main())
