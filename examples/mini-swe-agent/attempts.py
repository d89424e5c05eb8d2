"""What a run's mini-SWE-agent attempts did, read from their traj.json and result.json.

    python examples/mini-swe-agent/attempts.py runs/mini-swe-agent-demo/rl [--each]

Per graded attempt: the word in its workspace, the word its first thought named ("The word is ..."), the
answer its first `echo ... > answer.txt` wrote, how many of mini's format-error turns it got, its model
calls and its reward; then the totals (docs/results.md quotes them). A run's metrics.jsonl has the
rewards; this says why an attempt failed: a wrong word named, a wrong answer, or a broken tool call.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

NAMED = re.compile(r'The word is "?(\w+)')
ANSWERED = re.compile(r"echo (\w+) > answer")


def attempt(directory: Path) -> dict[str, Any] | None:
    """One graded attempt's summary; None while it runs or when mini left no trajectory."""
    traj, result = directory / "traj.json", directory / "result.json"
    if not (traj.exists() and result.exists()):
        return None
    word_file = directory / "workspace" / "word.txt"
    out: dict[str, Any] = {
        "word": word_file.read_text().strip() if word_file.exists() else None,
        "named": None,
        "answer": None,
        "format_errors": 0,
        "calls": 0,
        "reward": json.loads(result.read_text())["reward"],
    }
    for message in json.loads(traj.read_text())["messages"][2:]:
        if message["role"] == "assistant":
            out["calls"] += 1
            named = NAMED.search(message.get("content") or "")
            if named and out["named"] is None:
                out["named"] = named.group(1)
            for call in message.get("tool_calls") or []:
                answered = ANSWERED.search(call["function"]["arguments"])
                if answered and out["answer"] is None:
                    out["answer"] = answered.group(1)
        elif message["role"] == "user" and "Tool call error" in (message.get("content") or ""):
            out["format_errors"] += 1
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run", type=Path, help="a run directory (its attempts/ folder is read)")
    p.add_argument("--each", action="store_true", help="one line per attempt too")
    args = p.parse_args(argv)
    rows = [r for d in sorted((args.run / "attempts").glob("*")) if (r := attempt(d)) is not None]
    if not rows:
        print(f"{args.run}: no graded attempt with a traj.json", file=sys.stderr)
        return 1
    if args.each:
        for r in rows:
            print(json.dumps(r))
    n = len(rows)
    named = sum(r["named"] == r["word"] for r in rows)
    broken = sum(r["format_errors"] > 0 for r in rows)
    calls = sum(r["calls"] for r in rows) / n
    reward = sum(r["reward"] for r in rows) / n
    print(
        f"{n} attempts: named the word {named}, broke a tool call {broken}, {calls:.2f} calls each, "
        f"mean reward {reward:.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
