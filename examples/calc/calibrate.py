"""Calibrate the calculator example's starting point: how good is the warmed-up tiny model, and how fast?

For each warm-up setting (K conversations, S steps, learning rate) this makes a tiny model, warms it up,
serves it with `inharness engine` + `inharness gateway` on 127.0.0.1, and runs the real harness.py as a
subprocess per attempt on M held-out tasks, at temperature 1.0 and at 0 (greedy). The warm-up's traces
pick the calculator's operator at random (tasks.py), so what RL can add is the operator: a warmed-up
model should copy the numbers and keep the format reliably (copy, fmt near 1) while choosing the
operator the question's word asks for about a third of the time (op), on rollouts cheap enough for a
2-core CPU. `--correct-operator` warms up on right traces instead, for the ceiling.

    .venv/bin/python examples/calc/calibrate.py --short-steps 150,250 --steps 20 --tasks 64

Columns: S1/S = warm-up steps without / with the tools preamble (phase 1 teaches copying cheaply on
short sequences, phase 2 the tool-call format); t1/t0 mean reward at T=1.0 / greedy; tool = attempts
whose calls were all well-formed and ran; copy = tool calls that copied the question's two numbers;
op = tool calls that also used the operator the word asks for; fmt = final answers shaped
"The answer is N."; s/roll = wall seconds per rollout (2 at a time); cpu/roll = CPU seconds per rollout
over harness, engine and gateway processes; sft = warm-up seconds. Measured on the 2-core machine
(plus/minus/times, operands <= 9, K=64, lr 1e-3, batch 8, M=64, seed 0; the S1 150 row's sft time was
taken while another job shared the CPUs):

    K      S1 + S     t1     t0     tool   copy   op     fmt    s/roll   sft
    64     150 + 20   0.30   0.44   0.84   0.91   0.43   0.73   1.09     186 s
    64     250 + 20   0.38   0.45   0.91   0.98   0.46   0.84   0.71      60 s
    1024   250 + 60   0.31   0.33   0.91   1.00   0.36   0.88   0.96      78 s

The chosen constants (tasks.py) are the last row (`calibrate.py -M 64`, idle machine; s/roll here runs
each harness without the pool's preload). With 64 traces, each seen ~30 times, op sat above the third
that uniformly random traces suggest: the model had memorised an operator per question, so the rollouts
of a group mostly agreed and GRPO had little to compare; 1024 traces bring op to about a third.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import itertools
import json
import os
import re
import resource
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inharness.gateway.client import GatewayClient
from inharness.procs import ServerProcess, free_port

HERE = Path(__file__).resolve().parent
HARNESS = HERE / "harness.py"
ADMIN = "calibrate-admin-token"
_FINAL = re.compile(r"^The answer is -?\d+(\.\d+)?\.$")
_DIGITS = re.compile(r"\d+")


def _numbers(expression: str) -> list[str]:
    return _DIGITS.findall(expression)


def _load(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"calc_{name}", HERE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TASKS = _load("tasks")


def _proc_cpu(pid: int) -> float:
    """utime+stime of a live process, from /proc (servers are not our waited-for children)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


@dataclass
class Batch:
    """Outcome of one batch of attempts at one temperature."""

    results: list[dict[str, Any]] = field(default_factory=list)
    tasks: list[dict[str, Any]] = field(default_factory=list)
    failures: int = 0
    wall: float = 0.0
    cpu: float = 0.0

    def mean(self, values: list[float]) -> float:
        return sum(values) / len(values) if values else float("nan")

    @property
    def reward(self) -> float:
        return self.mean([r["reward"] for r in self.results])

    @property
    def tool_ok(self) -> float:
        return self.mean([float(r["tool_calls"] > 0 and r["tool_errors"] == 0) for r in self.results])

    def _calls(self) -> list[tuple[str | None, str]]:
        """(expression the model passed or None if unparseable, expression the question asks for)."""
        calls = []
        for r, task in zip(self.results, self.tasks, strict=True):
            want = TASKS.intended_expression(task)
            for arguments in r["tool_arguments"]:
                try:
                    got = json.loads(arguments).get("expression")
                except (ValueError, AttributeError):
                    got = None
                calls.append((got if isinstance(got, str) else None, want))
        return calls

    @property
    def copy_ok(self) -> float:
        """Tool calls that copied the question's two numbers, in order (whatever the operator)."""
        hits = [got is not None and _numbers(got) == _numbers(want) for got, want in self._calls()]
        return self.mean([float(h) for h in hits])

    @property
    def op_ok(self) -> float:
        """Tool calls that copied the numbers and used the operator the question's word asks for."""
        return self.mean([float(got == want) for got, want in self._calls()])

    @property
    def format_ok(self) -> float:
        return self.mean([float(bool(_FINAL.match((r["answer"] or "").strip()))) for r in self.results])


async def _attempt(
    gw: GatewayClient, gateway_url: str, temperature: float, workdir: Path, batch: Batch
) -> bool:
    """Claim one attempt and run the harness on it; False when nothing is left to claim."""
    attempt = await gw.claim(lease_seconds=300)
    if attempt is None:
        return False
    result_file = workdir / f"{attempt.id}.json"
    env = {
        **os.environ,
        "OPENAI_BASE_URL": f"{gateway_url}/v1",
        "OPENAI_API_KEY": attempt.token,
        "OPENAI_MODEL": "calc-agent",
        "INHARNESS_TASK": json.dumps(attempt.task),
        "INHARNESS_RESULT_FILE": str(result_file),
        "INHARNESS_TEMPERATURE": str(temperature),
    }
    pipe, devnull = asyncio.subprocess.PIPE, asyncio.subprocess.DEVNULL
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(HARNESS), env=env, stdout=devnull, stderr=pipe
    )
    _, stderr = await proc.communicate()
    if proc.returncode != 0 or not result_file.exists():
        batch.failures += 1
        tail = stderr.decode(errors="replace").strip().splitlines()[-1:]
        await gw.complete(attempt.id, "failed", info={"error": tail})
        print(f"   harness failed ({proc.returncode}): {tail}", file=sys.stderr)
        return True
    result = json.loads(result_file.read_text())
    batch.results.append(result)
    batch.tasks.append(attempt.task)
    await gw.complete(attempt.id, "succeeded", reward=result["reward"], info=result)
    return True


async def run_batch(
    gw: GatewayClient,
    gateway_url: str,
    tasks: list[dict[str, Any]],
    temperature: float,
    *,
    parallel: int,
    servers: list[ServerProcess],
) -> Batch:
    """Run the harness once per task (`parallel` at a time) and collect its result files."""
    batch = Batch()
    await gw.create_rollouts(tasks, max_attempts=1, labels={"temperature": str(temperature)})
    pids = [s.proc.pid for s in servers if s.proc is not None]
    cpu0 = _children_cpu() + sum(_proc_cpu(p) for p in pids)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="calc-results-") as tmp:

        async def worker() -> None:
            while await _attempt(gw, gateway_url, temperature, Path(tmp), batch):
                pass

        await asyncio.gather(*(worker() for _ in range(parallel)))
    batch.wall = time.perf_counter() - t0
    batch.cpu = _children_cpu() + sum(_proc_cpu(p) for p in pids) - cpu0
    return batch


async def calibrate_one(
    args: argparse.Namespace, k: int, s1: int, s: int, lr: float, work: Path
) -> dict[str, Any]:
    """Warm up one model with (k, s1, s, lr), serve it, and measure it at T=1.0 and greedy."""
    from inharness.engine.tiny import init_tiny

    family = {"ops": args.ops, "max_operand": args.max_operand}
    run_dir = work / f"{'-'.join(args.ops)}{args.max_operand}-k{k}-s{s1}+{s}-lr{lr:g}-seed{args.seed}"
    base = init_tiny(run_dir / "tiny", seed=args.seed)
    model = run_dir / "warm"
    t0 = time.perf_counter()
    stats = TASKS.warm_up(
        base,
        model,
        conversations=k,
        short_steps=s1,
        steps=s,
        lr=lr,
        batch_size=args.batch_size,
        seed=args.seed,
        random_operator=not args.correct_operator,
        **family,
    )
    sft_time = time.perf_counter() - t0
    # Held out: a task seed the demo's tasks.jsonl (seed 0) and the warm-up stream do not use.
    held_out = TASKS.make_tasks(args.tasks, 1000 + args.seed, **family)

    eport, gport = free_port(), free_port()
    engine = ServerProcess.inharness(
        ["engine", "--model", str(model), "--port", str(eport)],
        port=eport,
        log=run_dir / "engine.log",
        health="/health",
    )
    db = run_dir / "gateway.db"
    db.unlink(missing_ok=True)
    gateway = ServerProcess.inharness(
        [
            *("gateway", "--model", str(model), "--engine", engine.url, "--store", f"sqlite:///{db}"),
            *("--port", str(gport), "--admin-token", ADMIN),
        ],
        port=gport,
        log=run_dir / "gateway.log",
        health="/healthz",
    )
    engine.start()
    try:
        gateway.start()
        async with GatewayClient(gateway.url, ADMIN, timeout=300) as gw:
            servers = [engine, gateway]
            hot = await run_batch(
                gw, gateway.url, held_out * args.samples, 1.0, parallel=args.parallel, servers=servers
            )
            greedy = await run_batch(gw, gateway.url, held_out, 0.0, parallel=args.parallel, servers=servers)
    finally:
        gateway.stop()
        engine.stop()
    rollouts = len(hot.results) + len(greedy.results) + hot.failures + greedy.failures
    return {
        "K": k,
        "S1": s1,
        "S": s,
        "lr": lr,
        "loss": stats["loss_last"],
        "t1": hot.reward,
        "t0": greedy.reward,
        "tool": hot.tool_ok,
        "copy": hot.copy_ok,
        "op": hot.op_ok,
        "fmt": hot.format_ok,
        "t0copy": greedy.copy_ok,
        "fail": hot.failures + greedy.failures,
        "s/roll": (hot.wall + greedy.wall) / max(rollouts, 1),
        "cpu/roll": (hot.cpu + greedy.cpu) / max(rollouts, 1),
        "sft": sft_time,
    }


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",")]


COLUMNS = [("K", 4, "d"), ("S1", 4, "d"), ("S", 4, "d"), ("lr", 6, "g"), ("loss", 5, ".3f")]
COLUMNS += [(key, 4, ".2f") for key in ("t1", "t0", "tool", "copy", "op", "fmt", "t0copy")]
COLUMNS += [("fail", 4, "d"), ("s/roll", 6, ".2f"), ("cpu/roll", 8, ".2f"), ("sft", 4, ".0f")]


def _row(r: dict[str, Any]) -> str:
    return "| " + " | ".join(f"{r[key]:>{width}{spec}}" for key, width, spec in COLUMNS) + " |"


def _header() -> str:
    return "| " + " | ".join(f"{key[:width]:>{width}}" for key, width, _ in COLUMNS) + " |"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--conversations", "-K", type=_ints, default=[TASKS.WARMUP_CONVERSATIONS], help="comma list"
    )
    p.add_argument(
        "--short-steps", "-S1", type=_ints, default=[TASKS.WARMUP_SHORT_STEPS], help="phase 1; comma list"
    )
    p.add_argument("--steps", "-S", type=_ints, default=[TASKS.WARMUP_STEPS], help="phase 2; comma list")
    p.add_argument("--batch-size", type=int, default=TASKS.WARMUP_BATCH_SIZE)
    p.add_argument("--lr", type=_floats, default=[TASKS.WARMUP_LR], help="comma list")
    p.add_argument("--tasks", "-M", type=int, default=64, help="held-out tasks")
    p.add_argument("--samples", type=int, default=1, help="T=1.0 attempts per held-out task")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ops", type=lambda t: tuple(t.split(",")), default=TASKS.OPS, help="comma list")
    p.add_argument(
        "--correct-operator",
        action="store_true",
        help="warm up on traces with the right operator (the copying ceiling), not the demo's random one",
    )
    p.add_argument("--max-operand", type=int, default=TASKS.MAX_OPERAND)
    p.add_argument("--parallel", type=int, default=2, help="harness subprocesses at a time")
    p.add_argument("--work", type=Path, default=Path(".calibrate"))
    args = p.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    warmup = "correct" if args.correct_operator else "random"
    print(
        f"ops {','.join(args.ops)} ({warmup} operator in the warm-up), operands <= {args.max_operand}, "
        f"M={args.tasks}, seed {args.seed}"
    )
    print(_header(), flush=True)
    for k, s1, s, lr in itertools.product(args.conversations, args.short_steps, args.steps, args.lr):
        row = asyncio.run(calibrate_one(args, k, s1, s, lr, args.work))
        print(_row(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
